"""The main window driven as a user would: run a tiny model, flip every knob mid-run, stop, errors."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import csv
import time

from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    app_config,
    make_window,
    one_torch_thread,
    start_run,
    stop_run,
    wait_for_settings,
    window,
)
from PySide6.QtCore import QElapsedTimer, Qt, QTimer


def test_every_knob_reaches_the_engine_mid_run_and_marks_every_plot(qtbot, window):
    knobs = window.knobs
    knobs.set_settings(
        knobs.settings().replace(draft_depth=3, chain=True, sub_vocab=0, p_min=0.0, plan_pool=8, speculative=True),
        emit=True,
    )
    # Long runs: Stop then lands inside a run (a 24-token repeat could end with 'length' just before it).
    start_run(qtbot, window, repeat=True, tokens=400)
    wait_for_settings(qtbot, window, draft_depth=3)
    assert window.run_panel.stop_button.isEnabled() and not window.run_panel.run_button.isEnabled()

    def change(action, **expected):
        markers_before = len(window.plots.markers)
        action()
        wait_for_settings(qtbot, window, **expected)  # the engine ran a round with it
        qtbot.waitUntil(lambda: len(window.plots.markers) > markers_before, timeout=RUN_TIMEOUT_MS)
        marker = window.plots.markers[-1]
        # The marker sits on every time plot, labelled with what changed.
        assert len(marker.lines) == len(window.plots.time_plots)
        assert all(line.label.textItem.toPlainText() == marker.label for line in marker.lines)
        return marker

    assert change(lambda: knobs.draft_depth.setValue(5), draft_depth=5).label == "depth 3→5"
    assert change(lambda: knobs.p_min.setValue(0.3), p_min=0.3).label == "p_min 0→0.3"
    assert change(lambda: knobs.sub_vocab.setValue(100), sub_vocab=100).label == "sub-vocab all→100"
    assert change(lambda: knobs.plan_pool.setValue(2), plan_pool=2).label == "pool 8→2"
    assert change(lambda: knobs.chain.click(), chain=False).label == "chain off"
    assert not knobs.sub_vocab.isEnabled()  # sub-vocab cannot act with chain off
    assert change(lambda: knobs.speculative.click(), speculative=False).label == "speculative off"
    assert not knobs.draft_depth.isEnabled() and "nothing is drafted" in knobs.draft_depth.toolTip()
    assert change(lambda: knobs.speculative.click(), speculative=True).label == "speculative on"
    # Mirror output cannot be clicked on the CPU; a profile still carries it to the engine.
    assert not knobs.mirror_output.isEnabled()
    mirror = not window.applied_settings.mirror_output
    profile = window.store.get("control" if not mirror else "best known")
    marker = change(lambda: window.apply_profile(profile), mirror_output=mirror)
    assert marker.label == f"▶ {profile.name}"

    finished = stop_run(qtbot, window)
    assert finished.stop_reason == "cancelled"
    assert window.run_panel.run_button.isEnabled()
    labels = [m.label for m in window.plots.markers]
    assert len(labels) == 8


def test_stop_returns_within_one_round(qtbot, window):
    updates = []
    window.worker.round.connect(updates.extend)
    start_run(qtbot, window, repeat=True, tokens=400)  # Stop lands inside a run, not between two
    qtbot.waitUntil(lambda: len(updates) > 3, timeout=RUN_TIMEOUT_MS)
    # When Stop reaches the engine (the click itself may wait behind a plot frame on a busy machine).
    stopped_at: list[float] = []
    stop = window.worker.stop
    window.worker.stop = lambda: (stopped_at.append(time.monotonic()), stop())[1]
    clock = time.monotonic()
    finished = stop_run(qtbot, window)
    elapsed = time.monotonic() - clock
    assert finished.stop_reason == "cancelled"
    # Rounds the engine finished after Stop reached it: at most the one in flight.
    assert sum(1 for u in updates if u.received_s > stopped_at[0]) <= 1
    slowest_round_s = max(u.event.time_round_s for u in updates)
    assert elapsed < 0.5 + 2 * slowest_round_s
    # The window is usable again: a second run starts and finishes.
    start_run(qtbot, window, repeat=False, tokens=8)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)


def test_the_event_loop_never_stalls_more_than_100_ms_during_a_run(qtbot, window):
    gaps_ms: list[int] = []
    clock = QElapsedTimer()
    timer = QTimer()
    timer.setInterval(10)
    timer.setTimerType(Qt.TimerType.PreciseTimer)

    def tick():
        gaps_ms.append(clock.restart())

    timer.timeout.connect(tick)
    window.tabs.setCurrentIndex(0)  # the Live tab: plots and text redraw while measuring
    qtbot.wait(200)  # the window's first paint is not part of the run
    clock.start()
    timer.start()
    # Measured from pressing Run: the model load (on the engine thread), the run, a knob change,
    # the tabs switched while it runs, and Stop.
    start_run(qtbot, window, repeat=True)
    rounds_before = window.plots.round_count
    frames_before = window.plots.frames_drawn
    qtbot.wait(1600)  # frames come at least once a second (plots.MAX_FRAME_INTERVAL_S)
    # Plots are drawn during the run, each frame between two rounds (worker.FrameGate).
    assert window.plots.frames_drawn > frames_before
    window.knobs.draft_depth.setValue(window.knobs.draft_depth.value() % 8 + 1)
    for tab in (1, 2, 3, 0):
        window.tabs.setCurrentIndex(tab)
        qtbot.wait(300)
    stop_run(qtbot, window)
    timer.stop()
    assert window.plots.round_count > rounds_before + 5  # the run really went on meanwhile
    assert len(gaps_ms) > 100
    print(f"timer gaps: max {max(gaps_ms)} ms, {sum(g > 30 for g in gaps_ms)} over 30 ms")
    assert max(gaps_ms) < 100, f"longest gap {max(gaps_ms)} ms: {sorted(gaps_ms)[-5:]}"


def test_an_engine_error_is_shown_and_the_app_stays_usable(qtbot, window, tmp_path):
    # A custom prompt left empty: the engine refuses it.
    window.run_panel.select_workload(None)
    window.run_panel.prompt_edit.setPlainText("")
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS):
        qtbot.mouseClick(window.run_panel.run_button, Qt.MouseButton.LeftButton)
    assert window.error_banner.isVisible()
    assert "The run failed" in window.last_error and "prompt is empty" in window.last_error
    assert window.state == "idle" and window.run_panel.run_button.isEnabled()

    # A folder that is not a model: the load fails, named in the banner.
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "readme.txt").write_text("hi")
    window.run_panel.add_model_dir(empty)
    window.run_panel.select_workload("code_gen")
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS):
        qtbot.mouseClick(window.run_panel.run_button, Qt.MouseButton.LeftButton)
    assert "Could not load the model" in window.last_error and "config.json" in window.last_error

    # Back to the good model: runs again, and the banner goes away.
    window.run_panel.model_combo.setCurrentIndex(
        window.run_panel.model_combo.findData(window.run_panel.model_dirs()[0])
    )
    start_run(qtbot, window, repeat=False, tokens=6)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert not window.error_banner.isVisible()
    assert window.last_run.stats["generated"] == 6


def test_accepted_draft_tokens_are_highlighted_in_the_output(qtbot, window, tiny_engine):
    from engine import EngineSettings

    prompt = "The quick brown fox"
    reference = tiny_engine.generate(prompt, 24, EngineSettings(speculative=False)).tokens
    prompt_ids = tiny_engine.tokenizer.encode(prompt)

    def oracle(tokens, n):  # a drafter that knows the target's greedy text: every draft is accepted
        done = len(tokens) - len(prompt_ids)
        return reference[done : done + n]

    window.run_panel.select_workload(None)
    window.run_panel.prompt_edit.setPlainText(prompt)
    window.run_panel.repeat.setChecked(False)
    window.run_panel.max_new_tokens.setValue(24)
    window.knobs.draft_depth.setValue(3)
    window.worker.load(window.model_key())
    qtbot.waitUntil(lambda: window.worker._session is not None, timeout=RUN_TIMEOUT_MS)
    window.worker._session.test_drafter = oracle
    updates = []
    window.worker.round.connect(updates.extend)
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS):
        qtbot.mouseClick(window.run_panel.run_button, Qt.MouseButton.LeftButton)
    output = window.output
    assert output.draft_tokens > 0 and output.target_tokens > 0
    assert output.draft_tokens + output.target_tokens == 24
    decode = tiny_engine.tokenizer.decode
    assert output.plain_text().endswith(decode(reference))
    # Exactly the tokens the engine flagged from_draft are shown highlighted.
    flagged = "".join(decode([t for t, d in zip(u.event.tokens, u.event.from_draft) if d]) for u in updates)
    assert flagged and output.draft_highlighted_text() == flagged


def test_knobs_that_cannot_act_are_disabled_with_the_reason(window):
    knobs = window.knobs
    knobs.set_settings(knobs.settings().replace(speculative=True, chain=False))
    assert not knobs.mirror_output.isEnabled() and "CPU" in knobs.mirror_output.toolTip()
    assert not knobs.plan_pool.isEnabled() and "CUDA graphs" in knobs.plan_pool.toolTip()
    assert not knobs.sub_vocab.isEnabled() and "Chain" in knobs.sub_vocab.toolTip()
    knobs.chain.click()
    assert knobs.sub_vocab.isEnabled()
    knobs.set_context("cuda", 1, 1000)
    assert not knobs.mirror_output.isEnabled() and "One GPU" in knobs.mirror_output.toolTip()
    assert knobs.plan_pool.isEnabled()
    knobs.set_context("cuda", 2, 1000)
    assert knobs.mirror_output.isEnabled()
    assert knobs.sub_vocab.maximum() == 1000  # never more than the model's vocabulary


def test_pause_clear_and_export_the_plots(qtbot, window, tmp_path):
    start_run(qtbot, window, repeat=True)
    window.knobs.draft_depth.setValue(window.knobs.draft_depth.value() % 8 + 1)
    qtbot.waitUntil(lambda: len(window.plots.markers) == 1, timeout=RUN_TIMEOUT_MS)

    window.plots.pause_button.click()
    assert window.plots.paused and window.plots.pause_button.text() == "Resume"
    drawn = len(window.plots.speed_raw_curve.getData()[0])
    recorded = window.plots.round_count
    qtbot.waitUntil(lambda: window.plots.round_count > recorded + 2, timeout=RUN_TIMEOUT_MS)
    qtbot.wait(100)
    assert len(window.plots.speed_raw_curve.getData()[0]) == drawn  # frozen while paused
    window.plots.pause_button.click()
    qtbot.waitUntil(lambda: len(window.plots.speed_raw_curve.getData()[0]) > drawn, timeout=5000)
    stop_run(qtbot, window)

    written = window.export_plot_csv(str(tmp_path / "run.csv"))
    with open(written[0], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == window.plots.round_count
    assert [r["marker"] for r in rows if r["marker"]] == [window.plots.markers[0].label]
    assert all(r["settings"].startswith("depth") for r in rows)
    assert float(rows[-1]["tokens_per_second"]) > 0 and rows[-1]["engine_weights_bytes"].isdigit()
    png = window.export_plot_png(str(tmp_path / "plots.png"))
    assert png.stat().st_size > 10_000

    window.plots.clear_button.click()
    assert window.plots.round_count == 0 and window.plots.markers == []
    assert len(window.plots.speed_raw_curve.getData()[0] or []) == 0


def test_last_used_settings_and_choices_are_restored_at_start(qtbot, make_window):
    first = make_window()
    first.knobs.draft_depth.setValue(9)
    first.knobs.p_min.setValue(0.4)
    first.run_panel.select_workload("prose")
    first.shutdown()
    second = make_window()
    assert second.knobs.settings().draft_depth == 9
    assert second.knobs.settings().p_min == 0.4
    assert second.run_panel.workload_name() == "prose"


def test_the_frame_gate_never_holds_the_engine_for_long():
    from app.gui.worker import FrameGate

    gate = FrameGate()
    gate.set_running(True)
    gate.request()  # the window asks and then never answers
    started = time.monotonic()
    gate.wait_for_frame()
    assert time.monotonic() - started < FrameGate.MAX_WAIT_S + 0.1
    assert not gate.requested
    gate.request()
    gate.set_running(False)  # a run's end withdraws the request: the window draws directly
    assert not gate.requested


def test_a_sub_vocab_larger_than_the_loaded_vocabulary_runs_on_all_of_it(qtbot, window):
    """A sub-vocab set before the model is known (or kept from a bigger model) larger than the model's
    vocabulary: the run uses the whole vocabulary and the knob shows it, instead of every round failing."""
    window.knobs.sub_vocab.setMaximum(10**6)
    window.knobs.sub_vocab.setValue(5000)  # the tiny model has 320 ids
    start_run(qtbot, window, repeat=False)
    wait_for_settings(qtbot, window, sub_vocab=0)
    assert window.worker.settings.sub_vocab == 0 and window.knobs.sub_vocab.value() == 0
