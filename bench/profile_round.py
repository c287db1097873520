"""Where a round's time goes on the GPU: torch.profiler over a few rounds, target-only and speculative.

  python bench/profile_round.py [--depth 3] [--rounds 30]
Prints wall time per round, GPU busy time per round, and the top kernels by total GPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--n", type=int, default=96)
    a = ap.parse_args()
    eng = Engine.load(device="cuda", dtype="bfloat16")
    prompt = load_workloads()["code_echo"].prompt
    for label, s in (
        ("target-only", EngineSettings(speculative=False, plan_pool=8)),
        (f"speculative depth {a.depth}", EngineSettings(draft_depth=a.depth, plan_pool=8)),
    ):
        sess = eng.new_session()
        eng.generate(prompt, a.n, s, sess)  # warm: every plan captured
        sess.reset()
        stream = eng.stream(prompt, a.n, s, sess)
        next(stream)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            rounds = sum(1 for _ in stream)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        gpu_total = sum(e.self_device_time_total for e in events) / 1e3  # ms
        print(
            f"== {label}: {rounds} rounds, wall {1e3 * wall / rounds:.3f} ms/round, "
            f"GPU busy {gpu_total / rounds:.3f} ms/round =="
        )
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
