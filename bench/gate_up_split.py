"""The 9B-like MLP's gate|up + silu_mul as gemm auto times it, with a K-split variant's split sum and activation
in a launch of its own (gemv_combine_sm, the default) and in the product's launch (the "_ss" forms,
kernels.cuda._GEMV_SPLIT_SILU), in one process, twice in turn: us per call of every candidate and auto's pick.

    python bench/gate_up_split.py [--rows 1,4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import gemm  # noqa: E402
from kernels import cuda as kc  # noqa: E402
from kernels import ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ops.use_cuda_kernels(True)
    kc.warm_up(dev, dtype)
    n, k = 2 * 12288, 4096
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dtype)
    with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:  # never the user's cache
        products = gemm.gemv_products("auto", dev, dtype, cache)
    for m in (int(r) for r in a.rows.split(",")):
        for on in (False, True, False, True):
            kc._GEMV_SPLIT_SILU = on
            pick, times = products._measure(m, n, k, [w], "silu")
            form = "one launch" if on else "two launches"
            shown = ", ".join(f"{c} {t:.2f}" for c, t in sorted(times.items(), key=lambda ct: ct[1]))
            print(f"{n}x{k} m{m} + silu, a split's sum in {form}: auto {pick}; us {shown}")
    kc._GEMV_SPLIT_SILU = False
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
