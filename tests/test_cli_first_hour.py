"""Issue 19, the command line as a new user meets it: threads, the bench's spread and verdict,
shipped profiles that each test one knob, profile lookup, and errors in the CLI's own words."""

# ruff: noqa: F811 (fixtures are imported from cli_fixtures and then named as test arguments)
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_fixtures import config, keep_torch_threads  # noqa: F401 (fixtures)

from app import profiles as P
from app.bench import BenchArm, BenchReport, BenchRow
from app.cli import main, user_wording
from app.threads import THREADS_ENV, apply_cpu_threads, cpu_threads, default_cpu_threads, usable_cores
from engine.settings import EngineSettings

# ---- threads ------------------------------------------------------------------------------------


def test_threads_flag_beats_the_variable_which_beats_the_default(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    threads, source = cpu_threads()
    assert threads == default_cpu_threads() and source.startswith("default")
    assert 1 <= threads <= max(1, usable_cores() - 1)  # one core left free, never oversubscribed
    monkeypatch.setenv(THREADS_ENV, "3")
    assert cpu_threads() == (3, THREADS_ENV)
    assert cpu_threads(2) == (2, "--threads")
    monkeypatch.setenv(THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="SPECDECK_CPU_THREADS must be a whole number"):
        cpu_threads()
    import torch

    assert apply_cpu_threads(1) == (1, "--threads") and torch.get_num_threads() == 1


def test_the_app_uses_the_same_rule(monkeypatch):
    from app.threads import cpu_threads_for_the_engine

    monkeypatch.setenv(THREADS_ENV, "2")
    assert cpu_threads_for_the_engine() == 2
    monkeypatch.delenv(THREADS_ENV)
    assert cpu_threads_for_the_engine() == default_cpu_threads()


def test_generate_says_its_thread_count_and_a_bad_variable_is_one_line(tiny_model_dir, capsys, monkeypatch):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "def", "-n", "4", "--threads", "1"]) == 0
    assert "1 CPU thread]" in capsys.readouterr().err
    monkeypatch.setenv(THREADS_ENV, "0")
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "def", "-n", "4"]) == 2
    assert "SPECDECK_CPU_THREADS must be a whole number of threads (1 or more), got '0'" in capsys.readouterr().err


# ---- the bench: spread and verdict ----------------------------------------------------------------


def _report(a: list[float], b: list[float], name_a: str = "A", name_b: str = "B") -> BenchReport:
    arms = [BenchArm(name_a, EngineSettings()), BenchArm(name_b, EngineSettings(draft_depth=5))]
    report = BenchReport(arms, ["prose"], len(a), 8, meta={"cpu_threads": 1, "cpu_threads_source": "--threads"})
    for arm, values in ((name_a, a), (name_b, b)):
        for rnd, v in enumerate(values):
            report.rows.append(BenchRow(arm, rnd, "prose", v, 2.0, 0.5, 8, "h"))
    return report


def test_a_difference_inside_the_spread_is_no_clear_difference():
    report = _report([100, 110, 120], [105, 115, 125])
    assert report.spread("A") == (100, 110, 120)
    assert report.verdict("A", "B") == "no clear difference"
    text = report.format_tables()
    assert "CPU threads: 1 (--threads)" in text
    assert "Min" in text and "Median" in text and "Max" in text
    assert "no clear difference between A and B: +4.5% is inside the spread" in text
    clear = _report([100, 101, 102], [120, 121, 122])
    assert clear.verdict("A", "B") == "faster" and clear.verdict("B", "A") == "slower"
    assert "B is faster than A: +19.8%" in clear.format_tables()
    assert _report([100], [120]).verdict("A", "B") == "one round, no spread"


def test_columns_stay_aligned_with_long_arm_names():
    long_a, long_b = "a profile with a rather long name", "control + draft_depth=5,chain=True"
    text = _report([100, 110], [105, 115], long_a, long_b).format_tables()
    blocks = [b.splitlines() for b in text.split("\n\n")]
    for block in blocks:
        if len(block) > 2 and set(block[1]) == {"-"}:
            header, rows = block[0], block[2:]
            # Every row's last column ends where the header's does (right-aligned numbers),
            # and no arm name was cut.
            for row in rows:
                assert len(row.rstrip()) <= len(header) + 1, (header, row)
    assert long_a in text and long_b in text


def test_bench_vs_chain_compares_control_with_one_knob(tiny_model_dir, config, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", "--model", str(tiny_model_dir), "--vs", "chain", "--rounds", "2", "-n", "4"]
    assert main([*args, "--workloads", "prose", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    a, b = report["arms"]
    assert a["name"] == "control" and b["name"] == "chain"
    assert EngineSettings(**a["settings"]).diff(EngineSettings(**b["settings"])) == {"chain": (False, True)}
    assert report["meta"]["cpu_threads"] == 1 and report["verdict"] is not None
    captured = capsys.readouterr()
    assert "[1 CPU thread (--threads)]" in captured.err
    # Knob flags change arm A, and say so in its name.
    assert main([*args, "--workloads", "prose", "--depth", "2", "--json", str(out)]) == 0
    a = json.loads(out.read_text())["arms"][0]
    assert a["name"] == "control + draft_depth=2" and a["settings"]["draft_depth"] == 2


# ---- shipped profiles, lookup, skip reasons ---------------------------------------------------------


def test_each_shipped_profile_changes_one_knob_of_control_except_best_known():
    shipped = {p.name: p for p in (P.read_profile_file(f) for f in P.SHIPPED_PROFILES_DIR.glob("*.toml"))}
    control = shipped.pop("control").settings
    best = shipped.pop("best known")
    assert len(shipped) >= 4
    for name, profile in shipped.items():
        changed = control.diff(profile.settings)
        assert len(changed) == 1 and profile.sub_vocab_fraction is None, (name, changed)
    changed = control.diff(best.settings)
    assert len(changed) >= 2
    for knob in ("chain", "draft depth", "sub-vocab", "mirrored", "plan pool"):
        assert knob in best.notes  # says what it changes


def test_profiles_are_found_by_display_name_or_file_name(config):
    for text in ("best known", "Best Known", "best-known", "best-known.toml"):
        assert P.load_profile(text).name == "best known"
    assert P.load_profile("target-only").settings.speculative is False


def test_a_skipped_profile_says_why(config, capsys, tiny_model_dir):
    profiles = config / "profiles"
    profiles.mkdir(parents=True)
    text = (P.SHIPPED_PROFILES_DIR / "depth-5.toml").read_text().replace('name = "depth 5"', 'name = "deep"')
    (profiles / "deep.toml").write_text(text.replace("draft_depth = 5", "draft_depth = 40"))
    with pytest.raises(P.ProfileError, match=r"profile 'deep' was skipped because of a bad value: deep.toml: "):
        P.load_profile("deep")
    args = ["bench", "--model", str(tiny_model_dir), "--profile", "deep", "--rounds", "1", "-n", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "skipped because of a bad value" in err and "draft_depth must be in 1..16, got 40" in err


# ---- the CLI's own words ---------------------------------------------------------------------------


def test_engine_messages_are_reworded_for_the_command_line():
    assert (
        user_wording("device 'cuda' asked for, but CUDA is not available here; use device='cpu'")
        == "--device cuda asked for, but CUDA is not available here; use --device cpu"
    )
    assert (
        user_wording("max_context must be an integer >= 16, got 8") == "--max-context must be an integer >= 16, got 8"
    )
    assert "load with a larger --max-context" in user_wording(
        "prompt (10 tokens) + max_new_tokens (10) exceeds the context of 16 tokens; shorten the prompt or load "
        "with a larger max_context"
    )
    assert user_wording("gemm='autotune' needs a CUDA device; use gemm='cublas'").endswith("use --gemm cublas")
    # A profile file's field keeps its file name.
    assert (
        user_wording("x.toml: settings.draft_depth must be in 1..16") == "x.toml: settings.draft_depth must be in 1..16"
    )


def test_cli_errors_use_flag_names(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--max-context", "8"]) == 2
    err = capsys.readouterr().err
    assert "--max-context must be" in err and "max_context" not in err
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "use --device cpu" in err and "device=" not in err


def test_screenshot_prints_no_qt_noise(tmp_path, tiny_model_dir):
    out = tmp_path / "shot.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", SPECDECK_CPU_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "app", "screenshot", str(out), "--model", str(tiny_model_dir), "-n", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out) and out.stat().st_size > 10_000
    assert proc.stderr == ""  # not "This plugin does not support propagateSizeHints()"
