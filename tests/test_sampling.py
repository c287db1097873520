"""Sampling: SamplingParams, the processing and draw ops, and speculative sampling that keeps the target's
distribution (CPU; the CUDA kernels are compared with these references in tests/test_kernels_gpu.py).

The statistical tests use Pearson's chi-square goodness of fit against the EXACT distribution of the first K
tokens (computed from the target's processed distributions), cells with an expected count below 5 pooled,
at significance level ALPHA = 0.001 per test. Every random stream is seeded, so each outcome is fixed (no
flakiness); a deliberately wrong acceptance rule must fail the same test.
"""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from engine import Engine, EngineError, EngineSettings, SamplingParams
from kernels import reference as ref

ALPHA = 0.001


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The chi-square critical value at level alpha (Wilson-Hilferty, no scipy needed; within 1.2% of the exact value for
    df >= 5: 37.84 vs 37.70 for df 15, 159.22 vs 159.16 for df 108)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---- SamplingParams ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1000.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_p": 2}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_round_trip_and_defaults():
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=7)
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    assert sp.replace(seed=8).seed == 8
    assert SamplingParams(temperature=0).greedy and not sp.greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    with pytest.raises(ValueError, match="warmth"):
        SamplingParams.from_dict({"warmth": 1})


# ---- the ops ------------------------------------------------------------------------------------------------
def test_rng_is_deterministic_uniform_and_keyed():
    seed = torch.tensor([12345])
    u = ref.rng_uniform(seed, 77, torch.arange(200_000), ref.RNG_DRAFT)
    assert torch.equal(u, ref.rng_uniform(seed, torch.tensor([77]), torch.arange(200_000), ref.RNG_DRAFT))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2_critical(19)
    others = [
        ref.rng_uniform(torch.tensor([12346]), 77, torch.arange(1000), ref.RNG_DRAFT),
        ref.rng_uniform(seed, 78, torch.arange(1000), ref.RNG_DRAFT),
        ref.rng_uniform(seed, 77, torch.arange(1000), ref.RNG_ACCEPT),
    ]
    for o in others:
        assert (o != u[:1000]).float().mean() > 0.99
        assert abs(float(torch.corrcoef(torch.stack((o, u[:1000])))[0, 1])) < 0.15


def test_sample_probs_semantics():
    lg = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, 3.0]])
    p = ref.sample_probs(lg, 0, 1.0, 0, 1.0, 0.0)
    torch.testing.assert_close(p, torch.softmax(lg, -1))
    torch.testing.assert_close(ref.sample_probs(lg, 0, 0.5, 0, 1.0, 0.0), torch.softmax(lg / 0.5, -1))
    # top-k: ties at the k-th value are kept
    assert (ref.sample_probs(lg, 0, 1.0, 3, 1.0, 0.0)[0] > 0).tolist() == [True, True, True, False, False, True]
    assert (ref.sample_probs(lg, 0, 1.0, 2, 1.0, 0.0)[0] > 0).tolist() == [True, False, False, False, False, True]
    # top-p: the smallest set of most likely ids reaching top_p
    sm = torch.softmax(lg, -1)[0]
    top2 = float(sm[5] + sm[0])
    assert (ref.sample_probs(lg, 0, 1.0, 0, top2 - 1e-4, 0.0)[0] > 0).sum() == 2
    assert (ref.sample_probs(lg, 0, 1.0, 0, top2 + 1e-4, 0.0)[0] > 0).sum() == 4  # the tie joins as a whole
    # min-p: relative to the most likely id
    kept = ref.sample_probs(lg, 0, 1.0, 0, 1.0, 0.3)[0] > 0
    assert kept.tolist() == (sm >= 0.3 * sm.max()).tolist()
    # the first n ids only; always normalised
    sub = ref.sample_probs(lg, 4, 1.0, 0, 1.0, 0.0)
    assert sub.shape == (1, 4)
    torch.testing.assert_close(sub, torch.softmax(lg[:, :4], -1))
    many = ref.sample_probs(torch.randn(50, 300) * 3, 0, 0.8, 40, 0.9, 0.02)
    torch.testing.assert_close(many.sum(-1), torch.ones(50))


def test_inverse_cdf_never_draws_zero_weight():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.9999999, 1.0 - 2**-24])
    assert ref._inverse_cdf(w, u).tolist() == [1, 1, 3, 3, 3]


def test_spec_accept_op_equals_the_batched_rule():
    """The op (device buffers, hashed uniforms) is the batched rule with B = 1 and the op's uniforms."""
    g = torch.Generator().manual_seed(0)
    seed = torch.tensor([99])
    for n, vq, p_min in [(0, 16, 0.0), (1, 16, 0.0), (3, 16, 0.0), (4, 8, 0.0), (4, 16, 0.2)]:
        p = torch.softmax(torch.randn(n + 1, 16, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(n, vq, generator=g) * 2, -1)
        drafts, qx = ref.sample_token(q, seed, 40, 0, ref.RNG_DRAFT)
        out = torch.full((n + 3,), -1, dtype=torch.long)
        cache_len = torch.tensor([40])
        ref.spec_accept(drafts, qx, q, p, p_min, seed, torch.tensor([40]), cache_len, out)
        n_valid = 0
        while n_valid < n and float(qx[n_valid]) >= p_min:
            n_valid += 1
        slots = torch.arange(n + 1)
        k, tok = ref.speculative_accept_rows(
            drafts[None],
            q[None],
            p[None],
            torch.tensor([n_valid]),
            ref.rng_uniform(seed, 40, slots[:n], ref.RNG_ACCEPT)[None],
            ref.rng_uniform(seed, 40, slots, ref.RNG_RESAMPLE)[None],
        )
        k = int(k)
        assert out[:2].tolist() == [k + 1, n_valid]
        assert out[2 : 3 + k].tolist() == [*drafts[:k].tolist(), int(tok)]
        assert int(cache_len) == 40 + k + 1


# ---- the statistical test of the acceptance rule (synthetic Markov chains, batched) ---------------------------
V, K, SAMPLES = 5, 3, 20_000


def _chains(sub: int):
    """A target and a draft Markov chain over V ids (row = previous id); the draft differs from the target a
    lot and, with sub > 0, puts mass only on the first `sub` ids (zero elsewhere), like a sub-vocab draft."""
    g = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.2, -1)
    logits = torch.randn(V, V, generator=g) * 1.5
    if sub:
        logits[:, sub:] = float("-inf")
    return target, torch.softmax(logits, -1)


def _simulate(target, draft, depth: int, rule: str, seed: int) -> torch.Tensor:
    """SAMPLES independent generations of K tokens by speculative sampling, in lock-step rounds: draft `depth`
    tokens from the draft chain, verify with the target rows of the drafted context, accept/resample."""
    g = torch.Generator().manual_seed(seed)
    b = SAMPLES
    out = torch.full((b, K), -1, dtype=torch.long)
    count = torch.zeros(b, dtype=torch.long)
    last = torch.zeros(b, dtype=torch.long)
    rows = torch.arange(b)[:, None].expand(b, depth + 1)
    while bool((count < K).any()):
        drafts, prev = [], last
        for _ in range(depth):
            prev = torch.multinomial(draft[prev], 1, generator=g)[:, 0]
            drafts.append(prev)
        d = torch.stack(drafts, 1) if depth else torch.zeros(b, 0, dtype=torch.long)
        ctx = torch.cat((last[:, None], d), 1)
        q_rows, p_rows = draft[ctx[:, :depth]], target[ctx]
        u_acc = torch.rand(b, depth, generator=g)
        u_res = torch.rand(b, depth + 1, generator=g)
        n_valid = torch.full((b,), depth)
        k, tok = ref.speculative_accept_rows(d, q_rows, p_rows, n_valid, u_acc, u_res, rule)
        j = torch.arange(depth + 1)
        emitted = torch.where(j[None] < k[:, None], torch.cat((d, tok[:, None]), 1), tok[:, None])
        pos = count[:, None] + j[None]
        keep = (j[None] <= k[:, None]) & (pos < K)
        out[rows[keep], pos[keep]] = emitted[keep]
        count += k + 1
        last = tok
    return out


def _chi_square(observed: dict, expected_p: dict, n: int) -> tuple[float, float, int]:
    """Pearson's statistic over the cells (expected counts < 5 pooled), its critical value at ALPHA, and df."""
    exp, obs = [], []
    pool_e = pool_o = 0.0
    for cell, p in expected_p.items():
        e = p * n
        if e < 5:
            pool_e += e
            pool_o += observed.get(cell, 0)
        else:
            exp.append(e)
            obs.append(observed.get(cell, 0))
    outside = n - sum(observed.get(c, 0) for c in expected_p)  # sequences the target cannot produce
    pool_o += outside
    if pool_e > 0 or pool_o > 0:
        exp.append(max(pool_e, 1e-9))
        obs.append(pool_o)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    return stat, chi2_critical(df), df


def _markov_exact(target) -> dict:
    probs = {}
    for seq in itertools.product(range(V), repeat=K):
        p, prev = 1.0, 0
        for x in seq:
            p *= float(target[prev, x])
            prev = x
        probs[seq] = p
    return probs


def _counts(seqs: torch.Tensor) -> dict:
    keys, counts = torch.unique(seqs, dim=0, return_counts=True)
    return {tuple(k.tolist()): int(c) for k, c in zip(keys, counts)}


@pytest.mark.parametrize("sub", [0, 3])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_speculative_rule_keeps_the_target_distribution(depth, sub):
    """20,000 generations of K=3 tokens over V=5 ids (125 cells): speculative sampling's joint distribution
    equals the target chain's (chi-square at ALPHA); accept-always and resample-from-p fail the same test."""
    target, draft = _chains(sub)
    exact = _markov_exact(target)
    stat, crit, df = _chi_square(_counts(_simulate(target, draft, depth, "exact", seed=depth)), exact, SAMPLES)
    print(f"chi-square {stat:.1f} < {crit:.1f} (df {df}, alpha {ALPHA})", end="")
    assert stat < crit, (depth, sub, stat, crit, df)
    for wrong in ("accept_always", "residual_p"):
        bad, crit_bad, _ = _chi_square(_counts(_simulate(target, draft, depth, wrong, seed=depth)), exact, SAMPLES)
        print(f"; {wrong}: {bad:.1f}", end="")
        assert bad > crit_bad, (wrong, depth, sub, bad, crit_bad)


def _hashed_uniform(seeds: torch.Tensor, pos: torch.Tensor, slot: int, purpose: int) -> torch.Tensor:
    """ref.rng_uniform for a batch of (seed, position) pairs: the engine's keying, one seed per sample."""
    m = 0xFFFFFFFF
    h = ref._mix32((seeds & m) ^ 0x9E3779B9)
    h = ref._mix32(h ^ ((seeds >> 32) & m))
    h = ref._mix32(h ^ (pos & m))
    h = ref._mix32(h ^ ((slot * 8 + purpose) & m))
    return (h >> 8).float() * (2.0**-24)


def test_speculative_rule_with_the_engines_random_numbers():
    """The same test with the engine's counter-based numbers instead of torch.rand: sample b has seed b, each
    round is keyed by its start position, drafts / acceptance tests / resamples by slot and purpose (as in
    spec.py): the hash's streams are independent enough to keep the distribution (20,000 samples, depth 3)."""
    target, draft = _chains(3)
    depth, b = 3, SAMPLES
    seeds = torch.arange(b) + 1000
    assert torch.equal(
        _hashed_uniform(seeds[:3], torch.full((3,), 17), 2, ref.RNG_ACCEPT),
        torch.cat([ref.rng_uniform(seeds[i : i + 1], 17, torch.tensor([2]), ref.RNG_ACCEPT) for i in range(3)]),
    )
    out = torch.full((b, K), -1, dtype=torch.long)
    count = torch.zeros(b, dtype=torch.long)
    last = torch.zeros(b, dtype=torch.long)
    rows = torch.arange(b)[:, None].expand(b, depth + 1)
    while bool((count < K).any()):
        pos = count + 5  # the round's start position (prompt of 5 + tokens so far): unique per round
        drafts, prev = [], last
        for j in range(depth):
            prev = ref._inverse_cdf(draft[prev], _hashed_uniform(seeds, pos, j, ref.RNG_DRAFT))
            drafts.append(prev)
        d = torch.stack(drafts, 1)
        ctx = torch.cat((last[:, None], d), 1)
        u_acc = torch.stack([_hashed_uniform(seeds, pos, j, ref.RNG_ACCEPT) for j in range(depth)], 1)
        u_res = torch.stack([_hashed_uniform(seeds, pos, j, ref.RNG_RESAMPLE) for j in range(depth + 1)], 1)
        k, tok = ref.speculative_accept_rows(
            d, draft[ctx[:, :depth]], target[ctx], torch.full((b,), depth), u_acc, u_res
        )
        j = torch.arange(depth + 1)
        emitted = torch.where(j[None] < k[:, None], torch.cat((d, tok[:, None]), 1), tok[:, None])
        at = count[:, None] + j[None]
        keep = (j[None] <= k[:, None]) & (at < K)
        out[rows[keep], at[keep]] = emitted[keep]
        count += k + 1
        last = tok
    stat, crit, df = _chi_square(_counts(out), _markov_exact(target), SAMPLES)
    print(f"chi-square {stat:.1f} < {crit:.1f} (df {df}, alpha {ALPHA})", end="")
    assert stat < crit


def test_plain_sampling_keeps_the_target_distribution():
    target, draft = _chains(0)
    stat, crit, _ = _chi_square(_counts(_simulate(target, draft, 0, "exact", seed=5)), _markov_exact(target), SAMPLES)
    assert stat < crit


# ---- the engine ---------------------------------------------------------------------------------------------
PROMPT = "def main():"


@pytest.fixture(scope="module")
def eng(tiny_model_dir) -> Engine:
    eng = Engine.load(tiny_model_dir)
    eng.tokenizer.eos_token_ids = frozenset()  # hot sampling draws id 0 (the EOS) now and then: never stop
    return eng


def test_temperature_zero_is_the_greedy_path(eng):
    ids = eng.tokenizer.encode(PROMPT)
    greedy = eng.generate(ids, 16, EngineSettings(speculative=False), eng.new_session()).tokens
    for settings in (EngineSettings(speculative=False), EngineSettings(draft_depth=3), EngineSettings(chain=False)):
        for sampling in (None, SamplingParams(temperature=0.0, top_k=3, seed=5)):
            sess = eng.new_session()
            assert eng.generate(ids, 16, settings, sess, sampling=sampling).tokens == greedy
            assert getattr(sess.state, "sampling_buffers", None) is None  # the greedy path never touched them


@pytest.mark.parametrize(
    "settings",
    [
        EngineSettings(speculative=False),
        EngineSettings(draft_depth=3),
        EngineSettings(draft_depth=4, chain=False),
        EngineSettings(draft_depth=2, sub_vocab=64),
        EngineSettings(draft_depth=3, p_min=0.2),
    ],
)
def test_same_seed_same_text(eng, settings):
    sp = SamplingParams(temperature=4.0, top_p=0.95, seed=11)
    a = eng.generate(PROMPT, 24, settings, eng.new_session(), sampling=sp).tokens
    b = eng.generate(PROMPT, 24, settings, eng.new_session(), sampling=sp).tokens
    c = eng.generate(PROMPT, 24, settings, eng.new_session(), sampling=sp.replace(seed=12)).tokens
    sess = eng.new_session()
    eng.generate("something else entirely", 8, settings, sess, sampling=sp)  # a session reused: same text
    d = eng.generate(PROMPT, 24, settings, sess, sampling=sp).tokens
    assert a == b == d
    assert a != c
    assert len(a) == 24


def test_chain_on_and_off_draw_the_same_drafts(eng):
    """The host (chain off) draws with the numbers the device would: same drafts, so the same text."""
    sp = SamplingParams(temperature=3.0, top_k=8, seed=4)
    on = eng.generate(PROMPT, 24, EngineSettings(draft_depth=3), eng.new_session(), sampling=sp).tokens
    off = eng.generate(PROMPT, 24, EngineSettings(draft_depth=3, chain=False), eng.new_session(), sampling=sp)
    assert on == off.tokens


def test_sampling_argument_is_checked(eng):
    with pytest.raises(EngineError, match="SamplingParams"):
        eng.generate(PROMPT, 4, sampling={"temperature": 1.0})


# End to end on the tiny model: the first 2 tokens. The tiny model's random MTP head agrees with its target only
# where both are broad, so the sampling is hot (temperature 5, top-p 0.9: ~30% of drafts accepted) and the
# pair (x1, x2) is reduced to (group of x1, group of x2 given x1), each distribution's support cut into 4
# groups of about equal mass: 16 cells whose exact probabilities come from the target's logits. A drafter
# that proposes the target's greedy continuation (all mass on one token: q one-hot) covers long accepted runs.
E2E_SAMPLING = SamplingParams(temperature=5.0, top_p=0.9)
E2E_SAMPLES = 400


def _groups(p: torch.Tensor) -> dict[int, int]:
    """id -> group 0..3 for the support of p: sorted by probability, cut at cumulative mass 1/4, 1/2, 3/4."""
    p = p.cpu()
    order = torch.argsort(p, descending=True, stable=True)
    out, mass = {}, 0.0
    for i in order.tolist():
        if p[i] <= 0:
            break
        out[i] = min(3, int(mass * 4))
        mass += float(p[i])
    return out


def _process(eng, ids, sp):
    return ref.sample_probs(eng.logits(ids)[-1:], 0, sp.temperature, sp.top_k, sp.top_p, sp.min_p)[0]


@pytest.fixture(scope="module")
def e2e_exact(eng):
    return e2e_cells(eng)


def e2e_cells(eng):
    """(prompt ids, exact cell probabilities, the map from a token pair to its cell)."""
    ids = eng.tokenizer.encode(PROMPT)
    first = _process(eng, ids, E2E_SAMPLING).cpu()
    g1 = _groups(first)
    cells: dict = {}
    g2 = {}
    for x, a in g1.items():
        second = _process(eng, [*ids, x], E2E_SAMPLING).cpu()
        g2[x] = _groups(second)
        for y, b in g2[x].items():
            cells[(a, b)] = cells.get((a, b), 0.0) + float(first[x]) * float(second[y])
    return ids, cells, lambda x, y: (g1.get(x, -1), g2.get(x, {}).get(y, -1))


def _greedy_drafter(eng):
    memo: dict = {}
    sess = eng.new_session()

    def draft(tokens, depth):
        key = (tuple(tokens), depth)
        if key not in memo:
            memo[key] = eng.generate(tokens, depth, EngineSettings(speculative=False), sess).tokens
        return memo[key]

    return draft


@pytest.mark.parametrize(
    "settings, drafter",
    [
        (EngineSettings(speculative=False), False),
        (EngineSettings(draft_depth=2), False),
        (EngineSettings(draft_depth=3, chain=False), False),
        (EngineSettings(draft_depth=4, sub_vocab=160), False),
        (EngineSettings(draft_depth=3), True),
    ],
    ids=["plain", "depth2-chain", "depth3-host", "depth4-sub160", "depth3-one-hot-drafter"],
)
def test_engine_first_two_tokens_keep_the_target_distribution(eng, e2e_exact, settings, drafter):
    ids, exact, cell_of = e2e_exact
    sess = eng.new_session()
    if drafter:
        sess.test_drafter = _greedy_drafter(eng)
    seen: dict = {}
    accepted = 0
    for seed in range(E2E_SAMPLES):
        res = eng.generate(ids, 2, settings, sess, sampling=E2E_SAMPLING.replace(seed=seed))
        cell = cell_of(*res.tokens)
        seen[cell] = seen.get(cell, 0) + 1
        accepted += res.stats["accepted"]
    stat, crit, df = _chi_square(seen, exact, E2E_SAMPLES)
    print(f"chi-square {stat:.1f} < {crit:.1f} (df {df}, alpha {ALPHA}); {accepted} drafts accepted")
    assert stat < crit, (stat, crit, df, seen)
    if settings.speculative:
        assert accepted > E2E_SAMPLES // 10  # the accept path ran, not only rejections


@pytest.fixture(scope="module")
def eng_ordered(tiny_model_dir) -> Engine:
    """The same model drafting its sub-vocabulary through an order far from id order (engine/subvocab.py)."""
    ordered = Engine.load(tiny_model_dir)
    ordered.tokenizer.eos_token_ids = frozenset()
    ordered.set_sub_vocab_order(torch.randperm(320, generator=torch.Generator().manual_seed(9))[:200].tolist())
    return ordered


@pytest.mark.parametrize(
    "settings", [EngineSettings(draft_depth=4, sub_vocab=160), EngineSettings(draft_depth=2, sub_vocab=200)]
)
def test_engine_with_a_sub_vocab_order_keeps_the_target_distribution(eng_ordered, e2e_exact, settings):
    """Drafts drawn over the order's columns, mapped to token ids, their q rows scattered to token-id columns
    for the verify: the first two tokens still follow the target's distribution."""
    ids, exact, cell_of = e2e_exact
    sess = eng_ordered.new_session()
    seen: dict = {}
    accepted = remapped = 0
    for seed in range(E2E_SAMPLES):
        res = eng_ordered.generate(ids, 2, settings, sess, sampling=E2E_SAMPLING.replace(seed=seed))
        cell = cell_of(*res.tokens)
        seen[cell] = seen.get(cell, 0) + 1
        accepted += res.stats["accepted"]
        remapped += res.stats["remap_rounds"]
    stat, crit, df = _chi_square(seen, exact, E2E_SAMPLES)
    print(f"chi-square {stat:.1f} < {crit:.1f} (df {df}, alpha {ALPHA}); {accepted} drafts accepted")
    assert stat < crit, (stat, crit, df, seen)
    assert accepted > E2E_SAMPLES // 10 and remapped >= E2E_SAMPLES


def test_tensor_parallel_draws_the_same_tokens(tiny_model_dir, eng):
    """The draws depend only on the logits, the seed and the position: a model split over two (virtual)
    devices, LM head mirrored or sliced by vocabulary (gathered for sampling), draws the same tokens."""
    tp = Engine.load(tiny_model_dir, devices=["cpu", "cpu"])  # rank 1 in a worker process
    sp = SamplingParams(temperature=4.0, top_p=0.95, seed=3)
    try:
        for settings in (
            EngineSettings(draft_depth=3),
            EngineSettings(draft_depth=3, mirror_output=False),
            EngineSettings(draft_depth=2, chain=False, mirror_output=False),
            EngineSettings(speculative=False),
        ):
            want = eng.generate(PROMPT, 24, settings, eng.new_session(), sampling=sp).tokens
            assert tp.generate(PROMPT, 24, settings, tp.new_session(), sampling=sp).tokens == want, settings
    finally:
        tp.close()


# ---- CLI, profiles, bench arms ----------------------------------------------------------------------------------
def test_cli_generate_samples_reproducibly(tiny_model_dir, capsys):
    import json

    from app.cli import main

    args = ["generate", "--model", str(tiny_model_dir), "--prompt", PROMPT, "-n", "12", "--json"]
    hot = ["--temperature", "4", "--top-p", "0.95", "--top-k", "50", "--min-p", "0.01", "--seed", "9"]
    runs = []
    for extra in (hot, hot, [*hot[:-1], "10"], []):
        assert main([*args, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1] != runs[2]
    greedy = Engine.load(tiny_model_dir).generate(PROMPT, 12, EngineSettings()).tokens
    assert runs[3] == greedy  # no --temperature: greedy


def test_cli_bad_sampling_flag_is_one_line(tiny_model_dir, capsys):
    from app.cli import main

    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdeck: error: top_p") and err.count("\n") == 1


def test_cli_bench_arm_differs_in_sampling(tiny_model_dir, tmp_path, capsys):
    import json

    from app.cli import main

    js = tmp_path / "r.json"
    args = ["bench", "--model", str(tiny_model_dir), "--rounds", "1", "-n", "6", "--workloads", "prose,code_gen"]
    assert main([*args, "--vs", "temperature=0.8,seed=3,depth=4", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "sampled arms" in out and "outputs identical across arms" in out
    report = json.loads(js.read_text())
    assert "sampling" not in report["arms"][0]
    assert report["arms"][1]["sampling"] == SamplingParams(temperature=0.8, seed=3).to_dict()
    assert report["arms"][1]["settings"]["draft_depth"] == 4
    with pytest.raises(ValueError, match="temperature"):
        from app.cli import parse_arm_sampling

        parse_arm_sampling("temperature=hot", None)


def test_profile_sampling_part(tmp_path, monkeypatch):
    from app import profiles as P

    monkeypatch.setenv(P.CONFIG_DIR_ENV, str(tmp_path / "config"))
    store = P.ProfileStore(shipped_dir=None)
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3)
    saved = store.save(P.Profile(name="warm", settings=EngineSettings(draft_depth=5), sampling=sp))
    back = store.get("warm")
    assert back.sampling == sp and back.settings.draft_depth == 5
    assert "[sampling]" in saved.path.read_text()
    store.save(P.Profile(name="cold", settings=EngineSettings()))
    assert store.get("cold").sampling is None and "[sampling]" not in store.get("cold").path.read_text()
    from app.cli import parse_arm_sampling

    assert parse_arm_sampling(str(saved.path), None) == sp
    good = P.Profile(name="x", settings=EngineSettings(), sampling=sp).to_toml_dict()
    for change, message in [
        ({"top_p": 2.0}, "sampling.top_p"),
        ({"warmth": 1}, "sampling.warmth"),
    ]:
        data = {**good, "sampling": {**good["sampling"], **change}}
        with pytest.raises(P.ProfileError, match=message):
            P.parse_profile(data, "f.toml")
    data = {**good, "sampling": {k: v for k, v in good["sampling"].items() if k != "seed"}}
    with pytest.raises(P.ProfileError, match="missing sampling setting.*sampling.seed"):
        P.parse_profile(data, "f.toml")


def test_sampling_buffers_are_counted_in_memory(tiny_model_dir):
    eng = Engine.load(tiny_model_dir)
    sess = eng.new_session()
    before = eng.memory()["workspace"]
    eng.generate(PROMPT, 4, EngineSettings(), sess, sampling=SamplingParams(seed=1))
    q_bytes = sess.state.sampling_buffers.q_buf.numel() * 4
    assert eng.memory()["workspace"] >= before + q_bytes
