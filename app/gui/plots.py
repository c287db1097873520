"""Live run plots, drawn from a RunHistory (app.history: the data, without Qt) by one timer (all plots
in the same frame), never once per event.

Every time series shares one x axis: seconds since recording started (linked across plots, so
panning one pans all). Each settings change the engine actually applied (a round whose
RoundEvent.settings differs from the round before) puts a labelled vertical marker on every
time plot; the per-position bars show the rounds since the latest change beside the ones before.

pyqtgraph conventions followed (see the pyqtgraph examples): one PlotDataItem per series updated
with setData(float64 arrays); clip-to-view + peak downsampling for long histories; antialias and
OpenGL off; text refreshed about once a second; y ranges changed at most once a second (1.25 x
the visible maximum) so the axes do not jitter.

A run that was stopped and started again leaves a gap: a row of NaNs between the two (curves
drawn with connect="finite" break there) and a start / stop marker at each end. A finished run
can be kept as a dashed overlay (or one loaded from an exported CSV) to compare the next with.

RunPlots records nothing itself: rounds, memory samples, markers and the CSV go to and come from
its `history`; it keeps only what is drawn (curves, marker lines) and when to draw.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (loaded with the window: numpy's unique/percentile import it at first use)
import pyqtgraph as pg
from PySide6.QtCore import QCoreApplication, QEvent, QRect, Qt, QTimer
from PySide6.QtGui import QRegion
from PySide6.QtWidgets import (
    QGraphicsItem,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app import history as hist
from app.gui import theme
from app.gui.paint_queue import StagedView, paint_queue
from app.history import (
    ENGINE_MEMORY_COMPONENTS,
    GIB,
    SMOOTHING_ROUNDS,
    Marker,
    Overlay,
    RunHistory,
    RunMark,
    rolling_mean,
)

pg.setConfigOptions(antialias=False, useOpenGL=False, background="w", foreground="#333")

SERIES_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
TIME_SPLIT = [  # (RunHistory column, legend name, colour): bottom to top in the stacked plot
    ("time_draft_ms", "draft", "#4c78a8"),
    ("time_verify_ms", "verify", "#f58518"),
    ("time_accept_ms", "accept", "#54a24b"),
    ("time_host_ms", "host", "#b279a2"),
]
REDRAW_HZ = 20  # the most frames a second; fewer when frames cost more (PLOT_TIME_SHARE)
# While a run streams, frames are drawn while the engine thread waits between two rounds
# (worker.FrameGate), so each frame costs the engine its own time: frames may take at most this
# share of wall time, and come at least once a second. (0.02 cost a CPU run about 7% of its tokens/s
# on 2 cores; 0.005 keeps the app within 1% of the headless engine: bench/app_vs_headless.py.)
PLOT_TIME_SHARE = 0.005
MAX_FRAME_INTERVAL_S = 1.0
MIB = 1024**2
# The engine's own memory breakdown (eng.memory(), RoundEvent.run["memory"]), stacked bottom up.
MEMORY_COMPONENTS = dict(zip(ENGINE_MEMORY_COMPONENTS, ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#d9d9d9")))
MEMORY_SHORT_NAMES = {
    "weights": "weights",
    "kv_cache": "kv",
    "snapshot_planes": "planes",
    "graph_pools": "graphs",
    "workspace": "work",
}
MARKER_LABEL_CHARS = 24  # longer labels are shortened; the whole label is in the tooltip
# Marker labels take turns over these heights (share of the plot, from the bottom), so labels of
# markers close together sit on different lines instead of over each other.
MARKER_LANES = (0.92, 0.79, 0.66, 0.53)
OVERLAY_COLOR = "#888888"


class StagedPlotWidget(StagedView, pg.PlotWidget):
    """A PlotWidget whose paint, when it appears, waits its turn on the paint queue: a tab of
    several plots then appears one plot per turn of the event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staged_init()


def make_plot(title: str, unit: str, x_label: str = "s") -> pg.PlotWidget:
    """A small plot styled like the others (used by the monitor tab)."""
    plot = StagedPlotWidget(title=title)
    _style_plot(plot.getPlotItem(), unit, x_label)
    return plot


def follow_x(plot: pg.PlotItem, first: float, last: float) -> bool:
    """Keep data from first to last (seconds) in view on x, in steps: when the data nears the
    right edge (or the range is far too wide, after a clear), the range becomes first .. first +
    1.5 x the data's span. A few range changes over a long run instead of one per update (each
    one repaints every axis of the linked plots). Returns whether the range changed."""
    left, right = plot.getViewBox().viewRange()[0]
    span = max(last - first, 0.0)
    width = right - left
    if last > left + 0.95 * width or first < left or width > 4 * max(span, 1.0):
        plot.setXRange(first, first + max(1.0, 1.5 * span), padding=0)
        return True
    return False


def finite_peak(*arrays: np.ndarray) -> float:
    """The largest finite value of the arrays (0 when there is none)."""
    finite = [a[np.isfinite(a)] for a in arrays]
    return max((float(a.max()) for a in finite if a.size), default=0.0)


def fit_y_top(plot: pg.PlotItem, top_value: float) -> None:
    """Top of a plot at 1.25 x top_value, changed only when the data outgrows it or shrinks below
    half of it (after Clear, a slower setting): each change repaints the plot's axes."""
    current = plot.getViewBox().viewRange()[1][1]
    wanted = 1.25 * top_value if top_value > 0 else 1.0
    if top_value > current or wanted < 0.5 * current:
        plot.setYRange(0, wanted, padding=0)


def _style_plot(item: pg.PlotItem, unit: str, x_label: str) -> None:
    item.showGrid(x=True, y=True, alpha=0.2)
    # Axes (with their grid lines and tick text) are the costliest thing to paint, and the grid
    # makes each axis cover its whole plot, so every curve update would repaint them. Cached as
    # pixmaps they are redrawn only when their range changes, which is at most once a second.
    for name in ("left", "bottom"):
        item.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        item.getAxis(name).enableAutoSIPrefix(False)  # "s", never "s (x0.001)"
    item.setLabel("left", units=None, text=unit)
    item.setLabel("bottom", text=x_label)
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    item.setMenuEnabled(False)
    item.getViewBox().setMouseEnabled(x=True, y=False)
    item.hideButtons()


def _shrinkable(label: pg.LabelItem) -> None:
    """Let a pyqtgraph LabelItem be narrower than its text (LabelItem.updateMin pins the minimum
    width to the text's on every setText)."""
    original = label.updateMin

    def update_min() -> None:
        original()
        label.setMinimumWidth(0)
        hints = getattr(label, "_sizeHint", None)
        if hints is not None:
            hints[Qt.SizeHint.MinimumSize] = (0, hints[Qt.SizeHint.MinimumSize][1])
        label.updateGeometry()

    label.updateMin = update_min
    update_min()

    # A text wider than the space it got is scaled down to fit (never up), not cut at the edges.
    original_resize = label.resizeEvent

    def resize_event(ev: Any) -> None:
        natural = label.item.boundingRect().width()
        available = label.rect().width()
        scale = min(1.0, available / natural) if natural > 0 and available > 0 else 1.0
        if abs(label.item.scale() - scale) > 1e-3:
            label.item.setScale(scale)
        original_resize(ev)

    label.resizeEvent = resize_event


def _title(name: str, keys: list[tuple[str, str]]) -> str:
    """A plot title with a colour key: 'Tokens / s  ━ per round  ━ 16-round rate'."""
    spans = "".join(f"&nbsp;&nbsp;<span style='color:{color}'>━</span>&nbsp;{label}" for color, label in keys)
    return f"<b>{name}</b><span style='font-size:8pt'>{spans}</span>"


class TimedGraphicsLayout(StagedView, pg.GraphicsLayoutWidget):
    """The Live plots' view. Every paint goes through the paint queue, one plot per piece
    (StagedView.queued_always), and the view adds up how long its paints take."""

    queued_always = True
    painted_s = 0.0  # wall time of all its paints so far

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pieces: list[pg.PlotItem] = []  # the plots, each painted as one piece
        self.staged_init()

    def piece_rects(self) -> list[QRect]:
        """Every plot's rectangle in the viewport (the margins between them hold nothing)."""
        rects = [self.mapFromScene(item.sceneBoundingRect()).boundingRect() for item in self.pieces]
        return rects or super().piece_rects()

    def paintEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        started = time.perf_counter()
        super().paintEvent(event)
        self.painted_s += time.perf_counter() - started


@dataclass
class MarkerLines:
    """A settings marker of the history as drawn: a labelled line on every time plot."""

    marker: Marker
    lines: list[pg.InfiniteLine]
    shown: str  # the text on the plots (shortened when long)
    lane: int

    @property
    def label(self) -> str:  # the whole label (CSV, tooltip)
        return self.marker.label

    @property
    def time_s(self) -> float:
        return self.marker.time_s


@dataclass
class RunMarkLines:
    """A stop or start of the history as drawn: a dotted line on every time plot."""

    mark: RunMark
    lines: list[pg.InfiniteLine]

    @property
    def kind(self) -> str:
        return self.mark.kind


class RunPlots(QWidget):
    """The Live tab's plots plus their toolbar (pause, clear, export CSV / PNG), drawn from `history`."""

    def __init__(self, parent: QWidget | None = None, history: RunHistory | None = None):
        super().__init__(parent)
        self.history = history if history is not None else RunHistory()
        self.paused = False
        self._dirty = False
        self._last_text_update = 0.0
        self._last_x_update = 0.0
        self._last_frame_s = 0.0
        self.frames_drawn = 0
        self._rounds_at_last_frame = 0  # rounds plotted by the latest frame (0: none yet)
        self.frame_gate: Any = None  # worker.FrameGate, set by the window
        self._redraw_s = 0.0  # smoothed wall time of a frame's redraw() and of its paint
        self._paint_s = 0.0
        self._painted_at_update = 0.0  # graphics.painted_s when update_frame() ended
        self.markers: list[MarkerLines] = []  # the history's markers, as drawn
        self.run_marks: list[RunMarkLines] = []
        self.overlay: Overlay | None = None

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        toolbar = QHBoxLayout()
        self.pause_button = QPushButton("Pause")
        self.pause_button.setCheckable(True)
        self.pause_button.setToolTip("Freeze the plots; data keeps being recorded")
        self.pause_button.toggled.connect(self.set_paused)
        self.clear_button = QPushButton("Clear")
        self.clear_button.setToolTip("Forget the plotted data and markers")
        self.clear_button.clicked.connect(self.clear)
        self.export_csv_button = QPushButton("Export CSV…")
        self.export_png_button = QPushButton("Export PNG…")
        self.overlay_button = QToolButton()
        self.overlay_button.setText("Compare…")
        self.overlay_button.setToolTip("Overlay a previous run (dashed) on the plots to compare with")
        self.overlay_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.overlay_menu = QMenu(self.overlay_button)
        self.keep_overlay_action = self.overlay_menu.addAction("Keep this run as the overlay, and clear")
        self.keep_overlay_action.triggered.connect(lambda: self.keep_as_overlay())
        self.load_overlay_action = self.overlay_menu.addAction("Load an exported run (CSV) as the overlay…")
        self.remove_overlay_action = self.overlay_menu.addAction("Remove the overlay")
        self.remove_overlay_action.triggered.connect(self.remove_overlay)
        self.overlay_button.setMenu(self.overlay_menu)
        self.summary_label = QLabel("No run yet: pick a workload and press Run.")
        self.summary_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        for button in (self.pause_button, self.clear_button, self.export_csv_button, self.export_png_button):
            toolbar.addWidget(button)
        toolbar.addWidget(self.overlay_button)
        toolbar.addStretch(1)
        self.memory_label = QLabel("")
        self.memory_label.setToolTip("The engine's own count of its memory (eng.memory())")
        layout.addLayout(toolbar)
        # The figures on a line of their own, wrapped when narrow: never cut off (1280 px and up).
        status = QHBoxLayout()
        status.setContentsMargins(4, 0, 4, 0)
        for label, stretch in ((self.summary_label, 3), (self.memory_label, 2)):
            label.setWordWrap(True)
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Minimum)
            # Two lines kept free, so the figures changing each second never resize the plots
            # (a resize re-lays out and repaints all six).
            label.setMinimumHeight(2 * label.fontMetrics().lineSpacing() + 2)
            label.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
            status.addWidget(label, stretch)
        layout.addLayout(status)

        self.graphics = TimedGraphicsLayout()
        self.frame_wanted = False  # a frame waits for the engine's next grant (frame_gate)
        layout.addWidget(self.graphics, 1)
        self._build_plots()
        self.graphics.pieces = [*self.time_plots, self.position_plot]

        self._timer = QTimer(self)
        self._timer.setInterval(int(1000 / REDRAW_HZ))
        self._timer.timeout.connect(self._on_timer)
        self._timer.start()

    # ----------------------------------------------------------------------------- layout

    def _build_plots(self) -> None:
        # Series keys live in the titles, not in legends inside the plots: the top of each plot
        # is left free for the settings markers' labels.
        g = self.graphics
        w = SMOOTHING_ROUNDS
        self.speed_plot = g.addPlot(
            row=0, col=0, title=_title("Tokens / s", [("#9ecae1", "per round"), (SERIES_COLORS[0], f"{w}-round rate")])
        )
        self.time_plot = g.addPlot(
            row=0, col=1, title=_title(f"Round time (mean of {w})", [(color, name) for _, name, color in TIME_SPLIT])
        )
        self.acceptance_plot = g.addPlot(
            row=1,
            col=0,
            title=_title("Draft acceptance rate", [("#a1d99b", "per round"), (SERIES_COLORS[2], f"{w}-round")]),
        )
        self.length_plot = g.addPlot(
            row=1,
            col=1,
            title=_title(
                "Accepted length (tokens/round)",
                [("#fdd0a2", "per round"), (SERIES_COLORS[1], f"{w}-round"), ("#756bb1", "depth drafted")],
            ),
        )
        self.position_plot = g.addPlot(
            row=2,
            col=0,
            title=_title(
                "Acceptance by draft position",
                [
                    (SERIES_COLORS[2], "since last change"),
                    ("#999", "before (outline)"),
                    ("#756bb1", "auto: expected tok/s by depth"),
                ],
            ),
        )
        self.memory_plot = g.addPlot(row=2, col=1, title=self._memory_title(with_gpus=False))
        self.time_plots = [self.speed_plot, self.time_plot, self.acceptance_plot, self.length_plot, self.memory_plot]
        units = {
            self.speed_plot: "tok/s",
            self.time_plot: "ms",
            self.acceptance_plot: "rate",
            self.length_plot: "tokens",
            self.memory_plot: "GiB",
        }
        for plot in self.time_plots + [self.position_plot]:
            # A title's text must not set the plot's minimum width (the keys would push the right
            # column out of a 1280 px window); the titles fit a plot of ~440 px.
            _shrinkable(plot.titleLabel)
        for plot in self.time_plots:
            _style_plot(plot, units[plot], "s")
            if plot is not self.speed_plot:
                plot.setXLink(self.speed_plot)
        _style_plot(self.position_plot, "accepted / drafted", "draft position")
        self.position_plot.getViewBox().setMouseEnabled(x=False, y=False)
        self.position_plot.setYRange(0, 1.05)
        self.acceptance_plot.setYRange(0, 1.25)
        for plot in (self.speed_plot, self.time_plot, self.length_plot, self.memory_plot, self.acceptance_plot):
            plot.enableAutoRange(axis="y", enable=False)
        # The x range follows the data once a second (not on every redraw: a changed range
        # repaints every axis). Panning or zooming by hand stops following until Clear.
        self.follow_x = True
        self.speed_plot.enableAutoRange(axis="x", enable=False)
        self.speed_plot.setXRange(0, 1, padding=0)
        for plot in self.time_plots:
            plot.getViewBox().sigRangeChangedManually.connect(self._stop_following)

        self.speed_raw_curve = self.speed_plot.plot(pen=pg.mkPen("#9ecae1", width=1))
        self.speed_smooth_curve = self.speed_plot.plot(pen=pg.mkPen(SERIES_COLORS[0], width=2))
        self.acceptance_raw_curve = self.acceptance_plot.plot(pen=pg.mkPen("#a1d99b", width=1))
        self.acceptance_smooth_curve = self.acceptance_plot.plot(pen=pg.mkPen(SERIES_COLORS[2], width=2))
        self.length_raw_curve = self.length_plot.plot(pen=pg.mkPen("#fdd0a2", width=1))
        self.length_smooth_curve = self.length_plot.plot(pen=pg.mkPen(SERIES_COLORS[1], width=2))
        # The depth each round drafted at (with draft_depth "auto": the controller's choice, round by round).
        self.depth_curve = self.length_plot.plot(pen=pg.mkPen("#756bb1", width=1, style=Qt.PenStyle.DashLine))
        # Stacked areas: each curve is the running sum up to its component, filled down to zero,
        # drawn top component first so the lower ones paint over it.
        self.time_split_curves = []
        for depth, (_, _, color) in enumerate(TIME_SPLIT):
            curve = self.time_plot.plot(pen=pg.mkPen(color, width=1), fillLevel=0, brush=pg.mkBrush(color))
            curve.setZValue(-depth)
            self.time_split_curves.append(curve)
        self.memory_component_curves = {}
        for depth, (name, color) in enumerate(MEMORY_COMPONENTS.items()):
            curve = self.memory_plot.plot(pen=pg.mkPen(color, width=1), fillLevel=0, brush=pg.mkBrush(color))
            curve.setZValue(-10 - depth)
            self.memory_component_curves[name] = curve
        self.position_bars_previous = pg.BarGraphItem(x=[], height=[], width=0.8, pen=pg.mkPen("#999"), brush=None)
        self.position_bars = pg.BarGraphItem(x=[], height=[], width=0.5, brush=pg.mkBrush(SERIES_COLORS[2]))
        self.position_plot.addItem(self.position_bars_previous)
        self.position_plot.addItem(self.position_bars)
        # With draft_depth "auto": the expected tokens/s at each depth the controller decided from,
        # scaled so that its best depth is 1 (the depth d sits over its deepest position, d - 1).
        self.gain_curve = self.position_plot.plot(
            pen=pg.mkPen("#756bb1", width=2), symbol="o", symbolSize=6, symbolBrush="#756bb1"
        )
        self._position_label = ""
        self.memory_used_curves: dict[int, pg.PlotDataItem] = {}
        self.memory_total_curves: dict[int, pg.PlotDataItem] = {}
        self.memory_scale = (GIB, "GiB")

    @staticmethod
    def _memory_title(with_gpus: bool) -> str:
        keys = [(color, MEMORY_SHORT_NAMES[name]) for name, color in MEMORY_COMPONENTS.items()]
        if with_gpus:
            keys.append((SERIES_COLORS[3], "GPU used, total┅"))
        return _title("Memory", keys)

    # ------------------------------------------------------------------------------ data in

    @property
    def recording(self) -> bool:
        """Whether memory samples are kept (around loads and runs)."""
        return self.history.recording

    @recording.setter
    def recording(self, on: bool) -> None:
        self.history.recording = on

    def add_rounds(self, updates: Iterable[Any]) -> None:
        """Record RoundUpdates (worker.RoundUpdate: .event, .received_s, .run_id) in the history; a
        settings change among them gets its marker drawn now."""
        for marker in self.history.add_updates(updates):
            self._draw_marker(marker)
        self._mark_dirty()

    def _mark_dirty(self) -> None:
        self._dirty = True

    def set_engine_memory(self, memory: dict[str, int]) -> None:
        """The engine's own breakdown (eng.memory()), e.g. right after a load."""
        self.history.set_engine_memory(memory)
        self._mark_dirty()

    def add_memory_sample(self, sample: Any) -> None:
        """A hardware.MonitorSample: per-GPU used / total from NVML (kept while recording)."""
        if self.history.add_memory_sample(sample):
            self._mark_dirty()

    # ------------------------------------------------------------------------------ markers

    def name_settings(self, settings: Any, name: str) -> None:
        """Label the marker for a change to `settings` with `name` (e.g. the profile applied)."""
        self.history.name_settings(settings, name)

    @staticmethod
    def shorten(label: str) -> str:
        """The text a marker shows: the whole label when short, else its first change and a count."""
        if len(label) <= MARKER_LABEL_CHARS:
            return label
        parts = label.split(", ")
        first = parts[0] if len(parts[0]) <= MARKER_LABEL_CHARS - 8 else parts[0][: MARKER_LABEL_CHARS - 9] + "…"
        return first + (f" +{len(parts) - 1} more" if len(parts) > 1 else "")

    def _draw_marker(self, marker: Marker) -> None:
        lane = len(self.markers) % len(MARKER_LANES)  # neighbours never share a line
        shown = self.shorten(marker.label)
        lines = []
        for plot in self.time_plots:
            line = pg.InfiniteLine(
                pos=marker.time_s,
                angle=90,
                movable=False,
                pen=pg.mkPen("#d62728", width=1, style=Qt.PenStyle.DashLine),
                label=shown,
                labelOpts={
                    "position": MARKER_LANES[lane],
                    "color": theme.current.marker_text,
                    "fill": theme.current.marker_fill,
                    "anchors": [(0, 0), (0, 0)],
                },
            )
            line.label.setToolTip(marker.label)
            line.setToolTip(marker.label)
            plot.addItem(line, ignoreBounds=True)
            lines.append(line)
        self.markers.append(MarkerLines(marker, lines, shown, lane))

    # ------------------------------------------------------------------------------ gaps

    def mark_stop(self) -> None:
        """The run stopped (not a repeat). Nothing is drawn until a run starts again: the end of
        the data already shows where the last run stopped."""
        self.history.mark_stop()

    def mark_start(self, monotonic_s: float | None = None) -> None:
        """A run starts after a stop: stop and start markers, and a gap (a NaN row in the history)
        between them, so the curves do not join straight across the time nothing ran."""
        marks = self.history.mark_start(monotonic_s)
        if marks is None:
            return
        for mark in marks:
            self._draw_run_mark(mark)
        self._mark_dirty()

    def _draw_run_mark(self, mark: RunMark) -> None:
        kind = mark.kind
        lines = []
        for plot in self.time_plots:
            line = pg.InfiniteLine(
                pos=mark.time_s,
                angle=90,
                movable=False,
                pen=pg.mkPen("#7f7f7f", width=1, style=Qt.PenStyle.DotLine),
                label="▶ start" if kind == "start" else "■ stop",
                labelOpts={
                    "position": 0.06,
                    "color": theme.current.foreground,
                    "fill": theme.current.marker_fill,
                    "anchors": [(0, 1), (0, 1)] if kind == "start" else [(1, 1), (1, 1)],
                },
            )
            plot.addItem(line, ignoreBounds=True)
            lines.append(line)
        self.run_marks.append(RunMarkLines(mark, lines))

    # ------------------------------------------------------------------------------ overlay

    def _overlay_curves(self) -> dict[str, pg.PlotDataItem]:
        if not hasattr(self, "_overlay_items"):
            pen = pg.mkPen(OVERLAY_COLOR, width=2, style=Qt.PenStyle.DashLine)
            self._overlay_items = {
                "tokens_per_second_smoothed": self.speed_plot.plot(pen=pen),
                "acceptance_rate_smoothed": self.acceptance_plot.plot(pen=pen),
                "accepted_length_smoothed": self.length_plot.plot(pen=pen),
            }
            for item in self._overlay_items.values():
                item.setZValue(-20)
        return self._overlay_items

    def set_overlay(self, overlay: Overlay | None) -> None:
        self.overlay = overlay
        for name, curve in self._overlay_curves().items():
            if overlay is None:
                curve.setData([], [])
            else:
                curve.setData(overlay.time_s, overlay.series[name], connect="finite")
        self.remove_overlay_action.setEnabled(overlay is not None)
        self._last_text_update = 0.0
        self._mark_dirty()

    def keep_as_overlay(self, name: str = "previous run") -> Overlay | None:
        """The plotted run becomes the dashed overlay (time from its start) and the plots clear."""
        overlay = self.history.to_overlay(name)
        if overlay is None:
            return None
        self.clear()
        self.set_overlay(overlay)
        return overlay

    def load_overlay(self, path: str | Path) -> Overlay:
        """An exported run (Export CSV) as the overlay. Raises ValueError naming what is wrong."""
        overlay = hist.load_overlay(path)
        self.set_overlay(overlay)
        return overlay

    def remove_overlay(self) -> None:
        self.set_overlay(None)

    # ------------------------------------------------------------------------------ controls

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.pause_button.setChecked(paused)
        self.pause_button.setText("Resume" if paused else "Pause")
        if not paused:
            self._mark_dirty()

    def clear(self) -> None:
        self.history.clear()
        for curves in (self.memory_used_curves, self.memory_total_curves):
            for curve in curves.values():
                self.memory_plot.removeItem(curve)
            curves.clear()
        self.memory_plot.setTitle(self._memory_title(with_gpus=False))
        for drawn in [*self.markers, *self.run_marks]:
            for plot, line in zip(self.time_plots, drawn.lines):
                plot.removeItem(line)
        self.markers.clear()
        self.run_marks.clear()
        self._rounds_at_last_frame = 0
        self.follow_x = True
        self.speed_plot.setXRange(0, 1, padding=0)
        self.summary_label.setText("Cleared.")
        self.redraw(force_ranges=True)

    @property
    def round_count(self) -> int:
        return self.history.round_count

    # ------------------------------------------------------------------------------ drawing

    def _on_timer(self) -> None:
        # Skip work nobody can see: paused, nothing new, or the tab is hidden.
        if self.paused or not self._dirty or not self.isVisible():
            return
        # Keep the plots' share of time under PLOT_TIME_SHARE (see there), but draw at least
        # once every MAX_FRAME_INTERVAL_S.
        now = time.monotonic()
        frame_s = self._redraw_s + self._paint_s
        first_rounds = self._rounds_at_last_frame == 0 and self.history.round_count > 0  # show a new run at once
        if not first_rounds and now - self._last_frame_s < min(frame_s / PLOT_TIME_SHARE, MAX_FRAME_INTERVAL_S):
            return
        gate = self.frame_gate
        if gate is not None and gate.running:
            # Draw between two rounds, not during one (worker.FrameGate): ask, and the window
            # draws the frame when the engine thread grants it.
            self.frame_wanted = True
            if not gate.requested:
                gate.request()
            return
        self.draw_frame()

    def draw_frame(self) -> None:
        """Redraw and paint now (synchronously, so the paint is over when this returns)."""
        self.update_frame()
        self.paint_frame()

    def update_frame(self) -> None:
        """A frame's first half: every plot gets the new data and queues its paint (the view
        paints only through the paint queue); nothing is painted yet."""
        self._last_frame_s = time.monotonic()
        self._rounds_at_last_frame = self.history.round_count
        self.frames_drawn += 1
        started = time.perf_counter()
        self.redraw()
        if self.isVisible():
            # The view boxes apply a changed range to their curves when the scene is about to be
            # painted. Left to the paint, that changes the plots again, and they are painted twice.
            scene = self.graphics.scene()
            scene.prepareForPaint()
            # The scene reports its changes (a queued call): now, so the pieces are queued now.
            QCoreApplication.sendPostedEvents(scene, QEvent.Type.MetaCall)
        self._redraw_s = 0.8 * self._redraw_s + 0.2 * (time.perf_counter() - started)
        self._painted_at_update = self.graphics.painted_s

    def paint_frame(self) -> None:
        """A frame's second half, at once: paint every plot now."""
        if self.isVisible():
            self.graphics.queue_region(QRegion(self.graphics.viewport().rect()))
            paint_queue().flush()
        self._frame_painted()

    def paint_frame_in_pieces(self) -> None:
        """A frame's second half on the paint queue: one plot per turn of the event loop."""
        if not self.isVisible():
            self._frame_painted()
            return
        self.graphics.queue_region(QRegion(self.graphics.viewport().rect()), done=self._frame_painted)

    def _frame_painted(self) -> None:
        frame_paint_s = self.graphics.painted_s - self._painted_at_update
        self._paint_s = 0.8 * self._paint_s + 0.2 * frame_paint_s

    def redraw(self, force_ranges: bool = False) -> None:
        """Every plot from the same data in one frame, so they all advance together.
        force_ranges fits the x range to the data and updates the texts now."""
        self._dirty = False
        r = self.history.columns()  # a frame copies out only the columns it draws
        t = r["time_s"]
        self.speed_raw_curve.setData(t, r["tokens_per_second"], connect="finite")
        self.speed_smooth_curve.setData(t, r["tokens_per_second_smoothed"], connect="finite")
        self.acceptance_raw_curve.setData(t, r["acceptance_rate"], connect="finite")
        self.acceptance_smooth_curve.setData(t, r["acceptance_rate_smoothed"], connect="finite")
        self.length_raw_curve.setData(t, r["accepted_length"], connect="finite")
        self.length_smooth_curve.setData(t, r["accepted_length_smoothed"], connect="finite")
        self.depth_curve.setData(t, r["depth"], connect="finite")
        self._draw_time_split(t, r)
        self._draw_positions()
        self._draw_memory(t, r)

        now = time.monotonic()
        self._update_y_ranges(r)
        if force_ranges or now - self._last_x_update >= 0.5:
            self._last_x_update = now
            self._update_x_range(r["time_s"], exact=force_ranges)
        if force_ranges or now - self._last_text_update >= 1.0:
            self._last_text_update = now
            self._update_texts(r)

    def _draw_time_split(self, t: np.ndarray, r: dict[str, np.ndarray]) -> None:
        gaps = ~np.isfinite(r["time_round_ms"])  # the rows that separate a stop from a start
        stacked = np.zeros_like(t)
        for curve, (column, _, _) in zip(self.time_split_curves, TIME_SPLIT):
            stacked = stacked + rolling_mean(r[column], SMOOTHING_ROUNDS)
            shown = np.where(gaps, np.nan, stacked)
            curve.setData(t, shown, connect="finite")
        self._time_split_top = stacked

    def _draw_positions(self) -> None:
        rates = self.history.position_rates()
        previous_positions = self.history.previous_positions
        positions = np.arange(len(rates), dtype=np.float64)
        self.position_bars.setOpts(x=positions, height=np.nan_to_num(rates), width=0.5)
        if previous_positions is not None:
            previous, _ = previous_positions
            self.position_bars_previous.setOpts(
                x=np.arange(len(previous), dtype=np.float64), height=np.nan_to_num(previous), width=0.8
            )
        else:
            self.position_bars_previous.setOpts(x=[], height=[], width=0.8)
        gains = np.asarray((self.history.adaptive or {}).get("expected_tokens_per_s") or [], dtype=np.float64)
        if gains.size and gains.max() > 0:
            self.gain_curve.setData(np.arange(gains.size, dtype=np.float64), gains / gains.max())
        else:
            self.gain_curve.setData([], [])
        width = max(len(rates), len(previous_positions[0]) if previous_positions else 0, gains.size, 1)
        self.position_plot.setXRange(-0.6, width - 0.4, padding=0)
        self.position_plot.getAxis("bottom").setTicks([[(i, str(i)) for i in range(width)]])

    def _draw_memory(self, t: np.ndarray, r: dict[str, np.ndarray]) -> None:
        scale = self.memory_scale[0]
        gaps = ~np.isfinite(r["time_round_ms"])
        columns = [np.nan_to_num(r[f"engine_{name}_bytes"]) / scale for name in self.memory_component_curves]
        # The engine's memory changes rarely: only the rounds where some component (or a gap)
        # changes, and the last one, are drawn. Five filled areas of a few corners each paint far
        # faster than of one corner per round.
        keep = _change_points(np.vstack([*columns, gaps.astype(np.float64)]) if t.size else np.zeros((1, 0)))
        tk, gk = t[keep], gaps[keep]
        stacked = np.zeros_like(tk)
        for column, curve in zip(columns, self.memory_component_curves.values()):
            stacked = stacked + column[keep]
            curve.setData(tk, np.where(gk, np.nan, stacked), connect="finite")
        times = self.history.memory_times.array()
        for index, used in self.history.gpu_memory_used.items():
            color = SERIES_COLORS[(index + 3) % len(SERIES_COLORS)]
            if index not in self.memory_used_curves:
                if not self.memory_used_curves:
                    self.memory_plot.setTitle(self._memory_title(with_gpus=True))
                self.memory_used_curves[index] = self.memory_plot.plot(pen=pg.mkPen(color, width=2))
                self.memory_total_curves[index] = self.memory_plot.plot(
                    pen=pg.mkPen(color, width=1, style=Qt.PenStyle.DashLine)
                )
            self.memory_used_curves[index].setData(times, used.array() * GIB / scale, connect="finite")
            self.memory_total_curves[index].setData(
                times, self.history.gpu_memory_total[index].array() * GIB / scale, connect="finite"
            )

    def _stop_following(self, *_: Any) -> None:
        self.follow_x = False

    def _update_x_range(self, t: np.ndarray, exact: bool = False) -> bool:
        """Follow the data on x; returns whether the range changed."""
        if not self.follow_x:
            return False
        memory_times = self.history.memory_times
        last = max(float(t[-1]) if t.size else 0.0, float(memory_times.last()) if len(memory_times) else 0.0)
        if exact:  # a picture being exported: fit the data
            self.speed_plot.setXRange(0, max(last * 1.02, 0.1), padding=0)
            return True
        return follow_x(self.speed_plot, 0.0, last)

    def _update_y_ranges(self, r: dict[str, np.ndarray], only: int | None = None) -> None:
        """Top of each plot at 1.25 x its peak (fit_y_top)."""
        peak = finite_peak

        if only in (None, 0):
            # Single rounds can be very fast (a short bonus-only round): scale to the smoothed
            # rate and to most rounds, not to the one outlier.
            raw = r["tokens_per_second"][np.isfinite(r["tokens_per_second"])]
            typical = float(np.percentile(raw, 95)) if raw.size else 0.0
            fit_y_top(self.speed_plot, max(peak(r["tokens_per_second_smoothed"]), typical))
        if only in (None, 1):
            fit_y_top(self.length_plot, peak(r["accepted_length"]))
        if only in (None, 2):
            fit_y_top(self.time_plot, peak(getattr(self, "_time_split_top", np.zeros(0))))
        if only not in (None, 4):
            return
        # Memory in MiB or GiB, whichever reads better; the curves are redrawn in that unit.
        peak_bytes = max(
            [peak(r["engine_memory_bytes"])] + [peak(b.array()) * GIB for b in self.history.gpu_memory_total.values()]
        )
        scale = (GIB, "GiB") if peak_bytes >= GIB else (MIB, "MiB")
        if scale != self.memory_scale:
            self.memory_scale = scale
            self.memory_plot.setLabel("left", text=scale[1])
            self._draw_memory(r["time_s"], r)
        fit_y_top(self.memory_plot, peak_bytes / scale[0])

    def _update_texts(self, r: dict[str, np.ndarray]) -> None:
        # Which rounds the bars count, in the axis label (changed only at a marker, so the
        # re-layout that a new label costs is rare).
        label = "draft position"
        if self.markers:
            label += f" — bars: since {self.markers[-1].label}; outline: before"
        if label != self._position_label:
            self._position_label = label
            self.position_plot.setLabel("bottom", text=label)
        engine_memory, by_device = self.history.engine_memory, self.history.engine_memory_by_device
        if engine_memory:
            unit, name = self.memory_scale
            breakdown = " · ".join(
                f"{MEMORY_SHORT_NAMES.get(k, k)} {v / unit:,.1f}" for k, v in engine_memory.items() if v
            )
            # A QLabel, not the plot's axis label: changing that would re-layout every plot.
            text = f"Engine memory ({name}): {breakdown}"
            if len(by_device) > 1:  # several GPUs: every rank's own count
                text += " · per device: " + ", ".join(
                    f"{device} {value / unit:,.1f}" for device, value in by_device.items()
                )
            self.memory_label.setText(text)
        finite = np.isfinite(r["time_round_ms"])
        if not finite.any():
            return
        last = int(np.flatnonzero(finite)[-1])
        rate = r["acceptance_rate_smoothed"][last]
        overlay = f" · dashed: {self.overlay.name}" if self.overlay is not None else ""
        # whether the last round was queued before the one ahead of it was read (a setting can stop that)
        pipelined = " (pipelined)" if r["pipelined"][last] == 1 else ""
        self.summary_label.setText(
            f"round {self.history.round_count} · {r['tokens_per_second_smoothed'][last]:.1f} tok/s · "
            f"acceptance {'n/a' if np.isnan(rate) else f'{rate:.0%}'} · "
            f"{r['accepted_length_smoothed'][last]:.2f} tokens/round · "
            f"round {r['time_round_ms'][last]:.1f} ms{pipelined}{overlay}"
        )

    # ------------------------------------------------------------------------------ export

    def export_csv(self, path: str | Path) -> list[Path]:
        """The history's CSV (RunHistory.export_csv): the rounds, and the per-GPU memory beside them."""
        return self.history.export_csv(path)

    def export_png(self, path: str | Path) -> Path:
        self.redraw(force_ranges=True)
        path = Path(path)
        with paint_queue().direct():  # every plot in the picture, none left for a later turn
            saved = self.graphics.grab().save(str(path))
        if not saved:
            raise OSError(f"could not write {path}")
        return path


def _change_points(rows: np.ndarray) -> np.ndarray:
    """Indices of the columns where any row differs from the column before, with the neighbours
    that keep each step a step (the column before a change), the first and the last column."""
    n = rows.shape[1]
    if n <= 2:
        return np.arange(n)
    changed = np.flatnonzero(np.any(rows[:, 1:] != rows[:, :-1], axis=0)) + 1
    keep = np.unique(np.concatenate([[0, n - 1], changed, changed - 1]))
    return keep
