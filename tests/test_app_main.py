"""The entry points: `specdeck` (run_app) and `specdeck screenshot PATH` (screenshot)."""

# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

from conftest_app import app_config, one_torch_thread  # noqa: F401 (fixtures)
from PySide6.QtCore import QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication


def test_run_app_opens_the_window_and_returns_when_it_is_closed(qtbot, app_config, tiny_model_dir):
    from app.gui.main import run_app

    seen = []

    def close_the_window():
        for widget in QApplication.topLevelWidgets():
            if type(widget).__name__ == "MainWindow" and widget.isVisible():
                seen.append((widget.windowTitle(), widget.run_panel.model_dir()))
                widget.close()

    QTimer.singleShot(300, close_the_window)
    assert run_app(["specdeck", "--model", str(tiny_model_dir)]) == 0
    assert seen == [("SpecDeck", str(tiny_model_dir))]
    assert (app_config / "last_used.toml").exists()  # closing saved the last used settings


def test_screenshot_renders_the_window_after_a_short_run(qtbot, app_config, tiny_model_dir, tmp_path):
    from app.gui.main import screenshot

    path = screenshot(tmp_path / "shots" / "window.png", model=str(tiny_model_dir), tokens=24)
    image = QImage(str(path))
    assert (image.width(), image.height()) == (1440, 900)
    assert not (app_config / "last_used.toml").exists()  # a screenshot changes no user settings
