"""Decode attention alone, the form a plan runs for the 9B-like model (the butterfly kernel with its splits folded in
the same launch, attn_vecb_u2_g4_f): microseconds a call for T = 1 and 4 query rows at 128..32k keys over a 32768-slot
cache with a device start (so the splits are sized for the cache, as inside a captured plan), bf16, 16 query heads,
4 kv heads, head_dim 256. Run it from two trees to compare their kernels (tools/tree_ab.sh's way).

    python3 bench/attention_fold.py [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import per_call_us  # noqa: E402

from kernels import cuda as kc  # noqa: E402
from kernels import ops  # noqa: E402

SLOTS, HQ, HKV, D = 32768, 16, 4, 256
CONTEXTS = (128, 512, 2048, 8192, 32768)


def fold_calls(rows: tuple[int, ...] = (1, 4)):
    """(query rows, keys, call) for each row count and context of CONTEXTS: attention_cached over one pair of bf16
    caches of SLOTS slots with a device start (the CUDA kernels bound; bench/decode_ab.py --fold-min-keys too)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    kcache = torch.randn(SLOTS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vcache = torch.randn(SLOTS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for t in rows:
        q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for ctx in CONTEXTS:
            start = torch.tensor([ctx - t], device="cuda")
            yield t, ctx, lambda q=q, start=start: kc.attention_cached(q, kcache, vcache, start, D**-0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="timings of each cell (the fastest is printed)")
    a = ap.parse_args()
    ok, why = ops.use_cuda_kernels(True)
    if not ok:
        print(f"no CUDA kernels: {why}")
        return 1
    cells: dict[int, list[str]] = {}
    for t, ctx, call in fold_calls():
        cells.setdefault(t, []).append(f"{ctx} {min(per_call_us(call) for _ in range(a.reps)):.2f}")
    for t, row in cells.items():
        print(f"attention fold T={t}, us a call at keys: " + ", ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
