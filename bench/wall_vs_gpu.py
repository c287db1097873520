"""Does a decode's wall time match the GPU's own time? One process, one engine (the 9B-like model, or --model's):

    python bench/wall_vs_gpu.py [--n 256] [--reps 2] [--gemm auto[,cublas...]] [--model assets/models/specdeck-tiny]

For each --gemm mode in turn (the same engine, the mode set anew each time):

1. `generate(prompt, n)` as bench/decode_ab.py times it (stats tokens_per_second, the engine's own clock).
2. The same generation under torch.profiler, its prefill and first round outside the profile: the GPU span of the
   rounds in the window over their count (counted by their embedding kernels), the kernels' summed spans, and the
   idle gaps between kernels longer than 2 us, grouped by the kernel before them. The difference between 1 and 2 is
   time the GPU waits on the host.
3. The host's own work per round (RoundEvent.time_host_s) and the rounds' times, median and the slowest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import random_9b_engine  # noqa: E402
from profile_9b import _kernel_rows, _short  # noqa: E402
from timing import set_gemm_fresh  # noqa: E402

from engine import Engine, EngineSettings  # noqa: E402

PROMPT = list(range(100, 164))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gemm", default="auto", help="gemm modes, comma list, each measured in turn")
    ap.add_argument("--model", default=None, help="a model folder (bf16 on cuda) instead of the 9B-like model")
    a = ap.parse_args()
    eng = Engine.load(Path(a.model), device="cuda", dtype="bfloat16") if a.model else random_9b_engine()
    for gemm in a.gemm.split(","):
        set_gemm_fresh(eng, gemm)
        print(f"== gemm {gemm}: {a.n} tokens, target-only ==")
        measure(eng, a)
        if eng.model.gemm_choices:
            print("auto's choices: " + ", ".join(f"{k} {v}" for k, v in eng.model.gemm_choices.items()))
    eng.close()
    return 0


def measure(eng: Engine, a: argparse.Namespace) -> None:
    s = EngineSettings(speculative=False, plan_pool=8)
    sess = eng.new_session()
    eng.generate(PROMPT, 16, s, sess)
    for rep in range(a.reps):
        sess.reset()
        events = list(eng.stream(PROMPT, a.n, s, sess))
        run = events[-1].run
        rounds = [e.time_round_s * 1e6 for e in events]
        host = [e.time_host_s * 1e6 for e in events]
        print(
            f"rep {rep}: {run['tokens_per_second']:.1f} t/s (engine clock, {len(events)} rounds); round us median "
            f"{statistics.median(rounds):.1f}, slowest {max(rounds):.1f}, first {rounds[0]:.1f}; host us a round "
            f"median {statistics.median(host):.1f}, slowest {max(host):.1f}"
        )
    sess.reset()
    stream = eng.stream(PROMPT, a.n, s, sess)
    next(stream)  # the prefill and the first round, outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        events = list(stream)
        torch.cuda.synchronize()
    run = events[-1].run
    dec = _kernel_rows(prof)
    # a round's plan runs its embedding once: the rounds whose kernels the window holds (one may have been queued
    # before the profile began)
    n_rounds = sum(1 for r in dec if r[2].startswith("embed_rmsnorm"))
    span = dec[-1][1] - dec[0][0]
    busy = sum(e - b for b, e, _ in dec)
    print(
        f"profiled: {run['tokens_per_second']:.1f} t/s engine clock; {n_rounds} rounds' kernels in the window; GPU "
        f"span {span / n_rounds:.1f} us a round ({1e6 / (span / n_rounds):.1f} t/s), kernels' spans summed "
        f"{busy / n_rounds:.1f} us a round, {len(dec) / n_rounds:.1f} kernels and copies a round"
    )
    gaps: dict[str, list[float]] = defaultdict(list)
    last_end = dec[0][1]
    for i in range(1, len(dec)):
        b, e, name = dec[i]
        g = b - last_end
        if g > 2.0:
            gaps[f"{_short(dec[i - 1][2])} -> {_short(name)}"].append(g)
        last_end = max(last_end, e)
    total = sum(sum(v) for v in gaps.values())
    print(f"idle gaps > 2 us: {total / n_rounds:.1f} us a round")
    for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(
            f"  {k:<70} {len(v):>5} gaps, mean {statistics.mean(v):8.1f} us, max {max(v):8.1f}, {sum(v) / n_rounds:7.1f} us/round"
        )
    own: dict[str, list[float]] = defaultdict(list)
    for b, e, name in dec:
        own[_short(name)].append(e - b)
    print("kernels by their summed spans:")
    for k, v in sorted(own.items(), key=lambda kv: -sum(kv[1]))[:16]:
        print(
            f"  {k:<40} {len(v) / n_rounds:6.1f} a round, mean {statistics.mean(v):7.2f} us, {sum(v) / n_rounds:7.1f} us/round"
        )


if __name__ == "__main__":
    raise SystemExit(main())
