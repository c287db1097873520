"""Micro-benchmark: each CuPy kernel (kernels/cuda.py) against its PyTorch reference, on the GPU.

    python bench/kernels_bench.py [--dtype bf16|fp32] [--iters 50] [--reps 5] [--ctx 1024,8192,32768]

Shapes: the bundled model (hidden 384, 6/2 heads of 64, linear Hk 2 / Hv 4, dk = dv = 64, vocab 16384) and
a Qwen3.5-9B-like model (hidden 4096, 16/4 heads of 256, linear Hk 16 / Hv 32, dk = dv = 128, vocab 32768
and 262144 for argmax). T = 1 (a decode step) and T = 9 (verify at depth 8).

Columns: `ref` and `cuda` are eager calls (Python launch overhead included, what a plan_pool = 0 run pays);
`graph` is the kernel's device time per call, replayed from a CUDA graph of 20 calls (what a captured plan
pays); `GB/s` is the bytes the op must move divided by the graph time, where that is well defined.
Each figure: median over `reps` timings of `iters` back-to-back calls, after a warm-up.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cuda as kc  # noqa: E402
from kernels import reference as ref  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_time, time_eager  # noqa: E402

DEV = torch.device("cuda")

SHAPES = {
    "bundled": dict(hidden=384, hq=6, hkv=2, d=64, rot=16, hk=2, hv=4, dk=64, dv=64, vocab=16384),
    "9b": dict(hidden=4096, hq=16, hkv=4, d=256, rot=64, hk=16, hv=32, dk=128, dv=128, vocab=32768),
}


def cases(name: str, s: dict, t: int, dtype: torch.dtype, ctxs: list[int]):
    """Yield (op, detail, ref_fn, cuda_fn, bytes moved or 0)."""
    r = lambda *shape, sc=1.0: (torch.randn(*shape, device=DEV) * sc).to(dtype)  # noqa: E731
    el = torch.tensor([], dtype=dtype).element_size()
    h, hq, hkv, d = s["hidden"], s["hq"], s["hkv"], s["d"]
    hk, hv, dk, dv = s["hk"], s["hv"], s["dk"], s["dv"]
    x, res, w = r(t, h), r(t, h), r(h, sc=0.1)
    yield "rmsnorm", f"[{t},{h}]", lambda: ref.rmsnorm(x, w, 1e-6), lambda: kc.rmsnorm(x, w, 1e-6), 2 * t * h * el
    yield (
        "add_rmsnorm",
        f"[{t},{h}]",
        lambda: ref.add_rmsnorm(x, res, w, 1e-6),
        lambda: kc.add_rmsnorm(x, res, w, 1e-6),
        4 * t * h * el,
    )
    qg = r(t, hq, 2 * d)
    qv, wq = qg[..., :d], r(d, sc=0.1)
    yield "rmsnorm q-heads", f"[{t},{hq},{d}]", lambda: ref.rmsnorm(qv, wq, 1e-6), lambda: kc.rmsnorm(qv, wq, 1e-6), 0
    o, z, wn = r(t, hv, dv), r(t, hv, dv), r(dv)
    yield (
        "gated_rmsnorm",
        f"[{t},{hv},{dv}]",
        lambda: ref.gated_rmsnorm(o, z, wn, 1e-6),
        lambda: kc.gated_rmsnorm(o, z, wn, 1e-6),
        3 * t * hv * dv * el,
    )
    q = r(t, hq, d)
    start_t = torch.tensor([0], dtype=torch.int64, device=DEV)
    for ctx in ctxs:
        kcache, vcache = r(ctx + 64, hkv, d), r(ctx + 64, hkv, d)
        st = ctx - t
        st_dev = torch.tensor([st], dtype=torch.int64, device=DEV)
        yield (
            "attention_cached",
            f"ctx {ctx} Hq {hq}/{hkv} D {d}",
            partial(ref.attention_cached, q, kcache, vcache, st, d**-0.5),
            partial(kc.attention_cached, q, kcache, vcache, st_dev, d**-0.5),
            2 * ctx * hkv * d * el,
        )
    c = 2 * hk * dk + hv * dv
    xc, ring, wc = r(t, c), r(18, c, 3), r(c, 4)
    yield (
        "conv_update",
        f"C {c}",
        lambda: ref.conv_update(xc, ring, wc, 3),
        lambda: kc.conv_update(xc, ring, wc, start_t),
        (2 * t * c + c * 3 * (1 + t)) * el,
    )
    qkv = r(t, 2 * hk * dk + hv * dv)
    qd, kd, vd = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    qd, kd, vd = qd.reshape(t, hk, dk), kd.reshape(t, hk, dk), vd.reshape(t, hv, dv)
    g = -torch.rand(t, hv, device=DEV)
    beta = torch.sigmoid(r(t, hv))
    state = torch.randn(18, hv, dk, dv, device=DEV) * 0.1
    yield (
        "gated_delta_rule",
        f"Hk {hk} Hv {hv} dk {dk} dv {dv}",
        lambda: ref.gated_delta_rule(qd, kd, vd, g, beta, state, 3),
        lambda: kc.gated_delta_rule(qd, kd, vd, g, beta, state, start_t),
        hv * dk * dv * 4 * (1 + t),
    )
    for vocab in [s["vocab"]] + ([262144] if name == "9b" else []):
        lg = r(t, vocab, sc=2.0)
        yield (
            "argmax_prob",
            f"V {vocab}",
            partial(ref.argmax_prob, lg, 0),
            partial(kc.argmax_prob, lg, 0),
            lg.numel() * el,
        )
    if t > 1:
        n = t - 1
        drafts = torch.randint(0, 100, (n,), device=DEV)
        probs = torch.rand(n, device=DEV)
        target = torch.cat((drafts, drafts[:1]))
        cl = torch.zeros(1, dtype=torch.int64, device=DEV)
        out = torch.zeros(n + 3, dtype=torch.int64, device=DEV)
        yield (
            "greedy_accept",
            f"n {n}",
            lambda: ref.greedy_accept(drafts, probs, target, 0.3, cl, out),
            lambda: kc.greedy_accept(drafts, probs, target, 0.3, cl, out),
            0,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx", default="1024,8192,32768")
    ap.add_argument("--t", default="1,9")
    a = ap.parse_args()
    ok, why = kc.available()
    if not ok:
        print(f"CUDA kernels unavailable: {why}")
        return
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kc.warm_up(DEV, dtype)
    print(f"# {torch.cuda.get_device_name()} | {why} | dtype {a.dtype} | times in us per call")
    hdr = (
        f"{'shape':8} {'T':>2} {'op':17} {'detail':27} {'ref':>9} {'cuda':>9} {'graph':>8} {'ref/graph':>9} {'GB/s':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    ctxs = [int(c) for c in a.ctx.split(",")]
    for name, s in SHAPES.items():
        for t in [int(v) for v in a.t.split(",")]:
            for op, detail, rf, cf, nbytes in cases(name, s, t, dtype, ctxs):
                tr = 1e6 * time_eager(rf, max(5, a.iters // 5), a.reps)  # microseconds
                tc = 1e6 * time_eager(cf, a.iters, a.reps)
                try:
                    tg = 1e6 * graph_time(cf, reps=a.reps)
                except Exception as e:  # noqa: BLE001
                    print(f"  graph timing failed for {op}: {type(e).__name__}: {e}")
                    tg = float("nan")
                bw = f"{nbytes / (tg * 1e-6) / 1e9:7.0f}" if nbytes and tg == tg else f"{'':>7}"
                print(
                    f"{name:8} {t:>2} {op:17} {detail:27} {tr:9.1f} {tc:9.1f} {tg:8.2f} {tr / tg:9.1f} {bw}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
