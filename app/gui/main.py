"""Entry points: run_app(argv) opens the window; screenshot(path) renders it offscreen.

`specdeck` (bare or `specdeck gui [--model DIR]`) calls run_app; `specdeck screenshot PATH`
calls screenshot.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

APP_NAME = "SpecDeck"


def _application(argv: list[str] | None = None) -> Any:
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    if app is None:
        app = QApplication(argv or [sys.argv[0] if sys.argv else "specdeck"])
        app.setApplicationName(APP_NAME)
        app.setOrganizationName(APP_NAME)
        app.setDesktopFileName("specdeck")
    return app


def run_app(argv: list[str] | None = None) -> int:
    """Open the main window and run the event loop until it closes. argv[1:] may hold
    `--model DIR`."""
    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog="specdeck", add_help=False)
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int)
    options, qt_args = parser.parse_known_args(argv[1:])
    if options.threads is not None:  # the engine thread reads it when it loads on the CPU
        if options.threads < 1:
            print("specdeck: error: --threads must be 1 or more", file=sys.stderr)
            return 2
        os.environ["SPECDECK_CPU_THREADS"] = str(options.threads)
    if (
        not os.environ.get("DISPLAY")
        and not os.environ.get("WAYLAND_DISPLAY")
        and sys.platform.startswith("linux")
        and "QT_QPA_PLATFORM" not in os.environ
    ):
        print(
            "specdeck: no display found (DISPLAY / WAYLAND_DISPLAY unset). Run it on a desktop, "
            "or use `specdeck screenshot PATH` to render the window offscreen.",
            file=sys.stderr,
        )
        return 2
    from app.gui.startup_check import xcb_problem

    problem = xcb_problem()  # before Qt: a missing library would make it abort (exit 134)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    app = _application([argv[0] if argv else "specdeck", *qt_args])
    from app.gui.window import MainWindow

    window = MainWindow(model_dir=options.model)
    window.show()
    return app.exec()


def screenshot(
    path: str | os.PathLike[str],
    model: str | None = None,
    tokens: int = 48,
    size: tuple[int, int] = (1440, 900),
    switch_to: str | None = "chain",
    start_with: str | None = "control",
    timeout_s: float = 300.0,
    theme: str = "light",
    quiet: bool = False,
) -> Path:
    """Render the window offscreen after a short run and save it as a PNG.

    The run starts with the `start_with` profile and switches to `switch_to` a few rounds in,
    so the picture shows a settings marker and its effect. Uses the bundled model unless
    `model` names a model folder. Nothing is saved to the user's settings. theme: light, dark or
    system. quiet: Qt's own warnings (the offscreen plugin's "does not support
    propagateSizeHints()") are not printed.
    """
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    if quiet:
        _silence_qt_warnings()
    app = _application()
    from app.gui.paint_queue import paint_queue
    from app.gui.window import MainWindow

    window = MainWindow(model_dir=model, remember=False, theme=theme)
    try:
        window.resize(*size)
        window.run_panel.repeat.setChecked(False)
        window.run_panel.select_workload("code_gen")
        window.run_panel.max_new_tokens.setValue(tokens)
        profiles = {p.name: p for p in window.profiles_tab.profiles}
        if start_with in profiles:
            window.apply_profile(profiles[start_with])
        window.show()
        window.tabs.setCurrentIndex(0)

        finished: list[Any] = []
        window.run_finished.connect(finished.append)
        window.start_run()
        switched = switch_to not in profiles
        deadline = time.monotonic() + timeout_s
        while not finished and time.monotonic() < deadline:
            app.processEvents()
            # Switch a third of the way through, so both settings have rounds on the plots.
            if not switched and window.plots.round_count >= max(3, tokens // 12):
                window.apply_profile(profiles[switch_to])
                switched = True
            time.sleep(0.005)
        if not finished:
            window.stop()
            raise TimeoutError(f"the screenshot run did not finish within {timeout_s:.0f} s")
        # Let the plots, text and monitor catch up, then draw everything once more.
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.01)
        window.plots.redraw(force_ranges=True)
        window.output.flush()
        app.processEvents()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with paint_queue().direct():  # every plot in the picture, none left for a later turn
            saved = window.grab().save(str(path))
        if not saved:
            raise OSError(f"could not write {path}")
        if window.last_error:  # the picture shows the error banner; the command still fails
            from engine.errors import EngineError

            raise EngineError(f"{window.last_error} (the picture at {path} shows it)")
        return path
    finally:
        window.shutdown()
        window.close()
        window.deleteLater()
        app.processEvents()


def _silence_qt_warnings() -> None:
    """Drop Qt's debug/info/warning output (kept: critical and fatal messages)."""
    from PySide6.QtCore import QtMsgType, qInstallMessageHandler

    def handler(kind: QtMsgType, _context: Any, message: str) -> None:
        if kind in (QtMsgType.QtCriticalMsg, QtMsgType.QtFatalMsg):
            sys.stderr.write(message + "\n")

    qInstallMessageHandler(handler)


if __name__ == "__main__":
    sys.exit(run_app(sys.argv))
