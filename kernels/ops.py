"""Dispatcher: the engine calls `kernels.ops.<name>`; each name is bound to the PyTorch reference, or to
the CUDA kernel of the same signature when CUDA kernels are enabled. Tensors on the CPU always take the
reference path."""

from __future__ import annotations

from . import reference

NAMES = (
    "rmsnorm",
    "add_rmsnorm",
    "gated_rmsnorm",
    "rope_partial",
    "kv_write",
    "attention_cached",
    "conv_update",
    "gated_delta_rule",
    "chunk_gated_delta_rule",
    "argmax_prob",
    "greedy_accept",
)

rmsnorm = reference.rmsnorm
add_rmsnorm = reference.add_rmsnorm
gated_rmsnorm = reference.gated_rmsnorm
rope_partial = reference.rope_partial
kv_write = reference.kv_write
attention_cached = reference.attention_cached
conv_update = reference.conv_update
gated_delta_rule = reference.gated_delta_rule
chunk_gated_delta_rule = reference.chunk_gated_delta_rule
argmax_prob = reference.argmax_prob
greedy_accept = reference.greedy_accept
