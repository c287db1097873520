"""The Profiles tab as a user drives it: save, apply, rename, duplicate, delete, import, export,
and a corrupt file in the profiles folder."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import tomllib

import pytest
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

from app.profiles import SHIPPED_PROFILES_DIR, read_profile_file

SHIPPED_NAMES = sorted((read_profile_file(f).name for f in SHIPPED_PROFILES_DIR.glob("*.toml")), key=str.casefold)


def answer(monkeypatch, tab, **answers):
    """Answer the tab's dialogs for the user."""
    for name, value in answers.items():
        monkeypatch.setattr(tab, name, lambda *args, _value=value: _value)


def test_save_apply_rename_duplicate_delete(qtbot, window, monkeypatch):
    tab = window.profiles_tab
    window.tabs.setCurrentWidget(tab)
    window.knobs.draft_depth.setValue(7)
    window.knobs.p_min.setValue(0.2)

    answer(monkeypatch, tab, ask_new_profile=("Deep draft", "seven deep"), confirm=True)
    tab.save_button.click()
    saved = window.store.get("Deep draft")
    assert saved.settings == window.knobs.settings() and saved.notes == "seven deep"
    assert saved.hardware["cpu_count"] > 0 and "gpus" in saved.hardware
    assert tab.selected().name == "Deep draft"
    assert "Deep draft" in [window.profile_combo.itemText(i) for i in range(window.profile_combo.count())]
    data = tomllib.loads(saved.path.read_text())
    assert data["version"] == 1 and data["settings"]["draft_depth"] == 7

    # Apply another profile, then this one again: the knobs follow.
    tab.select("control")
    tab.apply_button.click()
    assert window.knobs.settings().draft_depth == 3 and not window.knobs.settings().chain
    tab.select("Deep draft")
    tab.apply_button.click()
    assert window.knobs.settings().draft_depth == 7 and window.knobs.settings().p_min == 0.2

    answer(monkeypatch, tab, ask_text="Deeper")
    tab.rename_button.click()
    assert window.store.find("Deep draft") is None and tab.selected().name == "Deeper"

    tab.duplicate_button.click()
    assert tab.selected().name == "Deeper copy"

    tab.delete_button.click()
    assert window.store.find("Deeper copy") is None and window.store.find("Deeper") is not None

    # Shipped profiles cannot be renamed or deleted: the buttons say so by being disabled.
    tab.select("chain")
    assert not tab.delete_button.isEnabled() and not tab.rename_button.isEnabled()
    assert tab.duplicate_button.isEnabled() and tab.apply_button.isEnabled()


def test_export_then_import(qtbot, window, monkeypatch, tmp_path):
    tab = window.profiles_tab
    tab.select("best known")
    target = tmp_path / "shared" / "best-for-a-friend.toml"
    target.parent.mkdir()
    answer(monkeypatch, tab, ask_save_path=str(target), ask_open_path=str(target))
    tab.export_button.click()
    assert tomllib.loads(target.read_text())["name"] == "best known"
    tab.import_button.click()
    imported = window.store.get("best known 2")  # "best known" was taken
    assert not imported.shipped and imported.sub_vocab_fraction == pytest.approx(0.215671)
    assert tab.selected().name == "best known 2"


def test_a_corrupt_profile_file_is_listed_and_skipped(qtbot, make_window, app_config, monkeypatch, tmp_path):
    profiles_dir = app_config / "profiles"
    profiles_dir.mkdir(parents=True)
    (profiles_dir / "broken.toml").write_text('version = 1\nname = "half\n[settings')
    (profiles_dir / "future.toml").write_text('version = 7\nname = "x"\n[settings]\n')
    window = make_window()
    tab = window.profiles_tab
    assert not tab.problems_label.isHidden()
    assert "2 bad profile file(s) skipped" in window.statusBar().currentMessage()
    text = tab.problems_label.text()
    assert "broken.toml" in text and "corrupt" in text
    assert "future.toml" in text and "newer SpecDeck" in text
    assert [p.name for p in tab.profiles] == SHIPPED_NAMES  # the good ones still load

    # Importing a broken file: an error message naming the file, nothing added, no crash.
    errors = []
    monkeypatch.setattr(tab, "show_error", errors.append)
    answer(monkeypatch, tab, ask_open_path=str(profiles_dir / "broken.toml"))
    tab.import_button.click()
    assert errors and "broken.toml" in errors[0]
    assert [p.name for p in tab.profiles] == SHIPPED_NAMES


def test_a_profile_with_a_vocabulary_fraction_is_scaled_to_the_loaded_model(qtbot, window):
    window.apply_profile(window.store.get("best known"))
    start_run(qtbot, window, repeat=False, tokens=6)
    vocab = window.model_info["vocab_size"]
    wait_for_settings(qtbot, window, sub_vocab=round(0.215671 * vocab))
    assert window.knobs.sub_vocab.value() == round(0.215671 * vocab)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)


def test_saved_profile_carries_the_last_runs_figures(qtbot, window, monkeypatch):
    start_run(qtbot, window, repeat=False, tokens=8)
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    answer(monkeypatch, window.profiles_tab, ask_new_profile=("after run", ""))
    window.profiles_tab.save_button.click()
    bench = window.store.get("after run").bench
    assert bench["source"] == "live run" and bench["generated"] == 8 and bench["tokens_per_second"] > 0
    assert bench["model"] == window.model_info["name"]
