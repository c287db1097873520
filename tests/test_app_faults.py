"""Faults around the app: NVML failing in the middle of a run, a read-only profile folder."""

from __future__ import annotations

import tempfile

import pytest

from app.profiles import Profile, ProfileError, ProfileStore
from engine.settings import EngineSettings


class FlakyNvml:
    """Answers at start, then every call fails (a driver reset, a GPU that fell off the bus)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    broken = False

    def _check(self):
        if self.broken:
            raise RuntimeError("GPU is lost")

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlSystemGetDriverVersion(self):
        return "580.1"

    def __getattr__(self, name):  # every reading
        if not name.startswith("nvmlDevice"):
            raise AttributeError(name)

        def reading(*args):
            self._check()
            from types import SimpleNamespace

            return (
                SimpleNamespace(used=1 << 30, total=1 << 37, gpu=50, memory=10)
                if name in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates")
                else 100
            )

        return reading


def test_a_profile_fingerprint_reads_the_gpus_through_the_monitor_reader(monkeypatch):
    """app.hardware is the one NVML reader: the fingerprint's GPUs and driver come from it, NVML shut down after."""
    import sys

    from app import profiles
    from app.hardware import gpu_names_and_driver

    nvml = FlakyNvml()
    closed = []
    nvml.nvmlShutdown = lambda: closed.append(True)
    assert gpu_names_and_driver(nvml) == (["NVIDIA H200"], "580.1") and closed == [True]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fingerprint = profiles.hardware_fingerprint()
    assert fingerprint["gpus"] == ["NVIDIA H200"] and fingerprint["nvidia_driver"] == "580.1"


def test_nvml_failing_mid_run_leaves_gaps_not_a_crash():
    from app.hardware import NvmlReader

    nvml = FlakyNvml()
    reader = NvmlReader(nvml)
    (ok,) = reader.read()
    assert ok.memory_used_bytes == 1 << 30
    nvml.broken = True
    (lost,) = reader.read()  # no exception: the readings are missing, shown as gaps
    assert lost.name == "NVIDIA H200" and lost.memory_used_bytes is None and lost.temperature_c is None


def test_read_only_profile_folder_is_a_clear_message_and_the_old_file_stays(tmp_path, monkeypatch):
    store = ProfileStore(tmp_path / "profiles", shipped_dir=None)
    store.save(Profile(name="mine", settings=EngineSettings(draft_depth=4)))
    before = (tmp_path / "profiles" / "mine.toml").read_text()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(ProfileError) as info:
        store.save(Profile(name="mine", settings=EngineSettings(draft_depth=7)))
    msg = str(info.value)
    assert "Permission denied" in msg and str(tmp_path / "profiles") in msg and "SPECDECK_CONFIG_DIR" in msg
    assert (tmp_path / "profiles" / "mine.toml").read_text() == before
