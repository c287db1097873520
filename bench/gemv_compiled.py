"""Can a PyTorch-generated (torch.compile / Triton) one-token product beat cuBLAS on the 9B shapes?

    python bench/gemv_compiled.py
Graph-timed, distinct weights per call; prints us and % of the copy bandwidth per variant and shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_9b import SHAPES  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402


def main() -> int:
    try:
        import triton

        print("triton", triton.__version__)
    except Exception as e:  # noqa: BLE001
        print("no triton:", e)
        return 0
    import torch._inductor.config as ic

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")

    def red(x, w):
        return (w * x).sum(-1, dtype=torch.float32).to(torch.bfloat16)[None]

    variants = {
        "cublas": lambda x, w: F.linear(x, w),
        "compiled reduction": torch.compile(red, dynamic=False),
    }
    ic.max_autotune_gemm_backends = "TRITON"
    variants["compiled mm max-autotune triton"] = torch.compile(
        lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False
    )
    print(f"{'shape':<24}" + "".join(f"{n:>34}" for n in variants))
    for name, (n, k, _) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        cells = []
        for vname, fn in variants.items():
            try:
                out = fn(x if vname != "compiled reduction" else x[0], ws[0]).float()
                err = float((out.reshape(-1) - ref.reshape(-1)).abs().max() / ref.abs().max())
                i = [0]

                def call(fn=fn, i=i, vname=vname, x=x, ws=ws):
                    fn(x if vname != "compiled reduction" else x[0], ws[i[0] % 4])
                    i[0] += 1

                t = graph_time(call)
                cells.append(f"{t * 1e6:>12.1f} us {100 * n * k * 2 / t / bw:>4.0f}% err {err:.1e}")
            except Exception as e:  # noqa: BLE001
                cells.append(f"{'failed: ' + type(e).__name__:>34}")
        print(f"{name:<24}" + "".join(f"{c:>34}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
