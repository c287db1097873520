"""Synthetic acceptance in the window (issue 15): the Bench tab's rates field, a banner over the window while such
a bench runs (gone after), and bench profiles that cannot turn the mode on for a live run."""
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

from app.bench import SYNTHETIC_BANNER
from app.profiles import Profile
from engine.settings import EngineSettings


def _small_bench(tab, rates: str) -> None:
    tab.select_profiles("control", "shallow")
    for name, box in tab.workload_boxes.items():
        box.setChecked(name == "prose")
    tab.rounds.setValue(1)
    tab.max_new_tokens.setValue(8)
    tab.synthetic_rates.setText(rates)


def test_the_banner_is_up_while_a_synthetic_bench_runs_and_gone_after(qtbot, window):
    window.store.save(Profile(name="shallow", settings=EngineSettings(draft_depth=2, chain=True)))
    window.profiles_tab.reload()
    tab = window.bench_tab
    window.tabs.setCurrentWidget(tab)
    _small_bench(tab, "0.87, 0.78, 0.68")
    assert not window.synthetic_banner.isVisible()
    qtbot.mouseClick(tab.run_button, Qt.MouseButton.LeftButton)
    assert window.state == "bench"
    assert window.synthetic_banner.isVisible()
    assert SYNTHETIC_BANNER in window.synthetic_banner.text() and "0.87, 0.78, 0.68" in window.synthetic_banner.text()
    assert "synthetic" in window.state_label.text()
    window.tabs.setCurrentIndex(0)  # over every tab, not only the Bench tab
    assert window.synthetic_banner.isVisible()
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert not window.synthetic_banner.isVisible()

    report = tab.report
    assert report.synthetic and all(row.synthetic for row in report.rows) and report.rows
    assert tab.tables_view.toPlainText().startswith(SYNTHETIC_BANNER)
    assert SYNTHETIC_BANNER in tab.warning_label.text()
    # Its figures are no profile's real speed: nothing stored in the user profile.
    assert window.store.get("shallow").bench == {}
    # The knobs (and so the live runs and the last used settings) never took the rates.
    assert not window.knobs.settings().synthetic


def test_a_real_bench_shows_no_banner(qtbot, window):
    window.store.save(Profile(name="shallow", settings=EngineSettings(draft_depth=2, chain=True)))
    window.profiles_tab.reload()
    tab = window.bench_tab
    _small_bench(tab, "")
    tab.run_button.click()
    assert window.state == "bench" and not window.synthetic_banner.isVisible()
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert not tab.report.synthetic and "identical" in tab.warning_label.text()


def test_a_bad_rate_is_named_and_nothing_starts(qtbot, window):
    tab = window.bench_tab
    tab.select_profiles("control", "chain")
    tab.synthetic_rates.setText("0.9, 1.5")
    messages = []
    tab.message.connect(messages.append)
    tab.run_button.click()
    assert window.state == "idle" and not window.synthetic_banner.isVisible()
    assert messages and "'1.5' (position 2) is not in 0..1" in messages[-1]


def test_applying_a_bench_profile_leaves_live_runs_real(qtbot, window):
    profile = Profile(name="bench fast", settings=EngineSettings(draft_depth=4, synthetic_rates=(0.9,)), kind="bench")
    window.store.save(profile)
    window.profiles_tab.reload()
    window.apply_profile(window.store.get("bench fast"))
    assert window.knobs.settings().draft_depth == 4  # its knobs applied
    assert not window.worker.settings.synthetic and not window.knobs.settings().synthetic
    assert "Bench tab" in window.statusBar().currentMessage()
