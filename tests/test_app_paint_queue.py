"""The paint queue: plot views painted a piece per turn of the event loop, and while a run streams
only while the engine waits between two rounds (app/gui/paint_queue.py)."""
# Fixtures are imported from conftest_app and then named as test arguments:
# ruff: noqa: F811

from __future__ import annotations

import time

from conftest_app import (  # noqa: F401 (fixtures)
    RUN_TIMEOUT_MS,
    app_config,
    make_window,
    one_torch_thread,
    window,
)
from PySide6.QtCore import QRect, QTimer
from PySide6.QtWidgets import QWidget

from app.gui.paint_queue import PaintQueue, paint_queue
from app.gui.worker import FrameGate


class Canvas(QWidget):
    """Records each paint: its rectangle and the event-loop turn it came in."""

    def __init__(self, turns: list[int]) -> None:
        super().__init__()
        self.turns = turns
        self.paints: list[tuple[tuple[int, int, int, int], int]] = []
        self.resize(300, 100)

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self.paints.append((event.rect().getRect(), self.turns[0]))


def _turn_counter(qtbot) -> tuple[list[int], QTimer]:
    """A zero-interval timer that counts turns of the event loop."""
    turns = [0]
    timer = QTimer()
    timer.setInterval(0)
    timer.timeout.connect(lambda: turns.__setitem__(0, turns[0] + 1))
    timer.start()
    return turns, timer


def _shown_canvas(qtbot) -> tuple[Canvas, QTimer]:
    """A canvas on screen, past its first paints, with no paints recorded yet."""
    turns, timer = _turn_counter(qtbot)
    canvas = Canvas(turns)
    qtbot.addWidget(canvas)
    canvas.show()
    qtbot.waitExposed(canvas)
    qtbot.wait(50)
    canvas.paints.clear()
    return canvas, timer


def _thirds() -> list[QRect]:
    return [QRect(0, 0, 100, 100), QRect(100, 0, 100, 100), QRect(200, 0, 100, 100)]


def test_pieces_are_painted_in_order_one_per_turn_with_the_windows_timers_between(qtbot):
    canvas, timer = _shown_canvas(qtbot)
    queue = PaintQueue()
    done: list[int] = []
    queue.add(canvas, _thirds(), done=lambda: done.append(len(canvas.paints)))
    assert canvas.paints == [] and queue.pending == 3  # nothing is painted inside add()
    qtbot.waitUntil(lambda: bool(done), timeout=2000)
    timer.stop()
    assert [rect for rect, _ in canvas.paints] == [r.getRect() for r in _thirds()]
    painted_turns = [turn for _, turn in canvas.paints]
    assert len(set(painted_turns)) == 3  # a timer ran between every two pieces
    assert done == [3] and queue.pending == 0  # done came after the last piece


def test_a_piece_already_queued_is_queued_once(qtbot):
    canvas, timer = _shown_canvas(qtbot)
    queue = PaintQueue()
    queue.add(canvas, _thirds()[:2])
    queue.add(canvas, _thirds())  # the first two again, and a third
    assert queue.pending == 3
    queue.flush()
    timer.stop()
    assert [rect for rect, _ in canvas.paints] == [r.getRect() for r in _thirds()]


def test_a_closed_windows_pieces_and_callbacks_are_dropped(qtbot):
    # A window closed while its frame waits on the (application-wide) queue: the next window's
    # queue turns must not call into the deleted one.
    from shiboken6 import delete

    canvas, timer = _shown_canvas(qtbot)
    queue = PaintQueue()
    called: list[str] = []
    queue.add(canvas, _thirds(), done=lambda: called.append("frame"))
    queue.run_granted(done=lambda: called.append("granted"), owner=canvas)
    delete(canvas)
    queue.flush()
    timer.stop()
    assert called == [] and queue.pending == 0


def test_while_a_run_streams_pieces_wait_for_the_engine_to_stop_between_rounds(qtbot):
    canvas, timer = _shown_canvas(qtbot)
    gate = FrameGate()
    gate.set_running(True)
    queue = PaintQueue()
    queue.gate = gate
    queue.add(canvas, _thirds())
    qtbot.wait(int(PaintQueue.GRANT_WAIT_S * 1000 / 3))
    assert canvas.paints == [] and gate.requested  # it asked the engine, and waits
    released = []
    # The engine thread grants (the window's frame_granted handler calls run_granted) and waits.
    queue.run_granted(done=lambda: (released.append(len(canvas.paints)), gate.release()))
    qtbot.waitUntil(lambda: bool(released), timeout=2000)
    timer.stop()
    assert released == [3]  # the engine was released once every piece was painted
    assert not gate.requested


def test_a_grant_that_does_not_come_is_not_waited_for(qtbot):
    canvas, timer = _shown_canvas(qtbot)
    gate = FrameGate()
    gate.set_running(True)  # a run whose round never ends (a long first round)
    queue = PaintQueue()
    queue.gate = gate
    started = time.monotonic()
    queue.add(canvas, _thirds())
    qtbot.wait(int(PaintQueue.GRANT_WAIT_S * 1000 / 2))
    assert canvas.paints == []  # still waiting for the grant
    qtbot.waitUntil(lambda: len(canvas.paints) == 3, timeout=2000)
    timer.stop()
    # Painted anyway, after about GRANT_WAIT_S (a Qt timer may fire a few percent early).
    assert time.monotonic() - started >= 0.9 * PaintQueue.GRANT_WAIT_S


def test_the_live_plots_paint_only_through_the_queue_one_plot_per_piece(qtbot, window):
    plots = window.plots
    window.tabs.setCurrentIndex(0)
    qtbot.waitUntil(lambda: paint_queue().pending == 0, timeout=RUN_TIMEOUT_MS)
    qtbot.wait(100)
    painted_before = plots.graphics.painted_s
    plots.clear()  # every plot changes
    plots.update_frame()
    # Queued, one piece per plot, and nothing painted yet.
    assert paint_queue().pending == len(plots.graphics.pieces) == 6
    assert plots.graphics.painted_s == painted_before
    qtbot.waitUntil(lambda: paint_queue().pending == 0, timeout=RUN_TIMEOUT_MS)
    assert plots.graphics.painted_s > painted_before
    # A picture of the view (export, screenshot) is painted whole, at once.
    with paint_queue().direct():
        image = plots.graphics.grab().toImage()
    assert image.width() > 100 and len({image.pixel(x, image.height() // 2) for x in range(0, image.width(), 7)}) > 2
