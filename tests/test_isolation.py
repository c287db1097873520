"""The test suite never touches the user's own settings and profiles (conftest.py points every
settings path into a temp dir for the session, and fails the session on a write under the real
config dir)."""
# ruff: noqa: F811

from __future__ import annotations

import os
from pathlib import Path

import conftest
from conftest_app import app_config, make_window, one_torch_thread, window  # noqa: F401 (fixtures)


def test_the_config_dir_resolves_under_the_sessions_temp_dir():
    from app.profiles import ProfileStore, config_dir, last_used_path

    root = conftest.TEST_ROOT
    assert config_dir().resolve().is_relative_to(root)
    assert last_used_path().resolve().is_relative_to(root)
    assert ProfileStore().directory.resolve().is_relative_to(root)
    assert not config_dir().resolve().is_relative_to(conftest.REAL_CONFIG_DIR)
    # Without SPECDECK_CONFIG_DIR, platformdirs' answer is under the temp XDG_CONFIG_HOME.
    saved = os.environ.pop("SPECDECK_CONFIG_DIR")
    try:
        assert config_dir().resolve().is_relative_to(root)
    finally:
        os.environ["SPECDECK_CONFIG_DIR"] = saved


def test_a_window_that_remembers_writes_only_into_the_temp_dir(qtbot):
    from app.gui.window import MainWindow

    writes_before = len(conftest.WRITES_TO_REAL_CONFIG)
    window = MainWindow(remember=True)  # no app_config fixture: the session's own dir
    qtbot.addWidget(window)
    window.knobs.draft_depth.setValue(4)
    window.shutdown()  # saves last_used.toml and window.ini
    assert Path(window.qsettings.fileName()).resolve().is_relative_to(conftest.TEST_ROOT)
    from app.profiles import last_used_path

    assert last_used_path().exists() and last_used_path().resolve().is_relative_to(conftest.TEST_ROOT)
    assert len(conftest.WRITES_TO_REAL_CONFIG) == writes_before


def test_a_write_under_the_real_config_dir_would_be_caught():
    target = str(conftest.REAL_CONFIG_DIR / "last_used.toml")
    before = list(conftest.WRITES_TO_REAL_CONFIG)
    conftest._audit("open", (target, "w", os.O_WRONLY | os.O_CREAT))
    conftest._audit("os.replace", (target + ".tmp", target, -1, -1))
    conftest._audit("open", (target, "r", os.O_RDONLY))  # reading is fine
    caught = conftest.WRITES_TO_REAL_CONFIG[len(before) :]
    del conftest.WRITES_TO_REAL_CONFIG[len(before) :]  # a simulation: the session must not fail for it
    assert caught == [f"open {target}", f"os.replace {target}.tmp", f"os.replace {target}"]
