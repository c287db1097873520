"""The main window: the run panel and knobs on the left, tabs on the right (Live, GPU monitor,
Profiles, Bench), an error banner on top and the engine's state in the status bar.

The window never calls the engine itself: runs, loads and benches go to the EngineWorker (the
engine thread), and its signals come back here, where handlers only store data and update
widgets. Plots and text redraw on their own timers.
"""

from __future__ import annotations

import dataclasses
import html
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QIcon, QKeySequence
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.gui import theme
from app.gui.bench_tab import BenchTab
from app.gui.controls import KNOB_HELP, KnobPanel, RunPanel, SamplingPanel, check_model_dir
from app.gui.monitor import MonitorSampler, MonitorTab
from app.gui.output_view import OutputView
from app.gui.paint_queue import paint_queue
from app.gui.plots import RunPlots
from app.gui.profiles_view import ProfilesTab, figures_from_stats
from app.gui.worker import (
    BenchRequest,
    EngineWorker,
    LoadedModel,
    ModelKey,
    RunFinished,
    RunRequest,
    RunStarted,
)
from app.hardware import MonitorSample
from app.history import settings_summary
from app.profiles import (
    Profile,
    ProfileStore,
    config_dir,
    load_last_used,
    save_last_used,
)
from engine.settings import EngineSettings, knobs
from engine.untrusted import exists, is_regular_file

ICON_PATH = Path(__file__).resolve().parents[2] / "assets" / "icons" / "specdeck.svg"
DEFAULT_WORKLOAD = "code_gen"  # a first run works with one click: a real prompt, not an empty one
# Panels whose state is kept in last_used.toml (the profile file format, shared with the command line)
# rather than in a group of window.ini.
LAST_USED_PANELS = ("knobs",)
TAB_NAMES = ("Live", "GPU monitor", "Profiles", "Bench")

# (keys, what they do): the Help menu's list, and what the window's actions use.
SHORTCUTS = [
    ("Ctrl+R", "Run"),
    ("Ctrl+.", "Stop the run or bench"),
    ("Space", "Pause / resume the plots (data keeps being recorded)"),
    ("Ctrl+E", "Export the plot data (CSV)"),
    ("Ctrl+Shift+E", "Export the plots (PNG)"),
    ("Ctrl+1 … Ctrl+4", "Live, GPU monitor, Profiles, Bench tab"),
    ("Ctrl+Tab / Ctrl+Shift+Tab", "Next / previous tab"),
    ("Ctrl+O", "Open a model folder"),
    ("Ctrl+Q", "Quit"),
]


def _window_state_settings() -> tuple[QSettings, str | None]:
    """The window's saved state (window.ini), and a notice when the file was not usable: a FIFO, a device
    or an oversized file is moved aside (QSettings would block on it or read it all) and a fresh one used."""
    path = config_dir() / "window.ini"
    notice = None
    if exists(path) and (not is_regular_file(path) or path.stat().st_size > 1 << 20):
        aside = path.with_name("window.ini.bad")
        try:
            os.replace(path, aside)
            notice = f"window state not restored: {path} was not a small regular file; moved to {aside.name}"
        except OSError as exc:
            notice = f"window state not restored: {path} is not a small regular file ({exc.strerror}); not saved"
            path = Path(tempfile.mkdtemp(prefix="specdeck-")) / "window.ini"
    return QSettings(str(path), QSettings.Format.IniFormat), notice


class MainWindow(QMainWindow):
    run_finished = Signal(object)  # RunFinished, after the window has handled it (tests wait on it)

    def __init__(
        self,
        model_dir: str | None = None,
        nvml: Any = None,
        remember: bool = True,
        sample_interval_s: float | None = None,
        theme: str | None = None,
    ):
        """model_dir: preselect this model folder (None: the bundled one).
        nvml: an NVML module to use instead of pynvml (tests).
        remember: restore and save the last used settings and window state.
        theme: system / light / dark (None: the saved choice, else system)."""
        super().__init__()
        self.setWindowTitle("SpecDeck")
        if ICON_PATH.exists():
            self.setWindowIcon(QIcon(str(ICON_PATH)))
        self.remember = remember
        self.state = "idle"  # idle | running (includes its load) | bench
        self.model_info: dict[str, Any] | None = None
        self.applied_settings: EngineSettings | None = None  # what the engine last ran with
        self.applied_profile: Profile | None = None  # re-scaled to each model's vocabulary
        self.last_run: RunFinished | None = None
        self.last_error: str | None = None
        self._stopping = False
        self._last_request: RunRequest | None = None
        self._gpu_names: list[str] = []
        self.qsettings, self._state_notice = _window_state_settings()

        from app.workloads import load_workloads
        from engine import EngineError, bundled_model_dir

        startup_problems = []
        try:
            self.workloads = load_workloads()
        except EngineError as exc:
            self.workloads = {}
            startup_problems.append(str(exc))
        try:
            bundled = bundled_model_dir()
        except EngineError:
            bundled = None

        # ---- widgets
        self.run_panel = RunPanel(self.workloads, bundled, default_workload=DEFAULT_WORKLOAD)
        self.knobs = KnobPanel()
        self.sampling_panel = SamplingPanel()
        self.profile_combo = QComboBox()
        self.profile_combo.setToolTip("Apply a saved profile's settings")
        self.profile_combo.activated.connect(self._on_quick_profile)
        quick_row = QHBoxLayout()
        quick_row.addWidget(QLabel("Profile"))
        quick_row.addWidget(self.profile_combo, 1)

        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.addWidget(self.run_panel)
        left_layout.addLayout(quick_row)
        left_layout.addWidget(self.knobs)
        left_layout.addWidget(self.sampling_panel)
        left_layout.addStretch(1)
        left_scroll = QScrollArea()
        left_scroll.setWidget(left)
        left_scroll.setWidgetResizable(True)
        left_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        left_scroll.setMinimumWidth(300)
        left_scroll.setMaximumWidth(420)

        self.plots = RunPlots()
        self.output = OutputView()
        live = QSplitter(Qt.Orientation.Vertical)
        live.addWidget(self.plots)
        live.addWidget(self.output)
        live.setStretchFactor(0, 3)
        live.setStretchFactor(1, 1)
        live.setSizes([640, 200])

        self.monitor_tab = MonitorTab()
        self.store = ProfileStore()
        self.profiles_tab = ProfilesTab(
            self.store, self.knobs.settings, self.current_figures, lambda: list(self._gpu_names)
        )
        self.profiles_tab.current_sampling = self.sampling_panel.sampling
        self.bench_tab = BenchTab(list(self.workloads))
        self.export_dir: str = str(Path.home())  # where the last export went (remembered)

        self.tabs = QTabWidget()
        self.tabs.addTab(live, "Live")
        self.tabs.addTab(self.monitor_tab, "GPU monitor")
        self.tabs.addTab(self.profiles_tab, "Profiles")
        bench_scroll = QScrollArea()  # the A/B bench and the Tune panel: scrolls rather than set a minimum height
        bench_scroll.setWidgetResizable(True)
        bench_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        bench_scroll.setWidget(self.bench_tab)
        self.tabs.addTab(bench_scroll, "Bench")

        self.error_label = QLabel("")
        self.error_label.setWordWrap(True)
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_close = QPushButton("Dismiss")
        self.error_close.clicked.connect(self.clear_error)
        self.error_banner = QWidget()
        self.error_banner.setStyleSheet("background:#f8d7da; color:#842029;")
        banner_layout = QHBoxLayout(self.error_banner)
        banner_layout.addWidget(self.error_label, 1)
        banner_layout.addWidget(self.error_close)
        self.error_banner.hide()
        # Shown while a bench with synthetic acceptance runs: its figures are speed only, its text not the model's.
        self.synthetic_banner = QLabel("")
        self.synthetic_banner.setWordWrap(True)
        self.synthetic_banner.setStyleSheet("background:#fff3cd; color:#664d03; padding:6px; font-weight:bold;")
        self.synthetic_banner.hide()

        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        right_layout.addWidget(self.synthetic_banner)
        right_layout.addWidget(self.error_banner)
        right_layout.addWidget(self.tabs, 1)
        splitter = QSplitter()
        splitter.addWidget(left_scroll)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        self.setCentralWidget(splitter)

        self.state_label = QLabel("Idle")
        self.model_label = QLabel("No model loaded")
        # Both permanent: temporary messages (showMessage) appear at the left and never cover them.
        self.statusBar().addPermanentWidget(self.state_label)
        self.statusBar().addPermanentWidget(self.model_label)
        self._build_menu()

        # ---- the engine thread and the monitor thread
        self.worker = EngineWorker(self.workloads)
        self.worker.load_started.connect(self._on_load_started)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.started.connect(self._on_run_started)
        self.worker.round.connect(self._on_rounds)
        self.worker.finished.connect(self._on_run_finished)
        self.worker.errored.connect(self.show_error)
        self.worker.bench_progress.connect(self.bench_tab.on_progress)
        self.worker.bench_finished.connect(self._on_bench_finished)
        self.worker.frame_granted.connect(self._draw_granted_frame)
        self.plots.frame_gate = self.worker.frame_gate
        paint_queue().gate = self.worker.frame_gate
        self.output.frame_gate = self.worker.frame_gate

        self.sampler = MonitorSampler(nvml=nvml, **({"interval_s": sample_interval_s} if sample_interval_s else {}))
        self.sampler.sampled.connect(self._on_sample)
        self.sampler.sampled.connect(self.monitor_tab.add_sample)
        self.sampler.sampled.connect(self.plots.add_memory_sample)

        # ---- wiring between panels
        self.run_panel.run_clicked.connect(self.start_run)
        self.run_panel.stop_clicked.connect(self.stop)
        self.run_panel.model_changed.connect(self._on_model_choice_changed)
        self.run_panel.model_refused.connect(lambda problem: self.show_error("model", problem))
        self.knobs.settings_changed.connect(self._on_knobs_changed)
        self.profiles_tab.apply_requested.connect(self.apply_profile)
        self.profiles_tab.message.connect(self.show_message)
        self.profiles_tab.profiles_changed.connect(self._on_profiles_changed)
        self.bench_tab.start_requested.connect(self.start_bench)
        from app.gui.tune_panel import TuneRunner

        self.tune_runner = TuneRunner(self.worker)
        self._fallbacks_shown: dict = {}
        self.tune_panel = self.bench_tab.tune_panel
        self.tune_panel.start_requested.connect(self.start_tune)
        # Direct: the runner lives on the engine thread, which is busy with the tune it should cancel.
        self.tune_panel.cancel_requested.connect(self.tune_runner.cancel, Qt.ConnectionType.DirectConnection)
        self.tune_runner.progress.connect(self.tune_panel.on_progress)
        self.tune_runner.finished.connect(self._on_tune_finished)
        self.tune_runner.errored.connect(lambda message: self.show_error("tune", message))
        self.bench_tab.stop_requested.connect(self.stop)
        self.bench_tab.message.connect(self.show_message)
        self.plots.export_csv_button.clicked.connect(self.export_plot_csv)
        self.plots.export_png_button.clicked.connect(self.export_plot_png)

        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(500)
        self._save_timer.timeout.connect(lambda: self._save_panel("knobs"))
        # Each panel saves and restores its own state (save_state() -> dict, restore_state(dict)); the
        # window only keeps them, each under its name (a group of window.ini, or last_used.toml).
        self.panels: dict[str, Any] = {"run": self.run_panel, "knobs": self.knobs}

        self._on_profiles_changed()
        restored_geometry = False
        if remember:
            restored_geometry = self._restore_state()
        self.set_theme(theme if theme is not None else self._saved_theme())
        if model_dir:
            self.run_panel.add_model_dir(model_dir)
        self._on_model_choice_changed()
        for problem in startup_problems:
            self.show_error("startup", problem)
        if self.profiles_tab.problems:
            self.show_message(f"{len(self.profiles_tab.problems)} bad profile file(s) skipped: see the Profiles tab")
        self.sampler.start()
        self.tabs.currentChanged.connect(self._on_tab_changed)
        try:  # the desktop switched between light and dark: follow it when the theme is "system"
            from PySide6.QtGui import QGuiApplication

            QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme_changed)
        except AttributeError:  # Qt < 6.5
            pass
        self._update_bench_button()
        if not restored_geometry:
            self.resize(1440, 900)

    # ------------------------------------------------------------------ menu

    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        open_model = QAction("Open model folder…", self)
        open_model.setShortcut(QKeySequence.StandardKey.Open)
        open_model.triggered.connect(self._open_model_folder)
        export_csv = QAction("Export plot data (CSV)…", self)
        export_csv.setShortcut("Ctrl+E")
        export_csv.triggered.connect(lambda: self.export_plot_csv())
        export_png = QAction("Export plots (PNG)…", self)
        export_png.setShortcut("Ctrl+Shift+E")
        export_png.triggered.connect(lambda: self.export_plot_png())
        load_overlay = QAction("Compare with an exported run (CSV)…", self)
        load_overlay.triggered.connect(lambda: self.load_overlay())
        quit_action = QAction("Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        for action in (open_model, export_csv, export_png, load_overlay):
            file_menu.addAction(action)
        file_menu.addSeparator()
        file_menu.addAction(quit_action)
        run_menu = self.menuBar().addMenu("&Run")
        run_action = QAction("Run", self)
        run_action.setShortcut("Ctrl+R")
        run_action.triggered.connect(self.start_run)
        stop_action = QAction("Stop", self)
        stop_action.setShortcut("Ctrl+.")
        stop_action.triggered.connect(self.stop)
        self.pause_action = QAction("Pause plots", self)
        self.pause_action.setShortcut("Space")
        self.pause_action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        self.pause_action.setCheckable(True)
        self.pause_action.toggled.connect(self.plots.set_paused)
        self.plots.pause_button.toggled.connect(self.pause_action.setChecked)
        run_menu.addAction(run_action)
        run_menu.addAction(stop_action)
        run_menu.addAction(self.pause_action)

        view_menu = self.menuBar().addMenu("&View")
        self.theme_actions: dict[str, QAction] = {}
        group = QActionGroup(self)
        for mode, text in (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")):
            action = QAction(f"Theme: {text}", self)
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, m=mode: self.set_theme(m))
            group.addAction(action)
            view_menu.addAction(action)
            self.theme_actions[mode] = action
        view_menu.addSeparator()
        self.tab_actions = []
        for index, name in enumerate(TAB_NAMES):
            action = QAction(f"{name} tab", self)
            action.setShortcut(f"Ctrl+{index + 1}")
            action.triggered.connect(lambda _=False, i=index: self.tabs.setCurrentIndex(i))
            view_menu.addAction(action)
            self.tab_actions.append(action)
        next_tab = QAction("Next tab", self)
        next_tab.setShortcut(QKeySequence("Ctrl+Tab"))
        next_tab.triggered.connect(
            lambda: self.tabs.setCurrentIndex((self.tabs.currentIndex() + 1) % self.tabs.count())
        )
        previous_tab = QAction("Previous tab", self)
        previous_tab.setShortcut(QKeySequence("Ctrl+Shift+Tab"))
        previous_tab.triggered.connect(
            lambda: self.tabs.setCurrentIndex((self.tabs.currentIndex() - 1) % self.tabs.count())
        )
        view_menu.addAction(next_tab)
        view_menu.addAction(previous_tab)

        help_menu = self.menuBar().addMenu("&Help")
        shortcuts = QAction("Keyboard shortcuts", self)
        shortcuts.setShortcut(QKeySequence.StandardKey.HelpContents)
        shortcuts.triggered.connect(lambda: self._show_help("Keyboard shortcuts", self.shortcuts_html()))
        glossary = QAction("Knob glossary", self)
        glossary.triggered.connect(lambda: self._show_help("Knob glossary", self.glossary_html()))
        about = QAction("About SpecDeck", self)
        about.triggered.connect(self._about)
        for action in (shortcuts, glossary, about):
            help_menu.addAction(action)

    @staticmethod
    def shortcuts_html() -> str:
        rows = "".join(
            f"<tr><td><b>{html.escape(k)}</b>&nbsp;&nbsp;</td><td>{html.escape(v)}</td></tr>" for k, v in SHORTCUTS
        )
        return f"<table>{rows}</table>"

    @staticmethod
    def glossary_html() -> str:
        names = {k.name: k.label for k in knobs()}
        items = "".join(
            f"<p><b>{names[k]}</b> (<code>{k}</code>): {html.escape(text)}</p>" for k, text in KNOB_HELP.items()
        )
        return (
            items + "<p>Speculation changes speed, never text: the output is always the target's greedy decoding. "
            "Compare settings on the Bench tab (or <code>specdeck bench</code>): a difference inside the spread of "
            "the rounds is reported as no clear difference.</p>"
        )

    def _show_help(self, title: str, body: str) -> None:
        box = QMessageBox(self)
        box.setWindowTitle(title)
        box.setTextFormat(Qt.TextFormat.RichText)
        box.setText(body)
        box.open()
        self._help_box = box

    # ------------------------------------------------------------------ theme and tabs

    def _saved_theme(self) -> str:
        if not self.remember:
            return "system"
        mode = str(self.qsettings.value("view/theme", "system"))
        return mode if mode in theme.THEMES else "system"

    def set_theme(self, mode: str) -> None:
        """system / light / dark: the widgets' palette, the plots, the output's colours."""
        colors = theme.apply_theme(mode)
        theme.style_plots(self, colors)
        self.theme = theme.current_mode
        if self.theme in self.theme_actions:
            self.theme_actions[self.theme].setChecked(True)
        self.run_panel.set_colors(colors)
        self.knobs.set_colors(colors)
        self.bench_tab.bars.show_figures(self.bench_tab.bars.figures)  # whiskers in the new text colour
        if self.remember:
            self.qsettings.setValue("view/theme", self.theme)

    def _on_system_scheme_changed(self, *_: Any) -> None:
        if self.theme == "system":
            self.set_theme("system")

    def _on_tab_changed(self, index: int) -> None:
        if self.remember:
            self.qsettings.setValue("window/tab", index)

    def _update_bench_button(self) -> None:
        """Run bench is greyed only while something runs, and then says why."""
        busy = self.state != "idle"
        self.bench_tab.set_available(not busy, "A run is going: stop it (Ctrl+.) to start a bench." if busy else "")

    def _open_model_folder(self) -> None:
        directory = self.run_panel.ask_model_dir()
        if directory:
            self.choose_model_dir(directory)

    def choose_model_dir(self, directory: str) -> bool:
        """Check a folder the user picked before it is listed (and remembered): a folder that is
        not a model is refused with the reason, and the previous choice stays."""
        problem = check_model_dir(directory)
        if problem:
            self.show_error("model", problem)
            return False
        self.clear_error()
        self.run_panel.add_model_dir(directory)
        return True

    def _about(self) -> None:
        from engine import __version__

        QMessageBox.about(self, "About SpecDeck", f"SpecDeck {__version__}\nLive tuning of MTP speculative decoding.")

    # ------------------------------------------------------------------ runs

    def model_key(self) -> ModelKey:
        return ModelKey(
            self.run_panel.model_dir(), self.run_panel.device(), self.run_panel.dtype(), self.run_panel.gemm()
        )

    def start_run(self) -> None:
        if self.state != "idle":
            return
        self.clear_error()
        workload = self.run_panel.workload_name()
        request = RunRequest(
            key=self.model_key(),
            workload=workload,
            prompt=self.run_panel.prompt(),
            max_new_tokens=self.run_panel.max_new_tokens.value(),
            settings=self.knobs.settings(),
            label=workload or "custom prompt",
            sampling=self.sampling_panel.sampling(),
        )
        self._begin(request)

    def _begin(self, request: RunRequest) -> None:
        self._last_request = request
        self._stopping = False
        self.state = "running"
        self.run_panel.set_running(True)
        self._update_bench_button()
        self.plots.recording = True
        self.plots.mark_start()
        self.state_label.setText("Starting…")
        self.worker.load_and_run(request)

    def stop(self) -> None:
        """Stop the run (or bench) within one round; a repeat loop ends too."""
        if self.state == "idle":
            return
        self._stopping = True
        self.state_label.setText("Stopping…")
        self.tune_runner.cancel()
        self.worker.stop()

    def _on_load_started(self, message: str) -> None:
        self.plots.recording = True
        self.state_label.setText(message)

    def _on_loaded(self, loaded: LoadedModel) -> None:
        info = loaded.info
        self.model_info = info
        threads = ""
        if str(info.get("device", "")).startswith("cpu"):
            import torch

            count = torch.get_num_threads()  # app.threads' rule, set by the worker before the load
            threads = f" · {count} CPU thread{'s' if count != 1 else ''}"
        self.model_label.setText(
            f"{info.get('name')} · {info.get('parameters', 0) / 1e6:,.1f} M params · "
            f"vocab {info.get('vocab_size'):,} · context {info.get('max_context') or 0:,} · {info.get('device')} · "
            f"{info.get('dtype')}{threads}"
            + (f" · GEMM {info.get('gemm')}" if info.get("gemm", "cublas") != "cublas" else "")
        )
        self.model_label.setToolTip(
            f"{info.get('context_note') or ''}\n"
            "CPU threads: the usable cores minus one (SPECDECK_CPU_THREADS or specdeck --threads N overrides)"
        )
        self.state_label.setText(f"Loaded in {loaded.load_s:.1f} s")
        devices = info.get("devices") or []
        if len(devices) > 1:
            self.model_label.setText(self.model_label.text() + f" · split over {len(devices)} devices")
        note = (info.get("collectives") or {}).get("note", "")
        if note:  # a split that cannot pay: said once, where the user looks after a load
            self.show_message(f"Note: {note}")
            self.model_label.setToolTip(f"{note}\n\n{self.model_label.toolTip()}")
        self.plots.set_engine_memory(loaded.memory)
        self._update_knob_context()
        # The worker fitted the settings to this model before its first round (sub-vocab scaled
        # from a profile's share of the vocabulary, or reset when larger): show what will run.
        fitted = self.worker.settings
        if fitted is not None:
            if self.applied_profile is not None and self.applied_profile.sub_vocab_fraction is not None:
                self.plots.name_settings(fitted, self.applied_profile.name)
            self.knobs.set_settings(fitted)

    def _on_run_started(self, started: RunStarted) -> None:
        self.output.begin_run(f"run {started.run_id} · {started.label} · {settings_summary(started.settings)}")
        self.state_label.setText(f"Running {started.label}…")

    def _on_rounds(self, updates: list[Any]) -> None:
        # Called for each batch the worker emits (at most ~30 per second): store, don't draw.
        self.plots.add_rounds(updates)
        self.output.add_rounds(updates)
        settings = updates[-1].event.settings
        if settings != self.applied_settings:
            self.applied_settings = settings
            self.knobs.show_applied(settings)

    def _draw_granted_frame(self) -> None:
        # The engine thread waits between two rounds until release(), however this goes: the
        # frame (if one is due) and whatever else waits on the paint queue are painted a piece
        # per turn of the event loop, so the window answers input and timers between pieces.
        def frame() -> None:
            if self.plots.frame_wanted:
                self.plots.frame_wanted = False
                self.plots.update_frame()
                self.plots.paint_frame_in_pieces()
            self.output.flush()

        try:
            paint_queue().run_granted(done=self._granted_frame_painted, work=frame, owner=self)
        except BaseException:
            self.worker.frame_gate.release()
            raise

    def _granted_frame_painted(self) -> None:
        try:
            self.output.paint_now()
        finally:
            self.worker.frame_gate.release()

    def _on_run_finished(self, finished: RunFinished) -> None:
        if finished.stats:
            self.last_run = finished
            fallbacks = finished.stats.get("fallbacks") or {}
            if fallbacks and fallbacks != self._fallbacks_shown:  # said once per new set, not every run
                self._fallbacks_shown = dict(fallbacks)
                ops = ", ".join(f"{op} ({n})" for op, n in sorted(fallbacks.items()))
                self.show_message(f"On the GPU, these ops ran as their slower PyTorch references: {ops}")
        repeat = (
            self.run_panel.repeat.isChecked()
            and not self._stopping
            and finished.stop_reason in ("length", "eos")
            and self._last_request is not None
        )
        if repeat:  # same workload again; the worker runs it with the latest settings and sampling
            self._last_request = dataclasses.replace(self._last_request, sampling=self.sampling_panel.sampling())
            self.worker.load_and_run(self._last_request)
        else:
            self.state = "idle"
            self.plots.recording = False
            self.plots.mark_stop()
            self.run_panel.set_running(False)
            self._update_bench_button()
            stats = finished.stats or {}
            if finished.stop_reason == "error":
                self.state_label.setText("Run failed (see the message above)")
            elif stats:
                self.state_label.setText(
                    f"Run {finished.stop_reason}: {stats.get('generated', 0)} tokens, "
                    f"{stats.get('tokens_per_second', 0):.1f} tok/s, acceptance "
                    f"{stats.get('acceptance_rate', 0):.0%}, "
                    f"{stats.get('mean_accepted_length', 0):.2f} tokens/round"
                )
            else:
                self.state_label.setText("Stopped")
        self.run_finished.emit(finished)

    # ------------------------------------------------------------------ knobs and profiles

    def _on_knobs_changed(self, settings: EngineSettings) -> None:
        self.applied_profile = None  # a knob turned by hand: the profile no longer applies
        if self.remember:
            self.qsettings.setValue("run/profile", "")
        self.worker.set_settings(settings)
        self._after_settings_change()

    def _after_settings_change(self) -> None:
        self.knobs.show_applied(self.applied_settings if self.state == "running" else None)
        if self.remember:
            self._save_timer.start()

    def apply_profile(self, profile: Profile) -> None:
        if profile.settings.synthetic:  # a bench profile: its synthetic rates apply on the Bench tab only
            profile = dataclasses.replace(profile, settings=profile.settings.replace(synthetic_rates=()))
            self.show_message("The profile's synthetic acceptance rates apply only on the Bench tab; its knobs applied")
        vocab = self.model_info["vocab_size"] if self.model_info else None
        settings = profile.settings_for(vocab) if vocab else profile.settings
        self.plots.name_settings(settings, profile.name)
        self.knobs.set_settings(settings)
        if profile.sampling is not None:
            self.sampling_panel.set_sampling(profile.sampling)
        self.applied_profile = profile
        self.worker.set_settings(profile.settings, profile.sub_vocab_fraction)
        self._after_settings_change()
        self.profile_combo.setCurrentText(profile.name)
        if self.remember:
            self.qsettings.setValue("run/profile", profile.name)

    def _on_quick_profile(self, index: int) -> None:
        profile = next((p for p in self.profiles_tab.profiles if p.name == self.profile_combo.itemText(index)), None)
        if profile is not None:
            self.apply_profile(profile)
            self.show_message(f"Applied profile {profile.name!r}")

    def _on_profiles_changed(self) -> None:
        profiles = self.profiles_tab.profiles
        current = self.profile_combo.currentText()
        self.profile_combo.blockSignals(True)
        self.profile_combo.clear()
        self.profile_combo.addItems([p.name for p in profiles])
        self.profile_combo.setCurrentIndex(self.profile_combo.findText(current))
        self.profile_combo.blockSignals(False)
        self.bench_tab.set_profiles(profiles)

    def current_figures(self) -> dict[str, Any]:
        """The figures stored with a profile saved now: the latest bench arm run with exactly
        these settings, else the latest run's cumulative stats."""
        settings = self.knobs.settings()
        report = self.bench_tab.report
        if report is not None:
            for arm in report.arms:
                if arm.settings == settings:
                    return self.bench_tab.figures_for(arm.name, self.model_info)
        if self.last_run is not None and self.last_run.stats:
            return figures_from_stats(self.last_run.stats, "live run", self.model_info)
        return {}

    def _update_knob_context(self) -> None:
        key = self.model_key()
        if self.model_info and self.worker.loaded_key == key:
            devices = self.model_info.get("devices") or [self.model_info.get("device", "cpu")]
            device = str(devices[0]).split(":")[0]
            self.knobs.set_context(device, len(devices), self.model_info.get("vocab_size"))
        else:  # chosen, not loaded yet: judge by the choice
            device = key.devices[0].split(":")[0]
            vocab = self.model_info.get("vocab_size") if self.model_info else None
            self.knobs.set_context(device, len(key.devices), vocab)

    def _on_model_choice_changed(self) -> None:
        self._update_knob_context()

    # ------------------------------------------------------------------ bench

    def start_bench(self, spec: tuple[list[tuple[str, Profile]], list[str], int, int]) -> None:
        if self.state != "idle":
            self.show_message("Stop the run before starting a bench")
            self.bench_tab.set_running(False)
            return
        arms, workloads, rounds, max_new_tokens = spec
        self.clear_error()
        self.state = "bench"
        self._stopping = False
        self.run_panel.set_running(True)
        self._update_bench_button()
        synthetic = [(name, p.settings.synthetic_rates) for name, p in arms if p.settings.synthetic]
        if synthetic:
            from app.bench import SYNTHETIC_BANNER, rates_text

            rates = "; ".join(f"{name}: rates {rates_text(r)}" for name, r in synthetic)
            self.synthetic_banner.setText(f"{SYNTHETIC_BANNER} ({rates})")
            self.synthetic_banner.show()
        self.state_label.setText("Bench running (synthetic acceptance)…" if synthetic else "Bench running…")
        self.worker.bench(BenchRequest(self.model_key(), arms, workloads, rounds, max_new_tokens))

    def _on_bench_finished(self, report: Any) -> None:
        self.state = "idle"
        self.synthetic_banner.hide()
        self.run_panel.set_running(False)
        self.bench_tab.on_finished(report)
        self._update_bench_button()
        self.state_label.setText("Bench done" if report is not None else "Bench stopped")
        if report is None or not self.bench_tab.record_figures.isChecked() or report.synthetic:
            return  # a synthetic bench's figures are no profile's real speed
        # Arms are named after their profiles (a profile benched against itself gets "(A)" /
        # "(B)" appended, matches no profile, and so stores nothing).
        self.profiles_tab.record_bench(
            {arm.name: self.bench_tab.figures_for(arm.name, self.model_info) for arm in report.arms}
        )

    # ------------------------------------------------------------------ tune

    def start_tune(self, spec: tuple[list[str], float, int]) -> None:
        from app.gui.tune_panel import TuneRequest

        if self.state != "idle":
            self.show_message("Stop the run before starting a tune")
            return
        workloads, budget_s, max_new_tokens = spec
        self.clear_error()
        self.state = "tune"
        self.run_panel.set_running(True)
        self.bench_tab.run_button.setEnabled(False)
        self.tune_panel.set_running(True)
        self.state_label.setText("Tune running…")
        baseline = self.worker.settings or self.knobs.settings()
        self.tune_runner.start(TuneRequest(self.model_key(), baseline, workloads, budget_s, max_new_tokens))

    def _on_tune_finished(self, report: Any) -> None:
        """Save the winner as a profile (figures + hardware), keep the cells on screen, back to idle."""
        from app.tune import winner_profile

        self.state = "idle"
        self.run_panel.set_running(False)
        self.bench_tab.run_button.setEnabled(True)
        saved = None
        if report is not None and any(c.runs for c in report.cells):
            model = (self.model_info or {}).get("name", "model")
            name = self.store.unique_name(f"tuned {model} {time.strftime('%Y-%m-%d %H:%M')}")
            try:
                saved = self.store.save(winner_profile(report, name, model, list(self._gpu_names)))
            except Exception as exc:  # noqa: BLE001 - a read-only config folder: say so, keep the result
                self.show_error("tune", str(exc))
            else:
                self.profiles_tab.reload(select=saved.name)
        self.tune_panel.on_finished(report, saved)
        self.state_label.setText("Tune done" if report is not None and not report.cancelled else "Tune stopped")

    # ------------------------------------------------------------------ monitor

    def _on_sample(self, sample: MonitorSample) -> None:
        names = [gpu.name for gpu in sample.gpus]
        if names != self._gpu_names:
            self._gpu_names = names
            self.run_panel.set_devices(names)

    # ------------------------------------------------------------------ messages

    def show_error(self, context: str, message: str) -> None:
        what = {
            "load": "Could not load the model",
            "run": "The run failed",
            "bench": "The bench failed",
            "model": "Not a model folder",
            "overlay": "Cannot compare with that file",
        }.get(context, "Problem")
        self.last_error = f"{what}: {message}"
        self.error_label.setText(f"<b>{what}</b>: {html.escape(message, quote=False)}")
        self.error_banner.show()
        self.statusBar().showMessage(self.last_error, 10000)

    def clear_error(self) -> None:
        self.error_banner.hide()

    def show_message(self, text: str) -> None:
        self.statusBar().showMessage(text, 6000)

    # ------------------------------------------------------------------ export

    def _ask_save(self, title: str, name: str, kind: str) -> str:
        path, _ = QFileDialog.getSaveFileName(self, title, str(Path(self.export_dir) / name), kind)
        return path

    def _remember_export(self, path: str | Path) -> None:
        self.export_dir = str(Path(path).resolve().parent)
        if self.remember:
            self.qsettings.setValue("export/dir", self.export_dir)

    def export_plot_csv(self, path: str | None = None) -> list[Path]:
        if not path:
            path = self._ask_save("Export plot data", "specdeck-run.csv", "CSV (*.csv)")
            if not path:
                return []
        written = self.plots.export_csv(path)
        self._remember_export(path)
        self.show_message("Wrote " + ", ".join(str(p) for p in written))
        return written

    def export_plot_png(self, path: str | None = None) -> Path | None:
        if not path:
            path = self._ask_save("Export plots", "specdeck-plots.png", "PNG (*.png)")
            if not path:
                return None
        written = self.plots.export_png(path)
        self._remember_export(path)
        self.show_message(f"Wrote {written}")
        return written

    def load_overlay(self, path: str | None = None) -> bool:
        """Overlay an exported run (dashed) on the plots."""
        if not path:
            path, _ = QFileDialog.getOpenFileName(self, "Compare with an exported run", self.export_dir, "CSV (*.csv)")
            if not path:
                return False
        try:
            overlay = self.plots.load_overlay(path)
        except ValueError as exc:
            self.show_error("overlay", str(exc))
            return False
        self.show_message(f"Dashed lines: {overlay.name}")
        return True

    # ------------------------------------------------------------------ persistence

    def _restore_state(self) -> bool:
        """Every panel's state, then the window's own (size, layout, tab, export folder, active profile);
        returns whether a window geometry was restored. Nothing saved can stop the window opening."""
        if self._state_notice:
            self.show_message(self._state_notice)
        bad: list[str] = []
        restored: dict[str, dict] = {}
        for name, panel in self.panels.items():
            try:
                restored[name] = self._read_panel_state(name)
                bad += [f"{name}/{key}" for key in panel.restore_state(restored[name])]
            except Exception as exc:  # a store that cannot be read at all: that panel keeps its defaults
                self.show_message(f"{name} state not restored ({type(exc).__name__}: {exc}); using defaults")
        last_used = self.knobs.settings() if restored.get("knobs") else None
        if last_used is not None:
            self.worker.set_settings(last_used)
        try:
            geometry = self._restore_window_state(last_used, bad)
        except Exception as exc:  # a hand-edited or damaged window.ini: ignored, the window opens anyway
            self.show_message(f"window state not restored (window.ini: {type(exc).__name__}: {exc}); using defaults")
            return False
        if bad:
            self.show_message(f"window state: ignored bad value(s) for {', '.join(bad)}")
        return geometry

    def _read_panel_state(self, name: str) -> dict[str, Any]:
        """A panel's saved state as stored (untrusted: the panel checks every value)."""
        if name in LAST_USED_PANELS:
            settings, problem = load_last_used()
            if problem:
                self.show_message(problem)
            return settings.to_dict() if settings is not None else {}
        q = self.qsettings
        q.beginGroup(name)
        try:
            return {key: q.value(key) for key in q.childKeys()}
        finally:
            q.endGroup()

    def _save_panel(self, name: str) -> None:
        state = self.panels[name].save_state()
        if name in LAST_USED_PANELS:
            try:
                save_last_used(EngineSettings.from_dict(state))
            except OSError as exc:
                self.show_message(f"Could not save the last used settings: {exc}")
            return
        for key, value in state.items():
            self.qsettings.setValue(f"{name}/{key}", value)

    def _restore_window_state(self, last_used: EngineSettings | None, bad: list[str]) -> bool:
        q = self.qsettings

        def text(key: str, default: str) -> str:
            value = q.value(key, default)
            if isinstance(value, str) and len(value) <= 1_000_000:
                return value
            bad.append(key)
            return default

        geometry = q.value("window/geometry")
        restored = False
        if isinstance(geometry, (QByteArray, bytes)):
            restored = bool(self.restoreGeometry(geometry))
        elif geometry is not None:
            bad.append("window/geometry")
        for key, restore in (
            ("window/state", self.restoreState),
            ("window/splitter", self.centralWidget().restoreState),
        ):
            value = q.value(key)
            if isinstance(value, (QByteArray, bytes)):
                restore(value)
            elif value is not None:
                bad.append(key)
        self.export_dir = text("export/dir", self.export_dir) or self.export_dir
        tab = q.value("window/tab")
        if tab is not None and str(tab).isdigit() and int(tab) < self.tabs.count():
            self.tabs.setCurrentIndex(int(tab))
        profile_name = text("run/profile", "")
        profile = next((p for p in self.profiles_tab.profiles if p.name == profile_name), None)
        if profile is not None:  # the active profile, as it was when the window closed
            self.profile_combo.setCurrentText(profile.name)
            self.applied_profile = profile
            self.worker.set_settings(profile.settings, profile.sub_vocab_fraction)
            self.knobs.set_settings(profile.settings if last_used is None else last_used)  # fitted to the vocabulary
        return restored

    def _save_state(self) -> None:
        for name in self.panels:
            self._save_panel(name)
        q = self.qsettings
        q.setValue("window/geometry", self.saveGeometry())
        q.setValue("window/state", self.saveState())
        q.setValue("window/splitter", self.centralWidget().saveState())
        q.setValue("window/tab", self.tabs.currentIndex())
        q.sync()

    def shutdown(self) -> None:
        """Stop the threads (idempotent). closeEvent calls it; tests call it directly too."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        try:  # the application outlives the window: no signal of its own may reach a closed one
            from PySide6.QtGui import QGuiApplication

            QGuiApplication.styleHints().colorSchemeChanged.disconnect(self._on_system_scheme_changed)
        except (AttributeError, RuntimeError, TypeError):
            pass
        if self.remember:
            self._save_state()
        self.tune_runner.cancel()
        self.worker.shutdown()
        self.sampler.stop()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        self.shutdown()
        super().closeEvent(event)
