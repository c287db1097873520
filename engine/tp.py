"""Tensor parallelism: one model split across several devices (or several shards of one device).

Split (computed once per model and cached): attention by KV-head groups (each shard its KV heads and
their query heads), the delta-net by key-head groups (each shard its key heads and their value heads,
with the matching conv channels), the MLP by intermediate columns. Every shard holds the replicated
residual stream x; each row-parallel output (o_proj, out_proj, down_proj) is a partial sum that
`AllReduce` adds up across shards. Norms and embeddings are replicated.

The LM head: `mirror_output` on -> every device holds the whole head and the leader computes the logits
alone (no cross-device traffic); off -> each device holds a vocabulary slice and the pick is combined
either by gathering the logits (the "before") or by a distributed argmax that exchanges only
(max, index, sum of exp) per row — `TPModel.combine` chooses.

The same code runs on "virtual devices" (["cpu", "cpu"]) and on several shards of one GPU, which is how it
is tested where there is only one device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from kernels import ops

from .config import ModelConfig
from .errors import EngineError
from .model import Model
from .state import SessionState


@functools.cache
def split_ranges(n_items: int, n_shards: int) -> tuple[tuple[int, int], ...]:
    """Contiguous, as even as possible: the split plan of one dimension (computed once, then reused)."""
    base, extra = divmod(n_items, n_shards)
    out, lo = [], 0
    for s in range(n_shards):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


class AllReduce:
    """Sum row-parallel partials across shards; every shard gets the total on its own device.

    Shards on one device (virtual CPU devices, several shards of one GPU): one add, in a fixed order.
    Several CUDA devices: NCCL all-reduce (CuPy's binding, one communicator per device, a group call on
    each device's current stream — no host or event synchronisation); without NCCL, peer copies to the
    leader and back, stream-ordered. Calls are counted for the latency benchmark.
    """

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.same_device = len({str(d) for d in devices}) == 1
        self.calls = 0
        self._comms = None
        if not self.same_device:
            try:
                from cupy.cuda import nccl

                self._nccl = nccl
                self._comms = nccl.NcclCommunicator.initAll([d.index for d in devices])
            except Exception:
                self._comms = None

    def __call__(self, partials: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        if self.same_device:
            total = partials[0]
            for p in partials[1:]:
                total = total + p
            return [total] * len(partials)
        if self._comms is not None:
            return self._nccl_sum(partials)
        lead = self.devices[0]
        total = partials[0]
        for p in partials[1:]:
            total = total + p.to(lead, non_blocking=True)
        return [total if d == lead else total.to(d, non_blocking=True) for d in self.devices]

    def _nccl_sum(self, partials: list[torch.Tensor]) -> list[torch.Tensor]:
        nccl = self._nccl
        kind = {
            torch.float32: nccl.NCCL_FLOAT32,
            torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", nccl.NCCL_FLOAT16),
            torch.float16: nccl.NCCL_FLOAT16,
        }[partials[0].dtype]
        nccl.groupStart()
        for comm, p, d in zip(self._comms, partials, self.devices):
            with torch.cuda.device(d):
                stream = torch.cuda.current_stream(d).cuda_stream
                comm.allReduce(p.data_ptr(), p.data_ptr(), p.numel(), kind, nccl.NCCL_SUM, stream)
        nccl.groupEnd()
        return partials


def _rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[lo:hi].contiguous()


def _cols(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[:, lo:hi].contiguous()


def shard_weights(
    cfg: ModelConfig, w: dict[str, torch.Tensor], s: int, n: int, device: torch.device
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Shard s of n: its config (head counts of its slice) and its tensors, on `device`."""
    kv_lo, kv_hi = split_ranges(cfg.num_key_value_heads, n)[s]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    q_lo, q_hi = kv_lo * group, kv_hi * group
    k_lo, k_hi = split_ranges(cfg.linear_num_key_heads, n)[s]
    rep = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    v_lo, v_hi = k_lo * rep, k_hi * rep
    i_lo, i_hi = split_ranges(cfg.intermediate_size, n)[s]
    d, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk_all = cfg.linear_num_key_heads * dk
    qkv_rows = torch.cat(
        [
            torch.arange(k_lo * dk, k_hi * dk),
            hk_all + torch.arange(k_lo * dk, k_hi * dk),
            2 * hk_all + torch.arange(v_lo * dv, v_hi * dv),
        ]
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        if name == "lm_head.weight":
            continue  # the output layer is placed by TPModel (slices or mirrors)
        leaf = name.rsplit(".", 2)
        key = ".".join(leaf[-2:]) if len(leaf) >= 2 else name
        if key in ("q_proj.weight",):
            t = _rows(t, q_lo * 2 * d, q_hi * 2 * d)
        elif key in ("k_proj.weight", "v_proj.weight"):
            t = _rows(t, kv_lo * d, kv_hi * d)
        elif key == "o_proj.weight":
            t = _cols(t, q_lo * d, q_hi * d)
        elif key in ("in_proj_qkv.weight", "conv1d.weight"):
            t = t.index_select(0, qkv_rows.to(t.device)).contiguous()
        elif key == "in_proj_z.weight":
            t = _rows(t, v_lo * dv, v_hi * dv)
        elif key in ("in_proj_b.weight", "in_proj_a.weight") or name.endswith(("A_log", "dt_bias")):
            t = _rows(t, v_lo, v_hi)
        elif key == "out_proj.weight":
            t = _cols(t, v_lo * dv, v_hi * dv)
        elif key in ("gate_proj.weight", "up_proj.weight"):
            t = _rows(t, i_lo, i_hi)
        elif key == "down_proj.weight":
            t = _cols(t, i_lo, i_hi)
        out[name] = t.to(device)
    shard_cfg = dataclasses.replace(
        cfg,
        num_attention_heads=q_hi - q_lo,
        num_key_value_heads=kv_hi - kv_lo,
        linear_num_key_heads=k_hi - k_lo,
        linear_num_value_heads=v_hi - v_lo,
        intermediate_size=i_hi - i_lo,
    )
    return shard_cfg, out


class TPModel:
    """The target and MTP head split over several devices; the same interface as `Model`."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], has_mtp: bool, devices: list[torch.device]):
        n = len(devices)
        for what, count in (
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("linear_num_key_heads", cfg.linear_num_key_heads),
        ):
            if count < n:
                raise EngineError(f"cannot split {what}={count} over {n} devices; use at most {count} devices")
        self.cfg = cfg
        self.has_mtp = has_mtp
        self.devices = devices
        self.device = devices[0]
        self.dtype = weights["embed_tokens.weight"].dtype
        tied = cfg.tie_word_embeddings
        self.parameter_count = sum(t.numel() for k, t in weights.items() if not (tied and k == "lm_head.weight"))
        self.device_names = [str(d) for d in devices]
        self.shards: list[Model] = []
        for s, dev in enumerate(devices):
            shard_cfg, w = shard_weights(cfg, weights, s, n, dev)
            self.shards.append(Model(shard_cfg, w, has_mtp))
        self.vocab_ranges = split_ranges(cfg.vocab_size, n)
        head = weights["lm_head.weight"]
        # The loaded head stays in host memory (the mirror copies are made from it when mirroring turns on).
        self._full_head = head if tied else head.to("cpu")
        self.head_slices = [_rows(head, lo, hi).to(d) for (lo, hi), d in zip(self.vocab_ranges, devices)]
        self.head_mirrors: list[torch.Tensor] | None = None
        self.mirror = False
        self.combine = "argmax"  # or "gather": how vocabulary slices are combined when not mirrored
        self.reduce = AllReduce(devices)
        self.cache_split_plans = True
        self._plan_cache: dict[tuple, tuple] = {}
        self.split_plan_builds = 0

    # ---- configuration ------------------------------------------------------------------------------
    def configure(self, settings) -> None:
        want = bool(settings.mirror_output)
        if want == self.mirror:
            return
        if want and self.cfg.tie_word_embeddings:  # each device already holds the (tied) embedding
            self.head_mirrors = [sh.w["embed_tokens.weight"] for sh in self.shards]
        elif want:
            self.head_mirrors = [self._full_head.to(d, copy=True) for d in self.devices]
        else:
            self.head_mirrors = None
        self.mirror = want

    @property
    def plan_tag(self) -> tuple:
        return (self.mirror, self.combine, self.gemm)

    @property
    def gemm(self) -> str:
        return self.shards[0].gemm

    def set_gemm(self, mode: str) -> None:
        for sh in self.shards:
            sh.set_gemm(mode)

    @property
    def capturable(self) -> bool:
        return False  # several devices: rounds run eagerly (NCCL under graph capture can deadlock)

    def weight_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for shard, head in zip(self.shards, self.head_slices):
            out.setdefault(str(shard.device), []).extend([*shard.w.values(), head])
        if self.head_mirrors:
            for d, m in zip(self.devices, self.head_mirrors):
                out.setdefault(str(d), []).append(m)
        return out

    def new_state(self, max_context: int, n_planes: int) -> SessionState:
        lead = SessionState(self.cfg, self.device, self.dtype, max_context, n_planes, self.has_mtp, caches=False)
        lead.shards = [
            SessionState(sh.cfg, sh.device, self.dtype, max_context, n_planes, self.has_mtp) for sh in self.shards
        ]
        return lead

    # ---- the split plan of a step shape ---------------------------------------------------------------
    def split_plan(self, t: int, start) -> tuple:
        """Per shard: where its inputs come from for a step of t tokens (cached per step shape)."""
        key = (t, isinstance(start, torch.Tensor))
        plan = self._plan_cache.get(key) if self.cache_split_plans else None
        if plan is None:
            self.split_plan_builds += 1
            plan = tuple((sh, sh.device, sh.device == self.device) for sh in self.shards)
            if self.cache_split_plans:
                self._plan_cache[key] = plan
        return plan

    @staticmethod
    def _on(x, device: torch.device, local: bool):
        if local or not isinstance(x, torch.Tensor):
            return x
        return x.to(device, non_blocking=True)

    # ---- target -------------------------------------------------------------------------------------
    forward = Model.forward  # the same bookkeeping around this class's forward_layers

    def forward_layers(self, ids: torch.Tensor, state: SessionState, start, recurrent: bool) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        plan = self.split_plan(ids.shape[0], start)
        starts = [self._on(start, dev, local) for _, dev, local in plan]
        xs = [F.embedding(self._on(ids, dev, local), sh.w["embed_tokens.weight"]) for sh, dev, local in plan]
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":

                def mixer(sh, st, h, s0, i=i):
                    return sh._attention(f"layers.{i}.", h, s0, st.k_cache[i], st.v_cache[i])

            else:

                def mixer(sh, st, h, s0, i=i):
                    return sh._delta_net(i, h, st, s0, recurrent)

            xs = self._decoder_layer(f"layers.{i}.", plan, state, xs, starts, mixer)
        return ops.rmsnorm(xs[0], self.shards[0].w["norm.weight"], eps)

    def _decoder_layer(self, p: str, plan: tuple, state: SessionState, xs: list, starts: list, mixer) -> list:
        """One decoder layer on every shard: x += allreduce(mixer(norm(x))); x += allreduce(mlp(norm(x)))."""
        eps = self.cfg.rms_norm_eps
        parts = []
        for (sh, _, _), st, x, s0 in zip(plan, state.shards, xs, starts):
            parts.append(mixer(sh, st, ops.rmsnorm(x, sh.w[p + "input_layernorm.weight"], eps), s0))
        hs, new_xs = [], []
        for (sh, _, _), x, m in zip(plan, xs, self.reduce(parts)):
            h, x = ops.add_rmsnorm(m, x, sh.w[p + "post_attention_layernorm.weight"], eps)
            hs.append(h)
            new_xs.append(x)
        mlp = self.reduce([sh._mlp(p, h) for (sh, _, _), h in zip(plan, hs)])
        return [x + m for x, m in zip(new_xs, mlp)]

    # ---- the LM head --------------------------------------------------------------------------------
    def lm_head(self, hidden: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """Full logits on the leader (mirror: local; otherwise the slices gathered)."""
        if self.mirror:
            head = self.head_mirrors[0]
            return F.linear(hidden, head[:rows] if rows else head)
        parts = [F.linear(hidden.to(d, non_blocking=True), w) for w, d in zip(self.head_slices, self.devices)]
        logits = torch.cat([p.to(self.device, non_blocking=True) for p in parts], dim=-1)
        return logits[:, :rows] if rows else logits

    def pick(self, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mirror or self.combine == "gather":
            return ops.argmax_prob(self.lm_head(hidden, n), n)
        # Distributed argmax: each slice sends (max, index, sum of exp) per row, never its logits.
        limit = n if n > 0 else self.cfg.vocab_size
        maxes, idxs, sums = [], [], []
        for (lo, hi), w, d in zip(self.vocab_ranges, self.head_slices, self.devices):
            hi = min(hi, limit)
            if hi <= lo:
                continue
            local = F.linear(hidden.to(d, non_blocking=True), w[: hi - lo]).float()
            m, i = local.max(dim=-1)
            z = torch.exp(local - m[:, None]).sum(dim=-1)
            maxes.append(m.to(self.device, non_blocking=True))
            idxs.append((i + lo).to(self.device, non_blocking=True))
            sums.append(z.to(self.device, non_blocking=True))
        m, i, z = torch.stack(maxes), torch.stack(idxs), torch.stack(sums)  # [S, T]
        best = m.argmax(dim=0)  # first (lowest-id) slice on ties
        top = m.gather(0, best[None])[0]
        total = (z * torch.exp(m - top[None])).sum(dim=0)
        return i.gather(0, best[None])[0], 1.0 / total

    # ---- MTP head -----------------------------------------------------------------------------------
    def mtp_forward(self, tokens: torch.Tensor, hiddens: torch.Tensor, start, state: SessionState) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        plan = self.split_plan(tokens.shape[0], start)
        lead = self.shards[0]
        w = lead.w
        e = ops.rmsnorm(F.embedding(tokens, w["embed_tokens.weight"]), w["mtp.pre_fc_norm_embedding.weight"], eps)
        hn = ops.rmsnorm(hiddens, w["mtp.pre_fc_norm_hidden.weight"], eps)
        x0 = lead.linear(torch.cat((e, hn), dim=-1), w["mtp.fc.weight"])
        xs = [self._on(x0, dev, local) for _, dev, local in plan]
        starts = [self._on(start, dev, local) for _, dev, local in plan]
        for j in range(self.cfg.mtp_num_hidden_layers):
            p = f"mtp.layers.{j}."

            def mixer(sh, st, h, s0, p=p, j=j):
                return sh._attention(p, h, s0, st.mtp_k_cache[j], st.mtp_v_cache[j])

            xs = self._decoder_layer(p, plan, state, xs, starts, mixer)
        return ops.rmsnorm(xs[0], w["mtp.norm.weight"], eps)
