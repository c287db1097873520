"""How the model's decode-sized products are computed: the GEMM backend (`Engine.load(gemm=...)`, `--gemm`).

- "cublas" (default): `F.linear`, i.e. cuBLAS on the GPU. Nothing to compile.
- "autotune": one-token products go through `torch.compile` with max-autotune: at the first use of each
  weight shape PyTorch's compiler times its cuBLAS call against generated Triton GEMM kernels and keeps the
  fastest. Costs a few seconds per distinct weight shape, once, at the first round; needs CUDA and Triton.
  Products of more than one token and the LM head stay on `F.linear`.
- "cupy": every product of 1..17 rows (a target step, a verify of depth + 1 rows, the MTP head's rows, the LM
  head) goes through the CuPy gemv kernels (kernels/cuda_src/gemv_kernels.cu), their default launch per
  shape; more rows (prefill), or a dtype/layout the kernels do not take, stay on cuBLAS.
- "auto": per weight shape and row bucket (1, 2-4, 5-8, 9-17 rows), the fastest of cuBLAS and the gemv
  kernel variants, measured on the device with CUDA events (each candidate replayed from a CUDA graph over
  several distinct weights of that shape, so that L2 does not flatter it; a variant whose result disagrees
  with cuBLAS is never chosen). The model's own shapes are measured when the mode is set (at load), shapes
  first seen later (a sub-vocab slice of the LM head) at their first eager use, never inside a graph capture
  (a capture meeting an unmeasured shape uses the default launch). A shape whose product always has an epilogue
  is timed with it: the MLP's gate|up with its activation (cuBLAS + silu_mul against a variant's one-launch form,
  which needs a variant without K splits), the row-parallel projections that join the residual stream (o_proj,
  out_proj, down_proj) with the residual add and the next norm (cuBLAS + add_rmsnorm against any variant's
  one-launch form); the one-launch form is kept unless the two launches are more than 1% faster (`pick`).
  Choices are cached on disk per GPU (engine/gemm_cache.py), so a second load measures nothing.

- "exact": every product of 1..17 rows through one gemv variant per weight shape whose result for a row does not
  depend on how many rows come with it (CUDA cores, one K order), and decode attention split by the cache size
  only (kernels.cuda.set_row_invariant): a verify of d + 1 rows computes each row as a one-row step would, so
  speculative output equals greedy output bit for bit in bf16 too, not only in fp32. Costs some speed (no
  tensor cores, no per-bucket choice).

The choice per shape is in `Engine.info["gemm_choices"]` and each run's stats (`{"4096x4096 m1": "tc1.w8.s1",
...}`); a mode whose kernels cannot run here (CuPy missing, the gemv module failing to compile) keeps every
product on cuBLAS, with one notice line on stderr and in `Engine.info["gemm_notice"]`.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import ops

from .errors import EngineError
from .gemm_cache import TuneCache, cache_file, cache_key

GEMM_MODES = ("cublas", "autotune", "cupy", "auto", "exact")
# Row buckets of the gemv modes: a choice holds for every row count of its bucket (measured at the largest).
ROW_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 17))
# Autotune measurement: weights of a shape cycled per graph (distinct tensors, or clones up to ~3 x L2),
# products per graph, replays timed (the fastest counts).
_TUNE_MAX_WEIGHTS = 8
_TUNE_MIN_CALLS = 16
_TUNE_REPLAYS = 3
_TUNE_CLONE_BYTES = 512 << 20  # the most a measurement clones to get past L2
_TUNE_GRAPH_BYTES = 256 << 20  # weight bytes a timed graph reads, at least (at most _TUNE_MIN_CALLS calls)
# The shapes with an epilogue: cuBLAS then the epilogue's kernel is two launches, a gemv variant's fused form one
# (gate|up + silu_mul: a variant without K splits; one that splits K is its product then gemv_combine_sm, two, unless
# kernels/cuda.py _GEMV_SPLIT_SILU is on (off by default: measured slower), which makes it one where its tiles pair up;
# a projection + add_rmsnorm: any variant, its split sum is in the launch). The one-launch form is kept unless a
# form of two launches is faster by more than this fraction: the
# timing of each candidate repeats the same launches back to back, where the second launch costs nothing extra,
# while a decode step's graph pays for every launch (issue 20: launches per token). The rule is part of the cache
# key.
_ONE_LAUNCH_MARGIN = 0.01
# A projection + add_rmsnorm of several rows: the fused form's last blocks norm the rows once the product is done, a
# tail (3-4 us on the H200) that the back-to-back timing hides behind the next launch's weight loads (PDL), while in a
# decode step the kernel after it is often cuBLAS, which loads nothing early. On the H200 (bench/results/
# h200-gemv-tails-2026-12-02.txt) fused forms picked at 2-4 rows within a few percent of cuBLAS + add_rmsnorm made a
# speculative round 1.8-5.4% slower; so with more than one row the fused form must take this fraction less time.
_NORM_ROWS_MARGIN = 0.15
_PICK_RULE = "one-launch 1% over any (silu s1, norm); norm rows>1 fused 15% under cublas"
# the epilogues a shape can be timed with: the MLP's activation, the residual add + the next norm
EPILOGUES = ("silu", "norm")

# The delta-net's in_proj product + decode step in one launch (GemvProducts.conv_delta_rule_norm) where the product
# runs a gemv kernel: with the tensor-core tile variant (its occupancy is the same with the rule's registers, a
# CUDA-core variant's falls by three quarters; on a dtype or GPU without tensor cores the kernels' default), and
# only for a weight of at least _RULE_MIN_BYTES, whose product lasts long enough to hide the rule's pieces (9B-like,
# bench/in_proj_step.py: 33.8 against 36.2 us a layer at 1 row, 44.6 against 50.7 at 4; the bundled model's 0.6 MB
# in_proj was 1-4% slower fused). Mode "exact" keeps its row-invariant variant and the two launches.
_RULE_VARIANT = "tc2.w8.s1"
_RULE_MIN_BYTES = 32 << 20
# The MLP of one row in one launch (GemvProducts.mlp_add_rmsnorm; kernels/cuda.py gemv_mlp_add_rmsnorm): the CUDA-core
# variants of the down product it can run (the gate|up product takes the same warps), "auto" timing each against
# the launches it replaces (the gate|up and down choices with their epilogues); mode "cupy" takes _MLP_DEFAULT.
_MLP_VARIANTS = tuple(f"simt{c}.w{w}.s{s}" for c in (1, 2) for w in (4, 8) for s in (1, 2, 4)) + tuple(
    f"res{c}.w{w}.s1" for c in (1, 2) for w in (4, 8)
)  # res: every block resident, the activation staged once a block (bench/persistent_chain.py)
_MLP_DEFAULT = "simt2.w8.s2"
_MLP_LABEL = "m1 mlp"  # the cache's bucket label of the choice ("cublas" there: the launches it replaces)
# The one launch is taken only where it times this fraction faster than the separate launches: the back-to-back timing
# hides its tail (the last down blocks' norm) behind the next MLP's early start, which a decode step does not (the
# delta-net's in_proj follows). On the H200 (bench/results/h200-mlp-one-launch-2026-12-02.txt) the timing put the one
# launch 4.0% and 6.7% ahead in two runs and 1.6% behind in another, while decode was 1.1-2.4% slower with it every
# time (the separate launches' own timing moved by 9% between runs: a margin, not a tie-break).
_MLP_MARGIN = 0.10
# The resident variants' margin, negative: one is taken unless it times more than 2% slower than the separate
# launches. Their timing has no tail of the same kind to hide (every block is resident, the last block's norm is the
# launch's only tail), and a 9B-like MLP (302 MB) decoded faster with it in every run on the H200 and the H100:
# timed 2.6% and 4.1% ahead, decode 1.0% and 1.8% faster (bench/results/h200-persistent-chain-2026-12-03.txt
# section 5); but the timing moves between processes by more than its lead (3.4% ahead in one H100 process, under
# the former 2% margin in the next; there the separate launches it chose decoded 0.8% slower on the H100, 181.6
# against 183.0 t/s, and 1.2% on the H200, 233.7 against 236.4, with 181 launches a token instead of 118;
# bench/results/mlp-pick-and-tails-2026-12-05.txt). Small MLPs are kept off it by _RESIDENT_MIN_BYTES, not the margin.
_RESIDENT_MLP_MARGIN = -0.02
# ... and only for an MLP of at least this many weight bytes (gate|up and down): a resident launch of a small MLP is
# mostly its blocks' start and their wait for one another, and decode does not follow its timing there (the bundled
# model, 4.7 MB: timed 1.7% ahead, decode 3316 / 1452 against 3399 / 2607 t/s with the separate launches; the 9B-like
# 302 MB MLP: timed 4.1% ahead, decode 1.8% faster; bench/results/h200-persistent-chain-2026-12-03.txt section 6).
_RESIDENT_MIN_BYTES = 32 << 20

_compiled = None


def _one_token(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def autotuned_linear():
    """The compiled one-token product (shared by every model in the process: one cache per weight shape)."""
    global _compiled
    if _compiled is None:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            raise EngineError(
                f"gemm='autotune' needs Triton ({type(exc).__name__}: {exc}); install PyTorch's CUDA build "
                "with Triton, or use gemm='cublas'"
            ) from None
        import torch._dynamo

        # One compiled graph per weight shape (a 9B-like model has 6, plus the MTP head's).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(
            _one_token,
            dynamic=False,
            options={
                "max_autotune": True,
                "coordinate_descent_tuning": True,
                "max_autotune_gemm_backends": "TRITON",
                "triton.cudagraphs": False,
            },
        )
    return _compiled


def check_mode(mode: str, device: torch.device) -> None:
    if mode not in GEMM_MODES:
        raise EngineError(f"gemm {mode!r} is not known; use one of {', '.join(GEMM_MODES)}")
    if mode != "cublas" and device.type != "cuda":
        raise EngineError(f"gemm={mode!r} needs a CUDA device, and the model is on {device}; use gemm='cublas'")


def bucket_index(m: int) -> int:
    return next(i for i, (lo, hi) in enumerate(ROW_BUCKETS) if lo <= m <= hi)


def bucket_label(index: int) -> str:
    lo, hi = ROW_BUCKETS[index]
    return f"m{lo}" if lo == hi else f"m{lo}-{hi}"


class GemvProducts:
    """The products of a model in gemm mode "cupy", "auto" or "exact": `products(x, w)` is x @ w^T through the gemv
    kernel variant chosen for w's shape and x's row bucket, or cuBLAS. `cache_path`: the autotune cache file
    of mode "auto" (None: keep the measurements in memory)."""

    def __init__(self, mode: str, device: torch.device, dtype: torch.dtype, cache_path: os.PathLike | None) -> None:
        if mode not in ("cupy", "auto", "exact"):
            raise ValueError(f"GemvProducts serves gemm modes cupy, auto and exact, not {mode!r}")
        self.mode, self.device, self.dtype = mode, device, dtype
        self.ok, why = ops.gemv_kernels(device, dtype)  # compiles and loads the module now, outside captures
        self.notice = "" if self.ok else f"gemm {mode}: gemv kernels unavailable ({why}); products stay on cuBLAS"
        if self.notice:
            print(f"specdeck: notice: {self.notice}", file=sys.stderr)
        self.cache = TuneCache(cache_path) if mode == "auto" and self.ok else None
        if self.cache is not None and self.cache.notice:
            self.notice = self.cache.notice
        self.gpu = torch.cuda.get_device_name(device) if self.ok else ""
        self.version = f"{ops.gemv_version()} {_PICK_RULE}" if self.ok else ""
        # (n, k, bucket index) -> "cublas" or a gemv variant; the measured us per candidate of mode "auto"
        self.choices: dict[tuple[int, int, int], str] = {}
        self.timings: dict[tuple[int, int, int], dict[str, float]] = {}
        self.measured = 0  # (shape, bucket) pairs measured on the device by this object (not from the cache)
        # Weight shape -> the epilogue that always follows its product ("silu": the packed gate|up, "norm": the
        # projections that add_rmsnorm follows): "auto" times them with it (cuBLAS and a launch more, or the gemv
        # kernel's one-launch form)
        self.epilogues: dict[tuple[int, int], str] = {}
        # (n, k, bucket index) -> the variant whose fused form made that product with the delta-net's step instead of
        # the choice (conv_delta_rule_norm): shown beside the choice in `labels`
        self.fused: dict[tuple[int, int, int], str] = {}
        # down weight shape (n, k) -> the one-launch MLP's variant, or "cublas": the gate|up and down products as
        # chosen above, each with its epilogue (mlp_choice)
        self.mlp_choices: dict[tuple[int, int], str] = {}
        self._tuning = False  # inside tune(): the cache is written once at its end
        self._labels: tuple | None = None  # (the choices they were built from, labels): see labels

    # ---- the product --------------------------------------------------------------------------------
    def takes(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether x @ w^T goes through this object's choice (else it is plain cuBLAS)."""
        return self.ok and ops.gemv_takes(x, w)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.takes(x, w):
            return F.linear(x, w)
        choice = self.choice(x.shape[0], w)
        return F.linear(x, w) if choice == "cublas" else ops.gemv(x, w, choice)

    def add_rmsnorm(
        self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rmsnorm(self(x, w), residual, weight, eps): one fused op where the product runs a gemv kernel."""
        if self.takes(x, w):
            choice = self.choice(x.shape[0], w)
            if choice != "cublas":
                return ops.gemv_add_rmsnorm(x, w, residual, weight, eps, choice)
        return ops.add_rmsnorm(self(x, w), residual, weight, eps)

    def norm_product(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rmsnorm(x) with no weight, w) for a layer's input rows x (the residual stream) whose norm's weight is
        folded into w (Model.fold_norms): one launch that norms in the product where the choice for w is a gemv
        kernel that can (ops.gemv_norm), else the norm first."""
        if self.takes(x, w):
            choice = self.choice(x.shape[0], w)
            if choice != "cublas":
                return ops.gemv_norm(x, w, eps, choice)
        return self(ops.unit_rmsnorm(x, eps), w)

    def product_norms(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether norm_product of rows like x (one row: a decode step) norms them in the product's launch
        (Model.fold_norms folds an attention layer's input norm into its qkv product only there)."""
        if not self.takes(x, w) or self.mode == "exact":
            return False
        choice = self.choice(x.shape[0], w)
        return choice != "cublas" and ops.gemv_norms(x, w, choice)

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu_mul(self(x, w)) for the MLP's packed gate|up weight: one fused launch where the product runs a
        gemv kernel without K splits (the same sums, so the same bits as the two launches)."""
        if self.takes(x, w):
            choice = self.choice(x.shape[0], w)
            if choice != "cublas":
                return ops.gemv_silu_mul(x, w, choice)
        return ops.silu_mul(self(x, w))

    def mlp_add_rmsnorm(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rmsnorm(self(silu_mul(self(x, w_gate_up)), w_down), residual, weight, eps): the MLP and the residual
        add + norm after it, in one launch where mlp_choice names a variant (one row), else as silu_mul then
        add_rmsnorm make them."""
        variant = self.mlp_choice(x, w_gate_up, w_down)
        if variant != "cublas":
            return ops.gemv_mlp_add_rmsnorm(x, w_gate_up, w_down, residual, weight, eps, variant)
        return self.add_rmsnorm(self.silu_mul(x, w_gate_up), w_down, residual, weight, eps)

    def add_mlp_add_rmsnorm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        residual: torch.Tensor,
        x_weight: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        folded: bool = False,
        defer_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """mlp_add_rmsnorm(*add_rmsnorm(x, w, residual, x_weight, eps), ...): a projection joining the residual stream,
        its norm, the MLP and the add + norm after it. folded: x_weight is zero, its values folded into w_gate_up
        (Model.fold_norms). Then, where the MLP is one resident launch (one row, mlp_choice "res...") and the
        projection a gemv kernel, the norm is deferred (issue 20): the projection's launch stores the residual
        stream only (ops.gemv_add: no counter and no one-block norm at its end, ~4 us on the H200 a 9B-like layer),
        and the MLP's warps scale their sums by the norm after their FMAs (gemv_mlp_add_rmsnorm's x_norm).
        defer_next (the norm after the MLP is folded into the next layer's in_proj, whose fused launch norms its
        input: conv_delta_rule_norm's x_eps): there, (None, s), the MLP's launch storing s only (no norm block at
        its end, ~3 us on the H200 a 9B-like layer)."""
        if folded and x.dim() == 2 and x.shape[0] == 1 and self.takes(x, w):
            choice, variant = self.choice(1, w), self.mlp_choice(residual, w_gate_up, w_down)
            if choice != "cublas" and variant.startswith("res"):
                s = ops.gemv_add(x, w, residual, choice)
                after = None if defer_next else weight
                return ops.gemv_mlp_add_rmsnorm(s, w_gate_up, w_down, s, after, eps, variant, x_norm=True)
        h, s = self.add_rmsnorm(x, w, residual, x_weight, eps)
        return self.mlp_add_rmsnorm(h, w_gate_up, w_down, s, weight, eps)

    def mlp_choice(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> str:
        """The one-launch MLP's variant for these operands, or "cublas" (the launches it replaces): only for one
        row, not in mode "exact"; mode "cupy" _MLP_DEFAULT, mode "auto" measured (tune_mlp; a shape met later
        inside a capture is the launches it replaces until an eager call measures it)."""
        if not self.ok or self.mode == "exact" or x.dim() != 2 or x.shape[0] != 1:
            return "cublas"
        key = (w_down.shape[0], w_down.shape[1])
        found = self.mlp_choices.get(key)
        if found is not None:
            return found if ops.gemv_mlp_fits(x, w_gate_up, w_down, found) else "cublas"
        if self.mode == "cupy":
            found = self._default_mlp(w_gate_up, w_down)
        elif torch.cuda.is_current_stream_capturing():
            return "cublas"
        else:
            found = self._tuned_mlp([(w_gate_up, w_down)])
        self.mlp_choices[key] = found
        return found if ops.gemv_mlp_fits(x, w_gate_up, w_down, found) else "cublas"

    def tune_mlp(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Choose the one-launch MLP per down shape now (the model's (gate|up, down) pairs), after tune()."""
        if not self.ok or self.mode == "exact":
            return
        by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for gu, down in pairs:
            by_shape.setdefault((down.shape[0], down.shape[1]), []).append((gu, down))
        self._tuning = True
        try:
            for same in by_shape.values():
                gu, down = same[0]
                key = (down.shape[0], down.shape[1])
                if key in self.mlp_choices:
                    continue
                self.mlp_choices[key] = self._tuned_mlp(same) if self.mode == "auto" else self._default_mlp(gu, down)
        finally:
            self._tuning = False
            if self.cache is not None:
                self.cache.save()

    def _default_mlp(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> str:
        """Mode "cupy"'s one-launch MLP choice for these shapes: _MLP_DEFAULT where they take it (checked on an
        aligned row: a call's own row is checked at the call), else "cublas"."""
        row = torch.empty((1, w_gate_up.shape[1]), dtype=self.dtype, device=self.device)
        return _MLP_DEFAULT if ops.gemv_mlp_fits(row, w_gate_up, w_down, _MLP_DEFAULT) else "cublas"

    def conv_delta_rule_norm(
        self, x, w, conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight, eps, x_eps=None
    ) -> torch.Tensor:
        """The delta-net's decode step from its input rows: in_proj_step(self(x, w), ...), one fused launch where
        the product runs a gemv kernel (ops.gemv_conv_delta_rule_norm: the same bits as the product then the step).
        x_eps given: x is the residual stream, the layer's input norm folded into w (Model.fold_norms), normed in the
        fused launch or (rmsnorm with no weight) before the product."""
        step = (conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight, eps)
        if self._rule_fused(x, w):
            self.fused[(w.shape[0], w.shape[1], bucket_index(x.shape[0]))] = _RULE_VARIANT
            return ops.gemv_conv_delta_rule_norm(x, w, *step, _RULE_VARIANT, x_eps)
        if x_eps is not None:
            x = ops.unit_rmsnorm(x, x_eps)
        if self.takes(x, w):
            choice = self.choice(x.shape[0], w)
            if choice != "cublas":
                return ops.in_proj_step(ops.gemv(x, w, choice), *step)
        return ops.in_proj_step(self(x, w), *step)

    def _rule_fused(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether conv_delta_rule_norm of these rows is the fused in_proj launch (_RULE_VARIANT): a gemv choice
        for the product, a weight of at least _RULE_MIN_BYTES, not mode "exact"."""
        if not self.takes(x, w) or self.mode == "exact" or w.numel() * w.element_size() < _RULE_MIN_BYTES:
            return False
        return self.choice(x.shape[0], w) != "cublas"

    def rule_norms(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether conv_delta_rule_norm of rows like x (one row: a decode step) norms its input in the fused launch
        (Model.fold_norms folds a delta-net layer's input norm into its in_proj only there)."""
        return self._rule_fused(x, w) and ops.gemv_rule_norms(x, w, _RULE_VARIANT)

    def prepare_rule(self, in_proj: list[torch.Tensor], key_dim: int) -> None:
        """Compile and load the fused in_proj + step kernels now (at load) where conv_delta_rule_norm will take them
        (`in_proj`: the delta-net layers' packed in_proj weights), so that the first round compiles nothing."""
        big = any(w.numel() * w.element_size() >= _RULE_MIN_BYTES for w in in_proj)
        if self.ok and self.mode != "exact" and big:
            ops.gemv_rule_kernels(self.device, self.dtype, key_dim)

    def choice(self, m: int, w: torch.Tensor, same_shape: list[torch.Tensor] | None = None) -> str:
        """The product used for m rows times w^T: looked up, else the default launch ("cupy"), else measured
        ("auto"; inside a graph capture the default launch, measured at the next eager use)."""
        b = bucket_index(m)
        n, k = w.shape
        key = (n, k, b)
        found = self.choices.get(key)
        if found is not None:
            return found
        top = ROW_BUCKETS[b][1]
        if self.mode == "exact":
            found = ops.gemv_row_invariant(n, k, self.dtype, self.device)  # the same for every bucket
        elif self.mode == "cupy" or torch.cuda.is_current_stream_capturing():
            found = ops.gemv_default(top, n, k, self.dtype, self.device)
            if self.mode == "auto":
                return found
        else:
            found = self._tuned(b, n, k, same_shape or [w])
        self.choices[key] = found
        return found

    @property
    def labels(self) -> dict[str, str]:
        """The choices made so far, by "NxK bucket" (what Engine.info and the run stats show); a product made with
        the delta-net's step in one launch shows that launch's variant and the choice for the product alone."""
        # Read into every round's run stats: rebuilt only when a choice changed (the dicts' contents are the key,
        # compared in C; building the labels was ~20 us of host time a round, which a launch-bound model's decode
        # waits on)
        live = (self.choices, self.fused, self.mlp_choices)
        if self._labels is None or self._labels[0] != live:  # the live dicts against copies: no copy a round
            self._labels = (tuple(dict(d) for d in live), self._build_labels())
        return dict(self._labels[1])

    def _build_labels(self) -> dict[str, str]:
        out = {}
        for (n, k, b), c in sorted(self.choices.items()):
            fused = self.fused.get((n, k, b))
            out[f"{n}x{k} {bucket_label(b)}"] = c if fused is None else f"{fused} with the delta step ({c} alone)"
        for (n, k), c in sorted(self.mlp_choices.items()):
            out[f"{n}x{k} {_MLP_LABEL}"] = "separate launches" if c == "cublas" else f"{c} one launch with gate|up"
        return out

    # ---- auto: measuring --------------------------------------------------------------------------------
    def tune(
        self,
        shapes: dict[tuple[int, int], list[torch.Tensor]],
        activation: set[tuple[int, int]] | None = None,
        norm: set[tuple[int, int]] | None = None,
    ) -> None:
        """Choose for every weight shape (with the model's tensors of that shape) and row bucket: mode "cupy"
        its default launches, mode "auto" from the cache or by measuring (then the cache is written). The shapes
        in `activation` are measured with the MLP's activation after the product (see silu_mul), those in `norm`
        with the residual add and norm after it (see add_rmsnorm; a shape in both counts as an activation)."""
        self.epilogues = {shape: "norm" for shape in norm or ()}
        self.epilogues |= {shape: "silu" for shape in activation or ()}
        if not self.ok:
            return
        self._tuning = True
        try:
            for weights in shapes.values():
                for _, hi in ROW_BUCKETS:
                    x = torch.empty((hi, weights[0].shape[1]), dtype=self.dtype, device=self.device)
                    if self.takes(x, weights[0]):
                        self.choice(hi, weights[0], weights)
        finally:
            self._tuning = False
            if self.cache is not None:
                self.cache.save()

    def _tuned(self, b: int, n: int, k: int, weights: list[torch.Tensor]) -> str:
        epilogue = self.epilogues.get((n, k))
        label = bucket_label(b) + (f" {epilogue}" if epilogue else "")
        return self._cached_or_measured(
            cache_key(self.gpu, self.dtype, n, k, label, self.version),
            (n, k, b),
            lambda: self._measure(ROW_BUCKETS[b][1], n, k, weights, epilogue),
            f"{n}x{k} {bucket_label(b)}",
            "using cuBLAS for it",
        )

    def _cached_or_measured(self, key: str, timing_key: tuple, measure, what: str, instead: str) -> str:
        """The choice cached under `key`, else measure() -> (choice, times): kept in `timings` under timing_key and
        in the cache (written at once for a shape met after the load). A failed measurement is a warning naming
        `what` and `instead`, and "cublas" (what a failure leaves: cuBLAS, or the MLP's separate launches)."""
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            choice, times = measure()
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop the model
            warnings.warn(f"gemm auto: measuring {what} failed ({type(exc).__name__}: {exc}); {instead}", stacklevel=3)
            return "cublas"
        self.measured += 1
        self.timings[timing_key] = times
        self.cache.put(key, choice, times)
        if not self._tuning:
            self.cache.save()  # a shape met after the load is written at once
        return choice

    def _tuned_mlp(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
        """The cached or measured one-launch MLP choice for the (gate|up, down) pairs of one down shape."""
        gu, down = pairs[0]
        n, k = down.shape
        margins = f"margin {_MLP_MARGIN}/{_RESIDENT_MLP_MARGIN} resident from {_RESIDENT_MIN_BYTES >> 20} MiB"
        label = f"{_MLP_LABEL} {gu.shape[0]}x{gu.shape[1]} {margins}"
        return self._cached_or_measured(
            cache_key(self.gpu, self.dtype, n, k, label, self.version),
            (n, k, -1),
            lambda: self._measure_mlp(pairs),
            f"the one-launch MLP for {n}x{k}",
            "the MLP keeps its separate launches",
        )

    def _measure_mlp(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[str, dict[str, float]]:
        """(fastest, us per call of each) of the one-launch MLP's variants against "cublas" (the gate|up and down
        products as chosen, with their epilogues) for one row; a variant must give the bits of the launches it
        replaces (gemv_silu_mul then gemv_add_rmsnorm with its warps and splits)."""
        gu, down = pairs[0]
        i, n = gu.shape[0] // 2, down.shape[0]
        each = gu.numel() * gu.element_size() + down.numel() * down.element_size()
        calls = self._timed_calls(pairs, each, lambda pair: (pair[0].clone(), pair[1].clone()))
        g = torch.Generator(device=self.device).manual_seed(n * 7919 + i * 31 + 1)
        x = torch.randn((1, gu.shape[1]), device=self.device, generator=g).to(self.dtype)
        r = torch.randn((1, n), device=self.device, generator=g).to(self.dtype)
        nw = torch.randn(n, device=self.device, generator=g) * 0.1
        eps = 1e-6

        def form(candidate, pair):
            if candidate == "cublas":
                return self.add_rmsnorm(self.silu_mul(x, pair[0]), pair[1], r, nw, eps)
            return ops.gemv_mlp_add_rmsnorm(x, pair[0], pair[1], r, nw, eps, candidate)

        times: dict[str, float] = {}
        for candidate in ["cublas", *mlp_candidates(gu, down)]:
            if candidate != "cublas":
                if not ops.gemv_mlp_fits(x, gu, down, candidate):
                    continue
                gu_variant, down_variant = ops.gemv_mlp_launches(candidate)  # the launches whose bits it gives
                act = ops.gemv_silu_mul(x, gu, gu_variant)
                want = ops.gemv_add_rmsnorm(act, down, r, nw, eps, down_variant)
                got = form(candidate, pairs[0])
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    warnings.warn(
                        f"gemm auto: the one-launch MLP {candidate} differs from its separate launches on "
                        f"{gu.shape[0]}x{gu.shape[1]} then {n}x{i}; it is not used",
                        stacklevel=3,
                    )
                    continue
            times[candidate] = _graph_seconds(lambda c=candidate: [form(c, p) for p in calls], self.device)
            times[candidate] *= 1e6 / len(calls)
        return pick_mlp(times), {c: round(t, 3) for c, t in times.items()}

    def _timed_calls(self, items: list, each: int, clone) -> list:
        """The operands a timed graph cycles through, a call each: the given ones (each of `each` bytes), plus
        clones of the first (by `clone`) until they pass ~3 x L2 (at most _TUNE_CLONE_BYTES of clones,
        _TUNE_MAX_WEIGHTS distinct), so a timing reads memory rather than L2; repeated until the graph reads
        _TUNE_GRAPH_BYTES (at most _TUNE_MIN_CALLS calls, never fewer than the distinct operands)."""
        ws = list(items[:_TUNE_MAX_WEIGHTS])
        l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 64 << 20) or (64 << 20)
        cloned = 0
        while len(ws) < _TUNE_MAX_WEIGHTS and each * len(ws) < 3 * l2 and cloned + each <= _TUNE_CLONE_BYTES:
            try:
                ws.append(clone(ws[0]))
            except torch.OutOfMemoryError:
                break
            cloned += each
        count = max(len(ws), min(_TUNE_MIN_CALLS, -(-_TUNE_GRAPH_BYTES // each)))
        return [ws[i % len(ws)] for i in range(count)]

    def _measure(
        self, m: int, n: int, k: int, weights: list[torch.Tensor], epilogue: str | None = None
    ) -> tuple[str, dict[str, float]]:
        """(fastest candidate, us per call of each) for [m, k] x [n, k]^T; `epilogue` (EPILOGUES): the product
        followed by the MLP's activation ("silu": cuBLAS then silu_mul, against each variant's one-launch
        gemv_silu_mul) or by the residual add and norm ("norm": cuBLAS then add_rmsnorm, against each variant's
        one-launch gemv_add_rmsnorm). A variant is checked against cuBLAS on its product (with the activation for
        "silu")."""
        calls = self._timed_calls(weights, weights[0].numel() * weights[0].element_size(), lambda t: t.clone())
        g = torch.Generator(device=self.device).manual_seed(n * 7919 + k * 31 + m)
        x = torch.randn((m, k), device=self.device, generator=g).to(self.dtype)
        # checked: the product (with the activation for "silu") of each candidate against cuBLAS's
        checked = _timed_forms(x, n, "silu" if epilogue == "silu" else None, g)
        expect = checked("cublas", weights[0]).float()
        scale = float(expect.abs().max()) or 1.0
        tol = 1e-3 if self.dtype == torch.float32 else 3e-2
        timed = _timed_forms(x, n, epilogue, g)
        times: dict[str, float] = {}
        for candidate in ["cublas", *ops.gemv_variants(m, n, k, self.dtype, self.device)]:
            product = functools.partial(timed, candidate)
            if candidate != "cublas":
                err = float((checked(candidate, weights[0]).float() - expect).abs().max())
                if not err <= tol * scale:
                    warnings.warn(
                        f"gemm auto: gemv variant {candidate} disagrees with cuBLAS on {m}x{k} @ {n}x{k} "
                        f"(max error {err:.3g} of {scale:.3g}); it is not used",
                        stacklevel=3,
                    )
                    continue
            times[candidate] = _graph_seconds(lambda p=product: [p(w) for w in calls], self.device) / len(calls) * 1e6
        one_launch = None
        if epilogue == "silu":
            one_launch = functools.partial(ops.gemv_silu_one_launch, x, weights[0])
        return pick(times, epilogue, m, one_launch), {c: round(t, 3) for c, t in times.items()}


def _timed_forms(x: torch.Tensor, n: int, epilogue: str | None, g: torch.Generator):
    """form(candidate, w): what a decode step runs for x @ w^T (w [n, K]) with `epilogue` after it, by candidate
    ("cublas" or a gemv variant), for the timing."""
    if epilogue == "norm":  # a residual and a norm weight of the output's width
        r = torch.randn((x.shape[0], n), device=x.device, generator=g).to(x.dtype)
        nw = torch.randn(n, device=x.device, generator=g) * 0.1

        def form(candidate, w):
            if candidate == "cublas":
                return ops.add_rmsnorm(F.linear(x, w), r, nw, 1e-6)
            return ops.gemv_add_rmsnorm(x, w, r, nw, 1e-6, candidate)
    elif epilogue == "silu":

        def form(candidate, w):
            return ops.silu_mul(F.linear(x, w)) if candidate == "cublas" else ops.gemv_silu_mul(x, w, candidate)
    else:

        def form(candidate, w):
            return F.linear(x, w) if candidate == "cublas" else ops.gemv(x, w, candidate)

    return form


def pick(
    times: dict[str, float], epilogue: str | None = None, rows: int = 1, one_launch: Callable[[str], bool] | None = None
) -> str:
    """The candidate to use from measured us per call of `rows` rows: the fastest; for a shape with an epilogue
    (EPILOGUES), the fastest gemv variant whose fused form is one launch (for "silu" those `one_launch` says are,
    kernels/cuda.py gemv_silu_one_launch; by default a variant without K splits, one that splits K being its product,
    then its split sum with silu_mul; for "norm" any) against the fastest
    candidate of more launches (cuBLAS and the epilogue's kernel; for "silu" also a variant of two launches): the
    one-launch form is kept unless that one is faster by more than _ONE_LAUNCH_MARGIN, and for "norm" with more
    than one row only if it is itself faster by _NORM_ROWS_MARGIN (see there)."""
    best = min(times, key=times.get)
    if epilogue not in EPILOGUES:
        return best
    fused = [c for c in times if c != "cublas" and ops.parse_gemv_variant(c) is not None]
    if epilogue == "silu":
        fused = [c for c in fused if (one_launch(c) if one_launch else ops.parse_gemv_variant(c)[2] == 1)]
    rivals = [c for c in times if c not in fused]
    if not fused or not rivals:
        return best
    one, rival = min(fused, key=times.get), min(rivals, key=times.get)
    margin = -_NORM_ROWS_MARGIN if epilogue == "norm" and rows > 1 else _ONE_LAUNCH_MARGIN
    return one if times[one] <= times[rival] * (1.0 + margin) else rival


def mlp_candidates(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[str, ...]:
    """The one-launch MLP variants auto times for these weights: every one, but the resident ones only for an MLP of
    at least _RESIDENT_MIN_BYTES."""
    size = w_gate_up.numel() * w_gate_up.element_size() + w_down.numel() * w_down.element_size()
    return tuple(v for v in _MLP_VARIANTS if size >= _RESIDENT_MIN_BYTES or not v.startswith("res"))


def pick_mlp(times: dict[str, float]) -> str:
    """The one-launch MLP's choice from measured us per call ("cublas": the separate launches): the fastest variant
    within its margin of the separate launches (a per-launch one _MLP_MARGIN faster, a resident one at most
    -_RESIDENT_MLP_MARGIN slower), else "cublas"."""
    if "cublas" not in times:
        return "cublas"
    margin = lambda c: _RESIDENT_MLP_MARGIN if c.startswith("res") else _MLP_MARGIN  # noqa: E731
    ahead = [c for c in times if c != "cublas" and times[c] <= times["cublas"] * (1.0 - margin(c))]
    return min(ahead, key=times.get) if ahead else "cublas"


def _graph_seconds(run, device: torch.device) -> float:
    """Seconds of one replay of `run()` captured as a CUDA graph (the fastest of _TUNE_REPLAYS), on a side
    stream: device time only, no host launch cost (what the engine's captured plans pay)."""
    main = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(main)
    best = math.inf
    with torch.cuda.stream(stream):
        run()  # eager first: every kernel loaded, cuBLAS's workspace made for this stream
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            run()
        finally:
            graph.capture_end()
        graph.replay()
        for _ in range(_TUNE_REPLAYS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            graph.replay()
            b.record(stream)
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
    main.wait_stream(stream)
    del graph
    return best


def gemv_products(mode: str, device: torch.device, dtype: torch.dtype, cache_dir=None) -> GemvProducts:
    """The products of gemm mode "cupy", "auto" or "exact" (the cache file of "auto" in `cache_dir`, None: the default
    folder, see engine/gemm_cache.py)."""
    return GemvProducts(mode, device, dtype, cache_file(cache_dir) if mode == "auto" else None)


__all__ = [
    "GEMM_MODES",
    "ROW_BUCKETS",
    "EPILOGUES",
    "GemvProducts",
    "TuneCache",
    "autotuned_linear",
    "check_mode",
    "gemv_products",
    "pick",
    "pick_mlp",
]
