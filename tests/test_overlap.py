"""Overlapped rounds (Engine.overlap_rounds; on by default on a GPU, off on the CPU): rank 0 queues round
k+1 on the device before it makes round k's event and hands it over. The text must be exactly what it is
without overlap, a cancel or a change of settings made while handling an event applies one round later (the
round already queued is emitted as usual), and a stream dropped with a round queued leaves the session as if
that round had never run. Forced on here, on the CPU, where the order of the host's work is the same as on a
GPU."""

from __future__ import annotations

import pytest

from engine import EngineSettings, SamplingParams

PROMPT = list(range(3, 40))


@pytest.fixture
def overlapped(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "overlap_rounds", True)
    return tiny_engine


def _greedy(eng, prompt, n):
    eng.overlap_rounds = False
    try:
        return eng.generate(prompt, n, EngineSettings(speculative=False), eng.new_session()).tokens
    finally:
        eng.overlap_rounds = True


@pytest.mark.parametrize(
    "settings,sampling",
    [
        (EngineSettings(speculative=False), None),
        (EngineSettings(draft_depth=3, chain=True), None),
        (EngineSettings(draft_depth=4, chain=False, p_min=0.2), None),
        (EngineSettings(draft_depth="auto", max_draft_depth=4), None),
        (EngineSettings(draft_depth=3, chain=True), SamplingParams(temperature=0.8, seed=3)),
    ],
    ids=["target", "chain", "host-draft", "auto", "sampled"],
)
def test_overlapped_rounds_give_the_same_tokens(overlapped, tiny_engine, settings, sampling):
    tiny_engine.overlap_rounds = False
    want = tiny_engine.generate(PROMPT, 40, settings, tiny_engine.new_session(), sampling=sampling).tokens
    tiny_engine.overlap_rounds = True
    sess = overlapped.new_session()
    got = overlapped.generate(PROMPT, 40, settings, sess, sampling=sampling)
    assert got.tokens == want
    assert len(got.tokens) == 40 and got.stats["generated"] == 40  # no round queued past the budget
    assert sess.tokens == PROMPT + want


def _cancel_at_third_event(eng, sess) -> list:
    """The events of a 30-token target-only stream whose third event's handler cancels the session."""
    events = []
    for ev in eng.stream(PROMPT, 30, EngineSettings(speculative=False), sess):
        events.append(ev)
        if len(events) == 3:
            sess.cancel()
    return events


def test_a_cancel_while_handling_an_event_stops_after_the_round_already_queued(overlapped):
    want = _greedy(overlapped, PROMPT, 30)
    sess = overlapped.new_session()
    events = _cancel_at_third_event(overlapped, sess)
    rounds = [ev for ev in events if ev.tokens]
    assert len(rounds) == 4  # the three seen, then the one queued when the cancel came
    assert events[-1].stop_reason == "cancelled" and not events[-1].tokens
    out = [t for ev in rounds for t in ev.tokens]
    assert out == want[: len(out)]
    assert sess.tokens == PROMPT + out  # what was handed over is what the session holds


@pytest.mark.parametrize("depth", [0, 3])
def test_a_stream_dropped_with_a_round_queued_leaves_the_session_as_handed_over(overlapped, depth):
    settings = EngineSettings(speculative=depth > 0, draft_depth=max(depth, 1), chain=True)
    want = _greedy(overlapped, PROMPT, 40)
    sess = overlapped.new_session()
    it = overlapped.stream(PROMPT, 40, settings, sess)
    seen = []
    for _ in range(4):
        seen += next(it).tokens
    it.close()  # round 5 was queued: it must not reach the session
    assert sess.tokens == PROMPT + seen
    # the session continues from what it holds, exactly as plain greedy decoding does
    more = overlapped.generate(sess.tokens, 40 - len(seen), settings, sess).tokens
    assert seen + more == want


def test_the_overlapped_run_counts_every_token_and_round_once(overlapped):
    res = overlapped.generate(PROMPT, 25, EngineSettings(draft_depth=2, chain=True), overlapped.new_session())
    s = res.stats
    assert s["generated"] == 25 == len(res.tokens)
    assert s["rounds"] == sum(c["rounds"] for c in s["round_cost_by_depth"].values())
    assert s["tokens_per_second"] > 0


def test_a_round_that_cannot_be_queued_fails_after_the_event_before_it(overlapped):
    """Settings that do not fit the model (a sub-vocab larger than its vocabulary) set while handling an
    event: the round already queued is handed over, then the run stops with the one clear error, and the
    session holds exactly what was handed over."""
    from engine import EngineError

    sess = overlapped.new_session()
    seen = []
    with pytest.raises(EngineError, match="sub_vocab"):
        for ev in overlapped.stream(PROMPT, 30, EngineSettings(speculative=False), sess):
            seen.append(ev)
            if len(seen) == 2:
                sess.settings = EngineSettings(draft_depth=2, sub_vocab=10**6)
    assert len(seen) == 3  # the round queued before the change came out first
    assert sess.tokens == PROMPT + [t for ev in seen for t in ev.tokens]


def test_by_default_overlap_is_on_for_a_gpu_only(tiny_engine):
    """The default (None) overlaps on a GPU; on the CPU, where a round's work is done when it is queued, a cancel
    made while handling an event stops the run right there, with no round queued ahead."""
    assert tiny_engine.overlap_rounds is None and tiny_engine.model.device.type == "cpu"
    events = _cancel_at_third_event(tiny_engine, tiny_engine.new_session())
    assert len([ev for ev in events if ev.tokens]) == 3
    assert events[-1].stop_reason == "cancelled"


# ---- pipelined rounds: a target-only round queued behind the one before it, its input taken on the device ----
# On the bundled model, whose greedy text varies from token to token (the random tiny model repeats its last
# token, so a round fed a stale token or position would go unseen there).


@pytest.fixture(scope="module")
def bundled():
    from engine import Engine

    eng = Engine.load()  # no model given: the bundled one
    eng.overlap_rounds = True
    return eng


@pytest.fixture(scope="module")
def code(bundled):
    return bundled.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n")


def _plain(eng, prompt, n, settings=None, sampling=None):
    eng.overlap_rounds = False
    try:
        settings = settings or EngineSettings(speculative=False)
        return eng.generate(prompt, n, settings, eng.new_session(), sampling=sampling)
    finally:
        eng.overlap_rounds = True


def test_target_only_rounds_are_pipelined_and_give_greedy_tokens(bundled, code):
    """Past the first, every target-only round is queued before the one ahead of it is read (its token and
    position come from that round's results on the device): the same tokens as plain greedy decoding."""
    want = _plain(bundled, code, 30).tokens
    assert len(set(want)) > 5  # a text whose next token depends on the last
    sess = bundled.new_session()
    events = list(bundled.stream(code, 30, EngineSettings(speculative=False), sess))
    assert [t for ev in events for t in ev.tokens] == want
    assert [ev.pipelined for ev in events] == [False] + [True] * 29
    assert events[-1].run["pipelined_rounds"] == 29 and events[-1].run["generated"] == 30
    assert sess.tokens == code + want


def test_a_pipelined_round_advances_inside_its_plan_where_the_pool_holds_the_plans(bundled, code):
    """The plans a pipelined target-only run asks for: its first round's verify plan, then one "behind" plan per host
    buffer (the input's advance and the copy of the results inside it); a pool of fewer than three plans keeps the
    one verify plan, the advance launched outside it, so that no plan is captured again every round. Greedy tokens
    either way."""
    want = _plain(bundled, code, 12).tokens
    for pool, behind in ((8, True), (2, False)):
        sess = bundled.new_session()
        keys = []
        run = sess.plans.run

        def record(key, capacity, work, run=run, keys=keys):
            keys.append(key)
            return run(key, capacity, work)

        sess.plans.run = record
        out = bundled.generate(code, 12, EngineSettings(speculative=False, plan_pool=pool), sess)
        assert out.tokens == want and out.stats["pipelined_rounds"] == 11
        verify = [k for k in keys if k[0] == "verify"]
        assert len(verify) == 12 and "behind" not in verify[0]
        tails = {k[-2:] for k in verify[1:]}
        assert tails == ({("behind", 0), ("behind", 1)} if behind else {verify[0][-2:]}), (pool, tails)


def test_without_overlap_no_round_is_pipelined(bundled, code):
    assert _plain(bundled, code, 12).stats["pipelined_rounds"] == 0


def test_an_end_of_text_drops_the_round_pipelined_behind_it(bundled, code, monkeypatch):
    """The round queued behind the one that emits an end-of-text token never reaches the session: the run stops
    at the EOS, and the session then continues exactly as greedy decoding does (the dropped round's cache
    entries and recurrent planes are not taken for positions it no longer holds)."""
    want = _plain(bundled, code, 40).tokens
    eos = want[9]
    first = want.index(eos)
    monkeypatch.setattr(bundled.tokenizer, "eos_token_ids", frozenset({eos}))
    sess = bundled.new_session()
    res = bundled.generate(code, 40, EngineSettings(speculative=False), sess)
    assert res.tokens == want[: first + 1] and res.stats["stop_reason"] == "eos"
    assert res.stats["generated"] == first + 1 == res.stats["rounds"]
    assert sess.tokens == code + want[: first + 1]
    monkeypatch.setattr(bundled.tokenizer, "eos_token_ids", frozenset())
    more = bundled.generate(sess.tokens, 40 - first - 1, EngineSettings(speculative=False), sess).tokens
    assert want[: first + 1] + more == want


def test_a_stream_dropped_with_a_pipelined_round_queued_leaves_the_session_as_handed_over(bundled, code):
    want = _plain(bundled, code, 30).tokens
    sess = bundled.new_session()
    it = bundled.stream(code, 30, EngineSettings(speculative=False), sess)
    seen = [t for _ in range(6) for t in next(it).tokens]
    it.close()  # round 7 was queued behind round 6: it must not reach the session
    assert sess.tokens == code + seen
    assert seen + bundled.generate(sess.tokens, 24, EngineSettings(speculative=False), sess).tokens == want


def test_switching_to_speculative_keeps_greedy_tokens_and_pipelines_again_from_its_second_round(bundled, code):
    """A change to speculative settings made while handling an event: the round already queued (pipelined) is
    emitted, the first speculative round is queued once the round before is read (a target-only round leaves the
    draft head's rows to catch up from the host), the ones after it are pipelined again, and the text is still
    greedy's."""
    want = _plain(bundled, code, 40).tokens
    sess = bundled.new_session()
    events = []
    for ev in bundled.stream(code, 40, EngineSettings(speculative=False), sess):
        events.append(ev)
        if len(events) == 4:
            sess.settings = EngineSettings(draft_depth=3, chain=True)
    assert [t for ev in events for t in ev.tokens] == want
    assert [ev.pipelined for ev in events[:5]] == [False, True, True, True, True]
    assert events[5].depth == 3 and not events[5].pipelined
    assert events[6].pipelined and events[-1].run["pipelined_rounds"] >= len(events) - 4
    assert sess.tokens == code + want


def test_sampled_target_only_rounds_are_pipelined_and_draw_the_same_tokens(bundled, code):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    want = _plain(bundled, code, 30, sampling=sampling)
    got = bundled.generate(code, 30, EngineSettings(speculative=False), bundled.new_session(), sampling=sampling)
    assert got.tokens == want.tokens and len(set(want.tokens)) > 5
    assert got.stats["pipelined_rounds"] == 29 and want.stats["pipelined_rounds"] == 0


def test_pipelining_can_be_turned_off_keeping_the_overlap(bundled, code, monkeypatch):
    """Engine.pipeline_rounds False: rounds still queued ahead after each read (overlap), none pipelined; the
    same tokens either way."""
    monkeypatch.setattr(bundled, "pipeline_rounds", False)
    res = bundled.generate(code, 20, EngineSettings(speculative=False), bundled.new_session())
    assert res.stats["pipelined_rounds"] == 0 and res.tokens == _plain(bundled, code, 20).tokens


# ---- pipelined speculative rounds (Engine.pipeline_rounds None, the default, or "all"): a chained-draft round
# queued behind the one before it, its position, MTP rows and their tokens taken from that round's acceptance on
# the device ----


@pytest.fixture
def pipelined_all(bundled, monkeypatch):
    monkeypatch.setattr(bundled, "pipeline_rounds", "all")
    return bundled


@pytest.mark.parametrize("depth", [1, 3, 5, 8])
def test_speculative_rounds_pipelined_give_greedy_tokens(pipelined_all, code, depth):
    settings = EngineSettings(draft_depth=depth, chain=True)
    want = _plain(pipelined_all, code, 60).tokens
    unpipelined = _plain(pipelined_all, code, 60, settings)
    sess = pipelined_all.new_session()
    events = list(pipelined_all.stream(code, 60, settings, sess))
    assert [t for ev in events for t in ev.tokens] == want == unpipelined.tokens
    # the same drafts round by round as drafted from the host's staging (a wrong MTP input would only lose speed)
    assert events[-1].run["accepted"] == unpipelined.stats["accepted"] > 0
    assert events[-1].run["per_position_acceptance"] == unpipelined.stats["per_position_acceptance"]
    pipelined = [ev.pipelined for ev in events]
    assert not pipelined[0] and all(pipelined[1:-3])  # past the first, all but the budget's last few
    assert events[-1].run["generated"] == 60 and sess.tokens == code + want


def test_speculative_rounds_are_pipelined_by_default_and_target_keeps_it_to_target_only(bundled, code, monkeypatch):
    settings = EngineSettings(draft_depth=3, chain=True)
    assert bundled.pipeline_rounds is None
    res = bundled.generate(code, 40, settings, bundled.new_session())
    assert res.stats["pipelined_rounds"] >= res.stats["rounds"] - 4 > 0
    monkeypatch.setattr(bundled, "pipeline_rounds", "target")
    only = bundled.generate(code, 40, settings, bundled.new_session())
    assert only.stats["pipelined_rounds"] == 0 and only.tokens == res.tokens
    target = bundled.generate(code, 20, EngineSettings(speculative=False), bundled.new_session())
    assert target.stats["pipelined_rounds"] == 19


def _cut_at_each_and_continue(eng, monkeypatch, prompt, settings, want, cuts, before=None):
    """For each cut, an end of text at want[cut]'s token: the run stops at its first place in want, and the session
    then continues exactly as greedy decoding (want: the greedy tokens; `before()`: called before each run)."""
    n = len(want)
    for cut in cuts:
        eos = want[cut]
        first = want.index(eos)
        monkeypatch.setattr(eng.tokenizer, "eos_token_ids", frozenset({eos}))  # the module's engine: undone after
        if before is not None:
            before()
        sess = eng.new_session()
        res = eng.generate(prompt, n, settings, sess)
        assert res.tokens == want[: first + 1] and res.stats["stop_reason"] == "eos", cut
        monkeypatch.setattr(eng.tokenizer, "eos_token_ids", frozenset())
        more = eng.generate(sess.tokens, n - first - 1, settings, sess).tokens
        assert want[: first + 1] + more == want, cut


@pytest.mark.parametrize("depth", [8, 16])
def test_an_end_of_text_inside_a_pipelined_speculative_round_leaves_a_session_that_continues_greedily(
    pipelined_all, code, monkeypatch, depth
):
    """The round queued behind the one whose acceptance holds an end of text ran from the position the device
    gave it, past the host's cut: dropped, its recurrent planes unmarked, and where it overwrote the plane of
    the position the host keeps, the target is fed again from the latest intact one. At every cut position and
    at depths 8 and the deepest, 16 (whose planes wrap past the kept one: 18 planes for 17 verify rows), the session
    then continues exactly as greedy decoding."""
    from engine import spec

    settings = EngineSettings(draft_depth=depth, chain=True)
    want = _plain(pipelined_all, code, 48).tokens
    fed_again = []
    real_prefill = spec.prefill
    monkeypatch.setattr(spec, "prefill", lambda *a, **kw: fed_again.append(1) or real_prefill(*a, **kw))
    _cut_at_each_and_continue(pipelined_all, monkeypatch, code, settings, want, range(4, 30))
    assert bool(fed_again) == (depth == 16)  # at 16 a cut overwrote the kept position's plane: the recovery ran


def test_a_stream_dropped_with_a_pipelined_speculative_round_queued(pipelined_all, code):
    settings = EngineSettings(draft_depth=4, chain=True)
    want = _plain(pipelined_all, code, 50).tokens
    sess = pipelined_all.new_session()
    it = pipelined_all.stream(code, 50, settings, sess)
    seen = []
    for _ in range(4):
        ev = next(it)
        seen += ev.tokens
    assert ev.pipelined
    it.close()
    assert sess.tokens == code + seen
    assert seen + pipelined_all.generate(sess.tokens, 50 - len(seen), settings, sess).tokens == want


def test_settings_changed_mid_run_keep_greedy_tokens(pipelined_all, code):
    want = _plain(pipelined_all, code, 60).tokens
    sess = pipelined_all.new_session()
    events = []
    for ev in pipelined_all.stream(code, 60, EngineSettings(draft_depth=3, chain=True), sess):
        events.append(ev)
        if len(events) == 3:
            sess.settings = EngineSettings(draft_depth=5, chain=True)
        if len(events) == 8:
            sess.settings = EngineSettings(speculative=False)
    assert [t for ev in events for t in ev.tokens] == want
    assert events[4].depth == 5 and events[4].pipelined  # a new depth, queued behind the round of the old one
    target = next(i for i, ev in enumerate(events) if ev.depth == 0)
    assert not events[target].pipelined and events[target + 1].pipelined  # target-only: from the host, then on
    assert sess.tokens == code + want


@pytest.mark.parametrize(
    "depth,sub_vocab,sampling",
    [
        (1, 0, SamplingParams(temperature=0.8, seed=5)),
        (3, 0, SamplingParams(temperature=0.8, seed=5)),
        (6, 0, SamplingParams(temperature=1.0, top_p=0.9, seed=2)),
        (4, 4096, SamplingParams(temperature=0.7, top_k=20, seed=9)),
    ],
)
def test_sampled_speculative_rounds_pipelined_draw_as_without(pipelined_all, code, depth, sub_vocab, sampling):
    """A sampled chained round's draws are keyed by the seed and its start position, both on the device: queued
    behind the round ahead, it draws the same drafts, acceptances and tokens as from the host's staging."""
    spec = EngineSettings(draft_depth=depth, chain=True, sub_vocab=sub_vocab)
    want = _plain(pipelined_all, code, 60, spec, sampling)
    got = pipelined_all.generate(code, 60, spec, pipelined_all.new_session(), sampling=sampling)
    assert got.tokens == want.tokens and len(set(want.tokens)) > 5
    assert got.stats["per_position_acceptance"] == want.stats["per_position_acceptance"]
    assert got.stats["accepted"] == want.stats["accepted"] > 0
    assert got.stats["pipelined_rounds"] >= got.stats["rounds"] - 4 > 0


def test_an_end_of_text_inside_a_pipelined_sampled_round(pipelined_all, code, monkeypatch):
    """The round queued behind a sampled round cut at an end of text is dropped; the session then continues
    drawing exactly as an unpipelined session cut at the same token (every draw is keyed by the seed and the
    round's start position, so a cut moves the rounds after it: the uncut run is not the reference)."""
    spec = EngineSettings(draft_depth=4, chain=True)
    sampling = SamplingParams(temperature=0.8, seed=7)
    whole = _plain(pipelined_all, code, 48, spec, sampling).tokens

    def cut_and_continue(eos):
        monkeypatch.setattr(pipelined_all.tokenizer, "eos_token_ids", frozenset({eos}))
        sess = pipelined_all.new_session()
        res = pipelined_all.generate(code, 48, spec, sess, sampling=sampling)
        monkeypatch.setattr(pipelined_all.tokenizer, "eos_token_ids", frozenset())
        more = pipelined_all.generate(sess.tokens, 48 - len(res.tokens), spec, sess, sampling=sampling)
        return res, more

    dropped = 0  # cuts whose round was pipelined behind another
    for cut in range(3, 30, 2):
        eos = whole[cut]
        pipelined_all.overlap_rounds = False
        want, want_more = cut_and_continue(eos)
        pipelined_all.overlap_rounds = True
        got, more = cut_and_continue(eos)
        assert got.tokens == want.tokens == whole[: whole.index(eos) + 1] and got.stats["stop_reason"] == "eos", cut
        assert more.tokens == want_more.tokens and len(more.tokens) == 48 - len(got.tokens), cut
        dropped += got.stats["pipelined_rounds"] > 0
    assert dropped >= 8


def test_adaptive_depth_is_pipelined_and_gives_greedy_tokens(pipelined_all, code):
    """An adaptive depth chooses each round's depth before the round ahead of it is read (from the rounds before
    that one); rounds of a new depth are queued behind the old one's like any other."""
    auto = EngineSettings(draft_depth="auto", max_draft_depth=6, chain=True)
    sess = pipelined_all.new_session()
    events = list(pipelined_all.stream(code, 80, auto, sess))
    assert [t for ev in events for t in ev.tokens] == _plain(pipelined_all, code, 80).tokens
    depths = [ev.depth for ev in events]
    changes = [i for i in range(1, len(events)) if depths[i] != depths[i - 1]]
    assert len(set(depths)) >= 3 and any(events[i].pipelined for i in changes)  # its sweep of the depths
    assert events[-1].run["pipelined_rounds"] >= len(events) // 2


# A depth for every round, shallower and deeper by turns (up to the deepest: planes wrap past the kept position)
DEPTHS = (3, 5, 2, 8, 1, 4, 4, 7, 16, 2, 6, 1, 16, 16, 9, 3)


@pytest.fixture
def depth_pattern(force_depths):
    """Adaptive rounds whose depths are DEPTHS in turn (conftest's force_depths)."""
    return force_depths(DEPTHS)


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, seed=4)], ids=["greedy", "sampled"])
def test_pipelined_rounds_of_changing_depths_draft_and_accept_as_unpipelined_ones(
    pipelined_all, code, depth_pattern, sampling
):
    auto = EngineSettings(draft_depth="auto", max_draft_depth=16, chain=True)
    want = _plain(pipelined_all, code, 160, sampling=sampling).tokens
    depth_pattern.clear()
    unpipelined = _plain(pipelined_all, code, 160, auto, sampling)
    depth_pattern.clear()
    sess = pipelined_all.new_session()
    events = list(pipelined_all.stream(code, 160, auto, sess, sampling=sampling))
    assert [t for ev in events for t in ev.tokens] == unpipelined.tokens
    if sampling is None:
        assert unpipelined.tokens == want
    assert [ev.depth for ev in events] == [DEPTHS[i % len(DEPTHS)] for i in range(len(events))]
    assert len(events) > len(DEPTHS)
    # the same drafts round by round as from the host's staging: a wrong MTP row or token would only lose speed
    assert events[-1].run["per_position_acceptance"] == unpipelined.stats["per_position_acceptance"]
    assert events[-1].run["accepted"] == unpipelined.stats["accepted"] > 0
    # every round after the first pipelined, up or down in depth, where the budget cannot cut the round ahead
    left = [160 - sum(len(ev.tokens) for ev in events[:i]) for i in range(len(events))]
    assert [ev.pipelined for ev in events[1:]] == [left[i] > events[i].depth + 1 for i in range(len(events) - 1)]
    assert sum(ev.pipelined for ev in events) >= len(events) - 6
    assert sess.tokens == code + unpipelined.tokens


def test_an_end_of_text_inside_pipelined_rounds_of_changing_depths(pipelined_all, code, monkeypatch, depth_pattern):
    """An end of text at every cut position while the depth changes round by round: the round queued behind the
    cut one is dropped whatever its depth, and the session then continues exactly as greedy decoding."""
    auto = EngineSettings(draft_depth="auto", max_draft_depth=16, chain=True)
    want = _plain(pipelined_all, code, 60).tokens
    _cut_at_each_and_continue(pipelined_all, monkeypatch, code, auto, want, range(3, 40), before=depth_pattern.clear)


def test_synthetic_acceptance_pipelined_draws_as_without(pipelined_all, code):
    settings = EngineSettings(draft_depth=3, chain=True, synthetic_rates=(0.8, 0.6, 0.4))
    want = _plain(pipelined_all, code, 40, settings)
    got = pipelined_all.generate(code, 40, settings, pipelined_all.new_session())
    assert got.tokens == want.tokens and got.stats["accepted"] == want.stats["accepted"]
    assert got.stats["pipelined_rounds"] > 0
