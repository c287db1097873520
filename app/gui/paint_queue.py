"""Plot views painted a piece per turn of the event loop, between the engine's rounds.

On a slow machine a repaint of the Live plots, or a tab of plots appearing, is tens of
milliseconds: pyqtgraph re-renders an axis (ticks, text, grid) whenever its range changed, a few
milliseconds each, and a view of six plots changes them together. Painted in one go, the window
answers no input, timer or engine signal meanwhile; painted while the engine thread runs, each of
the paint's many calls into Python also waits for the GIL behind it, and takes several times as
long. So a view's paint is cut into pieces (one plot each, or the whole of a small view) that
paint_queue() paints one per turn of the event loop, everything else running between them, and
while a run streams, only while the engine waits between two rounds (worker.FrameGate).

The views (StagedView, mixed into a pyqtgraph GraphicsView):
- While a view is held (hold_updates), changes in its scene post no paint of their own, and a
  paint that Qt asks for (a show, a layout, a changed region) is turned into queued pieces: the
  view keeps its picture meanwhile (WA_OpaquePaintEvent), and the margins between the pieces,
  which hold nothing, are filled at once. The Live plots are held always (queued_always).
- A view that appears (a tab switch, the window's first show) paints its background only and
  queues its pieces, held until the last one is painted.

Pictures of a view (QWidget.grab) are taken inside paint_queue().direct(), after flush().
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from PySide6.QtCore import QObject, QRect, QRectF, Qt, QTimer
from PySide6.QtGui import QPainter, QPaintEvent, QRegion
from PySide6.QtWidgets import QGraphicsView, QWidget
from shiboken6 import isValid

Piece = tuple[QWidget, QRect]


class PaintQueue(QObject):
    """Paints queued (widget, rect) pieces, one per turn of the event loop, in order.

    While a run streams (gate.running), pieces wait for the engine to stop between two rounds:
    the queue asks the gate, the window's grant handler calls run_granted(), the pieces are
    painted, and its done callback releases the engine. A grant that does not come within
    GRANT_WAIT_S (a long first round) is not waited for.
    """

    GRANT_WAIT_S = 0.15

    def __init__(self) -> None:
        super().__init__()
        # Pieces (widget, rect, None), and done callbacks (owner, None, done) that run once everything
        # queued before them is painted, unless their owner is gone by then (a closed window).
        self._pieces: deque[tuple[QObject, QRect | None, Callable[[], None] | None]] = deque()
        self._queued: set[tuple[int, tuple[int, int, int, int]]] = set()  # pieces queued, by widget and rect
        self.painting: Piece | None = None  # the piece being painted now
        self.direct_paints = 0  # > 0: every paint goes straight through (direct())
        self.gate: Any = None  # worker.FrameGate of the window, set by it
        self._granted = False  # the engine waits: paint now, then run _when_done
        self._when_done: list[tuple[QObject | None, Callable[[], None]]] = []
        self._waited_long = False
        # A zero-interval timer, not a queued call: Qt runs queued calls before timers that are
        # already due, so a chain of queued calls would keep the window's own timers waiting.
        self._timer = self._single_shot(0, self._on_turn)
        self._grant_timer = self._single_shot(int(self.GRANT_WAIT_S * 1000), self._on_grant_late)

    def _single_shot(self, interval_ms: int, slot: Callable[[], None]) -> QTimer:
        timer = QTimer(self)
        timer.setSingleShot(True)
        timer.setInterval(interval_ms)
        timer.timeout.connect(slot)
        return timer

    @property
    def pending(self) -> int:
        """Pieces queued and not painted yet."""
        return len(self._queued)

    def add(self, widget: QWidget, rects: list[QRect], done: Callable[[], None] | None = None) -> None:
        """Queue widget's rects (widget coordinates) that are not queued already; done runs once
        they, and everything queued before, are painted (or dropped: the widget gone or hidden); not
        at all if the widget is gone by then."""
        for rect in rects:
            key = (id(widget), rect.getRect())
            if rect.isEmpty() or key in self._queued:
                continue
            self._queued.add(key)
            self._pieces.append((widget, rect, None))
        if done is not None:
            self._pieces.append((widget, None, done))
        self._schedule()

    def run_granted(
        self, done: Callable[[], None], work: Callable[[], None] | None = None, owner: QObject | None = None
    ) -> None:
        """The engine waits between two rounds: run work (which may queue pieces), paint every
        queued piece, one per turn, then call done (which releases the engine), unless owner is
        gone by then."""
        self._granted = True
        self._grant_timer.stop()
        self._when_done.append((owner, done))
        try:
            if work is not None:
                work()
        finally:
            self._schedule()

    def flush(self) -> None:
        """Paint everything queued now."""
        while self._pieces:
            self._paint_one()
        self._finish()

    @contextlib.contextmanager
    def direct(self) -> Iterator[None]:
        """Paints inside go straight through, not through the queue: a picture taken of a view
        (QWidget.grab) must show all of it. Queued pieces are painted first."""
        self.flush()
        self.direct_paints += 1
        try:
            yield
        finally:
            self.direct_paints -= 1

    def _schedule(self) -> None:
        if not self._pieces:
            self._finish()
            return
        if self._timer.isActive():
            return
        gate = self.gate
        if gate is not None and gate.running and not self._granted and not self._waited_long:
            if not gate.requested:
                gate.request()  # the window's grant handler calls run_granted()
            if not self._grant_timer.isActive():
                self._grant_timer.start()
            return
        self._timer.start()

    def _on_grant_late(self) -> None:
        self._waited_long = True
        self._schedule()

    def _on_turn(self) -> None:
        if self._pieces:
            self._paint_one()
        self._schedule()

    def _finish(self) -> None:
        self._grant_timer.stop()
        self._granted = False
        self._waited_long = False
        callbacks, self._when_done = self._when_done, []
        for owner, callback in callbacks:
            if owner is None or isValid(owner):
                callback()

    def _run_due_callbacks(self) -> None:
        # Done callbacks at the head of the queue run in the same turn: they are not paints.
        while self._pieces and self._pieces[0][1] is None:
            owner, _, done = self._pieces.popleft()
            if isValid(owner):
                done()  # type: ignore[misc]

    def _paint_one(self) -> None:
        self._run_due_callbacks()
        if not self._pieces:
            return
        widget, rect = self._pieces.popleft()[:2]
        self._queued.discard((id(widget), rect.getRect()))  # type: ignore[union-attr]
        if isValid(widget) and widget.isVisible():
            self.painting = (widget, rect)  # type: ignore[assignment]
            try:
                widget.repaint(rect)  # type: ignore[union-attr,arg-type]
            finally:
                self.painting = None
        self._run_due_callbacks()


_queue: PaintQueue | None = None


def paint_queue() -> PaintQueue:
    """The application's one queue (made on first use, once a QApplication exists)."""
    global _queue
    if _queue is None or not isValid(_queue):
        _queue = PaintQueue()
    return _queue


class StagedView:
    """Mixin for a pyqtgraph GraphicsView (before it in the bases): its paints go through
    paint_queue() in pieces (see the module's docstring)."""

    queued_always = False  # held from the start: every paint goes through the queue
    _holds = 0
    _held_mode: Any = None
    _appearing = False  # shown, and not painted since

    def staged_init(self) -> None:
        """Call at the end of __init__."""
        if self.queued_always:
            self.hold_updates()
        self.scene().changed.connect(self._on_scene_changed)  # type: ignore[attr-defined]

    def piece_rects(self) -> list[QRect]:
        """The pieces, in viewport coordinates: the whole view unless overridden."""
        return [self.viewport().rect()]  # type: ignore[attr-defined]

    def hold_updates(self) -> None:
        if self._holds == 0:
            self._held_mode = self.viewportUpdateMode()  # type: ignore[attr-defined]
            self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.NoViewportUpdate)  # type: ignore[attr-defined]
            # What a piece's paint leaves out keeps the picture it had (Qt would clear it to the
            # background): the pieces painted before it, and the ones still to come.
            self.viewport().setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent, True)  # type: ignore[attr-defined]
        self._holds += 1

    def release_updates(self) -> None:
        if self._holds == 0 or not isValid(self):
            return
        self._holds -= 1
        if self._holds == 0:
            self.setViewportUpdateMode(self._held_mode)  # type: ignore[attr-defined]
            self.viewport().setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent, False)  # type: ignore[attr-defined]

    def queue_region(self, region: QRegion, done: Callable[[], None] | None = None) -> None:
        """Queue the pieces that region (viewport coordinates) touches."""
        rects = [rect for rect in self.piece_rects() if region.intersects(rect)]
        paint_queue().add(self.viewport(), rects, done)  # type: ignore[attr-defined]

    def _on_scene_changed(self, rects: list[QRectF]) -> None:
        if not self._holds:
            return  # the view paints it as usual
        region = QRegion()
        for rect in rects:
            region += self.mapFromScene(rect).boundingRect()  # type: ignore[attr-defined]
        if not region.isEmpty():
            self.queue_region(region)

    def showEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)  # type: ignore[misc]
        self._appearing = True

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)  # type: ignore[misc]
        if self._holds:  # queued pieces' rectangles may be out of date: queue it all again
            self.queue_region(QRegion(self.viewport().rect()))  # type: ignore[attr-defined]

    def paintEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        queue = paint_queue()
        viewport = self.viewport()  # type: ignore[attr-defined]
        painting = queue.painting
        if queue.direct_paints:
            pass  # a picture being taken: paint it all now
        elif painting is not None and painting[0] is viewport:
            # A piece's repaint paints every update pending in the window, this view's whole area
            # among them when Qt asked for that: only the piece is painted now.
            event = QPaintEvent(event.region().intersected(painting[1]))
        elif self._holds or self._appearing:
            # Qt asks for a paint: queue it in pieces. Meanwhile the view keeps its picture, but
            # one that appears has none (the area showed another tab): its background, then.
            appearing, self._appearing = self._appearing, False
            if not self._holds:
                self.hold_updates()
                self.queue_region(event.region(), self.release_updates)
            else:
                self.queue_region(event.region())
            fill = event.region() if appearing else event.region().subtracted(_union(self.piece_rects()))
            if not fill.isEmpty():
                painter = QPainter(viewport)
                painter.setClipRegion(fill)
                painter.fillRect(fill.boundingRect(), self.backgroundBrush())  # type: ignore[attr-defined]
                painter.end()
            return
        self._appearing = False
        super().paintEvent(event)  # type: ignore[misc]


def _union(rects: list[QRect]) -> QRegion:
    region = QRegion()
    for rect in rects:
        region += rect
    return region
