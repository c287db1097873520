"""Profiles and saved window state from a hand-edited or damaged config folder: one bad file never hides
the others or hangs; saves are atomic and race-free across processes; a full disk is one line naming the
file, with the old file intact; a bad window state is ignored with a notice and the window opens."""

from __future__ import annotations

import errno
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from app import profiles as P
from app.profiles import Profile, ProfileError, ProfileStore
from engine.settings import EngineSettings

GOOD = """\
version = 1
name = "good"

[settings]
speculative = true
draft_depth = 6
p_min = 0.1
chain = true
sub_vocab = 0
mirror_output = true
plan_pool = 8
"""


@pytest.fixture
def store(tmp_path, monkeypatch) -> ProfileStore:
    monkeypatch.setenv(P.CONFIG_DIR_ENV, str(tmp_path / "config"))
    s = ProfileStore(shipped_dir=None)
    s.directory.mkdir(parents=True)
    (s.directory / "good.toml").write_text(GOOD)
    return s


def listed(store: ProfileStore, seconds: float = 20.0):
    """store.list() in a thread with a deadline: a regression must not hang the suite."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", store.list()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "ProfileStore.list() hung"
    profiles, problems = out["r"]
    for problem in problems:
        assert "\n" not in str(problem) and len(str(problem)) < 500
    return [p.name for p in profiles], {p.path.name: p.message for p in problems}


def _deep(n: int) -> str:
    return GOOD + "[bench]\nx = " + "[" * n + "]" * n + "\n"


BAD_CONTENTS = {
    "deep-arrays": (_deep(100_000).encode(), "nested too deeply"),
    "deep-tables": ((GOOD + "[bench]\nx = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n").encode(), "nested too deeply"),
    "not-utf8": (b'version = 1\nname = "\xff\xfe"\n', "not UTF-8"),
    "nul-bytes": (b"\0" * 100, "not valid TOML"),
    "name-a-table": (GOOD.replace('name = "good"', "name = {a = 1}").encode(), "field 'name' must be a non-empty"),
    "depth-a-string": (GOOD.replace("draft_depth = 6", 'draft_depth = "6"').encode(), "draft_depth must be an integer"),
    "depth-a-float": (GOOD.replace("draft_depth = 6", "draft_depth = 6.0").encode(), "draft_depth must be an integer"),
    "p-min-nan": (GOOD.replace("p_min = 0.1", "p_min = nan").encode(), "p_min must be a number in 0..1"),
    "p-min-inf": (GOOD.replace("p_min = 0.1", "p_min = inf").encode(), "p_min must be a number in 0..1"),
    "settings-a-list": (GOOD.replace("[settings]", "settings = [1]\n[x]").encode(), "unknown field"),
    "version-huge": (GOOD.replace("version = 1", "version = 99999999999999999").encode(), "newer SpecDeck"),
    "version-bool": (GOOD.replace("version = 1", "version = true").encode(), "version' must be a positive integer"),
    "bench-a-string": (GOOD.replace('name = "good"', 'name = "good"\nbench = "fast"'), "'bench' must be a table"),
    "fraction-nan": (GOOD.replace("[settings]", "[settings]\nsub_vocab_fraction = nan").encode(), "(0, 1]"),
    "long-name": (GOOD.replace('"good"', '"' + "n" * 5000 + '"').encode(), "at most 1000"),
    "dotted-keys": ((GOOD + "[bench]\n" + ".".join(["a"] * 300_000) + " = 1").encode(), "took more than 2 s"),
    "deep-dotted-bench": ((GOOD + "[bench]\n" + ".".join(["a"] * 3000) + " = 1").encode(), "nested more than 8"),
    "control-key": (GOOD.replace("plan_pool = 8", 'plan_pool = 8\n"\\u0007\\n" = 1').encode(), "unknown setting"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CONTENTS))
def test_one_bad_file_never_hides_the_others(store, kind):
    content, expected = BAD_CONTENTS[kind]
    (store.directory / "bad.toml").write_bytes(content if isinstance(content, bytes) else content.encode())
    names, problems = listed(store)
    assert names == ["good"]
    assert expected in problems["bad.toml"], problems


def test_an_oversized_profile_is_refused_unread(store):
    with open(store.directory / "big.toml", "wb") as f:
        f.truncate(P.MAX_PROFILE_BYTES + 1)  # sparse
    names, problems = listed(store)
    assert names == ["good"] and "larger than 4 MiB" in problems["big.toml"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_is_skipped_without_blocking(store):
    os.mkfifo(store.directory / "pipe.toml")
    names, problems = listed(store, seconds=10)
    assert names == ["good"] and "FIFO" in problems["pipe.toml"]


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="/dev/zero")
def test_a_link_to_a_device_is_skipped_without_reading_it(store):
    os.symlink("/dev/zero", store.directory / "zero.toml")
    os.symlink("/dev/urandom", store.directory / "random.toml")
    names, problems = listed(store, seconds=10)
    assert names == ["good"] and "character device" in problems["zero.toml"] and "random.toml" in problems


def test_a_folder_or_a_broken_link_named_like_a_profile(store):
    (store.directory / "dir.toml").mkdir()
    os.symlink(store.directory / "nowhere", store.directory / "dangling.toml")
    names, problems = listed(store)
    assert names == ["good"] and "folder" in problems["dir.toml"] and "dangling.toml" in problems


def test_an_unreadable_file_is_a_problem_not_a_crash(store):
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    path = store.directory / "secret.toml"
    path.write_text(GOOD.replace("good", "secret"))
    path.chmod(0)
    names, problems = listed(store)
    assert names == ["good"] and "secret.toml" in problems


# ---- saving ------------------------------------------------------------------------------------------


def test_long_names_get_short_file_names_and_keep_their_text(store):
    long_name = "A very long profile name, " * 30  # 780 characters
    saved = store.save(Profile(name=long_name, settings=EngineSettings()))
    assert len(saved.path.name) <= 100 and saved.path.name.endswith(".toml")
    other = store.save(Profile(name=long_name + "x", settings=EngineSettings()))
    assert other.path != saved.path  # the hash tells them apart
    assert P.read_profile_file(saved.path).name == long_name.strip()
    with pytest.raises(ProfileError, match="at most 1000 characters"):
        store.save(Profile(name="n" * 5000, settings=EngineSettings()))
    assert P.file_name_for("CON") == "profile-con.toml"


def test_a_name_that_is_not_valid_unicode_is_refused_before_writing(store):
    with pytest.raises(ProfileError, match="not valid Unicode"):
        store.save(Profile(name="bad\ud800", settings=EngineSettings()))
    with pytest.raises(ProfileError, match="not valid Unicode"):
        store.save(Profile(name="fine", notes="bad\udcff", settings=EngineSettings()))
    assert sorted(p.name for p in store.directory.iterdir()) == ["good.toml"]


@pytest.mark.parametrize("where", ["fsync", "replace", "mkstemp"])
def test_a_full_disk_is_one_line_naming_the_file_and_the_old_file_stays(store, monkeypatch, where):
    saved = store.save(Profile(name="keep", settings=EngineSettings(draft_depth=2)))
    before = saved.path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target = {"fsync": (P.os, "fsync"), "replace": (P.os, "replace"), "mkstemp": (tempfile, "mkstemp")}[where]
    monkeypatch.setattr(*target, full)
    with pytest.raises(ProfileError) as info:
        store.save(Profile(name="keep", settings=EngineSettings(draft_depth=9)))
    msg = str(info.value)
    assert "\n" not in msg and "keep.toml" in msg and "No space left on device" in msg and "free some space" in msg
    assert isinstance(info.value, OSError)  # callers catching OSError (the app) still catch it
    assert saved.path.read_bytes() == before
    assert sorted(p.name for p in store.directory.iterdir()) == ["good.toml", "keep.toml"]  # no temp left
    with pytest.raises(ProfileError, match="No space left"):
        P.save_last_used(EngineSettings())


def _save_many(directory: str, worker: int, count: int, start_at: float) -> None:
    store = ProfileStore(Path(directory), shipped_dir=None)
    while time.time() < start_at:
        time.sleep(0.001)
    for i in range(count):
        # Names that differ but share a file name ("Race 3" / "race-3"), across the processes.
        name = f"Race {i}" if worker % 2 else f"race-{i}"
        store.save(Profile(name=f"{name} w{worker}", settings=EngineSettings(draft_depth=1 + i % 16)))
        store.save(Profile(name=name if worker < 2 else f"{name}!", notes=f"w{worker}", settings=EngineSettings()))


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_two_processes_saving_at_once_lose_no_profile(tmp_path):
    directory = tmp_path / "profiles"
    ctx = multiprocessing.get_context("fork")
    count, workers = 15, 4
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=_save_many, args=(str(directory), w, count, start_at)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    profiles, problems = ProfileStore(directory, shipped_dir=None).list()
    names = {p.name for p in profiles}
    for w in range(workers):
        for i in range(count):
            name = f"Race {i}" if w % 2 else f"race-{i}"
            assert f"{name} w{w}" in names
    # "Race i" and "race-i" are different names sharing a file name: both kept, in different files.
    assert {f"Race {i}" for i in range(count)} <= names and {f"race-{i}" for i in range(count)} <= names
    assert not problems, problems
    assert not [p for p in directory.iterdir() if p.suffix != ".toml"]  # no temp files left


# ---- saved window state --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe garbage", b"[[[[" * 10_000, GOOD.replace("draft_depth = 6", 'draft_depth = "x"').encode(), b""],
    ids=["not-utf8", "deep", "bad-value", "empty"],
)
def test_a_bad_last_used_file_is_ignored_with_a_notice(store, content):
    P.last_used_path().write_bytes(content)
    settings, notice = P.load_last_used()
    assert settings is None and notice.startswith("last used settings not restored") and "\n" not in notice


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_last_used_fifo_is_ignored_without_blocking(store):
    os.mkfifo(P.last_used_path())
    settings, notice = P.load_last_used()
    assert settings is None and "FIFO" in notice
