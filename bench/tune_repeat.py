"""How steady gemm "auto"'s choices are: the 9B-like model's shapes measured from scratch --times times in one
process (a fresh measurement each, no cache), then every (shape, row bucket) whose choice was not the same every
time, with the us each time of the candidates it went to. Run from two trees (tools/tree_ab.sh-style) to compare
two ways of measuring.

    python bench/tune_repeat.py [--times 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import random_9b_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", type=int, default=3)
    a = ap.parse_args()
    eng = random_9b_engine()
    model = eng.model
    runs = []
    for _ in range(a.times):
        with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:
            t0 = time.perf_counter()
            model.set_gemm("auto", cache_dir=cache)
            took = time.perf_counter() - t0
        g = model._gemv
        runs.append((dict(g.choices), dict(g.timings)))
        print(f"measured {g.measured} (shape, bucket) pairs in {took:.1f} s")
    keys = sorted(runs[0][0])
    moved = [key for key in keys if len({choices.get(key) for choices, _ in runs}) > 1]
    print(f"choices that were not the same all {a.times} times: {len(moved)} of {len(keys)}")
    for n, k, b in moved:
        picks = [choices[(n, k, b)] for choices, _ in runs]
        shown = []
        for _, timings in runs:
            t = timings.get((n, k, b), {})
            shown.append(" / ".join(f"{c} {t[c]:.2f}" for c in dict.fromkeys(picks) if c in t))
        print(f"  {n}x{k} bucket {b}: {' | '.join(picks)}; us: {' | '.join(shown)}")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
