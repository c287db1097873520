"""How many CPU threads PyTorch gets: one rule for the CLI (generate, bench), the app and bench/.

PyTorch's CPU pool takes every core and each op waits for its slowest thread, so a pool sharing
its cores with anything else (the window's thread, a browser, a second process) makes every op
wait. Seen on a 2-core machine: `generate` at 2-14 tokens/s with 2 threads and 78-117 with one,
and an A/B bench whose sign flipped with the thread count. The default therefore leaves one core
free: the usable cores minus one (at least 1, at most what PyTorch would pick itself).

Order of precedence: `--threads N` (CLI) > `SPECDECK_CPU_THREADS=N` > the default.
"""

from __future__ import annotations

import os

THREADS_ENV = "SPECDECK_CPU_THREADS"

_torch_default: int | None = None  # what PyTorch picked before SpecDeck changed it


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    """The usable cores minus one (at least 1), and no more than PyTorch's own choice (physical cores)."""
    cores = max(1, usable_cores() - 1)
    global _torch_default
    if _torch_default is None:
        try:
            import torch

            _torch_default = torch.get_num_threads()
        except ImportError:
            _torch_default = cores
    return max(1, min(cores, _torch_default))


def _parse(value: object, where: str) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{where} must be a whole number of threads (1 or more), got {value!r}")
    return int(text)


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """(thread count, where it came from: 'threads flag' / SPECDECK_CPU_THREADS / 'default').
    A bad --threads or SPECDECK_CPU_THREADS is a ValueError naming it."""
    if requested is not None:
        return _parse(requested, "--threads"), "--threads"
    override = os.environ.get(THREADS_ENV, "").strip()
    if override:
        return _parse(override, THREADS_ENV), THREADS_ENV
    return default_cpu_threads(), f"default: {usable_cores()} usable cores, one left free"


def apply_cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """Set PyTorch's intra-op threads by the rule above; returns (count, where it came from)."""
    threads, source = cpu_threads(requested)
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads, source


def cpu_threads_for_the_engine() -> int:
    """Intra-op threads for CPU runs in the window: the rule above, the same as the CLI's (one core fewer
    than the process may use; SPECDECK_CPU_THREADS overrides). The window's thread needs a share of one
    core to draw, and a pool thread sharing that core makes every op wait for it (seen on a 2-core
    machine: rounds 10x slower with 2 threads than with 1). A bad SPECDECK_CPU_THREADS falls back to the
    default here (the CLI refuses it)."""
    try:
        return cpu_threads()[0]
    except ValueError:
        return default_cpu_threads()
