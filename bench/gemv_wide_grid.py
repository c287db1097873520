"""Is gemm auto's candidate list (kernels/cuda.py gemv_variants) leaving time behind? Per 9B-like product at 1 and
6 rows: cuBLAS, the fastest of the candidates auto times, and the six fastest of a wide grid (every family, 2/4/8
warps, 1/2/4/8 K splits: 48 launches), each timed as auto times it (engine/gemm.py GemvProducts._measure: CUDA graph
over distinct weights past L2, PDL on), in us and % of the device's copy bandwidth (bench/timing.py).

    PYTHONPATH=$PWD python3 bench/gemv_wide_grid.py ["o_proj/out_proj" "mtp fc" ...]   (default: every shape)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_bench import GEMV_SHAPES, pdl_captures  # noqa: E402
from timing import copy_bandwidth  # noqa: E402

from engine.gemm import GemvProducts  # noqa: E402
from kernels import ops  # noqa: E402

WIDE = [f"{fam}.w{w}.s{s}" for fam in ("simt1", "simt2", "tc1", "tc2") for w in (2, 4, 8) for s in (1, 2, 4, 8)]


def main() -> int:
    names = sys.argv[1:] or list(GEMV_SHAPES)
    unknown = [n for n in names if n not in GEMV_SHAPES]
    if unknown:
        print(f"unknown shape(s) {unknown}; choose from {list(GEMV_SHAPES)}")
        return 2
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name(0)}  copy bandwidth {bw / 1e12:.2f} TB/s")
    ops.use_cuda_kernels(True)
    tuner = GemvProducts("auto", torch.device("cuda"), torch.bfloat16, None)
    listed = ops.gemv_variants
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name in names:
        n, k = GEMV_SHAPES[name]
        each = n * k * 2
        ws = [
            (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16() for _ in range(max(2, min(8, -(-3 * l2 // each))))
        ]
        for m in (1, 6):
            moved = each + m * k * 2 + m * n * 2

            def cell(label, t, moved=moved):
                return f"{label} {t:.1f} ({100 * moved / (t * 1e-6) / bw:.0f}%)"

            with pdl_captures(True):
                try:
                    _, now = tuner._measure(m, n, k, ws)
                    ops.gemv_variants = lambda *_: list(WIDE)
                    _, wide = tuner._measure(m, n, k, ws)
                finally:
                    ops.gemv_variants = listed
            ours = {c: t for c, t in now.items() if c != "cublas"}
            best = min(ours, key=ours.get)
            top = sorted((t, c) for c, t in wide.items() if c != "cublas")[:6]
            print(
                f"{name:<16} {n}x{k} M{m}: {cell('cublas', now['cublas'])} | auto's candidates: "
                f"{cell(best, ours[best])} | wide grid: " + ", ".join(cell(c, t) for t, c in top),
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
