"""The Tune panel (in the Bench tab): a staged autotune of the loaded model, on the engine's thread.

Start -> `TuneRunner` (a QObject living on the EngineWorker's thread, so the engine is only ever used
there) runs `app.tune.run_tune` with the panel's budget and workloads; every finished cell comes back
as a signal and is added to the table, with a progress bar over the budget and the time left. Cancel
stops at the next pass and keeps the finished cells. At the end the winner is saved as a profile that
holds its measured figures and the hardware it was measured on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)


@dataclass
class TuneRequest:
    key: Any  # app.gui.worker.ModelKey
    baseline: Any  # EngineSettings the user has now
    workloads: list[str]
    budget_s: float
    max_new_tokens: int


class TuneRunner(QObject):
    """Runs tunes on the engine worker's thread (moved there), using the worker's loaded engine."""

    progress = Signal(float, str, object)  # fraction of the budget, message, the cell that finished
    finished = Signal(object)  # TuneReport, or None when it could not start
    errored = Signal(str)
    _requested = Signal(object)

    def __init__(self, worker) -> None:
        super().__init__()
        self.worker = worker
        self._cancel = threading.Event()
        self.moveToThread(worker.thread)
        self._requested.connect(self._do_tune)

    def start(self, request: TuneRequest) -> None:  # GUI thread
        self._cancel.clear()
        self._requested.emit(request)

    def cancel(self) -> None:  # GUI thread, any time
        self._cancel.set()

    @Slot(object)
    def _do_tune(self, request: TuneRequest) -> None:
        if not self.worker._ensure_loaded(request.key):
            self.finished.emit(None)
            return
        try:
            from app.tune import run_tune

            report = run_tune(
                self.worker.engine,
                baseline=request.baseline,
                workloads=request.workloads,
                budget_s=request.budget_s,
                max_new_tokens=request.max_new_tokens,
                progress=lambda fraction, message, cell: self.progress.emit(fraction, message, cell),
                should_stop=self._cancel.is_set,
            )
        except Exception as exc:  # noqa: BLE001 - shown in the panel, the app goes on
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.errored.emit(f"{type(exc).__name__}: {first}")
            self.finished.emit(None)
            return
        self.finished.emit(report)


class TunePanel(QGroupBox):
    start_requested = Signal(object)  # (workloads, budget_s, max_new_tokens)
    cancel_requested = Signal()

    def __init__(self, workload_names: list[str], parent: QWidget | None = None) -> None:
        super().__init__("Autotune: find the fastest settings for this model here", parent)
        self.report: Any = None
        self.saved_profile: Any = None
        self._started = 0.0
        self._budget = 0.0
        self.workload_boxes: dict[str, QCheckBox] = {}
        row = QHBoxLayout()
        for name in workload_names:
            box = QCheckBox(name)
            box.setChecked(name in ("code_gen", "prose") or len(workload_names) <= 2)
            self.workload_boxes[name] = box
            row.addWidget(box)
        row.addStretch(1)
        self.budget = QSpinBox()
        self.budget.setRange(5, 3600)
        self.budget.setValue(120)
        self.budget.setSuffix(" s")
        self.budget.setToolTip("Wall time for the whole tune: 60% for the search, the rest to confirm the best three")
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(4, 4096)
        self.max_new_tokens.setValue(64)
        self.start_button = QPushButton("Tune")
        self.start_button.clicked.connect(self._start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setFormat("%p% of the budget")
        self.time_left = QLabel("")
        self.verdict = QLabel(
            "Tune measures the settings you have (the baseline), then drafting off, depth × chain, "
            "sub-vocab and p_min, and confirms the best three with repeats."
        )
        self.verdict.setWordWrap(True)
        self.table = QTableWidget(0, 6)
        self.table.setHorizontalHeaderLabels(["Cell", "Stage", "Median t/s", "Min", "Max", "Runs"])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setMinimumHeight(120)

        settings_row = QHBoxLayout()
        settings_row.addWidget(QLabel("Budget"))
        settings_row.addWidget(self.budget)
        settings_row.addWidget(QLabel("New tokens per run"))
        settings_row.addWidget(self.max_new_tokens)
        settings_row.addWidget(self.start_button)
        settings_row.addWidget(self.cancel_button)
        settings_row.addWidget(self.progress, 1)
        settings_row.addWidget(self.time_left)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addLayout(settings_row)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.verdict)

    # ------------------------------------------------------------------ state

    def _start(self) -> None:
        workloads = [n for n, box in self.workload_boxes.items() if box.isChecked()]
        if not workloads:
            self.verdict.setText("Choose at least one workload to tune on.")
            return
        self.start_requested.emit((workloads, float(self.budget.value()), int(self.max_new_tokens.value())))

    def set_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        if running:
            self.report = None
            self.saved_profile = None
            self.table.setRowCount(0)
            self.progress.setValue(0)
            self._started = time.monotonic()
            self._budget = float(self.budget.value())
            self.verdict.setText("Tuning…")

    def on_progress(self, fraction: float, message: str, cell: Any) -> None:
        self.progress.setValue(int(1000 * min(max(fraction, 0.0), 1.0)))
        left = max(0.0, self._budget - (time.monotonic() - self._started))
        self.time_left.setText(f"{left:.0f} s left")
        if cell is not None:
            self._show_cell(cell)

    def _show_cell(self, cell: Any) -> None:
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.ItemDataRole.UserRole) is cell:
                break
        else:
            row = self.table.rowCount()
            self.table.insertRow(row)
        lo, med, hi = cell.spread
        values = [cell.name, str(cell.stage), f"{med:.1f}", f"{lo:.1f}", f"{hi:.1f}", str(len(cell.runs))]
        for col, text in enumerate(values):
            item = QTableWidgetItem(text)
            if col == 0:
                item.setData(Qt.ItemDataRole.UserRole, cell)
            self.table.setItem(row, col, item)

    def on_finished(self, report: Any, saved: Any = None) -> None:
        self.set_running(False)
        self.report = report
        self.saved_profile = saved
        if report is None:
            self.verdict.setText("The tune did not run (see the message above).")
            return
        for cell in report.cells:
            if cell.runs:
                self._show_cell(cell)
        self.progress.setValue(1000 if not report.cancelled else self.progress.value())
        self.time_left.setText(f"{report.elapsed_s:.0f} s")
        text = ("Cancelled; the finished cells are kept. " if report.cancelled else "") + report.verdict()
        if saved is not None:
            text += f" Saved as the profile “{saved.name}”."
        self.verdict.setText(text)
