"""What both halves of the kernels floor share, so that neither imports the other's module: the op names
the dispatcher binds (`ops.py` imports `cuda.py`, never the reverse), and the fallback counter.

A fallback is an op asked to run on a GPU that took its PyTorch reference instead: CuPy missing or broken
(every op), or a shape, dtype or layout its kernel does not cover (that call). Each is counted per op and
reported once per op (a warning on the `specdeck.kernels` logger, which reaches stderr when the application
configures no logging); the engine puts the counts in its run stats as `stats["fallbacks"]`. The counts are
of Python calls: a captured plan that contains a fallback counts it when captured, not at each replay.
Choices made on purpose are not fallbacks: CPU tensors (the reference is the CPU implementation), the chunked
delta rule of prefill, and prefill-sized attention with a host-side start (the reference's GEMMs win there).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

NAMES = (
    "rmsnorm",
    "add_rmsnorm",
    "gated_rmsnorm",
    "attn_prep",
    "silu_mul",
    "gdn_gates",
    "attention_cached",
    "conv_update",
    "gated_delta_rule",
    "chunk_gated_delta_rule",
    "argmax_prob",
    "greedy_accept",
    "argmax_greedy_accept",
    "sample_probs",
    "sample_token",
    "spec_accept",
    "synthetic_accept",
    "gemv",
    "gemv_add_rmsnorm",
    "gemv_add",
    "gemv_norm",
    "gemv_silu_mul",
    "gemv_mlp_add_rmsnorm",
    "mtp_prefc",
    "embed_rmsnorm",
    "store_rows",
    "gated_delta_rule_ab",
    "gated_delta_rule_ab_norm",
    "conv_delta_rule_norm",
    "gemv_conv_delta_rule_norm",
)

# The skinny-GEMM op `gemv` (x [M, K] @ W[N, K]^T for decode shapes) takes up to this many rows; a launch
# variant is named "<family>.w<warps>.s<K splits>" (families: simt1, simt2 on CUDA cores, C output columns a
# warp; tc1, tc2 on tensor cores, 16 C columns a warp), e.g. "tc1.w8.s2" (kernels/cuda.py, gemv_kernels.cu).
GEMV_MAX_ROWS = 17
GEMV_FAMILIES = ("simt1", "simt2", "tc1", "tc2")
GEMV_MAX_WARPS = 8
GEMV_MAX_SPLITS = 64
# res1 / res2: the one-launch MLP with every block resident (kernels/cuda.py gemv_mlp_add_rmsnorm), no K split; a
# plain product given one runs its default launch.
_GEMV_VARIANT = re.compile(r"(simt1|simt2|tc1|tc2|res1|res2)\.w([1-8])\.s([1-9][0-9]?)")


def parse_gemv_variant(name: object) -> tuple[str, int, int] | None:
    """(family, warps per block, K splits) of a gemv variant name, or None when it is not one."""
    if not isinstance(name, str) or len(name) > 16:
        return None
    m = _GEMV_VARIANT.fullmatch(name)
    if m is None:
        return None
    warps, splits = int(m.group(2)), int(m.group(3))
    if warps not in (1, 2, 4, 8) or splits > GEMV_MAX_SPLITS:
        return None
    return m.group(1), warps, splits


def gemv_twin(variant: str) -> str:
    """The CUDA-core variant whose launches a resident MLP variant gives the bits of ("res2.w8.s1" -> "simt2.w8.s1");
    any other variant itself (a variant name: parse_gemv_variant must take it)."""
    family, warps, splits = parse_gemv_variant(variant)
    return f"simt{family[3]}.w{warps}.s{splits}" if family.startswith("res") else variant


def gemv_unsplit(variant: str) -> str:
    """The variant of the same family and warps without a K split ("simt2.w8.s4" -> "simt2.w8.s1"): what the
    one-launch MLP makes its gate|up product with."""
    family, warps, _ = parse_gemv_variant(variant)
    return f"{family}.w{warps}.s1"


def gemv_mlp_launches(variant: str) -> tuple[str, str]:
    """(gate|up variant, down variant) of the separate launches whose bits the one-launch MLP with `variant` gives:
    gemv_silu_mul with the twin's unsplit form, then gemv_add_rmsnorm with the twin (gemv_twin)."""
    twin = gemv_twin(variant)
    return gemv_unsplit(twin), twin


# Ops that are the reference on every device, by design (not fallbacks).
REFERENCE_ONLY = frozenset({"chunk_gated_delta_rule"})

_log = logging.getLogger("specdeck.kernels")
_lock = threading.Lock()
_counts: dict[str, int] = {}


def on_gpu(first: Any) -> bool:
    """Whether a call whose first tensor is `first` was meant for a GPU kernel (a seam for CPU tests)."""
    return bool(getattr(first, "is_cuda", False))


def count_fallback(op: str, reason: str) -> None:
    """Count one fallback of `op`; the first one of each op is logged with `reason`."""
    with _lock:
        first = op not in _counts
        _counts[op] = _counts.get(op, 0) + 1
    if first:
        _log.warning("%s ran as its PyTorch reference on a GPU (%s); later fallbacks are only counted", op, reason)


def fallbacks() -> dict[str, int]:
    """Fallbacks so far in this process, per op ({} when every GPU call ran its kernel)."""
    with _lock:
        return dict(_counts)


def reset_fallbacks() -> None:
    """Forget the counts (and report each op's next fallback again)."""
    with _lock:
        _counts.clear()
