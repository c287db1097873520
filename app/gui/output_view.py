"""The streamed output: accepted draft tokens highlighted apart from tokens only the target made.

Text arrives as RoundUpdates; each carries `segments`, the round's text split into
(text, from_draft) runs (worker.split_round_text). Appends are buffered and flushed by a timer,
so a burst of fast rounds costs one document edit, not one per round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QVBoxLayout, QWidget

DRAFT_BACKGROUND = QColor("#c8f0c8")  # accepted draft tokens (with dark text, in either theme)
DRAFT_TEXT = QColor("#102010")
MAX_CHARACTERS = 400_000  # keep the document bounded on endless repeat runs


class OutputView(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._pending: list[tuple[str, bool]] = []
        self.draft_tokens = 0
        self.target_tokens = 0

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        legend = QHBoxLayout()
        title = QLabel("<b>Output</b>")
        draft_swatch = QLabel(" accepted draft token ")
        draft_swatch.setStyleSheet(
            f"background:{DRAFT_BACKGROUND.name()}; color:{DRAFT_TEXT.name()}; border:1px solid #8c8;"
        )
        target_swatch = QLabel(" target token ")
        target_swatch.setStyleSheet("border:1px solid #bbb;")  # the text's own background
        self.counts_label = QLabel("")
        legend.addWidget(title)
        legend.addWidget(draft_swatch)
        legend.addWidget(target_swatch)
        legend.addStretch(1)
        legend.addWidget(self.counts_label)
        layout.addLayout(legend)

        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setUndoRedoEnabled(False)
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        font = QFont("monospace")
        font.setStyleHint(QFont.StyleHint.Monospace)
        self.text.setFont(font)
        layout.addWidget(self.text, 1)

        self._draft_format = QTextCharFormat()
        self._draft_format.setBackground(DRAFT_BACKGROUND)
        self._draft_format.setForeground(DRAFT_TEXT)
        self._target_format = QTextCharFormat()  # the palette's own text on its own background

        # 4 text updates a second read as streaming; each one costs the GUI thread a layout and a
        # paint, time the engine thread then waits for the GIL (measured: 10 a second cost the run
        # 3-4% of its tokens/s on a 2-core CPU, 4 a second under 1%; bench/app_vs_headless.py).
        self._timer = QTimer(self)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self._on_timer)
        self._timer.start()
        # While a run streams, the window flushes the text in the plots' frames, drawn while
        # the engine waits between two rounds (worker.FrameGate), not on this timer.
        self.frame_gate: Any = None

    def begin_run(self, heading: str) -> None:
        """Start a run's text on a fresh paragraph with a one-line heading."""
        self.flush()
        if self.text.document().characterCount() > 1:
            self._append("\n\n", False)
        heading_format = QTextCharFormat()
        heading_format.setForeground(QColor("#777"))
        heading_format.setFontItalic(True)
        cursor = self._end_cursor()
        cursor.insertText(f"── {heading} ──\n", heading_format)

    def add_rounds(self, updates: Iterable[Any]) -> None:
        for update in updates:
            self._pending.extend(update.segments)
            flags = update.event.from_draft
            drafted = sum(1 for f in flags if f)
            self.draft_tokens += drafted
            self.target_tokens += len(flags) - drafted

    def _on_timer(self) -> None:
        if self.frame_gate is None or not self.frame_gate.running or not self.isVisible():
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        scrollbar = self.text.verticalScrollBar()
        follow = scrollbar.value() >= scrollbar.maximum() - 4  # keep following unless scrolled up
        cursor = self._end_cursor()
        cursor.beginEditBlock()
        # Merge neighbouring runs of the same kind: fewer format switches, same picture.
        merged: list[tuple[str, bool]] = []
        for text, from_draft in pending:
            if merged and merged[-1][1] == from_draft:
                merged[-1] = (merged[-1][0] + text, from_draft)
            else:
                merged.append((text, from_draft))
        for text, from_draft in merged:
            cursor.insertText(text, self._draft_format if from_draft else self._target_format)
        cursor.endEditBlock()
        self._trim()
        total = self.draft_tokens + self.target_tokens
        if total:
            self.counts_label.setText(
                f"{total} tokens · {self.draft_tokens} from accepted drafts ({self.draft_tokens / total:.0%})"
            )
        if follow:
            scrollbar.setValue(scrollbar.maximum())

    def paint_now(self) -> None:
        """Paint the text as it is now (a frame between two rounds), not at Qt's next turn."""
        if self.isVisible():
            self.text.viewport().repaint()

    def clear(self) -> None:
        self._pending.clear()
        self.text.clear()
        self.draft_tokens = 0
        self.target_tokens = 0
        self.counts_label.setText("")

    def plain_text(self) -> str:
        self.flush()
        return self.text.toPlainText()

    def draft_highlighted_text(self) -> str:
        """The characters shown with the draft highlight (for tests and copy-out)."""
        self.flush()
        out = []
        block = self.text.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                if fragment.charFormat().background().color() == DRAFT_BACKGROUND:
                    out.append(fragment.text())
                it += 1
            block = block.next()
        return "".join(out)

    def _append(self, text: str, from_draft: bool) -> None:
        self._end_cursor().insertText(text, self._draft_format if from_draft else self._target_format)

    def _end_cursor(self) -> QTextCursor:
        cursor = self.text.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _trim(self) -> None:
        document = self.text.document()
        excess = document.characterCount() - MAX_CHARACTERS
        if excess > 0:
            cursor = QTextCursor(document)
            cursor.movePosition(QTextCursor.MoveOperation.Start)
            cursor.movePosition(QTextCursor.MoveOperation.Right, QTextCursor.MoveMode.KeepAnchor, excess)
            cursor.removeSelectedText()


__all__ = ["OutputView", "DRAFT_BACKGROUND"]
