"""Why two runs of the same cell differ: the bundled model (bf16, chain on) at a few depths, interleaved passes,
and per run the t/s beside what could explain a slow one: the GPU's SM clock (NVML, sampled through the run),
the process's CPU time over the wall time (below 1: the process waited for a core), the mean round, and the
mean GPU spans of a round's phases at its main depth.

    python bench/noise_probe.py [--n 2048] [--passes 8] [--depths 7,8,auto] [--workload code_gen]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings  # noqa: E402


class ClockSampler:
    """The SM clock (MHz) every `every` seconds on a thread, while running."""

    def __init__(self, every: float = 0.01) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.every = every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            time.sleep(self.every)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(next((Path(__file__).parent.parent / "assets" / "models").iterdir())))
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--depths", default="7,8,auto")
    ap.add_argument("--workload", default="code_gen")
    a = ap.parse_args()
    eng = Engine.load(Path(a.model), device="cuda", dtype="bfloat16")
    prompt = load_workloads()[a.workload].prompt_for(eng.tokenizer)
    # "8@auto": static depth 8 on a session that an auto run warmed first (every depth's plans captured), to tell
    # what a session holding many plans costs from what the controller costs
    depths = a.depths.split(",")

    def settings_of(d: str) -> EngineSettings:
        d = d.split("@")[0]
        return EngineSettings(
            draft_depth=d if d == "auto" else int(d), max_draft_depth=8, chain=True, plan_pool=16 if d != "auto" else 18
        )

    cells = {d: settings_of(d) for d in depths}
    sessions = {}
    for d, st in cells.items():
        sessions[d] = eng.new_session()
        if d.endswith("@auto"):
            eng.generate(prompt, a.n, settings_of("auto"), sessions[d])
            sessions[d].reset()
        eng.generate(prompt, a.n, st, sessions[d])
    sampler = ClockSampler()
    print(f"device: {torch.cuda.get_device_name()}  {a.workload}, {a.n} tokens, {a.passes} passes")
    print(
        f"{'pass':>4} {'depth':>5} {'t/s':>7} {'cpu/wall':>8} {'SM MHz min..max':>16} {'round ms':>8} "
        f"{'main':>4} {'draft':>6} {'verify':>6} {'accept':>6} {'host':>6} {'acc.len':>7} {'captures':>8}  by depth"
    )
    tps: dict = {d: [] for d in depths}
    for p in range(a.passes):
        for d in depths if p % 2 == 0 else reversed(depths):
            sessions[d].reset()
            gc.collect()
            c0, w0 = time.process_time(), time.perf_counter()
            with sampler:
                stats = eng.generate(prompt, a.n, cells[d], sessions[d]).stats
            cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
            cost = stats["round_cost_by_depth"]
            main_d = max(cost, key=lambda k: cost[k]["rounds"])
            c = cost[main_d]
            clocks = sampler.samples or [0]
            tps[d].append(stats["tokens_per_second"])
            print(
                f"{p:>4} {str(d):>5} {stats['tokens_per_second']:>7.0f} {cpu:>8.2f} "
                f"{min(clocks):>7}..{max(clocks):<7} {1e3 * c['round_s']:>8.3f} {main_d:>4} "
                + " ".join(f"{1e3 * c[k]:>6.3f}" for k in ("draft_s", "verify_s", "accept_s", "host_s"))
                + f" {stats['mean_accepted_length']:>7.2f} {stats['plan_misses']:>8}  "
                + " ".join(f"{k}:{v['rounds']}x{1e3 * v['round_s']:.3f}" for k, v in cost.items())
            )
    for d in depths:
        v = tps[d]
        print(f"depth {d}: min {min(v):.0f} median {statistics.median(v):.0f} max {max(v):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
