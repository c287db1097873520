"""The knob panel is made from EngineSettings' knob metadata (engine.settings.knobs()): every knob has a
control named by its label, with its help as the tooltip, and turning that control changes that field, and
only that field, of the settings the panel emits. So a knob added to EngineSettings gets its control."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QCheckBox, QDoubleSpinBox, QFormLayout, QSpinBox

import app.gui  # noqa: F401 (the PySide6 guard)
from app.gui.controls import CONTROL_LOOKS, KnobPanel
from engine.settings import EngineSettings, knobs


@pytest.fixture
def panel(qtbot):
    panel = KnobPanel()
    qtbot.addWidget(panel)
    panel.set_context("cuda", 2, 1000)  # two GPUs and a known vocabulary: every knob can act
    panel.show()
    qtbot.waitExposed(panel)
    return panel


def _row_label(form: QFormLayout, widget) -> str | None:
    """The form's label of the row holding `widget` (directly or in the row's layout)."""
    for row in range(form.rowCount()):
        field = form.itemAt(row, QFormLayout.ItemRole.FieldRole)
        label = form.itemAt(row, QFormLayout.ItemRole.LabelRole)
        if field is None or label is None:
            continue
        layout = field.layout()
        inside = [layout.itemAt(i).widget() for i in range(layout.count())] if layout is not None else []
        if field.widget() is widget or widget in inside:
            return label.widget().text()
    return None


def test_every_knob_has_a_control_with_its_label_and_help(panel):
    form = panel.layout()
    assert set(panel.widgets) == {k.name for k in knobs()}
    for knob in knobs():
        widget = panel.widgets[knob.name]
        assert getattr(panel, knob.name) is widget
        assert widget.accessibleName() == knob.label
        assert knob.help in widget.toolTip(), knob.name
        if knob.type is bool:
            assert isinstance(widget, QCheckBox) and widget.text() == knob.label
            continue
        assert isinstance(widget, QSpinBox if knob.type is int else QDoubleSpinBox), knob.name
        lo, hi = knob.range
        assert widget.minimum() == lo and (hi is None or widget.maximum() == hi), knob.name
        host = CONTROL_LOOKS.get(knob.name, {}).get("beside")
        assert _row_label(form, widget) == (knob.label if host is None else panel.knobs[host].label), knob.name
    # draft_depth keeps its Auto option, on its row
    assert panel.depth_auto.text() == "Auto" and _row_label(form, panel.depth_auto) == panel.knobs["draft_depth"].label


def _another_value(widget):
    """A different value the control accepts."""
    if widget.value() + widget.singleStep() <= widget.maximum():
        return widget.value() + widget.singleStep()
    return widget.minimum() if widget.value() != widget.minimum() else widget.maximum()


def test_turning_each_control_changes_its_field_of_the_emitted_settings(qtbot, panel):
    emitted: list[EngineSettings] = []
    panel.settings_changed.connect(emitted.append)
    for knob in knobs():
        widget = panel.widgets[knob.name]
        before = panel.settings()
        if knob.type is bool:
            assert widget.isEnabled(), knob.name
            widget.click()  # as a user's click: a disabled box would not change
            expected = not getattr(before, knob.name)
        else:
            expected = _another_value(widget)
            widget.setValue(expected)
        assert emitted, knob.name
        assert getattr(emitted[-1], knob.name) == pytest.approx(expected), knob.name
        assert emitted[-1].replace(**{knob.name: getattr(before, knob.name)}) == before  # only that field
        panel.set_settings(before)
        emitted.clear()


def test_auto_depth_is_draft_depth_auto(qtbot, panel):
    emitted: list[EngineSettings] = []
    panel.settings_changed.connect(emitted.append)
    panel.depth_auto.click()
    assert emitted[-1].draft_depth == "auto" and panel.max_draft_depth.isEnabled()
    panel.max_draft_depth.setValue(5)
    assert emitted[-1] == EngineSettings(draft_depth="auto", max_draft_depth=5)
    panel.depth_auto.click()
    assert emitted[-1].draft_depth == 3  # the fixed depth it had before Auto
