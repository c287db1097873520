"""What the hardware says, without Qt: every NVIDIA GPU through NVML and the host's CPU and RAM from /proc.

One module for the two users of NVML: the window's GPU monitor (app.gui.monitor samples these readers on
its own thread) and a profile's hardware fingerprint (app.profiles: the GPUs and the driver a profile was
tuned on). NVML comes from the nvidia-ml-py package (`import pynvml`), imported only when a reader starts.

No NVIDIA driver (nvmlInit raises): a reader says so in `unavailable_reason` and reads nothing; CPU and RAM
still work. A reading NVML cannot give (a GPU without a power sensor, an older driver) is None, never 0.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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

    @property
    def names(self) -> list[str]:
        """The GPUs' names, in NVML's index order ([] when NVML is unavailable)."""
        return list(self._names) if self.available else []

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


def read_sample(nvml: NvmlReader, host: HostReader) -> MonitorSample:
    """One reading of every GPU and the host, stamped with time.monotonic()."""
    error = None if nvml.available else nvml.unavailable_reason
    return MonitorSample(time.monotonic(), nvml.read(), host.read(), error)


def gpu_names_and_driver(nvml: Any = None) -> tuple[list[str], str | None]:
    """The GPUs' names and the driver's version, NVML shut down again after ([], None without NVML)."""
    reader = NvmlReader(nvml)
    try:
        return reader.names, reader.driver_version
    finally:
        reader.close()


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
