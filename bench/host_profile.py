"""Where the host's time goes in a decode round: cProfile over target-only generations, per gemm mode.

    python bench/host_profile.py [--model assets/models/specdeck-tiny] [--gemm cublas,auto] [--n 256] [--top 25]

A launch-bound model (the bundled one) decodes as fast as the host can launch its rounds; this prints, for each
--gemm mode on one engine, the engine clock's t/s without the profiler, then the functions that take the host's time
per round under cProfile (own time and cumulative), so that two modes' host paths can be compared line by line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import set_gemm_fresh  # noqa: E402

from engine import Engine, EngineSettings  # noqa: E402

PROMPT = list(range(100, 164))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/models/specdeck-tiny")
    ap.add_argument("--gemm", default="cublas,auto", help="gemm modes, comma list, each profiled in turn")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--spec", action="store_true", help="speculative (depth 5, chain) instead of target-only")
    a = ap.parse_args()
    eng = Engine.load(Path(a.model), device="cuda", dtype="bfloat16")
    s = (
        EngineSettings(draft_depth=5, chain=True, plan_pool=8)
        if a.spec
        else EngineSettings(speculative=False, plan_pool=8)
    )
    for gemm in a.gemm.split(","):
        set_gemm_fresh(eng, gemm)
        sess = eng.new_session()
        eng.generate(PROMPT, 16, s, sess)  # every plan captured
        sess.reset()
        out = eng.generate(PROMPT, a.n, s, sess)
        rounds = out.stats.get("rounds", a.n)
        print(f"== gemm {gemm}: {out.stats['tokens_per_second']:.1f} t/s without the profiler ==")
        sess.reset()
        prof = cProfile.Profile()
        prof.enable()
        out = eng.generate(PROMPT, a.n, s, sess)
        prof.disable()
        print(f"under cProfile: {out.stats['tokens_per_second']:.1f} t/s")
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
            body = buf.getvalue()
            print(f"-- by {key} (calls over {rounds} rounds) --")
            if key == "tottime":  # the header's "N function calls in S seconds": the host's whole time
                print(next(line.strip() for line in body.splitlines() if "function calls" in line))
            print(body[body.find("ncalls") :].rstrip())
        print()
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
