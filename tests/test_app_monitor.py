"""The GPU monitor: a clear 'no NVIDIA GPU' state without NVML (this machine has no driver), and
the per-GPU readings when NVML answers (a stand-in NVML module with the same functions)."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest_app import app_config, make_window, one_torch_thread  # noqa: F401 (fixtures)

from app.gui.monitor import MonitorSampler, MonitorTab
from app.hardware import HostReader, NvmlReader

GIB = 1024**3


class NotSupported(Exception):
    pass


class FakeNvml:
    """Two GPUs; the second has no power sensor (NVML raises NotSupported for it)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self):
        self.shut_down = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200" if h == 0 else "NVIDIA H200"

    def nvmlSystemGetDriverVersion(self):
        return "570.86"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(10 + h) * GIB, total=141 * GIB)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=55 + h, memory=20)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise NotSupported()
        return 312_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if clock == self.NVML_CLOCK_SM else 2619


class BrokenNvml(FakeNvml):
    def nvmlInit(self):
        raise RuntimeError("Driver Not Loaded")


def test_without_nvml_the_monitor_says_no_nvidia_gpu_and_cpu_ram_still_work(qtbot):
    reader = NvmlReader()  # the real pynvml: there is no NVIDIA driver on this machine
    assert not reader.available and reader.read() == []
    assert "driver" in reader.unavailable_reason or "NVML" in reader.unavailable_reason

    sampler = MonitorSampler(interval_s=0.05)
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.show()
    sampler.sampled.connect(tab.add_sample)
    try:
        with qtbot.waitSignals([sampler.sampled] * 3, timeout=5000):
            sampler.start()
        qtbot.waitUntil(lambda: tab.latest is not None and tab.latest.host.cpu_percent is not None, timeout=5000)
    finally:
        sampler.stop()
    assert "No NVIDIA GPU" in tab.status_label.text()
    assert not tab.gpu_table.isVisible() and not tab.plots["memory_gib"].isVisible()
    assert tab.plots["cpu_percent"].isVisible()
    host = tab.latest.host
    assert 0 <= host.cpu_percent <= 100 and 0 < host.ram_used_bytes < host.ram_total_bytes
    assert "RAM" in tab.host_label.text() and "n/a" not in tab.host_label.text()


def test_with_nvml_every_gpu_reading_is_shown_and_a_missing_one_is_na(qtbot):
    fake = FakeNvml()
    sampler = MonitorSampler(nvml=fake)
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.show()
    try:
        for _ in range(3):
            tab.add_sample(sampler.read_once())
    finally:
        sampler.stop()
    assert sampler.driver_version == "570.86"
    assert tab.gpu_table.isVisible() and tab.gpu_table.rowCount() == 2
    row0 = [tab.gpu_table.item(0, c).text() for c in range(tab.gpu_table.columnCount())]
    assert row0 == ["0", "NVIDIA H200", "10.0 / 141.0 GiB", "55%", "61 °C", "312 W / 700 W", "1980 MHz", "2619 MHz"]
    assert tab.gpu_table.item(1, 5).text() == "n/a / 700 W"  # no power sensor: n/a, never 0
    assert "No NVIDIA GPU" not in tab.status_label.text()
    # One line per GPU in each history plot.
    assert len(tab.plots["memory_gib"].getPlotItem().listDataItems()) == 2
    power = tab._gpu_series[(1, "power_w")].array()
    assert len(power) == 3 and all(v != v for v in power)  # NaN gaps, not zeros


def test_a_failing_nvml_init_is_a_state_not_a_crash():
    reader = NvmlReader(BrokenNvml())
    assert not reader.available and reader.unavailable_reason == "the NVIDIA driver is not loaded"


def test_the_window_lists_nvml_gpus_as_devices_and_knobs_follow(qtbot, make_window):
    window = make_window(nvml=FakeNvml(), sample_interval_s=0.05)
    combo = window.run_panel.device_combo
    qtbot.waitUntil(lambda: combo.count() == 4, timeout=5000)
    assert [combo.itemData(i) for i in range(4)] == ["cpu", "cuda:0", "cuda:1", "cuda:0,cuda:1"]
    assert "NVIDIA H200" in combo.itemText(1) and "tensor parallel" in combo.itemText(3)
    combo.setCurrentIndex(1)
    # Chosen but not loaded yet: one GPU -> mirror output cannot act, plans can.
    assert not window.knobs.mirror_output.isEnabled() and "One GPU" in window.knobs.mirror_output.toolTip()
    assert window.knobs.plan_pool.isEnabled()
    combo.setCurrentIndex(3)
    assert window.model_key().devices == ["cuda:0", "cuda:1"]
    assert window.knobs.mirror_output.isEnabled()  # two GPUs: mirroring the output layer can act


def test_the_window_without_nvml_still_runs_and_shows_the_state(qtbot, make_window):
    window = make_window(sample_interval_s=0.05)
    window.tabs.setCurrentWidget(window.monitor_tab)
    qtbot.waitUntil(lambda: "No NVIDIA GPU" in window.monitor_tab.status_label.text(), timeout=5000)
    assert window.run_panel.device_combo.count() == 1  # cpu only


@pytest.mark.parametrize("missing", ["stat", "meminfo"])
def test_host_reader_without_proc_files_gives_none(tmp_path, missing):
    (tmp_path / "stat").write_text("cpu  10 0 10 80 0 0 0 0 0 0\n")
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 250 kB\n")
    (tmp_path / missing).unlink()
    reading = HostReader(tmp_path).read()
    if missing == "stat":
        assert reading.cpu_percent is None and reading.ram_used_bytes == 750 * 1024
    else:
        assert reading.ram_used_bytes is None and reading.ram_total_bytes is None
