"""Programmatic dependent launch (kernels/pdl.py) on the GPU: a plan captured with PDL computes exactly what the
same plan captured without it computes, for a chain of dependent kernels (each reading what the one before it
wrote, and one writing what the one before it read) and through the engine (fp32 speculative == greedy, bf16
tokens identical with and without PDL). Skipped where PDL is unavailable (no cuLaunchKernelEx, before sm_90).

    QT_QPA_PLATFORM=offscreen PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineSettings

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture
def kc():
    import kernels.cuda as kc

    ok, why = kc.available()
    if not ok:
        pytest.skip(f"CUDA kernels unavailable: {why}")
    if not kc.set_pdl(True):
        pytest.skip("programmatic dependent launch is not available on this driver / GPU")
    kc.set_pdl(False)
    yield kc
    kc.set_pdl(False)


def _chain(kc, x, w_norm, w1, w2, kcache, vcache, start):
    """A decode-like chain: every kernel reads what the previous one wrote; the last rewrites `x` in place-ish
    (into a buffer the first kernel read), so a kernel that ran ahead of its predecessor would be seen.
    The gemv kernels load their first W vectors before PDL's wait (weights only): their three forms are here."""
    h = kc.rmsnorm(x, w_norm, 1e-6)
    up = kc.gemv(h, w1)
    act = kc.gemv_silu_mul(h, w1)  # the product and the activation in one launch
    q = act[:, : 16 * 64].reshape(-1, 16, 64)
    att = kc.attention_cached(q, kcache, vcache, start, 64**-0.5).reshape(act.shape[0], -1)
    down = kc.gemv(att, w2)
    y, s = kc.gemv_add_rmsnorm(att, w2, x, w_norm, 1e-6)  # product + residual add + norm in one launch
    tok, prob = kc.argmax_prob(s, 0)
    x.copy_(s)  # the buffer the first kernel read: written last
    return tok, prob, up, down, y, s


def _captured(kc, pdl_on: bool, dtype: torch.dtype, rows: int):
    torch.manual_seed(0)
    d = 1024
    x = torch.randn(rows, d, device=CUDA, dtype=dtype)
    w_norm = torch.randn(d, device=CUDA, dtype=dtype) * 0.1
    w1 = (torch.randn(2 * 16 * 64, d, device=CUDA) * d**-0.5).to(dtype)
    w2 = (torch.randn(d, 16 * 64, device=CUDA) * 0.03).to(dtype)
    kcache = torch.randn(4096, 4, 64, device=CUDA, dtype=dtype)
    vcache = torch.randn(4096, 4, 64, device=CUDA, dtype=dtype)
    start = torch.tensor([3000], device=CUDA)
    kc.set_pdl(pdl_on)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _chain(kc, x.clone(), w_norm, w1, w2, kcache, vcache, start)  # warm: compiles, no capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _chain(kc, x, w_norm, w1, w2, kcache, vcache, start)
    finally:
        kc.set_pdl(False)
    history = []
    for _ in range(3):  # replays feed each output back in: any race compounds
        graph.replay()
        history.append(tuple(o.clone() for o in outs))
    torch.cuda.synchronize()
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_chain_captured_with_pdl_equals_one_without(kc, dtype, rows):
    plain = _captured(kc, False, dtype, rows)
    with_pdl = _captured(kc, True, dtype, rows)
    for a, b in zip(plain, with_pdl, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_pdl_is_used_only_while_capturing(kc, monkeypatch):
    """Eager launches keep CuPy's path (cheaper from Python); captures go through cuLaunchKernelEx."""
    import kernels.pdl as pdl

    calls = []
    real = pdl.launch
    monkeypatch.setattr(pdl, "launch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x = torch.randn(2, 256, device=CUDA)
    w = torch.ones(256, device=CUDA)
    kc.set_pdl(True)
    kc.rmsnorm(x, w, 1e-6)
    torch.cuda.synchronize()
    assert calls == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kc.rmsnorm(x, w, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == 1
    assert torch.allclose(y, kc.rmsnorm(x, w, 1e-6))


@pytest.fixture(scope="module")
def bundled():
    from engine import bundled_model_dir

    return bundled_model_dir()


def test_pdl_is_on_by_default_where_the_gpu_has_it(kc, bundled):
    """An engine on an sm_90+ GPU captures its plans with PDL unless told not to; the option turns it off."""
    eng = Engine.load(bundled, device="cuda", dtype="bfloat16")
    assert eng.model.pdl and kc._PDL and "pdl" in eng.model.plan_tag
    eng.set_model_option("pdl", False)
    assert not eng.model.pdl and not kc._PDL and "pdl" not in eng.model.plan_tag


@pytest.mark.parametrize("gemm", ["cublas", "cupy"])
def test_engine_with_pdl_speculative_equals_greedy_fp32(kc, bundled, gemm):
    """With gemm "cupy" every product is a gemv kernel loading weights before PDL's wait (and the MLP's
    activation inside its gate|up product)."""
    eng = Engine.load(bundled, device="cuda", dtype="float32", gemm=gemm)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    kc.set_pdl(True)
    try:
        greedy = eng.generate(prompt, 48, EngineSettings(speculative=False, plan_pool=8), eng.new_session()).tokens
        sess = eng.new_session()
        for depth in (3, 5):
            for _ in range(2):  # the second run replays the plans captured with PDL
                sess.reset()
                out = eng.generate(prompt, 48, EngineSettings(draft_depth=depth, chain=True, plan_pool=8), sess)
                assert out.tokens == greedy, depth
        assert out.stats["plan_hits"] > 0
    finally:
        kc.set_pdl(False)


def test_engine_bf16_tokens_are_the_same_with_and_without_pdl(kc, bundled):
    eng = Engine.load(bundled, device="cuda", dtype="bfloat16")
    prompt = "class Stack:\n    def __init__(self):\n"
    settings = EngineSettings(draft_depth=4, chain=True, plan_pool=8)
    runs = []
    for on in (False, True):
        kc.set_pdl(on)
        try:
            sess = eng.new_session()
            eng.generate(prompt, 16, settings, sess)  # captures this session's plans this way
            sess.reset()
            runs.append(eng.generate(prompt, 64, settings, sess).tokens)
        finally:
            kc.set_pdl(False)
    assert runs[0] == runs[1]
