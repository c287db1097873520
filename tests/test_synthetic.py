"""Synthetic acceptance (EngineSettings.synthetic_rates, issue 15): a measurement mode where the engine drafts and
verifies as usual but draws how many drafts a round accepts from per-position rates. CPU: the op's reference
(kernels.reference.synthetic_accept) and the engine on the tiny random model; the kernel is compared with it in
tests/test_kernels_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import EngineError, EngineSettings, SamplingParams
from engine import spec as spec_module
from kernels import reference as ref

N_DRAWS = 20_000


def _accept(rates, n, start, seed=3, p_min=0.0, probs=None):
    """One call of the op; returns (out list, cache_len)."""
    drafts = torch.arange(100, 100 + n)
    target = torch.arange(200, 201 + n)
    probs = torch.ones(n) if probs is None else torch.tensor(probs, dtype=torch.float32)
    out = torch.full((n + 3,), -1, dtype=torch.int64)
    cache_len = torch.tensor([start])
    ref.synthetic_accept(
        drafts,
        probs,
        target,
        p_min,
        torch.tensor(rates, dtype=torch.float32),
        torch.tensor([seed]),
        start,
        cache_len,
        out,
    )
    return out.tolist(), int(cache_len[0])


def _accepted_counts(rates, n, seed=3, draws=N_DRAWS) -> list[int]:
    return [_accept(rates, n, start, seed)[0][0] - 1 for start in range(draws)]


# ---- the op -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rates", [(0.873, 0.778, 0.675), (0.5,), (0.95, 0.2, 0.9, 0.9)])
def test_accepted_lengths_follow_the_rates(rates):
    """Over 20k rounds (start positions), P(at least i+1 drafts accepted) is the product of the first i+1 rates
    (the last rate continuing past the list), within 5 standard errors, at every one of 5 positions."""
    n = 5
    counts = _accepted_counts(rates, n)
    assert all(0 <= k <= n for k in counts)
    expected = 1.0
    for i in range(n):
        expected *= rates[min(i, len(rates) - 1)]
        seen = sum(k > i for k in counts) / N_DRAWS
        se = math.sqrt(max(expected * (1 - expected), 1e-4) / N_DRAWS)
        assert abs(seen - expected) < 5 * se, (rates, i, seen, expected)


def test_draws_are_reproducible_and_depend_on_seed_and_position():
    rates = (0.7, 0.6, 0.5)
    first = _accepted_counts(rates, 4, seed=11, draws=2000)
    assert _accepted_counts(rates, 4, seed=11, draws=2000) == first  # the same seed: the same lengths
    other = _accepted_counts(rates, 4, seed=12, draws=2000)
    assert other != first
    assert sum(a == b for a, b in zip(first, other)) < 0.6 * len(first)  # not a shifted copy either
    assert len(set(first)) == 5  # every accepted length 0..4 occurs


def test_the_emitted_tokens_are_the_accepted_drafts_then_the_targets_token():
    """The layout greedy_accept writes: [k+1, n_valid, drafts[:k]..., target[k]], cache length + k + 1."""
    for start in range(200):
        out, cache_len = _accept((0.8, 0.5), 4, start)
        k = out[0] - 1
        assert out[1] == 4
        assert out[2 : 2 + k] == list(range(100, 100 + k))
        assert out[2 + k :] == [200 + k] * (4 + 1 - k)  # the target's token at the first rejected position
        assert cache_len == start + k + 1


def test_rate_one_accepts_everything_and_rate_zero_nothing():
    for start in range(300):
        assert _accept((1.0,), 6, start)[0][0] == 7
        assert _accept((1.0, 1.0, 1.0), 6, start)[0][0] == 7  # the last rate continues
        assert _accept((0.0,), 6, start)[0][:3] == [1, 6, 200]
        assert _accept((1.0, 1.0, 0.0), 6, start)[0][0] == 3  # stops at the first rate of 0
    assert _accept((0.5,), 0, 7)[0] == [1, 0, 200]  # no drafts: the target's token


def test_p_min_cuts_the_drafts_before_the_draw():
    """Drafts after the first one below p_min are not valid: even at rate 1 they are never accepted."""
    for start in range(100):
        out, _ = _accept((1.0,), 5, start, p_min=0.5, probs=[0.9, 0.6, 0.4, 0.9, 0.9])
        assert out[:2] == [3, 2] and out[2:5] == [100, 101, 202]


def test_the_reference_never_reads_a_value_on_the_host():
    """It may run inside a captured plan on a GPU (a fallback): no item(), int(), bool(), tolist(), cpu()."""
    host_reads = {"item", "__int__", "__float__", "__bool__", "__index__", "tolist", "cpu", "numpy"}

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    n = 4
    args = (torch.arange(n), torch.ones(n), torch.arange(n + 1), 0.2, torch.tensor([0.6, 0.5]), torch.tensor([1]))
    out, cache_len = torch.zeros(n + 3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    with Reads() as reads:
        ref.synthetic_accept(*args, torch.tensor([9]), cache_len, out)
    assert reads.seen and not host_reads & set(reads.seen), reads.seen


# ---- the engine -------------------------------------------------------------------------------------------


PROMPT = "def main():"


def _target_only(eng, n):
    return eng.generate(PROMPT, n, EngineSettings(speculative=False), eng.new_session()).tokens


@pytest.mark.parametrize("chain", [True, False])
def test_rate_zero_emits_the_models_own_text(eng, chain):
    """Nothing accepted: every round emits the target's token, so the text is exactly target-only greedy."""
    settings = EngineSettings(draft_depth=3, chain=chain, synthetic_rates=(0.0,))
    out = eng.generate(PROMPT, 30, settings, eng.new_session())
    assert out.tokens == _target_only(eng, 30)
    assert out.stats["accepted"] == 0 and out.stats["drafted"] == 3 * out.stats["rounds"]
    assert out.stats["synthetic"] is True


@pytest.mark.parametrize(
    "knobs",
    [dict(chain=True), dict(chain=False), dict(chain=True, sub_vocab=64), dict(chain=False, sub_vocab=64)],
    ids=["chain", "no-chain", "chain-subvocab", "no-chain-subvocab"],
)
def test_rate_one_accepts_every_draft_and_the_state_stays_consistent(eng, knobs):
    """Every draft accepted (depth 4: 5 tokens a round), whatever the draft proposed. The target verified exactly
    those drafts, so after each rollback its state is the text's: each round's last token (the target's own)
    is the target's greedy pick after everything before it."""
    settings = EngineSettings(draft_depth=4, synthetic_rates=(1.0,), **knobs)
    sess = eng.new_session()
    events = list(eng.stream(PROMPT, 40, settings, sess))
    rounds = [ev for ev in events if ev.tokens]
    assert all(ev.synthetic for ev in events)
    assert all(ev.drafted == 4 and ev.accepted == 4 and len(ev.tokens) == 5 for ev in rounds if not ev.done)
    assert rounds[0].from_draft == [True] * 4 + [False]
    text = sess.tokens
    logits = eng.logits(text)
    pos = len(eng.tokenizer.encode(PROMPT))
    for ev in rounds:
        pos += len(ev.tokens)
        if not ev.from_draft[-1]:  # the round's own target token (absent when cut by the budget or EOS)
            assert int(logits[pos - 2].argmax()) == text[pos - 1], pos


def test_p_min_cuts_drafts_before_the_synthetic_draw(eng):
    """p_min 1.0 leaves no valid draft (no probability reaches 1 here): rate 1 accepts nothing."""
    out = eng.generate(PROMPT, 20, EngineSettings(draft_depth=3, p_min=1.0, synthetic_rates=(1.0,)), eng.new_session())
    assert out.stats["accepted"] == 0 and out.tokens == _target_only(eng, 20)


def test_the_engine_draws_the_given_rates(eng):
    """Per-round accepted counts over ~600 rounds (final rounds, cut by the budget or EOS, left out) follow the
    rates: P(at least i+1 accepted) = the product of the first i+1 rates, within 4.5 standard errors. The draws
    are keyed by the round's start position (and a fixed seed), so the runs start 200 tokens apart: no position,
    and no draw, is counted twice."""
    rates = (0.9, 0.6, 0.3)
    settings = EngineSettings(draft_depth=3, synthetic_rates=rates)
    counts = []
    for j in range(19):
        prompt = [(7 * i + j) % 300 + 1 for i in range(200 * j + 5)]
        for ev in eng.stream(prompt, 150, settings, eng.new_session()):
            if ev.tokens and not ev.done:
                assert ev.drafted == 3
                counts.append(ev.accepted)
        if len(counts) >= 600:
            break
    assert len(counts) >= 400
    expected = 1.0
    for i, rate in enumerate(rates):
        expected *= rate
        seen = sum(k > i for k in counts) / len(counts)
        assert abs(seen - expected) < 4.5 * math.sqrt(expected * (1 - expected) / len(counts)), (i, seen, expected)


def test_a_synthetic_run_is_reproducible(eng):
    settings = EngineSettings(draft_depth=3, synthetic_rates=(0.8, 0.5))
    a = eng.generate(PROMPT, 40, settings, eng.new_session())
    b = eng.generate(PROMPT, 40, settings, eng.new_session())
    assert a.tokens == b.tokens and a.stats["accepted"] == b.stats["accepted"]


def test_a_normal_run_is_not_marked_synthetic(eng):
    events = list(eng.stream(PROMPT, 12, EngineSettings(draft_depth=3), eng.new_session()))
    assert not any(ev.synthetic for ev in events) and events[-1].run["synthetic"] is False


def test_one_host_read_per_synthetic_round(eng, monkeypatch):
    """Every round reads its result once (engine.spec.allowed_sync, the window the GPU test's sync guard lets
    through): synthetic rounds, chained or not, add no read."""
    entered = []
    real = spec_module.allowed_sync

    def counting(device):
        entered.append(device)
        return real(device)

    monkeypatch.setattr(spec_module, "allowed_sync", counting)
    for chain in (True, False):
        entered.clear()
        events = list(eng.stream(PROMPT, 30, EngineSettings(draft_depth=4, chain=chain, synthetic_rates=(0.7,))))
        rounds = [ev for ev in events if ev.tokens]
        assert len(entered) == len(rounds) > 3


def test_sampling_with_synthetic_rates_is_refused(eng):
    settings = EngineSettings(synthetic_rates=(0.8,))
    with pytest.raises(EngineError, match="greedy rounds only; set the temperature to 0"):
        eng.generate(PROMPT, 8, settings, eng.new_session(), sampling=SamplingParams(temperature=0.7))
    # temperature 0 is greedy: allowed
    eng.generate(PROMPT, 8, settings, eng.new_session(), sampling=SamplingParams(temperature=0.0))


def test_sampling_refused_when_rates_arrive_mid_run(eng):
    """Settings may change between rounds (from another thread): the round checks too, before touching state."""
    sess = eng.new_session()
    stream = eng.stream(PROMPT, 40, EngineSettings(draft_depth=2), sess, sampling=SamplingParams(temperature=0.7))
    next(stream)
    sess.settings = EngineSettings(draft_depth=2, synthetic_rates=(0.5,))
    with pytest.raises(EngineError, match="greedy rounds only"):
        next(stream)


# ---- the setting ------------------------------------------------------------------------------------------


def test_the_setting_validates_each_rate():
    assert EngineSettings().synthetic_rates == () and not EngineSettings().synthetic
    s = EngineSettings(synthetic_rates=[0.87, 1, 0])  # a list (as a profile file gives it) becomes a tuple
    assert s.synthetic_rates == (0.87, 1.0, 0.0) and s.synthetic
    assert [s.synthetic_rate(i) for i in range(5)] == [0.87, 1.0, 0.0, 0.0, 0.0]
    for bad, message in [
        ((0.5, 1.2), r"synthetic_rates\[1\] must be a number in 0..1, got 1.2"),
        ((-0.1,), r"synthetic_rates\[0\]"),
        ((float("nan"),), r"synthetic_rates\[0\]"),
        ((True,), r"synthetic_rates\[0\]"),
        (("0.5",), r"synthetic_rates\[0\]"),
        ("0.5", "must be a list of numbers"),
        ((0.5,) * 17, "at most 16"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineSettings(synthetic_rates=bad)


def test_the_setting_is_not_a_knob():
    """No knob flag, no knob control, no plot marker, no tune cell: knobs() leaves it out."""
    from engine.settings import knobs

    assert "synthetic_rates" not in {k.name for k in knobs()}
    hash(EngineSettings(synthetic_rates=(0.5,)))  # still a settings value (sets, dict keys, plan pools)


def test_a_huge_or_not_a_number_rate_is_a_clear_error_naming_the_field():
    """A profile or flag can carry any number: float() of a huge integer would raise OverflowError, not the
    one-line message naming the field."""
    for bad, field in (((10**400,), "synthetic_rates[0]"), ((0.5, float("nan")), "synthetic_rates[1]")):
        with pytest.raises(ValueError, match=rf"{field.replace('[', '.').replace(']', '.')} must be a number in 0..1"):
            EngineSettings(synthetic_rates=bad)
    with pytest.raises(ValueError, match="p_min must be a number in 0..1"):
        EngineSettings(p_min=10**400)
