"""Decode attention on the GPU: each kernel form ("vec", "warp", "tile") at several blocks a SM, per query width T, at
1k..128k context over a 131584-slot cache with a device start (as inside a captured plan); then the 9B-like
model's target-only decode by context with the best per T. The constants this chose are in kernels/cuda.py.

    python bench/attention_sweep.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_bench as G  # noqa: E402

from engine import EngineSettings  # noqa: E402
from kernels import cuda as C  # noqa: E402
from kernels import reference as R  # noqa: E402

CONTEXTS = [1024, 8192, 32768, 131072]
HQ, HKV, D, SLOTS = 16, 4, 256, 131584
# (form, blocks a SM, vec's unroll)
FORMS = {
    1: [("vec", 4, 2), ("vec", 8, 2), ("vecb", 4, 2), ("vecb", 8, 2), ("vec", 4, 4), ("warp", 8, 0)],
    4: [("tile", 2, 0), ("vec", 4, 2), ("vecb", 4, 2)],
    16: [("tile", 2, 0), ("vec", 4, 2), ("vecb", 4, 2)],
}


def per_call_us(fn, iters: int = 100) -> float:
    """Microseconds per call, ten calls per captured graph (launch overhead out of the figure)."""
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters // 10):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3


def set_form(impl: str, blocks: int, unroll: int) -> None:
    C._ATT_IMPL = impl
    if impl == "warp":
        C._ATT_WARP_BLOCKS_PER_SM = blocks
    elif impl in ("vec", "vecb"):
        C._ATT_VEC_BLOCKS_PER_SM = blocks
        C._ATT_VEC_UNROLL = unroll
    else:
        C._ATT_TILE_BLOCKS_PER_SM = blocks


def sweep() -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    kc = torch.randn(SLOTS, HKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(SLOTS, HKV, D, device=dev, dtype=torch.bfloat16)
    G.say(f"== attention_cached [T, {HQ}, {D}] bf16, {HKV} kv heads, {SLOTS}-slot cache, device start; us per call ==")
    G.say(
        f"{'T':>2} {'form':>5} {'blocks/SM':>9} {'unroll':>6} "
        + " ".join(f"{c:>8}" for c in CONTEXTS)
        + "  max err @8k"
    )
    res = {}
    for t, forms in FORMS.items():
        q = torch.randn(t, HQ, D, device=dev, dtype=torch.bfloat16)
        for impl, blocks, unroll in forms:
            set_form(impl, blocks, unroll)
            got = C.attention_cached(q, kc, vc, torch.tensor([8192 - t], device=dev), D**-0.5).float()
            err = (got - R.attention_cached(q, kc, vc, 8192 - t, D**-0.5).float()).abs().max().item()
            starts = [torch.tensor([c - t], device=dev) for c in CONTEXTS]
            row = [per_call_us(lambda s=s, q=q: C.attention_cached(q, kc, vc, s, D**-0.5)) for s in starts]
            res[(t, impl, blocks, unroll)] = row
            G.say(
                f"{t:>2} {impl:>5} {blocks:>9} {unroll or '-':>6} "
                + " ".join(f"{x:8.1f}" for x in row)
                + f"  {err:.2e}"
            )
    return res


def best(res: dict, t: int) -> tuple:
    rows = {k: v for k, v in res.items() if k[0] == t}
    lows = [min(r[i] for r in rows.values()) for i in range(len(CONTEXTS))]
    return min(rows, key=lambda k: sum(x / lo for x, lo in zip(rows[k], lows, strict=True)))


def decode_by_context() -> None:
    eng = G.random_9b_engine(max_context=SLOTS, mtp=True)
    gen = torch.Generator().manual_seed(1)
    eng.generate(torch.randint(0, 32768, (1024,), generator=gen).tolist(), 64, EngineSettings(speculative=False))
    G.say("9B-like, bf16, target-only, with the forms chosen above:")
    G.decode_by_context(eng, CONTEXTS, gen)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        res = sweep()
        for t in FORMS:
            top = best(res, t)
            G.say(f"best at T={t}: {top[1]} at {top[2]} blocks/SM" + (f", unroll {top[3]}" if top[3] else ""))
        one = best(res, 1)
        set_form(*one[1:])
        C._ATT_IMPL = "auto" if one[1] == "vec" else one[1]  # "vecb" or another form: forced for every width
        G.say()
        decode_by_context()
    finally:
        G.save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
