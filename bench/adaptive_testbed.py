"""Adaptive depth offline, on the CPU: the bundled model's real drafts, acceptance and round alignment (fp32),
each round costed at a GPU's measured time of a round at its depth instead of the CPU's clock, so the depth
controller (engine/adaptive.py) decides from GPU-like costs. Prints, per workload, every static depth and auto
(a warm-up run, then the median of `--reps` runs on the same session, as `gpu_bench.py --sections auto`) in
GPU-equivalent tokens/s. Where auto here is at the best static depth and on the GPU it is not, the difference is in
what the controller measures on the GPU, not in its model of a round.

    python bench/adaptive_testbed.py [--n 512] [--reps 3] [--costs 0.422,0.496,...]   # ms a round, depth 1..8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.adaptive as adaptive  # noqa: E402
from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings, bundled_model_dir  # noqa: E402

# H200, bundled model, bf16, chain: round time = accepted length / t/s of the static runs of
# bench/results/h200-adaptive-2026-12-01.txt (512 tokens, median of 3; code_edit, code_echo and prose averaged)
H200_COSTS_MS = (0.422, 0.496, 0.563, 0.642, 0.720, 0.800, 0.870, 0.964)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--costs", default=",".join(f"{c:g}" for c in H200_COSTS_MS))
    ap.add_argument("--noise", type=float, default=0.04, help="relative spread of a round's time (uniform)")
    ap.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="phases of a slower machine, as seen on the H200 host (other load, the host's Python): every 30..200 "
        "rounds every depth's time is multiplied by a new factor drawn from 1..1+drift (the controller sees it; "
        "t/s is still counted at the undrifted costs, so drift can only mislead it)",
    )
    a = ap.parse_args()
    costs = [float(c) * 1e-3 for c in a.costs.split(",")]
    rng = random.Random(0)
    observe = adaptive.DepthController.observe

    phase = {"left": 0, "factor": 1.0}

    def gpu_clock(self, depth, drafted, accepted, round_s, captured):  # the CPU's round time replaced
        if phase["left"] <= 0:
            phase["left"], phase["factor"] = rng.randint(30, 200), 1.0 + a.drift * rng.random()
        phase["left"] -= 1
        t = costs[depth - 1] * phase["factor"] * (1 + a.noise * (rng.random() - 0.5))
        return observe(self, depth, drafted, accepted, t, captured)

    adaptive.DepthController.observe = gpu_clock

    def gpu_tps(stats: dict) -> float:
        spent = sum(c["rounds"] * costs[d - 1] for d, c in stats["round_cost_by_depth"].items() if d > 0)
        return stats["generated"] / spent

    eng = Engine.load(bundled_model_dir())
    depths = range(1, len(costs) + 1)
    print(f"bundled model on the CPU (fp32), rounds costed at {a.costs} ms (depth 1..{len(costs)}), {a.n} tokens")
    print(f"{'workload':<10} " + " ".join(f"{d:>6}" for d in depths) + f" {'auto':>6}   auto vs best static")
    shares = []
    for name, w in load_workloads().items():
        prompt = w.prompt_for(eng.tokenizer)
        sess = eng.new_session()
        static = {}
        for d in depths:
            sess.reset()
            static[d] = gpu_tps(eng.generate(prompt, a.n, EngineSettings(draft_depth=d, chain=True), sess).stats)
        auto_settings = EngineSettings(draft_depth="auto", max_draft_depth=len(costs), chain=True)
        sess = eng.new_session()
        eng.generate(prompt, a.n, auto_settings, sess)  # warm-up: the controller's sweep
        runs, spent = [], {}
        for _ in range(a.reps):
            sess.reset()
            st = eng.generate(prompt, a.n, auto_settings, sess).stats
            runs.append(gpu_tps(st))
            for d, c in st["round_cost_by_depth"].items():
                spent[d] = spent.get(d, 0) + c["rounds"]
        auto = statistics.median(runs)
        best = max(depths, key=lambda d: static[d])
        shares.append(auto / static[best])
        print(
            f"{name:<10} " + " ".join(f"{static[d]:6.0f}" for d in depths) + f" {auto:6.0f}   {auto / static[best]:.3f}"
            f" of depth {best}; auto's rounds by depth: " + " ".join(f"{k}:{v}" for k, v in sorted(spent.items()))
        )
    print(f"mean {statistics.fmean(shares):.3f}, lowest {min(shares):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
