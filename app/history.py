"""RunHistory: the figures of a run, round by round, kept without Qt.

The Live tab's plots (app.gui.plots.RunPlots) draw from one RunHistory; everything they show is
here, so it can be recorded, exported and tested without a window:

- ring buffers of per-round figures (ROUND_COLUMNS, the last `capacity` rounds; older ones drop off);
- rolling statistics: the SMOOTHING_ROUNDS-round rates written beside each round's own figures, and
  the acceptance by draft position since the latest settings change (and the segment before it);
- markers: each settings change the engine applied (a round whose settings differ from the round
  before), and the stop / start of a run stopped and started again (a row of NaNs lies between them,
  so curves drawn with connect="finite" break there);
- the engine's memory breakdown and the monitor's per-GPU memory readings;
- CSV export (one row per round, with the settings it ran with and the marker where they changed) and
  reading an export back as an overlay to compare a run with.

A missing reading is stored as NaN and exported as an empty cell, never as 0.
"""

from __future__ import annotations

import csv
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.settings import knobs

SMOOTHING_ROUNDS = 16  # the window of the smoothed series (a rate over rounds, not an EMA)
ROUND_HISTORY = 50_000  # rounds kept for plots and CSV; older ones drop off
MEMORY_HISTORY = 20_000  # memory samples kept
GIB = 1024**3
# RoundEvent's time split, draft first: (event field in seconds, column in milliseconds).
TIME_SPLIT_COLUMNS = (
    ("time_draft_s", "time_draft_ms"),
    ("time_verify_s", "time_verify_ms"),
    ("time_accept_s", "time_accept_ms"),
    ("time_host_s", "time_host_ms"),
)
# The engine's own memory breakdown (eng.memory(), RoundEvent.run["memory"]), bottom up.
ENGINE_MEMORY_COMPONENTS = ("weights", "kv_cache", "snapshot_planes", "graph_pools", "workspace")
# Columns of the per-round buffers (also the CSV columns, in this order).
ROUND_COLUMNS = [
    "time_s",
    "run",
    "round",
    "tokens",
    "drafted",
    "accepted",
    "tokens_per_second",
    "tokens_per_second_smoothed",
    "acceptance_rate",
    "acceptance_rate_smoothed",
    "accepted_length",
    "accepted_length_smoothed",
    "depth",
    "pipelined",  # 1: the round was queued before the one ahead of it was read (RoundEvent.pipelined)
    *(column for _, column in TIME_SPLIT_COLUMNS),
    "time_round_ms",
    "engine_memory_bytes",
] + [f"engine_{name}_bytes" for name in ENGINE_MEMORY_COMPONENTS]
CSV_EXTRA_COLUMNS = ["settings", "marker"]  # after ROUND_COLUMNS in an export
OVERLAY_SERIES = ("tokens_per_second_smoothed", "acceptance_rate_smoothed", "accepted_length_smoothed")
_INTEGER_COLUMNS = {"run", "round", "tokens", "drafted", "accepted", "pipelined"}

# Short names for marker labels: "depth 3→5", "chain on" (EngineSettings' field metadata).
KNOB_SHORT_NAMES = {k.name: k.short for k in knobs()}


class RingBuffer:
    """The last `capacity` floats, read back oldest-first as a contiguous float64 array.

    Each value is stored twice (at i and i + capacity) so the window is always one slice.
    None is stored as NaN: a missing reading is a gap, never a zero.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a ring buffer holds at least one value, got capacity {capacity}")
        self.capacity = capacity
        self._data = np.full(2 * capacity, np.nan, dtype=np.float64)
        self._next = 0
        self._count = 0

    def append(self, value: float | None) -> None:
        value = np.nan if value is None else float(value)
        self._data[self._next] = value
        self._data[self._next + self.capacity] = value
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def array(self) -> np.ndarray:
        """A copy (a curve keeps it while we go on writing)."""
        end = self._next if self._next >= self._count else self._next + self.capacity
        return self._data[end - self._count : end].copy()

    def last(self) -> float:
        return self._data[(self._next - 1) % self.capacity] if self._count else math.nan

    def clear(self) -> None:
        self._data.fill(np.nan)
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count


@dataclass(frozen=True)
class Marker:
    """A settings change the engine applied: at `round_number` (counted since the history was cleared)."""

    time_s: float
    round_number: int
    label: str  # the whole label (CSV, tooltip)


@dataclass(frozen=True)
class RunMark:
    """Where a run was stopped or started again (a gap lies between a stop and the next start)."""

    time_s: float
    kind: str  # "start" | "stop"


@dataclass
class Overlay:
    """A previous run kept for comparison: time since its start and its smoothed series."""

    name: str
    time_s: np.ndarray
    series: dict[str, np.ndarray]


def settings_change_label(before: Any, after: Any) -> str:
    """'depth 3→5, chain on' for two EngineSettings values."""
    parts = []
    for name, (old, new) in before.diff(after).items():
        label = KNOB_SHORT_NAMES.get(name, name)
        if isinstance(new, bool):
            parts.append(f"{label} {'on' if new else 'off'}")
        elif name == "sub_vocab":
            parts.append(f"{label} {old or 'all'}→{new or 'all'}")
        else:
            parts.append(f"{label} {old:g}→{new:g}" if isinstance(new, float) else f"{label} {old}→{new}")
    return ", ".join(parts)


def settings_summary(settings: Any) -> str:
    """One-line description of a whole EngineSettings: for CSV rows and the bar chart legend."""
    if not settings.speculative:
        return "speculative off"
    depth = f"auto ≤{settings.max_draft_depth}" if settings.adaptive else settings.draft_depth
    return (
        f"depth {depth}, p_min {settings.p_min:g}, "
        f"chain {'on' if settings.chain else 'off'}, sub-vocab {settings.sub_vocab or 'all'}, "
        f"mirror {'on' if settings.mirror_output else 'off'}, pool {settings.plan_pool}"
    )


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each value and the window - 1 before it (fewer at the start); NaN counts as 0."""
    if values.size == 0:
        return values
    clean = np.nan_to_num(values)
    sums = np.cumsum(clean)
    out = np.empty_like(clean)
    out[:window] = sums[:window] / np.arange(1, min(window, clean.size) + 1)
    if clean.size > window:
        out[window:] = (sums[window:] - sums[:-window]) / window
    return out


def safe_ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, NaN where the denominator is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, numerator / np.maximum(denominator, 1), np.nan)


class Columns(dict):
    """The round columns as arrays, each copied out of its ring buffer the first time it is read
    (a frame copies out only the columns it draws)."""

    def __init__(self, buffers: Mapping[str, RingBuffer]) -> None:
        super().__init__()
        self._buffers = buffers

    def __missing__(self, name: str) -> np.ndarray:
        value = self[name] = self._buffers[name].array()
        return value


class RunHistory:
    """Per-round figures, rolling statistics, markers and memory readings of the runs since the last
    clear(); see the module's docstring. Fed by the window's worker (add_round) and the monitor
    (add_memory_sample); read by the plots and by export_csv."""

    def __init__(
        self, capacity: int = ROUND_HISTORY, memory_capacity: int = MEMORY_HISTORY, smoothing: int = SMOOTHING_ROUNDS
    ):
        self.capacity = capacity
        self.memory_capacity = memory_capacity
        self.smoothing = smoothing
        self.recording = False  # memory samples are kept only around loads and runs
        self._rounds = {name: RingBuffer(capacity) for name in ROUND_COLUMNS}
        self._window: deque[tuple[int, int, int, float]] = deque(maxlen=smoothing)
        self.memory_times = RingBuffer(memory_capacity)
        self.gpu_memory_used: dict[int, RingBuffer] = {}  # GiB, per GPU index
        self.gpu_memory_total: dict[int, RingBuffer] = {}
        self.gpu_names: dict[int, str] = {}
        self.engine_memory: dict[str, int] = {}  # the latest breakdown (survives clear: it is the engine's now)
        self.engine_memory_by_device: dict[str, int] = {}
        self.adaptive: dict | None = None  # the latest round's adaptive-depth figures
        self._label_hints: dict[Any, str] = {}  # settings -> a name for them (a profile's)
        self.clear()

    def clear(self) -> None:
        """Forget the rounds, markers and memory readings (not the engine's current memory breakdown)."""
        for buffer in self._rounds.values():
            buffer.clear()
        self.memory_times.clear()
        self.gpu_memory_used.clear()
        self.gpu_memory_total.clear()
        self._window.clear()
        self.round_count = 0  # rounds seen since clear (a marker's round number), gap rows included
        self._origin_s: float | None = None
        # Settings segments: (first round number, settings); the CSV's settings column.
        self.segments: list[tuple[int, Any]] = []
        self._last_settings: Any = None
        self.markers: list[Marker] = []
        self.run_marks: list[RunMark] = []
        self._stopped_at: float | None = None  # a stop not yet followed by a start
        # Per-position acceptance: counts since the latest change, and the rates of the segment before it.
        self._position_drafted = np.zeros(0)
        self._position_accepted = np.zeros(0)
        self.previous_positions: tuple[np.ndarray, str] | None = None

    # ------------------------------------------------------------------ time

    def clock(self, monotonic_s: float) -> float:
        """Seconds since the first thing recorded after a clear (the plots' shared x axis)."""
        if self._origin_s is None:
            self._origin_s = monotonic_s
        return monotonic_s - self._origin_s

    # ------------------------------------------------------------------ data in

    def add_updates(self, updates: Iterable[Any]) -> list[Marker]:
        """Record worker.RoundUpdates (.event, .received_s, .run_id); returns the markers they made."""
        made = []
        for update in updates:
            marker = self.add_round(update.event, update.received_s, update.run_id)
            if marker is not None:
                made.append(marker)
        return made

    def add_round(self, ev: Any, received_s: float, run_id: int) -> Marker | None:
        """Record one RoundEvent received at `received_s` (time.monotonic()); returns the marker it made
        when its settings differ from the round before."""
        t = self.clock(received_s)
        settings = ev.settings
        marker = None
        if self._last_settings is None:
            self.segments.append((self.round_count, settings))
        elif settings != self._last_settings:
            self.segments.append((self.round_count, settings))
            marker = Marker(t, self.round_count, self._marker_label(self._last_settings, settings))
            self.markers.append(marker)
            self._start_position_segment(self._last_settings)
        self._last_settings = settings

        n_tokens = len(ev.tokens)
        round_s = max(ev.time_round_s, 1e-9)
        self._window.append((n_tokens, ev.drafted, ev.accepted, round_s))
        w_tokens = sum(w[0] for w in self._window)
        w_drafted = sum(w[1] for w in self._window)
        w_accepted = sum(w[2] for w in self._window)
        w_time = sum(w[3] for w in self._window)
        run = ev.run if isinstance(ev.run, dict) else {}
        if run.get("memory"):
            self.engine_memory = dict(run["memory"])
        if run.get("memory_by_device"):
            self.engine_memory_by_device = {
                d: sum(v.get(k, 0) for k in ENGINE_MEMORY_COMPONENTS) for d, v in run["memory_by_device"].items()
            }
        self.adaptive = getattr(ev, "adaptive", None)
        row = {
            "time_s": t,
            "run": run_id,
            "round": ev.index,
            "tokens": n_tokens,
            "drafted": ev.drafted,
            "accepted": ev.accepted,
            "tokens_per_second": n_tokens / round_s,
            "tokens_per_second_smoothed": w_tokens / w_time,
            "acceptance_rate": ev.accepted / ev.drafted if ev.drafted else None,
            "acceptance_rate_smoothed": w_accepted / w_drafted if w_drafted else None,
            "accepted_length": n_tokens,
            "accepted_length_smoothed": w_tokens / len(self._window),
            "depth": float(getattr(ev, "depth", 0) or 0),
            "pipelined": float(bool(getattr(ev, "pipelined", False))),
            "time_round_ms": round_s * 1000.0,
            "engine_memory_bytes": sum(self.engine_memory.values()) if self.engine_memory else None,
        }
        for field, column in TIME_SPLIT_COLUMNS:
            row[column] = getattr(ev, field) * 1000.0
        for name in ENGINE_MEMORY_COMPONENTS:
            row[f"engine_{name}_bytes"] = self.engine_memory.get(name)
        for name, value in row.items():
            self._rounds[name].append(value)
        self.round_count += 1

        # Accepted drafts are a prefix of the drafted ones: positions 0..accepted-1 hit.
        if ev.drafted > len(self._position_drafted):
            grow = ev.drafted - len(self._position_drafted)
            self._position_drafted = np.concatenate([self._position_drafted, np.zeros(grow)])
            self._position_accepted = np.concatenate([self._position_accepted, np.zeros(grow)])
        self._position_drafted[: ev.drafted] += 1
        self._position_accepted[: ev.accepted] += 1
        return marker

    def _start_position_segment(self, previous_settings: Any) -> None:
        if self._position_drafted.any():
            self.previous_positions = (self.position_rates(), settings_summary(previous_settings))
        self._position_drafted = np.zeros(0)
        self._position_accepted = np.zeros(0)

    def set_engine_memory(self, memory: Mapping[str, int]) -> None:
        """The engine's own breakdown (eng.memory()), e.g. right after a load."""
        self.engine_memory = dict(memory)

    def add_memory_sample(self, sample: Any) -> bool:
        """A hardware.MonitorSample: per-GPU used / total from NVML, kept while recording. Returns whether
        it was kept."""
        if not self.recording or not sample.gpus:
            return False
        self.memory_times.append(self.clock(sample.time_s))
        for gpu in sample.gpus:
            if gpu.index not in self.gpu_memory_used:
                self.gpu_memory_used[gpu.index] = RingBuffer(self.memory_capacity)
                self.gpu_memory_total[gpu.index] = RingBuffer(self.memory_capacity)
                for _ in range(len(self.memory_times) - 1):  # earlier samples of this GPU: missing, not 0
                    self.gpu_memory_used[gpu.index].append(None)
                    self.gpu_memory_total[gpu.index].append(None)
            self.gpu_names[gpu.index] = gpu.name
            used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
            self.gpu_memory_used[gpu.index].append(None if used is None else used / GIB)
            self.gpu_memory_total[gpu.index].append(None if total is None else total / GIB)
        return True

    # ------------------------------------------------------------------ markers

    def name_settings(self, settings: Any, name: str) -> None:
        """Label the marker for a change to `settings` with `name` (e.g. the profile applied)."""
        self._label_hints = {settings: name}

    def _marker_label(self, before: Any, after: Any) -> str:
        if after in self._label_hints:
            return f"▶ {self._label_hints[after]}"
        return settings_change_label(before, after)

    def mark_stop(self) -> None:
        """The run stopped (not a repeat): remembered until a run starts again."""
        if not len(self._rounds["time_s"]) or self._stopped_at is not None:
            return
        self._stopped_at = float(self._rounds["time_s"].last())

    def mark_start(self, monotonic_s: float | None = None) -> tuple[RunMark, RunMark] | None:
        """A run starts after a stop: a stop and a start mark, and a gap (a NaN row) between them, so
        curves do not join straight across the time nothing ran. Returns the two marks (None: no stop
        came before)."""
        if self._stopped_at is None:
            return None
        stop = RunMark(self._stopped_at, "stop")
        t = self.clock(time.monotonic() if monotonic_s is None else monotonic_s)
        for name in ROUND_COLUMNS:
            self._rounds[name].append((self._stopped_at + t) / 2 if name == "time_s" else None)
        self.round_count += 1
        self._window.clear()  # the rolling rates start afresh after a gap
        self._stopped_at = None
        start = RunMark(t, "start")
        self.run_marks += [stop, start]
        return stop, start

    # ------------------------------------------------------------------ data out

    def __len__(self) -> int:
        """Rows held (at most `capacity`; gap rows included)."""
        return len(self._rounds["time_s"])

    def column(self, name: str) -> np.ndarray:
        """One column, oldest row first (a copy)."""
        return self._rounds[name].array()

    def columns(self) -> Columns:
        """Every column, each copied out when first read."""
        return Columns(self._rounds)

    def last(self, name: str) -> float:
        """The newest row's value in one column (NaN when there is none)."""
        return self._rounds[name].last()

    def position_rates(self) -> np.ndarray:
        """Acceptance at each draft position (accepted / drafted) since the latest settings change."""
        return safe_ratio(self._position_accepted, self._position_drafted)

    def rolling_mean(self, name: str, window: int | None = None) -> np.ndarray:
        """One column's rolling mean over `window` rows (default: the smoothing window)."""
        return rolling_mean(self.column(name), window or self.smoothing)

    def settings_of_rows(self) -> list[Any]:
        """The settings each row held now ran with (None before the first round)."""
        n = len(self)
        first_round = self.round_count - n  # rounds older than the history dropped off
        starts = [start for start, _ in self.segments]
        out = []
        segment = 0
        for i in range(n):
            number = first_round + i
            while segment + 1 < len(starts) and starts[segment + 1] <= number:
                segment += 1
            out.append(self.segments[segment][1] if self.segments else None)
        return out

    # ------------------------------------------------------------------ CSV

    def export_csv(self, path: str | Path) -> list[Path]:
        """Write the rounds to `path` (one row per round, with the settings each ran with and the marker
        label where they changed) and, when there are NVML readings, the per-GPU memory to
        `<stem>-gpu-memory.csv`. Missing readings are empty, never 0. Returns the files written."""
        path = Path(path)
        r = self.columns()
        first_round = self.round_count - len(self)
        marker_at = {m.round_number: m.label for m in self.markers}
        written = [path]
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(ROUND_COLUMNS + CSV_EXTRA_COLUMNS)
            for i, settings in enumerate(self.settings_of_rows()):
                row = [csv_value(r[name][i], name) for name in ROUND_COLUMNS]
                row.append(settings_summary(settings) if settings is not None else "")
                row.append(marker_at.get(first_round + i, ""))
                writer.writerow(row)
        if self.gpu_memory_used:
            memory_path = path.with_name(f"{path.stem}-gpu-memory.csv")
            times = self.memory_times.array()
            with memory_path.open("w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(["time_s", "gpu", "name", "memory_used_gib", "memory_total_gib"])
                for index, used in self.gpu_memory_used.items():
                    used_values = used.array()
                    total_values = self.gpu_memory_total[index].array()
                    for i, t in enumerate(times):
                        writer.writerow(
                            [
                                f"{t:.4f}",
                                index,
                                self.gpu_names.get(index, ""),
                                csv_value(used_values[i]),
                                csv_value(total_values[i]),
                            ]
                        )
            written.append(memory_path)
        return written

    def to_overlay(self, name: str = "previous run") -> Overlay | None:
        """The recorded run as an overlay (time from its start); None when nothing is recorded."""
        t = self.column("time_s")
        if not t.size:
            return None
        return Overlay(name, t - t[np.isfinite(t)][0], {k: self.column(k) for k in OVERLAY_SERIES})


def read_csv(path: str | Path, needed: Iterable[str] = ROUND_COLUMNS) -> dict[str, np.ndarray]:
    """The `needed` columns of an export as numbers (empty cells: NaN). Raises ValueError naming what is
    wrong: a file that cannot be read, one without those columns, or a cell in them that is not a number."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path.name}: cannot be read ({exc})") from None
    needed = tuple(needed)
    if not rows or any(k not in rows[0] for k in needed):
        raise ValueError(f"{path.name}: not a SpecDeck run export (needs the columns {', '.join(needed)})")

    def number(text: str | None) -> float:
        if text in ("", None):
            return np.nan
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{path.name}: not a number: {text[:40]!r}") from None

    return {k: np.array([number(r[k]) for r in rows], dtype=np.float64) for k in needed}


def load_overlay(path: str | Path) -> Overlay:
    """An exported run (RunHistory.export_csv) as an overlay named after its file. Raises ValueError."""
    path = Path(path)
    columns = read_csv(path, ("time_s", *OVERLAY_SERIES))
    t = columns["time_s"]
    return Overlay(path.stem, t - t[0], {k: columns[k] for k in OVERLAY_SERIES})


def csv_value(value: float | None, name: str = "") -> str:
    """A cell: empty for a missing reading, integers for counts and bytes, else 6 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if name in _INTEGER_COLUMNS or name.endswith("_bytes"):
        return str(int(value))
    return f"{value:.6g}"
