"""Several devices: one process per device (SPMD) on torch.distributed.

Rank 0 lives in the caller's process (the app, the CLI, a test) and keeps the public `Engine` API; ranks
1..W-1 are worker processes started here ("spawn": no CUDA or Qt state is inherited). Every rank loads
its own shard (`build_model`), joins one process group (NCCL on CUDA, gloo on the CPU) and runs the same
round loop (`Engine._run`); each replays its own captured graphs, with its all-reduces inside them.

Rank 0 makes every host decision the ranks must share and sends it down one pipe per worker:
  ("session", sid) / ("drop", sid)                  sessions are created and freed on every rank
  ("run", sid, ids, max_new_tokens, reset, eos, drafter, sampling, settings)   a generation starts
  ("round", settings, cancelled)                     at every round boundary: the settings of that round
  ("proposal", tokens)                               a test drafter's proposal (tests only)
  ("end",)                                           the generation is over (normal end, cancel, error)
  ("logits", ids) / ("option", name, value) / ("close",)
and the workers send back only their memory count when it changes, and an error line before they exit.
Everything else (tokens, acceptance, rollback) every rank computes itself from identical device results,
so the round itself crosses no pipe: the all-reduces keep the ranks in step.

Faults: each worker beats a heartbeat into shared memory; rank 0 checks it (and the process) while it
waits for a round, so a worker that dies or stops answering is one EngineError within ~10 s, the workers
are ended and the process group destroyed, and a new engine can be loaded in the same process.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .adaptive import DepthController
from .errors import EngineError

HANG_S = 5.0  # a worker whose heartbeat is older than this is taken as hung
NCCL_TIMEOUT_S = 300.0  # NCCL's own watchdog: long enough for any prefill; liveness is checked by us
_LIVE: weakref.WeakSet = weakref.WeakSet()  # clusters not closed yet (one process group per process)
_GROUPS = itertools.count(100)  # process group names used by this process, one per cluster
_SYMMETRIC_TAKEN = [False]  # this process has set up symmetric memory once (see setup_collectives)


class WorkerLost(EngineError):
    """A worker process died or stopped answering; the engine is closed."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(source: tuple, rank: int, devices: list[torch.device]):
    """This rank's shard of the model. `source`: ("dir", path, dtype) a model directory, or
    ("call", factory, args): factory(device, *args) -> (cfg, weights, has_mtp), e.g. a benchmark's random
    model (built on the rank's device, then sliced)."""
    from .config import ModelConfig
    from .loader import DTYPES, load_weights
    from .model import Model
    from .parallel import Group, check_splittable, shard_weights

    world, device = len(devices), devices[rank]
    if source[0] == "dir":
        path = Path(source[1])
        cfg = ModelConfig.from_file(path / "config.json")
        if world > 1:
            check_splittable(cfg, world)
        weights, has_mtp = load_weights(path, cfg, torch.device("cpu") if world > 1 else device, DTYPES[source[2]])
    else:
        cfg, weights, has_mtp = source[1](device, *source[2])
    if world == 1:
        return Model(cfg, weights, has_mtp)
    check_splittable(cfg, world)
    tied = cfg.tie_word_embeddings
    count = sum(t.numel() for k, t in weights.items() if not (tied and k == "lm_head.weight"))
    shard_cfg, shard = shard_weights(cfg, weights, rank, world, device)
    del weights
    group = Group(rank, world, device)
    return Model(shard_cfg, shard, has_mtp, group, count, device_labels(devices))


def device_labels(devices: list[torch.device]) -> list[str]:
    """One label per rank: the device, with the rank where several ranks share one (CPU tests)."""
    names = [str(d) for d in devices]
    return [n if names.count(n) == 1 else f"{n} (rank {r})" for r, n in enumerate(names)]


def init_group(rank: int, world: int, port: int, device: torch.device, name_index: int = 0) -> None:
    """Join the process group (NCCL on CUDA, gloo on the CPU) and make one collective, so that every
    communicator exists before a graph captures one.

    `name_index` names the group: a process that loads a second multi-device engine gets a new group
    name (every rank the same), because PyTorch keeps per-name state (symmetric memory's store) that a
    re-created group of the old name would find stale."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if dist.is_initialized():
        raise EngineError("a multi-device engine is already loaded in this process; close it first")
    world_state = getattr(c10d, "_world", None)
    if world_state is not None and hasattr(world_state, "group_count"):
        world_state.group_count = name_index
    cuda = device.type == "cuda"
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicator, never the app
    kwargs: dict[str, Any] = {}
    if cuda:
        kwargs["device_id"] = device
    backend = "nccl" if cuda else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=NCCL_TIMEOUT_S if cuda else HANG_S + 1),
            **kwargs,
        )
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
    except Exception as exc:  # never a silent slower path: the user hears why the group failed
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise EngineError(
            f"the {backend} process group of {world} devices could not be set up on rank {rank} "
            f"({type(exc).__name__}: {first}); check the devices and that the GPUs can reach each other"
        ) from None
    if int(probe.item()) != world:
        raise EngineError(f"the process group's first all-reduce gave {probe.item()}, expected {world}")


def split_note(model, collectives: dict) -> str:
    """One line when splitting this model cannot pay on these GPUs: the weights each rank no longer reads
    per token (at ~3 TB/s) take less time than the all-reduces the split adds (2 per layer)."""
    if model.device.type != "cuda" or not model.group.active:
        return ""
    per_rank = sum(t.numel() * t.element_size() for t in model.w.values())
    saved_us = per_rank * (model.group.world - 1) / 3e12 * 1e6
    table = collectives.get("table_us") or {}
    one_row = table.get(1, {})
    call_us = min(one_row.values()) if one_row else 15.0
    added_us = 2 * (model.cfg.num_layers + model.cfg.mtp_num_hidden_layers) * call_us
    if saved_us >= added_us:
        return ""
    return (
        f"splitting this model over {model.group.world} GPUs cannot pay: it saves ~{saved_us:.0f} us of weight "
        f"reads per token and adds ~{added_us:.0f} us of all-reduces; one GPU is faster for it"
    )


def setup_collectives(model, allow_symmetric: bool = True) -> dict:
    """CUDA: symmetric memory for decode-sized all-reduces where it beats NCCL (timed here, at load,
    inside captured graphs; the same choice on every rank). Returns a summary for `Engine.info`.

    Only the first multi-device engine of a process may use symmetric memory: PyTorch keeps its
    rendezvous state per process, and a second process group's rendezvous waited for a peer that never
    came (seen on two H200s: a 300 s stall, then a failure); later engines use NCCL alone."""
    group = model.group
    if model.device.type != "cuda":
        return {"all_reduce": "gloo"}
    if not allow_symmetric:
        return {"all_reduce": "nccl", "symmetric_memory": "not again in this process (first engine only)"}
    hidden, dtype = model.cfg.hidden_size, model.dtype
    why = group.setup_symmetric(2 * 32 * hidden, dtype)  # two halves of 32 rows
    if why:
        return {"all_reduce": "nccl", "symmetric_memory": f"unavailable ({why})"}
    try:
        group.choose_backends(hidden, dtype)
    except Exception as exc:  # noqa: BLE001 - keep NCCL whatever went wrong with the alternative
        group.symm.clear()
        return {"all_reduce": "nccl", "symmetric_memory": f"failed ({type(exc).__name__}: {exc})"}
    return {"all_reduce": "per size", "table_us": group.backend_table}


class Cluster:
    """Rank 0's handle on the worker processes: start, command channel, liveness, close."""

    def __init__(self, devices: list[torch.device], source: dict, threads: int, build_rank: Callable) -> None:
        """`build_rank(spec, rank, devices) -> engine`: how a worker builds its rank (Engine._build_rank, passed
        in so that this module never imports engine.engine, which imports it)."""
        for other in list(_LIVE):
            other.close("another multi-device engine was loaded")
        self.devices = devices
        self.world = len(devices)
        self.port = _free_port()
        self.name_index = next(_GROUPS)
        self.allow_symmetric = not _SYMMETRIC_TAKEN[0] and devices[0].type == "cuda"
        _SYMMETRIC_TAKEN[0] = _SYMMETRIC_TAKEN[0] or self.allow_symmetric
        ctx = mp.get_context("spawn")
        self.beats = ctx.Array("d", self.world, lock=False)
        self.conns = []
        self.procs = []
        self.closed = ""
        self._send_lock = threading.RLock()  # re-entrant: a stream dropped by the GC mid-send sends "end"
        self._dropped: list[int] = []
        self._pickled: dict[tuple, bytes] = {}
        self._reports: dict[int, dict] = {}
        # Rank 0's engine's release_plans (a weak method): run first by close(), however the close comes (the
        # engine's close, its finalizer, a lost worker, another engine loaded, interpreter exit)
        self.before_close: weakref.WeakMethod | None = None
        env_keep = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        for k, v in env_keep.items():
            os.environ.setdefault(k, v)
        for rank in range(1, self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world,
                    (self.port, self.name_index, self.allow_symmetric),
                    [str(d) for d in devices],
                    source,
                    threads,
                    child,
                    self.beats,
                    build_rank,
                ),
                daemon=True,
                name=f"specdeck-rank{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        _LIVE.add(self)

    # ---- start-up ---------------------------------------------------------------------------------
    def wait_for(self, what: str, timeout: float) -> None:
        """Every worker reports `what` (or an error, which is raised here as one line)."""
        deadline = time.monotonic() + timeout
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise self._lost(f"worker rank {rank} exited (code {proc.exitcode}) while it {what}")
                if time.monotonic() > deadline:
                    raise self._lost(f"worker rank {rank} did not report '{what}' within {timeout:.0f} s")
            msg = conn.recv()
            if msg[0] == "error":
                raise self._lost(msg[1], cls=EngineError)
            if msg[0] != what:
                raise self._lost(f"worker rank {rank} answered {msg[0]!r} instead of {what!r}")

    # ---- the channel ------------------------------------------------------------------------------
    def send(self, *msg) -> None:
        if self.closed:
            raise EngineError(f"this multi-device engine was closed ({self.closed}); load the model again")
        self._write(pickle.dumps(msg))

    def _write(self, data: bytes) -> None:
        """A pickled message to every worker, after the drops of freed sessions queued before it."""
        with self._send_lock:
            try:
                while self._dropped:
                    drop = pickle.dumps(("drop", self._dropped.pop()))
                    for conn in self.conns:
                        conn.send_bytes(drop)
                for conn in self.conns:
                    conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self.check()
                raise self._lost("a worker's channel closed") from None

    def send_round(self, settings, cancelled: bool) -> None:
        """The per-round message, pickled once per distinct value (most rounds repeat the last one)."""
        key = (settings, cancelled)
        data = self._pickled.get(key)
        if data is None:
            if len(self._pickled) > 64:
                self._pickled.clear()
            data = self._pickled[key] = pickle.dumps(("round", settings, cancelled))
        if self.closed:
            raise EngineError(f"this multi-device engine was closed ({self.closed}); load the model again")
        self._write(data)

    def reports(self) -> dict[str, dict[str, int]]:
        """The workers' latest memory reports (each worker sends one whenever its count changes;
        they are never asked for, so a worker busy in a round is never waited on)."""
        for rank, conn in enumerate(self.conns, start=1):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "memory":
                        self._reports[rank] = msg[1]
                    elif msg[0] == "error":
                        raise self._lost(msg[1])
        out: dict[str, dict[str, int]] = {}
        for rank in sorted(self._reports):
            out.update(self._reports[rank])
        return out

    def drop_later(self, sid: int) -> None:
        """A session was freed on rank 0 (a finaliser: may run anywhere, so only queued here)."""
        self._dropped.append(sid)

    # ---- liveness ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise WorkerLost (and close everything) when a worker died or its heartbeat stopped."""
        if self.closed:
            raise EngineError(f"this multi-device engine was closed ({self.closed}); load the model again")
        now = time.time()
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                said = self._last_words(rank)
                raise self._lost(
                    said or f"worker rank {rank} (on {self.devices[rank]}) died (exit code {proc.exitcode})"
                )
            beat = self.beats[rank]
            if beat and now - beat > HANG_S:
                raise self._lost(
                    f"worker rank {rank} (on {self.devices[rank]}) stopped answering for {now - beat:.0f} s"
                )

    def _last_words(self, rank: int) -> str:
        """The one-line error a worker sent before it exited, if it did."""
        conn = self.conns[rank - 1]
        with contextlib.suppress(Exception):
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    return msg[1]
        return ""

    def _lost(self, why: str, cls=None) -> EngineError:
        self.close(why)
        cls = cls or WorkerLost
        return cls(f"{why}; the multi-device engine was stopped and its workers ended — load the model again")

    def close(self, why: str = "closed") -> None:
        """End the workers (politely, then by force), destroy the process group. Idempotent."""
        if self.closed:
            return
        self.closed = why
        _LIVE.discard(self)
        import torch.distributed as dist

        # Graphs with NCCL collectives captured in them hold the communicator: they go before the group does.
        release = self.before_close() if self.before_close is not None else None
        if release is not None:
            with contextlib.suppress(Exception):  # a broken device must not stop the rest of the close
                release()

        for conn in self.conns:
            with contextlib.suppress(Exception):  # a dead worker's pipe
                conn.send(("close",))
        # A normal close gives the workers 3 s to exit on their own; after a fault (a worker dead or hung, the
        # group about to be aborted) nothing of theirs is kept, and a hung one never answers: half a second
        # (the user's one line then comes well inside the 10 s the fault promise gives, on a loaded host too)
        deadline = time.monotonic() + (3.0 if why == "closed" else 0.5)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                if why != "closed":
                    from torch.distributed.distributed_c10d import _abort_process_group

                    _abort_process_group()
                else:
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - tearing down a broken group may itself fail
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


# ---- the worker process ---------------------------------------------------------------------------
class _WorkerChannel:
    """A worker's end of the pipe: commands arrive in order; queries are answered inline."""

    def __init__(self, conn, engine) -> None:
        self.conn = conn
        self.engine = engine
        self.sessions: dict[int, Any] = {}
        self._ended = False  # a run's "end" already read by _WorkerRounds (so _skip_to_end reads no further)
        self._reported = None
        engine.report = self.report

    def recv(self) -> tuple:
        while True:
            # Spin briefly before blocking: during a run the next round's message comes within a
            # millisecond, and waking a blocked reader costs tens of microseconds each round.
            deadline = time.perf_counter() + 0.02
            while not self.conn.poll(0) and time.perf_counter() < deadline:
                pass
            msg = self.conn.recv()
            if msg[0] == "drop":
                self.sessions.pop(msg[1], None)
                self.report()
            else:
                return msg

    def report(self) -> None:
        """Send this rank's memory count to rank 0 when it changed (after a round, a session, a drop)."""
        counts = self.engine.local_memory()
        if counts is not self._reported:
            self._reported = counts
            self.conn.send(("memory", counts))


def _heartbeat(beats, rank: int, stop: threading.Event) -> None:
    parent = os.getppid()
    while not stop.wait(0.25):
        beats[rank] = time.time()
        if os.getppid() != parent:  # rank 0 is gone: nothing left to serve
            os._exit(3)


def worker_main(rank, world, address, devices, source, threads, conn, beats, build_rank) -> None:
    stop = threading.Event()
    beats[rank] = time.time()
    threading.Thread(target=_heartbeat, args=(beats, rank, stop), daemon=True).start()
    try:
        torch.set_num_threads(max(1, threads))
        device = torch.device(devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        engine = build_rank(source, rank, [torch.device(d) for d in devices])
        conn.send(("loaded",))
        init_group(rank, world, address[0], device, address[1])
        engine.collectives = setup_collectives(engine.model, allow_symmetric=address[2])
        conn.send(("ready",))
        serve(engine, _WorkerChannel(conn, engine))
        engine.release_plans()  # "close": its graphs go before the process group does (as on rank 0)
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # noqa: BLE001 - report it in one line to rank 0, then leave
        traceback.print_exc()
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with contextlib.suppress(Exception):
            conn.send(("error", f"worker rank {rank} on {devices[rank]}: {msg}"))
    finally:
        stop.set()
        os._exit(0)


def serve(engine, channel: _WorkerChannel) -> None:
    """The worker's command loop: the same engine code as rank 0, driven by rank 0's decisions."""
    from .errors import EngineError as _EngineError

    while True:
        msg = channel.recv()
        op = msg[0]
        if op == "close":
            return
        if op == "session":
            channel.sessions[msg[1]] = engine.new_session(sid=msg[1])
            channel.report()
        elif op == "run":
            _, sid, ids, max_new, reset, eos, has_drafter, sampling, settings = msg
            sess = channel.sessions[sid]
            sess.settings = settings  # what the prefill reads (its chunk: every rank runs the same passes)
            engine.tokenizer.eos_token_ids = eos
            drafter = (lambda _tokens, _depth: _expect(channel, "proposal")[1]) if has_drafter else None
            sess.busy.acquire()  # released by the run, as on rank 0
            try:
                for _ in engine._run(sess, ids, max_new, _WorkerRounds(channel), reset, drafter, sampling):
                    pass
            except _EngineError:
                pass  # rank 0 raised the same error from the same decision
            _skip_to_end(channel)
        elif op == "logits":
            engine.logits(msg[1])
        elif op == "option":
            engine.model.set_option(msg[1], msg[2])
        elif op == "end":
            pass
        else:
            raise RuntimeError(f"unknown command {op!r}")


def _expect(channel: _WorkerChannel, op: str) -> tuple:
    msg = channel.recv()
    if msg[0] == "end":
        raise _RunOver
    if msg[0] != op:
        raise RuntimeError(f"expected {op!r} from rank 0, got {msg[0]!r}")
    return msg


def _skip_to_end(channel: _WorkerChannel) -> None:
    if channel._ended:
        channel._ended = False
        return
    while channel.recv()[0] != "end":
        pass


class _RunOver(Exception):
    pass


class _WorkerRounds:
    """Round boundaries on a worker: the settings (and cancel) that rank 0 decided for this round."""

    def __init__(self, channel: _WorkerChannel) -> None:
        self.channel = channel

    def next(self) -> tuple[Any, bool]:
        try:
            _, settings, cancelled = _expect(self.channel, "round")
        except _RunOver:
            self.channel._ended = True
            return None, True
        return settings, cancelled


class LeaderRounds:
    """Round boundaries on rank 0: read the session's settings and cancel flag, resolve an adaptive depth
    to this round's depth, and tell the workers (which get concrete settings only).
    (Sending the decision a round ahead would save the workers a pipe wake-up per round, but a consumer
    that stops iterating after round k would leave them running a round k+1 that rank 0 never runs.)"""

    def __init__(self, sess, cluster: Cluster | None) -> None:
        self.sess = sess
        self.cluster = cluster
        self.requested = None  # the session's settings of the current round ("auto" stays "auto")
        self.controller = None  # the session's DepthController while the depth is "auto"
        self._concrete: tuple[Any, dict[int, Any]] = (None, {})  # auto settings -> {depth: concrete settings}

    def next(self) -> tuple[Any, bool]:
        settings, cancelled = self.sess.settings, self.sess.cancelled
        self.requested = settings
        self.controller = None
        if settings.adaptive:
            ctrl = self.sess.depth_controller
            if ctrl is None or ctrl.max_depth != settings.max_draft_depth:
                ctrl = self.sess.depth_controller = DepthController(settings.max_draft_depth)
            self.controller = ctrl
            depth = ctrl.choose() if settings.speculative else 1
            if self._concrete[0] is not settings:  # the concrete settings per depth, made once per settings
                self._concrete = (settings, {})
            by_depth = self._concrete[1]
            if depth not in by_depth:
                by_depth[depth] = settings.replace(draft_depth=depth, plan_pool=settings.auto_plan_pool)
            settings = by_depth[depth]
        if self.cluster is not None:
            self.cluster.send_round(settings, cancelled)
        return settings, cancelled

    def while_waiting(self) -> None:
        """While the device runs the round: an adaptive depth works out its next decision (DepthController.
        prepare), so the round boundary is left with only the choice itself."""
        if self.controller is not None:
            self.controller.prepare()

    def observe(self, settings, out, round_s: float) -> None:
        """After a round: what an adaptive depth learns from it (host data only, no extra device read)."""
        if self.controller is not None and settings.speculative:
            captured = out.plan_misses > 0
            self.controller.observe(settings.draft_depth, out.drafted, out.accepted, round_s, captured)

    def finish(self) -> None:
        if self.cluster is not None and not self.cluster.closed:
            self.cluster.send("end")


def leader_drafter(drafter: Callable, cluster: Cluster) -> Callable:
    def propose(tokens: list[int], depth: int) -> list[int]:
        proposal = list(drafter(tokens, depth))
        cluster.send("proposal", proposal)
        return proposal

    return propose
