"""RunHistory without Qt: ring buffers, rolling statistics, markers and the CSV export.

Nothing here imports PySide6 or pyqtgraph (tests/test_floors.py checks that app.history loads without them)."""

from __future__ import annotations

import csv
import types
from pathlib import Path

import numpy as np
import pytest

from app.history import (
    CSV_EXTRA_COLUMNS,
    OVERLAY_SERIES,
    ROUND_COLUMNS,
    RingBuffer,
    RunHistory,
    load_overlay,
    read_csv,
    settings_summary,
)
from engine.settings import EngineSettings

ROOT = Path(__file__).resolve().parent.parent


def _event(settings=None, tokens=3, drafted=3, accepted=2, round_s=0.01, index=0, run=None, depth=3, pipelined=False):
    return types.SimpleNamespace(
        pipelined=pipelined,
        settings=settings or EngineSettings(),
        tokens=list(range(tokens)),
        drafted=drafted,
        accepted=accepted,
        time_round_s=round_s,
        time_draft_s=round_s * 0.25,
        time_verify_s=round_s * 0.5,
        time_accept_s=round_s * 0.125,
        time_host_s=round_s * 0.125,
        run=run,
        index=index,
        depth=depth,
    )


def _feed(history: RunHistory, n: int, start_s: float = 100.0, run_id: int = 1, **kwargs) -> None:
    for i in range(n):
        history.add_round(_event(index=i, **kwargs), start_s + 0.01 * i, run_id)


# ---- ring buffer ------------------------------------------------------------------------------------------


def test_a_ring_buffer_keeps_the_last_capacity_values_oldest_first():
    ring = RingBuffer(4)
    assert len(ring) == 0 and ring.array().size == 0 and np.isnan(ring.last())
    for v in (1, 2, 3):
        ring.append(v)
    assert ring.array().tolist() == [1, 2, 3] and ring.last() == 3
    for v in (4, 5, 6, 7, 8, 9):  # wraps round more than once
        ring.append(v)
        assert ring.array().tolist() == list(range(max(1, v - 3), v + 1))
    assert len(ring) == 4 and ring.capacity == 4
    copy = ring.array()
    ring.append(10)
    assert copy.tolist() == [6, 7, 8, 9]  # what was read is a copy, not a view being overwritten
    ring.append(None)
    assert np.isnan(ring.last()) and ring.array()[:3].tolist() == [8, 9, 10]  # None is a gap, not 0
    ring.clear()
    assert len(ring) == 0 and ring.array().size == 0
    with pytest.raises(ValueError):
        RingBuffer(0)


def test_the_history_holds_at_most_capacity_rows_and_counts_every_round():
    history = RunHistory(capacity=8)
    _feed(history, 20)
    assert len(history) == 8 and history.round_count == 20
    assert history.column("round").tolist() == list(range(12, 20))  # the newest eight
    assert history.last("round") == 19
    assert history.settings_of_rows() == [EngineSettings()] * 8


# ---- rolling statistics ----------------------------------------------------------------------------------


def test_rolling_rates_are_over_the_last_smoothing_rounds():
    history = RunHistory(smoothing=4)
    tokens = [1, 2, 3, 4, 5, 6]
    for i, n in enumerate(tokens):
        history.add_round(_event(tokens=n, drafted=4, accepted=n - 1 if n <= 5 else 4, round_s=0.1, index=i), i, 1)
    speed = history.column("tokens_per_second")
    smooth = history.column("tokens_per_second_smoothed")
    assert speed.tolist() == pytest.approx([n / 0.1 for n in tokens])
    # Each smoothed value: tokens over time of the last (up to) four rounds.
    for i in range(len(tokens)):
        window = tokens[max(0, i - 3) : i + 1]
        assert smooth[i] == pytest.approx(sum(window) / (0.1 * len(window)))
    length = history.column("accepted_length_smoothed")
    assert length[-1] == pytest.approx(np.mean(tokens[-4:]))
    rate = history.column("acceptance_rate_smoothed")
    assert rate[-1] == pytest.approx((2 + 3 + 4 + 4) / 16)
    assert history.rolling_mean("time_round_ms", 2)[-1] == pytest.approx(100.0)


def test_no_draft_is_no_acceptance_rate_not_zero():
    history = RunHistory()
    history.add_round(_event(tokens=1, drafted=0, accepted=0, settings=EngineSettings(speculative=False)), 0.0, 1)
    assert np.isnan(history.column("acceptance_rate")[0]) and np.isnan(history.column("acceptance_rate_smoothed")[0])


def test_acceptance_by_position_restarts_at_a_settings_change():
    history = RunHistory()
    history.add_round(_event(drafted=3, accepted=1), 0.0, 1)
    history.add_round(_event(drafted=3, accepted=3), 0.1, 1)
    assert history.position_rates().tolist() == [1.0, 0.5, 0.5]
    history.add_round(_event(settings=EngineSettings(draft_depth=5), drafted=5, accepted=0), 0.2, 1)
    assert history.position_rates().tolist() == [0.0] * 5
    previous, summary = history.previous_positions
    assert previous.tolist() == [1.0, 0.5, 0.5] and summary == settings_summary(EngineSettings())


# ---- markers and gaps ------------------------------------------------------------------------------------


def test_a_settings_change_is_a_marker_at_its_round():
    history = RunHistory()
    a, b = EngineSettings(), EngineSettings(draft_depth=5, chain=False)
    _feed(history, 3, settings=a)
    assert history.markers == []
    marker = history.add_round(_event(settings=b), 100.5, 1)
    assert marker is history.markers[-1] and marker.round_number == 3 and marker.label == "depth 3→5, chain off"
    assert marker.time_s == pytest.approx(0.5)
    history.name_settings(a, "control")
    assert history.add_round(_event(settings=a), 100.6, 1).label == "▶ control"  # a profile's name when applied
    assert [start for start, _ in history.segments] == [0, 3, 4]


def test_a_stop_and_start_leave_one_gap_row_and_two_marks():
    history = RunHistory()
    assert history.mark_start(5.0) is None  # nothing stopped yet
    _feed(history, 5, start_s=10.0)
    history.mark_stop()
    stop, start = history.mark_start(monotonic_s=20.0)
    assert (stop.kind, start.kind) == ("stop", "start") and history.run_marks == [stop, start]
    assert stop.time_s == pytest.approx(0.04) and start.time_s == pytest.approx(10.0)
    _feed(history, 2, start_s=20.1, run_id=2)
    speed = history.column("tokens_per_second")
    assert np.isnan(speed[5]) and np.isfinite(speed[:5]).all() and np.isfinite(speed[6:]).all()
    assert history.column("time_s")[5] == pytest.approx((0.04 + 10.0) / 2)
    # The rolling rates start afresh after the gap.
    assert history.column("accepted_length_smoothed")[6] == pytest.approx(3.0)
    assert history.round_count == 8
    history.clear()
    assert history.run_marks == [] and history.markers == [] and len(history) == 0 and history.round_count == 0


def test_memory_samples_are_kept_only_while_recording():
    gpu = types.SimpleNamespace(index=0, name="GPU", memory_used_bytes=2 * 2**30, memory_total_bytes=8 * 2**30)
    sample = types.SimpleNamespace(time_s=3.0, gpus=[gpu])
    history = RunHistory()
    assert history.add_memory_sample(sample) is False and len(history.memory_times) == 0
    history.recording = True
    assert history.add_memory_sample(sample) is True
    assert history.gpu_memory_used[0].array().tolist() == [2.0] and history.gpu_names == {0: "GPU"}


# ---- CSV ---------------------------------------------------------------------------------------------------


def test_each_round_records_whether_it_was_pipelined():
    history = RunHistory()
    history.add_round(_event(index=0), 100.0, 1)
    history.add_round(_event(index=1, pipelined=True), 100.01, 1)
    old = _event(index=2)
    del old.pipelined  # an event from before the field: not pipelined
    history.add_round(old, 100.02, 1)
    assert history.column("pipelined").tolist() == [0.0, 1.0, 0.0]


def test_the_csv_round_trips_every_column(tmp_path):
    history = RunHistory()
    memory = {"weights": 70 * 2**20, "kv_cache": 12 * 2**20}
    _feed(history, 4, settings=EngineSettings(), run={"memory": memory}, pipelined=True)
    history.add_round(_event(settings=EngineSettings(p_min=0.3), index=4), 100.2, 1)
    history.mark_stop()
    history.mark_start(monotonic_s=101.0)
    _feed(history, 2, start_s=101.5, run_id=2, settings=EngineSettings(p_min=0.3))
    path = tmp_path / "run.csv"
    assert history.export_csv(path) == [path]  # no GPU readings: no second file

    with path.open(newline="", encoding="utf-8") as f:
        header = next(csv.reader(f))
    assert header == ROUND_COLUMNS + CSV_EXTRA_COLUMNS
    back = read_csv(path)
    assert set(back) == set(ROUND_COLUMNS)
    for name in ROUND_COLUMNS:
        expected = history.column(name)
        assert back[name] == pytest.approx(expected, rel=1e-5, nan_ok=True), name
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == history.round_count == 8
    assert [r["marker"] for r in rows if r["marker"]] == ["p_min 0→0.3"] and rows[4]["marker"]
    assert rows[0]["settings"] == settings_summary(EngineSettings())
    assert rows[-1]["settings"] == settings_summary(EngineSettings(p_min=0.3))
    assert rows[5]["tokens"] == "" and rows[5]["time_s"]  # the gap row: missing, not 0
    assert rows[0]["engine_weights_bytes"] == str(70 * 2**20) and rows[0]["engine_workspace_bytes"] == ""

    overlay = load_overlay(path)
    assert overlay.name == "run" and overlay.time_s[0] == 0 and set(overlay.series) == set(OVERLAY_SERIES)
    assert len(overlay.time_s) == 8
    assert rows[0]["pipelined"] == "1"
    # an export from before the pipelined column still loads as an overlay
    older = tmp_path / "older.csv"
    with older.open("w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, [k for k in rows[0] if k != "pipelined"])
        out.writeheader()
        out.writerows({k: v for k, v in r.items() if k != "pipelined"} for r in rows)
    assert load_overlay(older).series["tokens_per_second_smoothed"] == pytest.approx(
        overlay.series["tokens_per_second_smoothed"], nan_ok=True
    )


def test_gpu_memory_goes_to_its_own_csv(tmp_path):
    history = RunHistory()
    history.recording = True
    for t, used in ((1.0, 2 * 2**30), (1.5, None)):
        gpu = types.SimpleNamespace(index=0, name="H200", memory_used_bytes=used, memory_total_bytes=141 * 2**30)
        history.add_memory_sample(types.SimpleNamespace(time_s=t, gpus=[gpu]))
    _feed(history, 2)
    written = history.export_csv(tmp_path / "run.csv")
    assert [p.name for p in written] == ["run.csv", "run-gpu-memory.csv"]
    with written[1].open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["memory_used_gib"] for r in rows] == ["2", ""] and rows[0]["name"] == "H200"


def test_a_file_that_is_not_an_export_is_a_clear_error(tmp_path):
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a SpecDeck run export"):
        load_overlay(bad)
    words = tmp_path / "words.csv"
    words.write_text("time_s," + ",".join(OVERLAY_SERIES) + "\n0,one,2,3\n")
    with pytest.raises(ValueError, match="not a number"):
        load_overlay(words)
    with pytest.raises(ValueError, match="cannot be read"):
        load_overlay(tmp_path / "missing.csv")
