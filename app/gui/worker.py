"""The engine thread. Loads, runs and benches happen here, never on the GUI thread.

One EngineWorker owns one QThread and the loaded Engine. The GUI asks for work with plain method
calls (load_and_run, bench, stop, set_settings); the requests travel to the worker thread as
queued signals, so they run one after another there. Results come back as signals, which Qt
delivers on the GUI thread, where the handlers only store and draw:

    load_started(str)   a load began (message)
    loaded(object)      LoadedModel: info + the engine's memory breakdown
    started(object)     RunStarted: a run began (id, label, settings)
    round(object)       list[RoundUpdate]: the rounds since the last emit (about every
                        EMIT_INTERVAL_S, so fast rounds cannot flood the GUI's event queue)
    finished(object)    RunFinished: the run's cumulative stats and stop reason
    errored(str, str)   (what failed: "load" | "run" | "bench", one-line message)
    bench_progress(int, int, str), bench_finished(object)

Live settings do not go through the queue: set_settings() writes session.settings directly from
the GUI thread (the engine reads it at its next round boundary), and stop() calls
session.cancel(), so both act within one round even while the worker thread is busy.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

EMIT_INTERVAL_S = 0.1  # round batches to the GUI thread: each one wakes it and takes the GIL


@dataclass(frozen=True)
class ModelKey:
    """What to load: None model_dir = the bundled model. `device` may list several devices,
    comma-separated ("cuda:0,cuda:1"): the engine then splits the model tensor-parallel."""

    model_dir: str | None
    device: str = "cpu"
    dtype: str = "float32"
    gemm: str = "cublas"  # Engine.load's gemm: how decode-sized products run on a GPU

    @property
    def devices(self) -> list[str]:
        return [d.strip() for d in self.device.split(",") if d.strip()]


@dataclass
class LoadedModel:
    key: ModelKey
    info: dict[str, Any]
    memory: dict[str, int]
    load_s: float


@dataclass
class RunRequest:
    key: ModelKey
    workload: str | None  # a name from app.workloads, or None for `prompt`
    prompt: str  # the custom prompt (used when workload is None)
    max_new_tokens: int
    settings: Any  # EngineSettings, used only when set_settings() was never called
    label: str = ""
    sampling: Any = None  # SamplingParams, or None for greedy


@dataclass
class RunStarted:
    run_id: int
    label: str
    settings: Any


@dataclass
class RoundUpdate:
    event: Any  # engine.RoundEvent
    segments: list[tuple[str, bool]]  # the round's text as (text, from_draft) runs
    received_s: float  # time.monotonic() when the worker got it
    run_id: int


@dataclass
class RunFinished:
    run_id: int
    stats: dict[str, Any]
    stop_reason: str | None
    wall_s: float  # from the first round's request to the last event, as the user waited
    generated: int = 0


@dataclass
class BenchRequest:
    key: ModelKey
    arms: list[tuple[str, Any]]  # (arm name, app.profiles.Profile): scaled to the model here
    workloads: list[str]
    rounds: int
    max_new_tokens: int


def split_round_text(text: str, from_draft: list[bool], tokens: list[int], decode: Any) -> list[tuple[str, bool]]:
    """Split a round's text into (text, from_draft) runs.

    A round emits its accepted drafts first and then the target's bonus token, so the text is
    at most two runs. The bonus token is decoded alone to find where it starts; when that does
    not line up (a character split across tokens), the whole round is shown as the target's.
    """
    if not text:
        return []
    n_draft = sum(1 for flag in from_draft if flag)
    if n_draft == 0:
        return [(text, False)]
    if n_draft == len(from_draft):
        return [(text, True)]
    bonus_text = decode(tokens[n_draft:])
    if bonus_text and text.endswith(bonus_text) and len(bonus_text) < len(text):
        return [(text[: -len(bonus_text)], True), (bonus_text, False)]
    return [(text, False)]


class FrameGate:
    """Lets the window draw its plots while the engine thread waits between two rounds.

    Painting pyqtgraph plots calls from Qt into Python hundreds of times per frame, and each
    call needs the GIL. Drawn while a round runs, every one of those calls has to take the GIL
    from the engine thread, and the handovers cost the engine far more than the frame's own
    time (seen: 7-15% fewer tokens/s on the CPU at a few frames a second). So the window asks
    (request), the engine thread grants at its next round boundary (the worker's frame_granted
    signal) and waits, and the window releases it once the frame is painted. The engine then
    loses exactly the frame's time, and the window caps that share. Waits are bounded, so a
    window that never answers cannot stall the engine for long.
    """

    MAX_WAIT_S = 0.25

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._released = threading.Event()
        self.running = False  # a run is streaming: frames go through the gate

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self) -> None:  # GUI thread
        self._released.clear()
        self._requested.set()

    def release(self) -> None:  # GUI thread, once the frame is painted
        self._requested.clear()
        self._released.set()

    def wait_for_frame(self) -> None:  # engine thread, between rounds
        self._released.wait(self.MAX_WAIT_S)
        self._requested.clear()

    def set_running(self, running: bool) -> None:  # engine thread, at a run's start and end
        self.running = running
        if not running:
            self._requested.clear()  # the window draws directly again


class EngineWorker(QObject):
    load_started = Signal(str)
    loaded = Signal(object)
    started = Signal(object)
    round = Signal(object)
    finished = Signal(object)
    errored = Signal(str, str)
    bench_progress = Signal(int, int, str)
    bench_finished = Signal(object)
    frame_granted = Signal()  # the engine thread waits between rounds: draw now (FrameGate)

    _run_requested = Signal(object)
    _load_requested = Signal(object)
    _bench_requested = Signal(object)

    def __init__(self, workloads: dict[str, Any] | None = None) -> None:
        """workloads: the fixed workloads as the window loaded them (read here on first use when None)."""
        super().__init__()
        self.engine: Any = None  # touched only on the worker thread
        self.loaded_key: ModelKey | None = None
        self._session: Any = None
        self._settings_lock = threading.Lock()
        self._pending_settings: Any = None
        self._sub_vocab_fraction: float | None = None
        self._workloads = workloads
        self._stop = threading.Event()
        self.frame_gate = FrameGate()
        self._run_counter = 0
        self._thread = QThread()
        self._thread.setObjectName("specdeck-engine")
        self.moveToThread(self._thread)
        self._run_requested.connect(self._do_run)
        self._load_requested.connect(self._do_load)
        self._bench_requested.connect(self._do_bench)
        self._thread.start()

    # ------------------------------------------------------------------ called from the GUI thread

    def load(self, key: ModelKey) -> None:
        self._load_requested.emit(key)

    def load_and_run(self, request: RunRequest) -> None:
        """Load request.key if it is not the loaded model, then stream request.prompt with the
        latest settings given to set_settings()."""
        self._stop.clear()
        self._run_requested.emit(request)

    @property
    def settings(self) -> Any:
        """The settings the next round will use (as scaled to the loaded model)."""
        with self._settings_lock:
            return self._pending_settings

    def bench(self, request: BenchRequest) -> None:
        self._stop.clear()
        self._bench_requested.emit(request)

    def set_settings(self, settings: Any, sub_vocab_fraction: float | None = None) -> None:
        """Apply settings live: the running generation picks them up at its next round.

        sub_vocab_fraction (from a profile): sub_vocab is that share of the model's vocabulary.
        Either way the settings are fitted here to the loaded model, and again to each model loaded
        later before its first round (a sub_vocab larger than its vocabulary means all of it)."""
        with self._settings_lock:
            self._sub_vocab_fraction = sub_vocab_fraction
            if self.engine is not None:
                settings = _fitted(settings, sub_vocab_fraction, self.engine.info["vocab_size"])
            self._pending_settings = settings
            if self._session is not None:
                self._session.settings = settings

    def stop(self) -> None:
        """Stop the run or bench within one round. Safe to call at any time."""
        self._stop.set()
        with self._settings_lock:
            session = self._session
        if session is not None:
            session.cancel()

    def shutdown(self, timeout_ms: int = 5000) -> None:
        self.stop()
        self._thread.quit()
        self._thread.wait(timeout_ms)

    @property
    def thread(self) -> QThread:  # type: ignore[override]
        return self._thread

    # ------------------------------------------------------------------ on the worker thread

    def _ensure_loaded(self, key: ModelKey) -> bool:
        if self.engine is not None and self.loaded_key == key:
            return True
        from engine import Engine

        name = key.model_dir or "the bundled model"
        gemm = "" if key.gemm == "cublas" else f", GEMM {key.gemm}"
        self.load_started.emit(f"Loading {name} on {key.device} ({key.dtype}{gemm})…")
        # Drop the old model first so two never sit in memory together (reference counting
        # frees its tensors here; no gc.collect(): a full collection holds the GIL long enough
        # to stall the window).
        with self._settings_lock:
            self._session = None
        self.engine = None
        self.loaded_key = None
        if key.device == "cpu":
            leave_a_core_for_the_window()
        t0 = time.perf_counter()
        try:  # the load and the session on it (its buffers can be what does not fit)
            devices = key.devices
            engine = Engine.load(
                key.model_dir,
                device=devices[0],
                dtype=key.dtype,
                devices=devices if len(devices) > 1 else None,
                gemm=key.gemm,
            )
            session = engine.new_session()
            memory = dict(engine.memory())
        except Exception as exc:  # ModelLoadError, EngineError, or a bug: shown, never fatal
            self.errored.emit("load", _one_line(exc))
            return False
        self.engine = engine
        self.loaded_key = key
        with self._settings_lock:
            self._session = session
            if self._pending_settings is not None:
                self._pending_settings = _fitted(
                    self._pending_settings, self._sub_vocab_fraction, engine.info["vocab_size"]
                )
                session.settings = self._pending_settings
        self.loaded.emit(LoadedModel(key, dict(engine.info), memory, time.perf_counter() - t0))
        return True

    @Slot(object)
    def _do_load(self, key: ModelKey) -> None:
        self._ensure_loaded(key)

    @Slot(object)
    def _do_run(self, request: RunRequest) -> None:
        if self._stop.is_set() or not self._ensure_loaded(request.key):
            self.finished.emit(RunFinished(-1, {}, "cancelled", 0.0))
            return
        self._run_counter += 1
        run_id = self._run_counter
        engine, session = self.engine, self._session
        with self._settings_lock:
            settings = self._pending_settings or request.settings
        try:
            prompt = self._prompt_for(request)
        except Exception as exc:
            self.errored.emit("run", _one_line(exc))
            self.finished.emit(RunFinished(run_id, {}, "error", 0.0))
            return
        self.started.emit(RunStarted(run_id, request.label, settings))
        decode = engine.tokenizer.decode
        batch: list[RoundUpdate] = []
        last_emit = time.monotonic()
        stats: dict[str, Any] = {}
        stop_reason: str | None = None
        generated = 0
        t0 = time.perf_counter()
        events = None
        self.frame_gate.set_running(True)
        try:
            events = engine.stream(
                prompt, request.max_new_tokens, settings=settings, session=session, sampling=request.sampling
            )
            for ev in events:
                # stream() clears the session's cancel flag when it begins; a Stop pressed just
                # before that lives on in our own flag and is passed on here.
                if self._stop.is_set():
                    session.cancel()
                now = time.monotonic()
                generated += len(ev.tokens)
                if ev.tokens:  # the closing event of a cancelled run has none: not a round
                    batch.append(
                        RoundUpdate(ev, split_round_text(ev.text, ev.from_draft, ev.tokens, decode), now, run_id)
                    )
                gate_open = self.frame_gate.requested and not ev.done
                if batch and (ev.done or gate_open or now - last_emit >= EMIT_INTERVAL_S):
                    self.round.emit(batch)
                    batch = []
                    last_emit = now
                stats = ev.run
                stop_reason = ev.stop_reason
                if gate_open:  # the window wants to draw: wait here, between two rounds
                    self.frame_granted.emit()
                    self.frame_gate.wait_for_frame()
        except Exception as exc:
            self.frame_gate.set_running(False)
            if events is not None:
                events.close()  # releases the session's busy lock before the reset below
            if batch:
                self.round.emit(batch)
            self.errored.emit("run", _one_line(exc))
            self._recover_session()
            self.finished.emit(RunFinished(run_id, stats, "error", time.perf_counter() - t0, generated))
            return
        self.frame_gate.set_running(False)
        if batch:
            self.round.emit(batch)
        self.finished.emit(RunFinished(run_id, stats, stop_reason, time.perf_counter() - t0, generated))

    def _prompt_for(self, request: RunRequest) -> str:
        if request.workload is None:
            return request.prompt
        if self._workloads is None:
            from app.workloads import load_workloads

            self._workloads = load_workloads()
        # The workload's chat form when the model has a chat template, else its base prompt.
        return self._workloads[request.workload].prompt_for(self.engine.tokenizer)

    def _recover_session(self) -> None:
        # A round that raised may have left the KV / recurrent state half-written: start clean.
        try:
            self._session.reset()
        except Exception:
            traceback.print_exc()

    @Slot(object)
    def _do_bench(self, request: BenchRequest) -> None:
        if self._stop.is_set() or not self._ensure_loaded(request.key):
            self.bench_finished.emit(None)
            return
        try:
            from app.bench import BenchArm, run_bench

            vocab_size = self.engine.info["vocab_size"]
            arms = [
                BenchArm(name, profile.settings_for(vocab_size), profile.sampling) for name, profile in request.arms
            ]
            report = run_bench(
                self.engine,
                arms=arms,
                workloads=request.workloads,
                rounds=request.rounds,
                max_new_tokens=request.max_new_tokens,
                progress=lambda done, total, message: self.bench_progress.emit(done, total, message),
                should_stop=self._stop.is_set,
            )
        except Exception as exc:
            self.errored.emit("bench", _one_line(exc))
            self.bench_finished.emit(None)
            return
        self.bench_finished.emit(report)


def leave_a_core_for_the_window() -> None:
    import torch

    from app.threads import cpu_threads_for_the_engine

    threads = cpu_threads_for_the_engine()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _fitted(settings: Any, sub_vocab_fraction: float | None, vocab_size: int) -> Any:
    """The settings for a model of this vocabulary (EngineSettings.fitted_to, the one rule)."""
    return settings.fitted_to(vocab_size, sub_vocab_fraction)


def _one_line(exc: BaseException) -> str:
    from engine import EngineError

    if isinstance(exc, (EngineError, ValueError)):
        return str(exc)
    # Not an error the engine meant to raise: keep the traceback for a bug report.
    traceback.print_exception(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''} (an internal error; details on stderr)"
