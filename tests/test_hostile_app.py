"""The window opens whatever its saved state holds: a damaged window.ini or last_used.toml is ignored
with a notice, and a bad profile file is listed as a problem while the good ones stay usable."""

# ruff: noqa: F811

from __future__ import annotations

import os

import pytest
from conftest_app import app_config, make_window, one_torch_thread  # noqa: F401 (fixtures)

BAD_INI = [
    b"[window]\ngeometry=not a geometry\n[run]\nmax_new_tokens=lots\ndtype=a, b, c\nmodel_dirs=5\nworkload=@Variant(\\0)\n",
    b"\xff\xfe\x00garbage\n[[[[\n=====\n",
    b"[run]\nmax_new_tokens=99999999999999999999999\ncustom_prompt=@ByteArray(\\xff)\nmodel_dir=\\0\n",
]


@pytest.mark.parametrize("content", BAD_INI, ids=["bad-values", "garbage", "overflow"])
def test_a_bad_window_ini_is_ignored_and_the_window_opens(make_window, app_config, content):
    app_config.mkdir(parents=True, exist_ok=True)
    (app_config / "window.ini").write_bytes(content)
    (app_config / "last_used.toml").write_bytes(b"version = 1\nname = [[[\n")
    window = make_window()
    assert window.isVisible() and window.run_panel.dtype() in ("float32", "bfloat16", "float16")
    assert window.run_panel.max_new_tokens.value() >= 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_window_ini_fifo_is_moved_aside_with_a_notice(make_window, app_config, monkeypatch):
    from app.gui.window import MainWindow

    notices: list[str] = []
    original = MainWindow.show_message
    monkeypatch.setattr(MainWindow, "show_message", lambda self, text: (notices.append(text), original(self, text)))
    app_config.mkdir(parents=True, exist_ok=True)
    os.mkfifo(app_config / "window.ini")
    os.mkfifo(app_config / "last_used.toml")
    window = make_window()
    assert window.isVisible()
    assert any("window.ini.bad" in n for n in notices) and any("last used settings not restored" in n for n in notices)
    assert (app_config / "window.ini.bad").exists()


def test_bad_profile_files_are_listed_as_problems_and_the_window_opens(make_window, app_config):
    profiles = app_config / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "deep.toml").write_text("x = " + "[" * 50_000 + "]" * 50_000)
    (profiles / "binary.toml").write_bytes(os.urandom(4096))
    if os.path.exists("/dev/zero"):
        os.symlink("/dev/zero", profiles / "zero.toml")
    window = make_window()
    bad = {p.path.name for p in window.profiles_tab.problems}
    assert {"deep.toml", "binary.toml"} <= bad
    assert {"control", "chain"} <= {p.name for p in window.profiles_tab.profiles}  # the shipped ones still load
