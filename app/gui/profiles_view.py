"""The Profiles tab: named settings with notes, hardware fingerprint and last bench figures.

The files themselves are handled by app.profiles (no Qt there, the CLI uses it too); this tab
only lists them and asks the user for names and paths. Bad files are listed by file name and
field under the list, and skipped.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.profiles import Profile, ProfileError, ProfileStore, hardware_fingerprint
from engine.settings import EngineSettings


class NewProfileDialog(QDialog):
    def __init__(self, parent: QWidget | None, default_name: str):
        super().__init__(parent)
        self.setWindowTitle("Save current settings as a profile")
        self.name_edit = QLineEdit(default_name)
        self.notes_edit = QPlainTextEdit()
        self.notes_edit.setPlaceholderText("What is this for? What did you find?")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form = QFormLayout(self)
        form.addRow("Name", self.name_edit)
        form.addRow("Notes", self.notes_edit)
        form.addRow(buttons)


class ProfilesTab(QWidget):
    apply_requested = Signal(object)  # Profile
    profiles_changed = Signal()  # the list changed (the bench tab's pickers follow)
    message = Signal(str)  # a line for the status bar

    def __init__(
        self,
        store: ProfileStore,
        current_settings: Callable[[], EngineSettings],
        current_figures: Callable[[], dict[str, Any]],
        gpu_names: Callable[[], list[str]],
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.store = store
        self._current_settings = current_settings
        self._current_figures = current_figures
        self._gpu_names = gpu_names
        self.current_sampling: Callable[[], Any] = lambda: None  # the window's SamplingPanel.sampling
        self.profiles: list[Profile] = []
        self.problems: list[Any] = []

        self.list_widget = QListWidget()
        self.list_widget.currentRowChanged.connect(self._show_selected)
        self.list_widget.itemDoubleClicked.connect(lambda _: self.apply_selected())
        self.problems_label = QLabel("")
        self.problems_label.setWordWrap(True)
        self.problems_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.problems_label.setStyleSheet("background:#f8d7da; color:#842029; padding:6px;")
        self.problems_label.hide()
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        heading = QLabel(f"<b>Profiles</b> <small>({store.directory})</small>")
        heading.setToolTip(str(store.directory))
        # A long folder path is cut, not allowed to widen the window past the screen.
        heading.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        left_layout.addWidget(heading)
        left_layout.addWidget(self.list_widget, 1)
        left_layout.addWidget(self.problems_label)

        self.title_label = QLabel("")
        self.title_label.setStyleSheet("font-size:14pt; font-weight:bold;")
        self.notes_edit = QPlainTextEdit()
        self.notes_edit.setMaximumHeight(90)
        self.save_notes_button = QPushButton("Save notes")
        self.save_notes_button.clicked.connect(self.save_notes)
        self.details_label = QLabel("")
        self.details_label.setWordWrap(True)
        self.details_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details_label.setAlignment(Qt.AlignmentFlag.AlignTop)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.details_label.setFont(mono)

        self.save_button = QPushButton("Save current settings as…")
        self.apply_button = QPushButton("Apply")
        self.rename_button = QPushButton("Rename…")
        self.duplicate_button = QPushButton("Duplicate")
        self.delete_button = QPushButton("Delete")
        self.import_button = QPushButton("Import…")
        self.export_button = QPushButton("Export…")
        self.save_button.clicked.connect(self.save_current)
        self.apply_button.clicked.connect(self.apply_selected)
        self.rename_button.clicked.connect(self.rename_selected)
        self.duplicate_button.clicked.connect(self.duplicate_selected)
        self.delete_button.clicked.connect(self.delete_selected)
        self.import_button.clicked.connect(self.import_profile)
        self.export_button.clicked.connect(self.export_selected)
        buttons = QGridLayout()
        for i, button in enumerate(
            [
                self.save_button,
                self.apply_button,
                self.rename_button,
                self.duplicate_button,
                self.delete_button,
                self.import_button,
                self.export_button,
            ]
        ):
            buttons.addWidget(button, i // 4, i % 4)

        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.addLayout(buttons)
        right_layout.addWidget(self.title_label)
        notes_row = QHBoxLayout()
        notes_row.addWidget(self.notes_edit, 1)
        notes_row.addWidget(self.save_notes_button, 0, Qt.AlignmentFlag.AlignBottom)
        right_layout.addLayout(notes_row)
        right_layout.addWidget(self.details_label, 1)

        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)
        self.reload()

    # ------------------------------------------------------------------ list

    def reload(self, select: str | None = None) -> None:
        previous = select or (self.selected().name if self.selected() else None)
        self.profiles, self.problems = self.store.list()
        self.list_widget.blockSignals(True)
        self.list_widget.clear()
        for profile in self.profiles:
            item = QListWidgetItem(profile.name + ("  (shipped)" if profile.shipped else ""))
            if profile.shipped:
                font = item.font()
                font.setItalic(True)
                item.setFont(font)
                item.setToolTip("Shipped with SpecDeck (read-only): duplicate it to change it")
            self.list_widget.addItem(item)
        self.list_widget.blockSignals(False)
        row = next((i for i, p in enumerate(self.profiles) if p.name == previous), 0)
        self.list_widget.setCurrentRow(row if self.profiles else -1)
        self._show_selected()
        if self.problems:
            lines = "<br>".join(f"• <b>{p.path.name}</b>: {html.escape(p.message, quote=False)}" for p in self.problems)
            self.problems_label.setText(f"Skipped {len(self.problems)} bad profile file(s):<br>{lines}")
            self.problems_label.show()
        else:
            self.problems_label.hide()
        self.profiles_changed.emit()

    def selected(self) -> Profile | None:
        row = self.list_widget.currentRow()
        return self.profiles[row] if 0 <= row < len(self.profiles) else None

    def select(self, name: str) -> None:
        for i, profile in enumerate(self.profiles):
            if profile.name == name:
                self.list_widget.setCurrentRow(i)
                return

    def _show_selected(self, *_: Any) -> None:
        profile = self.selected()
        editable = profile is not None and not profile.shipped
        for button in (self.rename_button, self.delete_button, self.save_notes_button):
            button.setEnabled(editable)
        for button in (self.apply_button, self.duplicate_button, self.export_button):
            button.setEnabled(profile is not None)
        self.notes_edit.setReadOnly(not editable)
        if profile is None:
            self.title_label.setText("No profile")
            self.notes_edit.setPlainText("")
            self.details_label.setText("Save the current settings to make one.")
            return
        bench_only = "  (bench profile: synthetic acceptance)" if profile.settings.synthetic else ""
        self.title_label.setText(profile.name + ("  (shipped, read-only)" if profile.shipped else "") + bench_only)
        self.notes_edit.setPlainText(profile.notes)
        lines = ["settings:"]
        for name, value in profile.settings.to_dict().items():
            if name == "synthetic_rates" and not value:
                continue  # off: not listed (it is no knob)
            if name == "sub_vocab" and profile.sub_vocab_fraction is not None:
                value = f"{profile.sub_vocab_fraction:.2%} of the model's vocabulary"
            lines.append(f"  {name:<14} {value}")
        if profile.hardware:
            lines.append("hardware:")
            lines += [f"  {k:<14} {v}" for k, v in profile.hardware.items()]
        if profile.bench:
            lines.append("last bench figures:")
            lines += [f"  {k:<14} {_fmt(v)}" for k, v in profile.bench.items()]
        lines.append(f"file: {profile.path}")
        self.details_label.setText("\n".join(lines))

    # ------------------------------------------------------------------ operations

    def save_current(self) -> Profile | None:
        answer = self.ask_new_profile(self.store.unique_name("my profile"))
        if answer is None:
            return None
        name, notes = answer
        existing = self.store.find(name)
        if existing is not None and not existing.shipped and not self.confirm(f"Replace the profile {name!r}?"):
            return None
        profile = Profile(
            name=name,
            settings=self._current_settings(),
            sampling=self.current_sampling(),
            notes=notes,
            hardware=hardware_fingerprint(self._gpu_names()),
            bench=self._current_figures(),
        )
        return self._do(lambda: self.store.save(profile), f"Saved profile {name!r}")

    def apply_selected(self) -> None:
        profile = self.selected()
        if profile is not None:
            self.apply_requested.emit(profile)
            self.message.emit(f"Applied profile {profile.name!r}")

    def rename_selected(self) -> Profile | None:
        profile = self.selected()
        if profile is None:
            return None
        new_name = self.ask_text("Rename profile", "New name:", profile.name)
        if not new_name or new_name == profile.name:
            return None
        return self._do(lambda: self.store.rename(profile.name, new_name), f"Renamed {profile.name!r} to {new_name!r}")

    def duplicate_selected(self) -> Profile | None:
        profile = self.selected()
        if profile is None:
            return None
        return self._do(lambda: self.store.duplicate(profile.name), f"Duplicated {profile.name!r}")

    def delete_selected(self) -> bool:
        profile = self.selected()
        if profile is None or not self.confirm(f"Delete the profile {profile.name!r}?"):
            return False
        return (
            self._do(lambda: self.store.delete(profile.name) or True, f"Deleted profile {profile.name!r}") is not None
        )

    def import_profile(self) -> Profile | None:
        path = self.ask_open_path()
        if not path:
            return None
        return self._do(lambda: self.store.import_file(path), f"Imported {Path(path).name}")

    def export_selected(self) -> Path | None:
        profile = self.selected()
        if profile is None:
            return None
        path = self.ask_save_path(Path.home() / Path(profile.path.name if profile.path else "profile.toml").name)
        if not path:
            return None
        return self._do(lambda: self.store.export(profile.name, path), f"Exported to {path}", reload=False)

    def save_notes(self) -> None:
        profile = self.selected()
        if profile is None or profile.shipped:
            return
        profile.notes = self.notes_edit.toPlainText()
        self._do(lambda: self.store.save(profile), f"Saved notes of {profile.name!r}")

    def record_bench(self, figures_by_name: dict[str, dict[str, Any]]) -> list[str]:
        """Store a bench's figures in the user profiles of those names (shipped ones are read-only:
        skipped), then reload the list once. Returns the names stored."""
        wanted = {name.strip().casefold(): figures for name, figures in figures_by_name.items()}
        stored = []
        for profile in self.profiles:
            figures = wanted.get(profile.name.casefold())
            if figures is None or profile.shipped:
                continue
            profile.bench = figures
            self.store.save(profile)
            stored.append(profile.name)
        if stored:
            self.reload()
        return stored

    def _do(self, action: Callable[[], Any], done_message: str, reload: bool = True) -> Any:
        try:
            result = action()
        except (ProfileError, OSError) as exc:
            self.show_error(str(exc))
            return None
        if reload:
            self.reload(select=getattr(result, "name", None))
        self.message.emit(done_message)
        return result

    # ------------------------------------------------------------------ asking the user
    # (separate methods so tests can answer for the user)

    def ask_new_profile(self, default_name: str) -> tuple[str, str] | None:
        dialog = NewProfileDialog(self, default_name)
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return None
        name = dialog.name_edit.text().strip()
        return (name, dialog.notes_edit.toPlainText()) if name else None

    def ask_text(self, title: str, label: str, default: str) -> str | None:
        text, ok = QInputDialog.getText(self, title, label, text=default)
        return text.strip() if ok else None

    def confirm(self, question: str) -> bool:
        return QMessageBox.question(self, "SpecDeck", question) == QMessageBox.StandardButton.Yes

    def ask_open_path(self) -> str:
        path, _ = QFileDialog.getOpenFileName(self, "Import a profile", str(Path.home()), "Profiles (*.toml)")
        return path

    def ask_save_path(self, suggested: Path) -> str:
        path, _ = QFileDialog.getSaveFileName(self, "Export the profile", str(suggested), "Profiles (*.toml)")
        return path

    def show_error(self, text: str) -> None:
        self.last_error = text
        self.message.emit(text)
        QMessageBox.warning(self, "SpecDeck", text)


def figures_from_stats(stats: dict[str, Any], source: str, info: dict[str, Any] | None) -> dict[str, Any]:
    """Profile bench figures from a run's cumulative stats."""
    figures: dict[str, Any] = {
        "source": source,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if info:
        figures["model"] = info.get("name")
        figures["device"] = info.get("device")
        figures["dtype"] = info.get("dtype")
    for key in ("tokens_per_second", "acceptance_rate", "mean_accepted_length", "generated", "rounds"):
        if key in stats and stats[key] is not None:
            value = stats[key]
            figures[key] = round(value, 4) if isinstance(value, float) else value
    return figures


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)
