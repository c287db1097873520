"""app.profiles: the profile file format, its validation, and the store's operations (no Qt)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from app import profiles as P
from app.profiles import Profile, ProfileError, ProfileStore
from engine.settings import EngineSettings

GOOD = """\
version = 1
name = "deep"
notes = "tried on a 2-GPU box"

[settings]
speculative = true
draft_depth = 6
p_min = 0.1
chain = true
sub_vocab = 0
mirror_output = true
plan_pool = 8

[bench]
mean_tokens_per_second = 123.4
"""


@pytest.fixture
def config_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(P.CONFIG_DIR_ENV, str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture
def store(config_dir) -> ProfileStore:
    return ProfileStore()


SHIPPED_NAMES = sorted((P.read_profile_file(f).name for f in P.SHIPPED_PROFILES_DIR.glob("*.toml")), key=str.casefold)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_profiles_are_the_control_and_one_knob_changes(store):
    control, chain, best = store.get("control"), store.get("chain"), store.get("best known")
    assert control.shipped and chain.shipped and best.shipped
    assert control.settings == EngineSettings(draft_depth=3, chain=False, mirror_output=False, plan_pool=1)
    assert control.settings.diff(chain.settings) == {"chain": (False, True)}
    assert (best.settings.draft_depth, best.settings.chain, best.settings.plan_pool) == (5, True, 8)
    # sub-vocab follows the model: 32k of Qwen's 151,936 ids, scaled to each vocabulary.
    assert best.settings_for(151_936).sub_vocab == 32_768
    assert best.settings_for(320).sub_vocab == round(0.215671 * 320)
    assert control.settings_for(320).sub_vocab == 0


def test_round_trip_keeps_every_field(store):
    profile = Profile(
        name="mine",
        settings=EngineSettings(draft_depth=7, p_min=0.25),
        notes="n",
        hardware={"gpus": ["A", "B"], "cpu": "x"},
        bench={"tokens_per_second": 10.5},
    )
    saved = store.save(profile)
    assert saved.path.parent == store.directory and saved.path.name == "mine.toml"
    loaded = P.read_profile_file(saved.path)
    assert (loaded.name, loaded.settings, loaded.notes) == ("mine", profile.settings, "n")
    assert loaded.hardware == {"gpus": ["A", "B"], "cpu": "x"}
    assert loaded.bench == {"tokens_per_second": 10.5}
    assert tomllib.loads(saved.path.read_text())["version"] == P.PROFILE_FORMAT_VERSION


def test_missing_readings_are_left_out_not_written_as_zero(store):
    saved = store.save(Profile(name="m", settings=EngineSettings(), bench={"tokens_per_second": None, "rounds": 2}))
    assert tomllib.loads(saved.path.read_text())["bench"] == {"rounds": 2}


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD.replace("version = 1", "version = 9"), "newer SpecDeck (format version 9"),
        (GOOD.replace('notes = "tried', 'colour = "red"\nnotes = "tried'), "unknown field(s) 'colour'"),
        (GOOD.replace("plan_pool = 8", "plan_pool = 8\nturbo = true"), "unknown setting(s) settings.turbo"),
        (GOOD.replace("plan_pool = 8\n", ""), "incomplete: missing setting(s) settings.plan_pool"),
        (GOOD.replace('name = "deep"\n', ""), "missing field 'name'"),
        (GOOD.replace("version = 1\n", ""), "missing field 'version'"),
        (GOOD.replace("draft_depth = 6", "draft_depth = 40"), "settings.draft_depth must be in 1..16, got 40"),
        (GOOD.replace("chain = true", 'chain = "yes"'), "settings.chain must be true or false"),
        (GOOD[: len(GOOD) // 2] + "[[[", "corrupt, not valid TOML"),
        ("", "empty file"),
        (
            GOOD.replace("[settings]\n", "[settings]\nsub_vocab_fraction = 2.0\n"),
            "sub_vocab_fraction' must be in (0, 1]",
        ),
    ],
    ids=[
        "newer-version",
        "unknown-key",
        "unknown-setting",
        "partial",
        "no-name",
        "no-version",
        "out-of-range",
        "wrong-type",
        "corrupt",
        "empty",
        "bad-fraction",
    ],
)
def test_a_bad_file_is_reported_by_name_and_field_and_skipped(store, text, expected):
    write(store.directory / "good.toml", GOOD)
    write(store.directory / "bad.toml", text)
    profiles, problems = store.list()
    assert [p.name for p in profiles if not p.shipped] == ["deep"]  # the good one still loads
    assert len(problems) == 1
    assert problems[0].path.name == "bad.toml"
    assert expected in problems[0].message, problems[0].message
    assert str(problems[0]).startswith("bad.toml: ")
    with pytest.raises(ProfileError, match="bad.toml"):
        P.load_profile(store.directory / "bad.toml")


def test_binary_garbage_is_reported_not_raised(store):
    (store.directory).mkdir(parents=True)
    (store.directory / "junk.toml").write_bytes(b"\xff\xfe\x00garbage")
    _, problems = store.list()
    assert "not UTF-8" in problems[0].message


def test_save_is_atomic_a_failed_write_leaves_the_old_file(store, monkeypatch):
    saved = store.save(Profile(name="keep", settings=EngineSettings(draft_depth=2)))
    before = saved.path.read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(P.os, "replace", crash)
    with pytest.raises(OSError):
        store.save(Profile(name="keep", settings=EngineSettings(draft_depth=9)))
    assert saved.path.read_text() == before
    assert [p.name for p in store.directory.iterdir()] == ["keep.toml"]  # no temp file left over


def test_rename_duplicate_delete_import_export(store, tmp_path):
    store.save(Profile(name="First one", settings=EngineSettings(draft_depth=4)))
    renamed = store.rename("First one", "Second")
    assert renamed.path.name == "second.toml" and not (store.directory / "first-one.toml").exists()
    copy = store.duplicate("Second")
    assert copy.name == "Second copy" and copy.settings.draft_depth == 4
    with pytest.raises(ProfileError, match="already exists"):
        store.rename("Second copy", "second")
    exported = store.export("Second", tmp_path / "out" / "shared.toml")
    imported = store.import_file(exported)
    assert imported.name == "Second 2"  # the name was taken: a new one, nothing overwritten
    store.delete("Second")
    assert store.find("Second") is None and store.find("Second 2") is not None


def test_shipped_profiles_are_read_only_but_can_be_duplicated(store):
    with pytest.raises(ProfileError, match="shipped"):
        store.delete("control")
    with pytest.raises(ProfileError, match="shipped"):
        store.rename("chain", "x")
    copy = store.duplicate("best known", "my best")
    assert copy.sub_vocab_fraction == pytest.approx(0.215671)
    # A user profile of the same name shadows the shipped one.
    store.save(Profile(name="control", settings=EngineSettings(draft_depth=2)))
    assert store.get("control").settings.draft_depth == 2 and not store.get("control").shipped


def test_import_of_a_bad_file_names_the_file_and_field(store, tmp_path):
    bad = write(tmp_path / "theirs.toml", GOOD.replace("p_min = 0.1", "p_min = 3"))
    with pytest.raises(ProfileError, match=r"theirs.toml: settings.p_min must be a number in 0..1"):
        store.import_file(bad)
    assert store.names() == SHIPPED_NAMES


def test_load_profile_by_name_or_path_for_the_cli(store, tmp_path):
    assert P.load_profile("chain").name == "chain"
    path = write(tmp_path / "x.toml", GOOD)
    assert P.load_profile(str(path)).name == "deep"
    with pytest.raises(ProfileError, match="no profile named 'nope'"):
        P.load_profile("nope")


def test_last_used_settings_round_trip_and_a_bad_file_is_a_message(config_dir):
    assert P.load_last_used() == (None, None)
    P.save_last_used(EngineSettings(draft_depth=11))
    assert P.load_last_used() == (EngineSettings(draft_depth=11), None)
    P.last_used_path().write_text("version = 1\nname = [")
    settings, message = P.load_last_used()
    assert settings is None and "last_used.toml" in message and "corrupt" in message


def test_settings_for_a_count_bigger_than_the_vocabulary_means_all(store):
    profile = Profile(name="x", settings=EngineSettings(sub_vocab=50_000))
    assert profile.settings_for(320).sub_vocab == 0
    assert profile.settings_for(151_936).sub_vocab == 50_000


def test_hardware_fingerprint_without_nvidia(monkeypatch):
    fingerprint = P.hardware_fingerprint()
    assert fingerprint["cpu_count"] == os.cpu_count()
    assert isinstance(fingerprint["gpus"], list)
    assert P.hardware_fingerprint(["NVIDIA H200"])["gpus"] == ["NVIDIA H200"]


def test_a_profile_from_before_a_setting_existed_loads_with_the_value_it_ran_with(tmp_path):
    """prefill_chunk came after profiles were first saved: a file without it is not "incomplete", it gets
    the chunk the engine used then (2048), whatever today's default."""
    from app.profiles import SETTINGS_ADDED_LATER, load_profile

    assert "prefill_chunk" not in GOOD
    path = tmp_path / "old.toml"
    path.write_text(GOOD, encoding="utf-8")
    assert load_profile(path).settings.prefill_chunk == SETTINGS_ADDED_LATER["prefill_chunk"] == 2048
