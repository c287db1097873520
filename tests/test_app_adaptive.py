"""The window with draft_depth "auto": the Auto box reaches the engine, the depth it picks each round is
plotted, and the expected tokens/s per depth it decided from is drawn over the position bars. And on
several (CPU) ranks the memory label shows every rank's own count."""

# ruff: noqa: F811 (fixtures are imported from conftest_app and then named as test arguments)
from __future__ import annotations

import numpy as np
from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    _left,
    app_config,
    make_window,
    one_torch_thread,
    start_run,
    stop_run,
    wait_for_settings,
    window,
)


def test_auto_depth_reaches_the_engine_and_the_plots_show_the_controller(qtbot, window):
    knobs = window.knobs
    assert not knobs.max_draft_depth.isEnabled()  # acts only with Auto
    knobs.max_draft_depth.setValue(5)
    qtbot.mouseClick(knobs.depth_auto, _left())
    assert knobs.settings().draft_depth == "auto" and knobs.settings().max_draft_depth == 5
    assert knobs.max_draft_depth.isEnabled() and not knobs.draft_depth.isEnabled()
    start_run(qtbot, window, repeat=True)
    wait_for_settings(qtbot, window, draft_depth="auto")
    qtbot.waitUntil(lambda: window.plots.round_count > 8, timeout=RUN_TIMEOUT_MS)
    stop_run(qtbot, window)
    window.plots.redraw(force_ranges=True)
    _, depths = window.plots.depth_curve.getData()
    chosen = depths[np.isfinite(depths)]
    assert chosen.size and chosen.min() >= 1 and chosen.max() <= 5
    x, y = window.plots.gain_curve.getData()
    assert len(x) == 5 and np.nanmax(y) == 1.0  # one point per depth, scaled to the best
    # Off again: a fixed depth, the curve is gone after the next run's rounds.
    qtbot.mouseClick(knobs.depth_auto, _left())
    assert knobs.settings().draft_depth == knobs.draft_depth.value()


def test_memory_of_every_rank_in_the_window(qtbot, window):
    """A round from an engine split over two GPUs carries every rank's own count; the label shows both."""
    import time

    from app.gui.worker import RoundUpdate
    from engine import EngineSettings, RoundEvent

    ev = RoundEvent(
        index=0,
        tokens=[1, 2],
        text="ab",
        from_draft=[True, False],
        drafted=3,
        accepted=1,
        settings=EngineSettings(),
        time_draft_s=0.001,
        time_verify_s=0.001,
        time_accept_s=0.0,
        time_host_s=0.0,
        time_round_s=0.002,
        depth=3,
    )
    gib = 1 << 30
    ev.run = {
        "memory": {"weights": 3 * gib},
        "memory_by_device": {"cuda:0": {"weights": gib, "process": 5 * gib}, "cuda:1": {"weights": 2 * gib}},
    }
    window.plots.add_rounds([RoundUpdate(ev, [("ab", False)], time.monotonic(), 1)])
    window.plots.redraw(force_ranges=True)
    text = window.plots.memory_label.text()
    assert "cuda:0 1.0" in text and "cuda:1 2.0" in text  # components only, not the process figure


def test_the_window_on_two_ranks_runs_and_shows_every_ranks_memory(qtbot, window):
    """The app split over two devices (two CPU ranks here, as the GPU test machine would have two GPUs):
    a run goes through, the model line says so, and the memory label lists both ranks' own counts."""
    combo = window.run_panel.device_combo
    combo.addItem("two CPU ranks (tensor parallel)", "cpu,cpu")
    combo.setCurrentIndex(combo.count() - 1)
    start_run(qtbot, window, repeat=False, tokens=16)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert window.model_info["devices"] == ["cpu (rank 0)", "cpu (rank 1)"]
    assert "split over 2 devices" in window.model_label.text()
    window.plots.redraw(force_ranges=True)
    text = window.plots.memory_label.text()
    assert "cpu (rank 0)" in text and "cpu (rank 1)" in text


def test_fallbacks_to_reference_ops_are_said_in_the_status_bar(qtbot, window):
    from app.gui.worker import RunFinished

    window._on_run_finished(RunFinished(1, {"fallbacks": {"attention_cached": 3}, "generated": 1}, "length", 0.1))
    assert "attention_cached (3)" in window.statusBar().currentMessage()
