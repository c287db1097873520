"""GPU and host monitor: a sampler on its own thread, and the GPU monitor tab.

The sampler runs app.hardware's readers (every GPU through NVML; CPU / RAM from /proc/stat and
/proc/meminfo, no psutil needed on Linux) on a timer scheduled from its start time, so it does not
drift; the NVML handles are made once.

No NVIDIA driver (nvmlInit raises): the monitor says "no NVIDIA GPU" with NVML's reason, and the
CPU / RAM part and the rest of the app keep working. A reading NVML cannot give (a GPU without a
power sensor, an older driver) is None and shown as "n/a", never as zero.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QGridLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.gui.plots import SERIES_COLORS, finite_peak, fit_y_top, follow_x, make_plot
from app.hardware import HostReader, MonitorSample, NvmlReader, read_sample
from app.history import RingBuffer

GIB = 1024**3
SAMPLE_INTERVAL_S = 0.5
HISTORY_SAMPLES = 240  # two minutes at 2 Hz


class MonitorSampler(QObject):
    """Samples GPUs and host on its own thread; emits `sampled(MonitorSample)` every interval.

    Usage: sampler = MonitorSampler(); sampler.start(); ... sampler.stop().
    """

    sampled = Signal(object)
    _start_requested = Signal()
    _stop_requested = Signal()

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, nvml: Any = None):
        super().__init__()
        self.interval_s = interval_s
        self._nvml_module = nvml
        self._nvml: NvmlReader | None = None
        self._host: HostReader | None = None
        self._timer: QTimer | None = None
        self._started_at = 0.0
        self._ticks = 0
        self._thread = QThread()
        self._thread.setObjectName("specdeck-monitor")
        self.moveToThread(self._thread)
        self._start_requested.connect(self._begin)
        self._stop_requested.connect(self._end)
        self._thread.start()

    def start(self) -> None:
        self._start_requested.emit()

    def stop(self) -> None:
        """Stop sampling and the thread (blocks briefly; call from the GUI thread at shutdown)."""
        if self._thread.isRunning():
            self._stop_requested.emit()
            self._thread.quit()
            self._thread.wait(2000)

    def read_once(self) -> MonitorSample:
        """One sample taken on the calling thread (the first call sets NVML up)."""
        if self._nvml is None:
            self._nvml = NvmlReader(self._nvml_module)
            self._host = HostReader()
        return read_sample(self._nvml, self._host)

    @property
    def driver_version(self) -> str | None:
        return self._nvml.driver_version if self._nvml else None

    @Slot()
    def _begin(self) -> None:
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.timeout.connect(self._tick)
        self._started_at = time.monotonic()
        self._ticks = 0
        self._tick()

    @Slot()
    def _tick(self) -> None:
        self.sampled.emit(self.read_once())
        # Schedule from the start time, not from now, so the period does not drift; skip ticks
        # that are already past (a slow NVML call) rather than bunching them up.
        now = time.monotonic()
        self._ticks = max(self._ticks + 1, int((now - self._started_at) / self.interval_s) + 1)
        delay_s = self._started_at + self._ticks * self.interval_s - now
        self._timer.start(max(0, int(delay_s * 1000)))

    @Slot()
    def _end(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        if self._nvml is not None:
            self._nvml.close()


class MonitorTab(QWidget):
    """Per GPU: name, memory, utilisation, temperature, power, SM and memory clocks, with short
    histories (one line per GPU); and CPU / RAM. Works with no run going."""

    GPU_COLUMNS = ["GPU", "Name", "Memory used / total", "Util", "Temp", "Power / limit", "SM clock", "Mem clock"]

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.latest: MonitorSample | None = None
        self._start_time: float | None = None
        self._times = RingBuffer(HISTORY_SAMPLES)
        self._cpu = RingBuffer(HISTORY_SAMPLES)
        self._ram = RingBuffer(HISTORY_SAMPLES)
        self._gpu_series: dict[tuple[int, str], RingBuffer] = {}
        self._gpu_curves: dict[tuple[int, str], pg.PlotDataItem] = {}

        layout = QVBoxLayout(self)
        self.status_label = QLabel("Waiting for the first sample…")
        self.status_label.setWordWrap(True)
        self.status_label.setObjectName("monitorStatus")
        layout.addWidget(self.status_label)

        self.gpu_table = QTableWidget(0, len(self.GPU_COLUMNS))
        self.gpu_table.setHorizontalHeaderLabels(self.GPU_COLUMNS)
        self.gpu_table.verticalHeader().setVisible(False)
        self.gpu_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.gpu_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.gpu_table.horizontalHeader().setStretchLastSection(True)
        self.gpu_table.setMaximumHeight(180)
        layout.addWidget(self.gpu_table)

        self.host_label = QLabel("CPU – · RAM –")
        layout.addWidget(self.host_label)

        grid = QGridLayout()
        layout.addLayout(grid, 1)
        self.plots: dict[str, pg.PlotWidget] = {}
        # metric key -> (title, unit); a GPU plot has one line per GPU.
        self.gpu_metrics = {
            "memory_gib": ("GPU memory used", "GiB"),
            "utilization_percent": ("GPU utilisation", "%"),
            "temperature_c": ("Temperature", "°C"),
            "power_w": ("Power", "W"),
            "clock_sm_mhz": ("SM clock", "MHz"),
            "clock_memory_mhz": ("Memory clock", "MHz"),
        }
        for i, (key, (title, unit)) in enumerate(self.gpu_metrics.items()):
            plot = make_plot(title, unit, x_label="s")
            self.plots[key] = plot
            grid.addWidget(plot, i // 3, i % 3)
        self.plots["cpu_percent"] = make_plot("CPU", "%", x_label="s")
        self.plots["ram_gib"] = make_plot("RAM used", "GiB", x_label="s")
        self.plots["cpu_percent"].setYRange(0, 100)
        grid.addWidget(self.plots["cpu_percent"], 2, 0)
        grid.addWidget(self.plots["ram_gib"], 2, 1)
        # Ranges change in steps, not on every sample: a changed range repaints the plot's axes,
        # the costliest part of a paint, and with eight plots that would be every half second.
        # x follows the data on the CPU plot, which the others share; percentages span 0-100.
        x_master = self.plots["cpu_percent"]
        for plot in self.plots.values():
            plot.enableAutoRange(axis="x", enable=False)
            plot.enableAutoRange(axis="y", enable=False)
            if plot is not x_master:
                plot.setXLink(x_master)
        self.plots["utilization_percent"].setYRange(0, 100)
        self._cpu_curve = self.plots["cpu_percent"].plot(pen=pg.mkPen(SERIES_COLORS[0], width=2))
        self._ram_curve = self.plots["ram_gib"].plot(pen=pg.mkPen(SERIES_COLORS[1], width=2))

    @Slot(object)
    def add_sample(self, sample: MonitorSample) -> None:
        self.latest = sample
        if self._start_time is None:
            self._start_time = sample.time_s
        self._times.append(sample.time_s - self._start_time)
        host = sample.host
        self._cpu.append(host.cpu_percent)
        self._ram.append(None if host.ram_used_bytes is None else host.ram_used_bytes / GIB)
        for gpu in sample.gpus:
            values = {
                "memory_gib": None if gpu.memory_used_bytes is None else gpu.memory_used_bytes / GIB,
                "utilization_percent": gpu.utilization_percent,
                "temperature_c": gpu.temperature_c,
                "power_w": gpu.power_w,
                "clock_sm_mhz": gpu.clock_sm_mhz,
                "clock_memory_mhz": gpu.clock_memory_mhz,
            }
            for key, value in values.items():
                series = self._gpu_series.get((gpu.index, key))
                if series is None:
                    series = self._gpu_series[(gpu.index, key)] = RingBuffer(HISTORY_SAMPLES)
                    # Earlier samples of this GPU are missing, not zero.
                    for _ in range(len(self._times) - 1):
                        series.append(None)
                series.append(value)
        self._refresh_text(sample)
        if self.isVisible():
            self.redraw()

    def _refresh_text(self, sample: MonitorSample) -> None:
        if sample.nvml_error:
            self.status_label.setText(
                f"<b>No NVIDIA GPU</b> — NVML is not available: {sample.nvml_error}. "
                "GPU readings are off; CPU and RAM below still update, and runs on the CPU work."
            )
            self.status_label.setStyleSheet("background:#fff3cd; color:#664d03; padding:6px;")
        else:
            self.status_label.setText(f"{len(sample.gpus)} NVIDIA GPU(s), sampled every {SAMPLE_INTERVAL_S:g} s")
            self.status_label.setStyleSheet("")
        self.gpu_table.setVisible(bool(sample.gpus))
        for key in self.gpu_metrics:
            self.plots[key].setVisible(bool(sample.gpus) or not sample.nvml_error)
        self.gpu_table.setRowCount(len(sample.gpus))
        for row, gpu in enumerate(sample.gpus):
            cells = [
                str(gpu.index),
                gpu.name,
                f"{_gib(gpu.memory_used_bytes)} / {_gib(gpu.memory_total_bytes)} GiB",
                _fmt(gpu.utilization_percent, "%"),
                _fmt(gpu.temperature_c, " °C"),
                f"{_fmt(gpu.power_w, ' W')} / {_fmt(gpu.power_limit_w, ' W')}",
                _fmt(gpu.clock_sm_mhz, " MHz"),
                _fmt(gpu.clock_memory_mhz, " MHz"),
            ]
            for column, text in enumerate(cells):
                item = self.gpu_table.item(row, column)
                if item is None:
                    self.gpu_table.setItem(row, column, QTableWidgetItem(text))
                else:
                    item.setText(text)
        host = sample.host
        self.host_label.setText(
            f"CPU {_fmt(host.cpu_percent, '%')} · RAM {_gib(host.ram_used_bytes)} / {_gib(host.ram_total_bytes)} GiB"
        )

    def redraw(self) -> None:
        times = self._times.array()
        if times.size:
            follow_x(self.plots["cpu_percent"].getPlotItem(), float(times[0]), float(times[-1]))
        self._cpu_curve.setData(times, self._cpu.array(), connect="finite")
        self._ram_curve.setData(times, self._ram.array(), connect="finite")
        total = self.latest.host.ram_total_bytes if self.latest else None
        if total:  # the whole of RAM, so small changes do not look like big ones
            self._set_top(self.plots["ram_gib"], total / GIB)
        gpus = self.latest.gpus if self.latest else []
        # Memory and power up to the largest GPU's total and limit, like RAM; the rest fit the data.
        known = {
            "memory_gib": [g.memory_total_bytes / GIB for g in gpus if g.memory_total_bytes],
            "power_w": [g.power_limit_w for g in gpus if g.power_limit_w],
        }
        for key in ("memory_gib", "power_w", "temperature_c", "clock_sm_mhz", "clock_memory_mhz"):
            if known.get(key):
                self._set_top(self.plots[key], max(known[key]))
            else:
                series = [b.array() for (_, k), b in self._gpu_series.items() if k == key]
                if any(np.isfinite(a).any() for a in series):  # no reading yet: the range stays
                    fit_y_top(self.plots[key].getPlotItem(), finite_peak(*series))
        for (index, key), series in self._gpu_series.items():
            curve = self._gpu_curves.get((index, key))
            if curve is None:
                curve = self.plots[key].plot(
                    pen=pg.mkPen(SERIES_COLORS[index % len(SERIES_COLORS)], width=2),
                    name=f"GPU {index}",
                )
                self._gpu_curves[(index, key)] = curve
            curve.setData(times, series.array(), connect="finite")

    @staticmethod
    def _set_top(plot: pg.PlotWidget, top: float) -> None:
        if abs(plot.getViewBox().viewRange()[1][1] - 1.02 * top) > 1e-6 * top:
            plot.setYRange(0, top * 1.02, padding=0)

    def showEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        self.redraw()


def _fmt(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.0f}{unit}"


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.1f}"
