"""Dispatcher: the engine calls `kernels.ops.<name>`; each name is bound to the PyTorch reference, or to
the CUDA kernel of the same signature when CUDA kernels are enabled. Tensors on the CPU always take the
reference path."""

from __future__ import annotations

from . import reference, registry
from .registry import NAMES

rmsnorm = reference.rmsnorm
add_rmsnorm = reference.add_rmsnorm
gated_rmsnorm = reference.gated_rmsnorm
attn_prep = reference.attn_prep
silu_mul = reference.silu_mul
gdn_gates = reference.gdn_gates
attention_cached = reference.attention_cached
conv_update = reference.conv_update
gated_delta_rule = reference.gated_delta_rule
chunk_gated_delta_rule = reference.chunk_gated_delta_rule
argmax_prob = reference.argmax_prob
greedy_accept = reference.greedy_accept
argmax_greedy_accept = reference.argmax_greedy_accept
sample_probs = reference.sample_probs
sample_token = reference.sample_token
spec_accept = reference.spec_accept
synthetic_accept = reference.synthetic_accept
gemv = reference.gemv
gemv_add_rmsnorm = reference.gemv_add_rmsnorm
gemv_add = reference.gemv_add
gemv_norm = reference.gemv_norm
gemv_silu_mul = reference.gemv_silu_mul
gemv_mlp_add_rmsnorm = reference.gemv_mlp_add_rmsnorm
mtp_prefc = reference.mtp_prefc
embed_rmsnorm = reference.embed_rmsnorm
store_rows = reference.store_rows
gated_delta_rule_ab = reference.gated_delta_rule_ab
gated_delta_rule_ab_norm = reference.gated_delta_rule_ab_norm
conv_delta_rule_norm = reference.conv_delta_rule_norm
gemv_conv_delta_rule_norm = reference.gemv_conv_delta_rule_norm

_cuda_enabled = False


def in_proj_step(prod, conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight, eps):
    """The delta-net's decode step after its packed in_proj product `prod` (reference.in_proj_step) through the
    conv_delta_rule_norm bound now (its kernel on a GPU)."""
    return reference.in_proj_step(
        prod, conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight, eps,
        conv_delta_rule_norm,
    )  # fmt: skip


def unit_rmsnorm(x, eps):
    """rmsnorm(x) with no weight through the rmsnorm bound now (reference.unit_rmsnorm)."""
    return reference.unit_rmsnorm(x, eps, rmsnorm)


def cuda_enabled() -> bool:
    """True when the CUDA kernels are bound (so every op reads `start` on the device: capturable)."""
    return _cuda_enabled


def use_cuda_kernels(enable: bool) -> tuple[bool, str]:
    """Bind every op to its CUDA kernel (enable=True) or back to the reference. Returns (enabled, reason).

    The CUDA kernels dispatch CPU tensors to the reference themselves, so CPU sessions keep working."""
    global _cuda_enabled
    g = globals()
    if not enable:
        for name in NAMES:
            g[name] = getattr(reference, name)
        _cuda_enabled = False
        return False, "disabled"
    try:
        from . import cuda
    except Exception as exc:  # a broken CuPy install must not take the engine down
        return _references_counted(f"CUDA kernels unavailable ({exc})")
    ok, reason = cuda.available()
    if not ok:
        return _references_counted(reason)
    for name in NAMES:
        g[name] = _by_device(getattr(cuda, name), getattr(reference, name))
    _cuda_enabled = True
    return True, "CUDA kernels enabled"


def _references_counted(reason: str) -> tuple[bool, str]:
    """The kernels were asked for but cannot run: bind the references, each counting its calls on a GPU as
    fallbacks (kernels/registry.py). Returns (False, reason)."""
    g = globals()
    for name in NAMES:
        ref = getattr(reference, name)
        g[name] = ref if name in registry.REFERENCE_ONLY else _counted(name, ref, reason)
    return False, reason


def _counted(name: str, ref, reason: str):
    def op(first, *args, **kwargs):
        if registry.on_gpu(first):
            registry.count_fallback(name, reason)
        return ref(first, *args, **kwargs)

    op.__name__, op.__doc__ = name, ref.__doc__
    op.reference = ref
    return op


# ---- the gemv kernels' launch choices (the engine's gemm modes "cupy" and "auto", engine/gemm.py) ----------
def gemv_kernels(device, dtype) -> tuple[bool, str]:
    """(True, note) when `gemv` runs its kernels for `dtype` on `device` (their module compiled and loaded now,
    outside any graph capture); else (False, why): the CUDA kernels are not bound, or that module failed."""
    if not _cuda_enabled:
        return False, "the CUDA kernels are not in use"
    from . import cuda

    return cuda.gemv_kernels(device, dtype)


def gemv_rule_kernels(device, dtype, dk: int) -> bool:
    """Whether the in_proj product's fused form with the delta-net's step runs for key head dim dk: its module
    compiled and loaded now (call it outside a graph capture, as the gemm modes do at load)."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_rule_kernels(device, dtype, dk)


def gemv_takes(x, w) -> bool:
    """Whether the gemv kernel covers x @ w^T (shape, dtype, layout) with the CUDA kernels bound."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_takes(x, w)


def gemv_mlp_fits(x, w_gate_up, w_down, variant) -> bool:
    """Whether gemv_mlp_add_rmsnorm makes the MLP of x in one launch with `variant` (with the CUDA kernels bound)."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_mlp_fits(x, w_gate_up, w_down, variant)


def gemv_rule_norms(x, w, variant) -> bool:
    """Whether gemv_conv_delta_rule_norm given x_eps norms the rows x in its own launch (with the CUDA kernels bound),
    rather than rmsnorm first."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_rule_norms(x, w, variant)


def gemv_norms(x, w, variant) -> bool:
    """Whether gemv_norm norms the rows x in the product's own launch for `variant` (with the CUDA kernels bound),
    rather than rmsnorm first."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_norms(x, w, variant)


def gemv_silu_one_launch(x, w_gate_up, variant) -> bool:
    """Whether gemv_silu_mul of `variant` is one launch for these operands (with the CUDA kernels bound)."""
    if not _cuda_enabled:
        return False
    from . import cuda

    return cuda.gemv_silu_one_launch(x, w_gate_up, variant)


def gemv_variants(m: int, n: int, k: int, dtype, device) -> list[str]:
    """The gemv launch variants worth timing for [m, k] x [n, k]^T here (the default first)."""
    from . import cuda

    return cuda.gemv_variants(m, n, k, dtype, device)


def gemv_default(m: int, n: int, k: int, dtype, device) -> str:
    """The variant `gemv` launches for [m, k] x [n, k]^T when none is named (aligned operands)."""
    from . import cuda

    return cuda.gemv_default(m, n, k, dtype, device)


def gemv_row_invariant(n: int, k: int, dtype, device) -> str:
    """The gemv variant whose rows do not depend on the row count (gemm mode "exact")."""
    from . import cuda

    return cuda.gemv_row_invariant(n, k, dtype, device)


def set_row_invariant(on: bool) -> None:
    """Decode attention with splits from the cache size only (gemm mode "exact"); nothing without CUDA."""
    try:
        from . import cuda
    except Exception:  # noqa: BLE001 - no CuPy: the references are row-invariant already
        return
    cuda.set_row_invariant(on)


def gemv_version() -> str:
    """A hash of the gemv kernels' source (new kernels invalidate cached timings)."""
    from . import cuda

    return cuda.gemv_version()


GEMV_MAX_ROWS = registry.GEMV_MAX_ROWS
parse_gemv_variant = registry.parse_gemv_variant
gemv_mlp_launches = registry.gemv_mlp_launches


def fallbacks() -> dict[str, int]:
    """Calls meant for a GPU that ran as PyTorch references, per op (see kernels/registry.py)."""
    return registry.fallbacks()


def _by_device(kernel, ref):
    """Call the CUDA kernel for CUDA tensors and the reference for CPU ones (engines on both can coexist)."""

    def op(first, *args, **kwargs):
        return (kernel if first.is_cuda else ref)(first, *args, **kwargs)

    op.__name__ = kernel.__name__
    op.__doc__ = ref.__doc__
    op.kernel, op.reference = kernel, ref
    return op
