"""Sampling on the GPU: the CUDA kernels (kernels/cuda_src/sampling_kernels.cu) against their references, graph
capture with a device-side position, no host sync inside the ops, and the engine's sampled rounds (graphs equal
eager, one host sync per round, reproducible, the target's distribution kept).

Marked `gpu`: skipped without CUDA; run on the device machine.

Tolerances: processed probabilities fp32 (rtol 1e-4, atol 1e-6) with the kept/cut mask equal on all but
boundary elements (the kernel and torch round sums in different orders, so a value sitting on a top-p / min-p
threshold may fall either way: at most 1 element in 10,000); draws from identical inputs equal in all but
at most 1% of rows (a uniform landing within rounding of a running-sum boundary).
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import chi2_critical

from app.workloads import load_workloads
from engine import Engine, EngineSettings, SamplingParams
from kernels import reference as ref

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ALPHA = 0.001


@pytest.fixture(scope="module")
def kc():
    import kernels.cuda as kc

    ok, why = kc.available()
    if not ok:
        pytest.skip(f"CUDA kernels unavailable: {why}")
    ok, why = kc.sampling_kernels()
    assert ok, why  # the sampling module must compile and load wherever the decode kernels do
    return kc


PARAMS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (0.7, 40, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (0.6, 20, 0.95, 0.05),
    (1.3, 0, 1.0, 0.1),
    (1.0, 1, 1.0, 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [320, 16384, 248320])
@pytest.mark.parametrize("n_frac", [0, 0.25])
@pytest.mark.parametrize("params", PARAMS)
def test_sample_probs(kc, dtype, vocab, n_frac, params):
    torch.manual_seed(vocab)
    lg = (torch.randn(5, vocab, device=CUDA) * 4).to(dtype)
    n = int(vocab * n_frac)
    got = kc.sample_probs(lg, n, *params)
    want = ref.sample_probs(lg, n, *params)
    assert got.shape == want.shape and got.dtype == torch.float32
    mask_diff = ((got > 0) != (want > 0)).sum().item()
    assert mask_diff <= max(1, got.numel() // 10_000), mask_diff
    if mask_diff == 0:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(5, device=CUDA), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [7, 320, 16384, 248320])
@pytest.mark.parametrize("tensor_start", [False, True])
def test_sample_token(kc, vocab, tensor_start):
    torch.manual_seed(vocab + 1)
    probs = ref.sample_probs(torch.randn(200, vocab, device=CUDA) * 3, 0, 1.0, 0, 0.95, 0.0)
    seed = torch.tensor([1234], device=CUDA)
    start = torch.tensor([77], device=CUDA) if tensor_start else 77
    tok, prob = kc.sample_token(probs, seed, start, 3, ref.RNG_DRAFT)
    rt, rp = ref.sample_token(probs, seed, start, 3, ref.RNG_DRAFT)
    assert tok.dtype == torch.int64 and prob.dtype == torch.float32
    assert (tok != rt).sum().item() <= 2
    assert bool((probs.gather(1, tok[:, None]) > 0).all())  # never a token of probability 0
    same = tok == rt
    torch.testing.assert_close(prob[same], rp[same])


def test_spec_accept_matches_reference(kc):
    g = torch.Generator(device=CUDA).manual_seed(0)
    seed = torch.tensor([99], device=CUDA)
    cases = mismatches = 0
    for vocab in (16, 320, 16384):
        for n in (0, 1, 2, 3, 5, 8):
            for vq in {vocab, max(1, vocab // 2)}:
                for p_min in (0.0, 0.3):
                    for s in range(4):
                        temp = 1.0 + s
                        p = torch.softmax(torch.randn(n + 1, vocab, device=CUDA, generator=g) / temp, -1)
                        q = torch.softmax(torch.randn(n, vq, device=CUDA, generator=g) / temp, -1)
                        start = torch.tensor([100 + s], device=CUDA)
                        drafts, qx = ref.sample_token(q, seed, start, 0, ref.RNG_DRAFT)
                        outs = []
                        for impl in (ref.spec_accept, kc.spec_accept):
                            out = torch.full((n + 3,), -7, dtype=torch.int64, device=CUDA)
                            cache_len = torch.tensor([40], device=CUDA)
                            impl(drafts, qx, q, p, p_min, seed, start, cache_len, out)
                            e = int(out[0])
                            outs.append((out[: 2 + e].tolist(), int(cache_len)))
                        cases += 1
                        mismatches += outs[0] != outs[1]
    assert mismatches <= cases // 100, (mismatches, cases)


def test_spec_accept_kernel_keeps_the_target_distribution(kc):
    """20,000 single rounds through the kernels only (drafts drawn by sample_token, accepted by spec_accept,
    each round at its own position): the first emitted token is distributed as p_0 (chi-square at ALPHA)."""
    vocab, n, rounds = 12, 3, 20_000
    g = torch.Generator(device=CUDA).manual_seed(1)
    p = torch.softmax(torch.randn(n + 1, vocab, device=CUDA, generator=g) * 1.2, -1)
    q = torch.softmax(torch.randn(n, vocab, device=CUDA, generator=g) * 1.5, -1)
    q[:, 8:] = 0  # a sub-vocabulary draft
    q = q / q.sum(-1, keepdim=True)
    seed = torch.tensor([5], device=CUDA)
    starts = torch.arange(rounds, device=CUDA)
    outs = torch.zeros(rounds, n + 3, dtype=torch.int64, device=CUDA)
    cache_len = torch.zeros(1, dtype=torch.int64, device=CUDA)
    ones = torch.ones(n, device=CUDA)
    for i in range(rounds):
        # q rows do not depend on the drafts here: a context-free draft, so p_0 is the exact answer
        tok = torch.cat([kc.sample_token(q[j : j + 1], seed, starts[i : i + 1], j, ref.RNG_DRAFT)[0] for j in range(n)])
        kc.spec_accept(tok, ones, q, p, 0.0, seed, starts[i : i + 1], cache_len, outs[i])
    first = outs[:, 2].cpu()
    counts = torch.bincount(first, minlength=vocab).double()
    expected = p[0].double().cpu() * rounds
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(vocab - 1), stat
    assert 0 < float((outs[:, 0] > 1).double().mean()) < 1  # both accepted and rejected rounds happened


def test_graph_capture_replays_with_new_positions(kc):
    """sample_probs -> sample_token -> spec_accept captured once; each replay at a new device-side position
    draws new numbers, equal to the eager kernels at that position."""
    torch.manual_seed(3)
    vocab, n = 4096, 3
    lg_q = torch.randn(n, vocab, device=CUDA) * 2
    lg_p = torch.randn(n + 1, vocab, device=CUDA) * 2
    seed = torch.tensor([42], device=CUDA)
    start = torch.zeros(1, dtype=torch.int64, device=CUDA)
    out = torch.zeros(n + 3, dtype=torch.int64, device=CUDA)
    cache_len = torch.zeros(1, dtype=torch.int64, device=CUDA)

    def step():
        q = kc.sample_probs(lg_q, 0, 0.8, 50, 0.95, 0.0)
        tok, qx = kc.sample_token(q, seed, start, 0, ref.RNG_DRAFT)
        p = kc.sample_probs(lg_p, 0, 0.8, 50, 0.95, 0.0)
        kc.spec_accept(tok, qx, q, p, 0.0, seed, start, cache_len, out)
        return tok

    kc.warm_up(CUDA, torch.float32)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok_g = step()
    seen = set()
    for s in (0, 5, 17, 1000):
        start.fill_(s)
        cache_len.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        got = (tok_g.tolist(), out.tolist(), int(cache_len))
        start.fill_(s)
        cache_len.fill_(s)
        tok_e = step()
        torch.cuda.synchronize()
        assert got == (tok_e.tolist(), out.tolist(), int(cache_len))
        seen.add(tuple(got[0]))
    assert len(seen) > 1  # new positions, new draws


def test_sampling_ops_never_sync(kc):
    kc.warm_up(CUDA, torch.float32)
    lg = torch.randn(4, 16384, device=CUDA)
    seed = torch.tensor([1], device=CUDA)
    start = torch.tensor([9], device=CUDA)
    out = torch.zeros(6, dtype=torch.int64, device=CUDA)
    cache_len = torch.zeros(1, dtype=torch.int64, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for params in PARAMS:
            q = kc.sample_probs(lg[:3], 0, *params)
            tok, qx = kc.sample_token(q, seed, start, 0, ref.RNG_DRAFT)
            kc.spec_accept(tok, qx, q, kc.sample_probs(lg, 0, *params), 0.2, seed, start, cache_len, out)
            kc.sample_probs(lg.bfloat16(), 100, *params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# ---- the engine on the GPU ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    out = {"tiny": Engine.load(tiny_model_dir, device="cuda", dtype="float32")}
    try:
        from engine import bundled_model_dir

        out["bundled"] = Engine.load(bundled_model_dir(), device="cuda", dtype="float32")
    except Exception:
        pass
    return out


def test_temperature_zero_is_greedy_on_gpu(engines):
    eng = engines.get("bundled", engines["tiny"])
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    ref_tokens = eng.generate(prompt, 40, EngineSettings(speculative=False), eng.new_session()).tokens
    for settings in (EngineSettings(draft_depth=5), EngineSettings(draft_depth=3, chain=False)):
        got = eng.generate(prompt, 40, settings, eng.new_session(), sampling=SamplingParams(temperature=0)).tokens
        assert got == ref_tokens


@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_sampled_graphs_equal_eager_and_rerun(engines, which):
    if which not in engines:
        pytest.skip("no bundled model")
    eng = engines[which]
    prompt = load_workloads()["prose"].prompt_for(eng.tokenizer)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    for depth, chain, sub in ((3, True, 0), (5, True, 0), (4, False, 0), (3, True, eng.cfg.vocab_size // 4)):
        base = EngineSettings(draft_depth=depth, chain=chain, sub_vocab=sub)
        eager = eng.generate(prompt, 48, base.replace(plan_pool=0), eng.new_session(), sampling=sp).tokens
        graphs = eng.generate(prompt, 48, base.replace(plan_pool=8), eng.new_session(), sampling=sp).tokens
        again = eng.generate(prompt, 48, base.replace(plan_pool=8), eng.new_session(), sampling=sp).tokens
        assert eager == graphs == again, (which, depth, chain, sub)
    plain = eng.generate(prompt, 48, EngineSettings(speculative=False), eng.new_session(), sampling=sp).tokens
    assert len(plain) == 48


def test_one_host_sync_per_sampled_round(engines):
    eng = engines.get("bundled", engines["tiny"])
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    settings = EngineSettings(draft_depth=4, chain=True, plan_pool=16)
    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=1)
    sess = eng.new_session()
    eng.generate(prompt, 48, settings, sess, sampling=sp.replace(seed=100))  # another seed: the same plans
    sess.reset()
    eng.generate(prompt, 48, settings, sess, sampling=sp)  # the run below, exactly: every plan it needs
    sess.reset()
    rounds = misses = 0
    stream = eng.stream(prompt, 48, settings, sess, sampling=sp)
    next(stream)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ev in stream:
            rounds += 1
            misses += ev.plan_misses
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rounds > 3 and misses == 0


def test_engine_first_two_tokens_on_gpu(engines):
    """The CPU test's end-to-end check (tests/test_sampling.py) through the CUDA kernels and graphs."""
    import test_sampling as cpu_test

    eng = engines["tiny"]
    eng.tokenizer.eos_token_ids = frozenset()
    ids, exact, cell_of = cpu_test.e2e_cells(eng)
    for settings in (EngineSettings(draft_depth=3), EngineSettings(draft_depth=4, sub_vocab=160)):
        sess = eng.new_session()
        seen: dict = {}
        for seed in range(cpu_test.E2E_SAMPLES):
            res = eng.generate(ids, 2, settings, sess, sampling=cpu_test.E2E_SAMPLING.replace(seed=seed))
            cell = cell_of(*res.tokens)
            seen[cell] = seen.get(cell, 0) + 1
        stat, crit, _ = cpu_test._chi_square(seen, exact, cpu_test.E2E_SAMPLES)
        assert stat < crit, (settings, stat, crit)


def test_two_gpus_sample_like_one(tiny_model_dir, engines):
    """Two GPUs (one process each): every rank draws the same tokens (else the ranks' states part and the
    output is garbage); reruns with graphs are identical, and the text is the one GPU's (the logits agree to
    ~1e-6, so a draw could differ only on a boundary: the first 8 tokens are required to agree)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    one = engines["tiny"]
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=4)
    tp = Engine.load(tiny_model_dir, devices=["cuda:0", "cuda:1"])
    try:
        for case in (dict(), dict(mirror_output=False), dict(mirror_output=False, sub_vocab=200), dict(chain=False)):
            settings = EngineSettings(draft_depth=4, plan_pool=8).replace(**case)
            want = one.generate("def main():", 32, settings, one.new_session(), sampling=sp).tokens
            sess = tp.new_session()
            runs = []
            for _ in range(2):  # the second run replays the captured graphs
                sess.reset()
                runs.append(tp.generate("def main():", 32, settings, sess, sampling=sp).tokens)
            assert runs[0] == runs[1], case
            first_diff = next((i for i, (a, b) in enumerate(zip(runs[0], want)) if a != b), None)
            assert first_diff is None or first_diff > 8, (case, first_diff)
    finally:
        tp.close()
