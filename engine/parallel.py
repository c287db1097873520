"""Tensor parallelism as a property of the layers: split rules, weight shards, and the collectives.

One process per device (SPMD, see engine/workers.py); every rank runs the same `Model` code on its shard:

- column-parallel projections (q|k|v, the delta-net's qkv|z|b|a, the MLP's gate|up) hold a slice of the
  output rows: attention heads by KV-head groups, the delta-net by key-head groups, the MLP by columns;
- row-parallel projections (o_proj, out_proj, down_proj) hold the matching input columns; their outputs
  are partial sums that `Group.all_reduce` adds up, so the residual stream is replicated on every rank;
- the LM head is either mirrored (every rank the whole head: each picks the same tokens locally) or
  vocab-parallel (a slice of rows each; the pick is a distributed argmax exchanging (max, index, sum of
  exp) per row, never the logits). Norms and the embedding are replicated.

More ranks than KV heads (or delta-net key heads): each rank holds one KV head, shared by several ranks
that split its query-head group between them (vLLM's rule: KV heads are replicated, never split).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from .config import ModelConfig
from .errors import EngineError


@functools.cache
def split_ranges(n_items: int, n_shards: int) -> tuple[tuple[int, int], ...]:
    """Contiguous, as even as possible."""
    base, extra = divmod(n_items, n_shards)
    out, lo = [], 0
    for s in range(n_shards):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def head_split(n_heads: int, n_kv: int, rank: int, world: int, what: str) -> tuple[int, int, int, int]:
    """(head_lo, head_hi, kv_lo, kv_hi) held by `rank`: whole KV groups while there are enough KV heads;
    otherwise one KV head per rank, its group of heads split among the ranks that share it."""
    group = n_heads // n_kv
    if world <= n_kv:
        kv_lo, kv_hi = split_ranges(n_kv, world)[rank]
        return kv_lo * group, kv_hi * group, kv_lo, kv_hi
    kv = rank * n_kv // world
    sharers = [r for r in range(world) if r * n_kv // world == kv]
    if len(sharers) > group:
        raise EngineError(
            f"cannot split {what} ({n_heads} heads in groups of {group}) over {world} devices: a device "
            f"would hold no head; use at most {n_kv * group} devices"
        )
    lo, hi = split_ranges(group, len(sharers))[sharers.index(rank)]
    return kv * group + lo, kv * group + hi, kv, kv + 1


def check_splittable(cfg: ModelConfig, world: int) -> None:
    """Raise EngineError (before anything is loaded) when some rank would hold no head."""
    for rank in range(world):
        head_split(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world, "attention")
        head_split(cfg.linear_num_value_heads, cfg.linear_num_key_heads, rank, world, "the delta-net")
    if cfg.intermediate_size < world:
        raise EngineError(f"cannot split intermediate_size={cfg.intermediate_size} over {world} devices")


def vocab_slice(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """The vocabulary rows of a vocab-parallel head: equal slices (the last one may be short)."""
    per = -(-vocab // world)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def shard_weights(
    cfg: ModelConfig, w: dict[str, torch.Tensor], rank: int, world: int, device: torch.device
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Rank `rank` of `world`: its config (the head counts of its slice) and its tensors on `device`.
    `lm_head.weight` is left whole (the model slices or mirrors it)."""
    d, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q_lo, q_hi, kv_lo, kv_hi = head_split(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world, "attention")
    v_lo, v_hi, k_lo, k_hi = head_split(
        cfg.linear_num_value_heads, cfg.linear_num_key_heads, rank, world, "the delta-net"
    )
    i_lo, i_hi = split_ranges(cfg.intermediate_size, world)[rank]
    hk_all = cfg.linear_num_key_heads * dk
    qkv_rows = torch.cat(
        [
            torch.arange(k_lo * dk, k_hi * dk),
            hk_all + torch.arange(k_lo * dk, k_hi * dk),
            2 * hk_all + torch.arange(v_lo * dv, v_hi * dv),
        ]
    )

    def rows(t, lo, hi):
        return t[lo:hi]

    def cols(t, lo, hi):
        return t[:, lo:hi]

    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        key = ".".join(name.rsplit(".", 2)[-2:])
        if name == "lm_head.weight":
            pass
        elif key == "q_proj.weight":
            t = rows(t, q_lo * 2 * d, q_hi * 2 * d)
        elif key in ("k_proj.weight", "v_proj.weight"):
            t = rows(t, kv_lo * d, kv_hi * d)
        elif key == "o_proj.weight":
            t = cols(t, q_lo * d, q_hi * d)
        elif key in ("in_proj_qkv.weight", "conv1d.weight"):
            t = t.index_select(0, qkv_rows.to(t.device))
        elif key == "in_proj_z.weight":
            t = rows(t, v_lo * dv, v_hi * dv)
        elif key in ("in_proj_b.weight", "in_proj_a.weight") or name.endswith(("A_log", "dt_bias")):
            t = rows(t, v_lo, v_hi)
        elif key == "out_proj.weight":
            t = cols(t, v_lo * dv, v_hi * dv)
        elif key in ("gate_proj.weight", "up_proj.weight"):
            t = rows(t, i_lo, i_hi)
        elif key == "down_proj.weight":
            t = cols(t, i_lo, i_hi)
        out[name] = t.to(device).contiguous() if name != "lm_head.weight" else t
    shard_cfg = dataclasses.replace(
        cfg,
        num_attention_heads=q_hi - q_lo,
        num_key_value_heads=kv_hi - kv_lo,
        linear_num_key_heads=k_hi - k_lo,
        linear_num_value_heads=v_hi - v_lo,
        intermediate_size=i_hi - i_lo,
    )
    return shard_cfg, out


class Group:
    """This rank's view of the process group: all-reduce of row-parallel partials, all-gather of the
    per-row pick statistics. One rank (no group) is the identity. Calls are counted.

    On CUDA the all-reduce of a decode-sized message may go through PyTorch's symmetric memory (one-shot:
    every rank reads every peer's buffer over NVLink and adds locally) instead of NCCL; `choose_backends`
    times both inside a captured graph at load and keeps the faster per row count."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")
        self.calls = 0
        self.symm: dict[int, str] = {}  # rows -> "symm" where symmetric memory won for that size
        self._symm_buf: torch.Tensor | None = None
        self._half = 0
        self._group_name = ""
        self.backend_table: dict[int, dict[str, float]] = {}

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; every rank gets the total (in place where NCCL/gloo is used)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        rows = x.shape[0] if x.dim() > 1 else 1
        if self._symm_buf is not None and self.symm.get(rows) == "symm" and x.is_contiguous():
            return self._symm_reduce(x)  # counted by reduce_symmetric
        self.calls += 1
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x, in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x)
        return out.view(self.world, *x.shape)

    # ---- symmetric memory (CUDA only) ---------------------------------------------------------------
    def _symm_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.symmetric_out(x.shape[0], x.numel() // x.shape[0], x.dtype).view(x.shape)
        out.copy_(x)
        return self.reduce_symmetric(out)

    def symmetric_out(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A [rows, cols] view of the symmetric buffer to write a partial into, when sums of this many
        rows go through symmetric memory; else None. Consecutive sums use alternate halves of the buffer,
        so a partial is never written where a peer may still be reading the previous one (the next sum's
        barrier orders the one after)."""
        buf = self._symm_buf
        half = buf.numel() // 2 if buf is not None else 0
        if buf is None or self.symm.get(rows) != "symm" or buf.dtype != dtype or rows * cols > half:
            return None
        self._half ^= 1
        start = self._half * half
        return buf[start : start + rows * cols].view(rows, cols)

    def reduce_symmetric(self, out: torch.Tensor) -> torch.Tensor:
        """The one-shot sum of a partial already in the symmetric buffer (a new tensor)."""
        self.calls += 1
        return torch.ops.symm_mem.one_shot_all_reduce(out, "sum", self._group_name)

    def setup_symmetric(self, max_elems: int, dtype: torch.dtype) -> str:
        """Allocate the symmetric buffer (a collective call on every rank). Returns '' or why not."""
        try:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD
            self._group_name = group.group_name
            enable = symm_mem.enable_symm_mem_for_group
            if not getattr(enable, "__deprecated__", None):  # older PyTorch: register the group by hand
                enable(self._group_name)
            buf = symm_mem.empty(max_elems, dtype=dtype, device=self.device)
            symm_mem.rendezvous(buf, self._group_name)
            self._symm_buf = buf
            return ""
        except Exception as exc:  # not built with it, no P2P between the GPUs, ...
            self._symm_buf = None
            return f"{type(exc).__name__}: {exc}"

    def choose_backends(self, hidden: int, dtype: torch.dtype, rows_list=range(1, 18), reps: int = 50) -> None:
        """Time NCCL and one-shot symmetric memory per row count inside captured graphs; keep the faster.
        The same decision on every rank (rank 0's timings are broadcast)."""
        import torch.distributed as dist

        if self._symm_buf is None:
            return
        table = torch.zeros((len(rows_list), 2), dtype=torch.float64)
        for i, rows in enumerate(rows_list):
            for j, kind in enumerate(("nccl", "symm")):
                table[i, j] = self.time_in_graph(rows, hidden, dtype, kind, reps)
        table = table.to(self.device)
        dist.broadcast(table, 0)
        table = table.cpu()
        for i, rows in enumerate(rows_list):
            nccl_us, symm_us = table[i].tolist()
            self.backend_table[rows] = {"nccl": nccl_us, "symm": symm_us}
            self.symm[rows] = "symm" if symm_us < nccl_us else "nccl"

    def time_in_graph(self, rows: int, hidden: int, dtype: torch.dtype, kind: str, reps: int = 50) -> float:
        """Microseconds per all-reduce of [rows, hidden] replayed in a captured graph of `reps` calls."""
        import torch.distributed as dist

        x = torch.ones((rows, hidden), dtype=dtype, device=self.device)
        saved = dict(self.symm)
        self.symm[rows] = kind

        def work():
            for _ in range(reps):
                self.all_reduce(x)

        try:
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                work()
            torch.cuda.current_stream(self.device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                work()
            g.replay()
            torch.cuda.synchronize(self.device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize(self.device)
            dt = (time.perf_counter() - t0) / (5 * reps)
            del g
            return dt * 1e6
        finally:
            self.symm = saved
