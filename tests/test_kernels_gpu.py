"""Every CuPy kernel in kernels/cuda.py equals its PyTorch reference in kernels/reference.py.

GPU tests are marked `gpu` (skipped without CUDA by conftest.py; skipped with the reason when CuPy cannot
run). References run on the same GPU tensors (TF32 off), from clones of every state buffer.

Tolerances (torch.testing.assert_close), per output dtype:
- fp32: rtol 1e-5, atol 1e-5 * max|ref| (elements that approach 0 through cancellation are compared
  against the tensor's scale).
- bf16: rtol 2.5e-2 (about 3 bf16 ulps), atol 2e-3 * max|ref|, and at least 90% of the elements
  bit-identical: the kernels reproduce the reference's intermediate roundings to bf16, so differences
  come only from fp32 rounding in the last place flipping a bf16 rounding.
- fp16: rtol 3e-3, atol 1e-3 * max|ref|.
- exact (torch.equal): the conv planes (copies of inputs), argmax tokens, greedy_accept.
- argmax probabilities are fp32 maths from identical inputs in both: fp32 tolerance in every dtype.
- the delta rule's fp32 state planes: fp32 tolerance in every dtype (fp32 maths from identical inputs).
Ties in argmax: the kernel returns the LOWEST index of the maximum (what torch's CPU max returns);
random test data has a planted unique maximum, and `test_argmax_ties_lowest_index` checks ties.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import ops
from kernels import reference as ref

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]


# ---- CPU-runnable ----------------------------------------------------------------------------------
def test_cuda_module_imports_and_reports_availability():
    import kernels.cuda as kc

    ok, why = kc.available()
    assert isinstance(ok, bool)
    assert isinstance(why, str) and why and "\n" not in why
    if not torch.cuda.is_available():
        assert ok is False
        with pytest.raises(RuntimeError):
            kc.warm_up("cuda", torch.float32)


def test_signatures_match_reference():
    import kernels.cuda as kc

    for name in ops.NAMES:
        assert str(inspect.signature(getattr(kc, name))) == str(inspect.signature(getattr(ref, name))), name


def test_reference_argmax_writes_into_the_given_slots():
    lg = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    ids, probs = torch.zeros(4, dtype=torch.int64), torch.zeros(3)
    tok, prob = ref.argmax_prob(lg, 0, (ids[2:3], probs[1:2]))
    assert ids.tolist() == [0, 0, 1, 0] and tok.data_ptr() == ids[2:3].data_ptr()
    e = torch.exp(torch.tensor([-3.0, 0.0, -2.0, 0.0])).sum()
    assert probs[0] == 0 and probs[2] == 0 and abs(float(prob) - float(1 / e)) < 1e-6


def test_cpu_tensors_take_the_reference_path():
    import kernels.cuda as kc

    torch.manual_seed(0)
    x = torch.randn(3, 32)
    w = torch.randn(32)
    torch.testing.assert_close(kc.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), rtol=0, atol=0)
    tok, prob = kc.argmax_prob(x, 0)
    rt, rp = ref.argmax_prob(x, 0)
    assert torch.equal(tok, rt) and torch.equal(prob, rp)


# ---- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kc():
    import kernels.cuda as kc

    ok, why = kc.available()
    if not ok:
        pytest.skip(f"CUDA kernels unavailable: {why}")
    prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield kc
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def close(out: torch.Tensor, expect: torch.Tensor, name: str = "") -> None:
    assert out.shape == expect.shape, (name, out.shape, expect.shape)
    assert out.dtype == expect.dtype, (name, out.dtype, expect.dtype)
    amax = float(expect.float().abs().max()) if expect.numel() else 0.0
    if out.dtype == torch.float32:
        rtol, atol = 1e-5, max(1e-5 * amax, 1e-7)
    elif out.dtype == torch.bfloat16:
        rtol, atol = 2.5e-2, max(2e-3 * amax, 1e-6)
    else:
        rtol, atol = 3e-3, max(1e-3 * amax, 1e-6)
    torch.testing.assert_close(out, expect, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    if out.dtype == torch.bfloat16 and out.numel() >= 64:
        same = (out.view(torch.int16) == expect.view(torch.int16)).float().mean().item()
        assert same >= 0.9, f"{name}: only {same:.3f} of the bf16 elements are bit-identical"


def captured(fn):
    """(graph, fn()'s result as captured): fn run once inside a CUDA graph capture on a side stream (its kernels
    recorded, not run), the current stream ordered around it. Replay the graph to run them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            result = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def as_start(s: int, tensor: bool):
    return torch.tensor([s], dtype=torch.int64, device=CUDA) if tensor else s


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=CUDA) * scale).to(dtype)


# ---- norms -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 256, 384, 4096, 8192])
@pytest.mark.parametrize("t", [1, 9])
def test_rmsnorm(kc, dtype, d, t):
    torch.manual_seed(d + t)
    x = rnd(t, 3, d, dtype=dtype, scale=2.0)
    w = rnd(d, dtype=dtype, scale=0.1)
    close(kc.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), "rmsnorm")
    wf = w.float()
    close(kc.rmsnorm(x, wf, 1e-6), ref.rmsnorm(x, wf, 1e-6), "rmsnorm fp32 weight")
    # a strided view, like q = qg[..., :d] in the attention layer
    qg = rnd(t, 4, 2 * d, dtype=dtype)
    xv = qg[..., :d]
    close(kc.rmsnorm(xv, w, 1e-6), ref.rmsnorm(xv, w, 1e-6), "rmsnorm strided")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 384, 4096])
@pytest.mark.parametrize("t", [1, 4, 17])
def test_add_rmsnorm(kc, dtype, d, t):
    torch.manual_seed(d * 7 + t)
    x = rnd(t, d, dtype=dtype)
    r = rnd(t, d, dtype=dtype, scale=3.0)
    for w in (rnd(d, dtype=dtype, scale=0.1), rnd(d, scale=0.1)):
        y, s = kc.add_rmsnorm(x, r, w, 1e-6)
        ry, rs = ref.add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(s, rs)  # the sum is one rounding of x + residual in both
        close(y, ry, "add_rmsnorm")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 384, 4096])
@pytest.mark.parametrize("t", [1, 4])
def test_mtp_prefc(kc, dtype, d, t):
    """The MTP head's fc input in one kernel: each half equals rmsnorm's kernel on its row bit for bit (the
    same arithmetic), and the whole matches the reference; weights in the activations' dtype, in fp32, and
    mixed; a strided hidden (the verify's rows) and a token view into a round's buffer."""
    torch.manual_seed(d + 31 * t)
    vocab = 1000
    embed = rnd(vocab, d, dtype=dtype)
    buf = torch.randint(0, vocab, (t + 3,), device=CUDA)
    tokens = buf[1 : 1 + t]
    hid = rnd(t, 2 * d, dtype=dtype, scale=3.0)[:, :d]
    we, wh = rnd(d, dtype=dtype, scale=0.1), rnd(d, dtype=dtype, scale=0.1)
    for a, b in ((we, wh), (we.float(), wh.float()), (we, wh.float())):
        y = kc.mtp_prefc(tokens, hid, embed, a, b, 1e-6)
        close(y, ref.mtp_prefc(tokens, hid, embed, a, b, 1e-6), "mtp_prefc")
        if a.dtype == b.dtype:
            assert torch.equal(y[:, :d], kc.rmsnorm(embed[tokens], a, 1e-6))
            assert torch.equal(y[:, d:], kc.rmsnorm(hid, b, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [320, 32768, 248320])
def test_argmax_prob_into_a_rounds_slots(kc, dtype, n):
    """`out` given (the chained draft's ids_buf / probs_buf slots): the pick lands there, nothing else in the
    buffers changes, and it is what the op returns without `out`."""
    torch.manual_seed(n)
    lg, hot = _logits(1, n, n, dtype)
    ids = torch.full((6,), -7, dtype=torch.int64, device=CUDA)
    probs = torch.full((5,), -1.0, device=CUDA)
    got = kc.argmax_prob(lg, 0, (ids[2:3], probs[1:2]))
    tok, prob = kc.argmax_prob(lg, 0)
    assert got[0].data_ptr() == ids[2:3].data_ptr() and got[1].data_ptr() == probs[1:2].data_ptr()
    assert ids.tolist() == [-7, -7, int(hot[0]), -7, -7, -7] and torch.equal(ids[2:3], tok)
    assert torch.equal(probs[1:2], prob) and probs[[0, 2, 3, 4]].eq(-1.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hv,dv", [(4, 8), (4, 64), (32, 128)])
@pytest.mark.parametrize("t", [1, 9])
def test_gated_rmsnorm(kc, dtype, hv, dv, t):
    torch.manual_seed(hv + dv + t)
    x = rnd(t, hv, dv, dtype=dtype)
    zbig = rnd(t, hv * dv * 2, dtype=dtype, scale=2.0)
    gate = zbig[:, : hv * dv].view(t, hv, dv)
    for w in (rnd(dv, dtype=dtype, scale=0.5) + 1, rnd(dv, scale=0.5) + 1):
        for gt in (gate, gate.float()):
            close(kc.gated_rmsnorm(x, gt, w, 1e-6), ref.gated_rmsnorm(x, gt, w, 1e-6), "gated_rmsnorm")


# ---- attention -------------------------------------------------------------------------------------
ATT_SHAPES = [(4, 2, 16), (6, 2, 64), (16, 4, 256), (8, 8, 128), (4, 1, 96), (2, 2, 20)]
ATT_IMPLS = ["tile", "warp", "vec", "vecb"]  # kernels.cuda._ATT_IMPL forced to each form ("auto" picks one per call)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ATT_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", ATT_SHAPES)
@pytest.mark.parametrize("t", [1, 4, 9, 17])
@pytest.mark.parametrize("start,tensor_start", [(0, False), (1, True), (37, False), (1000, True), (2030, False)])
def test_attention_cached(kc, monkeypatch, impl, dtype, hq, hkv, d, t, start, tensor_start):
    monkeypatch.setattr(kc, "_ATT_IMPL", impl)
    torch.manual_seed(hq * 1000 + d + t + start)
    max_ctx = 2048
    kcache = rnd(max_ctx, hkv, d, dtype=dtype)  # rows past start+t hold garbage that must be masked
    vcache = rnd(max_ctx, hkv, d, dtype=dtype)
    q = rnd(t, hq, d, dtype=dtype, scale=2.0)
    scale = d**-0.5
    out = kc.attention_cached(q, kcache, vcache, as_start(start, tensor_start), scale)
    close(out, ref.attention_cached(q, kcache, vcache, start, scale), f"attention T={t} start={start}")


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["fold", "par", "serial"])
@pytest.mark.parametrize("impl", ATT_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,start", [(1, 20000), (17, 32768 - 17), (4, 32000), (17, 100_000)])
def test_attention_long_context(kc, monkeypatch, combine, impl, dtype, t, start):
    monkeypatch.setattr(kc, "_ATT_IMPL", impl)
    monkeypatch.setattr(kc, "_ATT_COMBINE", combine)
    torch.manual_seed(start)
    max_ctx, hq, hkv, d = max(32768, start + t), 16, 4, 256
    kcache = rnd(max_ctx, hkv, d, dtype=dtype)
    vcache = rnd(max_ctx, hkv, d, dtype=dtype)
    q = rnd(t, hq, d, dtype=dtype, scale=3.0)
    for st in (start, as_start(start, True)):
        out = kc.attention_cached(q, kcache, vcache, st, d**-0.5)
        close(out, ref.attention_cached(q, kcache, vcache, start, d**-0.5), "attention long")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("start", [5, 300, 1000, 30000])
@pytest.mark.parametrize("min_keys", [16, 32, 64])
def test_attention_fold_merges_the_splits_in_one_launch(kc, monkeypatch, dtype, t, start, min_keys):
    """vecb with the splits' combine folded into its launch: one kernel, the gated output close to the reference
    whatever the least keys a split, and within a rounding of the combine launch's (attn_combine_par) where the two
    split the keys alike (the combine launch's splits take AV_MIN_KEYS = 64 keys at least; with another least the
    partial sums are grouped otherwise); its counters left at zero (a captured launch replayed with new queries
    equals eager calls)."""
    monkeypatch.setattr(kc, "_ATT_FOLD_MIN_KEYS", min_keys)
    monkeypatch.setattr(kc, "_ATT_FOLD_MIN_KEYS_ONE_ROW", min_keys)
    torch.manual_seed(t + start + min_keys)
    max_ctx, hq, hkv, d = 32768 + 64, 16, 4, 256
    kcache, vcache = rnd(max_ctx, hkv, d, dtype=dtype), rnd(max_ctx, hkv, d, dtype=dtype)
    qg = rnd(t, hq, 2 * d, dtype=dtype, scale=2.0)
    q, gate = qg[..., :d], qg[..., d:]
    st = as_start(start, True)
    launched = []
    real_launch = kc._launch
    monkeypatch.setattr(kc, "_launch", lambda name, *a, **kw: launched.append(name) or real_launch(name, *a, **kw))
    out = kc.attention_cached(q, kcache, vcache, st, d**-0.5, gate)
    assert launched == ["attn_vecb_u2_g4_f"]
    monkeypatch.setattr(kc, "_ATT_COMBINE", "par")
    two = kc.attention_cached(q, kcache, vcache, st, d**-0.5, gate)
    assert launched[1:] == ["attn_vecb_u2_g4", "attn_combine_par"]
    close(out, ref.attention_cached(q, kcache, vcache, start, d**-0.5, gate), "folded attention")
    if min_keys == 64:
        ulp = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
        assert bool(((out.float() - two.float()).abs() <= two.float().abs() * ulp + 1e-6).all())
    monkeypatch.setattr(kc, "_ATT_COMBINE", "fold")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    q_in = q.clone()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            o_graph = kc.attention_cached(q_in, kcache, vcache, st, d**-0.5, gate)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (0.5, 2.0, 1.0):
        q_in.copy_(q * scale)
        graph.replay()
        want = kc.attention_cached(q * scale, kcache, vcache, st, d**-0.5, gate)
        torch.cuda.synchronize()
        assert torch.equal(o_graph, want), scale


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ATT_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (16, 4, 256)])
@pytest.mark.parametrize("t,start,tensor_start", [(1, 0, True), (4, 37, False), (9, 1000, True), (1, 20000, True)])
def test_attention_output_gate(kc, monkeypatch, impl, dtype, hq, hkv, d, t, start, tensor_start):
    """The gated output (out * sigmoid(gate)) from a strided gate view, as the attention layer passes it;
    start 20000 makes the split + combine path write it."""
    monkeypatch.setattr(kc, "_ATT_IMPL", impl)
    torch.manual_seed(hq + d + t + start)
    max_ctx = 32768
    kcache, vcache = rnd(max_ctx, hkv, d, dtype=dtype), rnd(max_ctx, hkv, d, dtype=dtype)
    qg = rnd(t, hq, 2 * d, dtype=dtype, scale=2.0)
    q, gate = qg[..., :d], qg[..., d:]
    out = kc.attention_cached(q, kcache, vcache, as_start(start, tensor_start), d**-0.5, gate)
    close(out, ref.attention_cached(q, kcache, vcache, start, d**-0.5, gate), "gated attention")


# ---- fused attention inputs, MLP activation, delta-net gates ------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,rot", [(6, 2, 64, 16), (16, 4, 256, 64), (4, 1, 96, 96), (2, 2, 1024, 64)])
@pytest.mark.parametrize("t,start,tensor_start", [(1, 0, False), (1, 41, True), (4, 37, True), (9, 2039, False)])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
def test_attn_prep(kc, dtype, hq, hkv, d, rot, t, start, tensor_start, wdtype):
    """q/k norm + RoPE + cache write in one kernel equals rope_partial(rmsnorm(.)) and kv_write, on the
    strided views of a packed q|gate, k, v projection (the attention layer's layout)."""
    torch.manual_seed(hq + d + t + start)
    max_ctx = 2048
    packed = rnd(t, hq * 2 * d + 2 * hkv * d, dtype=dtype, scale=2.0)
    qg, k, v = packed.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    q = qg.reshape(t, hq, 2 * d)[..., :d]
    k, v = k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    wt = dtype if wdtype == "same" else torch.float32
    wq, wk = rnd(d, dtype=wt, scale=0.1), rnd(d, dtype=wt, scale=0.1)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=CUDA) / rot))
    kc0, vc0 = rnd(max_ctx, hkv, d, dtype=dtype), rnd(max_ctx, hkv, d, dtype=dtype)
    a, b = kc0.clone(), vc0.clone()
    out = kc.attn_prep(q, k, v, wq, wk, 1e-6, inv_freq, a, b, as_start(start, tensor_start))
    ra, rb = kc0.clone(), vc0.clone()
    expect = ref.attn_prep(q, k, v, wq, wk, 1e-6, inv_freq, ra, rb, start)
    close(out, expect, "attn_prep q")
    close(a[start : start + t], ra[start : start + t], "attn_prep k cache rows")
    assert torch.equal(a[:start], kc0[:start]) and torch.equal(a[start + t :], kc0[start + t :])
    assert torch.equal(b, rb)  # v is a copy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 12288), (9, 1024), (4, 37)])
def test_silu_mul(kc, dtype, t, i):
    torch.manual_seed(t + i)
    x = rnd(t, 2 * i, dtype=dtype, scale=3.0)
    close(kc.silu_mul(x), ref.silu_mul(x), "silu_mul")
    xs = rnd(t, 2 * i + 6, dtype=dtype)[:, 3 : 3 + 2 * i]  # strided rows
    close(kc.silu_mul(xs), ref.silu_mul(xs), "silu_mul strided")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 32), (9, 4), (17, 48)])
def test_gdn_gates(kc, dtype, t, h):
    """g and beta from strided a/b views (the packed delta-net projection), over the softplus threshold."""
    torch.manual_seed(t * h)
    packed = rnd(t, 64 + 2 * h, dtype=dtype, scale=8.0)  # |a + dt_bias| reaches past 20
    b, a = packed[:, 64 : 64 + h], packed[:, 64 + h :]
    neg_exp_a = -torch.rand(h, device=CUDA).mul(8).add(0.5)
    for dt_bias in (rnd(h, scale=4.0), rnd(h, dtype=dtype, scale=4.0)):
        g, beta = kc.gdn_gates(a, b, neg_exp_a, dt_bias)
        rg, rbeta = ref.gdn_gates(a, b, neg_exp_a, dt_bias)
        close(g, rg, "gdn g")
        close(beta, rbeta, "gdn beta")


# ---- conv ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c,k", [(96, 4), (512, 4), (8192, 4), (130, 2), (64, 6)])
@pytest.mark.parametrize("t", [1, 4, 9, 17, 65, 100, 2049])  # past 64 with a host start: runs in parallel
@pytest.mark.parametrize("n_planes,start,tensor_start", [(18, 0, False), (18, 13, True), (6, 5, True), (4, 2, False)])
def test_conv_update(kc, dtype, c, k, t, n_planes, start, tensor_start):
    torch.manual_seed(c + k + t + n_planes + start)
    ring0 = rnd(n_planes, c, k - 1, dtype=dtype)
    x = rnd(t, c, dtype=dtype)
    for w in (rnd(c, k, dtype=dtype, scale=0.5), rnd(c, k, scale=0.5)):
        ring = ring0.clone()
        out = kc.conv_update(x, ring, w, as_start(start, tensor_start))
        rring = ring0.clone()
        expect = ref.conv_update(x, rring, w, start)
        close(out, expect, "conv_update")
        assert torch.equal(ring, rring), "conv planes differ"


# ---- gated delta rule ----------------------------------------------------------------------------------
GDR_SHAPES = [(2, 4, 16, 8), (2, 4, 64, 64), (16, 32, 128, 128), (4, 4, 32, 32), (1, 2, 48, 40)]


def _gdr_inputs(t, hk, hv, dk, dv, dtype, n_planes):
    # q, k, v as strided views of one projection, like the model's split of the conv output
    qkv = rnd(t, 2 * hk * dk + hv * dv, dtype=dtype)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    g = -torch.rand(t, hv, device=CUDA) * 0.5  # fp32 log-decay
    beta = torch.sigmoid(rnd(t, hv)).to(dtype)
    state = rnd(n_planes, hv, dk, dv, scale=0.3)
    return q, k, v, g, beta, state


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", GDR_SHAPES)
@pytest.mark.parametrize("t", [1, 4, 9, 17])
@pytest.mark.parametrize("start,tensor_start", [(0, False), (5, True), (22, True)])
def test_gated_delta_rule(kc, dtype, hk, hv, dk, dv, t, start, tensor_start):
    torch.manual_seed(hk + hv + dk + dv + t + start)
    n_planes = 18
    q, k, v, g, beta, state0 = _gdr_inputs(t, hk, hv, dk, dv, dtype, n_planes)
    for b in (beta, beta.float()):
        ring = state0.clone()
        out = kc.gated_delta_rule(q, k, v, g, b, ring, as_start(start, tensor_start))
        rring = state0.clone()
        expect = ref.gated_delta_rule(q, k, v, g, b, rring, start)
        close(out, expect, f"delta rule out T={t}")
        close(ring, rring, "delta rule planes")  # includes the planes that must stay untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", GDR_SHAPES)
@pytest.mark.parametrize("t", [1, 9])
def test_gated_delta_rule_ab(kc, dtype, hk, hv, dk, dv, t):
    """The rule with raw gates (a, b strided columns of the projection, a + dt_bias past softplus' threshold):
    equal to the reference, and bit for bit to gdn_gates then gated_delta_rule on the GPU (out and planes)."""
    torch.manual_seed(hk * hv + dk + dv + t)
    n_planes, start = 18, torch.tensor([7], device=CUDA)
    q, k, v, _, _, state0 = _gdr_inputs(t, hk, hv, dk, dv, dtype, n_planes)
    packed = rnd(t, 8 + 2 * hv, dtype=dtype, scale=3.0)
    b, a = packed[:, 8 : 8 + hv], packed[:, 8 + hv :]
    neg_exp_a = -torch.rand(hv, device=CUDA).mul(2).add(0.05)
    for dt_bias in (rnd(hv, scale=4.0), rnd(hv, dtype=dtype, scale=4.0)):
        ring = state0.clone()
        out = kc.gated_delta_rule_ab(q, k, v, a, b, neg_exp_a, dt_bias, ring, start)
        rring = state0.clone()
        close(out, ref.gated_delta_rule_ab(q, k, v, a, b, neg_exp_a, dt_bias, rring, 7), "delta rule ab out")
        close(ring, rring, "delta rule ab planes")
        two = state0.clone()
        g, beta = kc.gdn_gates(a, b, neg_exp_a, dt_bias)
        assert torch.equal(out, kc.gated_delta_rule(q, k, v, g, beta, two, start))
        assert torch.equal(ring, two)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", GDR_SHAPES)
@pytest.mark.parametrize("t", [1, 9])
def test_gated_delta_rule_ab_norm(kc, dtype, hk, hv, dk, dv, t):
    """The rule and the delta-net's output norm in one launch: the planes bit for bit the rule's, the normed
    rows within a rounding of gated_delta_rule_ab -> gated_rmsnorm on the GPU (a block's own sum order) and
    close to the reference; the first token's row the same bits whatever T is; a captured launch replayed with
    new inputs equal to eager calls (its per-head counters are left at zero)."""
    torch.manual_seed(hk * hv + dk + dv + t + 1)
    n_planes, start = 18, torch.tensor([7], device=CUDA)
    q, k, v, _, _, state0 = _gdr_inputs(t, hk, hv, dk, dv, dtype, n_planes)
    packed = rnd(t, 2 * hv + hv * dv + 8, dtype=dtype, scale=3.0)  # the projection's b | a | z columns, strided
    b, a = packed[:, :hv], packed[:, hv : 2 * hv]
    z = packed[:, 2 * hv : 2 * hv + hv * dv].reshape(t, hv, dv)
    neg_exp_a = -torch.rand(hv, device=CUDA).mul(2).add(0.05)
    dt_bias, weight = rnd(hv, scale=4.0), rnd(dv, scale=1.0) + 1.0
    before = kc.registry.fallbacks().get("gated_delta_rule_ab_norm", 0)
    ring = state0.clone()
    y = kc.gated_delta_rule_ab_norm(q, k, v, a, b, neg_exp_a, dt_bias, ring, start, z, weight, 1e-6)
    two = state0.clone()
    want = kc.gated_rmsnorm(kc.gated_delta_rule_ab(q, k, v, a, b, neg_exp_a, dt_bias, two, start), z, weight, 1e-6)
    assert torch.equal(ring, two)
    eps = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    assert bool(((y.float() - want.float()).abs() <= want.float().abs() * eps + torch.finfo(dtype).tiny).all())
    rring = state0.clone()
    close(y, ref.gated_delta_rule_ab_norm(q, k, v, a, b, neg_exp_a, dt_bias, rring, 7, z, weight, 1e-6), "ab norm")
    one = kc.gated_delta_rule_ab_norm(
        q[:1], k[:1], v[:1], a[:1], b[:1], neg_exp_a, dt_bias, state0.clone(), start, z[:1], weight, 1e-6
    )
    assert torch.equal(one[0], y[0])
    assert kc.registry.fallbacks().get("gated_delta_rule_ab_norm", 0) == before
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    ring_in, q_in = state0.clone(), q.clone()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y_out = kc.gated_delta_rule_ab_norm(q_in, k, v, a, b, neg_exp_a, dt_bias, ring_in, start, z, weight, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (0.5, 2.0, 1.0):
        q_in.copy_(q * scale)
        ring_in.copy_(state0)
        graph.replay()
        want = kc.gated_delta_rule_ab_norm(
            q * scale, k, v, a, b, neg_exp_a, dt_bias, state0.clone(), start, z, weight, 1e-6
        )
        torch.cuda.synchronize()
        assert torch.equal(y_out, want), scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", GDR_SHAPES)
@pytest.mark.parametrize("t", [1, 9, 20])
def test_conv_delta_rule_norm(kc, dtype, hk, hv, dk, dv, t, monkeypatch):
    """The delta-net's decode step after its projection in one launch (conv + SiLU, gates, rule, norm): the
    output, the rule's planes and the conv ring bit for bit conv_update -> gated_delta_rule_ab_norm on the GPU
    (T = 20 crosses the kernel's 16-token chunk), close to the reference, one kernel launched, and a captured
    launch replayed with new inputs equal to eager calls."""
    torch.manual_seed(hk * hv + dk + dv + t + 2)
    n_planes, start = 24, torch.tensor([7], device=CUDA)
    c = 2 * hk * dk + hv * dv
    proj = rnd(t, c + hv * dv + 2 * hv + 8, dtype=dtype)  # the projection's q|k|v, z, b, a columns, strided
    x, z = proj[:, :c], proj[:, c : c + hv * dv].reshape(t, hv, dv)
    b, a = proj[:, c + hv * dv : c + hv * dv + hv], proj[:, c + hv * dv + hv : c + hv * dv + 2 * hv]
    conv_w = rnd(c, 4, dtype=dtype, scale=0.5)
    conv0 = rnd(n_planes, c, 3, dtype=dtype)
    state0 = rnd(n_planes, hv, dk, dv, scale=0.3)
    neg_exp_a = -torch.rand(hv, device=CUDA).mul(2).add(0.05)
    dt_bias, weight = rnd(hv, scale=4.0), rnd(dv, scale=1.0) + 1.0

    def fused(x, conv, state):
        return kc.conv_delta_rule_norm(x, conv, conv_w, hk, a, b, neg_exp_a, dt_bias, state, start, z, weight, 1e-6)

    def two_ops(x, conv, state):
        qkv = kc.conv_update(x, conv, conv_w, start)
        q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
        return kc.gated_delta_rule_ab_norm(q, k, v, a, b, neg_exp_a, dt_bias, state, start, z, weight, 1e-6)

    before = dict(kc.registry.fallbacks())
    launched = []
    real_launch = kc._launch
    monkeypatch.setattr(kc, "_launch", lambda name, *a, **kw: launched.append(name) or real_launch(name, *a, **kw))
    conv, state = conv0.clone(), state0.clone()
    y = fused(x, conv, state)
    assert launched == [f"gdr_dk{16 if dk <= 16 else 32 if dk <= 32 else 64 if dk <= 64 else 128}_cabn"]
    conv2, state2 = conv0.clone(), state0.clone()
    want = two_ops(x, conv2, state2)
    assert torch.equal(y, want) and torch.equal(state, state2) and torch.equal(conv, conv2)
    rconv, rstate = conv0.clone(), state0.clone()
    expect = ref.conv_delta_rule_norm(x, rconv, conv_w, hk, a, b, neg_exp_a, dt_bias, rstate, 7, z, weight, 1e-6)
    close(y, expect, "conv delta rule norm")
    assert torch.equal(conv, rconv), "conv planes differ"  # raw inputs moved through the window: exact
    close(state, rstate, "conv delta rule planes")
    assert kc.registry.fallbacks() == before
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    x_in, conv_in, state_in = x.clone(), conv0.clone(), state0.clone()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y_out = fused(x_in, conv_in, state_in)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (0.5, 2.0, 1.0):
        x_in.copy_(x * scale)
        conv_in.copy_(conv0)
        state_in.copy_(state0)
        graph.replay()
        conv2, state2 = conv0.clone(), state0.clone()
        want = fused(x * scale, conv2, state2)
        torch.cuda.synchronize()
        assert torch.equal(y_out, want) and torch.equal(conv_in, conv2) and torch.equal(state_in, state2), scale


@pytest.mark.gpu
def test_conv_delta_rule_norm_takes_the_two_kernels_where_its_kernel_does_not_fit(kc):
    """A conv of another size (or an fp32 conv weight under bf16 activations) runs conv_update then
    gated_delta_rule_ab_norm, with the same result as calling them."""
    hk, hv, dk, dv, t = 2, 4, 16, 8, 3
    c = 2 * hk * dk + hv * dv
    start = torch.tensor([2], device=CUDA)
    x, z = rnd(t, c, dtype=torch.bfloat16), rnd(t, hv, dv, dtype=torch.bfloat16)
    a, b = rnd(t, hv, dtype=torch.bfloat16), rnd(t, hv, dtype=torch.bfloat16)
    neg_exp_a, dt_bias, weight = -torch.rand(hv, device=CUDA), rnd(hv), rnd(dv) + 1.0
    for conv_w in (rnd(c, 3, dtype=torch.bfloat16), rnd(c, 4)):
        k1 = conv_w.shape[1] - 1
        conv0, state0 = rnd(8, c, k1, dtype=torch.bfloat16), rnd(8, hv, dk, dv, scale=0.3)
        conv, state = conv0.clone(), state0.clone()
        y = kc.conv_delta_rule_norm(x, conv, conv_w, hk, a, b, neg_exp_a, dt_bias, state, start, z, weight, 1e-6)
        conv2, state2 = conv0.clone(), state0.clone()
        q, k, v = torch.split(kc.conv_update(x, conv2, conv_w, start), [hk * dk, hk * dk, hv * dv], dim=-1)
        want = kc.gated_delta_rule_ab_norm(
            q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), a, b, neg_exp_a, dt_bias, state2,
            start, z, weight, 1e-6,
        )  # fmt: skip
        assert torch.equal(y, want) and torch.equal(conv, conv2) and torch.equal(state, state2)
    with pytest.raises(ValueError, match="conv channels"):
        kc.conv_delta_rule_norm(x[:, 1:], conv, conv_w, hk, a, b, neg_exp_a, dt_bias, state, start, z, weight, 1e-6)


@pytest.mark.gpu
def test_gated_delta_rule_refuses_too_few_planes(kc):
    q, k, v, g, beta, state = _gdr_inputs(4, 2, 4, 16, 8, torch.float32, 4)
    with pytest.raises(ValueError):
        kc.gated_delta_rule(q, k, v, g, beta, state, 0)


# ---- argmax / acceptance ---------------------------------------------------------------------------------
def _logits(t, vocab, n, dtype):
    lg = torch.randn(t, vocab, device=CUDA) * 2.0
    lg = lg.clamp(-8, 8)
    hot = torch.randint(0, n, (t,), device=CUDA)
    lg[torch.arange(t, device=CUDA), hot] = 9.0 + torch.rand(t, device=CUDA)  # a unique maximum in [0, n)
    if n < vocab:
        lg[:, n + (vocab - n) // 2] = 20.0  # a larger value past n that must be ignored
    return lg.to(dtype), hot


def test_reference_bookkeeping_ops_on_the_cpu():
    """embed_rmsnorm is the gather then rmsnorm (the residual is the row itself); store_rows puts rows at start.. for a
    host or tensor start; greedy_accept with a start sets the cache length from it instead of adding."""
    embed, w = torch.randn(10, 8), torch.randn(8)
    ids = torch.tensor([3, 0, 9])
    y, s = ref.embed_rmsnorm(ids, embed, w, 1e-6)
    assert torch.equal(s, embed[ids]) and torch.equal(y, ref.rmsnorm(embed[ids], w, 1e-6))
    rows = torch.randn(2, 8)
    for start in (4, torch.tensor([4])):
        dst = torch.zeros(7, 8)
        ref.store_rows(dst, rows, start)
        assert torch.equal(dst[4:6], rows) and not dst[:4].any() and not dst[6:].any()
    out, cache_len = torch.zeros(5, dtype=torch.int64), torch.tensor([99])
    drafts, target = torch.tensor([5, 6]), torch.tensor([5, 7, 8])
    ref.greedy_accept(drafts, torch.ones(2), target, 0.0, cache_len, out, torch.tensor([20]))
    assert out.tolist() == [2, 2, 5, 7, 0] and cache_len.tolist() == [22]
    ref.greedy_accept(drafts, torch.ones(2), target, 0.0, cache_len, out)
    assert cache_len.tolist() == [24]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [320, 16384, 32768, 262144])
@pytest.mark.parametrize("t", [1, 4, 9, 17])
@pytest.mark.parametrize("frac", [0, 0.25, 1.0])
def test_argmax_prob(kc, dtype, vocab, t, frac):
    torch.manual_seed(vocab + t)
    n = 0 if frac == 0 else int(vocab * frac)
    lg, hot = _logits(t, vocab, n or vocab, dtype)
    tok, prob = kc.argmax_prob(lg, n)
    rt, rp = ref.argmax_prob(lg, n)
    assert tok.dtype == torch.int64 and prob.dtype == torch.float32
    assert torch.equal(tok, rt) and torch.equal(tok, hot)
    torch.testing.assert_close(prob, rp, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_lowest_index(kc, dtype):
    vocab = 262144
    lg = torch.zeros(3, vocab, device=CUDA, dtype=dtype)
    lg[0, 5] = lg[0, 17] = 3.0  # tie inside one block
    lg[1, 100] = lg[1, vocab - 3] = 3.0  # tie across the split parts
    lg[2] = 1.0  # all equal
    tok, prob = kc.argmax_prob(lg, 0)
    assert tok.tolist() == [5, 100, 0]
    torch.testing.assert_close(prob, ref.argmax_prob(lg, 0)[1], rtol=1e-5, atol=1e-9)
    # torch's CPU max returns the first maximum too
    assert ref.argmax_prob(lg.cpu(), 0)[0].tolist() == [5, 100, 0]


@pytest.mark.gpu
def test_greedy_accept(kc):
    gen = torch.Generator().manual_seed(3)
    cases = 0
    for n in (0, 1, 2, 3, 5, 8):
        for p_min in (0.0, 0.3, 0.5, 0.9):
            for _ in range(6):
                target = torch.randint(0, 50, (n + 1,), generator=gen)
                drafts = target[:n].clone()
                if n:
                    wrong = int(torch.randint(0, n + 1, (1,), generator=gen))  # first mismatch (n: none)
                    if wrong < n:
                        drafts[wrong] = (drafts[wrong] + 1) % 50
                probs = torch.rand(n, generator=gen)
                if n:
                    probs[int(torch.randint(0, n, (1,), generator=gen))] = p_min  # equality counts as valid
                probs = probs.float()
                out_h = torch.full((n + 3,), -7, dtype=torch.int64)
                cl_h = torch.tensor([123], dtype=torch.int64)
                ref.greedy_accept(drafts, probs, target, p_min, cl_h, out_h)
                out_d = torch.full((n + 3,), -7, dtype=torch.int64, device=CUDA)
                cl_d = torch.tensor([123], dtype=torch.int64, device=CUDA)
                kc.greedy_accept(drafts.to(CUDA), probs.to(CUDA), target.to(CUDA), p_min, cl_d, out_d)
                assert out_d.cpu().tolist() == out_h.tolist(), (n, p_min, drafts, probs, target)
                assert cl_d.cpu().tolist() == cl_h.tolist()
                # with the round's start: cache_len = start + k + 1, whatever cache_len held
                start_h = torch.tensor([40], dtype=torch.int64)
                ref.greedy_accept(drafts, probs, target, p_min, cl_h, out_h, start_h)
                kc.greedy_accept(drafts.to(CUDA), probs.to(CUDA), target.to(CUDA), p_min, cl_d, out_d, start_h.to(CUDA))
                assert cl_h.tolist() == [40 + out_h[0].item()] and cl_d.cpu().tolist() == cl_h.tolist()
                assert out_d.cpu().tolist() == out_h.tolist()
                cases += 1
    assert cases == 144


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [320, 32768, 248320])
def test_argmax_greedy_accept_is_the_pick_then_the_acceptance(kc, dtype, vocab, monkeypatch):
    """The verify's pick and acceptance in one launch (argmax_accept): for target-only (no drafts) and several
    drafts, some matching the picks and some under p_min, a row of one part (320 ids) and of many, the tokens,
    probabilities, `out` and the cache length are argmax_prob's then greedy_accept's bits; one launch, the
    counters back at zero; and the reference op is those two references."""
    names = []
    launch = kc._launch
    monkeypatch.setattr(kc, "_launch", lambda name, *a, **k: (names.append(name), launch(name, *a, **k))[1])
    gen = torch.Generator().manual_seed(vocab)
    start = torch.tensor([37], dtype=torch.int64, device=CUDA)
    for nd in (0, 1, 3, 7):
        for case in range(3):
            lg, hot = _logits(nd + 1, vocab, vocab, dtype)
            drafts = hot[:nd].clone()
            if nd and case:  # a mismatch somewhere (case 0: every draft matches)
                at = int(torch.randint(0, nd, (1,), generator=gen))
                drafts[at] = (drafts[at] + 1) % vocab
            probs = torch.rand(nd, generator=gen).to(CUDA)
            p_min = (0.0, 0.2, 0.6)[case]
            got_out, got_cl = torch.full((nd + 3,), -7, dtype=torch.int64, device=CUDA), torch.tensor([5], device=CUDA)
            want_out, want_cl = got_out.clone(), got_cl.clone()
            names.clear()
            tok, prob = kc.argmax_greedy_accept(lg, 0, drafts, probs, p_min, got_cl, got_out, start)
            assert names == ["argmax_accept"], names
            wt, wp = kc.argmax_prob(lg, 0)
            kc.greedy_accept(drafts, probs, wt, p_min, want_cl, want_out, start)
            label = (nd, case, vocab, dtype)
            assert torch.equal(tok, wt) and torch.equal(prob, wp) and torch.equal(tok, hot), label
            assert torch.equal(got_out, want_out) and torch.equal(got_cl, want_cl), label
            r_out, r_cl = torch.full_like(got_out, -7).cpu(), torch.tensor([5])
            rt, rp = ref.argmax_greedy_accept(lg.cpu(), 0, drafts.cpu(), probs.cpu(), p_min, r_cl, r_out, start.cpu())
            assert (
                torch.equal(rt, tok.cpu()) and r_out.tolist() == got_out.tolist() and r_cl.tolist() == got_cl.tolist()
            )
            cnt = kc._counters(torch.device(CUDA), ("argmax_accept", lg.data_ptr()), nd + 2)
            assert cnt.count_nonzero().item() == 0, label


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_argmax_greedy_accept_replayed_back_to_back(kc, pdl):
    """Rounds replay the fused pick + acceptance on the same logits buffer one after another (PDL lets the next
    start early): a captured chain of rounds on new logits gives the eager chain's results each time."""
    t, vocab = 4, 248320
    lg = torch.zeros(t, vocab, device=CUDA, dtype=torch.bfloat16)
    drafts = torch.zeros(t - 1, dtype=torch.int64, device=CUDA)
    probs = torch.ones(t - 1, device=CUDA)
    start = torch.tensor([3], dtype=torch.int64, device=CUDA)
    outs = [torch.zeros(t + 2, dtype=torch.int64, device=CUDA) for _ in range(3)]
    cls = [torch.zeros(1, dtype=torch.int64, device=CUDA) for _ in range(3)]
    if pdl and not kc.set_pdl(True):
        pytest.skip("programmatic dependent launch is not available on this driver / GPU")

    def rounds(out, cl):
        return [
            kc.argmax_greedy_accept(lg, 0, drafts, probs, 0.1, c, o, start)[0] for o, c in zip(out, cl, strict=True)
        ]

    try:
        rounds(outs, cls)  # eager first: the counters are made outside the capture
        graph, toks = captured(lambda: rounds(outs, cls))
        for seed in range(4):
            new, hot = _logits(t, vocab, vocab, torch.bfloat16)
            lg.copy_(new)
            drafts.copy_(hot[: t - 1])
            drafts[seed % (t - 1)] += 1  # a mismatch that moves
            for o in outs:  # past the bonus token `out` keeps what it held: both chains start from zeros
                o.zero_()
            graph.replay()
            e_outs = [torch.zeros_like(o) for o in outs]
            e_cls = [torch.zeros_like(c) for c in cls]
            e_toks = rounds(e_outs, e_cls)
            torch.cuda.synchronize()
            for a, b in zip(toks + outs + cls, e_toks + e_outs + e_cls, strict=True):
                assert torch.equal(a, b), seed
            assert outs[0][0].item() == seed % (t - 1) + 1
    finally:
        kc.set_pdl(False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 384, 4096, 9000])
@pytest.mark.parametrize("t", [1, 6, 40])
def test_embed_rmsnorm(kc, dtype, d, t):
    """The residual is the embedding row itself and the normed row is rmsnorm's kernel bit for bit (both weight
    dtypes; d 9000 takes the looped path), both close to the reference."""
    torch.manual_seed(d + t)
    vocab = 300
    embed = torch.randn(vocab, d, device=CUDA, dtype=dtype)
    ids = torch.randint(0, vocab, (t,), device=CUDA)
    for w in (torch.randn(d, device=CUDA, dtype=dtype) * 0.1, torch.randn(d, device=CUDA) * 0.1):
        y, s = kc.embed_rmsnorm(ids, embed, w, 1e-6)
        ry, rs = ref.embed_rmsnorm(ids, embed, w, 1e-6)
        assert torch.equal(s, rs) and s.dtype == dtype
        assert torch.equal(y, kc.rmsnorm(embed[ids], w, 1e-6))
        close(y, ry, "embed_rmsnorm")
    assert kc.embed_rmsnorm(ids[:0], embed, w, 1e-6)[0].shape == (0, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_rows(kc, dtype):
    """Rows land at start.. (a device start read on the device, a host int), as the reference puts them; a row
    whose place lies past the end is not written (nothing else is touched)."""
    torch.manual_seed(5)
    rows = torch.randn(5, 96, device=CUDA, dtype=dtype)
    for start in (torch.tensor([7], device=CUDA), 7, 0, torch.tensor([15], device=CUDA)):
        got = torch.randn(20, 96, device=CUDA, dtype=dtype)
        want = got.clone()
        kc.store_rows(got, rows, start)
        ref.store_rows(want, rows, start)
        assert torch.equal(got, want), start
    tail = torch.zeros(10, 96, device=CUDA, dtype=dtype)
    kc.store_rows(tail, rows, torch.tensor([8], device=CUDA))  # rows 8, 9 fit; 10..12 would not
    assert torch.equal(tail[8:], rows[:2]) and not tail[:8].any()
    strided = torch.randn(5, 200, device=CUDA, dtype=dtype)[:, :96]  # a row stride of its own
    got = torch.zeros(20, 96, device=CUDA, dtype=dtype)
    kc.store_rows(got, strided, 3)
    assert torch.equal(got[3:8], strided) and not got[:3].any() and not got[8:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 6])
def test_argmax_prob_is_one_launch_and_replays(kc, dtype, t, monkeypatch):
    """Over several parts, the last part of each row merges the row: one launch, the same (token, prob) bits as
    argmax_combine's second launch, again and again from a captured graph (each launch leaves its counters at
    zero), new logits each replay."""
    vocab = 32768
    names = []
    launch = kc._launch
    monkeypatch.setattr(kc, "_launch", lambda name, *a, **k: (names.append(name), launch(name, *a, **k))[1])
    lg, _ = _logits(t, vocab, vocab, dtype)
    tok, prob = kc.argmax_prob(lg, 0)
    assert names == ["argmax_partial"]
    monkeypatch.setattr(kc, "_ARGMAX_ONE_LAUNCH", False)
    names.clear()
    tok2, prob2 = kc.argmax_prob(lg, 0)
    assert names == ["argmax_partial", "argmax_combine"]
    assert torch.equal(tok, tok2) and torch.equal(prob, prob2)
    monkeypatch.setattr(kc, "_ARGMAX_ONE_LAUNCH", True)
    buf = lg.clone()
    out = (torch.zeros(t, dtype=torch.int64, device=CUDA), torch.zeros(t, device=CUDA))
    kc.argmax_prob(buf, 0, out)  # eager first (the counters are made outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kc.argmax_prob(buf, 0, out)
    for i in range(12):
        fresh, hot = _logits(t, vocab, vocab, dtype)
        buf.copy_(fresh)
        g.replay()
        rt, rp = ref.argmax_prob(fresh, 0)
        assert torch.equal(out[0], hot) and torch.equal(out[0], rt), i
        torch.testing.assert_close(out[1], rp, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_synthetic_accept(kc):
    """The kernel writes exactly what the reference writes (out, cache_len), over seeds, start positions (host
    ints and device tensors), draft counts, p_min cuts and rate lists shorter and longer than the drafts."""
    gen = torch.Generator().manual_seed(15)
    rate_lists = [(0.0,), (1.0,), (0.5,), (0.873, 0.778, 0.675), (1.0, 1.0, 0.0), (0.9, 0.6, 0.55, 0.5, 0.45, 0.4)]
    fallbacks = kc.registry.fallbacks().get("synthetic_accept", 0)
    cases = accepted = 0
    for n in (0, 1, 3, 5, 8, 16):
        for rates in rate_lists:
            for p_min in (0.0, 0.4):
                for trial in range(12):
                    drafts = torch.randint(0, 1000, (n,), generator=gen)
                    target = torch.randint(0, 1000, (n + 1,), generator=gen)
                    probs = torch.rand(n, generator=gen).float()
                    seed = torch.randint(0, 2**62, (1,), generator=gen)
                    start = int(torch.randint(0, 1 << 40, (1,), generator=gen))
                    rt = torch.tensor(rates, dtype=torch.float32)
                    out_h = torch.full((n + 3,), -7, dtype=torch.int64)
                    cl_h = torch.tensor([start], dtype=torch.int64)
                    ref.synthetic_accept(drafts, probs, target, p_min, rt, seed, start, cl_h, out_h)
                    out_d = torch.full((n + 3,), -7, dtype=torch.int64, device=CUDA)
                    cl_d = torch.tensor([start], dtype=torch.int64, device=CUDA)
                    dev_start = torch.tensor([start], dtype=torch.int64, device=CUDA) if trial % 2 else start
                    kc.synthetic_accept(
                        drafts.to(CUDA),
                        probs.to(CUDA),
                        target.to(CUDA),
                        p_min,
                        rt.to(CUDA),
                        seed.to(CUDA),
                        dev_start,
                        cl_d,
                        out_d,
                    )
                    what = (n, rates, p_min, int(seed), start)
                    assert out_d.cpu().tolist() == out_h.tolist(), what
                    assert cl_d.cpu().tolist() == cl_h.tolist(), what
                    accepted += int(out_h[0]) - 1
                    cases += 1
    assert cases == 6 * 6 * 2 * 12 and accepted > 0
    assert kc.registry.fallbacks().get("synthetic_accept", 0) == fallbacks  # every call ran the kernel


@pytest.mark.gpu
def test_synthetic_accept_in_a_graph_draws_fresh_numbers_per_position(kc):
    """Captured with a device-side start, every replay draws for the start it reads, without the host."""
    kc.warm_up(CUDA, torch.float32)
    n = 4
    drafts = torch.arange(10, 10 + n, device=CUDA)
    probs = torch.ones(n, device=CUDA)
    target = torch.arange(100, 101 + n, device=CUDA)
    rates = torch.tensor([0.7, 0.6, 0.5], device=CUDA)
    seed = torch.tensor([7], dtype=torch.int64, device=CUDA)
    start = torch.zeros(1, dtype=torch.int64, device=CUDA)
    cache_len = torch.zeros(1, dtype=torch.int64, device=CUDA)
    out = torch.zeros(n + 3, dtype=torch.int64, device=CUDA)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kc.synthetic_accept(drafts, probs, target, 0.0, rates, seed, start, cache_len, out)  # first launch
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kc.synthetic_accept(drafts, probs, target, 0.0, rates, seed, start, cache_len, out)
    seen = set()
    for pos in range(0, 4000, 40):
        start.fill_(pos)
        cache_len.fill_(pos)
        graph.replay()
        expect_out = torch.zeros(n + 3, dtype=torch.int64)
        expect_cl = torch.tensor([pos])
        ref.synthetic_accept(
            drafts.cpu(), probs.cpu(), target.cpu(), 0.0, rates.cpu(), seed.cpu(), pos, expect_cl, expect_out
        )
        assert out.tolist() == expect_out.tolist() and cache_len.tolist() == expect_cl.tolist(), pos
        seen.add(int(expect_out[0]))
    assert seen == {1, 2, 3, 4, 5}


# ---- fp16 smoke ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fp16_smoke(kc):
    dtype = torch.float16
    torch.manual_seed(11)
    x, w = rnd(4, 384, dtype=dtype), rnd(384, dtype=dtype, scale=0.1)
    close(kc.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), "fp16 rmsnorm")
    kcache, vcache = rnd(256, 2, 64, dtype=dtype), rnd(256, 2, 64, dtype=dtype)
    q = rnd(5, 6, 64, dtype=dtype)
    close(kc.attention_cached(q, kcache, vcache, 100, 0.125), ref.attention_cached(q, kcache, vcache, 100, 0.125))
    q, k, v, g, beta, s0 = _gdr_inputs(5, 2, 4, 64, 64, dtype, 8)
    a, b = s0.clone(), s0.clone()
    close(kc.gated_delta_rule(q, k, v, g, beta, a, 3), ref.gated_delta_rule(q, k, v, g, beta, b, 3))
    close(a, b)
    lg, hot = _logits(3, 16384, 16384, dtype)
    assert torch.equal(kc.argmax_prob(lg, 0)[0], hot)


# ---- graphs and host syncs ------------------------------------------------------------------------------
class _Step:
    """A decode-like sequence of every stateful op, on static buffers, with a device-side start."""

    def __init__(self, dtype):
        torch.manual_seed(5)
        self.dtype = dtype
        self.t, hq, hkv, d = 4, 6, 2, 64
        hk, hv, dk, dv = 2, 4, 64, 64
        c, k, n = 2 * hk * dk + hv * dv, 4, 8
        self.vocab = 16384
        self.max_ctx = 512
        t = self.t
        self.q, self.k, self.v = rnd(t, hq, d, dtype=dtype), rnd(t, hkv, d, dtype=dtype), rnd(t, hkv, d, dtype=dtype)
        self.kc0, self.vc0 = rnd(self.max_ctx, hkv, d, dtype=dtype), rnd(self.max_ctx, hkv, d, dtype=dtype)
        self.kcache, self.vcache = self.kc0.clone(), self.vc0.clone()
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32, device=CUDA) / 16))
        self.x, self.w = rnd(t, c, dtype=dtype), rnd(c, k, dtype=dtype, scale=0.5)
        self.ring0 = rnd(n, c, k - 1, dtype=dtype)
        self.ring = self.ring0.clone()
        self.dq, self.dk_, self.dv_, self.g, self.beta, self.st0 = _gdr_inputs(t, hk, hv, dk, dv, dtype, n)
        self.state = self.st0.clone()
        self.logits, self.hot = _logits(t, self.vocab, self.vocab, dtype)
        self.drafts = self.hot[: t - 1].clone()
        self.drafts[2] += 1  # accept 2, then the bonus
        self.dprobs = torch.tensor([0.9, 0.6, 0.7], device=CUDA)
        self.cache_len = torch.zeros(1, dtype=torch.int64, device=CUDA)
        self.out = torch.zeros(t + 2, dtype=torch.int64, device=CUDA)
        self.start = torch.zeros(1, dtype=torch.int64, device=CUDA)
        self.scale = d**-0.5
        self.wn = torch.zeros(d, device=CUDA, dtype=dtype)

    def reset(self, s: int) -> None:
        self.kcache.copy_(self.kc0)
        self.vcache.copy_(self.vc0)
        self.ring.copy_(self.ring0)
        self.state.copy_(self.st0)
        self.cache_len.fill_(s)
        self.out.fill_(-1)
        self.start.fill_(s)

    def run(self, ops_, start):
        # q/k norm (zero-centred weight 0: plain norm) + RoPE + the cache rows of k and v, in one op
        qp = ops_.attn_prep(
            self.q, self.k, self.v, self.wn, self.wn, 1e-6, self.inv_freq, self.kcache, self.vcache, start
        )
        att = ops_.attention_cached(qp, self.kcache, self.vcache, start, self.scale, self.q)
        conv = ops_.conv_update(self.x, self.ring, self.w, start)
        o = ops_.gated_delta_rule(self.dq, self.dk_, self.dv_, self.g, self.beta, self.state, start)
        tok, prob = ops_.argmax_prob(self.logits, 0)
        ops_.greedy_accept(self.drafts, self.dprobs, tok, 0.5, self.cache_len, self.out)
        return qp, att, conv, o, tok, prob

    def expected(self, s: int):
        saved = [b.clone() for b in (self.kcache, self.vcache, self.ring, self.state, self.cache_len, self.out)]
        self.reset(s)
        outs = self.run(ref, s)
        bufs = [b.clone() for b in (self.kcache, self.vcache, self.ring, self.state, self.cache_len, self.out)]
        for b, v in zip((self.kcache, self.vcache, self.ring, self.state, self.cache_len, self.out), saved):
            b.copy_(v)
        return outs, bufs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_capture_replay_with_device_start(kc, dtype):
    kc.warm_up(CUDA, dtype)
    step = _Step(dtype)
    step.reset(3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up of the exact sequence, as torch recommends
        step.run(kc, step.start)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step.run(kc, step.start)
    for s in (0, 9, 13, 300, 512 - 4):  # 13 and 9 wrap the 8-plane rings differently
        expect, bufs = step.expected(s)
        step.reset(s)
        graph.replay()
        torch.cuda.synchronize()
        names = ("rope", "attention", "conv", "delta", "token", "prob")
        for name, a, b in zip(names, outs, expect):
            if name == "token":
                assert torch.equal(a, b), (s, a, b)
            elif name == "prob":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            else:
                close(a, b, f"graph {name} start={s}")
        close(step.kcache, bufs[0], "graph k cache")
        close(step.vcache, bufs[1], "graph v cache")
        assert torch.equal(step.ring, bufs[2])
        close(step.state, bufs[3], "graph delta planes")
        assert step.cache_len.item() == bufs[4].item() == s + 3
        assert step.out.tolist() == bufs[5].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_host_sync_with_device_start(kc, dtype):
    kc.warm_up(CUDA, dtype)
    step = _Step(dtype)
    step.reset(21)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step.run(kc, step.start)
        x, w = rnd(4, 384, dtype=dtype), rnd(384, dtype=dtype)
        kc.rmsnorm(x, w, 1e-6)
        kc.add_rmsnorm(x, x, w, 1e-6)
        kc.gated_rmsnorm(x, x, w, 1e-6)
        kc.silu_mul(x)
        kc.gdn_gates(x[:, :8], x[:, 8:16], w[:8].float(), w[:8].float())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
