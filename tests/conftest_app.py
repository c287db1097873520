"""Fixtures and helpers for the app's tests (pytest-qt, offscreen).

Import what a test module needs: `from conftest_app import app_config, window, ...`.
(tests/conftest.py, the lead's, sets QT_QPA_PLATFORM=offscreen and provides tiny_model_dir.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PYTEST_QT_API", "pyside6")

import pytest  # noqa: E402

import app.gui  # noqa: E402, F401 (the PySide6 6.12.0 guard, before pytest-qt's application emits a signal)

RUN_TIMEOUT_MS = 60_000  # generous: CI machines share two cores


@pytest.fixture
def app_config(tmp_path, monkeypatch) -> Path:
    """A fresh config dir (profiles, last used settings, window.ini) for each test."""
    directory = tmp_path / "specdeck-config"
    monkeypatch.setenv("SPECDECK_CONFIG_DIR", str(directory))
    return directory


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and on a shared two-core machine more
    threads spin against each other (seen: 50x slower rounds under load). Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_window(qtbot, app_config, tiny_model_dir):
    """make_window(**kwargs) -> a shown MainWindow on the tiny model; shut down after the test."""
    from app.gui.window import MainWindow

    windows = []

    def make(**kwargs: Any) -> MainWindow:
        kwargs.setdefault("model_dir", str(tiny_model_dir))
        window = MainWindow(**kwargs)
        qtbot.addWidget(window)
        window.run_panel.max_new_tokens.setValue(24)
        window.show()
        windows.append(window)
        return window

    yield make
    for window in windows:
        window.shutdown()
    from app.gui import theme

    if theme.current_mode != "system":  # a test that switched themes leaves the next one as it was
        theme.apply_theme("system")


@pytest.fixture
def window(make_window):
    return make_window()


def start_run(qtbot, window, repeat: bool = True, tokens: int = 24, workload: str | None = "code_gen"):
    """Press Run as a user would and wait for the first rounds to be plotted."""
    window.run_panel.repeat.setChecked(repeat)
    window.run_panel.max_new_tokens.setValue(tokens)
    if workload is not None:
        window.run_panel.select_workload(workload)
    qtbot.mouseClick(window.run_panel.run_button, _left())
    qtbot.waitUntil(lambda: window.plots.round_count > 0, timeout=RUN_TIMEOUT_MS)


def stop_run(qtbot, window) -> Any:
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.run_panel.stop_button, _left())
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    return blocker.args[0]


def wait_for_settings(qtbot, window, **expected: Any) -> None:
    """Wait until a round ran with these settings (RoundEvent.settings, as the engine saw them)."""

    def reached() -> bool:
        applied = window.applied_settings
        return applied is not None and all(getattr(applied, k) == v for k, v in expected.items())

    qtbot.waitUntil(reached, timeout=RUN_TIMEOUT_MS)


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def wait(qtbot, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        qtbot.wait(10)
