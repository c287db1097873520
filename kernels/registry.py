"""What both halves of the kernels floor share, so that neither imports the other's module: the op names
the dispatcher binds (`ops.py` imports `cuda.py`, never the reverse)."""

from __future__ import annotations

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
    "sample_probs",
    "sample_token",
    "spec_accept",
)
