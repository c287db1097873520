"""Staged autotune: it stays within its budget, finds the best settings by what it measures (checked with
a deterministic measure, so the test checks the search and not the machine), confirms the finalists with
repeats beside the baseline, keeps finished cells when cancelled, and saves the winner as a profile."""

from __future__ import annotations

import json

import pytest

from app.profiles import ProfileStore
from app.tune import run_tune, winner_profile
from engine import EngineSettings

WORKLOADS = ["code_gen", "prose"]


class Ticks:
    """A clock that advances 0.1 "seconds" per scored generation (deterministic budgets)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def cost_model(ticks: Ticks):
    """Tokens per round over a made-up cost that grows with depth (chain halves the drafting cost)."""

    def score(stats: dict, settings: EngineSettings) -> float:
        ticks.t += 0.1
        depth = settings.draft_depth if settings.speculative and settings.draft_depth != "auto" else 2
        depth = depth if settings.speculative else 0
        per_step = 0.15 if settings.chain else 0.3
        return stats["mean_accepted_length"] / (1.0 + per_step * depth) * (0.97 if settings.p_min else 1.0)

    return score


def test_tune_finds_what_beats_the_default_and_a_rerun_confirms_it(tiny_engine):
    ticks = Ticks()
    score = cost_model(ticks)
    report = run_tune(tiny_engine, workloads=WORKLOADS, budget_s=6.0, max_new_tokens=24, clock=ticks, score=score)
    one_pass = 0.1 * len(WORKLOADS)
    assert report.elapsed_s <= 6.0 + one_pass + 1e-9  # within the budget (the cell under way finishes)
    assert not report.cancelled
    assert len(report.finalists) == 4 and report.baseline in report.finalists
    assert all(c.runs for c in report.finalists)
    assert report.winner.median == max(c.median for c in report.finalists)
    # The confirming re-run: the winner against the default, measured again the same way.
    sess = tiny_engine.new_session()

    def rerun(settings: EngineSettings) -> float:
        total = 0.0
        for w in WORKLOADS:
            from app.workloads import load_workloads

            sess.reset()
            prompt = load_workloads()[w].prompt_for(tiny_engine.tokenizer)
            total += score(tiny_engine.generate(prompt, 24, settings, sess).stats, settings)
        return total

    assert rerun(report.winner.settings) >= rerun(EngineSettings())
    if report.clear:
        assert rerun(report.winner.settings) > rerun(EngineSettings())
    assert report.winner.settings != EngineSettings() or "baseline is the best" in report.verdict()


def test_a_cancelled_tune_keeps_the_finished_cells(tiny_engine):
    measured = []

    def score(stats, settings):
        measured.append(settings)
        return stats["mean_accepted_length"]

    report = run_tune(
        tiny_engine,
        workloads=WORKLOADS,
        budget_s=60.0,
        max_new_tokens=8,
        score=score,
        should_stop=lambda: len(measured) >= 7,
    )
    assert report.cancelled
    finished = [c for c in report.cells if c.runs]
    assert len(finished) >= 3 and report.baseline.runs  # three whole passes were kept
    assert "cancelled" in report.format()


def test_the_winner_is_saved_as_a_profile_with_its_figures_and_hardware(tiny_engine, tmp_path):
    ticks = Ticks()
    report = run_tune(
        tiny_engine, workloads=WORKLOADS, budget_s=3.0, max_new_tokens=8, clock=ticks, score=cost_model(ticks)
    )
    store = ProfileStore(tmp_path, shipped_dir=None)
    saved = store.save(winner_profile(report, "tuned", model_name="tiny"))
    back = store.get("tuned")
    assert back.settings == report.winner.settings == saved.settings
    assert back.bench["source"] == "tune" and back.bench["model"] == "tiny"
    assert back.bench["tokens_per_second"] == pytest.approx(report.winner.median)
    assert back.bench["tokens_per_second_min"] <= back.bench["tokens_per_second_max"]
    assert back.hardware["cpu_count"] >= 1 and "specdeck tune" in back.notes


def test_a_real_clock_tune_ends_near_its_budget(tiny_engine):
    report = run_tune(tiny_engine, workloads=["code_gen"], budget_s=3.0, max_new_tokens=8)
    assert report.elapsed_s < 3.0 + 2.0  # the budget plus at most one short pass on a slow machine
    assert report.baseline.runs and report.winner.runs
    assert report.verdict()


def test_specdeck_tune_on_the_command_line_reports_and_saves_the_winner(tiny_model_dir, capsys, monkeypatch, tmp_path):
    from app.cli import main

    monkeypatch.setenv("SPECDECK_CONFIG_DIR", str(tmp_path / "config"))
    args = ["tune", "--model", str(tiny_model_dir), "--budget-s", "3", "-n", "8", "--workloads", "code_gen"]
    assert main([*args, "--save", "mine"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and ("beats the baseline" in out or "no clear difference" in out or "best found" in out)
    saved = ProfileStore(tmp_path / "config" / "profiles", shipped_dir=None).get("mine")
    assert saved.bench["source"] == "tune"


def test_depth_auto_on_the_command_line(tiny_model_dir, capsys):
    from app.cli import main

    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "def main", "-n", "12", "--json"]
    assert main([*args, "--depth", "auto", "--max-depth", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated"] == 12
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--depth", "deep"])
    assert exit_.value.code == 2 and "--depth" in capsys.readouterr().err
