"""Typed launch arguments: one builder per CUDA kernel (or family of kernels generated from one macro), whose
fields are the kernel's parameters in the order of its `extern "C" __global__` signature in `cuda_src/*.cu`,
each with its C type. A launch names every argument (`RmsNormArgs(x=..., xs=..., ...)`), and `pack` turns
them into the numpy scalars CuPy passes by value, in declaration order; a builder used for a kernel it does
not describe raises. tests/test_kernel_args.py parses the `.cu` sources and checks every builder's field names,
order and C types against its kernels' parameters, so a reordered or retyped parameter fails a test instead of
corrupting memory. This module needs neither CuPy nor a GPU.
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

# kernel name -> its builder class; builder class -> (its kernels, its field packers)
BUILDERS: dict[str, type] = {}
_PACKERS: dict[type, tuple[frozenset[str], tuple]] = {}


def kernels(*names: str):
    """Register a builder for the kernels `names` (all with the same parameter list)."""

    def register(cls):
        hints = cls.__annotations__
        _PACKERS[cls] = (frozenset(names), tuple(hints[f].pack for f in cls._fields))
        for name in names:
            if name in BUILDERS:
                raise ValueError(f"kernel {name} has two argument builders")
            BUILDERS[name] = cls
        return cls

    return register


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
@kernels("rmsnorm_ws", "rmsnorm_wf")
class RmsNormArgs(NamedTuple):
    x: Ptr
    xs: I64
    w: Ptr
    y: Ptr
    d: I32
    eps: F32


@kernels("add_rmsnorm_ws", "add_rmsnorm_wf")
class AddRmsNormArgs(NamedTuple):
    x: Ptr
    xs: I64
    r: Ptr
    rs: I64
    w: Ptr
    y: Ptr
    s: Ptr
    d: I32
    eps: F32


@kernels(*(f"gated_rmsnorm_w{a}_g{b}" for a in "sf" for b in "sf"))
class GatedRmsNormArgs(NamedTuple):
    x: Ptr
    xs: I64
    gate: Ptr
    gs: I64
    w: Ptr
    y: Ptr
    d: I32
    eps: F32


@kernels(*(f"attn_split_e{e}" for e in (1, 2, 4, 8)))
class AttnSplitArgs(NamedTuple):
    q: Ptr
    qs0: I64
    qs1: I64
    kc: Ptr
    vc: Ptr
    start_ptr: Ptr
    start_val: I64
    Hq: I32
    Hkv: I32
    D: I32
    max_ctx: I64
    scale: F32
    ws_acc: Ptr
    ws_ml: Ptr
    out: Ptr
    gate: Ptr
    gs0: I64
    gs1: I64


@kernels(*(f"attn_tile_e{e}" for e in (1, 2, 4, 8)))
class AttnTileArgs(NamedTuple):
    q: Ptr
    qs0: I64
    qs1: I64
    kc: Ptr
    vc: Ptr
    start_ptr: Ptr
    start_val: I64
    T: I32
    Hq: I32
    Hkv: I32
    D: I32
    max_ctx: I64
    scale: F32
    vec_ok: I32
    ws_acc: Ptr
    ws_ml: Ptr
    out: Ptr
    gate: Ptr
    gs0: I64
    gs1: I64


@kernels("attn_combine", "attn_combine_par")
class AttnCombineArgs(NamedTuple):
    ws_acc: Ptr
    ws_ml: Ptr
    out: Ptr
    S: I32
    D: I32
    gate: Ptr
    gs0: I64
    gs1: I64


@kernels(*(f"conv_update_k{k}_w{a}" for k in range(2, 9) for a in "sf"))
class ConvUpdateArgs(NamedTuple):
    x: Ptr
    xs0: I64
    ring: Ptr
    w: Ptr
    y: Ptr
    sp: Ptr
    sv: I64
    T: I32
    C: I32
    n_planes: I32


@kernels(*(f"gdr_dk{d}_b{a}" for d in (16, 32, 64, 128) for a in "sf"))
class GatedDeltaRuleArgs(NamedTuple):
    q: Ptr
    qs0: I64
    qs1: I64
    k: Ptr
    ks0: I64
    ks1: I64
    v: Ptr
    vs0: I64
    vs1: I64
    g: Ptr
    gs0: I64
    beta: Ptr
    bs0: I64
    ring: Ptr
    out: Ptr
    sp: Ptr
    sv: I64
    T: I32
    Hk: I32
    Hv: I32
    dk: I32
    dv: I32
    n_planes: I32
    qscale: F32


@kernels("silu_mul")
class SiluMulArgs(NamedTuple):
    x: Ptr
    xs: I64
    y: Ptr
    T: I32
    I: I32  # noqa: E741 - the kernel's name for the intermediate size


@kernels("gdn_gates")
class GdnGatesArgs(NamedTuple):
    a: Ptr
    as0: I64
    b: Ptr
    bs0: I64
    neg_exp_a: Ptr
    dt_bias: Ptr
    g: Ptr
    beta: Ptr
    T: I32
    H: I32


@kernels("attn_prep_ws", "attn_prep_wf")
class AttnPrepArgs(NamedTuple):
    q: Ptr
    qs0: I64
    qs1: I64
    k: Ptr
    ks0: I64
    ks1: I64
    v: Ptr
    vs0: I64
    vs1: I64
    wq: Ptr
    wk: Ptr
    inv_freq: Ptr
    q_out: Ptr
    kc: Ptr
    vc: Ptr
    sp: Ptr
    sv: I64
    Hq: I32
    Hkv: I32
    D: I32
    half: I32
    max_ctx: I64
    eps: F32


@kernels("argmax_partial")
class ArgmaxPartialArgs(NamedTuple):
    logits: Ptr
    ls0: I64
    n: I32
    chunk: I32
    vec_ok: I32
    pm: Ptr
    ps: Ptr
    pi: Ptr
    tok: Ptr
    prob: Ptr


@kernels("argmax_combine")
class ArgmaxCombineArgs(NamedTuple):
    pm: Ptr
    ps: Ptr
    pi: Ptr
    P: I32
    tok: Ptr
    prob: Ptr


@kernels("greedy_accept")
class GreedyAcceptArgs(NamedTuple):
    drafts: Ptr
    probs: Ptr
    target: Ptr
    p_min: F64
    cache_len: Ptr
    out: Ptr
    n: I32


# ---- sampling_kernels.cu -----------------------------------------------------------------------------
@kernels("sample_probs_rows")
class SampleProbsArgs(NamedTuple):
    logits: Ptr
    ls0: I64
    n: I32
    temperature: F32
    top_k: I32
    top_p: F32
    min_p: F32
    out: Ptr
    os0: I64


@kernels("sample_token_rows")
class SampleTokenArgs(NamedTuple):
    probs: Ptr
    ps0: I64
    n: I32
    seed: Ptr
    start_ptr: Ptr
    start_val: I64
    slot: I32
    purpose: I32
    tok: Ptr
    prob: Ptr


@kernels("spec_accept_k")
class SpecAcceptArgs(NamedTuple):
    drafts: Ptr
    draft_probs: Ptr
    q_rows: Ptr
    qs0: I64
    vq: I32
    p_rows: Ptr
    ps0: I64
    vocab: I32
    n: I32
    p_min: F64
    seed: Ptr
    start_ptr: Ptr
    start_val: I64
    cache_len: Ptr
    out: Ptr
