"""Gemm mode "exact" on the GPU: every piece a verify round shares with a one-row step computes a row the same
whatever the number of rows (the gemv variant it picks, decode attention with row-invariant splits), so in bf16
(where cuBLAS and the tensor-core kernels sum a row differently at different row counts) speculative output is
still greedy output, bit for bit.

    QT_QPA_PLATFORM=offscreen PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_exact_gpu.py
"""

from __future__ import annotations

import itertools

import pytest
import torch

from app.workloads import load_workloads
from engine import Engine, EngineSettings

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NINE_B = [(10240, 4096), (4096, 4096), (12352, 4096), (24576, 4096), (4096, 12288), (32768, 4096), (40, 64)]


@pytest.fixture
def kc():
    import kernels.cuda as kc

    ok, why = kc.available()
    if not ok:
        pytest.skip(f"CUDA kernels unavailable: {why}")
    for dtype in (torch.bfloat16, torch.float16):
        ok, why = kc.gemv_kernels(CUDA, dtype)
        if not ok:
            pytest.fail(f"the gemv module does not load for {dtype}: {why}")
    yield kc
    kc.set_row_invariant(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", NINE_B)
def test_the_row_invariant_gemv_variant_sums_a_row_alike_for_any_row_count(kc, dtype, n, k):
    g = torch.Generator(device=CUDA).manual_seed(n + k)
    w = (torch.randn(n, k, device=CUDA, generator=g) * k**-0.5).to(dtype)
    x = torch.randn(17, k, device=CUDA, generator=g).to(dtype)
    variant = kc.gemv_row_invariant(n, k, dtype, CUDA)
    whole = kc.gemv(x, w, variant)
    for m in (1, 2, 5, 9, 16):
        assert torch.equal(kc.gemv(x[:m], w, variant), whole[:m]), (variant, m)
    for i in (0, 7, 16):
        assert torch.equal(kc.gemv(x[i : i + 1], w, variant)[0], whole[i]), (variant, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 256), (8, 2, 64), (6, 2, 64)])
@pytest.mark.parametrize("start", [0, 37, 3000, 20000])
def test_row_invariant_attention_gives_a_row_what_a_one_row_step_gives(kc, dtype, hq, hkv, d, start):
    """A verify of T rows at positions start..start+T-1 equals T one-row steps, with the start on the device
    (a captured plan) or the host (an eager round), gated or not."""
    kc.set_row_invariant(True)
    g = torch.Generator(device=CUDA).manual_seed(start + d)
    max_ctx = 32768
    kcache = torch.randn(max_ctx, hkv, d, device=CUDA, generator=g).to(dtype)
    vcache = torch.randn(max_ctx, hkv, d, device=CUDA, generator=g).to(dtype)
    t = 6
    qg = torch.randn(t, hq, 2 * d, device=CUDA, generator=g).to(dtype)
    q, gate = qg[..., :d], qg[..., d:]
    for gt in (None, gate):
        rows = kc.attention_cached(q, kcache, vcache, torch.tensor([start], device=CUDA), d**-0.5, gt)
        eager = kc.attention_cached(q, kcache, vcache, start, d**-0.5, gt)
        assert torch.equal(rows, eager)
        for i in range(t):
            one = kc.attention_cached(
                q[i : i + 1], kcache, vcache, start + i, d**-0.5, None if gt is None else gt[i : i + 1]
            )
            assert torch.equal(one[0], rows[i]), (i, gt is None)


@pytest.fixture(scope="module")
def exact_bf16():
    from engine import bundled_model_dir

    eng = Engine.load(bundled_model_dir(), device="cuda", dtype="bfloat16", gemm="exact")
    yield eng
    import kernels.cuda as kc

    kc.set_row_invariant(False)


def test_bf16_speculative_output_is_greedy_output_with_gemm_exact(exact_bf16):
    eng = exact_bf16
    assert eng.info["gemm"] == "exact" and not eng.info["gemm_notice"]
    assert all(c.startswith("simt2.") for c in eng.info["gemm_choices"].values())
    target = EngineSettings(speculative=False, plan_pool=8)
    for w in load_workloads().values():
        prompt = w.prompt_for(eng.tokenizer)
        greedy = eng.generate(prompt, 96, target, eng.new_session()).tokens
        for depth, chain in itertools.product((1, 3, 5, 8), (True, False)):
            sess = eng.new_session()
            for _ in range(2):  # the second run replays the captured plans
                sess.reset()
                out = eng.generate(prompt, 96, EngineSettings(draft_depth=depth, chain=chain, plan_pool=8), sess)
                assert out.tokens == greedy, (w.name, depth, chain)
        auto = eng.generate(prompt, 96, EngineSettings(draft_depth="auto", plan_pool=16), eng.new_session())
        assert auto.tokens == greedy, (w.name, "auto")
