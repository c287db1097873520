"""Host-side phases of a round (wall clock, no profiler): launch, wait in the one sync, after it.

python bench/round_phases.py [--device cuda] [--dtype bfloat16] [--n 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.spec as spec  # noqa: E402
from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=256)
    a = ap.parse_args()
    eng = Engine.load(device=a.device, dtype=a.dtype)
    outcomes = []
    real = spec.finish_round  # every round the engine runs ends here (launch_round queued it)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        outcomes.append(out)
        return out

    import engine.engine as engine_mod

    engine_mod.finish_round = recording
    prompt = load_workloads()["code_echo"].prompt
    print(
        f"{'config':<24} {'round ms':>9} {'launch':>8} {'wait':>8} {'after':>8} {'engine':>8} {'tok/rnd':>8} {'t/s':>8}"
    )
    for label, s in (
        ("target-only", EngineSettings(speculative=False, plan_pool=8)),
        ("spec depth 3 chain", EngineSettings(draft_depth=3, plan_pool=8)),
        ("spec depth 5 chain", EngineSettings(draft_depth=5, plan_pool=8)),
    ):
        sess = eng.new_session()
        eng.generate(prompt, a.n, s, sess)
        sess.reset()
        outcomes.clear()
        t0 = time.perf_counter()
        events = list(eng.stream(prompt, a.n, s, sess))
        wall = time.perf_counter() - t0 - events[-1].run["prefill_s"]
        r = len(outcomes)
        res_stats = events[-1].run

        def ms(key):
            return 1e3 * statistics.fmean(getattr(o, key) for o in outcomes)

        per_round = 1e3 * wall / r  # wall clock per round, prefill excluded
        engine_ms = 1e3 * statistics.fmean(ev.time_round_s for ev in events if ev.tokens)
        engine_ms -= ms("host_launch_s") + ms("host_wait_s") + ms("host_after_s")
        print(
            f"{label:<24} {per_round:>9.3f} {ms('host_launch_s'):>8.3f} {ms('host_wait_s'):>8.3f} "
            f"{ms('host_after_s'):>8.3f} {engine_ms:>8.3f} {res_stats['generated'] / r:>8.2f} "
            f"{res_stats['tokens_per_second']:>8.0f}"
        )
    print("launch: round start until the verify plan is launched (staging, draft plan, verify plan);")
    print("wait: the one synchronisation; after: acceptance bookkeeping; engine: event, decode, stats;")
    print("round ms - (launch + wait + after + engine) = the generator hand-off and the caller's loop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
