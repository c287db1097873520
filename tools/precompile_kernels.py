"""Compile every CUDA module SpecDeck may load (kernels.cuda.module_codes: decode and gemv kernels per dtype, the
fused in_proj forms per dtype and rule size, sampling) side by side, one process each, into CuPy's kernel cache
(CUPY_CACHE_DIR, else ~/.cupy/kernel_cache), for the GPU of this machine. A later first use then loads them from
the cache instead of compiling one module after another (NVRTC takes 20-60 s a module).

    python tools/precompile_kernels.py [--jobs N] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _compile(item: tuple[str, str]) -> tuple[str, float, str]:
    label, code = item
    t0 = time.perf_counter()
    try:
        import cupy

        from kernels.cuda import _OPTIONS

        cupy.RawModule(code=code, options=_OPTIONS).compile()
        return label, time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        return label, time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--only", default="", help="compile only the modules whose label contains this")
    a = ap.parse_args()
    from kernels.cuda import module_codes

    items = [(label, code) for label, code in module_codes().items() if a.only in label]
    t0 = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for label, seconds, error in pool.map(_compile, items):
            print(f"{label}: {'FAILED ' + error if error else 'compiled'} ({seconds:.1f} s)")
            failed += bool(error)
    print(f"{len(items)} modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
