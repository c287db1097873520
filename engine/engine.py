"""The engine: load a model once, hold sessions, and generate / stream with live settings."""

from __future__ import annotations

import contextlib
import itertools
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
from .sampling import SamplingParams, active
from .settings import MAX_DRAFT_DEPTH, EngineSettings
from .spec import (
    RoundOutcome,
    abandon_round,
    can_pipeline,
    check_fits,
    check_synthetic,
    finish_round,
    launch_round,
    prefill,
)
from .state import Session, session_bytes
from .stats import RoundEvent, RunStats
from .subvocab import SubVocabError, SubVocabOrder, check_ids, find_order, fix_hint
from .tokenizer import Tokenizer
from .untrusted import one_line
from .workers import (
    Cluster,
    LeaderRounds,
    build_model,
    init_group,
    leader_drafter,
    setup_collectives,
    split_note,
)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MEMORY_KEYS = ("weights", "kv_cache", "snapshot_planes", "graph_pools", "workspace")
DEFAULT_CONTEXT = 4096  # max_context when the model's config does not say its trained length
PARALLEL_DEFAULT_CONTEXT = 65536  # several devices: the cap of the default (ranks must agree before loading)


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
    """Incremental detokenisation with a bounded cost per round: decode a window of the latest tokens and emit what
    was not shown yet (decoders may merge bytes or spaces across tokens, so pieces are never decoded alone); an
    incomplete UTF-8 sequence waits for the token that completes it. The window starts again after a line break,
    and after WINDOW tokens of one line, keeping its last CONTEXT tokens as the new window's start (a line that
    never ends — a tiny model's text, a minified file — cost a decode of the whole line every round: 40 us a round
    by the end of 512 tokens of the bundled model, whose decode the host's time bounds)."""

    WINDOW = 64
    CONTEXT = 8

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.line: list[int] = []
        self.shown = 0  # characters of decode(line) already emitted

    def add(self, tokens: list[int]) -> str:
        self.line.extend(tokens)
        full = self.tokenizer.decode(self.line)
        complete = not full.endswith("\ufffd")
        if not complete:
            full = full.rstrip("\ufffd")
        text = full[self.shown :]
        self.shown = len(full)
        if full.endswith("\n"):
            self.line, self.shown = [], 0
        elif complete and len(self.line) > self.WINDOW:
            # everything is shown: the context tokens' own text is where the next round's new text starts
            self.line = self.line[-self.CONTEXT :]
            self.shown = len(self.tokenizer.decode(self.line))
        return text


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a new session on `device` (CUDA: the device's free memory; CPU: the system's
    available memory), or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def process_bytes(device: torch.device) -> int:
    """What this process holds on a GPU: PyTorch's reserved memory plus what lies outside PyTorch's
    allocator (CUDA context, cuBLAS and NCCL workspaces, symmetric-memory buffers), taken as the device's
    used memory less reserved memory at this count: exact when this process is the GPU's only user (one
    process per GPU, as the engine runs); other processes on the same GPU would be counted too."""
    free, total = torch.cuda.mem_get_info(device)
    return max(torch.cuda.memory_reserved(device), total - free)


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


class _NoText:
    """A worker rank's tokenizer: it never shows text; rank 0 sends the end-of-text ids with each run."""

    eos_token_ids: frozenset[int] = frozenset()

    def decode(self, ids: list[int]) -> str:
        return ""


class Engine:
    """A loaded model. Use `Engine.load(...)`; the rest of this class is the public API."""

    def __init__(self, model: Model, tokenizer: Tokenizer, model_dir: Path, max_context: int | None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.n_planes = MAX_DRAFT_DEPTH + 2
        self.context_note = f"max_context {max_context:,} (as asked)" if max_context else ""
        self.max_context = max_context if max_context else self._default_context()
        self._default_session: Session | None = None
        self.cluster: Cluster | None = None  # several devices: rank 0's handle on the worker ranks
        self.collectives: dict[str, Any] = {}
        self.kernel_notice = ""
        self._session_ids = itertools.count(1)
        self._memory_cache: tuple | None = None
        # Sessions still referenced somewhere: a session dropped by its owner frees its buffers.
        self._live_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.report = None  # a worker rank: sends its memory count to rank 0 after each round
        # Rank 0 queues the next round before it hands the current one's event over (see _run): None = on a
        # GPU (on the CPU a round's work is done when it is queued, nothing would overlap); True / False force it
        # (the tests run it on the CPU; `bench/gpu_bench.py --sections overlap` compares the two: on the H200
        # 1.11x target-only and 1.16x auto on the bundled model, bench/results/h200-overlap-2026-12-01.txt).
        self.overlap_rounds: bool | None = None
        # Where rounds overlap on one device, a round is queued behind the one before it before that one is read
        # (see _run: pipelined rounds): None / True / "all" = target-only rounds and chained-draft rounds (greedy
        # or sampled, static or adaptive depth; spec.can_pipeline); "target" = target-only rounds only; False =
        # queued only after the read (the overlap alone; `bench/gpu_bench.py --sections overlap` compares them).
        self.pipeline_rounds: bool | str | None = None
        # The draft's sub-vocabulary order (engine/subvocab.py): None = id order; the notice says why a model
        # folder's subvocab.json is not used.
        self.sub_vocab_order: SubVocabOrder | None = None
        self.sub_vocab_notice = ""

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_context: int | None = None,
        devices: list[str] | None = None,
        gemm: str = "cublas",
    ) -> Engine:
        """Load a model directory. `devices` (e.g. ["cuda:0", "cuda:1"], or ["cpu", "cpu"] to test the split
        on one machine) splits the model tensor-parallel across them; otherwise it runs on `device`.
        `gemm`: "cublas", "autotune" (one-token products through torch.compile's max-autotune), "cupy" (products
        of 1..17 rows through the CuPy gemv kernels) or "auto" (per shape the fastest of cuBLAS and the gemv
        kernels, measured at load and cached on disk: $SPECDECK_CACHE_DIR or the user cache folder); the three
        last need CUDA. See engine/gemm.py."""
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
        if max_context is not None and (not isinstance(max_context, int) or max_context < 16):
            raise EngineError(f"max_context must be an integer >= 16 (or None: the model's own), got {max_context!r}")
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
        if len(devs) > 1:
            # every rank must size its sessions alike: the trained length, at most PARALLEL_DEFAULT_CONTEXT
            asked = max_context is not None
            if not asked:
                max_context = max(16, min(cfg.max_position_embeddings or DEFAULT_CONTEXT, PARALLEL_DEFAULT_CONTEXT))
            eng = cls._load_parallel(("dir", str(path), dtype), tokenizer, path, max_context, devs, gemm)
            if not asked:
                eng.context_note = (
                    f"max_context {max_context:,} (the model's trained length, at most "
                    f"{PARALLEL_DEFAULT_CONTEXT:,} on several devices; pass max_context to choose)"
                )
        else:
            try:
                weights, has_mtp = load_weights(path, cfg, dev, DTYPES[dtype])
            except torch.OutOfMemoryError:
                raise EngineError(
                    f"{path}: the model does not fit in {dev}'s free memory; use a smaller dtype or another device"
                ) from None
            eng = cls.from_weights(cfg, weights, has_mtp, tokenizer, path, max_context, devs, gemm)
        eng._use_order_file(path)
        return eng

    def _use_order_file(self, model_dir: Path) -> None:
        """The model folder's subvocab.json, when there is one. A bad one (or one that does not fit in memory)
        is not used: one warning on stderr, kept in info["sub_vocab_order"]["notice"]; the draft scores ids
        in id order and the file is left as it is."""
        try:
            order = find_order(model_dir, self.cfg.vocab_size)
            if order is not None:
                self.set_sub_vocab_order(order.ids, order.source, order.path)
        except SubVocabError as exc:
            self.sub_vocab_notice = f"{one_line(exc)}; the draft scores ids in id order ({fix_hint(model_dir)})"
            print(f"specdeck: warning: {self.sub_vocab_notice}", file=sys.stderr)

    def set_sub_vocab_order(
        self, ids: list[int] | tuple[int, ...] | None, source: str = "", path: Path | None = None
    ) -> None:
        """Draft sub-vocabularies through this order of token ids (most useful first; None: id order), on
        every rank. The LM head's rows are gathered once here (K x hidden; see engine/subvocab.py); captured
        plans made before are not reused. SubVocabError for ids that are not distinct ids of the vocabulary,
        or that do not fit in memory (the engine keeps drafting in id order then)."""
        checked = None if ids is None else check_ids(ids, self.cfg.vocab_size, "sub-vocab order")
        try:
            self.set_model_option("sub_vocab_order", checked)
        except torch.OutOfMemoryError:
            self.set_model_option("sub_vocab_order", None)
            self.sub_vocab_order = None
            raise SubVocabError(
                f"{path or 'sub-vocab order'}: its {len(checked)} rows of the LM head do not fit in "
                f"{self.model.device}'s free memory; use a smaller order"
            ) from None
        self.sub_vocab_order = None if checked is None else SubVocabOrder(checked, source, path)
        self.sub_vocab_notice = ""

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
        """An engine over weights already in memory on one device (as `load_weights` returns them), CUDA
        kernels enabled when there. Several devices: `from_factory` (each rank builds its own shard)."""
        if len(devices) > 1:
            raise EngineError("from_weights takes one device; use Engine.from_factory for several")
        notice = _enable_kernels(devices[0])
        model = Model(cfg, weights, has_mtp)
        model.set_gemm(gemm)
        eng = cls(model, tokenizer, model_dir, max_context)
        eng.kernel_notice = notice
        return eng

    @classmethod
    def from_factory(
        cls,
        factory,
        args: tuple,
        tokenizer,
        model_dir: Path,
        max_context: int,
        devices: list[torch.device],
        gemm: str = "cublas",
    ) -> Engine:
        """An engine over a model that `factory(device, *args) -> (cfg, weights, has_mtp)` builds (a module-level
        function, so that worker processes can call it too): one device, or split over several."""
        if len(devices) > 1:
            return cls._load_parallel(("call", factory, args), tokenizer, model_dir, max_context, devices, gemm)
        cfg, weights, has_mtp = factory(devices[0], *args)
        return cls.from_weights(cfg, weights, has_mtp, tokenizer, model_dir, max_context, devices, gemm)

    @classmethod
    def _build_rank(cls, spec: dict, rank: int, devices: list[torch.device]) -> Engine:
        """One rank's engine (rank 0's, or a worker's): its shard of the model, its kernels, no tokenizer."""
        device = devices[rank]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        notice = _enable_kernels(device)
        model = build_model(spec["source"], rank, devices)
        model.set_gemm(spec["gemm"])
        eng = cls(model, _NoText(), Path(str(spec.get("model_dir", ""))), spec["max_context"])
        eng.kernel_notice = notice
        return eng

    @classmethod
    def _load_parallel(cls, source: tuple, tokenizer, model_dir: Path, max_context: int, devices, gemm) -> Engine:
        """Several devices: start one worker process per device after the first, load rank 0's shard here,
        join the process group, then set up the collectives (see engine/workers.py)."""
        kinds = {d.type for d in devices}
        if len(kinds) > 1:
            raise EngineError("devices must be all CUDA or all CPU, not a mix")
        if kinds == {"cuda"} and len({d.index for d in devices}) < len(devices):
            raise EngineError("each rank needs its own GPU; list every CUDA device once")
        spec = {"source": source, "max_context": max_context, "gemm": gemm, "model_dir": str(model_dir)}
        cluster = Cluster(devices, spec, torch.get_num_threads(), cls._build_rank)
        try:
            eng = cls._build_rank(spec, 0, devices)
            cluster.wait_for("loaded", 600)
            init_group(0, len(devices), cluster.port, devices[0], cluster.name_index)
            eng.collectives = setup_collectives(eng.model, allow_symmetric=cluster.allow_symmetric)
            cluster.wait_for("ready", 120)
        except torch.OutOfMemoryError:
            cluster.close("the load failed")
            raise EngineError(
                f"{model_dir}: the model's shard does not fit in {devices[0]}'s free memory; use a smaller dtype"
            ) from None
        except BaseException:
            cluster.close("the load failed")
            raise
        eng.tokenizer, eng.model_dir = tokenizer, model_dir
        eng.collectives["note"] = split_note(eng.model, eng.collectives)
        eng.cluster = cluster
        cluster.before_close = weakref.WeakMethod(eng.release_plans)
        eng.model.watch = cluster.check
        weakref.finalize(eng, cluster.close)
        return eng

    def set_model_option(self, name: str, value) -> None:
        """A model option that is not a user knob, on every rank (the bench's combine="gather")."""
        self.model.set_option(name, value)
        if self.cluster is not None:
            self.cluster.send("option", name, value)
        self._memory_cache = None

    def close(self) -> None:
        """Free the engine's worker processes and process group now (several devices; else nothing).
        Dropping the engine does the same. The sessions' captured plans (graphs that hold all-reduces on the
        group's communicator) are released and the device idle before the group is torn down."""
        if self.cluster is not None:
            self.cluster.close()  # which runs release_plans first (cluster.before_close)

    def release_plans(self) -> None:
        """Drop every live session's captured plans (they are captured again at next use), collect dropped
        sessions still held by reference cycles (their plans too), and wait for the device. NCCL's
        communicator cannot be destroyed while a graph that captured one of its collectives exists: its
        destroy waits for those graphs' references to go (pytorch/pytorch#115388)."""
        import gc

        for sess in self._sessions():
            sess.plans.clear()
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

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
            "gemm_choices": self.model.gemm_choices,  # gemm cupy/auto: {"4096x4096 m1": "tc1.w8.s1", ...}
            "gemm_notice": self.model.gemm_notice,
            "parameters": params,
            "max_context": self.max_context,
            "context_note": self.context_note,  # how max_context was chosen, in one line
            "devices": self.model.device_names,
            "kernels": self.kernel_notice,
            "collectives": self.collectives,
            "sub_vocab_order": {
                "size": self.model.remap_size,
                "source": self.sub_vocab_order.source if self.sub_vocab_order else "",
                "file": str(self.sub_vocab_order.path) if self.sub_vocab_order and self.sub_vocab_order.path else None,
                "notice": self.sub_vocab_notice,
            },
        }

    def memory(self) -> dict[str, int]:
        """Bytes per component, all devices together, counted from the tensors the engine holds.

        Cached: recounted only when what it depends on changes (sessions, plan pools, mirroring)."""
        return dict(self._memory_counts()[0])

    def _memory_counts(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        """(total per component, per device): cached, recounted only when what they depend on changes
        (sessions, plan pools, mirroring) — on several devices a recount asks every worker."""
        by_device = self.local_memory()
        if self.cluster is not None:
            by_device = by_device | self.cluster.reports()
        total = dict.fromkeys(MEMORY_KEYS, 0)
        for per_device in by_device.values():
            for name in MEMORY_KEYS:
                total[name] += per_device.get(name, 0)
        return total, by_device

    def local_memory(self) -> dict[str, dict[str, int]]:
        """This rank's `memory_by_device(local=True)`, recounted only when what it depends on changes
        (sessions, plan pools, mirroring): the same object is returned while nothing did."""
        sessions = self._sessions()
        key = (len(sessions), sum(s.plans.pool_bytes for s in sessions), self.model.plan_tag)
        key += (sum(s.state.sampling_buffers is not None for s in sessions),)
        if self._memory_cache is None or self._memory_cache[0] != key:
            self._memory_cache = (key, self.memory_by_device(local=True))
        return self._memory_cache[1]

    def memory_by_device(self, local: bool = False) -> dict[str, dict[str, int]]:
        """Bytes per device and component: weights, kv_cache, snapshot_planes, graph_pools, workspace; on
        several devices every rank's own count (`local`: this rank's only). A CUDA device also reports
        `process`, what this process holds there: PyTorch's reserved memory plus the CUDA context and
        communication buffers (comparable to NVML's per-process figure)."""
        out: dict[str, dict[str, int]] = {}
        seen: set[int] = set()
        label = self.model.device_names[self.model.group.rank]

        def add(tensors: list[torch.Tensor], key: str) -> None:
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                entry = out.setdefault(
                    label if t.device.type == self.model.device.type else str(t.device), dict.fromkeys(MEMORY_KEYS, 0)
                )
                entry[key] += storage.nbytes()

        for tensors in self.model.weight_tensors().values():
            add(tensors, "weights")
        for sess in self._sessions():
            for key, tensors in sess.state.buffers().items():
                add(tensors, key)
            if sess.state.sampling_buffers is not None:  # made at the first sampled round
                add(sess.state.sampling_buffers.tensors(), "workspace")
            if sess.plans.pool_bytes:
                entry = out.setdefault(label, dict.fromkeys(MEMORY_KEYS, 0))
                entry["graph_pools"] += sess.plans.pool_bytes
        if self.model.device.type == "cuda":
            out.setdefault(label, dict.fromkeys(MEMORY_KEYS, 0))["process"] = process_bytes(self.model.device)
        if self.cluster is not None and not local:
            out.update(self.cluster.reports())
        return out

    def check_settings(self, settings: EngineSettings) -> None:
        """Raise EngineError when valid settings still do not fit this model."""
        check_fits(self.model, settings)

    # ---- sessions -------------------------------------------------------------------------------
    def _default_context(self) -> int:
        """max_context when none was asked for: the model's trained length (config.json's
        max_position_embeddings, else DEFAULT_CONTEXT; at least 16) where a session of it takes at most a
        quarter of the device's free memory (the rest is for a second session, as the Bench tab and tune
        open one beside the window's, and for prefill and plans); else the longest multiple of 1024 that
        does. Says which in `context_note`."""
        cfg, dtype, planes, mtp = self.model.cfg, self.model.dtype, self.n_planes, self.model.has_mtp
        trained = max(16, cfg.max_position_embeddings or DEFAULT_CONTEXT)
        free = free_bytes(self.model.device)
        budget = None if free is None else free // 4

        def need(n: int) -> int:
            return sum(session_bytes(cfg, dtype, n, planes, mtp).values())

        if budget is None or need(trained) <= budget:
            source = "the model's trained length" if cfg.max_position_embeddings else "the default"
            self.context_note = f"max_context {trained:,} ({source})"
            return trained
        lo, hi = 1, trained // 1024  # in units of 1024 positions: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid * 1024) <= budget else (lo, mid - 1)
        n = max(16, lo * 1024 if need(lo * 1024) <= budget else min(trained, 1024))
        gib = 2**30
        self.context_note = (
            f"max_context {n:,} of the model's {trained:,}: a session of {trained:,} positions needs "
            f"{need(trained) / gib:,.1f} GiB and {free / gib:,.1f} GiB is free (pass max_context to choose)"
        )
        return n

    def _check_session_fits(self) -> None:
        need = session_bytes(self.model.cfg, self.model.dtype, self.max_context, self.n_planes, self.model.has_mtp)
        free = free_bytes(self.model.device)
        total = sum(need.values())
        if free is not None and total > free:
            gib = 2**30
            raise EngineError(
                f"not enough memory on {self.model.device} for a session of max_context {self.max_context}: it "
                f"needs {total / gib:,.1f} GiB (KV cache {need['kv_cache'] / gib:,.1f} GiB, snapshot planes "
                f"{need['snapshot_planes'] / gib:,.1f} GiB, hidden rows {need['workspace'] / gib:,.1f} GiB) and "
                f"{free / gib:,.1f} GiB is free; load with a smaller max_context"
            )

    def new_session(self, settings: EngineSettings | None = None, sid: int | None = None) -> Session:
        """A new independent conversation (on several devices: on every rank, under one id). A context that
        cannot fit in the device's free memory is refused before anything is allocated."""
        self._check_session_fits()
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
        sess.sid = next(self._session_ids) if sid is None else sid
        if self.cluster is not None:
            self.cluster.send("session", sess.sid)
            weakref.finalize(sess, self.cluster.drop_later, sess.sid)
        self._live_sessions.add(sess)
        return sess

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
        if self.cluster is not None:
            self.cluster.send("logits", ids)
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
        sampling: SamplingParams | None = None,
    ) -> GenerateResult:
        tokens: list[int] = []
        stats: dict[str, Any] = {}
        for ev in self.stream(prompt, max_new_tokens, settings, session, sampling=sampling):
            tokens.extend(ev.tokens)
            stats = ev.run
        return GenerateResult(tokens, self.tokenizer.decode(tokens), stats)

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        settings: EngineSettings | None = None,
        session: Session | None = None,
        sampling: SamplingParams | None = None,
    ) -> Iterator[RoundEvent]:
        """Yield one RoundEvent per round. `session.settings` is re-read at every round boundary (with
        overlapped rounds, see `overlap_rounds`, the boundary after the round already queued).
        `sampling`: None or temperature 0 = greedy; else tokens are drawn (speculative sampling keeps the
        target's distribution; see engine/sampling.py).

        A stream that is dropped, or closed, before its first round releases the session."""
        try:
            sampling = active(sampling)
        except TypeError as exc:
            raise ArgumentTypeError(str(exc)) from None
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
        check_synthetic(settings if settings is not None else sess.settings, sampling)
        if settings is not None:
            sess.settings = settings
        if not sess.busy.acquire(blocking=False):
            raise EngineError("this session is already generating; cancel it or use another session")
        sess._clear_cancel()  # here, not in the generator: a cancel right after stream() returns counts
        return _Stream(self._run(sess, ids, max_new_tokens, sampling=sampling), sess.busy)

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

    def _run(
        self,
        sess: Session,
        ids: list[int],
        max_new_tokens: int,
        rounds=None,
        reset: bool | None = None,
        drafter=None,
        sampling: SamplingParams | None = None,
    ) -> Iterator[RoundEvent]:
        """The round loop, the same on every rank. Rank 0 (`rounds` None) decides at each round boundary
        which settings apply and whether to stop, and tells the workers; a worker (`rounds` given) gets
        those decisions, and `reset` and `drafter`, from rank 0. `sampling` is sent to the workers with the
        run: every rank draws the same tokens from the same logits, seed and position."""
        leader = rounds is None
        if leader:
            drafter = sess.test_drafter
            rounds = LeaderRounds(sess, self.cluster)
        try:
            state = sess.state
            if reset is None:
                reset = ids[: len(state.tokens)] != state.tokens or len(ids) < len(state.tokens) or not state.tokens
            first_settings = sess.settings  # read once: the prefill's chunk must be the same on every rank
            if leader and self.cluster is not None:
                eos = self.tokenizer.eos_token_ids
                self.cluster.send(
                    "run", sess.sid, ids, max_new_tokens, reset, eos, drafter is not None, sampling, first_settings
                )
                if drafter is not None:
                    drafter = leader_drafter(drafter, self.cluster)
            if reset:
                state.reset()
            state.tokens = list(ids)
            stats = RunStats()
            t0 = time.perf_counter()
            with self._run_failures(state), torch.inference_mode():
                stats.prefill_tokens = prefill(self.model, state, first_settings.prefill_chunk)
            stats.prefill_s = time.perf_counter() - t0
            generated: list[int] = []
            stream_text = _StreamText(self.tokenizer)
            # Within a round only one rank may look at the cancel flag: on several ranks it waits for
            # the round boundary, where rank 0 tells every rank at once.
            in_round_cancel = (lambda: sess.cancelled) if self.cluster is None and leader else (lambda: False)
            index = 0
            # Time: the engine's own wall time, every interval counted once. A round's time runs from where the
            # previous one's ended (so the engine's work after a round's end, its event and run stats, counts
            # into the next round, as does reading the next round's settings) to the end of its host work; the
            # caller's time between two events is taken out (`mark` moves past it).
            # Overlap (rank 0, `self.overlap_rounds`): once a round's results are read and the host state is up
            # to them, the next round is queued on the device before this round's event is made and handed
            # to the caller, so the event, the run stats and the caller's own work run while the device works.
            # The next round's settings are therefore read one event earlier: a change or cancel made while
            # handling an event takes effect a round later than without overlap (the round already queued is
            # finished and emitted as usual).
            # Pipelined (overlap on one device; target-only after target-only, chained drafts after chained drafts):
            # the next round is queued before this one is even read, its inputs (token, position, the draft head's
            # pending rows) taken from this round's results on the device (spec.can_pipeline), so the device runs
            # from round to round without waiting for the host's read, its bookkeeping and the next launch (on the
            # H200 ~0.3 ms a 9B-like token). Its settings are read at the same boundary as with overlap alone (after
            # the previous event was handed over); a round queued behind the run's last one (an end of text) is
            # abandoned before the last event goes out.
            overlap = leader and (
                self.model.device.type == "cuda" if self.overlap_rounds is None else self.overlap_rounds
            )
            pipeline = overlap and self.pipeline_rounds is not False and self.cluster is None and drafter is None
            # speculative rounds too (not pipeline_rounds "target"): chained drafts, greedy or sampled. An adaptive
            # depth then chooses a round's depth before the round ahead of it is read, from the rounds before it.
            pipe_spec = pipeline and self.pipeline_rounds != "target"
            pending = None  # (launched round, its settings) queued ahead of this round's event
            held = None  # settings read for the next round to pipeline that could not be pipelined
            stop_with = None  # settings of a cancel found while queueing ahead: the run ends after this event
            failed: EngineError | None = None  # queueing ahead failed: raised once this round's event is out
            mark = time.perf_counter()

            def launch(settings, after=None):
                budget = max_new_tokens - len(generated) if after is None else None  # behind: launch_round's
                return launch_round(
                    self.model,
                    state,
                    sess.plans,
                    settings,
                    budget,
                    self.tokenizer.eos_token_ids,
                    in_round_cancel,
                    drafter,
                    sampling,
                    behind=after,
                )

            def queue_ahead(after=None):
                """Read the next round's settings and queue it (behind `after`, not read yet, when given and
                can_pipeline holds; else they are held for after this round's read). Sets pending, held,
                stop_with or failed."""
                nonlocal pending, held, stop_with, failed
                nxt, cancelled = (held, False) if held is not None else rounds.next()
                held = None
                if cancelled:
                    stop_with = nxt
                    return
                if after is not None and not can_pipeline(state, nxt, after, speculative=pipe_spec):
                    held = nxt
                    return
                try:  # a failure here is the next round's: this round's event goes out first
                    with self._run_failures(state), torch.inference_mode():
                        pending = (launch(nxt, after), nxt)
                except EngineError as exc:
                    failed = exc

            try:
                while True:
                    if pending is None:
                        settings, cancelled = rounds.next()
                        if settings is None:  # a worker told the run is over
                            return
                        if cancelled:
                            stats.stop_reason = "cancelled"
                            yield self._final_event(index, settings, stats)
                            return
                        with self._run_failures(state), torch.inference_mode():
                            launched = launch(settings)
                    else:
                        (launched, settings), pending = pending, None
                    if (
                        pipeline
                        and stop_with is None
                        and failed is None
                        and can_pipeline(state, settings, launched, speculative=pipe_spec)
                    ):
                        queue_ahead(after=launched)
                    with self._run_failures(state), torch.inference_mode():
                        out = (
                            launched
                            if isinstance(launched, RoundOutcome)
                            else finish_round(
                                self.model, state, sess.plans, launched, rounds.while_waiting if leader else None
                            )
                        )
                    if out.cancelled:
                        stats.stop_reason = "cancelled"
                        yield self._final_event(index, settings, stats)
                        return
                    t_host = time.perf_counter()
                    if leader:
                        rounds.observe(settings, out, t_host - mark)
                    generated.extend(out.tokens)
                    done = out.hit_eos or len(generated) >= max_new_tokens
                    requested = rounds.requested if leader else settings
                    adaptive = rounds.controller.snapshot() if leader and rounds.controller else None
                    if done:
                        if pending is not None and not isinstance(pending[0], RoundOutcome):
                            # queued behind the run's last round: never handed over, the session as if it never ran
                            with self._run_failures(state), torch.inference_mode():
                                abandon_round(self.model, state, sess.plans, pending[0])
                        pending = held = stop_with = failed = None
                    elif overlap and pending is None and stop_with is None and failed is None:
                        queue_ahead()
                    text = stream_text.add(out.tokens)
                    t_end = time.perf_counter()
                    ev = RoundEvent(
                        index=index,
                        tokens=out.tokens,
                        text=text,
                        from_draft=out.from_draft,
                        drafted=out.drafted,
                        accepted=out.accepted,
                        settings=requested,
                        time_draft_s=out.time_draft_s,
                        time_verify_s=out.time_verify_s,
                        time_accept_s=out.time_accept_s,
                        time_host_s=max(0.0, (t_end - mark) - out.time_draft_s - out.time_verify_s - out.time_accept_s),
                        time_round_s=t_end - mark,
                        plan_hits=out.plan_hits,
                        plan_misses=out.plan_misses,
                        plan_capture_s=out.plan_capture_s,
                        depth=settings.draft_depth if settings.speculative else 0,
                        adaptive=adaptive,
                        remapped=out.remapped,
                        synthetic=out.synthetic,
                        pipelined=out.pipelined,
                    )
                    stats.add(ev)
                    if done:
                        stats.stop_reason = "eos" if out.hit_eos else "length"
                        ev.done, ev.stop_reason = True, stats.stop_reason
                    if leader:
                        ev.run = self._run_stats(stats)
                    elif self.report is not None:
                        self.report()
                    index += 1
                    t_yield = time.perf_counter()
                    mark = t_end
                    yield ev
                    mark += time.perf_counter() - t_yield  # the caller's time is not the engine's
                    if done:
                        return
                    if stop_with is not None:
                        stats.stop_reason = "cancelled"
                        yield self._final_event(index, stop_with, stats)
                        return
                    if failed is not None:
                        raise failed
            finally:
                if pending is not None and not isinstance(pending[0], RoundOutcome):
                    # dropped with a round queued ahead: wait for it, then take the host state back to before
                    # it (its tokens were never handed over; the planes it wrote are marked unused)
                    with self._run_failures(state), torch.inference_mode():
                        abandon_round(self.model, state, sess.plans, pending[0])
        finally:
            if leader:
                rounds.finish()
            sess.busy.release()

    def _run_stats(self, stats: RunStats) -> dict[str, Any]:
        total, by_device = self._memory_counts()
        out = stats.as_dict(total)
        out["memory_by_device"] = {d: dict(v) for d, v in by_device.items()}
        out["devices"] = len(self.model.device_names)
        out["remap_size"] = self.model.remap_size  # the sub-vocab order's size (0: none); remap_rounds used it
        out["fallbacks"] = kernel_ops.fallbacks()  # GPU calls that ran as PyTorch references, per op (this process)
        out["gemm_choices"] = self.model.gemm_choices  # gemm cupy/auto: the product per shape and row bucket
        return out

    @contextlib.contextmanager
    def _run_failures(self, state):
        """A failure inside the engine stops this run only: the session keeps its committed text and
        re-prefills on its next use; the caller gets one EngineError saying what happened. On several
        devices a failure on one rank leaves the others out of step, so the engine stops instead (naming
        the worker when one died or fell silent, which is what breaks a collective)."""
        try:
            yield
        except EngineError:  # settings that do not fit: raised before the round touched state
            raise
        except Exception as exc:
            if self.cluster is not None:
                for _ in range(40):
                    self.cluster.check()
                    time.sleep(0.05)
                first = str(exc).splitlines()[0] if str(exc) else ""
                self.cluster.close(f"{type(exc).__name__}: {first}")
                raise EngineError(
                    f"the run failed on rank 0 ({type(exc).__name__}: {first}); the multi-device engine was "
                    "stopped and its workers ended — load the model again"
                ) from exc
            state.forget_computed()
            if isinstance(exc, torch.OutOfMemoryError):
                raise EngineError(
                    f"out of memory on {self.model.device} during the run; it was stopped and the session "
                    "kept its text (use a shorter context, a smaller depth or another device)"
                ) from None
            raise EngineError(
                f"the run failed inside the engine ({type(exc).__name__}: {exc}); it was stopped and "
                "the session kept its text"
            ) from exc

    def _final_event(self, index: int, settings: EngineSettings, stats: RunStats) -> RoundEvent:
        nothing = {"tokens": [], "text": "", "from_draft": [], "drafted": 0, "accepted": 0}
        times = dict.fromkeys(("time_draft_s", "time_verify_s", "time_accept_s", "time_host_s", "time_round_s"), 0.0)
        ev = RoundEvent(
            index=index,
            settings=settings,
            done=True,
            stop_reason=stats.stop_reason,
            synthetic=stats.synthetic or settings.synthetic,
            **nothing,
            **times,
        )
        ev.run = self._run_stats(stats)
        return ev
