"""The engine: load a model once, hold sessions, and generate / stream with live settings."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels import ops as kernel_ops
from kernels.ops import cuda_enabled as ops_use_cuda

from .config import ModelConfig
from .errors import EngineError, ModelLoadError
from .gemm import check_mode as check_gemm
from .loader import DTYPES, load_weights
from .model import Model
from .plans import PlanPool
from .settings import MAX_DRAFT_DEPTH, EngineSettings
from .spec import check_fits, prefill, run_round
from .state import Session
from .stats import RoundEvent, RunStats
from .tokenizer import Tokenizer
from .untrusted import one_line

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MEMORY_KEYS = ("weights", "kv_cache", "snapshot_planes", "graph_pools", "workspace")


def bundled_model_dir() -> Path:
    """The small model shipped in assets/models (the first directory there with a config.json)."""
    models = ASSETS / "models"
    for candidate in sorted(models.glob("*/config.json")) if models.is_dir() else []:
        return candidate.parent
    raise ModelLoadError(f"{models}: no bundled model found; pass a model directory (--model DIR)")


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    stats: dict[str, Any] = field(default_factory=dict)


def _parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise EngineError(f"device {device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise EngineError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) found")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise EngineError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    return dev


class ArgumentTypeError(EngineError, TypeError):
    """An argument of the wrong type (a TypeError that is also an EngineError, so callers that catch either
    see it). The message names the parameter."""


MAX_CHARS_PER_TOKEN = 1024  # a prompt longer than this many characters per context token cannot fit


def _type_name(value: Any) -> str:
    return type(value).__name__ if not isinstance(value, bool) else f"a bool ({value})"


class _Stream:
    """The iterator `stream()` returns. The session is locked when stream() returns and unlocked when the run
    ends; a stream dropped (or closed) before its first round never ran the generator, whose `finally` would
    unlock it, so this object unlocks it instead."""

    def __init__(self, gen: Iterator[RoundEvent], lock) -> None:
        self._gen = gen
        self._lock = lock
        self._pending = True  # the lock is ours to release until the generator starts

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> RoundEvent:
        self._pending = False  # the generator's try/finally owns the lock from its first step
        return next(self._gen)

    def close(self) -> None:
        if self._pending:
            self._pending = False
            self._lock.release()
        self._gen.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _StreamText:
    """Incremental detokenisation with a bounded cost per round: decode the tokens since the last line
    break and emit what was not shown yet (decoders may merge bytes or spaces across tokens, so pieces
    are never decoded alone); an incomplete UTF-8 sequence waits for the token that completes it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.line: list[int] = []
        self.shown = 0

    def add(self, tokens: list[int]) -> str:
        self.line.extend(tokens)
        full = self.tokenizer.decode(self.line)
        if full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        text = full[self.shown :]
        self.shown = len(full)
        if full.endswith("\n"):
            self.line, self.shown = [], 0
        return text


def _enable_kernels(dev: torch.device) -> str:
    """CUDA devices use the CuPy kernels; without CuPy (or with the wrong CUDA major) fall back to the
    PyTorch references with a one-line notice on stderr."""
    if dev.type != "cuda":
        return "PyTorch reference ops (CPU)"
    if kernel_ops.cuda_enabled():
        return "CUDA kernels"
    ok, reason = kernel_ops.use_cuda_kernels(True)
    if not ok:
        print(f"specdeck: notice: {reason}; using the PyTorch reference ops (slower)", file=sys.stderr)
        return f"PyTorch reference ops ({reason})"
    return "CUDA kernels"


class Engine:
    """A loaded model. Use `Engine.load(...)`; the rest of this class is the public API."""

    def __init__(self, model: Model, tokenizer: Tokenizer, model_dir: Path, max_context: int) -> None:
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_context = max_context
        self.n_planes = MAX_DRAFT_DEPTH + 2
        self._default_session: Session | None = None

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_context: int = 4096,
        devices: list[str] | None = None,
        gemm: str = "cublas",
    ) -> Engine:
        """Load a model directory. `devices` (e.g. ["cuda:0", "cuda:1"], or ["cpu", "cpu"] to test the split
        on one machine) splits the model tensor-parallel across them; otherwise it runs on `device`.
        `gemm`: "cublas", or "autotune" (one-token products through torch.compile's max-autotune, for large
        models on CUDA; see engine/gemm.py)."""
        if model_dir is not None and not isinstance(model_dir, (str, os.PathLike)):
            raise ArgumentTypeError(f"model_dir must be a path (str or Path), got {_type_name(model_dir)}")
        for name, value in (("device", device), ("dtype", dtype), ("gemm", gemm)):
            if not isinstance(value, str):
                raise ArgumentTypeError(f"{name} must be a string, got {_type_name(value)}")
        if devices is not None and (
            not isinstance(devices, (list, tuple)) or not all(isinstance(d, str) for d in devices)
        ):
            raise ArgumentTypeError(f"devices must be a list of device names (str), got {_type_name(devices)}")
        if isinstance(max_context, bool):
            raise ArgumentTypeError("max_context must be an integer, got a bool")
        path = bundled_model_dir() if model_dir is None else Path(model_dir).expanduser()
        try:
            os.lstat(path)
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: model directory does not exist") from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{ascii(str(path))[1:-1]}: not a usable path ({one_line(exc)})") from None
        if not path.exists():
            raise ModelLoadError(f"{path}: model directory does not exist (a broken link)")
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a directory; pass a Hugging Face model directory")
        try:
            empty = not any(path.iterdir())
        except OSError as exc:
            raise ModelLoadError(f"{path}: model directory cannot be read ({exc.strerror or exc})") from None
        if empty:
            raise ModelLoadError(f"{path}: directory is empty; it needs config.json, *.safetensors, tokenizer.json")
        if dtype not in DTYPES:
            raise EngineError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        if not isinstance(max_context, int) or max_context < 16:
            raise EngineError(f"max_context must be an integer >= 16, got {max_context!r}")
        devs = [_parse_device(d) for d in devices] if devices else [_parse_device(device)]
        dev = devs[0]
        for d in devs:
            check_gemm(gemm, d)
        cfg = ModelConfig.from_file(path / "config.json")
        tokenizer = Tokenizer(path, cfg.eos_token_ids)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(
                f"{path / 'tokenizer.json'}: tokenizer has {tokenizer.vocab_size} tokens, more than the "
                f"model's vocab_size {cfg.vocab_size}"
            )
        several_gpus = len({str(d) for d in devs}) > 1
        try:
            weights, has_mtp = load_weights(path, cfg, torch.device("cpu") if several_gpus else dev, DTYPES[dtype])
        except torch.OutOfMemoryError:
            raise EngineError(
                f"{path}: the model does not fit in {dev}'s free memory; use a smaller dtype or another device"
            ) from None
        return cls.from_weights(cfg, weights, has_mtp, tokenizer, path, max_context, devs, gemm)

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        has_mtp: bool,
        tokenizer,
        model_dir: Path,
        max_context: int,
        devices: list[torch.device],
        gemm: str = "cublas",
    ) -> Engine:
        """An engine over weights already in memory (as `load_weights` returns them, or built in memory by a
        benchmark): split tensor-parallel when several devices are given, CUDA kernels enabled when there."""
        notice = _enable_kernels(devices[0])
        if len(devices) > 1:
            from .tp import TPModel

            model = TPModel(cfg, weights, has_mtp, devices)
        else:
            model = Model(cfg, weights, has_mtp)
        model.set_gemm(gemm)
        eng = cls(model, tokenizer, model_dir, max_context)
        eng.kernel_notice = notice
        return eng

    # ---- information ----------------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        params = self.model.parameter_count
        return {
            "name": self.model_dir.name,
            "model_dir": str(self.model_dir),
            "vocab_size": self.cfg.vocab_size,
            "hidden_size": self.cfg.hidden_size,
            "layers": self.cfg.num_layers,
            "layer_types": list(self.cfg.layer_types),
            "has_mtp": self.model.has_mtp,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).replace("torch.", ""),
            "gemm": self.model.gemm,
            "parameters": params,
            "max_context": self.max_context,
            "devices": self.model.device_names,
            "kernels": getattr(self, "kernel_notice", ""),
        }

    def memory(self) -> dict[str, int]:
        """Bytes per component, all devices together, counted from the tensors the engine holds.

        Cached: recounted only when what it depends on changes (sessions, plan pools, mirroring)."""
        sessions = self._sessions()
        key = (len(sessions), sum(s.plans.pool_bytes for s in sessions), self.model.plan_tag)
        cached = getattr(self, "_memory_cache", None)
        if cached is not None and cached[0] == key:
            return dict(cached[1])
        total: dict[str, int] = {}
        for per_device in self.memory_by_device().values():
            for name, value in per_device.items():
                total[name] = total.get(name, 0) + value
        self._memory_cache = (key, total)
        return dict(total)

    def memory_by_device(self) -> dict[str, dict[str, int]]:
        """Bytes per device and component: weights, kv_cache, snapshot_planes, graph_pools, workspace."""
        out: dict[str, dict[str, int]] = {}
        seen: set[int] = set()

        def add(tensors: list[torch.Tensor], key: str) -> None:
            for t in tensors:
                if t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                entry = out.setdefault(str(t.device), dict.fromkeys(MEMORY_KEYS, 0))
                entry[key] += t.numel() * t.element_size()

        for tensors in self.model.weight_tensors().values():
            add(tensors, "weights")
        for sess in self._sessions():
            for key, tensors in sess.state.buffers().items():
                add(tensors, key)
            if sess.plans.pool_bytes:
                entry = out.setdefault(str(self.model.device), dict.fromkeys(MEMORY_KEYS, 0))
                entry["graph_pools"] += sess.plans.pool_bytes
        return out

    def check_settings(self, settings: EngineSettings) -> None:
        """Raise EngineError when valid settings still do not fit this model."""
        check_fits(self.model, settings)

    # ---- sessions -------------------------------------------------------------------------------
    def new_session(self, settings: EngineSettings | None = None) -> Session:
        try:
            state = self.model.new_state(self.max_context, self.n_planes)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc):
                raise
            raise EngineError(
                f"not enough memory on {self.model.device} for a session of max_context {self.max_context} "
                "(KV cache, snapshot planes); load with a smaller max_context"
            ) from None
        plans = PlanPool(self.model.device, capturable=ops_use_cuda() and self.model.capturable)
        sess = Session(state, plans, settings)
        self._live_sessions.add(sess)
        return sess

    @property
    def _live_sessions(self) -> weakref.WeakSet:
        """Sessions still referenced somewhere: a session dropped by its owner frees its buffers."""
        if not hasattr(self, "_session_set"):
            self._session_set: weakref.WeakSet = weakref.WeakSet()
        return self._session_set

    def _sessions(self) -> list[Session]:
        return list(self._live_sessions)

    @property
    def default_session(self) -> Session:
        if self._default_session is None:
            self._default_session = self.new_session()
        return self._default_session

    # ---- decoding -------------------------------------------------------------------------------
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Target logits [T, vocab] for a fresh sequence; leaves no state behind."""
        ids = self._check_ids(list(token_ids), 0)
        state = self.model.new_state(len(ids) + 1, self.n_planes)
        with torch.inference_mode():
            return self.model.lm_head(self.model.forward(torch.tensor(ids, device=self.model.device), state)).float()

    def _check_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        if not ids:
            raise EngineError("the prompt is empty; give at least one token of text")
        if len(ids) + max_new_tokens > self.max_context:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                f"{self.max_context} tokens; shorten the prompt or load with a larger max_context"
            )
        vocab = self.cfg.vocab_size
        at = next((i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < vocab), None)
        if at is not None:
            bad = ids[at]
            if isinstance(bad, int) and not isinstance(bad, bool):
                raise EngineError(f"token id {bad!r} (prompt position {at}) is out of range 0..{vocab - 1}")
            raise ArgumentTypeError(f"prompt token ids must be integers, got {_type_name(bad)} at position {at}")
        return ids

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        settings: EngineSettings | None = None,
        session: Session | None = None,
    ) -> GenerateResult:
        tokens: list[int] = []
        stats: dict[str, Any] = {}
        for ev in self.stream(prompt, max_new_tokens, settings, session):
            tokens.extend(ev.tokens)
            stats = ev.run
        return GenerateResult(tokens, self.tokenizer.decode(tokens), stats)

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        settings: EngineSettings | None = None,
        session: Session | None = None,
    ) -> Iterator[RoundEvent]:
        """Yield one RoundEvent per round. `session.settings` is re-read at every round boundary.

        A stream that is dropped, or closed, before its first round releases the session."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ArgumentTypeError(f"max_new_tokens must be an integer, got {_type_name(max_new_tokens)}")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if settings is not None and not isinstance(settings, EngineSettings):
            raise ArgumentTypeError(
                f"settings must be an EngineSettings, got {_type_name(settings)}"
                + (" (use EngineSettings.from_dict(...) for a dict)" if isinstance(settings, dict) else "")
            )
        if session is not None and not isinstance(session, Session):
            raise ArgumentTypeError(f"session must be a Session from new_session(), got {_type_name(session)}")
        sess = session or self.default_session
        ids = self._check_ids(self._prompt_ids(prompt, max_new_tokens), max_new_tokens)
        if settings is not None:
            self.check_settings(settings)
            sess.settings = settings
        if not sess.busy.acquire(blocking=False):
            raise EngineError("this session is already generating; cancel it or use another session")
        sess._clear_cancel()  # here, not in the generator: a cancel right after stream() returns counts
        return _Stream(self._run(sess, ids, max_new_tokens), sess.busy)

    def _prompt_ids(self, prompt: Any, max_new_tokens: int) -> list[int]:
        """Token ids of a prompt (text or ids); a wrong type is a TypeError naming `prompt`, text that is not
        valid Unicode an EngineError naming the character's position."""
        if isinstance(prompt, str):
            if len(prompt) > MAX_CHARS_PER_TOKEN * self.max_context:
                raise EngineError(
                    f"the prompt is {len(prompt)} characters, far more than the context of {self.max_context} "
                    "tokens holds; shorten it"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EngineError(
                    f"the prompt is not valid Unicode at character {exc.start} (U+{ord(prompt[exc.start]):04X}, "
                    "a lone surrogate: text decoded from bytes that were not UTF-8?); fix or remove that character"
                ) from None
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ArgumentTypeError(f"prompt must be text (str) or a list of token ids, got {_type_name(prompt)}")

    def _run(self, sess: Session, ids: list[int], max_new_tokens: int) -> Iterator[RoundEvent]:
        try:
            state = sess.state
            if ids[: len(state.tokens)] != state.tokens or len(ids) < len(state.tokens) or not state.tokens:
                state.reset()
            state.tokens = list(ids)
            stats = RunStats()
            t0 = time.perf_counter()
            with self._run_failures(state), torch.inference_mode():
                stats.prefill_tokens = prefill(self.model, state)
            stats.prefill_s = time.perf_counter() - t0
            generated: list[int] = []
            stream_text = _StreamText(self.tokenizer)
            index = 0
            while True:
                if sess.cancelled:
                    stats.stop_reason = "cancelled"
                    yield self._final_event(index, sess.settings, stats)
                    return
                settings = sess.settings
                t_start = time.perf_counter()
                with self._run_failures(state), torch.inference_mode():
                    out = run_round(
                        self.model,
                        state,
                        sess.plans,
                        settings,
                        max_new_tokens - len(generated),
                        self.tokenizer.eos_token_ids,
                        lambda: sess.cancelled,
                        sess.test_drafter,
                    )
                if out.cancelled:
                    stats.stop_reason = "cancelled"
                    yield self._final_event(index, settings, stats)
                    return
                t_host = time.perf_counter()
                generated.extend(out.tokens)
                text = stream_text.add(out.tokens)
                done = out.hit_eos or len(generated) >= max_new_tokens
                t_end = time.perf_counter()
                ev = RoundEvent(
                    index=index,
                    tokens=out.tokens,
                    text=text,
                    from_draft=out.from_draft,
                    drafted=out.drafted,
                    accepted=out.accepted,
                    settings=settings,
                    time_draft_s=out.time_draft_s,
                    time_verify_s=out.time_verify_s,
                    time_accept_s=out.time_accept_s,
                    time_host_s=(t_end - t_host)
                    + max(0.0, (t_host - t_start) - out.time_draft_s - out.time_verify_s - out.time_accept_s),
                    time_round_s=t_end - t_start,
                    plan_hits=out.plan_hits,
                    plan_misses=out.plan_misses,
                    plan_capture_s=out.plan_capture_s,
                )
                stats.add(ev)
                if done:
                    stats.stop_reason = "eos" if out.hit_eos else "length"
                    ev.done, ev.stop_reason = True, stats.stop_reason
                ev.run = stats.as_dict(self.memory())
                index += 1
                yield ev
                if done:
                    return
        finally:
            sess.busy.release()

    @contextlib.contextmanager
    def _run_failures(self, state):
        """A failure inside the engine stops this run only: the session keeps its committed text and
        re-prefills on its next use; the caller gets one EngineError saying what happened."""
        try:
            yield
        except EngineError:  # settings that do not fit: raised before the round touched state
            raise
        except torch.OutOfMemoryError:
            state.forget_computed()
            raise EngineError(
                f"out of memory on {self.model.device} during the run; it was stopped and the session "
                "kept its text (use a shorter context, a smaller depth or another device)"
            ) from None
        except Exception as exc:
            state.forget_computed()
            raise EngineError(
                f"the run failed inside the engine ({type(exc).__name__}: {exc}); it was stopped and "
                "the session kept its text"
            ) from exc

    def _final_event(self, index: int, settings: EngineSettings, stats: RunStats) -> RoundEvent:
        ev = RoundEvent(
            index, [], "", [], 0, 0, settings, 0.0, 0.0, 0.0, 0.0, 0.0, done=True, stop_reason=stats.stop_reason
        )
        ev.run = stats.as_dict(self.memory())
        return ev
