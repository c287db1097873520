"""GPU timing shared by the bench scripts: CUDA-event timing of eager calls, of calls replayed from a
captured graph, and the device-copy bandwidth the bandwidth figures are measured against.
Every timing function returns seconds (per call, median over `reps`). Also set_gemm_fresh: a gemm mode set with an
autotune cache of its own."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable

import torch


def _median_event_time(run: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def time_eager(fn: Callable[[], object], iters: int, reps: int = 5) -> float:
    """Seconds per call of `iters` back-to-back eager calls (host launch overhead included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(iters):
            fn()

    return _median_event_time(run, reps) / iters


def graph_time(fn: Callable[[], object], calls: int = 20, reps: int = 5) -> float:
    """Seconds per call, replayed from a CUDA graph of `calls` back-to-back calls (device time only)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # eager warm-up off the capturing stream, as torch recommends
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return _median_event_time(g.replay, reps) / calls


def copy_bandwidth(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written, per second)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_eager(lambda x=x, y=y: y.copy_(x), iters=1, reps=10)
    x = y = None  # free the 2 x nbytes before returning
    torch.cuda.empty_cache()
    return 2 * nbytes / t


def kernel_times(prof) -> dict[str, list[float]]:
    """GPU time (us) and launch count per kernel name from a finished torch.profiler run: name -> [us, count]."""
    from collections import defaultdict

    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        row = by_name[e.name]
        row[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        row[1] += 1
    return by_name


def set_gemm_fresh(eng, mode: str) -> None:
    """`eng`'s gemm `mode` set with an autotune cache of its own, deleted after: "auto" measures its choices from
    scratch, as on a new GPU, and never reads or writes the user's cache."""
    with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:
        eng.model.set_gemm(mode, cache_dir=cache)
