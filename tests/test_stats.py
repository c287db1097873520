"""The round cost model in a run's stats: what a round at each depth costs, per phase."""

from __future__ import annotations

import pytest

from engine import EngineSettings


@pytest.mark.parametrize("overlap", [True, False])
def test_round_cost_by_depth_has_one_entry_per_depth_run_with_its_phase_means(tiny_engine, monkeypatch, overlap):
    """With overlap (forced here) the round after an event is already queued when the
    caller gets the event: a change made while handling event 5 applies from round 7; without, from round 6.
    Without overlap a round's phases are parts of it; with, the next round's launch is done while this
    round's event is made, so only the run's totals are bounded."""
    monkeypatch.setattr(tiny_engine, "overlap_rounds", overlap)
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
    assert cost[2]["rounds"] == (7 if overlap else 6)
    for c in cost.values():
        phases = c["draft_s"] + c["verify_s"] + c["accept_s"] + c["host_s"]
        assert phases > 0 and c["round_s"] > 0
        if not overlap:
            assert phases <= c["round_s"] * 1.01  # the phases are parts of the round
    target = tiny_engine.generate(ids, 8, EngineSettings(speculative=False)).stats["round_cost_by_depth"]
    assert set(target) == {0}  # no drafting: depth 0


def test_tokens_per_second_counts_the_engines_own_work_between_rounds_but_not_the_consumers(tiny_engine, monkeypatch):
    """tokens/s is the engine's whole decode time: the work after a round's end (its event, the run's stats)
    is counted into the next round, while the time the caller spends between two events is not the
    engine's. Here both are made 0.2 s long: the engine's shows in every round after the first, the
    consumer's in none."""
    import time

    run_stats = type(tiny_engine)._run_stats

    def slow_run_stats(self, stats):
        time.sleep(0.2)
        return run_stats(self, stats)

    monkeypatch.setattr(type(tiny_engine), "_run_stats", slow_run_stats)
    events = []
    for ev in tiny_engine.stream(list(range(3, 20)), 4, EngineSettings(speculative=False), tiny_engine.new_session()):
        events.append(ev)
        time.sleep(0.2)  # the consumer's own work
    rounds = [ev for ev in events if ev.tokens]
    assert len(rounds) == 4
    assert rounds[0].time_round_s < 0.15  # nothing before it; the consumer's sleeps are never counted
    assert all(0.2 <= ev.time_round_s < 0.35 for ev in rounds[1:]), [ev.time_round_s for ev in rounds]
    stats = rounds[-1].run
    assert stats["tokens_per_second"] == pytest.approx(4 / sum(ev.time_round_s for ev in rounds))
