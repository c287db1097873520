"""The app's sampling controls: shown next to the knobs, read at each run, reach the engine."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    app_config,
    make_window,
    one_torch_thread,
    window,
)
from PySide6.QtCore import Qt

from engine import SamplingParams


def test_sampling_panel_greedy_by_default_with_reasons_and_the_note(window):
    panel = window.sampling_panel
    assert panel.sampling() is None
    assert not panel.top_p.isEnabled() and "temperature 0" in panel.top_p.toolTip()
    assert "texts differ" in panel.toolTip() and "distributions are the same" in panel.toolTip()
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3)
    panel.set_sampling(sp)
    assert panel.sampling() == sp and panel.top_p.isEnabled()
    assert "texts differ" in panel.temperature.toolTip()
    panel.temperature.setValue(0.0)
    assert panel.sampling() is None


def test_a_sampled_run_reaches_the_engine_and_is_reproducible(qtbot, window, tiny_engine):
    prompt = "The quick brown fox"
    sp = SamplingParams(temperature=3.0, top_p=0.95, seed=5)
    window.sampling_panel.set_sampling(sp)
    window.run_panel.select_workload(None)
    window.run_panel.prompt_edit.setPlainText(prompt)
    window.run_panel.repeat.setChecked(False)
    window.run_panel.max_new_tokens.setValue(16)
    with qtbot.waitSignal(window.run_finished, timeout=RUN_TIMEOUT_MS):
        qtbot.mouseClick(window.run_panel.run_button, Qt.MouseButton.LeftButton)
    expected = tiny_engine.generate(prompt, 16, window.knobs.settings(), tiny_engine.new_session(), sampling=sp)
    greedy = tiny_engine.generate(prompt, 16, window.knobs.settings(), tiny_engine.new_session())
    assert expected.tokens != greedy.tokens
    assert window.output.plain_text().endswith(expected.text)


def test_a_profile_saved_in_the_app_carries_the_sampling(window, monkeypatch):
    sp = SamplingParams(temperature=0.9, top_k=30, seed=2)
    window.sampling_panel.set_sampling(sp)
    monkeypatch.setattr(window.profiles_tab, "ask_new_profile", lambda default: ("warm", ""))
    saved = window.profiles_tab.save_current()
    assert saved is not None and window.store.get("warm").sampling == sp
    window.sampling_panel.set_sampling(None)
    window.apply_profile(window.store.get("warm"))
    assert window.sampling_panel.sampling() == sp


def test_a_bench_arm_from_a_sampled_profile_samples(qtbot, window):
    from app.profiles import Profile
    from engine import EngineSettings

    sp = SamplingParams(temperature=2.0, seed=1)
    window.store.save(Profile(name="hot", settings=EngineSettings(draft_depth=2), sampling=sp))
    window.profiles_tab.reload()
    tab = window.bench_tab
    tab.select_profiles("control", "hot")
    for name, box in tab.workload_boxes.items():
        box.setChecked(name == "prose")
    tab.rounds.setValue(1)
    tab.max_new_tokens.setValue(6)
    with qtbot.waitSignal(window.worker.bench_finished, timeout=RUN_TIMEOUT_MS):
        qtbot.mouseClick(tab.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    report = tab.report
    assert [a.sampling for a in report.arms] == [None, sp]
    assert report.arms_agree and "sampled arms" in report.format_tables()
