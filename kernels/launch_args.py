"""Typed launch arguments: one builder per CUDA kernel (or family of kernels generated from one macro), whose
fields are the kernel's parameters in the order of its `extern "C" __global__` signature in `cuda_src/*.cu`,
each with its C type. A builder is declared as its kernel's parameter list ("ptr x, i64 xs, ..."); a launch
names every argument (`RmsNormArgs(x=..., xs=..., ...)`) and `pack` turns them into the numpy scalars CuPy
passes by value, in declaration order; a builder used for a kernel it does not describe raises.
tests/test_kernel_args.py parses the `.cu` sources and checks every builder's field names, order and C types
against its kernels' parameters, so a reordered or retyped parameter fails a test instead of corrupting
memory. This module needs neither CuPy nor a GPU.
"""

from typing import Any, NamedTuple

import numpy as np

NULL = np.uint64(0)


class Ptr:
    """A device pointer (any `T*`): a tensor's data pointer, an already packed np.uint64, or None (NULL)."""

    ctype = "T*"

    @staticmethod
    def pack(v: Any) -> np.uint64:
        if isinstance(v, np.uint64):
            return v
        if v is None:
            return NULL
        return np.uint64(v.data_ptr())


class I32:
    ctype = "int"
    pack = np.int32


class I64:
    ctype = "long long"
    pack = np.int64


class F32:
    ctype = "float"
    pack = np.float32


class F64:
    ctype = "double"
    pack = np.float64


# C type (qualifiers removed) -> the builder type a parameter of that type must have
CTYPES = {"int": I32, "long long": I64, "float": F32, "double": F64}
# the short names builders are declared with
_SHORT = {"ptr": Ptr, "i32": I32, "i64": I64, "f32": F32, "f64": F64}

# kernel name -> its builder class; builder class -> (its kernels, its field packers)
BUILDERS: dict[str, type] = {}
_PACKERS: dict[type, tuple[frozenset[str], tuple]] = {}


def builder(name: str, params: str, *kernels: str) -> type:
    """A NamedTuple class `name` for the kernels `kernels` (all with the same parameter list), its fields
    declared as "type name, ..." in the kernel's order (types: ptr, i32, i64, f32, f64)."""
    fields = [(f, _SHORT[t]) for t, f in (p.split() for p in params.split(","))]
    cls = NamedTuple(name, fields)
    _PACKERS[cls] = (frozenset(kernels), tuple(t.pack for _, t in fields))
    for kernel in kernels:
        if kernel in BUILDERS:
            raise ValueError(f"kernel {kernel} has two argument builders")
        BUILDERS[kernel] = cls
    return cls


def field_types(cls) -> list[tuple[str, type]]:
    """[(field name, builder type)] in launch order."""
    return [(f, cls.__annotations__[f]) for f in cls._fields]


def pack(kernel: str, args: NamedTuple) -> tuple:
    """The launch tuple of `args` for `kernel` (raises TypeError if `args` is not that kernel's builder)."""
    names, packers = _PACKERS[type(args)]
    if kernel not in names:
        raise TypeError(f"{type(args).__name__} does not describe kernel {kernel}")
    return tuple(p(v) for p, v in zip(packers, args))


# ---- decode_kernels.cu -------------------------------------------------------------------------------
RmsNormArgs = builder(
    "RmsNormArgs",
    "ptr x, i64 xs, ptr w, ptr y, i32 d, f32 eps",
    "rmsnorm_ws",
    "rmsnorm_wf",
)
AddRmsNormArgs = builder(
    "AddRmsNormArgs",
    "ptr x, i64 xs, ptr r, i64 rs, ptr w, ptr y, ptr s, i32 d, f32 eps",
    "add_rmsnorm_ws",
    "add_rmsnorm_wf",
)
MtpPrefcArgs = builder(
    "MtpPrefcArgs",
    "ptr tokens, ptr embed, i64 es, i64 vocab, ptr h, i64 hs, ptr we, ptr wh, ptr y, i32 d, f32 eps",
    "mtp_prefc_ws",
    "mtp_prefc_wf",
)
EmbedRmsNormArgs = builder(
    "EmbedRmsNormArgs",
    "ptr ids, ptr embed, i64 es, i64 vocab, ptr w, ptr y, ptr s, i32 d, f32 eps",
    "embed_rmsnorm_ws",
    "embed_rmsnorm_wf",
)
StoreRowsArgs = builder(
    "StoreRowsArgs",
    "ptr src, i64 ss, ptr dst, i64 ds, ptr start_ptr, i64 start_val, i32 d, i64 n_dst",
    "store_rows",
)
GatedRmsNormArgs = builder(
    "GatedRmsNormArgs",
    "ptr x, i64 xs, ptr gate, i64 gs, ptr w, ptr y, i32 d, f32 eps",
    *(f"gated_rmsnorm_w{a}_g{b}" for a in "sf" for b in "sf"),
)
AttnSplitArgs = builder(
    "AttnSplitArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr kc, ptr vc, ptr start_ptr, i64 start_val, i32 Hq, i32 Hkv, i32 D, "
        "i64 max_ctx, f32 scale, ptr ws_acc, ptr ws_ml, ptr out, ptr gate, i64 gs0, i64 gs1"
    ),
    *(f"attn_split_e{e}" for e in (1, 2, 4, 8)),
    *(f"attn_vec_u{u}_g{g}" for u in (2, 4) for g in (1, 2, 4, 8)),
    "attn_vecb_u2_g4",
)
AttnTileArgs = builder(
    "AttnTileArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr kc, ptr vc, ptr start_ptr, i64 start_val, i32 T, i32 Hq, i32 Hkv, i32 D, "
        "i64 max_ctx, f32 scale, i32 vec_ok, ptr ws_acc, ptr ws_ml, ptr out, ptr gate, i64 gs0, i64 gs1"
    ),
    *(f"attn_tile_e{e}" for e in (1, 2, 4, 8)),
)
AttnFoldArgs = builder(
    "AttnFoldArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr kc, ptr vc, ptr start_ptr, i64 start_val, i32 Hq, i32 Hkv, i32 D, "
        "i64 max_ctx, f32 scale, ptr ws_acc, ptr ws_ml, ptr out, ptr gate, i64 gs0, i64 gs1, ptr cnt, i32 min_keys"
    ),
    "attn_vecb_u2_g4_f",
)
AttnCombineArgs = builder(
    "AttnCombineArgs",
    "ptr ws_acc, ptr ws_ml, ptr out, i32 S, i32 D, ptr gate, i64 gs0, i64 gs1",
    "attn_combine",
    "attn_combine_par",
)
ConvUpdateArgs = builder(
    "ConvUpdateArgs",
    "ptr x, i64 xs0, ptr ring, ptr win, ptr w, ptr y, ptr sp, i64 sv, i32 T, i32 C, i32 n_planes",
    *(f"conv_update_k{k}_w{a}" for k in range(2, 9) for a in "sf"),
)
GatedDeltaRuleArgs = builder(
    "GatedDeltaRuleArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr k, i64 ks0, i64 ks1, ptr v, i64 vs0, i64 vs1, ptr g, i64 gs0, ptr beta, "
        "i64 bs0, ptr ring, ptr out, ptr sp, i64 sv, i32 T, i32 Hk, i32 Hv, i32 dk, i32 dv, i32 n_planes, "
        "f32 qscale"
    ),
    *(f"gdr_dk{d}_b{a}" for d in (16, 32, 64, 128) for a in "sf"),
)
GatedDeltaRuleAbArgs = builder(
    "GatedDeltaRuleAbArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr k, i64 ks0, i64 ks1, ptr v, i64 vs0, i64 vs1, ptr a, i64 as0, ptr b, "
        "i64 bs0, ptr neg_exp_a, ptr dt_bias, ptr ring, ptr out, ptr sp, i64 sv, i32 T, i32 Hk, i32 Hv, i32 dk, "
        "i32 dv, i32 n_planes, f32 qscale"
    ),
    *(f"gdr_dk{d}_ab" for d in (16, 32, 64, 128)),
)
GatedDeltaRuleAbNormArgs = builder(
    "GatedDeltaRuleAbNormArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr k, i64 ks0, i64 ks1, ptr v, i64 vs0, i64 vs1, ptr a, i64 as0, ptr b, "
        "i64 bs0, ptr neg_exp_a, ptr dt_bias, ptr ring, ptr out, ptr sp, i64 sv, i32 T, i32 Hk, i32 Hv, i32 dk, "
        "i32 dv, i32 n_planes, f32 qscale, ptr z, i64 zs0, ptr nw, ptr y, ptr cnt, f32 eps"
    ),
    *(f"gdr_dk{d}_abn" for d in (16, 32, 64, 128)),
)
ConvDeltaRuleNormArgs = builder(
    "ConvDeltaRuleNormArgs",
    (
        "ptr x, i64 xs0, ptr cring, ptr cw, i32 C, ptr a, i64 as0, ptr b, i64 bs0, ptr neg_exp_a, ptr dt_bias, "
        "ptr ring, ptr out, ptr sp, i64 sv, i32 T, i32 Hk, i32 Hv, i32 dk, i32 dv, i32 n_planes, f32 qscale, "
        "ptr z, i64 zs0, ptr nw, ptr y, ptr cnt, f32 eps"
    ),
    *(f"gdr_dk{d}_cabn" for d in (16, 32, 64, 128)),
)
SiluMulArgs = builder(
    "SiluMulArgs",
    "ptr x, i64 xs, ptr y, i32 T, i32 I",
    "silu_mul",
)
GdnGatesArgs = builder(
    "GdnGatesArgs",
    "ptr a, i64 as0, ptr b, i64 bs0, ptr neg_exp_a, ptr dt_bias, ptr g, ptr beta, i32 T, i32 H",
    "gdn_gates",
)
AttnPrepArgs = builder(
    "AttnPrepArgs",
    (
        "ptr q, i64 qs0, i64 qs1, ptr k, i64 ks0, i64 ks1, ptr v, i64 vs0, i64 vs1, ptr wq, ptr wk, "
        "ptr inv_freq, ptr q_out, ptr kc, ptr vc, ptr sp, i64 sv, i32 Hq, i32 Hkv, i32 D, i32 half, "
        "i64 max_ctx, f32 eps"
    ),
    "attn_prep_ws",
    "attn_prep_wf",
)
ArgmaxPartialArgs = builder(
    "ArgmaxPartialArgs",
    "ptr logits, i64 ls0, i32 n, i32 chunk, i32 vec_ok, ptr pm, ptr ps, ptr pi, ptr tok, ptr prob, ptr cnt",
    "argmax_partial",
)
ArgmaxAcceptArgs = builder(
    "ArgmaxAcceptArgs",
    (
        "ptr logits, i64 ls0, i32 n, i32 chunk, i32 vec_ok, ptr pm, ptr ps, ptr pi, ptr tok, ptr prob, ptr cnt, "
        "ptr drafts, ptr probs, f64 p_min, ptr cache_len, ptr out, i32 nd, ptr start"
    ),
    "argmax_accept",
)
ArgmaxCombineArgs = builder(
    "ArgmaxCombineArgs",
    "ptr pm, ptr ps, ptr pi, i32 P, ptr tok, ptr prob",
    "argmax_combine",
)
GreedyAcceptArgs = builder(
    "GreedyAcceptArgs",
    "ptr drafts, ptr probs, ptr target, f64 p_min, ptr cache_len, ptr out, i32 n, ptr start",
    "greedy_accept",
)

# ---- gemv_kernels.cu ----------------------------------------------------------------------------------
GemvArgs = builder(
    "GemvArgs",
    "ptr x, i64 xs, ptr w, i64 wsr, ptr out, ptr part, i32 M, i32 N, i32 K, i32 kchunk, i32 vec_ok",
    *(f"gemv_simt_m{mb}_c{c}" for mb in (1, 4, 8, 17) for c in (1, 2)),
    *(f"gemv_tc_t{mt}_c{ct}" for mt in (1, 2, 3) for ct in (1, 2)),
)
GemvNormArgs = builder(
    "GemvNormArgs",
    "ptr x, i64 xs, ptr w, i64 wsr, ptr out, i32 M, i32 N, i32 K, f32 xeps",
    *(f"gemv_simt_m1_c{c}_nx" for c in (1, 2)),
    *(f"gemv_tc_t1_c{ct}_nx" for ct in (1, 2)),
)
GemvDeltaArgs = builder(
    "GemvDeltaArgs",
    (
        "ptr x, i64 xs, ptr w, i64 wsr, ptr out, i32 M, i32 N, i32 K, i32 vec_ok, ptr cring, ptr cw, i32 C, "
        "ptr neg_exp_a, ptr dt_bias, ptr ring, ptr o, ptr sp, i64 sv, i32 Hk, i32 Hv, i32 dk, i32 dv, i32 n_planes, "
        "f32 qscale, ptr nw, ptr y, ptr ncnt, ptr gcnt, f32 eps, i32 xnorm, f32 xeps"
    ),
    *(f"gemv_simt_m{mb}_c{c}_dr{dk}" for mb in (1, 4, 8, 17) for c in (1, 2) for dk in (64, 128)),
    *(f"gemv_tc_t{mt}_c{ct}_dr{dk}" for mt in (1, 2, 3) for ct in (1, 2) for dk in (64, 128)),
)
GemvAddNormArgs = builder(
    "GemvAddNormArgs",
    (
        "ptr x, i64 xs, ptr w, i64 wsr, ptr part, i32 M, i32 N, i32 K, i32 kchunk, i32 vec_ok, "
        "ptr r, i64 rs, ptr nw, ptr y, ptr s, ptr cnt, f32 eps"
    ),
    *(f"gemv_simt_m{mb}_c{c}_an" for mb in (1, 4, 8, 17) for c in (1, 2)),
    *(f"gemv_tc_t{mt}_c{ct}_an" for mt in (1, 2, 3) for ct in (1, 2)),
)
GemvSiluArgs = builder(
    "GemvSiluArgs",
    "ptr x, i64 xs, ptr w, i64 wsr, ptr out, i32 M, i32 N, i32 K, i32 vec_ok",
    *(f"gemv_simt_m{mb}_c2_sm" for mb in (1, 4, 8, 17)),
    *(f"gemv_tc_t{mt}_c{ct}_sm" for mt in (1, 2, 3) for ct in (1, 2)),
)
GemvSplitSiluArgs = builder(
    "GemvSplitSiluArgs",
    "ptr x, i64 xs, ptr w, i64 wsr, ptr out, ptr part, i32 M, i32 N, i32 K, i32 kchunk, i32 vec_ok, ptr cnt",
    *(f"gemv_simt_m{mb}_c{c}_ss" for mb in (1, 4, 8, 17) for c in (1, 2)),
    *(f"gemv_tc_t{mt}_c{ct}_ss" for mt in (1, 2, 3) for ct in (1, 2)),
)
GemvMlpArgs = builder(
    "GemvMlpArgs",
    (
        "ptr x, ptr wg, i64 wgs, ptr act, i32 I, i32 K, ptr wd, i64 wds, ptr part, i32 N, i32 kchunk, i32 S, "
        "ptr r, ptr nw, ptr y, ptr s, ptr cnt, ptr mcnt, f32 eps, i32 xnorm"
    ),
    "gemv_simt_m1_c1_mlp",
    "gemv_simt_m1_c2_mlp",
    "gemv_simt_m1_c1_rmlp",
    "gemv_simt_m1_c2_rmlp",
)
GemvCombineArgs = builder(
    "GemvCombineArgs",
    "ptr part, ptr out, i32 S, i32 MN",
    "gemv_combine",
)
GemvCombineSiluArgs = builder(
    "GemvCombineSiluArgs",
    "ptr part, ptr out, i32 S, i32 M, i32 I",
    "gemv_combine_sm",
)

# ---- sampling_kernels.cu -----------------------------------------------------------------------------
SampleProbsArgs = builder(
    "SampleProbsArgs",
    "ptr logits, i64 ls0, i32 n, f32 temperature, i32 top_k, f32 top_p, f32 min_p, ptr out, i64 os0",
    "sample_probs_rows",
)
SampleTokenArgs = builder(
    "SampleTokenArgs",
    "ptr probs, i64 ps0, i32 n, ptr seed, ptr start_ptr, i64 start_val, i32 slot, i32 purpose, ptr tok, ptr prob",
    "sample_token_rows",
)
SpecAcceptArgs = builder(
    "SpecAcceptArgs",
    (
        "ptr drafts, ptr draft_probs, ptr q_rows, i64 qs0, i32 vq, ptr p_rows, i64 ps0, i32 vocab, i32 n, "
        "f64 p_min, ptr seed, ptr start_ptr, i64 start_val, ptr cache_len, ptr out"
    ),
    "spec_accept_k",
)
SyntheticAcceptArgs = builder(
    "SyntheticAcceptArgs",
    (
        "ptr drafts, ptr draft_probs, ptr target, f64 p_min, ptr rates, i32 m, i32 n, ptr seed, ptr start_ptr, "
        "i64 start_val, ptr cache_len, ptr out"
    ),
    "synthetic_accept_k",
)
