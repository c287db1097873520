"""The left-hand panels: what to run (RunPanel), the engine's knobs (KnobPanel) and how tokens are drawn
(SamplingPanel).

KnobPanel holds one widget per EngineSettings field, made from the field's knob metadata
(engine.settings.knobs(): label, help, range). Every user change emits settings_changed
with a whole new EngineSettings value; the window hands it to the running session, which picks
it up at its next round. A knob that cannot act in the current context (mirror output with one
device, sub-vocab with chain off, ...) is disabled, and its tooltip says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from engine.sampling import MAX_TEMPERATURE, SamplingParams
from engine.settings import EngineSettings, Knob, knobs

CUSTOM_PROMPT = "Custom prompt"
BUNDLED_MODEL = "Bundled model"
BROWSE = "Other model folder…"
DTYPES = ["float32", "bfloat16", "float16"]
# How the decode-sized products (1..17 rows) run on a GPU: (label, Engine.load's gemm)
GEMMS = [
    ("GEMM: cuBLAS", "cublas"),
    ("GEMM: tuned (auto)", "auto"),
    ("GEMM: SpecDeck kernels", "cupy"),
    ("GEMM: torch.compile", "autotune"),
    ("GEMM: exact (bf16 speculation = greedy)", "exact"),
]
GEMM_TIP = (
    "How the decode-sized products (1..17 rows) run on a GPU. cuBLAS: PyTorch's default. Tuned (auto): "
    "SpecDeck's gemv kernels where they beat cuBLAS, per weight shape, measured once per GPU and cached "
    "(a few seconds at the first load). SpecDeck kernels (cupy): always the kernels. torch.compile: Triton "
    "GEMMs from max-autotune (compiles at the first round). Exact: kernels whose rows do not depend on how many "
    "rows run together, so speculative output equals greedy output bit for bit in bf16 too (fp32 always does), "
    "at some speed. Not used on the CPU."
)
DEFAULT_NEW_TOKENS = 256
CUSTOM_WORKLOAD = "__custom__"  # how a saved state says "the custom prompt"
MAX_STATE_TEXT = 1_000_000  # a longer text in a saved state is not a prompt or a folder: ignored

# Tooltips and the Help glossary: each knob's description, written once in EngineSettings' field metadata.
KNOB_HELP = {k.name: k.help for k in knobs()}


def check_model_dir(directory: str | Path) -> str | None:
    """Why this folder cannot be a model (one line), or None when it looks like one. Reads only
    config.json and file names, so it is quick enough to run when the folder is chosen."""
    from engine.config import ModelConfig
    from engine.errors import EngineError

    path = Path(directory).expanduser()
    if not path.is_dir():
        return f"{path}: not a folder"
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror or exc})"
    if not names:
        return f"{path}: the folder is empty; a model folder has config.json, *.safetensors and tokenizer.json"
    try:
        ModelConfig.from_file(path / "config.json")
    except (EngineError, ValueError, OSError) as exc:
        return str(exc).splitlines()[0]
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return f"{path}: no *.safetensors weights in the folder"
    if "tokenizer.json" not in names:
        return f"{path}: tokenizer.json not found; SpecDeck needs the model's tokenizer.json"
    return None


# How a knob's control looks beyond what its metadata says (label, help, range): all optional, so a new
# knob needs nothing here. step: the arrows' step; special: the text shown at the minimum; prefix: before
# the number; decimals: of a float; beside: shown on that knob's row instead of a row of its own.
CONTROL_LOOKS: dict[str, dict[str, Any]] = {
    "p_min": {"step": 0.05, "decimals": 2},
    "sub_vocab": {"step": 1024, "special": "all", "group_separators": True},
    "max_draft_depth": {"prefix": "up to ", "beside": "draft_depth"},
}
UNBOUNDED = 1_000_000  # the top of an int knob without one (sub-vocab: the model's vocabulary once known)
FLOAT_DECIMALS = 4  # a float knob's value is rounded to this many places (what the spin box can show)


def knob_control(knob: Knob) -> QWidget:
    """The widget of one EngineSettings knob, from its metadata: a check box for a switch, a spin box for
    an int range, a double spin box for a float range; named (accessibleName) by the knob's label."""
    look = CONTROL_LOOKS.get(knob.name, {})
    if knob.type is bool:
        widget: QWidget = QCheckBox(knob.label)
    elif knob.type in (int, float):
        lo, hi = knob.range
        if knob.type is int:
            widget = QSpinBox()
            widget.setRange(int(lo), int(hi) if hi is not None else UNBOUNDED)
        else:
            widget = QDoubleSpinBox()
            widget.setDecimals(look.get("decimals", 2))
            widget.setRange(float(lo), float(hi) if hi is not None else float(UNBOUNDED))
            widget.setSingleStep(look.get("step", (widget.maximum() - widget.minimum()) / 20))
        if knob.type is int and "step" in look:
            widget.setSingleStep(look["step"])
        if "special" in look:
            widget.setSpecialValueText(look["special"])
        if "prefix" in look:
            widget.setPrefix(look["prefix"])
        widget.setGroupSeparatorShown(look.get("group_separators", False))
        widget.setKeyboardTracking(False)  # apply typed numbers on Enter / focus-out, not per keystroke ("1" then "16")
    else:
        raise TypeError(f"no control for the knob {knob.name} of type {knob.type.__name__}")
    widget.setAccessibleName(knob.label)
    widget.setToolTip(knob.help)
    return widget


def _control_value(knob: Knob, widget: QWidget) -> Any:
    if knob.type is bool:
        return widget.isChecked()
    if knob.type is float:
        return round(widget.value(), FLOAT_DECIMALS)
    return widget.value()


def _set_control_value(knob: Knob, widget: QWidget, value: Any) -> None:
    if knob.type is bool:
        widget.setChecked(value)
    else:
        widget.setValue(value)


class KnobPanel(QGroupBox):
    """One control per EngineSettings knob, made from knobs(): adding a knob to EngineSettings adds its
    control here (and its tooltip, from the knob's help). Each control is also an attribute named after
    its knob (self.draft_depth, self.chain, ...). Draft depth has an Auto check box beside it."""

    settings_changed = Signal(object)  # EngineSettings

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Engine knobs (apply at the next round)", parent)
        self._device = "cpu"
        self._device_count = 1
        self.vocab_size: int | None = None
        self.knobs = {k.name: k for k in knobs()}
        self.widgets: dict[str, QWidget] = {name: knob_control(knob) for name, knob in self.knobs.items()}
        for name, widget in self.widgets.items():
            setattr(self, name, widget)
        self.depth_auto = QCheckBox("Auto")  # draft_depth "auto": the engine picks each round's depth
        self.sub_vocab_share = QLabel("")  # "25% of 151,936"

        form = QFormLayout(self)
        for name, knob in self.knobs.items():
            if "beside" in CONTROL_LOOKS.get(name, {}):
                continue  # on its host's row
            widget = self.widgets[name]
            if knob.type is bool:
                form.addRow(widget)
                continue
            extras = [self.depth_auto] if name == "draft_depth" else []
            extras += [self.widgets[n] for n in self.knobs if CONTROL_LOOKS.get(n, {}).get("beside") == name]
            extras += [self.sub_vocab_share] if name == "sub_vocab" else []
            if not extras:
                form.addRow(knob.label, widget)
                continue
            row = QHBoxLayout()
            row.addWidget(widget, 1)
            for extra in extras:
                row.addWidget(extra, 1 if extra in self.widgets.values() else 0)
            form.addRow(knob.label, row)
        self.pending_label = QLabel("")
        self.pending_label.setWordWrap(True)
        self.pending_label.setStyleSheet("color:#666;")
        self.glossary_label = QLabel("Hover a knob for what it does; Help ▸ Knob glossary lists them all.")
        self.glossary_label.setWordWrap(True)
        self.glossary_label.setStyleSheet("color:#666;")
        form.addRow(self.pending_label)
        form.addRow(self.glossary_label)

        self._updating = False
        self.set_settings(EngineSettings())
        for widget in [*self.widgets.values(), self.depth_auto]:
            signal = widget.toggled if isinstance(widget, QCheckBox) else widget.valueChanged
            signal.connect(self._on_user_change)

    def set_colors(self, colors: Any) -> None:
        for label in (self.pending_label, self.glossary_label):
            label.setStyleSheet(f"color:{colors.muted};")

    def settings(self) -> EngineSettings:
        values = {name: _control_value(knob, self.widgets[name]) for name, knob in self.knobs.items()}
        if self.depth_auto.isChecked():
            values["draft_depth"] = "auto"
        return EngineSettings(**values)

    def set_settings(self, settings: EngineSettings, emit: bool = False) -> None:
        """Show `settings` (e.g. a profile being applied); emit=True also applies them."""
        self._updating = True
        try:
            self.depth_auto.setChecked(settings.adaptive)
            for name, knob in self.knobs.items():
                value = getattr(settings, name)
                if name == "draft_depth" and settings.adaptive:
                    continue  # the spin box keeps the last fixed depth, for when Auto goes off
                _set_control_value(knob, self.widgets[name], value)
        finally:
            self._updating = False
        self._refresh_availability()
        if emit:
            self.settings_changed.emit(self.settings())

    def save_state(self) -> dict[str, Any]:
        """The knobs' settings, field by field (what restore_state takes back)."""
        return self.settings().to_dict()

    def restore_state(self, state: Mapping[str, Any]) -> list[str]:
        """Show the settings a saved state holds. Untrusted: a field whose value EngineSettings refuses keeps
        its default (its name is returned), an unknown key is skipped, and nothing raises."""
        if not isinstance(state, Mapping):
            self.set_settings(EngineSettings())
            return ["(not a table of settings)"]
        settings, bad = EngineSettings(), []
        for name in self.knobs:
            if name not in state:
                continue
            try:
                settings = settings.replace(**{name: state[name]})
            except (ValueError, TypeError):
                bad.append(name)
        self.set_settings(settings)
        return bad

    def set_context(self, device: str, device_count: int, vocab_size: int | None) -> None:
        """Where the engine runs: decides which knobs can act. vocab_size bounds sub-vocab."""
        self._device = device
        self._device_count = device_count
        self.vocab_size = vocab_size
        if vocab_size:
            self._updating = True
            self.sub_vocab.setMaximum(vocab_size)
            self._updating = False
        self._refresh_availability()

    def show_applied(self, applied: EngineSettings | None) -> None:
        """Say whether the panel's settings are what the engine last ran with."""
        if applied is None or applied == self.settings():
            self.pending_label.setText("")
        else:
            changes = ", ".join(f"{k} {b}" for k, (a, b) in applied.diff(self.settings()).items())
            self.pending_label.setText(f"Pending (next round): {changes}")

    def _on_user_change(self, *_: Any) -> None:
        if self._updating:
            return
        self._refresh_availability()
        self.settings_changed.emit(self.settings())

    def disabled_reasons(self) -> dict[str, str]:
        """knob name -> why it cannot act now (only knobs that are disabled)."""
        reasons: dict[str, str] = {}
        on_cpu = self._device == "cpu"
        if not self.speculative.isChecked():
            for name in ("draft_depth", "max_draft_depth", "p_min", "chain", "sub_vocab"):
                reasons[name] = "Speculative decoding is off: nothing is drafted."
        else:
            if self.depth_auto.isChecked():
                reasons["draft_depth"] = "Auto: the engine chooses the depth of every round (up to the limit beside)."
            else:
                reasons["max_draft_depth"] = "Acts only with Auto on: the deepest the engine may choose."
            if not self.chain.isChecked():
                reasons["sub_vocab"] = "Sub-vocab applies to the chained draft only: turn Chain on to use it."
        if on_cpu:
            reasons["mirror_output"] = (
                "Running on the CPU: one device, which already holds the "
                "whole output layer. Mirroring needs two or more GPUs."
            )
            reasons["plan_pool"] = "Plans are CUDA graphs, a GPU feature: on the CPU every round runs eagerly."
        elif self._device_count < 2:
            reasons["mirror_output"] = (
                "One GPU: it already holds the whole output layer. Mirroring needs two or more GPUs."
            )
        return reasons

    def _refresh_availability(self) -> None:
        reasons = self.disabled_reasons()
        self.depth_auto.setEnabled(self.speculative.isChecked())
        self.depth_auto.setToolTip(KNOB_HELP["draft_depth"])
        for name, widget in self.widgets.items():
            reason = reasons.get(name)
            widget.setEnabled(reason is None)
            widget.setToolTip(f"Disabled: {reason}\n\n{KNOB_HELP[name]}" if reason else KNOB_HELP[name])
        if self.vocab_size and self.sub_vocab.value():
            self.sub_vocab_share.setText(f"{self.sub_vocab.value() / self.vocab_size:.0%} of {self.vocab_size:,}")
        elif self.vocab_size:
            self.sub_vocab_share.setText(f"all {self.vocab_size:,}")
        else:
            self.sub_vocab_share.setText("")


SAMPLING_NOTE = (
    "Speculative and plain sampling use the random numbers differently, so their texts differ; "
    "their distributions are the same (each draft is accepted with probability min(1, p/q), a "
    "rejection draws from max(0, p - q)). The same seed and settings give the same text again."
)
SAMPLING_HELP = {
    "temperature": "0 = greedy: the most likely token, exactly the text of plain greedy decoding. "
    "Above 0, tokens are drawn; higher is more varied (Qwen3.5's cards suggest 0.6–1.0).",
    "top_k": "Draw only from the k most likely tokens (0 = off).",
    "top_p": "Draw only from the smallest set of most likely tokens whose probability reaches this (1 = off).",
    "min_p": "Drop tokens less likely than this times the most likely one (0 = off).",
    "seed": "The random numbers' seed: the same seed and settings give the same text.",
}


class SamplingPanel(QGroupBox):
    """Temperature, top-k, top-p, min-p and seed (SamplingParams): read when a run starts, so a change
    applies at the next run (a repeated workload included)."""

    sampling_changed = Signal(object)  # SamplingParams | None (None: greedy)

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Sampling (applies at the next run)", parent)
        self.setToolTip(SAMPLING_NOTE)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, MAX_TEMPERATURE)
        self.temperature.setSingleStep(0.1)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("greedy")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1_000_000)
        self.top_k.setSpecialValueText("off")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setDecimals(2)
        self.min_p = QDoubleSpinBox()
        self.min_p.setRange(0.0, 1.0)
        self.min_p.setSingleStep(0.01)
        self.min_p.setDecimals(3)
        self.min_p.setSpecialValueText("off")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.widgets: dict[str, QWidget] = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
        }
        form = QFormLayout(self)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Min-p", self.min_p)
        form.addRow("Seed", self.seed)
        self._updating = False
        self.set_sampling(None)
        for spin in self.widgets.values():
            spin.setKeyboardTracking(False)
            spin.valueChanged.connect(self._on_user_change)

    def sampling(self) -> SamplingParams | None:
        """The panel's sampling, or None at temperature 0 (greedy)."""
        sp = SamplingParams(
            temperature=round(self.temperature.value(), 4),
            top_k=self.top_k.value(),
            top_p=round(self.top_p.value(), 4),
            min_p=round(self.min_p.value(), 4),
            seed=self.seed.value(),
        )
        return None if sp.greedy else sp

    def set_sampling(self, sampling: SamplingParams | None, emit: bool = False) -> None:
        sp = sampling or SamplingParams(temperature=0.0)
        self._updating = True
        try:
            self.temperature.setValue(sp.temperature)
            self.top_k.setValue(sp.top_k)
            self.top_p.setValue(sp.top_p)
            self.min_p.setValue(sp.min_p)
            self.seed.setValue(min(sp.seed, self.seed.maximum()))
        finally:
            self._updating = False
        self._refresh()
        if emit:
            self.sampling_changed.emit(self.sampling())

    def _on_user_change(self, *_: Any) -> None:
        if self._updating:
            return
        self._refresh()
        self.sampling_changed.emit(self.sampling())

    def _refresh(self) -> None:
        greedy = self.temperature.value() == 0.0
        for name, widget in self.widgets.items():
            off = greedy and name != "temperature"
            widget.setEnabled(not off)
            reason = "Disabled: temperature 0 is greedy decoding, nothing is drawn.\n\n" if off else ""
            widget.setToolTip(f"{reason}{SAMPLING_HELP[name]}\n\n{SAMPLING_NOTE}")


class RunPanel(QGroupBox):
    """Model, device, dtype, workload / prompt, and Run / Stop."""

    run_clicked = Signal()
    stop_clicked = Signal()
    model_changed = Signal()
    model_refused = Signal(str)  # a chosen folder that is not a model: why

    def __init__(
        self,
        workloads: dict[str, Any],
        bundled_dir: Path | None,
        parent: QWidget | None = None,
        default_workload: str | None = None,
    ):
        super().__init__("Run", parent)
        self.workloads = workloads
        # A first run works with one click: a real prompt, not an empty one.
        self.default_workload = default_workload if default_workload in workloads else next(iter(workloads), None)
        self._readonly_style = "background:#f4f4f4; color:#444;"

        self._running = False
        self.model_combo = QComboBox()
        bundled_text = f"{BUNDLED_MODEL} ({bundled_dir.name})" if bundled_dir else f"{BUNDLED_MODEL} (not installed)"
        self.model_combo.addItem(bundled_text, None)
        self.model_combo.addItem(BROWSE, "__browse__")
        self.model_combo.setToolTip(
            "A Hugging Face model folder (config.json, *.safetensors, "
            "tokenizer.json) of a Qwen3.5-hybrid model with an MTP head"
        )
        self._last_model_index = 0
        self.model_combo.activated.connect(self._on_model_activated)

        self.device_combo = QComboBox()
        self.device_combo.addItem("cpu", "cpu")
        self.device_combo.currentIndexChanged.connect(lambda _: self.model_changed.emit())
        self.dtype_combo = QComboBox()
        self.dtype_combo.addItems(DTYPES)
        self.dtype_combo.currentIndexChanged.connect(lambda _: self.model_changed.emit())
        self.gemm_combo = QComboBox()
        for label, mode in GEMMS:
            self.gemm_combo.addItem(label, mode)
        self.gemm_combo.setToolTip(GEMM_TIP)
        self.gemm_combo.currentIndexChanged.connect(lambda _: self.model_changed.emit())
        self.device_combo.currentIndexChanged.connect(lambda _: self._update_gemm_enabled())
        self._update_gemm_enabled()

        self.workload_combo = QComboBox()
        for name in workloads:
            self.workload_combo.addItem(name, name)
        self.workload_combo.addItem(CUSTOM_PROMPT, None)
        self.workload_combo.currentIndexChanged.connect(self._on_workload_changed)
        self.prompt_edit = QPlainTextEdit()
        self.prompt_edit.setPlaceholderText("Type a prompt…")
        self.prompt_edit.setMaximumHeight(110)
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(DEFAULT_NEW_TOKENS)
        self.repeat = QCheckBox("Repeat until stopped")
        self.repeat.setToolTip(
            "Start the workload again when it finishes, so the plots keep going while you flip knobs"
        )
        self.repeat.setChecked(True)

        self.run_button = QPushButton("Run")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self.run_clicked)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_clicked)

        form = QFormLayout(self)
        form.addRow("Model", self.model_combo)
        device_row = QHBoxLayout()
        device_row.addWidget(self.device_combo, 2)
        device_row.addWidget(self.dtype_combo, 1)
        form.addRow("Device", device_row)
        form.addRow("", self.gemm_combo)
        form.addRow("Workload", self.workload_combo)
        form.addRow(self.prompt_edit)
        form.addRow("New tokens", self.max_new_tokens)
        form.addRow(self.repeat)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        form.addRow(buttons)
        self.select_workload(self.default_workload)
        self._on_workload_changed()

    # -- model --

    def _on_model_activated(self, index: int) -> None:
        if self.model_combo.itemData(index) == "__browse__":
            directory = self.ask_model_dir()
            problem = check_model_dir(directory) if directory else None
            if problem:
                self.model_refused.emit(problem)
            if directory and not problem:
                self.add_model_dir(directory)
            else:
                self.model_combo.setCurrentIndex(self._last_model_index)
                return
        self._last_model_index = self.model_combo.currentIndex()
        self.model_changed.emit()

    def ask_model_dir(self) -> str:
        return QFileDialog.getExistingDirectory(self, "Choose a model folder")

    def add_model_dir(self, directory: str | Path) -> None:
        """Select a model folder (added to the list once)."""
        directory = str(directory)
        index = self.model_combo.findData(directory)
        if index < 0:
            index = self.model_combo.count() - 1  # before "Other model folder…"
            self.model_combo.insertItem(index, Path(directory).name or directory, directory)
            self.model_combo.setItemData(index, directory, 3)  # Qt.ToolTipRole
        self.model_combo.setCurrentIndex(index)
        self._last_model_index = index
        self.model_changed.emit()

    def model_dirs(self) -> list[str]:
        return [
            self.model_combo.itemData(i)
            for i in range(self.model_combo.count())
            if self.model_combo.itemData(i) not in (None, "__browse__")
        ]

    def set_devices(self, gpu_names: list[str]) -> None:
        """cpu plus one entry per NVIDIA GPU the monitor found."""
        current = self.device()
        self.device_combo.blockSignals(True)
        self.device_combo.clear()
        self.device_combo.addItem("cpu", "cpu")
        for i, name in enumerate(gpu_names):
            self.device_combo.addItem(f"cuda:{i} — {name}", f"cuda:{i}")
        if len(gpu_names) > 1:
            every_gpu = ",".join(f"cuda:{i}" for i in range(len(gpu_names)))
            self.device_combo.addItem(f"all {len(gpu_names)} GPUs (tensor parallel)", every_gpu)
        index = self.device_combo.findData(current)
        self.device_combo.setCurrentIndex(max(index, 0))
        self.device_combo.blockSignals(False)
        self._update_gemm_enabled()  # the device may have fallen back to the CPU (signals were blocked)

    def model_dir(self) -> str | None:
        return self.model_combo.currentData()

    def device(self) -> str:
        return self.device_combo.currentData() or "cpu"

    def dtype(self) -> str:
        return self.dtype_combo.currentText()

    def gemm(self) -> str:
        """The GEMM backend to load with: the chosen one on a GPU, cuBLAS (the only one there is) on the CPU."""
        return "cublas" if self.device() == "cpu" else (self.gemm_combo.currentData() or "cublas")

    def _update_gemm_enabled(self) -> None:
        """Choosable on a GPU while nothing runs; greyed on the CPU, where it does not apply."""
        self.gemm_combo.setEnabled(self.device() != "cpu" and not self._running)

    # -- workload --

    def _on_workload_changed(self, *_: Any) -> None:
        name = self.workload_combo.currentData()
        custom = name is None
        self.prompt_edit.setReadOnly(not custom)
        if not custom:
            workload = self.workloads[name]
            self.prompt_edit.setPlainText(workload.prompt)
            self.prompt_edit.setToolTip(
                f"{workload.description}\n\nA model with a chat template gets the task as a "
                f"chat message instead:\n{workload.chat}"
            )
        elif not self.prompt_edit.toPlainText().strip() or self._showing_workload_text():
            self.prompt_edit.clear()
        self.prompt_edit.setStyleSheet("" if custom else self._readonly_style)

    def set_colors(self, colors: Any) -> None:
        self._readonly_style = f"background:{colors.readonly_background}; color:{colors.muted};"
        self._on_workload_changed()

    def _showing_workload_text(self) -> bool:
        text = self.prompt_edit.toPlainText()
        return any(w.prompt == text for w in self.workloads.values())

    def workload_name(self) -> str | None:
        return self.workload_combo.currentData()

    def select_workload(self, name: str | None) -> None:
        index = self.workload_combo.findData(name)
        if index >= 0:
            self.workload_combo.setCurrentIndex(index)

    def prompt(self) -> str:
        return self.prompt_edit.toPlainText()

    # -- state kept between sessions --

    def save_state(self) -> dict[str, Any]:
        """The choices to bring back next time (restore_state takes them): the model folders listed and the
        one chosen ("" = bundled), dtype, GEMM backend, workload (or the custom prompt), new tokens, repeat."""
        workload = self.workload_name()
        state: dict[str, Any] = {
            "model_dirs": self.model_dirs(),
            "model_dir": self.model_dir() or "",
            "dtype": self.dtype(),
            "gemm": self.gemm_combo.currentData(),
            "workload": workload or CUSTOM_WORKLOAD,
            "max_new_tokens": self.max_new_tokens.value(),
            "repeat": self.repeat.isChecked(),
        }
        if workload is None:
            state["custom_prompt"] = self.prompt()
        return state

    def restore_state(self, state: Mapping[str, Any]) -> list[str]:
        """Bring back a saved state. Untrusted (read back from a file, where anything may be, as text or
        lists): a key whose value is unusable is returned and its choice keeps its default; a listed folder
        that is no longer a model is dropped; unknown keys are skipped; nothing raises."""
        if not isinstance(state, Mapping):
            state = {}
        bad: list[str] = []

        def text(key: str) -> str | None:
            value = state.get(key)
            if value is None or (isinstance(value, str) and len(value) <= MAX_STATE_TEXT):
                return value
            bad.append(key)
            return None

        dirs = state.get("model_dirs", [])
        dirs = [dirs] if isinstance(dirs, str) else dirs  # one folder reads back as a plain string
        if not isinstance(dirs, list):
            bad.append("model_dirs")
            dirs = []
        for directory in dirs:
            if (
                isinstance(directory, str)
                and len(directory) <= MAX_STATE_TEXT
                and "\0" not in directory
                and Path(directory).is_dir()
                and check_model_dir(directory) is None
            ):
                self.add_model_dir(directory)
        chosen = text("model_dir") or ""
        index = self.model_combo.findData(chosen) if chosen else 0  # "": the bundled model
        self.model_combo.setCurrentIndex(max(index, 0))
        self._last_model_index = self.model_combo.currentIndex()

        dtype = text("dtype")
        if dtype is not None and dtype not in DTYPES:
            bad.append("dtype")
        self.dtype_combo.setCurrentText(dtype if dtype in DTYPES else DTYPES[0])

        gemm = text("gemm")
        index = self.gemm_combo.findData(gemm) if gemm is not None else 0
        if index < 0:
            bad.append("gemm")
        self.gemm_combo.setCurrentIndex(max(index, 0))

        workload, custom_prompt = text("workload"), text("custom_prompt") or ""
        if workload == CUSTOM_WORKLOAD and custom_prompt.strip():
            self.select_workload(None)
            self.prompt_edit.setPlainText(custom_prompt)
        else:  # an empty custom prompt, a workload gone, or none: a real workload, so Run works at once
            self.select_workload(workload if workload in self.workloads else self.default_workload)

        max_new = state.get("max_new_tokens")
        try:
            max_new = DEFAULT_NEW_TOKENS if max_new is None else int(max_new)
        except (TypeError, ValueError, OverflowError):
            bad.append("max_new_tokens")
            max_new = DEFAULT_NEW_TOKENS
        self.max_new_tokens.setValue(max(1, min(max_new, self.max_new_tokens.maximum())))

        repeat = state.get("repeat", True)
        if repeat not in (True, False, "true", "false"):
            bad.append("repeat")
            repeat = True
        self.repeat.setChecked(repeat in (True, "true"))
        return bad

    def set_running(self, running: bool) -> None:
        self._running = running
        self.run_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        for widget in (self.model_combo, self.device_combo, self.dtype_combo, self.workload_combo, self.max_new_tokens):
            widget.setEnabled(not running)
        self._update_gemm_enabled()
        self.prompt_edit.setReadOnly(running or self.workload_name() is not None)
