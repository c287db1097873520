"""The Bench tab: two profiles, the tables (llama.cpp PR #27173 format), hashes per arm, export; the same code as the CLI."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import csv
import io
import json

from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    app_config,
    make_window,
    one_torch_thread,
    window,
)
from PySide6.QtCore import Qt

from app.profiles import Profile
from engine.settings import EngineSettings


def test_a_bench_of_two_profiles_produces_the_seeds_tables(qtbot, window, tmp_path, monkeypatch):
    window.store.save(Profile(name="shallow", settings=EngineSettings(draft_depth=2, chain=True)))
    window.profiles_tab.reload()
    tab = window.bench_tab
    window.tabs.setCurrentWidget(tab)
    tab.select_profiles("control", "shallow")
    for name, box in tab.workload_boxes.items():
        box.setChecked(name in ("code_gen", "prose"))
    tab.rounds.setValue(2)
    tab.max_new_tokens.setValue(8)
    progress = []
    window.worker.bench_progress.connect(lambda done, total, message: progress.append((done, total)))
    # Waited for on the GUI thread: bench_finished is emitted on the worker thread, and a
    # pytest-qt blocker on it (a direct connection) can miss its quit and wait forever.
    qtbot.mouseClick(tab.run_button, Qt.MouseButton.LeftButton)
    assert window.state == "bench"
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)

    report = tab.report
    assert [arm.name for arm in report.arms] == ["control", "shallow"]
    assert progress[-1] == (8, 8) and tab.progress.value() == tab.progress.maximum() == 8
    tables = tab.tables_view.toPlainText()
    assert tables == report.format_tables()  # the CLI's own tables, unchanged
    assert "Round results" in tables and "mixed avg" in tables and "Change" in tables
    # Greedy speculation never changes the text: one hash per workload, shared by both arms.
    assert report.arms_agree and "identical" in tab.warning_label.text()
    assert tab.hash_table.rowCount() == 2
    for row in range(2):
        assert tab.hash_table.item(row, 1).text() == tab.hash_table.item(row, 2).text() != "–"
    # The user profile took the figures; the shipped one is read-only and did not.
    figures = window.store.get("shallow").bench
    assert figures["source"] == "bench" and figures["compared_with"] == "control"
    assert set(figures["per_workload"]) == {"code_gen", "prose"}
    assert window.store.get("control").bench == {}

    monkeypatch.setattr(tab, "ask_save_path", lambda kind: str(tmp_path / f"bench.{kind}"))
    tab.export_csv_button.click()
    tab.export_json_button.click()
    rows = list(csv.DictReader(io.StringIO((tmp_path / "bench.csv").read_text())))
    assert len(rows) == 8 and {r["arm"] for r in rows} == {"control", "shallow"}
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["version"] == 1 and data["arms_agree"] is True


def test_differing_arm_texts_raise_a_warning(qtbot, window):
    tab = window.bench_tab

    class FakeReport:  # the bench tab only reads the report's public surface
        arms = [type("Arm", (), {"name": "A"})(), type("Arm", (), {"name": "B"})()]
        workloads = ["prose"]
        rounds, max_new_tokens, rows = 1, 8, [1, 2]
        arms_agree = synthetic = False

        def hashes(self, arm, workload):
            return {"aaaa"} if arm == "A" else {"bbbb"}

        def format_tables(self):
            return "tables"

    tab.on_finished(FakeReport())
    assert "differ" in tab.warning_label.text() and "prose" in tab.warning_label.text()
    assert tab.hash_table.item(0, 1).text() == "aaaa" and tab.hash_table.item(0, 2).text() == "bbbb"


def test_a_bench_can_be_stopped(qtbot, window):
    tab = window.bench_tab
    tab.select_profiles("control", "chain")
    tab.rounds.setValue(20)
    tab.max_new_tokens.setValue(16)
    tab.run_button.click()
    qtbot.waitUntil(lambda: tab.progress.value() >= 1, timeout=RUN_TIMEOUT_MS)
    tab.stop_button.click()
    # Waited for on the GUI thread (see above): Stop ends the bench within one run.
    qtbot.waitUntil(lambda: window.state == "idle", timeout=RUN_TIMEOUT_MS)
    assert tab.run_button.isEnabled()
    assert 0 < len(tab.report.rows) < 20 * 4 * 2
    assert "Stopped early" in tab.progress_label.text()
