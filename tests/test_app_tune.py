"""The Tune panel in the Bench tab: start, progress over the budget, cancel (finished cells kept), and the
winner saved as a profile with its figures and the hardware it was measured on."""

# ruff: noqa: F811 (fixtures are imported from conftest_app and then named as test arguments)
from __future__ import annotations

from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    _left,
    app_config,
    make_window,
    one_torch_thread,
    window,
)


def _tune(qtbot, window, budget: int, tokens: int = 8):
    panel = window.bench_tab.tune_panel
    panel.budget.setValue(budget)
    panel.max_new_tokens.setValue(tokens)
    for name, box in panel.workload_boxes.items():
        box.setChecked(name == "code_gen")
    progress = []
    window.tune_runner.progress.connect(lambda fraction, message, cell: progress.append((fraction, cell)))
    qtbot.mouseClick(panel.start_button, _left())
    return panel, progress


def test_a_tune_runs_shows_progress_and_saves_the_winner_as_a_profile(qtbot, window):
    with qtbot.waitSignal(window.tune_runner.finished, timeout=RUN_TIMEOUT_MS) as done:
        panel, progress = _tune(qtbot, window, budget=5)
        assert window.state == "tune" and not panel.start_button.isEnabled() and panel.cancel_button.isEnabled()
        assert not window.run_panel.run_button.isEnabled()  # no run while the tune owns the engine
    report = done.args[0]
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert report is not None and not report.cancelled
    assert progress and all(0.0 <= f <= 1.0 for f, _ in progress)
    assert panel.table.rowCount() == len([c for c in report.cells if c.runs]) >= 2
    assert panel.saved_profile is not None and panel.saved_profile.name in panel.verdict.text()
    saved = window.store.get(panel.saved_profile.name)  # on disk, in the test's config folder
    assert saved.settings == report.winner.settings
    assert saved.bench["source"] == "tune" and saved.bench["tokens_per_second"] > 0
    assert saved.hardware.get("cpu_count", 0) >= 1
    assert panel.start_button.isEnabled() and window.run_panel.run_button.isEnabled()


def test_cancel_keeps_the_finished_cells(qtbot, window):
    panel, progress = _tune(qtbot, window, budget=600, tokens=96)
    qtbot.waitUntil(lambda: len(progress) >= 3, timeout=RUN_TIMEOUT_MS)
    with qtbot.waitSignal(window.tune_runner.finished, timeout=RUN_TIMEOUT_MS) as done:
        qtbot.mouseClick(panel.cancel_button, _left())
    report = done.args[0]
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert report.cancelled and "Cancelled" in panel.verdict.text()
    kept = [c for c in report.cells if c.runs]
    assert len(kept) >= 3 and panel.table.rowCount() == len(kept)
    assert report.elapsed_s < 600
