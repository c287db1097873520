"""Each panel saves and restores its own state (save_state() -> dict, restore_state(dict)); the window only
keeps those dicts. A saved state is untrusted: a bad value is ignored, the choice keeps its default, and
nothing raises."""

# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import pytest
from conftest_app import app_config, make_window, one_torch_thread  # noqa: F401 (fixtures)

from app.gui.controls import DEFAULT_NEW_TOKENS
from engine.settings import EngineSettings


def _change_every_panel(window) -> None:
    run = window.run_panel
    run.dtype_combo.setCurrentText("bfloat16")
    run.gemm_combo.setCurrentIndex(run.gemm_combo.findData("auto"))
    run.select_workload("prose")
    run.max_new_tokens.setValue(77)
    run.repeat.setChecked(False)
    window.knobs.set_settings(EngineSettings(draft_depth=6, p_min=0.25, chain=False, plan_pool=3), emit=True)


def _assert_changed(window, new_tokens: int | None = 77) -> None:
    run = window.run_panel
    assert run.dtype() == "bfloat16" and run.workload_name() == "prose" and not run.repeat.isChecked()
    assert run.gemm_combo.currentData() == "auto"
    assert new_tokens is None or run.max_new_tokens.value() == new_tokens
    assert window.knobs.settings() == EngineSettings(draft_depth=6, p_min=0.25, chain=False, plan_pool=3)


def _states(window) -> dict:
    return {name: panel.save_state() for name, panel in window.panels.items()}


def _fresh_states(make_window) -> dict:
    """What a new window's panels hold (the bundled model; make_window's short runs undone)."""
    window = make_window(remember=False, model_dir=None)
    window.run_panel.max_new_tokens.setValue(DEFAULT_NEW_TOKENS)
    return _states(window)


def test_the_window_keeps_its_panels_and_nothing_else_of_theirs(make_window):
    window = make_window(remember=False)
    assert set(window.panels) == {"run", "knobs"}
    for panel in window.panels.values():
        assert callable(panel.save_state) and callable(panel.restore_state)


def test_a_panel_state_comes_back_in_a_new_window(make_window):
    first = make_window(remember=False)
    _change_every_panel(first)
    states = {name: panel.save_state() for name, panel in first.panels.items()}
    first.shutdown()

    second = make_window(remember=False)  # opens with the defaults: nothing was stored
    assert second.run_panel.dtype() == "float32" and second.knobs.settings() == EngineSettings()
    for name, panel in second.panels.items():
        assert panel.restore_state(states[name]) == []
    _assert_changed(second)


def test_a_custom_prompt_and_model_folder_come_back(make_window, tiny_model_dir):
    first = make_window(remember=False)
    first.run_panel.select_workload(None)
    first.run_panel.prompt_edit.setPlainText("Write a haiku about caches.")
    state = first.run_panel.save_state()
    assert state["model_dirs"] == [str(tiny_model_dir)] and state["model_dir"] == str(tiny_model_dir)
    second = make_window(remember=False, model_dir=None)
    assert second.run_panel.model_dir() is None  # the bundled model
    assert second.run_panel.restore_state(state) == []
    assert second.run_panel.model_dir() == str(tiny_model_dir)
    assert second.run_panel.workload_name() is None
    assert second.run_panel.prompt() == "Write a haiku about caches."


def test_panel_states_are_saved_at_close_and_restored_at_start(make_window):
    first = make_window()
    _change_every_panel(first)
    first.shutdown()
    again = make_window()
    _assert_changed(again, new_tokens=None)  # make_window sets its own short runs after the restore
    assert str(again.qsettings.value("run/max_new_tokens")) == "77"


CORRUPT = {
    "run": {
        "model_dirs": 7,
        "model_dir": ["not", "text"],
        "dtype": "float8",
        "gemm": "turbo",
        "workload": b"\xff",
        "custom_prompt": None,
        "max_new_tokens": "lots",
        "repeat": "maybe",
        "unknown": object(),
    },
    "knobs": {
        "speculative": "yes",
        "draft_depth": "x",
        "p_min": 7,
        "chain": None,
        "sub_vocab": -1,
        "mirror_output": [],
        "plan_pool": 10**9,
        "max_draft_depth": 0.5,
        "no_such_knob": 1,
    },
}


def test_a_corrupt_state_is_ignored_and_leaves_the_defaults(make_window):
    reference = _fresh_states(make_window)
    window = make_window(remember=False, model_dir=None)
    _change_every_panel(window)
    for name, panel in window.panels.items():
        bad = panel.restore_state(CORRUPT[name])
        assert set(bad) == set(CORRUPT[name]) - {"unknown", "no_such_knob", "custom_prompt"}, name
    assert _states(window) == reference


@pytest.mark.parametrize("state", [None, "text", 5, [("dtype", "float16")]])
def test_a_state_that_is_not_a_table_does_not_crash(make_window, state):
    reference = _fresh_states(make_window)
    window = make_window(remember=False, model_dir=None)
    _change_every_panel(window)
    for panel in window.panels.values():
        panel.restore_state(state)
    assert _states(window) == reference


def test_a_corrupt_saved_state_on_disk_opens_with_defaults(make_window, app_config):
    app_config.mkdir(parents=True, exist_ok=True)
    (app_config / "window.ini").write_text(
        "[run]\nmodel_dirs=5\nmodel_dir=@Variant(\\0)\ndtype=a, b\nworkload=nope\nmax_new_tokens=-3x\nrepeat=2\n"
    )
    (app_config / "last_used.toml").write_text('version = 1\nname = "x"\n[settings]\ndraft_depth = "deep"\n')
    window = make_window(model_dir=None)
    assert window.isVisible() and window.knobs.settings() == EngineSettings()
    run = window.run_panel
    assert run.model_dir() is None and run.model_dirs() == [] and run.dtype() == "float32"
    assert run.workload_name() == "code_gen" and run.repeat.isChecked()


def test_the_gemm_choice_applies_on_a_gpu_and_is_greyed_on_the_cpu(make_window):
    """The GEMM backend is a load choice: greyed and not used on the CPU (it is about the products on a GPU),
    choosable and carried into the model to load once a GPU is selected, greyed again while a run goes."""
    window = make_window(remember=False, model_dir=None)
    run = window.run_panel
    run.gemm_combo.setCurrentIndex(run.gemm_combo.findData("auto"))
    assert run.device() == "cpu" and not run.gemm_combo.isEnabled()
    assert window.model_key().gemm == "cublas"
    run.set_devices(["NVIDIA H200"])
    run.device_combo.setCurrentIndex(run.device_combo.findData("cuda:0"))
    assert run.gemm_combo.isEnabled()
    assert window.model_key() == type(window.model_key())(None, "cuda:0", "float32", "auto")
    run.set_running(True)
    assert not run.gemm_combo.isEnabled()
    run.set_running(False)
    assert run.gemm_combo.isEnabled()
    run.set_devices([])  # the GPU gone (the monitor found none): back on the CPU, greyed again
    assert run.device() == "cpu" and not run.gemm_combo.isEnabled() and window.model_key().gemm == "cublas"
