"""Synthetic acceptance in the application's services (issue 15): `specdeck bench --synthetic-rates`, the bench
report's marks, and profiles, which refuse the rates unless marked as a bench profile, so that a normal run can
never enable the mode by accident. (The window: tests/test_app_synthetic.py.)"""

# ruff: noqa: F811 (fixtures are imported from cli_fixtures and then named as test arguments)
from __future__ import annotations

import json
import tomllib

import pytest
from cli_fixtures import config, keep_torch_threads  # noqa: F401 (fixtures)

from app import profiles as P
from app.bench import SYNTHETIC_BANNER, BenchArm, parse_synthetic_rates, run_bench
from app.cli import main
from engine import Engine
from engine.settings import EngineSettings

BENCH = ["bench", "--rounds", "1", "-n", "6", "--workloads", "prose", "--threads", "1"]


# ---- the command line -------------------------------------------------------------------------------------


def test_cli_bench_with_synthetic_rates_says_so_and_marks_the_output(tiny_model_dir, config, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = tmp_path / "bench.csv"
    args = [*BENCH, "--model", str(tiny_model_dir), "--vs", "depth=4"]
    assert main([*args, "--synthetic-rates", "0.87,0.78,0.68", "--json", str(out), "--csv", str(rows)]) == 0
    printed = capsys.readouterr()
    assert SYNTHETIC_BANNER in printed.err  # said before the runs start
    tables = printed.out
    assert tables.startswith(SYNTHETIC_BANNER)  # and first in the printed tables
    assert "synthetic acceptance rates 0.87, 0.78, 0.68 (then 0.68)" in tables
    assert "outputs identical across arms" not in tables  # no claim about text that is not the model's
    assert "synthetic arms: left out of the text check" in tables
    data = json.loads(out.read_text())
    assert data["synthetic"] is True
    assert all(arm["settings"]["synthetic_rates"] == [0.87, 0.78, 0.68] for arm in data["arms"])
    assert data["rows"] and all(row["synthetic"] is True for row in data["rows"])
    assert "synthetic" in rows.read_text().splitlines()[0].split(",")


def test_cli_bench_without_the_flag_is_a_real_run(tiny_model_dir, config, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([*BENCH, "--model", str(tiny_model_dir), "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "SYNTHETIC" not in printed.out + printed.err
    data = json.loads(out.read_text())
    assert data["synthetic"] is False and not any(row["synthetic"] for row in data["rows"])


@pytest.mark.parametrize(
    "rates, message",
    [
        ("0.87,1.5,0.6", "synthetic rate '1.5' (position 2) is not in 0..1"),
        ("0.87,abc", "synthetic rate 'abc' (position 2) is not a number"),
        ("-0.1", "synthetic rate '-0.1' (position 1) is not in 0..1"),
        (",".join(["0.5"] * 17), "at most 16"),
    ],
)
def test_cli_refuses_a_bad_rate_naming_it(tiny_model_dir, config, capsys, rates, message):
    assert main([*BENCH, "--model", str(tiny_model_dir), "--synthetic-rates", rates]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdeck: error: ") and message in err and "Traceback" not in err


def test_cli_refuses_synthetic_rates_with_sampling(tiny_model_dir, config, capsys):
    args = [*BENCH, "--model", str(tiny_model_dir), "--synthetic-rates", "0.8", "--temperature", "0.7"]
    assert main(args) == 2
    assert "greedy rounds only; set the temperature to 0" in capsys.readouterr().err


def test_the_knob_flags_do_not_include_it():
    from app.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices
    for command in ("generate", "bench"):
        flags = {o for action in bench[command]._actions for o in action.option_strings}
        assert ("--synthetic-rates" in flags) == (command == "bench"), command
    assert parse_synthetic_rates("") == () and parse_synthetic_rates(" 0.9, 0.5 ") == (0.9, 0.5)


# ---- the report -------------------------------------------------------------------------------------------


def test_a_bench_arm_with_synthetic_rates_is_left_out_of_the_text_check(tiny_model_dir):
    eng = Engine.load(tiny_model_dir)
    arms = [
        BenchArm("real", EngineSettings(draft_depth=3)),
        BenchArm("synthetic", EngineSettings(draft_depth=3, synthetic_rates=(1.0,))),
    ]
    report = run_bench(eng, arms, ["prose"], rounds=1, max_new_tokens=12, warmup=False)
    real, synthetic = report.hashes("real", "prose"), report.hashes("synthetic", "prose")
    assert real != synthetic  # rate 1 accepts drafts the target would not have picked: another text
    assert report.synthetic and report.arms_agree  # not a warning: the synthetic text is not checked
    assert [row.synthetic for row in report.rows] == [False, True]


# ---- profiles: only a bench profile may set the rates ------------------------------------------------------


def _profile_text(kind: str | None, rates: str | None) -> str:
    lines = ["version = 1", 'name = "fast"']
    if kind is not None:
        lines.append(f'kind = "{kind}"')
    lines += [
        "[settings]",
        "speculative = true",
        "draft_depth = 3",
        "p_min = 0.0",
        "chain = true",
        "sub_vocab = 0",
        "mirror_output = false",
        "plan_pool = 8",
    ]
    if rates is not None:
        lines.append(f"synthetic_rates = {rates}")
    return "\n".join(lines) + "\n"


def test_a_normal_profile_file_that_sets_synthetic_rates_is_refused_saying_what_to_do(config, tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text(_profile_text(None, "[0.9, 0.8]"))
    with pytest.raises(P.ProfileError) as err:
        P.read_profile_file(path)
    message = str(err.value)
    assert message.startswith("fast.toml: ") and "synthetic_rates" in message
    assert "only a bench profile may" in message and 'kind = "bench"' in message
    # In the user's profile folder it is skipped with the same reason, never applied; loading it by name fails.
    (config / "profiles").mkdir(parents=True)
    (config / "profiles" / "fast.toml").write_text(_profile_text("tuning", "[0.9]"))
    profiles, problems = P.ProfileStore().list()
    assert "fast" not in [p.name for p in profiles]
    assert any(p.path.name == "fast.toml" and 'kind = "bench"' in p.message for p in problems)
    with pytest.raises(P.ProfileError, match="only a bench profile may"):
        P.load_profile("fast")


def test_a_bench_profile_keeps_its_rates_and_round_trips(config, tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text(_profile_text("bench", "[0.87, 0.78, 0.68]"))
    profile = P.read_profile_file(path)
    assert profile.kind == "bench" and profile.settings.synthetic_rates == (0.87, 0.78, 0.68)
    saved = P.ProfileStore().save(profile)
    data = tomllib.loads(saved.path.read_text())
    assert data["kind"] == "bench" and data["settings"]["synthetic_rates"] == [0.87, 0.78, 0.68]
    assert P.read_profile_file(saved.path).settings == profile.settings


def test_profiles_without_rates_read_and_write_as_before(config, tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text(_profile_text(None, None))
    profile = P.read_profile_file(path)
    assert profile.kind == "tuning" and not profile.settings.synthetic
    text = P.ProfileStore().save(profile).path.read_text()
    assert "synthetic" not in text and "kind" not in text  # files unchanged for older readers
    for shipped in P.ProfileStore(directory=config / "none").list()[0]:
        assert not shipped.settings.synthetic and shipped.kind == "tuning"
    bad = tmp_path / "odd.toml"
    bad.write_text(_profile_text("fastest", None))
    with pytest.raises(P.ProfileError, match="field 'kind' must be one of 'tuning', 'bench', got 'fastest'"):
        P.read_profile_file(bad)


def test_a_profile_with_rates_cannot_be_saved_unless_it_is_a_bench_profile(config):
    profile = P.Profile(name="sneaky", settings=EngineSettings(synthetic_rates=(0.9,)))
    with pytest.raises(P.ProfileError, match="only a bench profile may"):
        P.ProfileStore().save(profile)
    assert not (config / "profiles" / "sneaky.toml").exists()


def test_the_last_used_settings_never_hold_synthetic_rates(config):
    P.save_last_used(EngineSettings(draft_depth=5, synthetic_rates=(0.9, 0.5)))
    settings, problem = P.load_last_used()
    assert problem is None and settings == EngineSettings(draft_depth=5)
    # A hand-edited last_used.toml that sets them is not restored (and says why).
    P.last_used_path().write_text(_profile_text(None, "[0.9]").replace('"fast"', '"last used"'))
    settings, problem = P.load_last_used()
    assert settings is None and "only a bench profile may" in problem


def test_tune_refuses_a_bench_profile_baseline(tiny_model_dir, config, tmp_path, capsys):
    path = tmp_path / "fast.toml"
    path.write_text(_profile_text("bench", "[0.9]"))
    assert main(["tune", "--model", str(tiny_model_dir), "--profile", str(path), "--budget-s", "1"]) == 2
    assert "tune measures real acceptance" in capsys.readouterr().err
