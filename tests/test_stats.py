"""The round cost model in a run's stats: what a round at each depth costs, per phase."""

from __future__ import annotations

from engine import EngineSettings


def test_round_cost_by_depth_has_one_entry_per_depth_run_with_its_phase_means(tiny_engine):
    sess = tiny_engine.new_session(EngineSettings(draft_depth=2, chain=True))
    ids = list(range(3, 40))
    stats = {}
    for i, ev in enumerate(tiny_engine.stream(ids, 60, session=sess)):
        if i == 5:
            sess.settings = EngineSettings(draft_depth=5, chain=True)  # the depth changes mid-run
        stats = ev.run
    cost = stats["round_cost_by_depth"]
    assert set(cost) == {2, 5}
    assert sum(c["rounds"] for c in cost.values()) == stats["rounds"]
    assert cost[2]["rounds"] == 6
    for c in cost.values():
        phases = c["draft_s"] + c["verify_s"] + c["accept_s"] + c["host_s"]
        assert 0 < phases <= c["round_s"] * 1.01  # the phases are parts of the round
    target = tiny_engine.generate(ids, 8, EngineSettings(speculative=False)).stats["round_cost_by_depth"]
    assert set(target) == {0}  # no drafting: depth 0
