"""The Bench tab: A/B of two profiles on the fixed workloads, printed in the llama.cpp PR #27173
table format, with a bar chart beside it (tokens/s per workload, the spread of the rounds as
error bars) and optionally a saved bench (JSON) drawn as outlines beside the bars for comparison.

It runs app.bench.run_bench on the engine thread (the same code path as `specdeck bench`):
arms alternate (A,B then B,A), each run on a reset session, one untimed warm-up per arm. The
result is the report's own format_tables(); output hashes per arm are shown with a warning when
the arms' texts differ (speculation must never change the text).

Synthetic rates (a measurement mode, off when empty): both arms draft and verify as usual but accept as many drafts
as the rates draw; the window shows a banner while such a bench runs, the tables say so first, the text check
leaves those arms out and their figures are not stored in the profiles.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.bench import SYNTHETIC_BANNER, parse_synthetic_rates
from app.gui import theme
from app.gui.plots import SERIES_COLORS, StagedPlotWidget, _shrinkable, _style_plot
from app.profiles import Profile

# Per arm: {workload or "mixed avg": (mean, min, max)} tokens/s.
Figures = dict[str, dict[str, tuple[float, float, float]]]


def figures_from_report(report: Any) -> Figures:
    out: Figures = {}
    for arm in report.arms:
        per: dict[str, tuple[float, float, float]] = {}
        for w in [*report.workloads, None]:
            lo, _, hi = report.spread(arm.name, w)
            per[w or "mixed avg"] = (report.mean_tps(arm.name, w), lo, hi)
        out[arm.name] = per
    return out


def figures_from_json(data: dict[str, Any]) -> Figures:
    """The same figures from an exported bench (Export JSON / `specdeck bench --json`)."""
    rows = data["rows"]
    out: Figures = {}
    for arm in data["arms"]:
        name = arm["name"]
        per: dict[str, tuple[float, float, float]] = {}
        by_round: dict[int, list[float]] = {}
        for w in data["workloads"]:
            values = [r["tokens_per_second"] for r in rows if r["arm"] == name and r["workload"] == w]
            for r in rows:
                if r["arm"] == name and r["workload"] == w:
                    by_round.setdefault(r["round"], []).append(r["tokens_per_second"])
            if values:
                per[w] = (statistics.fmean(values), min(values), max(values))
        means = [statistics.fmean(v) for v in by_round.values()]
        if means:
            all_values = [r["tokens_per_second"] for r in rows if r["arm"] == name]
            per["mixed avg"] = (statistics.fmean(all_values), min(means), max(means))
        out[name] = per
    return out


class BenchBars(StagedPlotWidget):
    """Tokens/s per workload, one bar per arm with the spread of the rounds as an error bar; a
    compared bench is drawn as dashed outlines beside them."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        item = self.getPlotItem()
        _style_plot(item, "tokens / s", "")
        item.setTitle("<b>tokens/s</b> <span style='font-size:8pt'>(whiskers: min..max of the rounds)</span>")
        _shrinkable(item.titleLabel)
        item.getViewBox().setMouseEnabled(x=False, y=False)
        self.legend = item.addLegend(offset=(10, 5), colCount=2)
        self.figures: Figures = {}
        self.compare: Figures = {}
        self.compare_name = ""

    def show_figures(self, figures: Figures, compare: Figures | None = None, compare_name: str = "") -> None:
        self.figures = figures
        if compare is not None:
            self.compare, self.compare_name = compare, compare_name
        item = self.getPlotItem()
        item.clear()
        self.legend.clear()
        groups: list[str] = []
        for per in (*self.figures.values(), *self.compare.values()):
            for w in per:
                if w not in groups and w != "mixed avg":
                    groups.append(w)
        groups.append("mixed avg")
        arms = [(n, per, False) for n, per in self.figures.items()] + [
            (n, per, True) for n, per in self.compare.items()
        ]
        if not arms:
            return
        width = 0.8 / len(arms)
        top = 0.0
        for index, (name, per, compared) in enumerate(arms):
            color = SERIES_COLORS[index % len(SERIES_COLORS)] if not compared else "#888888"
            xs = np.array([g + (index - (len(arms) - 1) / 2) * width for g in range(len(groups))], dtype=float)
            cells = [per.get(w, (math.nan, math.nan, math.nan)) for w in groups]
            mean = np.array([c[0] for c in cells], dtype=float)
            lo = np.array([c[1] for c in cells], dtype=float)
            hi = np.array([c[2] for c in cells], dtype=float)
            if compared:
                bars = pg.BarGraphItem(
                    x=xs,
                    height=np.nan_to_num(mean),
                    width=width * 0.9,
                    brush=None,
                    pen=pg.mkPen(color, width=2, style=Qt.PenStyle.DashLine),
                )
            else:
                bars = pg.BarGraphItem(x=xs, height=np.nan_to_num(mean), width=width * 0.9, brush=pg.mkBrush(color))
            item.addItem(bars)
            label = f"{name} ({self.compare_name})" if compared and self.compare_name else name
            self.legend.addItem(bars, label)
            finite = np.isfinite(mean) & np.isfinite(lo) & np.isfinite(hi)
            if finite.any():
                errors = pg.ErrorBarItem(
                    x=xs[finite],
                    y=mean[finite],
                    top=(hi - mean)[finite],
                    bottom=(mean - lo)[finite],
                    beam=width * 0.4,
                    pen=pg.mkPen(theme.current.foreground if not compared else color, width=1),
                )
                item.addItem(errors)
                top = max(top, float(np.nanmax(hi[finite])))
        item.getAxis("bottom").setTicks([[(i, g) for i, g in enumerate(groups)]])
        item.setXRange(-0.6, len(groups) - 0.4, padding=0)
        self.legend.setColumnCount(min(len(arms), 2))
        # Room above the tallest whisker for the legend's rows.
        item.setYRange(0, max(top * (1.25 + 0.12 * ((len(arms) + 1) // 2)), 1.0), padding=0)


class BenchTab(QWidget):
    start_requested = Signal(object)  # (arms: list[(name, Profile)], workloads, rounds, max_new_tokens)
    stop_requested = Signal()
    message = Signal(str)

    def __init__(self, workload_names: list[str], parent: QWidget | None = None):
        super().__init__(parent)
        self.report: Any = None
        self._profiles: list[Profile] = []

        self.profile_a = QComboBox()
        self.profile_b = QComboBox()
        self.workload_boxes: dict[str, QCheckBox] = {}
        workload_row = QHBoxLayout()
        for name in workload_names:
            box = QCheckBox(name)
            box.setChecked(True)
            self.workload_boxes[name] = box
            workload_row.addWidget(box)
        workload_row.addStretch(1)
        self.rounds = QSpinBox()
        self.rounds.setRange(1, 50)
        self.rounds.setValue(3)
        self.rounds.setToolTip(
            "Each round runs every workload once per arm; arms alternate order. A difference inside the "
            "spread of the rounds is reported as 'no clear difference'"
        )
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 8192)
        self.max_new_tokens.setValue(128)
        self.record_figures = QCheckBox("Store the figures in the profiles (user profiles only)")
        self.record_figures.setChecked(True)
        self.synthetic_rates = QLineEdit()
        self.synthetic_rates.setPlaceholderText("off (real acceptance) — e.g. 0.87, 0.78, 0.68")
        self.synthetic_rates.setToolTip(
            "Synthetic acceptance, a measurement mode: both arms draft and verify as usual, but draft position i "
            "is accepted with probability rate i (the last rate continues deeper). The figures measure speed "
            "at these rates only; the text is not the model's output. Greedy only. Empty = off."
        )

        self.run_button = QPushButton("Run bench")
        self.run_button.clicked.connect(self.start)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_requested)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("%v / %m runs")
        self.progress_label = QLabel("")

        setup = QGroupBox("A/B bench")
        form = QFormLayout(setup)
        form.addRow("Profile A", self.profile_a)
        form.addRow("Profile B", self.profile_b)
        form.addRow("Workloads", workload_row)
        counts = QHBoxLayout()
        counts.addWidget(QLabel("Rounds"))
        counts.addWidget(self.rounds)
        counts.addWidget(QLabel("New tokens per run"))
        counts.addWidget(self.max_new_tokens)
        counts.addStretch(1)
        form.addRow(counts)
        form.addRow("Synthetic rates", self.synthetic_rates)
        form.addRow(self.record_figures)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.progress, 1)
        form.addRow(buttons)
        form.addRow(self.progress_label)

        self.warning_label = QLabel("")
        self.warning_label.setWordWrap(True)
        self.warning_label.hide()
        self.hash_table = QTableWidget(0, 3)
        self.hash_table.setHorizontalHeaderLabels(["Workload", "Hash A", "Hash B"])
        self.hash_table.verticalHeader().setVisible(False)
        self.hash_table.setMaximumHeight(150)
        self.hash_table.horizontalHeader().setStretchLastSection(True)
        self.tables_view = QPlainTextEdit()
        self.tables_view.setReadOnly(True)
        self.tables_view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.tables_view.setFont(mono)
        self.tables_view.setPlaceholderText(
            "The tables (llama.cpp PR #27173 format: round results, per-workload change, acceptance, output "
            "hashes) appear here after a bench."
        )
        self.bars = BenchBars()
        self.compare_button = QPushButton("Compare with a saved bench (JSON)…")
        self.compare_button.setToolTip("Draw an exported bench's figures as dashed outlines beside these bars")
        self.compare_button.clicked.connect(lambda: self.load_comparison())
        self.export_csv_button = QPushButton("Export CSV…")
        self.export_json_button = QPushButton("Export JSON…")
        self.export_csv_button.clicked.connect(lambda: self.export("csv"))
        self.export_json_button.clicked.connect(lambda: self.export("json"))
        for button in (self.export_csv_button, self.export_json_button):
            button.setEnabled(False)
        export_row = QHBoxLayout()
        export_row.addWidget(self.compare_button)
        export_row.addStretch(1)
        export_row.addWidget(self.export_csv_button)
        export_row.addWidget(self.export_json_button)

        from app.gui.tune_panel import TunePanel

        self.tune_panel = TunePanel(workload_names)
        layout = QVBoxLayout(self)
        layout.addWidget(setup)
        layout.addWidget(self.warning_label)
        results = QSplitter(Qt.Orientation.Horizontal)
        results.addWidget(self.tables_view)
        results.addWidget(self.bars)
        results.setStretchFactor(0, 3)
        results.setStretchFactor(1, 2)
        results.setSizes([480, 520])  # the tables scroll sideways; the chart's labels need the room
        layout.addWidget(results, 1)
        layout.addWidget(QLabel("Output hash per arm (sha-256 of the generated token ids)"))
        layout.addWidget(self.hash_table)
        layout.addLayout(export_row)
        layout.addWidget(self.tune_panel, 1)

    # ------------------------------------------------------------------ profiles

    def set_profiles(self, profiles: list[Profile]) -> None:
        chosen = (self.profile_a.currentText(), self.profile_b.currentText())
        self._profiles = list(profiles)
        names = [p.name for p in profiles]
        for combo, default in ((self.profile_a, "control"), (self.profile_b, "chain")):
            current = chosen[0] if combo is self.profile_a else chosen[1]
            combo.blockSignals(True)
            combo.clear()
            combo.addItems(names)
            pick = current if current in names else default if default in names else None
            if pick is not None:
                combo.setCurrentText(pick)
            elif names:
                combo.setCurrentIndex(min(1 if combo is self.profile_b else 0, len(names) - 1))
            combo.blockSignals(False)

    def select_profiles(self, a: str, b: str) -> None:
        self.profile_a.setCurrentText(a)
        self.profile_b.setCurrentText(b)

    def _profile(self, name: str) -> Profile | None:
        return next((p for p in self._profiles if p.name == name), None)

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        a, b = self._profile(self.profile_a.currentText()), self._profile(self.profile_b.currentText())
        workloads = [name for name, box in self.workload_boxes.items() if box.isChecked()]
        if a is None or b is None:
            self.message.emit("Pick two profiles to compare")
            return
        if not workloads:
            self.message.emit("Pick at least one workload")
            return
        try:
            rates = parse_synthetic_rates(self.synthetic_rates.text())
        except ValueError as exc:
            self.message.emit(f"Synthetic rates: {exc}")
            return
        if rates:  # both arms measure at these rates (a bench profile's own rates are replaced)
            a, b = (
                dataclasses.replace(p, settings=p.settings.replace(synthetic_rates=rates), kind="bench") for p in (a, b)
            )
        name_a, name_b = a.name, b.name
        if name_a == name_b:
            name_a, name_b = f"{name_a} (A)", f"{name_b} (B)"
        rounds, tokens = self.rounds.value(), self.max_new_tokens.value()
        self.progress.setRange(0, rounds * len(workloads) * 2)
        self.progress.setValue(0)
        self.progress_label.setText("Loading / warming up…")
        self.warning_label.hide()
        self.set_running(True)
        self.start_requested.emit(([(name_a, a), (name_b, b)], workloads, rounds, tokens))

    def set_running(self, running: bool) -> None:
        self.run_button.setEnabled(not running)
        self.stop_button.setEnabled(running)

    def set_available(self, available: bool, reason: str = "") -> None:
        """Whether Run bench can start now; when not, its tooltip and the label below say why."""
        running_bench = self.stop_button.isEnabled()
        self.run_button.setEnabled(available and not running_bench)
        tip = "Run both profiles on the checked workloads, alternating, and compare"
        self.run_button.setToolTip(tip if available else f"Greyed: {reason}")
        if not available and not running_bench and reason:
            self.progress_label.setText(reason)
        elif available and self.progress_label.text().startswith("A run is going"):
            self.progress_label.setText("")

    def on_progress(self, done: int, total: int, message: str) -> None:
        self.progress.setRange(0, total)
        self.progress.setValue(done)
        self.progress_label.setText(message)

    def on_finished(self, report: Any) -> None:
        self.set_running(False)
        if report is None:
            self.progress_label.setText("Bench stopped or failed (see the message above).")
            return
        self.report = report
        complete = len(report.rows) == report.rounds * len(report.workloads) * len(report.arms)
        self.progress_label.setText("Done." if complete else f"Stopped early: {len(report.rows)} runs measured.")
        self.tables_view.setPlainText(report.format_tables())
        if hasattr(report, "spread"):
            self.bars.show_figures(figures_from_report(report))
        self._show_hashes(report)
        for button in (self.export_csv_button, self.export_json_button):
            button.setEnabled(True)

    def _show_hashes(self, report: Any) -> None:
        names = [arm.name for arm in report.arms]
        self.hash_table.setColumnCount(1 + len(names))
        self.hash_table.setHorizontalHeaderLabels(["Workload"] + [f"Hash {n}" for n in names])
        self.hash_table.setRowCount(len(report.workloads))
        for row, workload in enumerate(report.workloads):
            self.hash_table.setItem(row, 0, QTableWidgetItem(workload))
            for column, name in enumerate(names, start=1):
                hashes = ", ".join(sorted(report.hashes(name, workload))) or "–"
                self.hash_table.setItem(row, column, QTableWidgetItem(hashes))
        if report.synthetic and report.arms_agree:
            self.warning_label.setText(
                f"<b>{SYNTHETIC_BANNER}.</b> Synthetic arms are left out of the text check; their figures are not "
                "stored in the profiles."
            )
            self.warning_label.setStyleSheet("background:#fff3cd; color:#664d03; padding:6px;")
        elif report.arms_agree:
            self.warning_label.setText("Outputs identical across arms: speculation did not change the text.")
            self.warning_label.setStyleSheet("background:#d1e7dd; color:#0f5132; padding:6px;")
        else:
            differing = [w for w in report.workloads if len(set().union(*(report.hashes(n, w) for n in names))) > 1]
            self.warning_label.setText(
                "<b>Warning: the arms' output texts differ</b> on "
                + ", ".join(differing)
                + ". Greedy speculative decoding should reproduce the target's text exactly; "
                "different hashes point at a numerical difference (dtype, sub-vocab) or a bug."
            )
            self.warning_label.setStyleSheet("background:#f8d7da; color:#842029; padding:6px;")
        self.warning_label.show()

    def figures_for(self, arm_name: str, model_info: dict[str, Any] | None) -> dict[str, Any]:
        """The profile 'last bench figures' for one arm of the last report."""
        report = self.report
        other = [a.name for a in report.arms if a.name != arm_name]
        figures: dict[str, Any] = {
            "source": "bench",
            "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "mean_tokens_per_second": _round(report.mean_tps(arm_name)),
            "round_results": [_round(v) for v in report.round_means(arm_name)],
            "per_workload": {w: _round(report.mean_tps(arm_name, w)) for w in report.workloads},
            "rounds": report.rounds,
            "max_new_tokens": report.max_new_tokens,
            "compared_with": other[0] if other else "",
        }
        if model_info:
            figures["model"] = model_info.get("name")
            figures["device"] = model_info.get("device")
            figures["dtype"] = model_info.get("dtype")
        return {k: v for k, v in figures.items() if v is not None}

    # ------------------------------------------------------------------ export

    def export(self, kind: str, path: str | Path | None = None) -> Path | None:
        if self.report is None:
            return None
        if path is None:
            path = self.ask_save_path(kind)
            if not path:
                return None
        path = Path(path)
        path.write_text(self.report.to_csv() if kind == "csv" else self.report.to_json(), encoding="utf-8")
        self.message.emit(f"Bench report written to {path}")
        return path

    def load_comparison(self, path: str | Path | None = None) -> bool:
        """A saved bench (JSON) drawn beside this one's bars."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Compare with a saved bench", str(Path.home()), "JSON (*.json)")
            if not path:
                return False
        path = Path(path)
        try:
            figures = figures_from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.message.emit(f"{path.name}: not a SpecDeck bench export ({type(exc).__name__}: {exc})")
            return False
        self.bars.show_figures(self.bars.figures, figures, path.stem)
        self.message.emit(f"Dashed outlines: {path.name}")
        return True

    def ask_save_path(self, kind: str) -> str:
        path, _ = QFileDialog.getSaveFileName(
            self,
            f"Export the bench report ({kind.upper()})",
            str(Path.home() / f"specdeck-bench.{kind}"),
            f"{kind.upper()} (*.{kind})",
        )
        return path


def _round(value: float) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 3)
