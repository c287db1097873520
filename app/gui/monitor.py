"""GPU and host monitor: an NVML + /proc sampler on its own thread, and the GPU monitor tab.

The sampler reads every GPU through NVML (`import pynvml`, from the nvidia-ml-py package) and the
CPU / RAM from /proc/stat and /proc/meminfo (no psutil needed on Linux). It runs on a timer
scheduled from its start time, so it does not drift, and caches the NVML handles.

No NVIDIA driver (nvmlInit raises): the monitor says "no NVIDIA GPU" with NVML's reason, and the
CPU / RAM part and the rest of the app keep working. A reading NVML cannot give (a GPU without a
power sensor, an older driver) is None and shown as "n/a", never as zero.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

from app.gui.plots import SERIES_COLORS, RingBuffer, make_plot

GIB = 1024**3
SAMPLE_INTERVAL_S = 0.5
HISTORY_SAMPLES = 240  # two minutes at 2 Hz


@dataclass
class GpuReading:
    index: int
    name: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_percent: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    clock_sm_mhz: float | None = None
    clock_memory_mhz: float | None = None


@dataclass
class HostReading:
    cpu_percent: float | None = None
    ram_used_bytes: int | None = None
    ram_total_bytes: int | None = None


@dataclass
class MonitorSample:
    time_s: float  # time.monotonic() when it was taken
    gpus: list[GpuReading] = field(default_factory=list)
    host: HostReading = field(default_factory=HostReading)
    nvml_error: str | None = None  # set when there is no usable NVML: "no NVIDIA GPU" state


class NvmlReader:
    """Reads every NVIDIA GPU through NVML. `available` is False (with `unavailable_reason`) when
    there is no driver, no library or no GPU; read() then returns []."""

    def __init__(self, nvml: Any = None):
        self.available = False
        self.unavailable_reason = ""
        self.driver_version: str | None = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        try:
            if nvml is None:
                import pynvml as nvml  # from nvidia-ml-py
            self._nvml = nvml
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError, ...
            self.unavailable_reason = _nvml_message(exc)
            return
        try:
            count = nvml.nvmlDeviceGetCount()
            for i in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(handle)
                self._names.append(_text(nvml.nvmlDeviceGetName(handle)))
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as exc:
            self.unavailable_reason = _nvml_message(exc)
            self.close()
            return
        if not self._handles:
            self.unavailable_reason = "the NVIDIA driver reports no GPU"
            self.close()
            return
        self.available = True

    def read(self) -> list[GpuReading]:
        if not self.available:
            return []
        nvml = self._nvml
        readings = []
        for index, (handle, name) in enumerate(zip(self._handles, self._names)):
            reading = GpuReading(index=index, name=name)
            memory = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                reading.memory_used_bytes = int(memory.used)
                reading.memory_total_bytes = int(memory.total)
            utilization = _try(nvml.nvmlDeviceGetUtilizationRates, handle)
            if utilization is not None:
                reading.utilization_percent = float(utilization.gpu)
            temperature = _try(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            if temperature is not None:
                reading.temperature_c = float(temperature)
            power_mw = _try(nvml.nvmlDeviceGetPowerUsage, handle)
            if power_mw is not None:
                reading.power_w = power_mw / 1000.0
            limit_mw = (
                _try(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
                if hasattr(nvml, "nvmlDeviceGetEnforcedPowerLimit")
                else None
            )
            if limit_mw is not None:
                reading.power_limit_w = limit_mw / 1000.0
            sm = _try(nvml.nvmlDeviceGetClockInfo, handle, getattr(nvml, "NVML_CLOCK_SM", 1))
            if sm is not None:
                reading.clock_sm_mhz = float(sm)
            mem = _try(nvml.nvmlDeviceGetClockInfo, handle, getattr(nvml, "NVML_CLOCK_MEM", 2))
            if mem is not None:
                reading.clock_memory_mhz = float(mem)
            readings.append(reading)
        return readings

    def close(self) -> None:
        if getattr(self, "_nvml", None) is None:
            return
        with contextlib.suppress(Exception):  # shutting down: nothing left to report
            self._nvml.nvmlShutdown()
        self._handles = []
        self.available = False


class HostReader:
    """CPU use from /proc/stat deltas and RAM from /proc/meminfo (None where /proc is absent)."""

    def __init__(self, proc: Path = Path("/proc")):
        self._proc = proc
        self._last_cpu: tuple[int, int] | None = None
        self.read()  # prime the CPU counters so the first real reading is a delta

    def read(self) -> HostReading:
        return HostReading(cpu_percent=self._cpu_percent(), **self._memory())

    def _cpu_percent(self) -> float | None:
        try:
            first = (self._proc / "stat").read_text().splitlines()[0].split()
        except (OSError, IndexError):
            return None
        values = [int(v) for v in first[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already counted in user time
        last, self._last_cpu = self._last_cpu, (idle, total)
        if last is None or total <= last[1]:
            return None
        return 100.0 * (1.0 - (idle - last[0]) / (total - last[1]))

    def _memory(self) -> dict[str, int | None]:
        try:
            lines = (self._proc / "meminfo").read_text().splitlines()
        except OSError:
            return {"ram_used_bytes": None, "ram_total_bytes": None}
        kib = {}
        for line in lines:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                kib[key] = int(parts[0])
        total = kib.get("MemTotal")
        available = kib.get("MemAvailable", kib.get("MemFree"))
        if total is None or available is None:
            return {"ram_used_bytes": None, "ram_total_bytes": None}
        return {"ram_used_bytes": (total - available) * 1024, "ram_total_bytes": total * 1024}


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
        gpus = self._nvml.read()
        error = None if self._nvml.available else self._nvml.unavailable_reason
        return MonitorSample(time.monotonic(), gpus, self._host.read(), error)

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
        self._cpu_curve.setData(times, self._cpu.array(), connect="finite")
        self._ram_curve.setData(times, self._ram.array(), connect="finite")
        total = self.latest.host.ram_total_bytes if self.latest else None
        if total:  # the whole of RAM, so small changes do not look like big ones
            self.plots["ram_gib"].setYRange(0, total / GIB, padding=0.02)
        for (index, key), series in self._gpu_series.items():
            curve = self._gpu_curves.get((index, key))
            if curve is None:
                curve = self.plots[key].plot(
                    pen=pg.mkPen(SERIES_COLORS[index % len(SERIES_COLORS)], width=2),
                    name=f"GPU {index}",
                )
                self._gpu_curves[(index, key)] = curve
            curve.setData(times, series.array(), connect="finite")

    def showEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        self.redraw()


def _nvml_message(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError):
        return f"the nvidia-ml-py package is not installed ({text})"
    if "Library Not Found" in text or "LibraryNotFound" in type(exc).__name__:
        return "the NVIDIA driver's library (libnvidia-ml) was not found — no driver installed"
    if "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    return text


def _try(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except Exception:  # NVMLError_NotSupported and friends: this reading is unavailable
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fmt(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.0f}{unit}"


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.1f}"
