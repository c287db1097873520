"""The target model and the MTP draft head: forward passes over T tokens of one session.

Reads like the architecture (see shared notes 01): embeddings; per layer x += mixer(norm(x)),
x += mlp(norm(x)); final norm; LM head. Custom ops come from `kernels` (a CUDA kernel on the GPU,
the PyTorch reference elsewhere); GEMMs are PyTorch's, or with gemm "cupy"/"auto" the gemv kernels for
decode-sized products (engine/gemm.py).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import ops

from .config import ModelConfig
from .gemm import GemvProducts, autotuned_linear, check_mode, gemv_products
from .parallel import Group, vocab_slice
from .state import SessionState

# Batches up to this many tokens use the recurrent delta rule (a plane per token, so rollback works
# anywhere inside them); longer ones (prefill) use the chunked GEMM form.
RECURRENT_MAX_TOKENS = 32
# Plans captured with programmatic dependent launch by default on GPUs that have it: on the H200 it was >= 1.0x
# in every configuration measured side by side (bench/gpu_bench.py --sections pdl), and the gemv kernels'
# weight loads before PDL's wait only pay with it. The model option "pdl" turns it off.
PDL_DEFAULT = True


class Model:
    """The target and the MTP head on one device, or one rank's shard of them (`group` of several ranks:
    `cfg` holds that shard's head counts, `weights` its slices, as `parallel.shard_weights` makes them;
    the LM head in `weights` is whole and is sliced or mirrored here)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        has_mtp: bool,
        group: Group | None = None,
        parameter_count: int | None = None,
        device_names: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        self.has_mtp = has_mtp
        self.group = group or Group()
        self.device = weights["embed_tokens.weight"].device
        self.dtype = weights["embed_tokens.weight"].dtype
        rot = cfg.rotary_dim
        self.inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=self.device) / rot)
        )
        self.scale = cfg.head_dim**-0.5
        tied = cfg.tie_word_embeddings
        self.parameter_count = parameter_count or sum(
            t.numel() for n, t in weights.items() if not (tied and n == "lm_head.weight")
        )
        self.device_names = device_names or [str(self.device)]
        self.gemm = "cublas"
        self._one_token_linear = None
        self._gemv: GemvProducts | None = None  # gemm modes "cupy" and "auto" (engine/gemm.py)
        # Several ranks, on rank 0: called while it waits for a round, raises when a worker is lost.
        self.watch: Callable[[], None] | None = None
        # The output layer. One device: the whole head. Several ranks: a vocabulary slice each, and the
        # whole head as well while `mirror_output` is on (built from the host copy, or the tied embedding).
        self.mirror = False
        self.combine = "argmax"  # vocab-parallel pick: distributed argmax, or "gather" the logits (before)
        # proj_add_norm as one launch (the gemv kernel's fused add + norm) where a gemv kernel makes the product;
        # off only to measure the two-launch form against it (bench/gpu_bench.py pdl)
        self.fuse_norm = True
        # the delta-net's in_proj product and its decode step as one launch (the gemv kernel's "_dr" form) where a
        # gemv kernel makes the product (engine/gemm.py _RULE_VARIANT says where); off only to measure the two-launch
        # form against it (bench/decode_ab.py --rule-ab)
        self.fuse_rule = True
        # the MLP of one row (gate|up + silu_mul, down + add + norm) as one launch (the gemv kernel's "_mlp" form)
        # where gemm mode "auto" measured it faster or "cupy" takes it (engine/gemm.py mlp_choice); off only to
        # measure the launches it replaces against it (bench/decode_ab.py --mlp-ab)
        self.fuse_mlp = True
        # the norm after a layer's output projection left to its MLP where that is one resident launch of one row
        # and the norm's weight is folded into it (fold_norms; GemvProducts.add_mlp_add_rmsnorm: the projection
        # stores the residual stream only, the MLP's warps scale by the norm after their FMAs); off only to measure
        # it (bench/decode_ab.py --defer-ab)
        self.defer_norm = True
        # ... and the norm after that MLP left to the next layer's fused in_proj launch where its weight is folded
        # there (fold_norms); off only to measure it (bench/decode_ab.py --defer-next-ab)
        self.defer_next = True
        # ... where the next layer is an attention layer whose qkv product norms its own input in its launch
        # (GemvProducts.product_norms; its input norm's weight folded into qkv_packed: fold_norms); off only to
        # measure it (bench/decode_ab.py --defer-attn-ab: the MLP then makes that norm, with the zeroed weight; on an
        # H100, 192.1 against 191.5 t/s a 9B-like token, 8 attention layers: bench/results/h100-balance-2026-12-06.txt)
        self.defer_attn = True
        # the layer prefixes whose post-attention norm weight is folded into their MLP's gate|up (fold_norms)
        self._folded: set[str] = set()
        # the layers whose input norm weight is folded into their first product (fold_norms): a delta-net's in_proj,
        # an attention layer's qkv; the MLP before each leaves that norm to that product's launch (out_mlp's defer_next)
        self._folded_in: set[int] = set()
        # plans captured with programmatic dependent launch (option "pdl", kernels/pdl.py): on by default where
        # the GPU and driver have it (sm_90+), set below once the rest is in place
        self.pdl = False
        self.head_slice: torch.Tensor | None = None  # several ranks: this rank's vocabulary rows
        if self.group.active:
            full = weights.pop("lm_head.weight")
            self._head_host = None if tied else full.to("cpu")
            self.vocab_lo, self.vocab_hi = vocab_slice(cfg.vocab_size, self.group.rank, self.group.world)
            source = weights["embed_tokens.weight"] if tied else full
            self.head_slice = source[self.vocab_lo : self.vocab_hi].to(self.device, copy=True)
            self.head: torch.Tensor | None = None
        else:
            self.head = weights["lm_head.weight"]
        # The draft's sub-vocabulary order (engine/subvocab.py), K ids most useful first, or none (id order).
        # remap_ids [K] on the device maps a scored row back to its token id inside the draft plan; remap_head
        # [K, H] holds the head's rows in that order (gathered once, contiguous) wherever the whole head is (one
        # device, or mirrored); vocab-parallel, each rank keeps the rows of its own slice (remap_local_*), in
        # order, and _remap_pos says where in the order each of them sits.
        self.remap_ids: torch.Tensor | None = None
        self.remap_head: torch.Tensor | None = None
        self.remap_local_ids: torch.Tensor | None = None
        self.remap_local_head: torch.Tensor | None = None
        self._remap_pos: list[int] = []
        self._head_version = 0  # in plan_tag, bumped when the head or the order's rows are re-made: a plan never outlives the tensors it read
        self._pack()
        if self.device.type == "cuda" and PDL_DEFAULT:
            try:
                self.set_option("pdl", True)
            except Exception:  # noqa: BLE001 - no CuPy or no driver entry point: plans launch as before
                self.pdl = False

    def _pack(self) -> None:
        """Projections that read the same input become one GEMM (q|k|v; delta-net qkv|z|b|a; MLP gate|up):
        fewer launches and one long weight read instead of several short ones. Constants are folded."""
        w = self.w
        for name in list(w):
            if name not in w:
                continue
            if name.endswith("self_attn.q_proj.weight"):
                p = name[: -len("q_proj.weight")]
                parts = [w.pop(p + n) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")]
                w[p + "qkv_packed"] = torch.cat(parts).contiguous()
            elif name.endswith("linear_attn.in_proj_qkv.weight"):
                p = name[: -len("in_proj_qkv.weight")]
                parts = [w.pop(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
                w[p + "in_proj_packed"] = torch.cat(parts).contiguous()
                w[p + "neg_exp_A"] = -w[p + "A_log"].float().exp()
            elif name.endswith("mlp.gate_proj.weight"):
                p = name[: -len("gate_proj.weight")]
                parts = [w.pop(p + n) for n in ("gate_proj.weight", "up_proj.weight")]
                w[p + "gate_up_packed"] = torch.cat(parts).contiguous()

    def set_gemm(self, mode: str, cache_dir=None) -> None:
        """The GEMM backend of decode-sized products: "cublas", "autotune", "cupy", "auto" or "exact" (engine/gemm.py).
        "auto" chooses per weight shape and row bucket now (from the autotune cache in `cache_dir`, None: the
        default folder, or by measuring)."""
        check_mode(mode, self.device)
        self._one_token_linear = autotuned_linear() if mode == "autotune" else None
        gemv_modes = ("cupy", "auto", "exact")
        self._gemv = gemv_products(mode, self.device, self.dtype, cache_dir) if mode in gemv_modes else None
        if self.device.type == "cuda":
            ops.set_row_invariant(mode == "exact")  # decode attention too (process-wide: the kernels' setting)
        self.gemm = mode
        if self._gemv is not None:
            gate_up = {tuple(t.shape) for name, t in self.w.items() if name.endswith("gate_up_packed")}
            # the projections proj_add_norm makes in one launch with the residual add and the next norm
            joins = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
            fused = self.fuse_norm and not self.group.active
            norm = {tuple(t.shape) for name, t in self.w.items() if name.endswith(joins)} if fused else set()
            self._gemv.tune(self.product_weights(), activation=gate_up, norm=norm)
            if fused:
                self._gemv.tune_mlp(self._mlp_pairs())
                self.fold_norms()
            in_proj = [t for name, t in self.w.items() if name.endswith("in_proj_packed")]
            self._gemv.prepare_rule(in_proj, self.cfg.linear_key_head_dim)

    @property
    def gemm_choices(self) -> dict[str, str]:
        """gemm modes "cupy"/"auto": the product chosen per weight shape and row bucket so far ({} otherwise)."""
        return self._gemv.labels if self._gemv is not None else {}

    @property
    def gemm_notice(self) -> str:
        """One line when the gemm mode could not do what it was asked (kernels unavailable, cache rebuilt)."""
        return self._gemv.notice if self._gemv is not None else ""

    def product_weights(self) -> dict[tuple[int, int], list[torch.Tensor]]:
        """The weights of the model's products, by shape [N, K] (the LM head and its gathered rows included)."""
        ends = ("qkv_packed", "in_proj_packed", "gate_up_packed", "o_proj.weight", "out_proj.weight")
        ends += ("down_proj.weight", "mtp.fc.weight")
        found = [t for name, t in self.w.items() if name.endswith(ends) and t.dim() == 2]
        found += [t for t in (self.head, self.head_slice, self.remap_head, self.remap_local_head) if t is not None]
        shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
        for t in found:
            shapes.setdefault((t.shape[0], t.shape[1]), []).append(t)
        return shapes

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T: decode-sized products through the chosen backend, everything else cuBLAS."""
        if self._gemv is not None:
            return self._gemv(x, weight)
        fn = self._one_token_linear
        if fn is not None and x.dim() == 2 and x.shape[0] == 1:
            return fn(x, weight)
        return F.linear(x, weight)

    def _head_product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """An LM-head product (the whole head, a slice of it, the gathered sub-vocab rows): the gemv modes'
        choice, else cuBLAS ("autotune" compiles only the layers' one-token products)."""
        return self._gemv(x, weight) if self._gemv is not None else F.linear(x, weight)

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection: this rank's partial product, summed over the ranks. Where the sum
        goes through symmetric memory, cuBLAS writes the partial straight into the shared buffer."""
        g = self.group
        if not g.active:
            return self.linear(x, weight)
        out = g.symmetric_out(x.shape[0], weight.shape[0], x.dtype)
        if out is None or (self._one_token_linear is not None and x.shape[0] == 1):
            return g.all_reduce(self.linear(x, weight))
        if self._gemv is not None and self._gemv.takes(x, weight):
            out.copy_(self._gemv(x, weight))
        else:
            torch.mm(x, weight.t(), out=out)
        return g.reduce_symmetric(out)

    # ---- layers -----------------------------------------------------------------------------
    def proj_add_norm(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A row-parallel projection whose output joins the residual stream, and the norm after it:
        add_rmsnorm(row_parallel(x, weight), residual, norm_weight) -> (normed, new residual). On one GPU with a
        gemv kernel making the product, one launch (the product, its split-K sum, the add and the norm; the new
        residual bit for bit the same, the normed rows within a rounding, each row alike whatever rows come with
        it)."""
        if self._gemv is not None and not self.group.active and self.fuse_norm:
            return self._gemv.add_rmsnorm(x, weight, residual, norm_weight, eps)
        return ops.add_rmsnorm(self.row_parallel(x, weight), residual, norm_weight, eps)

    def fold_norms(self) -> None:
        """The deferred norm's weights (issue 20): where the MLP of one row is the resident launch, the weight of the
        norm before it (post_attention_layernorm, zero-centred: y = s rsq (1 + w)) is folded into its gate|up (each
        column k times 1 + w[k], in fp32, rounded to the dtype once) and zeroed, so that norm is a scale alone, which
        the MLP's warps apply after their FMAs (GemvProducts.add_mlp_add_rmsnorm). The same function within a rounding
        of the weight, on every path (the others norm with the zero weight, then the folded product). Once a layer;
        one GPU only."""
        if self._gemv is None or self.group.active or self._gemv.mode == "exact":
            return
        ends = "mlp.gate_up_packed"
        row = torch.empty((1, self.cfg.hidden_size), dtype=self.dtype, device=self.device)  # a one-row input's shape
        for name, gate_up in self.w.items():
            p = name[: -len(ends)]
            if not name.endswith(ends) or p in self._folded:
                continue
            down = self.w[p + "mlp.down_proj.weight"]
            if not self._gemv.mlp_choice(row, gate_up, down).startswith("res"):
                continue
            _fold_norm(gate_up, self.w[p + "post_attention_layernorm.weight"])
            self._folded.add(p)
        # The norm after such an MLP where the next layer's first product norms its own input: a delta-net's fused
        # in_proj launch (GemvProducts.rule_norms), an attention layer's qkv product (product_norms): its weight into
        # that product's columns, the MLP then storing s only.
        for i, kind in enumerate(self.cfg.layer_types):
            if i == 0 or i in self._folded_in or f"layers.{i - 1}." not in self._folded:
                continue
            if kind == "full_attention":
                w_in = self.w[f"layers.{i}.self_attn.qkv_packed"]
                norms = self._gemv.product_norms(row, w_in)
            else:
                w_in = self.w[f"layers.{i}.linear_attn.in_proj_packed"]
                norms = self._gemv.rule_norms(row, w_in)
            if not norms:
                continue
            _fold_norm(w_in, self.w[f"layers.{i}.input_layernorm.weight"])
            self._folded_in.add(i)

    def _mlp_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(packed gate|up, down) of every MLP of the model (its layers', the MTP head's)."""
        w = self.w
        ends = "mlp.gate_up_packed"
        return [(t, w[n[: -len(ends)] + "mlp.down_proj.weight"]) for n, t in w.items() if n.endswith(ends)]

    def mlp_add_norm(
        self, p: str, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of layer prefix p on x, its output joining the residual stream, and the norm after it:
        proj_add_norm(_mlp(p, x), down, residual, norm_weight). On one GPU with the gemv kernels, for one row, one
        launch where the gemm mode chose it (GemvProducts.mlp_add_rmsnorm: the same bits as the launches it
        replaces)."""
        w_down = self.w[p + "mlp.down_proj.weight"]
        if self._gemv is not None and not self.group.active and self.fuse_norm and self.fuse_mlp:
            return self._gemv.mlp_add_rmsnorm(x, self.w[p + "mlp.gate_up_packed"], w_down, residual, norm_weight, eps)
        return self.proj_add_norm(self._mlp(p, x), w_down, residual, norm_weight, eps)

    def out_mlp(
        self,
        p: str,
        a: torch.Tensor,
        out_w: torch.Tensor,
        residual: torch.Tensor,
        post_norm: torch.Tensor,
        next_norm: torch.Tensor,
        eps: float,
        defer_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rest of layer prefix p after its mixer's output a: proj_add_norm(a, out_w, residual, post_norm), then
        mlp_add_norm with the next norm -> (normed, new residual). On one GPU with the gemv kernels, where the MLP is
        one resident launch of one row, the projection leaves its norm to the MLP (GemvProducts.add_mlp_add_rmsnorm:
        no norm at the end of the projection's launch; the same rows within a rounding), and where defer_next (the
        next layer's input norm is folded into its first product, which norms it: _defers_to) the MLP leaves the next
        norm to that layer: (None, residual)."""
        if self._gemv is not None and not self.group.active and self.fuse_norm and self.fuse_mlp and self.defer_norm:
            gate_up, down = self.w[p + "mlp.gate_up_packed"], self.w[p + "mlp.down_proj.weight"]
            folded = p in self._folded
            return self._gemv.add_mlp_add_rmsnorm(
                a, out_w, residual, post_norm, gate_up, down, next_norm, eps, folded, defer_next
            )
        h, residual = self.proj_add_norm(a, out_w, residual, post_norm, eps)
        return self.mlp_add_norm(p, h, residual, next_norm, eps)

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """The MLP up to its down projection (which mlp_add_norm makes, through proj_add_norm where the MLP is not
        one launch). With a gemv kernel making the gate|up
        product, the activation is in the same launch (the same bits as the product then silu_mul)."""
        w = self.w[p + "mlp.gate_up_packed"]
        if self._gemv is not None:
            return self._gemv.silu_mul(x, w)
        return ops.silu_mul(self.linear(x, w))

    def _attention(
        self,
        p: str,
        x: torch.Tensor,
        start: int | torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        x_eps: float | None = None,
    ) -> torch.Tensor:
        """The attention mixer of layer prefix p on its normed input x, or with x_eps on the residual stream x whose
        input norm is folded into qkv_packed (fold_norms; the qkv product norms it: GemvProducts.norm_product)."""
        cfg, w = self.cfg, self.w
        t = x.shape[0]
        d = cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        w_qkv = w[p + "self_attn.qkv_packed"]
        qkv = self.linear(x, w_qkv) if x_eps is None else self._gemv.norm_product(x, w_qkv, x_eps)
        qg, k, v = qkv.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
        qg = qg.reshape(t, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        k, v = k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        # q/k norms, RoPE and the cache write in one op; the output gate is applied by the attention op.
        q = ops.attn_prep(
            q,
            k,
            v,
            w[p + "self_attn.q_norm.weight"],
            w[p + "self_attn.k_norm.weight"],
            cfg.rms_norm_eps,
            self.inv_freq,
            k_cache,
            v_cache,
            start,
        )
        # up to the output projection (which proj_add_norm makes)
        return ops.attention_cached(q, k_cache, v_cache, start, self.scale, gate).reshape(t, -1)

    def _delta_net(
        self,
        i: int,
        x: torch.Tensor,
        state: SessionState,
        start: int | torch.Tensor,
        recurrent: bool,
        x_eps: float | None = None,
    ) -> torch.Tensor:
        """Layer i's delta-net mixer on its normed input x, or (x_eps given: the MLP before left the norm to it) on the
        residual stream x, whose norm has its weight folded into in_proj (fold_norms)."""
        cfg, w = self.cfg, self.w
        fused = recurrent and self._gemv is not None and self.fuse_rule
        if x_eps is not None and not fused:
            x, x_eps = ops.unit_rmsnorm(x, x_eps), None
        p = f"layers.{i}.linear_attn."
        t = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        w_in = w[p + "in_proj_packed"]
        # up to the output projection (which proj_add_norm makes)
        if recurrent:  # decode and verify: the conv, the gates, the rule and the output norm in one launch
            step = (
                state.conv_planes[i], w[p + "conv1d.weight"], hk, w[p + "neg_exp_A"], w[p + "dt_bias"],
                state.delta_planes[i], start, w[p + "norm.weight"], cfg.rms_norm_eps,
            )  # fmt: skip
            if fused:  # with the product too, where a gemv kernel makes it
                return self._gemv.conv_delta_rule_norm(x, w_in, *step, x_eps).reshape(t, hv * dv)
            return ops.in_proj_step(self.linear(x, w_in), *step).reshape(t, hv * dv)
        qkv, z, b, a = self.linear(x, w_in).split([cfg.conv_dim, hv * dv, hv, hv], dim=-1)
        z = z.reshape(t, hv, dv)
        qkv = ops.conv_update(qkv, state.conv_planes[i], w[p + "conv1d.weight"], start)
        q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
        g, beta = ops.gdn_gates(a, b, w[p + "neg_exp_A"], w[p + "dt_bias"])
        o = ops.chunk_gated_delta_rule(q, k, v, g, beta, state.delta_planes[i], start)
        return ops.gated_rmsnorm(o, z, w[p + "norm.weight"], cfg.rms_norm_eps).reshape(t, hv * dv)

    # ---- target -----------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, state: SessionState) -> torch.Tensor:
        """Consume T tokens at positions state.target_len ..; returns post-norm hidden states [T, H].

        Writes KV and snapshot planes, and tags the planes (host bookkeeping). Used for prefill and by
        tests; decode rounds call `forward_layers` with a device-side start and tag the planes themselves.
        """
        start = state.target_len
        t = ids.shape[0]
        if start + t > state.max_context:
            raise ValueError(f"context overflow: {start + t} > {state.max_context}")
        recurrent = t <= min(RECURRENT_MAX_TOKENS, state.n_planes - 1)
        hidden = self.forward_layers(ids, state, start, recurrent)
        state.record_batch(start, t, every_plane=recurrent)
        return hidden

    def forward_layers(
        self, ids: torch.Tensor, state: SessionState, start: int | torch.Tensor, recurrent: bool
    ) -> torch.Tensor:
        """The target's layers over T tokens starting at `start` (a host int, or a device tensor, which is
        what a captured graph reads). Pure device work: no host bookkeeping, no host reads with kernels."""
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        n = cfg.num_layers
        h, residual = ops.embed_rmsnorm(ids, w["embed_tokens.weight"], w["layers.0.input_layernorm.weight"], eps)
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            # h None: the MLP before left this layer's input norm to its first product's launch (qkv, in_proj)
            x, x_eps = (residual, eps) if h is None else (h, None)
            if kind == "full_attention":
                a = self._attention(p, x, start, state.k_cache[i], state.v_cache[i], x_eps)
                out_w = w[p + "self_attn.o_proj.weight"]
            else:
                a = self._delta_net(i, x, state, start, recurrent, x_eps)
                out_w = w[p + "linear_attn.out_proj.weight"]
            # The residual add after the MLP is fused into the next norm (the next layer's, or the final one).
            next_norm = w[f"layers.{i + 1}.input_layernorm.weight"] if i + 1 < n else w["norm.weight"]
            h, residual = self.out_mlp(
                p,
                a,
                out_w,
                residual,
                w[p + "post_attention_layernorm.weight"],
                next_norm,
                eps,
                self._defers_to(i + 1),
            )
        return h

    def _defers_to(self, j: int) -> bool:
        """Whether the MLP before layer j leaves j's input norm to j's first product (fold_norms folded it there, and
        the switch for j's kind is on: defer_next, and defer_attn for an attention layer)."""
        if j not in self._folded_in or not self.defer_next:
            return False
        return self.defer_attn or self.cfg.layer_types[j] != "full_attention"

    def pick(
        self, hidden: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy pick per row over the first n vocabulary ids (0 = all): (token, prob) on the device, written
        into `out` (token, prob) when given. Vocab-parallel: each rank sends (max, index, sum of exp) per row,
        never its logits."""
        if self._logits_whole:
            return ops.argmax_prob(self.lm_head(hidden, n), n, out)
        limit = n if n > 0 else self.cfg.vocab_size
        hi = min(self.vocab_hi, limit)
        local = self._head_product(hidden, self.head_slice[: hi - self.vocab_lo]) if hi > self.vocab_lo else None
        return _into(out, *self._distributed_argmax(hidden.shape[0], local, self.vocab_lo))

    @property
    def _logits_whole(self) -> bool:
        """Whether lm_head gives this rank every logit (one device, a mirrored head, or logits gathered), so a pick
        is the argmax kernel over them rather than the distributed argmax."""
        return self.head is not None or self.combine == "gather"

    def pick_accept(
        self,
        hidden: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor,
        p_min: float,
        cache_len: torch.Tensor,
        out: torch.Tensor,
        start: torch.Tensor,
    ) -> None:
        """The verify's greedy pick over all ids and its acceptance of `drafts` (ops.greedy_accept's writes to `out`
        and `cache_len`): one launch where the logits are whole on this rank (ops.argmax_greedy_accept)."""
        if self._logits_whole:
            ops.argmax_greedy_accept(self.lm_head(hidden, 0), 0, drafts, draft_probs, p_min, cache_len, out, start)
            return
        target_tokens, _ = self.pick(hidden, 0)
        ops.greedy_accept(drafts, draft_probs, target_tokens, p_min, cache_len, out, start)

    def _distributed_argmax(
        self, t: int, local: torch.Tensor | None, ids: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax and its probability over every rank's `local` logits [T, c] (None: this rank scores
        nothing), whose column j is token id `ids + j` (an offset) or `ids[j]` (a device tensor)."""
        if local is not None:
            local = local.float()
            m, i = local.max(dim=-1)
            z = torch.exp(local - m[:, None]).sum(dim=-1)
            tok = i + ids if isinstance(ids, int) else ids.index_select(0, i)
            mine = torch.stack((m, tok.float(), z))  # [3, T]; ids < 2^24 are exact
        else:  # this rank's slice lies past the sub-vocabulary
            mine = torch.zeros((3, t), device=self.device)
            mine[0].fill_(float("-inf"))
        every = self.group.all_gather(mine)  # [W, 3, T]
        m, i, z = every[:, 0], every[:, 1], every[:, 2]
        best = m.argmax(dim=0)  # the first (lowest-id) slice on ties, like one argmax over all ids
        top = m.gather(0, best[None])[0]
        total = (z * torch.exp(m - top[None])).sum(dim=0)
        return i.gather(0, best[None])[0].long(), 1.0 / total

    # ---- the draft's sub-vocabulary ---------------------------------------------------------------
    def draft_ids(self, n: int) -> torch.Tensor | None:
        """The token ids of the n columns a sub-vocab draft scores, as a device tensor, when a sub-vocabulary
        order holds them (0 < n <= its size); None when the draft scores ids 0..n-1 (or all, n = 0)."""
        if self.remap_ids is None or not 0 < n <= self.remap_ids.shape[0]:
            return None
        return self.remap_ids[:n]

    def draft_pick(
        self, hidden: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy (token, prob) per row over the draft's n-id sub-vocabulary (0 = all): the first n ids of
        the sub-vocabulary order when there is one that holds them, else ids 0..n-1 (`pick`). The pick is
        mapped back to its token id on the device; prob is over the n scored ids. Written into `out` (token,
        prob) when given (the chained draft's step slots: no copy after the pick where the kernel writes them)."""
        ids = self.draft_ids(n)
        if ids is None:
            return self.pick(hidden, n, out)
        if self._logits_whole:
            tok, prob = ops.argmax_prob(self.draft_logits(hidden, n), 0)
            return _into(out, ids.index_select(0, tok), prob)
        c = bisect.bisect_left(self._remap_pos, n)  # this rank's rows among the first n of the order
        local = self._head_product(hidden, self.remap_local_head[:c]) if c else None
        return _into(out, *self._distributed_argmax(hidden.shape[0], local, self.remap_local_ids[:c]))

    def draft_logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [T, n] over the draft's n-id sub-vocabulary (0 = all), column j being token `draft_ids(n)[j]`
        (ids 0..n-1 when that is None). Vocab-parallel without a mirror: whole rows gathered, then picked."""
        ids = self.draft_ids(n)
        if ids is None:
            return self.lm_head(hidden, n)
        if self.remap_head is not None:
            return self._head_product(hidden, self.remap_head[:n])
        return self.lm_head(hidden).index_select(1, ids)

    @property
    def remap_size(self) -> int:
        """K, the size of the sub-vocabulary order in use (0: none, the draft scores ids in id order)."""
        return 0 if self.remap_ids is None else self.remap_ids.shape[0]

    def set_sub_vocab_order(self, ids: list[int] | tuple[int, ...] | None) -> None:
        """Use this order of token ids for sub-vocab drafts (checked by the caller: distinct, in range), or
        none (None). Gathers the head's rows once: K x hidden on this device (vocab-parallel: this rank's
        share, plus all K while the head is mirrored)."""
        self.remap_ids = self.remap_head = self.remap_local_ids = self.remap_local_head = None
        self._remap_pos = []
        self._head_version += 1
        if ids is None:
            return
        self.remap_ids = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        if self.group.active:
            lo, hi = self.vocab_lo, self.vocab_hi
            self._remap_pos = [j for j, t in enumerate(ids) if lo <= t < hi]
            local = torch.tensor([ids[j] for j in self._remap_pos], dtype=torch.long, device=self.device)
            self.remap_local_ids = local
            self.remap_local_head = self.head_slice.index_select(0, local - lo)
        self._gather_remap_head()

    def _gather_remap_head(self) -> None:
        """remap_head: the whole head's rows in the order's order, wherever the whole head is held."""
        ok = self.remap_ids is not None and self.head is not None
        self.remap_head = self.head.index_select(0, self.remap_ids) if ok else None

    def sync(self, until: torch.cuda.Event | None = None) -> None:
        """Wait for this device's queued work (the round's one synchronisation), or only up to the recorded event
        `until` (work queued after it keeps running). With a `watch`, poll instead of blocking, so that a lost
        worker (whose collective would never complete) is noticed."""
        if self.watch is None:
            if until is not None:
                until.synchronize()
            else:
                torch.cuda.current_stream(self.device).synchronize()
            return
        done = until
        if done is None:
            done = torch.cuda.Event()
            done.record()
        next_check = 0.0
        while not done.query():
            now = time.monotonic()
            if now >= next_check:
                self.watch()
                next_check = now + 0.01

    def configure(self, settings) -> None:
        """Apply settings that change what the model holds: on several ranks, the mirrored output layer
        (called at the same round boundary on every rank)."""
        if not self.group.active or bool(settings.mirror_output) == self.mirror:
            return
        if settings.mirror_output:
            tied = self.cfg.tie_word_embeddings
            self.head = self.w["embed_tokens.weight"] if tied else self._head_host.to(self.device)
        else:
            self.head = None
        self.mirror = bool(settings.mirror_output)
        self._gather_remap_head()
        # The head (and the order's rows) are new tensors: a plan captured before, under the same mirror
        # setting, would read the freed ones after a toggle back. A new version keys new plans.
        self._head_version += 1

    def set_option(self, name: str, value) -> None:
        """Model options that are not user knobs (the bench's "gather" combine; the sub-vocab order; PDL)."""
        if name == "sub_vocab_order":
            self.set_sub_vocab_order(value)
            return
        if name == "pdl":  # on where the driver and GPU allow it (sm_90+), for plans captured from now on
            if not isinstance(value, bool):
                raise ValueError(f"model option pdl takes True or False, got {value!r}")
            on = False
            if self.device.type == "cuda":
                from kernels import cuda as kcuda

                on = kcuda.set_pdl(value)
            self.pdl = on
            return
        if name != "combine" or value not in ("argmax", "gather"):
            raise ValueError(f"unknown model option {name}={value!r}")
        self.combine = value

    @property
    def plan_tag(self) -> tuple:
        """Anything beyond the batch shape that a captured plan depends on."""
        tag = (self.gemm, self.mirror, self.combine) if self.group.active else (self.gemm,)
        tag = (*tag, "pdl") if self.pdl else tag
        tag = tag if self.fuse_rule else (*tag, "two-launch delta step")
        tag = tag if self.fuse_mlp else (*tag, "MLP in several launches")
        tag = tag if self.defer_norm else (*tag, "norm in the projection")
        tag = tag if self.defer_next else (*tag, "norm in the MLP")
        return (*tag, self._head_version) if self._head_version else tag

    @property
    def capturable(self) -> bool:
        return self.device.type == "cuda"

    def new_state(self, max_context: int, n_planes: int) -> SessionState:
        return SessionState(self.cfg, self.device, self.dtype, max_context, n_planes, self.has_mtp)

    def weight_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held, by device (shared tensors counted once)."""
        held = (
            self.head,
            self.head_slice,
            self.remap_ids,
            self.remap_head,
            self.remap_local_ids,
            self.remap_local_head,
        )
        extra = [t for t in held if t is not None]
        return {str(self.device): [*self.w.values(), *extra]}

    def lm_head(self, hidden: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """Logits over the first `rows` vocabulary ids (0 = all): the sub-vocab head is a view. Vocab-parallel
        without a mirror: every rank's slice gathered (the whole row crosses between the GPUs)."""
        if self.head is not None:
            return self._head_product(hidden, self.head[:rows] if rows else self.head)
        per = -(-self.cfg.vocab_size // self.group.world)
        local = self._head_product(hidden, self.head_slice)
        if local.shape[-1] < per:
            local = F.pad(local, (0, per - local.shape[-1]))
        every = self.group.all_gather(local)  # [W, T, per]
        logits = every.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, : self.cfg.vocab_size]
        return logits[:, :rows] if rows else logits

    # ---- MTP draft head -------------------------------------------------------------------------
    def mtp_forward(self, tokens: torch.Tensor, hiddens: torch.Tensor, start: int, state: SessionState) -> torch.Tensor:
        """MTP rows start .. start+T-1: row r pairs token r+1 with the hidden of position r.

        e = norm_e(embed(token)); hn = norm_h(hidden); x = fc(cat(e, hn)) (embedding first);
        x = decoder layer (full attention, own KV cache, RoPE position r); returns y = mtp.norm(x) [T, H],
        which is both the input hidden of a chained next step and the input of the LM head.
        """
        w, eps = self.w, self.cfg.rms_norm_eps
        # embedding gather, both norms and the concatenation: one kernel on a GPU
        pre = ops.mtp_prefc(
            tokens,
            hiddens,
            w["embed_tokens.weight"],
            w["mtp.pre_fc_norm_embedding.weight"],
            w["mtp.pre_fc_norm_hidden.weight"],
            eps,
        )
        x = self.linear(pre, w["mtp.fc.weight"])
        layers = len(state.mtp_k_cache)
        if not layers:
            return ops.rmsnorm(x, w["mtp.norm.weight"], eps)
        h = ops.rmsnorm(x, w["mtp.layers.0.input_layernorm.weight"], eps)
        for j in range(layers):
            p = f"mtp.layers.{j}."
            a = self._attention(p, h, start, state.mtp_k_cache[j], state.mtp_v_cache[j])
            # x + MLP(h), then the next layer's input norm, or the final one: one add_rmsnorm
            nxt = w[f"mtp.layers.{j + 1}.input_layernorm.weight"] if j + 1 < layers else w["mtp.norm.weight"]
            h, x = self.out_mlp(
                p, a, w[p + "self_attn.o_proj.weight"], x, w[p + "post_attention_layernorm.weight"], nxt, eps
            )
        return h


def _into(
    out: tuple[torch.Tensor, torch.Tensor] | None, tok: torch.Tensor, prob: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tok, prob), copied into `out` when given (the paths whose kernels do not write there themselves)."""
    if out is None:
        return tok, prob
    out[0].copy_(tok)
    out[1].copy_(prob)
    return out


def _fold_norm(w: torch.Tensor, norm: torch.Tensor) -> None:
    """A zero-centred norm's weight folded into the product w [N, K] that reads its output (each column k times
    1 + norm[k], in fp32 a slice at a time, rounded to w's dtype once), then zeroed (Model.fold_norms)."""
    scale = 1.0 + norm.float()
    for lo in range(0, w.shape[0], 4096):
        part = w[lo : lo + 4096]
        part.copy_((part.float() * scale[None, :]).to(part.dtype))
    norm.zero_()
