"""The chunked delta rule of prefill on the GPU: the batched form in kernels/reference.py against the previous
per-chunk loop (kept below only to be timed against), on the 9B-like delta-net shape, in one run; then the
9B-like prefill of a 4k prompt end to end with each form, so the share of the whole is visible.

    python bench/prefill_delta.py [--tokens 2048,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import time_eager  # noqa: E402

from kernels import reference as R  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B's gated delta-net


def loop_form(q, k, v, g, beta, state_ring, start, chunk_size=64):
    """The form before 2026-12-01: every chunk's outputs and state in ~9 launches of its own."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = state_ring.shape[0]
    rep = hv // hk
    query = (R._l2norm(q.float()).repeat_interleave(rep, dim=1) * dk**-0.5).transpose(0, 1)
    key = R._l2norm(k.float()).repeat_interleave(rep, dim=1).transpose(0, 1)
    value = v.float().transpose(0, 1)
    bt, decay = beta.float().transpose(0, 1), g.float().transpose(0, 1)
    pad = (chunk_size - t % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    bt, decay = F.pad(bt, (0, pad)), F.pad(decay, (0, pad))
    nc = (t + pad) // chunk_size
    v_beta, k_beta = value * bt[..., None], key * bt[..., None]
    query, key, k_beta, v_beta = (x.reshape(hv, nc, chunk_size, -1) for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(hv, nc, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(-1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    dk_beta = k_beta * cum.exp()[..., None]
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, dk_beta, upper=False, unitriangular=True)
    s = state_ring[start % n].clone()
    out = torch.zeros_like(new_v)
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(nc):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = query[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + key[:, i].transpose(-1, -2) @ v_new
    state_ring[(start + t) % n] = s
    return out.reshape(hv, -1, dv)[:, :t].transpose(0, 1).to(v.dtype).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    print(f"== chunk_gated_delta_rule, one 9B-like layer ({HK} key / {HV} value heads, {DK} x {DV}), bf16 in ==")
    print(f"{'tokens':>7} {'loop ms':>8} {'batched ms':>11} {'speed-up':>9} {'max |diff|':>11}")
    for t in (int(x) for x in a.tokens.split(",")):
        gen = torch.Generator(device=dev).manual_seed(t)
        q = torch.randn(t, HK, DK, device=dev, generator=gen).bfloat16()
        k = torch.randn(t, HK, DK, device=dev, generator=gen).bfloat16()
        v = torch.randn(t, HV, DV, device=dev, generator=gen).bfloat16()
        g = -torch.rand(t, HV, device=dev, generator=gen) * 0.1
        beta = torch.rand(t, HV, device=dev, generator=gen).bfloat16()
        rings = [torch.zeros(4, HV, DK, DV, device=dev) for _ in range(2)]
        outs = [f(q, k, v, g, beta, r, 0) for f, r in zip((loop_form, R.chunk_gated_delta_rule), rings, strict=True)]
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        args = (q, k, v, g, beta)
        times = [
            time_eager(lambda f=f, r=r, a=args: f(*a, r, 0), iters=5)
            for f, r in zip((loop_form, R.chunk_gated_delta_rule), rings, strict=True)
        ]
        print(f"{t:>7} {times[0] * 1e3:>8.2f} {times[1] * 1e3:>11.2f} {times[0] / times[1]:>8.2f}x {diff:>11.2e}")
    print()
    print("== 9B-like prefill of a 4096-token prompt (24 delta-net layers), each form ==")
    import gpu_bench as G

    from engine import EngineSettings
    from kernels import cuda as C
    from kernels import ops

    eng = G.random_9b_engine(max_context=8192, mtp=False)
    ids = torch.randint(0, 32768, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    target = EngineSettings(speculative=False)
    sess = eng.new_session()
    eng.generate(ids, 1, target, sess)  # warm-up
    for name, f in (("loop", loop_form), ("batched", R.chunk_gated_delta_rule), ("loop", loop_form)):
        for mod in (R, C, ops):
            mod.chunk_gated_delta_rule = f
        sess.reset()
        st = eng.generate(ids, 1, target, sess).stats
        print(f"{name:>8}: {st['prefill_tokens'] / st['prefill_s']:>8,.0f} t/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
