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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="timings of each cell (the fastest is printed)")
    a = ap.parse_args()
    ok, why = ops.use_cuda_kernels(True)
    if not ok:
        print(f"no CUDA kernels: {why}")
        return 1
    slots, hq, hkv, d = 32768, 16, 4, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    kcache = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vcache = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for t in (1, 4):
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cells = []
        for ctx in (128, 512, 2048, 8192, 32768):
            start = torch.tensor([ctx - t], device="cuda")
            fn = lambda q=q, start=start: kc.attention_cached(q, kcache, vcache, start, d**-0.5)  # noqa: E731
            cells.append(f"{ctx} {min(per_call_us(fn) for _ in range(a.reps)):.2f}")
        print(f"attention fold T={t}, us a call at keys: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
