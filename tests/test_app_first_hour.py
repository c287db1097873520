"""Issue 19, the window as a new user meets it: the first click works, what is chosen is
remembered (or refused when it is not a model), plots that fit and advance together, gaps as
gaps, overlays and the bench chart, themes, shortcuts and help, and the start-up check."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    app_config,
    make_window,
    one_torch_thread,
    start_run,
    stop_run,
    window,
)
from PySide6.QtCore import Qt
from PySide6.QtGui import QPalette

from engine.settings import EngineSettings

# ---- the first run -------------------------------------------------------------------------------


def test_the_first_launch_selects_a_real_workload_and_run_works_at_once(qtbot, make_window, app_config):
    window = make_window()
    assert window.run_panel.workload_name() == "code_gen" and window.run_panel.prompt().strip()
    window.run_panel.max_new_tokens.setValue(6)
    window.run_panel.repeat.setChecked(False)
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.run_panel.run_button, Qt.MouseButton.LeftButton)
    assert blocker.args[0].stop_reason in ("length", "eos") and window.last_error is None
    from app.threads import default_cpu_threads

    assert "context 4,096 ·" in window.model_label.text()  # the model's trained length, said where it loads
    assert "trained length" in window.model_label.toolTip()

    assert window.model_label.text().endswith(
        f"· {default_cpu_threads()} CPU thread" + "s" * (default_cpu_threads() != 1)
    )


def test_an_empty_custom_prompt_is_not_restored(qtbot, make_window):
    window = make_window()
    window.run_panel.select_workload(None)  # Custom prompt, left empty
    window.shutdown()
    again = make_window()
    assert again.run_panel.workload_name() == "code_gen"


# ---- remembered: size, tab, profile, export folder; refused: a folder that is not a model --------------


def test_window_size_tab_profile_and_export_folder_are_restored(qtbot, make_window, tmp_path):
    window = make_window()
    window.resize(1100, 700)
    qtbot.waitUntil(lambda: window.width() == 1100)
    window.tabs.setCurrentIndex(2)
    window.apply_profile(window.store.get("depth 5"))
    exports = tmp_path / "my exports"
    exports.mkdir()
    window.export_plot_csv(str(exports / "run.csv"))
    window.shutdown()

    again = make_window()
    # The offscreen screen is 800 px wide, so Qt fits the restored width to it; the height fits and
    # comes back exactly, and neither is the 1440x900 a first launch gets.
    assert again.height() == 700 and again.width() < 1440
    assert again.tabs.currentIndex() == 2
    assert again.profile_combo.currentText() == "depth 5" and again.knobs.settings().draft_depth == 5
    assert again.export_dir == str(exports.resolve())


def test_a_folder_that_is_not_a_model_is_refused_and_not_remembered(qtbot, make_window, tmp_path, tiny_model_dir):
    window = make_window()
    before = window.run_panel.model_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("hello")
    for folder, why in ((empty, "empty"), (notes, "config.json not found")):
        assert window.choose_model_dir(str(folder)) is False
        assert why in window.last_error and not window.error_banner.isHidden()
        assert str(folder) not in window.run_panel.model_dirs()
        assert window.run_panel.model_dir() == before
    # The browse entry of the model list goes through the same check.
    window.run_panel.ask_model_dir = lambda: str(notes)
    refused = []
    window.run_panel.model_refused.connect(refused.append)
    window.run_panel._on_model_activated(window.run_panel.model_combo.count() - 1)
    assert refused and "config.json" in refused[0] and str(notes) not in window.run_panel.model_dirs()
    assert window.choose_model_dir(str(tiny_model_dir)) is True
    window.qsettings.setValue("run/model_dirs", [str(tiny_model_dir), str(notes)])  # as an old version saved
    window.remember = False  # keep that list as written
    window.shutdown()
    again = make_window()
    assert str(notes) not in again.run_panel.model_dirs()


# ---- plots ----------------------------------------------------------------------------------------------


def _updates(n: int, start_s: float, settings: EngineSettings | None = None, run_id: int = 1):
    settings = settings or EngineSettings()
    out = []
    for i in range(n):
        ev = types.SimpleNamespace(
            settings=settings,
            tokens=[1, 2, 3],
            drafted=3,
            accepted=2,
            time_round_s=0.01,
            time_draft_s=0.002,
            time_verify_s=0.006,
            time_accept_s=0.001,
            time_host_s=0.001,
            run=None,
            index=i,
        )
        out.append(types.SimpleNamespace(event=ev, received_s=start_s + 0.01 * i, run_id=run_id))
    return out


def test_the_status_line_and_every_plot_fit_at_1280x800(qtbot, window):
    window.resize(1280, 800)
    window.tabs.setCurrentIndex(0)
    plots = window.plots
    plots.add_rounds(_updates(40, 100.0))
    plots.set_engine_memory({"weights": 70 * 2**20, "kv_cache": 12 * 2**20, "snapshot_planes": 5 * 2**20})
    plots.redraw(force_ranges=True)
    qtbot.waitUntil(lambda: window.width() == 1280)
    qtbot.wait(50)
    view = plots.graphics
    assert view.ci.boundingRect().width() <= view.viewport().width() + 1  # no plot past the right edge
    for label in (plots.summary_label, plots.memory_label):
        assert label.text()
        assert label.wordWrap() and label.heightForWidth(label.width()) <= label.height() + 1  # nothing cut


def test_the_status_line_says_when_the_last_round_was_pipelined(qtbot, window):
    plots = window.plots
    updates = _updates(5, 50.0)
    for u in updates[1:]:
        u.event.pipelined = True
    plots.add_rounds(updates)
    plots.redraw(force_ranges=True)
    assert "(pipelined)" in plots.summary_label.text()
    held = _updates(1, 51.0)  # a round queued only once the one ahead was read (e.g. a setting changed)
    held[0].event.pipelined = False
    plots.add_rounds(held)
    plots.redraw(force_ranges=True)
    assert "round" in plots.summary_label.text() and "(pipelined)" not in plots.summary_label.text()


def test_all_plots_advance_together_in_one_frame(qtbot, window):
    plots = window.plots
    plots.add_rounds(_updates(30, 10.0))
    plots.draw_frame()
    last = plots.history.last("time_s")
    curves = [
        plots.speed_raw_curve,
        plots.acceptance_smooth_curve,
        plots.length_smooth_curve,
        plots.time_split_curves[-1],
        *plots.memory_component_curves.values(),
    ]
    for curve in curves:
        x, _ = curve.getData()
        assert x is not None and x[-1] == pytest.approx(last)


def test_a_stop_and_start_leave_a_gap_with_markers(qtbot, window):
    plots = window.plots
    plots.recording = True
    plots.add_rounds(_updates(10, 50.0))
    plots.mark_stop()
    plots.mark_start(monotonic_s=60.0)
    plots.add_rounds(_updates(10, 60.1, run_id=2))
    plots.redraw(force_ranges=True)
    assert [m.kind for m in plots.run_marks] == ["stop", "start"]
    assert all(len(m.lines) == len(plots.time_plots) for m in plots.run_marks)
    _, y = plots.speed_raw_curve.getData()
    assert np.isnan(y[10]) and np.isfinite(y[:10]).all() and np.isfinite(y[11:]).all()
    assert plots.speed_raw_curve.opts["connect"] == "finite"  # drawn as a gap, not a straight line
    _, stacked = plots.time_split_curves[0].getData()
    assert np.isnan(stacked[10])
    plots.clear()
    assert plots.run_marks == []


def test_marker_labels_take_turns_over_lanes_and_long_ones_are_shortened(qtbot, window):
    from app.gui.plots import MARKER_LABEL_CHARS

    plots = window.plots
    a, b = EngineSettings(), EngineSettings(draft_depth=5, p_min=0.3, chain=False, plan_pool=2)
    plots.add_rounds(_updates(3, 1.0, a) + _updates(3, 1.05, b) + _updates(3, 1.1, a))
    first, second = plots.markers[:2]
    assert first.lane != second.lane  # two changes close together: labels on different lines
    assert first.lines[0].label.orthoPos != second.lines[0].label.orthoPos
    assert len(first.shown) <= MARKER_LABEL_CHARS and first.shown != first.label and "more" in first.shown
    assert first.lines[0].label.toolTip() == first.label  # the whole label on hover


def test_a_finished_run_can_be_kept_or_loaded_as_a_dashed_overlay(qtbot, window, tmp_path):
    plots = window.plots
    plots.add_rounds(_updates(20, 5.0))
    plots.redraw(force_ranges=True)
    exported = window.export_plot_csv(str(tmp_path / "before.csv"))[0]
    overlay = plots.keep_as_overlay()
    assert overlay is not None and overlay.time_s[0] == 0 and plots.round_count == 0
    curve = plots._overlay_curves()["tokens_per_second_smoothed"]
    assert len(curve.xData) == 20 and np.isfinite(curve.yData).all()
    plots.remove_overlay()
    assert window.load_overlay(str(exported)) is True
    assert plots.overlay.name == "before" and len(plots.overlay.time_s) == 20
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    assert window.load_overlay(str(bad)) is False and "not a SpecDeck run export" in window.last_error


# ---- bench tab --------------------------------------------------------------------------------------------


def test_run_bench_says_why_it_is_greyed(qtbot, window):
    tab = window.bench_tab
    assert tab.run_button.isEnabled()
    start_run(qtbot, window, repeat=True, tokens=8)
    assert not tab.run_button.isEnabled() and "A run is going" in tab.run_button.toolTip()
    assert "A run is going" in tab.progress_label.text()
    stop_run(qtbot, window)
    assert tab.run_button.isEnabled() and "Greyed" not in tab.run_button.toolTip()


def test_the_bench_chart_shows_bars_with_spread_and_a_saved_bench_beside_them(qtbot, window, tmp_path):
    from app.bench import BenchArm, BenchReport, BenchRow
    from app.gui.bench_tab import figures_from_json, figures_from_report

    arms = [BenchArm("control", EngineSettings(chain=False)), BenchArm("chain", EngineSettings())]
    report = BenchReport(arms, ["code_gen", "prose"], 2, 8)
    for rnd in range(2):
        for w in report.workloads:
            report.rows.append(BenchRow("control", rnd, w, 100 + 10 * rnd, 2, 0.5, 8, "h"))
            report.rows.append(BenchRow("chain", rnd, w, 150 + 10 * rnd, 2, 0.5, 8, "h"))
    tab = window.bench_tab
    tab.on_finished(report)
    figures = figures_from_report(report)
    assert figures["control"]["code_gen"] == (105, 100, 110) and figures["chain"]["mixed avg"] == (155, 150, 160)
    import pyqtgraph as pg

    items = tab.bars.getPlotItem().items
    assert sum(isinstance(i, pg.BarGraphItem) for i in items) == 2
    assert sum(isinstance(i, pg.ErrorBarItem) for i in items) == 2
    saved = tmp_path / "yesterday.json"
    saved.write_text(report.to_json())
    assert figures_from_json(json.loads(saved.read_text())) == figures
    assert tab.load_comparison(saved) is True
    items = tab.bars.getPlotItem().items
    assert sum(isinstance(i, pg.BarGraphItem) for i in items) == 4  # two arms + the saved two, dashed


# ---- theme, shortcuts, help ---------------------------------------------------------------------------------


def test_dark_theme_reaches_the_widgets_and_the_plots_and_is_remembered(qtbot, make_window):
    from app.gui import theme

    window = make_window()
    window.set_theme("dark")
    qtbot.waitUntil(lambda: window.palette().color(QPalette.ColorRole.Window).lightness() < 100)
    assert window.plots.graphics.backgroundBrush().color().lightness() < 60
    assert window.bench_tab.bars.backgroundBrush().color().lightness() < 60
    axis = window.plots.speed_plot.getAxis("left")
    assert axis.textPen().color().lightness() > 150
    assert window.theme_actions["dark"].isChecked()
    window.shutdown()
    again = make_window()
    assert again.theme == "dark" and theme.current is theme.DARK
    again.set_theme("light")
    qtbot.waitUntil(lambda: again.palette().color(QPalette.ColorRole.Window).lightness() > 150)
    assert again.plots.graphics.backgroundBrush().color().lightness() > 200
    again.set_theme("system")
    assert again.theme_actions["system"].isChecked()


def test_shortcuts_pause_switch_tabs_and_export(qtbot, window, monkeypatch, tmp_path):
    window.activateWindow()
    window.pause_action.trigger()
    assert window.plots.paused and window.plots.pause_button.isChecked()
    window.plots.pause_button.click()
    assert not window.plots.paused and not window.pause_action.isChecked()
    assert window.pause_action.shortcut().toString() == "Space"
    # Space in a text field is a space, not a pause.
    window.run_panel.select_workload(None)
    window.run_panel.prompt_edit.setFocus()
    qtbot.keyClicks(window.run_panel.prompt_edit, "a b")
    assert window.run_panel.prompt() == "a b" and not window.plots.paused
    for index, action in enumerate(window.tab_actions):
        assert action.shortcut().toString() == f"Ctrl+{index + 1}"
        action.trigger()
        assert window.tabs.currentIndex() == index
    exported = []
    monkeypatch.setattr(window, "_ask_save", lambda *a: str(tmp_path / "x.csv"))
    monkeypatch.setattr(window.plots, "export_csv", lambda path: exported.append(path) or [tmp_path / "x.csv"])
    export = next(a for a in window.findChildren(type(window.pause_action)) if a.shortcut().toString() == "Ctrl+E")
    export.trigger()
    assert exported == [str(tmp_path / "x.csv")]


def test_help_lists_the_shortcuts_and_every_knob(qtbot, window):
    from app.gui.controls import KNOB_HELP
    from app.gui.window import SHORTCUTS

    keys = window.shortcuts_html()
    for key, _ in SHORTCUTS:
        assert key in keys
    glossary = window.glossary_html()
    for knob in KNOB_HELP:
        assert f"<code>{knob}</code>" in glossary
    titles = [a.text() for a in window.menuBar().actions()]
    assert "&View" in titles and "&Help" in titles
    help_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Help")
    assert {"Keyboard shortcuts", "Knob glossary"} <= {a.text() for a in help_menu.actions()}


# ---- the start-up check for the X11 plugin's libraries --------------------------------------------------------

LDD_DEBIAN_12 = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x1)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""


def test_the_xcb_check_names_the_missing_libraries_and_the_install_line(tmp_path):
    from app.gui.startup_check import missing_from_ldd, uses_xcb, xcb_problem

    assert missing_from_ldd(LDD_DEBIAN_12) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert uses_xcb({"DISPLAY": ":0"}) and uses_xcb({"QT_QPA_PLATFORM": "xcb"})
    assert not uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"})
    assert not uses_xcb({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"})
    plugin = tmp_path / "libqxcb.so"
    debian = 'ID=debian\nVERSION_ID="12"\n'
    line = xcb_problem({"DISPLAY": ":0"}, lambda p: LDD_DEBIAN_12, [plugin], debian)
    assert line.count("\n") == 0
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1" in line
    assert line.endswith("sudo apt-get install libxcb-icccm4 libxcb-keysyms1")
    fedora = xcb_problem({"DISPLAY": ":0"}, lambda p: LDD_DEBIAN_12, [plugin], "ID=fedora\n")
    assert fedora.endswith("sudo dnf install xcb-util-keysyms xcb-util-wm")
    other = xcb_problem({"DISPLAY": ":0"}, lambda p: LDD_DEBIAN_12, [plugin], "ID=arch\n")
    assert "apt-get" in other and "dnf" in other
    assert xcb_problem({"DISPLAY": ":0"}, lambda p: "\tlibc.so.6 => /lib/libc.so.6\n", [plugin], debian) is None
    assert xcb_problem({"QT_QPA_PLATFORM": "offscreen"}, lambda p: LDD_DEBIAN_12, [plugin], debian) is None
    # A library ldd misses but the loader finds (beside a bundled app) is not reported.
    found = xcb_problem({"DISPLAY": ":0"}, lambda p: LDD_DEBIAN_12, [plugin], debian, lambda n: "icccm" in n)
    assert "libxcb-keysyms.so.1" in found and "icccm" not in found


def test_the_app_prints_the_check_instead_of_letting_qt_abort(monkeypatch, capsys):
    import app.gui.startup_check as check
    from app.gui.main import run_app

    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setattr(check, "_run_ldd", lambda path: LDD_DEBIAN_12)
    assert run_app(["specdeck"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "libxcb-keysyms.so.1" in err and "Install:" in err


def test_the_check_agrees_with_ldd_on_this_machine():
    from app.gui.startup_check import _loadable, _run_ldd, missing_from_ldd, xcb_plugin_paths, xcb_problem

    plugins = xcb_plugin_paths()
    if not plugins or not _run_ldd(plugins[0]):
        pytest.skip("no xcb plugin or no ldd here")
    missing = {m for p in plugins for m in missing_from_ldd(_run_ldd(p)) if not _loadable(m)}
    line = xcb_problem({"DISPLAY": ":0"})
    if missing:
        assert line is not None and all(m in line for m in missing)
    else:
        assert line is None


def test_memory_areas_keep_only_the_rounds_where_memory_changes():
    from app.gui.plots import _change_points

    rows = np.array([[1, 1, 1, 2, 2, 2, 2, 3.0]])
    assert _change_points(rows).tolist() == [0, 2, 3, 6, 7]  # each step drawn as a step, and the ends
    assert _change_points(np.zeros((2, 0))).tolist() == []


def test_the_system_theme_follows_the_desktop_when_it_switches(qtbot, window, monkeypatch):
    from app.gui import theme

    window.set_theme("system")
    monkeypatch.setattr(theme, "system_is_dark", lambda: True)  # the desktop went dark
    window._on_system_scheme_changed()
    assert theme.current is theme.DARK and window.plots.graphics.backgroundBrush().color().lightness() < 60
    monkeypatch.setattr(theme, "system_is_dark", lambda: False)
    window._on_system_scheme_changed()
    assert theme.current is theme.LIGHT and window.plots.graphics.backgroundBrush().color().lightness() > 200
    window.set_theme("light")
    monkeypatch.setattr(theme, "system_is_dark", lambda: True)
    window._on_system_scheme_changed()  # a fixed choice stays as chosen
    assert theme.current is theme.LIGHT


def test_the_window_takes_threads_from_the_command_line(monkeypatch, capsys):
    import app.gui.startup_check as check
    from app.gui.main import run_app

    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("SPECDECK_CPU_THREADS", "1")  # restored after the test, whatever run_app sets
    assert run_app(["specdeck", "--threads", "0"]) == 2
    assert "--threads must be 1 or more" in capsys.readouterr().err
    monkeypatch.setattr(check, "_run_ldd", lambda path: LDD_DEBIAN_12)  # stop before Qt starts
    assert run_app(["specdeck", "--model", "x", "--threads", "3"]) == 2
    import os

    assert os.environ["SPECDECK_CPU_THREADS"] == "3"  # what the engine thread reads at its load


def test_the_first_rounds_of_a_run_are_drawn_at_once(qtbot, window):
    plots = window.plots
    plots._last_frame_s = __import__("time").monotonic()  # a frame was just drawn (e.g. before Clear)
    plots.add_rounds(_updates(3, 1.0))
    frames = plots.frames_drawn
    plots._on_timer()  # the next timer tick draws, without waiting out the frame interval
    assert plots.frames_drawn == frames + 1
    plots.add_rounds(_updates(3, 1.1))
    plots._on_timer()  # later rounds wait for the interval (the plots' share of time is capped)
    assert plots.frames_drawn == frames + 1


def test_a_title_too_long_for_its_plot_is_scaled_to_fit_not_cut(qtbot, window):
    window.resize(1280, 800)
    qtbot.waitUntil(lambda: window.width() == 1280)
    plot = window.plots.length_plot
    plot.setTitle("<b>Accepted length (tokens/round)</b>" + " — a key that makes the title far too long" * 3)
    qtbot.wait(20)
    label = plot.titleLabel
    shown = label.mapRectFromItem(label.item, label.item.boundingRect())
    assert label.item.scale() < 1.0
    assert shown.width() <= label.rect().width() + 1 and shown.left() >= -1
    plot.setTitle("<b>Short</b>")
    assert label.item.scale() == 1.0
