"""CuPy CUDA kernels for the decode-path ops: one function per op, each with exactly the signature of its
PyTorch reference in `kernels/reference.py` (the ground truth, see tests/test_kernels_gpu.py).

- Kernels live in `cuda_src/decode_kernels.cu`, compiled by CuPy (NVRTC) once per (device, dtype) at first
  use; `warm_up(device, dtype)` compiles, loads and runs every kernel once, so nothing is compiled or
  loaded later (call it before capturing CUDA graphs, in the thread that captures).
- Launches go to PyTorch's current stream (so they are captured by `torch.cuda.graph`); arguments are
  `tensor.data_ptr()` and numpy scalars. Outputs and small workspaces are allocated with torch (shapes
  depend only on the input shapes), never with CuPy. No op synchronises with the host.
- `start` may be a host int or a 1-element int64 CUDA tensor; a tensor is read by the kernel from device
  memory (what a captured graph needs), never copied to the host.
- Tensors that are not on a CUDA device, and dtype/shape combinations the kernels do not cover, take the
  reference path (documented per op below).
- This module imports without CuPy or CUDA; `available()` says whether the kernels can run here.
"""

from __future__ import annotations

import ctypes
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from . import launch_args as la
from . import pdl, reference, registry
from .reference import Start
from .registry import NAMES as OP_NAMES

# The chunked (GEMM) form of the delta rule is used only for prefill and stays PyTorch.
chunk_gated_delta_rule = reference.chunk_gated_delta_rule

try:  # CuPy is optional: specdeck[cuda12] / specdeck[cuda13]
    import cupy as _cp

    _CUPY_ERROR: str | None = None
except Exception as _e:  # noqa: BLE001 - any import failure means "not available"
    _cp = None
    _CUPY_ERROR = (
        "CuPy is not installed; install specdeck[cuda12] or specdeck[cuda13]"
        if isinstance(_e, ModuleNotFoundError)
        else f"CuPy failed to import ({type(_e).__name__}: {_e})"
    )

# One function per op of the dispatcher (kernels/registry.py lists them), plus the module's own two.
__all__ = ["available", "warm_up", *OP_NAMES]

_SRC_PATH = Path(__file__).resolve().parent / "cuda_src" / "decode_kernels.cu"
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OPTIONS = ("-std=c++17",)

_lock = threading.Lock()
_source_text: str | None = None
_modules: dict[tuple[int, int], object] = {}
_functions: dict[tuple[int, int, str], object] = {}
_PDL = False  # programmatic dependent launch for kernels launched while a plan is captured (set_pdl)
_streams: dict[int, object] = {}
_sm_count: dict[int, int] = {}


# ---- availability ---------------------------------------------------------------------------------
def available() -> tuple[bool, str]:
    """(True, description) when the kernels can run here, else (False, a one-line reason)."""
    if _cp is None:
        return False, _CUPY_ERROR or "CuPy is not installed"
    if torch.version.cuda is None:
        return False, "this PyTorch build has no CUDA support"
    try:
        has_cuda = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001
        return False, f"PyTorch cannot query CUDA ({e})"
    if not has_cuda:
        return False, "PyTorch sees no CUDA device"
    try:
        cupy_rt = int(_cp.cuda.runtime.runtimeGetVersion())
    except Exception as e:  # noqa: BLE001
        return False, f"CuPy cannot load its CUDA runtime ({type(e).__name__}: {e})"
    cupy_major = cupy_rt // 1000
    torch_major = int(str(torch.version.cuda).split(".")[0])
    if cupy_major != torch_major:
        return False, (
            f"CuPy was built for CUDA {cupy_major} but torch uses CUDA {torch_major}; "
            f"install specdeck[cuda{torch_major}]"
        )
    try:
        driver = int(_cp.cuda.runtime.driverGetVersion())
    except Exception as e:  # noqa: BLE001
        return False, f"CuPy cannot query the CUDA driver ({type(e).__name__}: {e})"
    if driver // 1000 < cupy_major:
        return False, f"the CUDA driver supports CUDA {driver // 1000}.x but CuPy needs CUDA {cupy_major}"
    return True, f"CuPy {_cp.__version__} (CUDA {cupy_major}.{cupy_rt % 1000 // 10}), torch CUDA {torch.version.cuda}"


# ---- compilation, loading, launching ----------------------------------------------------------------
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)".*$', re.MULTILINE)


def expand_includes(path: Path) -> str:
    """The text of the CUDA source at `path` with each `#include "<name>.cuh"` line replaced by that header's
    text (from the same folder; each header once, its `#pragma once` dropped): what NVRTC compiles, and what the
    kernels' hashes (cache keys) are made of, so that a header edit changes them."""
    seen: set[str] = set()

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"// {name}: included above"
        seen.add(name)
        text = (path.parent / name).read_text().replace("#pragma once\n", "")
        return _INCLUDE.sub(one, text).rstrip("\n")

    return _INCLUDE.sub(one, path.read_text())


def _source() -> str:
    global _source_text
    if _source_text is None:
        _source_text = expand_includes(_SRC_PATH)
    return _source_text


def _decode_code(kind: int) -> str:
    return f"#define SCALAR_KIND {kind}\n" + _source()


def _compile(kind: int):
    code = _decode_code(kind)
    try:
        return _raw_module(code)
    except Exception as first:  # noqa: BLE001
        # The CUDA half headers can clash with CuPy's bundled fp16 header under NVRTC; the kernels then
        # use their own 2-byte storage types (same round-to-nearest-even PTX conversions).
        try:
            return _raw_module("#define SPECDECK_OWN_HALF 1\n" + code)
        except Exception:  # noqa: BLE001
            raise first from None


def _load_function(fns: dict, fn_key, modules: dict, mod_key, dev: int, name: str, build):
    """Kernel `name` of a module compiled once per `mod_key` by `build()` (under the lock; on device `dev`),
    the loaded cupy.cuda.function.Function kept in `fns` under `fn_key`."""
    fn = fns.get(fn_key)
    if fn is None:
        with _lock:
            fn = fns.get(fn_key)
            if fn is None:
                with _cp.cuda.Device(dev):
                    mod = modules.get(mod_key)
                    if mod is None:
                        mod = build()
                        modules[mod_key] = mod
                    fn = mod.get_function(name).kernel
                fns[fn_key] = fn
    return fn


def _raw_module(code: str):
    mod = _cp.RawModule(code=code, options=_OPTIONS)
    mod.compile()
    return mod


def _function(dev: int, kind: int, name: str):
    return _load_function(_functions, (dev, kind, name), _modules, (dev, kind), dev, name, lambda: _compile(kind))


def _stream(device: torch.device):
    ptr = torch.cuda.current_stream(device).cuda_stream
    s = _streams.get(ptr)
    if s is None:
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _cp.cuda.ExternalStream(ptr)
        _streams[ptr] = s
    return s


def _launch(name: str, dtype: torch.dtype | None, device: torch.device, grid, block, args, shared_mem: int = 0) -> None:
    """Launch kernel `name` of the module for `dtype` (None: a dtype-independent kernel, taken from any
    module already loaded on the device) on PyTorch's current stream. `args`: the kernel's typed builder
    (kernels/launch_args.py), packed here in the kernel's parameter order."""
    args = la.pack(name, args)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dtype is None:
        kind = next((kd for (dv_, kd) in list(_modules) if dv_ == dev), 0)
    else:
        kind = _KIND[dtype]
    _call(_function(dev, kind, name), dev, grid, block, args, shared_mem, _stream(device))


def set_pdl(on: bool) -> bool:
    """Launch the kernels of plans being captured with programmatic dependent launch (kernels/pdl.py), or not.
    Returns whether it is on: False where the driver or the GPU (compute capability < 9.0) cannot. Plans
    captured before a change keep how they were captured."""
    global _PDL
    _PDL = bool(on) and pdl.available() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    return _PDL


def _call(fn, dev: int, grid, block, args: tuple, shared_mem: int, stream, cooperative: bool = False) -> None:
    """Launch a loaded kernel on `stream`: with PDL while a plan is captured (when on), else through CuPy;
    `cooperative` (a kernel whose blocks wait for one another: all must be resident at once) through the driver's
    cooperative launch, which fails rather than leave blocks unscheduled."""
    with_pdl = _PDL and torch.cuda.is_current_stream_capturing()
    if _cp.cuda.runtime.getDevice() != dev:
        with _cp.cuda.Device(dev):
            _call_here(fn, grid, block, args, shared_mem, stream, with_pdl, cooperative)
    else:
        _call_here(fn, grid, block, args, shared_mem, stream, with_pdl, cooperative)


def _call_here(fn, grid, block, args: tuple, shared_mem: int, stream, with_pdl: bool, cooperative: bool) -> None:
    if with_pdl or cooperative:
        pdl.launch(fn.ptr, grid, block, args, shared_mem, stream.ptr, with_pdl, cooperative)
    else:
        fn(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)


def _sms(device: torch.device) -> int:
    dev = device.index if device.index is not None else torch.cuda.current_device()
    n = _sm_count.get(dev)
    if n is None:
        n = torch.cuda.get_device_properties(dev).multi_processor_count
        _sm_count[dev] = n
    return n


def _p(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


_NULL = la.NULL


def _start_args(start: Start, device: torch.device) -> tuple[np.uint64, np.int64]:
    """(pointer, value): a CUDA tensor is passed by pointer (read in the kernel), anything else by value."""
    if isinstance(start, torch.Tensor):
        s = start.reshape(-1)
        if s.device.type != "cuda":
            return _NULL, np.int64(int(s[0]))  # host memory: no device sync
        if s.device != device:
            raise ValueError(f"start is on {s.device} but the op runs on {device}")
        if s.dtype != torch.int64:
            raise TypeError(f"a device start must be int64, got {s.dtype}")
        return _p(s), np.int64(0)
    return _NULL, np.int64(int(start))


# Block counters of the kernels whose last block to finish does the launch's final step (the fused gemv + add +
# norm, the delta rule + gated norm): int32, zero between launches (each launch's last block leaves its counters
# at zero, so captured plans replay with no reset). One pool a device, made at the first eager use (warm_up,
# gemv_kernels, or a fused op called outside a capture; inside one it would only be recorded); a weight keeps its counters for the process (the
# same weight is never used on two streams at once).
_COUNTER_POOL = 1 << 20
_counter_pools: dict[int, torch.Tensor] = {}  # device -> the pool
_counter_at: dict[tuple, int] = {}  # (device, key, slots) -> offset in the pool
_counter_used: dict[int, int] = {}  # device -> counters handed out


def _counter_pool(device: torch.device) -> None:
    dev = _dev_index(device)
    if dev not in _counter_pools and not torch.cuda.is_current_stream_capturing():
        _counter_pools[dev] = torch.zeros(_COUNTER_POOL, dtype=torch.int32, device=torch.device("cuda", dev))


def _counters(device: torch.device, key: tuple, slots: int) -> torch.Tensor | None:
    """The `slots` counters of `key` (a kernel family and a weight's address), or None where none can be had
    (the pool is spent, or it was never made outside a capture): the caller then takes its unfused form."""
    dev = _dev_index(device)
    if dev not in _counter_pools:
        _counter_pool(device)  # an eager call (a plan's first round runs eagerly before its capture)
    pool = _counter_pools.get(dev)
    if pool is None:
        return None
    full = (dev, key, slots)
    at = _counter_at.get(full)
    if at is None:
        used = _counter_used.get(dev, 0)
        if used + slots > pool.numel():
            return None
        at = _counter_at[full] = used
        _counter_used[dev] = used + slots
    return pool[at : at + slots]


def _fallback(op: str, first: torch.Tensor):
    """The reference of `op`, for a call the kernel does not take; counted and reported once per op
    (kernels/registry.py) when the call was meant for a GPU. CPU tensors take the reference by design."""
    if registry.on_gpu(first):
        registry.count_fallback(
            op, _CUPY_ERROR if _cp is None else "a shape, dtype or layout its kernel does not cover"
        )
    return getattr(reference, op)


def _cuda_ok(*tensors: torch.Tensor) -> bool:
    return _cp is not None and all(t.is_cuda for t in tensors)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """x viewed as [rows, d] with contiguous rows (a copy only when no such view exists)."""
    x2 = x.reshape(-1, d)
    if d > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def _aux(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A weight/gate operand: same dtype as the activations -> 's' kernels, else upcast to fp32 -> 'f'
    kernels (exact for the reference's maths: a mixed-dtype product promotes to fp32 there too)."""
    if t.dtype == dtype:
        return t.contiguous(), "s"
    return t.float().contiguous(), "f"


def _heads(name: str, x: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """A [T, H, D] operand as the kernels take it: pointer `name`, token stride `name`s0, head stride `name`s1."""
    return {name: x, f"{name}s0": x.stride(0), f"{name}s1": x.stride(1)}


_NORM_REG = 8  # elements a thread keeps in registers in the norm kernels (NORM_REG in decode_kernels.cu)


def _norm_threads(d: int) -> int:
    return min(1024, max(32, ((d + 7) // 8 + 31) // 32 * 32))


# ---- ops ----------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _cuda_ok(x, weight) or x.dtype not in _KIND or x.dim() == 0 or weight.numel() != x.shape[-1]:
        return _fallback("rmsnorm", x)(x, weight, eps)
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x2 = _rows(x, d)
    w, ws = _aux(weight, x.dtype)
    _launch(
        f"rmsnorm_w{ws}",
        x.dtype,
        x.device,
        (x2.shape[0],),
        (_norm_threads(d),),
        la.RmsNormArgs(x=x2, xs=x2.stride(0), w=w, y=y, d=d, eps=eps),
    )
    return y


def embed_rmsnorm(
    ids: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    d = embed.shape[-1] if embed.dim() == 2 else 0
    if (
        not _cuda_ok(ids, embed, weight)
        or embed.dtype not in _KIND
        or ids.dtype != torch.int64
        or ids.dim() != 1
        or d == 0
        or (d > 1 and embed.stride(1) != 1)
        or weight.numel() != d
    ):
        return _fallback("embed_rmsnorm", ids)(ids, embed, weight, eps)
    t = ids.shape[0]
    y = torch.empty((t, d), dtype=embed.dtype, device=embed.device)
    s = torch.empty((t, d), dtype=embed.dtype, device=embed.device)
    if t == 0:
        return y, s
    w, ws = _aux(weight, embed.dtype)
    _launch(
        f"embed_rmsnorm_w{ws}",
        embed.dtype,
        embed.device,
        (t,),
        (_norm_threads(d),),
        la.EmbedRmsNormArgs(
            ids=ids.contiguous(), embed=embed, es=embed.stride(0), vocab=embed.shape[0], w=w, y=y, s=s, d=d, eps=eps
        ),
    )
    return y, s


def store_rows(dst: torch.Tensor, rows: torch.Tensor, start: Start) -> None:
    if (
        not _cuda_ok(dst, rows)
        or dst.dtype not in _KIND
        or rows.dtype != dst.dtype
        or dst.dim() != 2
        or rows.dim() != 2
        or rows.shape[1] != dst.shape[1]
        or (dst.shape[1] > 1 and (dst.stride(1) != 1 or rows.stride(1) != 1))
        or (isinstance(start, torch.Tensor) and not _one_long(start))
    ):
        return _fallback("store_rows", dst)(dst, rows, start)
    t, d = rows.shape
    if t == 0 or d == 0:
        return None
    sp, sv = _start_args(start, dst.device)
    _launch(
        "store_rows",
        dst.dtype,
        dst.device,
        (t,),
        (min(1024, max(32, -(-d // 32) * 32)),),
        la.StoreRowsArgs(
            src=rows, ss=rows.stride(0), dst=dst, ds=dst.stride(0), start_ptr=sp, start_val=sv, d=d, n_dst=dst.shape[0]
        ),
    )
    return None


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        not _cuda_ok(x, residual, weight)
        or x.dtype not in _KIND
        or residual.dtype != x.dtype
        or residual.shape != x.shape
        or x.dim() == 0
        or weight.numel() != x.shape[-1]
    ):
        return _fallback("add_rmsnorm", x)(x, residual, weight, eps)
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y, s
    x2, r2 = _rows(x, d), _rows(residual, d)
    w, ws = _aux(weight, x.dtype)
    _launch(
        f"add_rmsnorm_w{ws}",
        x.dtype,
        x.device,
        (x2.shape[0],),
        (_norm_threads(d),),
        la.AddRmsNormArgs(x=x2, xs=x2.stride(0), r=r2, rs=r2.stride(0), w=w, y=y, s=s, d=d, eps=eps),
    )
    return y, s


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (
        not _cuda_ok(x, gate, weight)
        or x.dtype not in _KIND
        or gate.shape != x.shape
        or x.dim() == 0
        or weight.numel() != x.shape[-1]
    ):
        return _fallback("gated_rmsnorm", x)(x, gate, weight, eps)
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x2 = _rows(x, d)
    gs = "s" if gate.dtype == x.dtype else "f"
    g2 = _rows(gate if gs == "s" else gate.float(), d)
    w, ws = _aux(weight, x.dtype)
    _launch(
        f"gated_rmsnorm_w{ws}_g{gs}",
        x.dtype,
        x.device,
        (x2.shape[0],),
        (_norm_threads(d),),
        la.GatedRmsNormArgs(x=x2, xs=x2.stride(0), gate=g2, gs=g2.stride(0), w=w, y=y, d=d, eps=eps),
    )
    return y


_ATT_MAX_SPLITS = 128  # what "warp" and "tile" may use
_ATT_VEC_MAX_SPLITS = 256  # "vec" at more than 4 blocks a SM (the sweep): ATT_MAX_SPLITS of the combine kernels
_ATT_MAX_KERNEL_ROWS = 64
# "tile": K/V tiles in shared memory shared by all query rows of a kv head;
# "warp": one block per (query row, head) and key split, a warp per key;
# "vec": one block per (query row, kv head) and key split serving the kv head's query heads, 16-byte loads;
# "vecb": "vec" with the butterfly reduction (4 query heads a kv head, head_dim 129..256; else "vec");
# "auto" (default): "vecb" (else "vec") up to _ATT_VEC_MAX_ROWS query rows where its shape limits allow (else
# "warp" for one row), "tile" for more (bench/attention_sweep.py times them per T and context).
# The sweep of 2026-12-01 (H200, us at 1k/8k/32k/128k): T=1 vecb 21.1/25.4/52.8/151.5, vec 22.8/27.2/60.7/186.4;
# T=4 vecb 17.8/43.0/141.5/533.2, vec 20.0/52.7/176.4/671.4, tile 43.3/72.2/240.3/858.1; T=16 vecb
# 29.4/142.9/529.1/2083, vec 34.1/184.2/690.4/2713; 8 blocks a SM slower than 4 for both.
_ATT_IMPL = "auto"
# "fold" (default): the "vecb" form merges its split partials in the same launch (the last split of a row and kv
# head merges them, attn_vecb_u2_g4_f; only the splits that hold keys take part, the others return at once, which
# bench/attention_fold.py times); other forms, and "par": a launch of attn_combine_par after the splits;
# "serial": one thread of attn_combine merges them (cross-check)
_ATT_COMBINE = "fold"
# The least keys a "vecb" split takes in the fold form (a short context: fewer, longer splits; decode_kernels.cu
# AV_MIN_KEYS is the other forms')
_ATT_FOLD_MIN_KEYS = 64
# ... for one query row (a target-only step, a draft step; and every row in row-invariant mode, so that a verify's
# row splits as a step's): shorter splits, more of them in flight. H200, decode_ab.py --fold-min-keys 64,16,32
# (bench/results/h200-pipelined-2026-12-02.txt), us a call at 128/512/2k/8k/32k keys, T = 1: 64 keys 13.0/14.2/
# 20.5/29.5/56.5, 32 keys 10.8/13.4/19.2/30.0/56.5, 16 keys 10.1/14.1/22.6/30.1/56.5; T = 4: 32 keys faster at
# 128/512 (10.5, 14.4 against 12.8, 15.5) but slower at 2k (20.5 against 19.7), so several rows keep 64.
_ATT_FOLD_MIN_KEYS_ONE_ROW = 32
_ATT_MIN_KEYS_PER_SPLIT = 64
# Blocks per SM the key splits aim for. A block walks its keys one dependent step after another, so a
# long context needs many blocks in flight to keep memory busy; splits past the context's length return
# at once. Timed on the H200 ([T, 16, 256] bf16, 4 KV heads, device start, us per call at 1k/32k/128k):
# "warp", T=1: 2 a SM 13.6/431/1802, 8 a SM 16.2/139/519 (more: capped at _ATT_MAX_SPLITS, no faster);
# "tile", T=4: 2 a SM 46.7/265/954, 4 a SM 56.0/294/960 (it already shares K/V tiles between rows).
# "vec"/"vecb": see the sweep above (4 a SM beat 8). An earlier grouped "warp" walk with 2-byte loads was
# 26.9/233/883 at T=1 (its four heads' register state cut the loads in flight more than the shared reads saved).
_ATT_WARP_BLOCKS_PER_SM = 8
_ATT_TILE_BLOCKS_PER_SM = 2
# "vec"/"vecb": a block serves the query heads of one kv head with 16-byte loads, K and V of two key steps in
# flight per lane (decode_kernels.cu, attn_vec_impl).
_ATT_VEC_BLOCKS_PER_SM = 4
_ATT_VEC_MIN_STEPS = 2
_ATT_VEC_UNROLL = 2  # key steps whose K and V loads a lane issues together: 2 or 4 (kernels for both)
_ATT_VEC_MIN_SPLITS = 16  # wide verify rows still get the context split (T=16: 16 splits beat 8)
# Up to this many query rows "auto" takes "vecb"/"vec" (one block per row reads K/V again, from L2); past it "tile".
_ATT_VEC_MAX_ROWS = 17
# Row-invariant decode attention (gemm mode "exact", set_row_invariant): the splits come from the cache size
# only (not the row count, not whether `start` is on the host), so a row's result is the same in a verify of
# T rows as in a one-row step; "vecb"/"vec" where they fit, else "warp", for every width up to _ATT_MAX_KERNEL_ROWS.
_ATT_ROW_INVARIANT = False


def set_row_invariant(on: bool) -> None:
    global _ATT_ROW_INVARIANT
    _ATT_ROW_INVARIANT = bool(on)


def _att_splits(device: torch.device, t: int, hq: int, max_keys: int) -> int:
    """Key splits per (row, head): about _ATT_WARP_BLOCKS_PER_SM blocks per SM, each split at least a few
    warps' worth of keys."""
    want = max(1, -(-_ATT_WARP_BLOCKS_PER_SM * _sms(device) // (t * hq)))
    cap = max(1, -(-max_keys // _ATT_MIN_KEYS_PER_SPLIT))
    return max(1, min(want, cap, _ATT_MAX_SPLITS))


def _att_vec_splits(device: torch.device, t: int, hkv: int, d: int, max_keys: int, unroll: int | None = None) -> int:
    """Key splits per (row, kv head) of the "vec" kernel: about _ATT_VEC_BLOCKS_PER_SM blocks per SM, each
    split at least _ATT_VEC_MIN_STEPS block steps of keys (a step: 4 warps x 32 / LPR keys x the unroll)."""
    lpr = 1
    while lpr * 8 < d:
        lpr *= 2
    step = 4 * (32 // lpr) * (unroll or _ATT_VEC_UNROLL)
    want = max(_ATT_VEC_MIN_SPLITS, -(-_ATT_VEC_BLOCKS_PER_SM * _sms(device) // (t * hkv)))
    cap = max(1, -(-max_keys // (_ATT_VEC_MIN_STEPS * step)))
    return max(1, min(want, cap, _ATT_VEC_MAX_SPLITS))


def _attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    scale: float,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """T queries at positions start..start+T-1 over keys 0..start+T-1: scaled_dot_product_attention with
    a bottom-right causal mask (flash attention in bf16/fp16; tiles, never a T x keys matrix), grouped
    KV heads read in place."""
    from torch.nn.attention.bias import causal_lower_right

    t, hq, d = q.shape
    total = start + t
    hkv = k_cache.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    kh = k_cache[:total].transpose(0, 1)[None]  # [1, Hkv, total, D]
    vh = v_cache[:total].transpose(0, 1)[None]
    mask = causal_lower_right(t, total)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=hq != hkv
    )
    out = out[0].transpose(0, 1)
    return out if gate is None else out * torch.sigmoid(gate)


def attention_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: Start,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        return _fallback("attention_cached", q)(q, k_cache, v_cache, start, scale, gate)
    if (
        not _cuda_ok(q, k_cache, v_cache)
        or q.dtype not in _KIND
        or not (q.dtype == k_cache.dtype == v_cache.dtype)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or q.dim() != 3
        or q.shape[2] > 256
        or q.shape[2] != k_cache.shape[2]
        or q.shape[1] % k_cache.shape[1] != 0
    ):
        return _fallback("attention_cached", q)(q, k_cache, v_cache, start, scale, gate)
    t, hq, d = q.shape
    if t > _ATT_MAX_KERNEL_ROWS and not (isinstance(start, torch.Tensor) and start.is_cuda):
        # prefill-sized batches with a host start: PyTorch's fused attention beats per-row decoding
        return _attention_prefill(q, k_cache, v_cache, int(start), scale, gate)
    hkv = k_cache.shape[1]
    max_ctx = k_cache.shape[0]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    qc = q if q.stride(2) == 1 else q.contiguous()
    sp, sv = _start_args(start, q.device)
    max_keys = max_ctx if sp != _NULL or _ATT_ROW_INVARIANT else min(max_ctx, int(sv) + t)
    split_rows = 1 if _ATT_ROW_INVARIANT else t  # the row count the splits are sized for
    epl = 1 if d <= 32 else 2 if d <= 64 else 4 if d <= 128 else 8
    groups_of = hq // hkv
    kv_aligned = k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0  # 16-byte K/V rows (with D)
    vec_fits = groups_of in (1, 2, 4, 8) and d % 8 == 0 and kv_aligned
    if _ATT_IMPL != "auto":
        impl = _ATT_IMPL
    elif vec_fits and (t <= _ATT_VEC_MAX_ROWS or _ATT_ROW_INVARIANT):
        impl = "vecb"  # "vec" where the butterfly's shape limits are not met (below)
    else:
        impl = "warp" if t == 1 or _ATT_ROW_INVARIANT else "tile"
    if impl == "vecb" and not (vec_fits and groups_of == 4 and 128 < d <= 256):
        impl = "vec"
    if impl == "vec" and not vec_fits:
        impl = "warp"
    fold = None
    if impl == "vecb":
        splits = _att_vec_splits(q.device, split_rows, hkv, d, max_keys, unroll=2)
        grid, name = (splits, hkv, t), "attn_vecb_u2_g4"
        if splits > 1 and _ATT_COMBINE == "fold":
            fold = _counters(q.device, ("attn", k_cache.data_ptr()), t * hkv)  # None: the combine launch
    elif impl == "vec":
        splits = _att_vec_splits(q.device, split_rows, hkv, d, max_keys)
        grid, name = (splits, hkv, t), f"attn_vec_u{_ATT_VEC_UNROLL}_g{groups_of}"
    elif impl == "tile":
        rb, kt = (8, 16) if q.dtype == torch.float32 else (16, 32)
        groups = -(-(t * groups_of) // rb)
        want = -(-_ATT_TILE_BLOCKS_PER_SM * _sms(q.device) // (hkv * groups))
        splits = max(1, min(want, -(-max_keys // (2 * kt)), _ATT_MAX_SPLITS))
        vec_ok = int(d % (16 // q.element_size()) == 0 and kv_aligned)
        grid, name = (splits, hkv, groups), f"attn_tile_e{epl}"
    else:
        splits = _att_splits(q.device, split_rows, hq, max_keys)
        grid, name = (splits, hq, t), f"attn_split_e{epl}"
    if splits > 1:
        ws_acc = torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((splits, t, hq, 2), dtype=torch.float32, device=q.device)
        pa, pm = _p(ws_acc), _p(ws_ml)
    else:
        pa = pm = _NULL
    gates = (
        {"gate": gate, "gs0": 0, "gs1": 0}
        if gate is None
        else {"gate": gate, "gs0": gate.stride(0), "gs1": gate.stride(1)}
    )
    common = {**_heads("q", qc), "kc": k_cache, "vc": v_cache, "start_ptr": sp}
    common |= {"start_val": sv, "Hq": hq, "Hkv": hkv, "D": d, "max_ctx": max_ctx, "scale": scale}
    common |= {"ws_acc": pa, "ws_ml": pm, "out": out, **gates}
    if impl == "tile":
        args = la.AttnTileArgs(T=t, vec_ok=vec_ok, **common)
    elif fold is not None:
        name = "attn_vecb_u2_g4_f"
        least = _ATT_FOLD_MIN_KEYS_ONE_ROW if t == 1 or _ATT_ROW_INVARIANT else _ATT_FOLD_MIN_KEYS
        args = la.AttnFoldArgs(**common, cnt=fold, min_keys=least)
    else:
        args = la.AttnSplitArgs(**common)
    _launch(name, q.dtype, q.device, grid, (128,), args)
    if splits > 1 and fold is None:
        if _ATT_COMBINE in ("par", "fold"):
            name, threads = "attn_combine_par", max(32, -(-max(d, splits) // 32) * 32)
        else:
            name, threads = "attn_combine", min(256, max(32, (d + 31) // 32 * 32))
        combine = la.AttnCombineArgs(ws_acc=pa, ws_ml=pm, out=out, S=splits, D=d, **gates)
        _launch(name, q.dtype, q.device, (hq, t), (threads,), combine)
    return out


_PREP_MAX_D = 1024  # attn_prep keeps a row in shared memory (PREP_MAX_D in the kernel source)


def attn_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    if (
        not _cuda_ok(q, k, v, q_weight, k_weight, k_cache, v_cache)
        or q.dtype not in _KIND
        or not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or q.dim() != 3
        or k.shape != v.shape
        or k.dim() != 3
        or k.shape[1:] != k_cache.shape[1:]
        or k_cache.shape != v_cache.shape
        or q.shape[2] != k.shape[2]
        or q.shape[0] != k.shape[0]
        or q.shape[2] > _PREP_MAX_D
        or q_weight.numel() != q.shape[2]
        or k_weight.numel() != k.shape[2]
        or 2 * inv_freq.numel() > q.shape[2]
        or min(q.stride(2), k.stride(2), v.stride(2)) != 1
    ):
        return _fallback("attn_prep", q)(q, k, v, q_weight, k_weight, eps, inv_freq, k_cache, v_cache, start)
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    wq, kq = _aux(q_weight, q.dtype)
    wk, kk = _aux(k_weight, q.dtype)
    if kq != kk:
        wq, wk, kq = q_weight.float().contiguous(), k_weight.float().contiguous(), "f"
    inv = inv_freq.reshape(-1)
    if inv.device != q.device or inv.dtype != torch.float32:
        inv = inv.to(device=q.device, dtype=torch.float32)
    inv = inv.contiguous()
    sp, sv = _start_args(start, q.device)
    _launch(
        f"attn_prep_w{kq}",
        q.dtype,
        q.device,
        (hq + hkv, t),
        (_norm_threads(d),),
        la.AttnPrepArgs(
            **_heads("q", q),
            **_heads("k", k),
            **_heads("v", v),
            wq=wq,
            wk=wk,
            inv_freq=inv,
            q_out=out,
            kc=k_cache,
            vc=v_cache,
            sp=sp,
            sv=sv,
            Hq=hq,
            Hkv=hkv,
            D=d,
            half=inv.numel(),
            max_ctx=k_cache.shape[0],
            eps=eps,
        ),
    )
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if not _cuda_ok(x) or x.dtype not in _KIND or x.dim() == 0 or x.shape[-1] % 2:
        return _fallback("silu_mul", x)(x)
    two_i = x.shape[-1]
    i = two_i // 2
    x2 = _rows(x, two_i)
    y = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    n = x2.shape[0] * i
    if n == 0:
        return y
    _launch(
        "silu_mul",
        x.dtype,
        x.device,
        ((n + 255) // 256,),
        (256,),
        la.SiluMulArgs(x=x2, xs=x2.stride(0), y=y, T=x2.shape[0], I=i),
    )
    return y


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, neg_exp_a: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        not _cuda_ok(a, b, neg_exp_a, dt_bias)
        or a.dtype not in _KIND
        or b.dtype != a.dtype
        or a.dim() != 2
        or a.shape != b.shape
        or neg_exp_a.numel() != a.shape[1]
        or dt_bias.numel() != a.shape[1]
        or neg_exp_a.dtype != torch.float32
    ):
        return _fallback("gdn_gates", a)(a, b, neg_exp_a, dt_bias)
    t, h = a.shape
    a2, b2 = _rows(a, h), _rows(b, h)
    g = torch.empty((t, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, h), dtype=b.dtype, device=a.device)
    if t * h == 0:
        return g, beta
    _launch(
        "gdn_gates",
        a.dtype,
        a.device,
        ((t * h + 127) // 128,),
        (128,),
        la.GdnGatesArgs(
            a=a2,
            as0=a2.stride(0),
            b=b2,
            bs0=b2.stride(0),
            neg_exp_a=neg_exp_a.contiguous(),
            dt_bias=dt_bias.float().contiguous(),
            g=g,
            beta=beta,
            T=t,
            H=h,
        ),
    )
    return g, beta


_CONV_MAX_KERNEL_ROWS = 64  # up to this many tokens one run a channel (decode's form)
_CONV_RUN = 32  # prefill: tokens a thread walks


def conv_update(x: torch.Tensor, conv_ring: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    if (
        not _cuda_ok(x, conv_ring, weight)
        or x.dtype not in _KIND
        or conv_ring.dtype != x.dtype
        or not conv_ring.is_contiguous()
        or x.dim() != 2
        or weight.dim() != 2
        or not 2 <= weight.shape[1] <= 8
        or conv_ring.shape[2] != weight.shape[1] - 1
    ):
        return _fallback("conv_update", x)(x, conv_ring, weight, start)
    t, c = x.shape
    n = conv_ring.shape[0]
    k = weight.shape[1]
    # Decode (a device start): one run of tokens a channel. Prefill (a host start): runs of >= _CONV_RUN
    # tokens in parallel, the window before the first token copied out of plane `start` first (a later
    # run may overwrite that plane before the first run reads it). 9B-like prefill, 2048 tokens x 8192
    # channels: the reference's cat + grouped conv1d (cuDNN) + SiLU took ~0.45 ms (profile, 2026-12-01).
    host_start = not (isinstance(start, torch.Tensor) and start.is_cuda)
    runs = max(1, t // max(_CONV_RUN, k - 1)) if t > _CONV_MAX_KERNEL_ROWS and host_start else 1
    win = conv_ring[int(start) % n].clone() if runs > 1 else None
    y = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    xc = x if x.stride(1) == 1 else x.contiguous()
    w, ws = _aux(weight, x.dtype)
    sp, sv = _start_args(start, x.device)
    _launch(
        f"conv_update_k{k}_w{ws}",
        x.dtype,
        x.device,
        ((c + 127) // 128, runs),
        (128,),
        la.ConvUpdateArgs(
            x=xc,
            xs0=xc.stride(0),
            ring=conv_ring,
            win=_NULL if win is None else win,
            w=w,
            y=y,
            sp=sp,
            sv=sv,
            T=t,
            C=c,
            n_planes=n,
        ),
    )
    return y


def _gdr_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_ring: torch.Tensor) -> bool:
    """Whether the recurrent rule's kernel takes these operands (raises when the ring is too short for T)."""
    t, hk, dk = q.shape
    n = state_ring.shape[0]
    if t >= n:
        raise ValueError(f"a recurrent batch of {t} tokens needs more than {n} snapshot planes")
    return (
        v.dtype in _KIND
        and q.dtype == k.dtype == v.dtype
        and state_ring.dtype == torch.float32
        and state_ring.is_contiguous()
        and dk <= 128
        and v.shape[1] % hk == 0
    )


def _gdr_dk_kernel(dk: int) -> int:
    """The rule kernel's DK for a key head dim dk (<= 128): dk rounded up to a power of two, at least 16."""
    return 16 if dk <= 16 else 32 if dk <= 32 else 64 if dk <= 64 else 128


def _gdr_launch(kernel: str, builder, q, k, v, state_ring, start: Start, gates: dict) -> torch.Tensor:
    """Launch the recurrent rule's kernel `kernel` (its "{dk}" filled with dk rounded up to a power of two)
    with the operands both forms share and their gate operands `gates`."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if out.numel() == 0:
        return out
    qc, kc, vc = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    dkp = _gdr_dk_kernel(dk)
    sp, sv = _start_args(start, v.device)
    _launch(
        kernel.format(dk=dkp),
        v.dtype,
        v.device,
        ((dv + 31) // 32, hv),
        (max(32, dkp),),
        builder(
            **_heads("q", qc),
            **_heads("k", kc),
            **_heads("v", vc),
            **gates,
            ring=state_ring,
            out=out,
            sp=sp,
            sv=sv,
            T=t,
            Hk=hk,
            Hv=hv,
            dk=dk,
            dv=dv,
            n_planes=state_ring.shape[0],
            qscale=dk**-0.5,
        ),
    )
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    if not (_cuda_ok(q, k, v, g, beta, state_ring) and _gdr_fits(q, k, v, state_ring)):
        return _fallback("gated_delta_rule", q)(q, k, v, g, beta, state_ring, start)
    t, hv = q.shape[0], v.shape[1]
    gf = g.float() if g.dtype != torch.float32 else g
    gf = gf.reshape(t, hv)
    if hv > 1 and gf.stride(1) != 1:
        gf = gf.contiguous()
    b, bs = _aux(beta, v.dtype)
    b = b.reshape(t, hv)
    gates = {"g": gf, "gs0": gf.stride(0), "beta": b, "bs0": b.stride(0)}
    return _gdr_launch(f"gdr_dk{{dk}}_b{bs}", la.GatedDeltaRuleArgs, q, k, v, state_ring, start, gates)


def gated_delta_rule_ab(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    if not _gdr_ab_fits(q, k, v, a, b, neg_exp_a, dt_bias, state_ring):
        return _fallback("gated_delta_rule_ab", q)(q, k, v, a, b, neg_exp_a, dt_bias, state_ring, start)
    return _gdr_launch(
        "gdr_dk{dk}_ab", la.GatedDeltaRuleAbArgs, q, k, v, state_ring, start, _raw_gates(a, b, neg_exp_a, dt_bias)
    )


def _gdr_ab_fits(q, k, v, a, b, neg_exp_a, dt_bias, state_ring) -> bool:
    """Whether the raw-gate rule's kernel takes these operands."""
    t, hv = q.shape[0], v.shape[1]
    return (
        _cuda_ok(q, k, v, a, b, neg_exp_a, dt_bias, state_ring)
        and _gdr_fits(q, k, v, state_ring)
        and a.dtype == b.dtype == v.dtype
        and a.shape == b.shape == (t, hv)
        and neg_exp_a.dtype == torch.float32
        and neg_exp_a.numel() == hv
        and dt_bias.numel() == hv
    )


def _raw_gates(a, b, neg_exp_a, dt_bias) -> dict:
    hv = a.shape[-1]
    a2, b2 = _rows(a, hv), _rows(b, hv)
    gates = {"a": a2, "as0": a2.stride(0), "b": b2, "bs0": b2.stride(0)}
    return gates | {"neg_exp_a": neg_exp_a.contiguous(), "dt_bias": dt_bias.float().contiguous()}


def gated_delta_rule_ab_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """One launch: the rule's kernel whose last block per head norms that head's rows (gated_rmsnorm with an
    fp32 weight and a gate of the activation dtype; within a rounding of that kernel's, each row alike whatever
    T is). Other weights and gates, or no counters (first call inside a capture), take the two kernels."""
    t, hv, dv = v.shape
    cnt = _counters(v.device, ("gdr", neg_exp_a.data_ptr()), hv) if _cuda_ok(v) else None
    if not (
        cnt is not None and _gdr_ab_fits(q, k, v, a, b, neg_exp_a, dt_bias, state_ring) and _gdr_norm_fits(v, z, weight)
    ):  # the two kernels (each takes its reference where it must)
        o = gated_delta_rule_ab(q, k, v, a, b, neg_exp_a, dt_bias, state_ring, start)
        return gated_rmsnorm(o, z, weight, eps)
    y = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    extra = _raw_gates(a, b, neg_exp_a, dt_bias)
    extra |= {"z": z, "zs0": z.stride(0), "nw": weight.contiguous(), "y": y, "cnt": cnt, "eps": eps}
    _gdr_launch("gdr_dk{dk}_abn", la.GatedDeltaRuleAbNormArgs, q, k, v, state_ring, start, extra)
    return y


_CDR_K = 4  # the fused conv's kernel size (GDR_CONV_K in decode_kernels.cu); other sizes take the two ops


def conv_delta_rule_norm(
    x: torch.Tensor,
    conv_ring: torch.Tensor,
    conv_weight: torch.Tensor,
    key_heads: int,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """One launch: conv + SiLU of the raw q|k|v columns, the gates, the rule and the output norm (gdr_dk*_cabn);
    the conv ring and the rule's planes bit for bit the two ops', the normed rows as gated_delta_rule_ab_norm's.
    Operands the kernel does not take (another conv size or weight dtype, no counters) run conv_update then
    gated_delta_rule_ab_norm, each on its kernel."""
    t, c = x.shape
    hv, dv = z.shape[1], z.shape[2]
    cnt = _cdr_counters(x, conv_ring, conv_weight, key_heads, a, b, neg_exp_a, dt_bias, state_ring, z, weight)
    if cnt is None:  # the two ops, each on its kernel
        q, k, v = reference.split_conv_heads(conv_update(x, conv_ring, conv_weight, start), key_heads, z)
        return gated_delta_rule_ab_norm(q, k, v, a, b, neg_exp_a, dt_bias, state_ring, start, z, weight, eps)
    y = torch.empty((t, hv, dv), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    out = torch.empty((t, hv, dv), dtype=x.dtype, device=x.device)
    dk = state_ring.shape[2]
    dkp = _gdr_dk_kernel(dk)
    sp, sv = _start_args(start, x.device)
    gates = _raw_gates(a, b, neg_exp_a, dt_bias)
    _launch(
        f"gdr_dk{dkp}_cabn",
        x.dtype,
        x.device,
        ((dv + 31) // 32, hv),
        (max(32, dkp),),
        la.ConvDeltaRuleNormArgs(
            x=x,
            xs0=x.stride(0),
            cring=conv_ring,
            cw=conv_weight,
            C=c,
            **gates,
            ring=state_ring,
            out=out,
            sp=sp,
            sv=sv,
            T=t,
            Hk=key_heads,
            Hv=hv,
            dk=dk,
            dv=dv,
            n_planes=state_ring.shape[0],
            qscale=dk**-0.5,
            z=z,
            zs0=z.stride(0),
            nw=weight.contiguous(),
            y=y,
            cnt=cnt,
            eps=eps,
        ),
    )
    return y


def _cdr_counters(x, conv_ring, conv_weight, key_heads, a, b, neg_exp_a, dt_bias, state_ring, z, weight):
    """The per-head norm counters of the fused delta-net step (gdr_dk*_cabn, and the in_proj product's _dr form)
    when its kernel takes these operands (x the raw conv columns [T, C], a, b [T, Hv], z [T, Hv, dv] views of
    the projection), else None (the caller takes conv_update then gated_delta_rule_ab_norm)."""
    if not _cuda_ok(x, conv_ring, conv_weight):
        return None
    t, c = x.shape
    hv, dv = z.shape[1], z.shape[2]
    q, k, v = reference.split_conv_heads(x, key_heads, z)  # views of the raw columns: what the rule is given
    n, dk = state_ring.shape[0], q.shape[2]
    fits = (
        _gdr_ab_fits(q, k, v, a, b, neg_exp_a, dt_bias, state_ring)
        and _gdr_norm_fits(v, z, weight)
        and x.dtype == conv_ring.dtype == conv_weight.dtype
        and x.stride(1) == 1
        and conv_ring.is_contiguous()
        and conv_ring.shape == (n, c, _CDR_K - 1)
        and conv_weight.is_contiguous()
        and conv_weight.shape == (c, _CDR_K)
        and state_ring.shape == (n, hv, dk, dv)
    )
    return _counters(x.device, ("gdr", neg_exp_a.data_ptr()), hv) if fits else None


def _gemv_tile_width(name: str, block: tuple) -> int:
    """Output columns a block of the gemv kernel `name` makes: warps x C (CUDA cores), 16 CT (tensor cores)."""
    return block[0] // 32 * int(name[-1]) if name.startswith("gemv_simt_") else 16 * int(name[-1])


def gemv_rule_norms(x: torch.Tensor, w: torch.Tensor, variant: str | None) -> bool:
    """Whether gemv_conv_delta_rule_norm given x_eps norms x in its own launch (the tensor-core forms of `variant`
    for these operands), rather than rmsnorm first."""
    return (
        gemv_takes(x, w)
        and gemv_kernels(x.device, x.dtype)[0]
        and _gemv_launch(x, w, variant)[0].startswith("gemv_tc_")
    )


def _dr_fits(splits, dkp, block, key_heads, hv, dk, dv, c, n, width, x) -> bool:
    """Whether the in_proj product's "_dr" form can run this launch: no K split, a rule size it is built for, a
    block of at least the rule's threads, every tile inside one head, an in_proj of C + Hv dv + 2 Hv columns, few
    enough blocks that may wait at once (below the SM count: no deadlock), and its module loaded."""
    return (
        splits == 1
        and dkp in _GEMV_DR_DK
        and block[0] >= dkp
        and key_heads > 0
        and hv % key_heads == 0
        and key_heads * (hv // key_heads * -(-dv // 32) - 1) < _sms(x.device)
        and n == c + hv * dv + 2 * hv
        and dk % width == 0
        and dv % width == 0
        and (c + hv * dv) % width == 0
        and _gemv_dr_loaded(x.device, x.dtype, dkp)
    )


def gemv_conv_delta_rule_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    conv_ring: torch.Tensor,
    conv_weight: torch.Tensor,
    key_heads: int,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    weight: torch.Tensor,
    eps: float,
    variant: str | None = None,
    x_eps: float | None = None,
) -> torch.Tensor:
    """One launch: the delta-net's packed in_proj product of `variant` and the step after it (the kernel's "_dr"
    form: the product stored as gemv stores it, then conv_delta_rule_norm's kernel code run by the blocks that
    finish each key head's columns last), so the result, both rings and the planes are bit for bit gemv(x, w,
    variant) then conv_delta_rule_norm. A variant that splits K, a block smaller than the rule's, a shape whose
    tiles would straddle a head, or operands conv_delta_rule_norm's kernel does not take: the two ops.
    x_eps given (the deferred norm): x is the residual stream, the layer's input norm has its weight folded into w
    (Model.fold_norms), so the product's input is rmsnorm(x) with no weight; the tensor-core forms sum x's squares as
    they read it and scale their sums by rsqrt(mean(x^2) + x_eps) after their mmas (within a rounding of the norm
    then the product: the normed rows are not rounded to the dtype between them); any other form norms first."""
    gcnt = None
    if gemv_takes(x, w) and gemv_kernels(x.device, x.dtype)[0]:
        m, n = x.shape[0], w.shape[0]
        hv, dk, dv = neg_exp_a.numel(), state_ring.shape[2], state_ring.shape[3]
        c = conv_weight.shape[0]
        name, _, block, smem, _, splits = _gemv_launch(x, w, variant)
        width, dkp = _gemv_tile_width(name, block), _gdr_dk_kernel(dk)
        if _dr_fits(splits, dkp, block, key_heads, hv, dk, dv, c, n, width, x):
            prod = torch.empty((m, n), dtype=x.dtype, device=x.device)
            qkv, z, b, a = reference.split_in_proj(prod, c, hv, dv)
            cnt = _cdr_counters(qkv, conv_ring, conv_weight, key_heads, a, b, neg_exp_a, dt_bias, state_ring, z, weight)
            gcnt = _counters(x.device, ("gdr_in", neg_exp_a.data_ptr()), key_heads + 2) if cnt is not None else None
    # x normed in the launch only by a fused tensor-core form (gemv_rule_norms); before it otherwise
    if x_eps is not None and (gcnt is None or not name.startswith("gemv_tc_")):
        x, x_eps = _unit_rmsnorm(x, x_eps), None
    if gcnt is None:  # the two ops
        return reference.in_proj_step(
            gemv(x, w, variant), conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight,
            eps, conv_delta_rule_norm,
        )  # fmt: skip
    y = torch.empty((m, hv, dv), dtype=x.dtype, device=x.device)
    o = torch.empty((m, hv, dv), dtype=x.dtype, device=x.device)
    sp, sv = _start_args(start, x.device)
    r = hv // key_heads
    tiles = -(-2 * hv // width) + key_heads * (2 * dk + r * dv) // width + hv * dv // width  # b|a, q|k|v, z
    args = la.GemvDeltaArgs(
        x=x, xs=x.stride(0), w=w, wsr=w.stride(0), out=prod, M=m, N=n, K=x.shape[1], vec_ok=int(_gemv_vec_ok(x, w)),
        cring=conv_ring, cw=conv_weight, C=c, neg_exp_a=neg_exp_a.contiguous(), dt_bias=dt_bias.float().contiguous(),
        ring=state_ring, o=o, sp=sp, sv=sv, Hk=key_heads, Hv=hv, dk=dk, dv=dv, n_planes=state_ring.shape[0],
        qscale=dk**-0.5, nw=weight.contiguous(), y=y, ncnt=cnt, gcnt=gcnt, eps=eps, xnorm=int(x_eps is not None),
        xeps=0.0 if x_eps is None else x_eps,
    )  # fmt: skip
    _launch_gemv(f"{name}_dr{dkp}", x.dtype, x.device, (tiles,), block, args, smem)
    return y


def _gdr_norm_fits(v: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the rule kernels' output norm (the _abn / _cabn forms) takes this gate z and fp32 weight for v."""
    t, hv, dv = v.shape
    return (
        _cuda_ok(z, weight)
        and z.dtype == v.dtype
        and z.shape == (t, hv, dv)
        and z.stride(2) == 1
        and z.stride(1) == dv
        and weight.dtype == torch.float32
        and weight.numel() == dv
    )


_AM_THREADS = 1024
_AM_MIN_PER_BLOCK = 4096  # bench/argmax_split.py on the H200: 32k logits 6.3 us (8.6 at 16384), 248k 6.8 (8.6)
# argmax_prob in one launch: argmax_partial's last part of a row merges the row's partials (counters keyed by the
# logits' address: the same buffer is never picked on two streams at once); False: argmax_combine's launch after.
_ARGMAX_ONE_LAUNCH = True


def _writable(x: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel may write rows 0..n-1 of `x` by index: that shape and dtype, on `device`, unit stride."""
    return x.shape == shape and x.dtype == dtype and x.device == device and (shape[0] <= 1 or x.stride(0) == 1)


def _argmax_parts(lg: torch.Tensor, n: int) -> tuple[int, int, int]:
    """(parts a row, ids a part: a multiple of 8, vec_ok) for argmax over the first n ids of each row of `lg`."""
    t = lg.shape[0]
    parts = max(1, min(-(-2 * _sms(lg.device) // t), -(-n // _AM_MIN_PER_BLOCK), 1024))
    chunk = -(-n // parts)
    chunk = -(-chunk // 8) * 8
    vec_ok = int(lg.data_ptr() % 16 == 0 and (lg.stride(0) * lg.element_size()) % 16 == 0)
    return -(-n // chunk), chunk, vec_ok


def argmax_prob(
    logits: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _cuda_ok(logits) or logits.dtype not in _KIND or logits.dim() != 2:
        return _fallback("argmax_prob", logits)(logits, n, out)
    t, vocab = logits.shape
    n = vocab if n <= 0 else min(int(n), vocab)
    if out is not None and not (
        _writable(out[0], (t,), torch.int64, logits.device) and _writable(out[1], (t,), torch.float32, logits.device)
    ):
        return _fallback("argmax_prob", logits)(logits, n, out)
    if out is not None:
        tok, prob = out
    else:
        tok = torch.empty((t,), dtype=torch.int64, device=logits.device)
        prob = torch.empty((t,), dtype=torch.float32, device=logits.device)
    if t == 0 or n == 0:
        return tok, prob
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    parts, chunk, vec_ok = _argmax_parts(lg, n)
    cnt = None
    if parts > 1:
        ws = torch.empty((3, t, parts), dtype=torch.float32, device=logits.device)
        pm, ps = _p(ws[0]), _p(ws[1])
        pi = _p(ws[2])  # int32 partial indices stored in the third fp32 plane (same size)
        # the last part of each row to finish merges the row (one launch); None: argmax_combine's launch after
        cnt = _counters(logits.device, ("argmax", lg.data_ptr()), t) if _ARGMAX_ONE_LAUNCH else None
    else:
        pm = ps = pi = _NULL
    _launch(
        "argmax_partial",
        logits.dtype,
        logits.device,
        (parts, t),
        (_AM_THREADS,),
        la.ArgmaxPartialArgs(
            logits=lg,
            ls0=lg.stride(0),
            n=n,
            chunk=chunk,
            vec_ok=vec_ok,
            pm=pm,
            ps=ps,
            pi=pi,
            tok=tok,
            prob=prob,
            cnt=cnt,
        ),  # fmt: skip
    )
    if parts > 1 and cnt is None:
        _launch(
            "argmax_combine",
            logits.dtype,
            logits.device,
            (t,),
            (32,),
            la.ArgmaxCombineArgs(pm=pm, ps=ps, pi=pi, P=parts, tok=tok, prob=prob),
        )
    return tok, prob


def mtp_prefc(
    tokens: torch.Tensor,
    hiddens: torch.Tensor,
    embed: torch.Tensor,
    w_embed: torch.Tensor,
    w_hidden: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    d = hiddens.shape[-1] if hiddens.dim() else 0
    if (
        not _cuda_ok(tokens, hiddens, embed, w_embed, w_hidden)
        or hiddens.dtype not in _KIND
        or embed.dtype != hiddens.dtype
        or tokens.dtype != torch.int64
        or tokens.dim() != 1
        or hiddens.dim() != 2
        or embed.dim() != 2
        or tokens.shape[0] != hiddens.shape[0]
        or embed.shape[1] != d
        or d == 0
        or (d > 1 and embed.stride(1) != 1)
        or w_embed.numel() != d
        or w_hidden.numel() != d
    ):
        return _fallback("mtp_prefc", tokens)(tokens, hiddens, embed, w_embed, w_hidden, eps)
    if w_embed.dtype == w_hidden.dtype == hiddens.dtype:  # the "s" kernel; else both weights in fp32 ("f")
        we, wh, kind = w_embed.contiguous(), w_hidden.contiguous(), "s"
    else:
        we, wh, kind = w_embed.float().contiguous(), w_hidden.float().contiguous(), "f"
    t = tokens.shape[0]
    y = torch.empty((t, 2 * d), dtype=hiddens.dtype, device=hiddens.device)
    if t == 0:
        return y
    h = _rows(hiddens, d)
    tk = tokens if tokens.is_contiguous() else tokens.contiguous()
    _launch(
        f"mtp_prefc_w{kind}",
        hiddens.dtype,
        hiddens.device,
        (t, 2),
        (_norm_threads(d),),
        la.MtpPrefcArgs(
            tokens=tk,
            embed=embed,
            es=embed.stride(0),
            vocab=embed.shape[0],
            h=h,
            hs=h.stride(0),
            we=we,
            wh=wh,
            y=y,
            d=d,
            eps=eps,
        ),
    )
    return y


def _one_long(start: torch.Tensor | None) -> bool:
    """A device-side start the acceptance kernels read as start[0]: None, or one int64 element."""
    return start is None or (start.dtype == torch.int64 and start.numel() == 1)


def _accept_ints_ok(*ints: torch.Tensor) -> bool:
    """The integer operands of an acceptance kernel: all int64, the last (`out`, written in place) contiguous."""
    return all(t.dtype == torch.int64 for t in ints) and ints[-1].is_contiguous()


def argmax_greedy_accept(
    logits: torch.Tensor,
    n: int,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    p_min: float,
    cache_len: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax_prob then greedy_accept in one launch (argmax_accept: the block that stores the last row's token runs
    the acceptance), the same bits as the two ops; where either would not run its kernel, or the counters cannot
    be had, those two ops."""
    t = logits.shape[0] if logits.dim() == 2 else -1
    ints = (drafts, cache_len) + ((start,) if start is not None else ()) + (out,)
    fits = (
        _cuda_ok(logits, drafts, draft_probs, *ints)
        and logits.dtype in _KIND
        and t == drafts.shape[0] + 1
        and t > 0
        and _accept_ints_ok(*ints)
        and _one_long(start)
    )
    cnt = _counters(logits.device, ("argmax_accept", logits.data_ptr()), t + 1) if fits else None
    vocab = logits.shape[1] if fits else 0
    n = vocab if n <= 0 else min(int(n), vocab)
    if cnt is None or n == 0:
        tok, prob = argmax_prob(logits, n)
        greedy_accept(drafts, draft_probs, tok, p_min, cache_len, out, start)
        return tok, prob
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    parts, chunk, vec_ok = _argmax_parts(lg, n)
    ws = torch.empty((3, t, parts), dtype=torch.float32, device=logits.device)
    tok = torch.empty((t,), dtype=torch.int64, device=logits.device)
    prob = torch.empty((t,), dtype=torch.float32, device=logits.device)
    pr = draft_probs if draft_probs.dtype == torch.float32 else draft_probs.float()
    args = la.ArgmaxAcceptArgs(
        logits=lg, ls0=lg.stride(0), n=n, chunk=chunk, vec_ok=vec_ok, pm=_p(ws[0]), ps=_p(ws[1]), pi=_p(ws[2]),
        tok=tok, prob=prob, cnt=cnt, drafts=drafts.contiguous(), probs=pr.contiguous(), p_min=p_min,
        cache_len=cache_len.reshape(-1), out=out, nd=t - 1, start=start,
    )  # fmt: skip
    _launch("argmax_accept", logits.dtype, logits.device, (parts, t), (_AM_THREADS,), args)
    return tok, prob


def greedy_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_tokens: torch.Tensor,
    p_min: float,
    cache_len: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor | None = None,
) -> None:
    ints = (drafts, target_tokens, cache_len) + ((start,) if start is not None else ()) + (out,)
    if not _cuda_ok(drafts, draft_probs, *ints) or not _accept_ints_ok(*ints) or not _one_long(start):
        return _fallback("greedy_accept", drafts)(drafts, draft_probs, target_tokens, p_min, cache_len, out, start)
    n = drafts.shape[0]
    d = drafts.contiguous()
    pr = draft_probs if draft_probs.dtype == torch.float32 else draft_probs.float()
    pr = pr.contiguous()
    tt = target_tokens.contiguous()
    cl = cache_len.reshape(-1)
    _launch(
        "greedy_accept",
        None,
        out.device,
        (1,),
        (32,),
        la.GreedyAcceptArgs(drafts=d, probs=pr, target=tt, p_min=p_min, cache_len=cl, out=out, n=n, start=start),
    )
    return None


# ---- sampling (a module of its own: cuda_src/sampling_kernels.cu, fp32, one per device) ---------------------
_SAMPLING_SRC = Path(__file__).resolve().parent / "cuda_src" / "sampling_kernels.cu"
_SAMPLING_KERNELS = ("sample_probs_rows", "sample_token_rows", "spec_accept_k", "synthetic_accept_k")
_sampling_fns: dict[tuple[int, str], object] = {}
_sampling_modules: dict[int, object] = {}
_sampling_failed: dict[int, str] = {}  # device -> why its sampling module did not compile or load
_SK_THREADS = 1024


def _sampling_function(dev: int, name: str):
    build = lambda: _raw_module(_SAMPLING_SRC.read_text())  # noqa: E731
    return _load_function(_sampling_fns, (dev, name), _sampling_modules, dev, dev, name, build)


def _sampling_ready(device: torch.device) -> bool:
    """Whether the sampling kernels run on `device`. A module that does not compile or load is reported once
    (a warning) and the ops take their references (capture-safe, slower); `sampling_kernels()` says why."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev in _sampling_failed:
        return False
    if all((dev, name) in _sampling_fns for name in _SAMPLING_KERNELS):
        return True
    try:
        for name in _SAMPLING_KERNELS:
            _sampling_function(dev, name)
    except Exception as exc:  # noqa: BLE001 - any failure means "use the references"
        _sampling_failed[dev] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        message = f"SpecDeck sampling kernels unavailable ({_sampling_failed[dev]}); using the PyTorch references"
        warnings.warn(message, stacklevel=3)
        return False
    return True


def _launch_sampling(name: str, device: torch.device, grid, args, threads: int = _SK_THREADS) -> None:
    args = la.pack(name, args)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    _call(_sampling_function(dev, name), dev, grid, (threads,), args, 0, _stream(device))


def _f32_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 rows with unit column stride (a copy only when needed)."""
    x = x if x.dtype == torch.float32 else x.float()
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def sample_probs(
    logits: torch.Tensor, n: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    if not _cuda_ok(logits) or logits.dim() != 2 or logits.dtype not in _KIND or not _sampling_ready(logits.device):
        return _fallback("sample_probs", logits)(logits, n, temperature, top_k, top_p, min_p)
    t, vocab = logits.shape
    n = vocab if n <= 0 else min(int(n), vocab)
    out = torch.empty((t, n), dtype=torch.float32, device=logits.device)
    if t == 0 or n == 0:
        return out
    lg = _f32_rows(logits)
    _launch_sampling(
        "sample_probs_rows",
        logits.device,
        (t,),
        la.SampleProbsArgs(
            logits=lg,
            ls0=lg.stride(0),
            n=n,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            out=out,
            os0=out.stride(0),
        ),
    )
    return out


def sample_token(
    probs: torch.Tensor, seed: torch.Tensor, start: Start, slot: int, purpose: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _cuda_ok(probs, seed) or probs.dim() != 2 or seed.dtype != torch.int64 or not _sampling_ready(probs.device):
        return _fallback("sample_token", probs)(probs, seed, start, slot, purpose)
    t, n = probs.shape
    tok = torch.empty((t,), dtype=torch.int64, device=probs.device)
    prob = torch.empty((t,), dtype=torch.float32, device=probs.device)
    if t == 0 or n == 0:
        return tok, prob
    pr = _f32_rows(probs)
    sp, sv = _start_args(start, probs.device)
    _launch_sampling(
        "sample_token_rows",
        probs.device,
        (t,),
        la.SampleTokenArgs(
            probs=pr,
            ps0=pr.stride(0),
            n=n,
            seed=seed.reshape(-1),
            start_ptr=sp,
            start_val=sv,
            slot=slot,
            purpose=purpose,
            tok=tok,
            prob=prob,
        ),
    )
    return tok, prob


def spec_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    p_min: float,
    seed: torch.Tensor,
    start: Start,
    cache_len: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if (
        not _cuda_ok(drafts, draft_probs, q_rows, p_rows, seed, cache_len, out)
        or not _accept_ints_ok(drafts, seed, cache_len, out)
        or q_rows.dim() != 2
        or p_rows.dim() != 2
        or not _sampling_ready(p_rows.device)
    ):
        return _fallback("spec_accept", drafts)(drafts, draft_probs, q_rows, p_rows, p_min, seed, start, cache_len, out)
    n = drafts.shape[0]
    d = drafts.contiguous()
    dp = draft_probs.float().contiguous()
    q = _f32_rows(q_rows)
    pr = _f32_rows(p_rows)
    sp, sv = _start_args(start, p_rows.device)
    _launch_sampling(
        "spec_accept_k",
        p_rows.device,
        (1,),
        la.SpecAcceptArgs(
            drafts=d,
            draft_probs=dp,
            q_rows=q if q.numel() else _NULL,
            qs0=q.stride(0) if q.numel() else 0,
            vq=q.shape[1],
            p_rows=pr,
            ps0=pr.stride(0),
            vocab=pr.shape[1],
            n=n,
            p_min=p_min,
            seed=seed.reshape(-1),
            start_ptr=sp,
            start_val=sv,
            cache_len=cache_len.reshape(-1),
            out=out,
        ),
    )
    return None


def synthetic_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_tokens: torch.Tensor,
    p_min: float,
    rates: torch.Tensor,
    seed: torch.Tensor,
    start: Start,
    cache_len: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if (
        not _cuda_ok(drafts, draft_probs, target_tokens, rates, seed, cache_len, out)
        or not _accept_ints_ok(drafts, target_tokens, seed, cache_len, out)
        or rates.dim() != 1
        or rates.shape[0] < 1
        or not _sampling_ready(out.device)
    ):
        return _fallback("synthetic_accept", drafts)(
            drafts, draft_probs, target_tokens, p_min, rates, seed, start, cache_len, out
        )
    sp, sv = _start_args(start, out.device)
    _launch_sampling(
        "synthetic_accept_k",
        out.device,
        (1,),
        la.SyntheticAcceptArgs(
            drafts=drafts.contiguous(),
            draft_probs=draft_probs.float().contiguous(),
            target=target_tokens.contiguous(),
            p_min=p_min,
            rates=rates.float().contiguous(),
            m=rates.shape[0],
            n=drafts.shape[0],
            seed=seed.reshape(-1),
            start_ptr=sp,
            start_val=sv,
            cache_len=cache_len.reshape(-1),
            out=out,
        ),
        threads=32,
    )
    return None


def sampling_kernels() -> tuple[bool, str]:
    """Whether the sampling module compiles and loads on the current device (the ops use it when it does)."""
    if _cp is None:
        return False, _CUPY_ERROR or "CuPy is not installed"
    dev = torch.device("cuda", torch.cuda.current_device())
    if _sampling_ready(dev):
        return True, "sampling kernels loaded"
    return False, _sampling_failed[dev.index]


# ---- gemv: skinny GEMMs of decode shapes (a module of its own: cuda_src/gemv_kernels.cu) ------------------
# One module per (device, dtype). A module that does not compile or load is reported once (a warning) and
# `gemv` takes its reference (the engine's gemm modes check `gemv_kernels` and stay on cuBLAS instead).
_GEMV_SRC = Path(__file__).resolve().parent / "cuda_src" / "gemv_kernels.cu"
_GEMV_SIMT_ROWS = (1, 4, 8, 17)  # the row buckets of the CUDA-core kernels (MB: accumulators per column)
_GEMV_SIMT = tuple(f"gemv_simt_m{mb}_c{c}" for mb in _GEMV_SIMT_ROWS for c in (1, 2))
_GEMV_TC = tuple(f"gemv_tc_t{mt}_c{ct}" for mt in (1, 2, 3) for ct in (1, 2))
# The fused projection + residual add + norm (gemv_add_rmsnorm): every kernel above with its "_an" form.
_GEMV_DR_DK = (64, 128)  # the rule's DK of the in_proj product's fused "_dr" forms (other dk: two launches)
_GEMV_STEP = 64  # K elements of one tensor-core step; every K split is a multiple of it
# A gate|up product that splits K: True, its split sum and silu_mul in the product's launch (the "_ss" forms, gemv_silu_mul:
# the last of a gate tile's and its up tile's blocks combines); False (default), gemv_combine_sm after it, a second
# launch. Off because on the H200 the one launch was slower: every block of the product ends on a counter (an
# atomic round trip before its slot frees), so simt2.w4.s2's gate|up went from the fastest candidate (two launches)
# to behind the unsplit forms, and the token lost 0.7% for its 32 fewer launches (bench/results/
# h200-split-silu-2026-12-02.txt; bench/gate_up_split.py times both).
_GEMV_SPLIT_SILU = False
_GEMV_WARPS_PER_SM = 12  # warps the default launch aims for (a memory stream needs many loads in flight)
_ELEMENT_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_gemv_text: str | None = None
_gemv_modules: dict[tuple, object] = {}  # (device, kind, DK): DK 0 the plain module, else its _dr forms
_gemv_fns: dict[tuple[int, int, str], object] = {}
_gemv_failed: dict[tuple, str] = {}  # (device, kind[, DK]) -> why its module did not compile or load
_gemv_ready: set[tuple] = set()  # (device, kind) whose kernels are all loaded; (device, kind, DK): the _dr forms
_capability: dict[int, tuple[int, int]] = {}


def _gemv_source() -> str:
    global _gemv_text
    if _gemv_text is None:
        _gemv_text = expand_includes(_GEMV_SRC)
    return _gemv_text


def gemv_version() -> str:
    """A short hash of the gemv kernels' source (part of an autotune cache key: new kernels, new timings)."""
    import hashlib

    return hashlib.sha256(_gemv_source().encode()).hexdigest()[:12]


def _gemv_code(kind: int, dk: int = 0) -> str:
    return f"#define SCALAR_KIND {kind}\n" + (f"#define GV_DR_DK {dk}\n" if dk else "") + _gemv_source()


def module_codes() -> dict[str, str]:
    """Every module's source as it is compiled, by label: the decode kernels and the gemv kernels per dtype, the
    gemv module's fused in_proj forms per dtype and rule size, the sampling kernels (tools/precompile_kernels.py
    compiles them side by side into CuPy's cache, so a first use loads rather than compiles)."""
    codes = {"sampling": _SAMPLING_SRC.read_text()}
    for dtype, kind in _KIND.items():
        label = str(dtype).removeprefix("torch.")
        codes[f"decode {label}"] = _decode_code(kind)
        codes[f"gemv {label}"] = _gemv_code(kind)
        codes |= {f"gemv in_proj DK {dk} {label}": _gemv_code(kind, dk) for dk in _GEMV_DR_DK}
    return codes


def _gemv_function(dev: int, kind: int, name: str):
    """A kernel of the gemv module of (dev, kind), or, for the in_proj product's fused "_dr{DK}" forms, of that DK's
    own module (the same source with GV_DR_DK defined: compiled only where a model's delta-net layers use it)."""
    dk = int(name[name.rindex("_dr") + 3 :]) if "_dr" in name else 0
    build = lambda: _raw_module(_gemv_code(kind, dk))  # noqa: E731
    return _load_function(_gemv_fns, (dev, kind, name), _gemv_modules, (dev, kind, dk), dev, name, build)


def _dev_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _tensor_cores(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the tensor-core kernels serve `dtype` here (bf16/fp16 mma.sync m16n8k16: sm_80 and later)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    dev = _dev_index(device)
    cc = _capability.get(dev)
    if cc is None:
        cc = torch.cuda.get_device_capability(dev)
        _capability[dev] = cc
    return cc >= (8, 0)


def _gemv_plain_names(dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
    """The plain products' kernels that serve `dtype` here (each fused form is one of them with a suffix)."""
    return (*_GEMV_SIMT, *(_GEMV_TC if _tensor_cores(dtype, device) else ()))


def _gemv_names(dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
    plain = _gemv_plain_names(dtype, device)
    tc = plain[len(_GEMV_SIMT) :]
    silu = (*(f"gemv_simt_m{mb}_c2_sm" for mb in _GEMV_SIMT_ROWS), *(f"{name}_sm" for name in tc))
    mlp = ("gemv_simt_m1_c1_mlp", "gemv_simt_m1_c2_mlp")
    fused = (*(f"{name}_an" for name in plain), *(f"{name}_ss" for name in plain))
    return (*plain, "gemv_combine", "gemv_combine_sm", *fused, *silu, *mlp)


def gemv_rule_kernels(device: torch.device | str | int, dtype: torch.dtype, dk: int) -> bool:
    """Whether the in_proj product's fused "_dr" forms run for key head dim dk (<= 128) here, compiling and loading
    their module now (the gemm modes call it at load, so the first round does not compile)."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    dkp = _gdr_dk_kernel(dk) if 0 < dk <= 128 else 0
    ok = _cp is not None and device.type == "cuda" and dtype in _KIND and gemv_kernels(device, dtype)[0]
    return ok and dkp in _GEMV_DR_DK and _gemv_dr_loaded(device, dtype, dkp)


def _gemv_dr_loaded(device: torch.device, dtype: torch.dtype, dk: int) -> bool:
    """Whether the in_proj product's fused forms for the rule's DK run here: their module compiled and loaded now
    (False inside a graph capture when it is not loaded yet: the capture takes the two launches), or not at all
    (it failed: reported once as a warning)."""
    dev, kind = _dev_index(device), _KIND[dtype]
    key = (dev, kind, dk)
    if key in _gemv_ready:
        return True
    if key in _gemv_failed or torch.cuda.is_current_stream_capturing():
        return False
    try:
        for name in _gemv_plain_names(dtype, device):
            _gemv_function(dev, kind, f"{name}_dr{dk}")
    except Exception as exc:  # noqa: BLE001 - any failure means "the two launches"
        text = str(exc).strip()
        _gemv_failed[key] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        warnings.warn(f"SpecDeck fused in_proj kernels unavailable ({_gemv_failed[key]})", stacklevel=2)
        return False
    _gemv_ready.add(key)
    return True


def gemv_kernels(device: torch.device | str | int, dtype: torch.dtype) -> tuple[bool, str]:
    """(True, note) when the gemv kernels run for `dtype` on `device`, compiling and loading their module the
    first time (call it outside a graph capture); else (False, a one-line reason), reported once as a warning."""
    if _cp is None:
        return False, _CUPY_ERROR or "CuPy is not installed"
    if dtype not in _KIND:
        return False, f"no gemv kernels for {dtype}"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return False, f"{device} is not a CUDA device"
    dev, kind = _dev_index(device), _KIND[dtype]
    if (dev, kind) in _gemv_failed:
        return False, _gemv_failed[(dev, kind)]
    if (dev, kind) not in _gemv_ready:
        try:
            for name in _gemv_names(dtype, device):
                _gemv_function(dev, kind, name)
        except Exception as exc:  # noqa: BLE001 - any failure means "not these kernels"
            text = str(exc).strip()
            _gemv_failed[(dev, kind)] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            warnings.warn(f"SpecDeck gemv kernels unavailable ({_gemv_failed[(dev, kind)]})", stacklevel=2)
            return False, _gemv_failed[(dev, kind)]
        _counter_pool(device)
        _gemv_ready.add((dev, kind))
    family = "tensor-core and CUDA-core" if _tensor_cores(dtype, device) else "CUDA-core"
    return True, f"{family} gemv kernels loaded"


def _gemv_vec_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """16-byte vectors fit: aligned pointers and row strides, K a whole number of vectors."""
    es = x.element_size()
    k = x.shape[1]
    return (
        k % (16 // es) == 0
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
        and (x.shape[0] == 1 or x.stride(0) * es % 16 == 0)
        and (w.shape[0] == 1 or w.stride(0) * es % 16 == 0)
    )


def gemv_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the gemv kernel covers x @ w^T (the shape, dtype and layout; not whether its module loaded):
    CUDA tensors of one dtype (fp32, bf16, fp16), x [M, K] with 1 <= M <= 17 and unit column stride (any row
    stride), w [N, K] with unit column stride."""
    return (
        _cp is not None
        and x.is_cuda
        and w.is_cuda
        and x.device == w.device
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype == w.dtype
        and x.dtype in _KIND
        and 1 <= x.shape[0] <= registry.GEMV_MAX_ROWS
        and x.shape[1] == w.shape[1]
        and 0 < x.shape[1] < 2**31 - _GEMV_STEP
        and w.shape[0] > 0
        and x.shape[0] * w.shape[0] < 2**31
        and (x.stride(1) == 1 or x.shape[1] == 1)
        and (w.stride(1) == 1 or w.shape[1] == 1)
    )


def _gemv_bucket_rows(m: int) -> int:
    return next(b for b in _GEMV_SIMT_ROWS if m <= b)


def _gemv_splits(k: int, splits: int) -> tuple[int, int]:
    """(kchunk, effective splits): K cut into `splits` ranges of a whole number of 64-element steps."""
    chunk = -(-k // max(1, splits))
    chunk = -(-chunk // _GEMV_STEP) * _GEMV_STEP
    return chunk, -(-k // chunk)


def gemv_default(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, vec_ok: bool = True) -> str:
    """The launch variant `gemv` uses when none is named: tensor cores for bf16/fp16 on sm_80+ (aligned), else
    CUDA cores (2 columns a warp up to 4 rows, 1 beyond); 4 or 8 warps a block and K splits only where the
    output is too narrow to give every SM about _GEMV_WARPS_PER_SM warps."""
    want = _GEMV_WARPS_PER_SM * _sms(device)
    if vec_ok and _tensor_cores(dtype, device):
        tiles = -(-n // 16)
        warps = 4 if tiles * 4 >= want else 8
        have, family, per_warp_k = tiles * warps, "tc1", warps * 2 * _GEMV_STEP
        splits = 1
        if have < want:
            splits = max(1, min(-(-want // have), k // per_warp_k, registry.GEMV_MAX_SPLITS))
        return f"{family}.w{warps}.s{_gemv_splits(k, splits)[1]}"
    return f"simt{2 if m <= 4 else 1}.w4.s{_simt_splits(n, k, dtype, device)}"


def _simt_splits(n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """K splits of the CUDA-core launches: from N and K only (not from the rows or the columns a warp takes),
    so every row count sums a column alike."""
    want = _GEMV_WARPS_PER_SM * _sms(device)
    have, per_warp_k = -(-n // 2), 32 * 4 * (16 // _ELEMENT_SIZE[dtype])
    splits = 1
    if have < want:
        splits = max(1, min(-(-want // have), k // per_warp_k, registry.GEMV_MAX_SPLITS))
    return _gemv_splits(k, splits)[1]


def gemv_row_invariant(n: int, k: int, dtype: torch.dtype, device: torch.device) -> str:
    """A launch variant whose result for a row does not depend on how many rows come with it: CUDA cores, each
    row's sum over K in one fixed order and the same splits for 1..17 rows (gemm mode "exact")."""
    return f"simt2.w4.s{_simt_splits(n, k, dtype, device)}"


def gemv_variants(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[str]:
    """The launch variants worth timing for an [m, k] x [n, k] product (the autotune's candidates; the default
    first), each distinct in what it launches (splits past what K allows are dropped)."""
    out = [gemv_default(m, n, k, dtype, device)]
    grid = []
    if _tensor_cores(dtype, device):
        grid += [("tc1", w, s) for w in (4, 8) for s in (1, 2, 4)]
        grid += [("tc2", w, s) for w in (4, 8) for s in (1, 2)]
    if m <= 4 or not _tensor_cores(dtype, device):
        grid += [("simt2", 4, s) for s in (1, 2)] + [("simt1", 4, 1), ("simt1", 8, 1)]
    for family, warps, splits in grid:
        name = f"{family}.w{warps}.s{_gemv_splits(k, splits)[1]}"
        if name not in out:
            out.append(name)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    if not gemv_takes(x, w) or not gemv_kernels(x.device, x.dtype)[0]:
        return _fallback("gemv", x)(x, w, variant)
    m, n = x.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part, splits = _gemv_main(x, w, variant, out)
    if part is not None:
        combine = la.GemvCombineArgs(part=part, out=out, S=splits, MN=m * n)
        _launch_gemv("gemv_combine", x.dtype, x.device, (-(-(m * n) // 256),), (256,), combine)
    return out


def gemv_add_rmsnorm(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: the gemv kernel's "_an" form, whose last split of each column tile adds the K splits and the
    residual (s, bit for bit gemv -> add_rmsnorm) and whose last tile, or for M rows the last M tiles a row each,
    norm the rows (y; a row's sum of squares in a fixed order of its own, so a row's y never depends on the rows
    beside it; within a rounding of add_rmsnorm's). Needs N a whole number of 16-byte vectors, and one eager call
    before a capture (the counters are made then); otherwise the reference."""
    launched = _launch_an(x, w, residual, variant, weight, eps)
    if launched is None:
        return _fallback("gemv_add_rmsnorm", x)(x, w, residual, weight, eps, variant)
    return launched


# The plain products with the deferred norm in their launch (op gemv_norm): one row, no K split.
_NX_KERNELS = ("gemv_simt_m1_c1", "gemv_simt_m1_c2", "gemv_tc_t1_c1", "gemv_tc_t1_c2")


def _nx_launch(x: torch.Tensor, w: torch.Tensor, variant: str | None) -> tuple | None:
    """`variant`'s launch (_gemv_launch) where gemv_norm norms x in it (one row, 16-byte vectors, no K split), else
    None."""
    if not (gemv_takes(x, w) and gemv_kernels(x.device, x.dtype)[0] and x.shape[0] == 1 and _gemv_vec_ok(x, w)):
        return None
    launch = _gemv_launch(x, w, variant)
    return launch if launch[5] == 1 and launch[0] in _NX_KERNELS else None


def gemv_norms(x: torch.Tensor, w: torch.Tensor, variant: str | None) -> bool:
    """Whether gemv_norm norms the rows x in the product's own launch for `variant`, rather than rmsnorm first."""
    return _nx_launch(x, w, variant) is not None


def gemv_norm(x: torch.Tensor, w: torch.Tensor, eps: float, variant: str | None = None) -> torch.Tensor:
    """gemv(rmsnorm(x) with no weight, w) (issue 20, the deferred norm): x is the residual stream and w carries the
    norm's weight folded into its columns (Model.fold_norms). Where gemv_norms says so, one launch whose warps
    (CUDA cores) or blocks (tensor cores) sum x's squares as they read it and scale their sums by rsqrt(mean(x^2) +
    eps) after the product (within a rounding of the norm then the product: the normed row is not rounded to the
    dtype between them); otherwise rmsnorm first, then gemv."""
    launch = _nx_launch(x, w, variant)
    if launch is None:
        return gemv(_unit_rmsnorm(x, eps), w, variant)
    name, grid, block, smem, _, _ = launch
    m, n = x.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = la.GemvNormArgs(x=x, xs=x.stride(0), w=w, wsr=w.stride(0), out=out, M=m, N=n, K=x.shape[1], xeps=eps)
    _launch_gemv(name + "_nx", x.dtype, x.device, grid, block, args, smem)
    return out


def gemv_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """gemv_add_rmsnorm's launch without its norm (issue 20, the deferred norm): the "_an" form given no y stores
    only s = gemv(x, w) + residual (bit for bit gemv_add_rmsnorm's s), with no counter round trip and no norm at the
    end of the launch; the kernel after it scales by the norm itself (gemv_mlp_add_rmsnorm's x_norm). Where the
    fused form does not take the operands, the reference."""
    launched = _launch_an(x, w, residual, variant)
    if launched is None:
        return _fallback("gemv_add", x)(x, w, residual, variant)
    return launched[1]


def _launch_an(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    variant: str | None,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The "_an" launch of gemv_add_rmsnorm (weight given: (y, s)) or gemv_add (None: (None, s), no norm, so no
    whole-vector rows needed); None where it does not take the operands or has no counters (the caller's reference)."""
    m, n = (x.shape[0], w.shape[0]) if x.dim() == 2 and w.dim() == 2 else (0, 0)
    if (
        not gemv_takes(x, w)
        or not gemv_kernels(x.device, x.dtype)[0]
        or not _add_norm_operands_ok(x, residual, weight, m, n)
        or (weight is not None and n % (16 // x.element_size()) != 0)
    ):
        return None
    name, grid, block, smem, kchunk, splits = _gemv_launch(x, w, variant)
    cnt = _counters(x.device, ("gemv", w.data_ptr()), grid[0] + 2)  # the launch's, a tile's each, the rows' norms
    if cnt is None:
        return None
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    y = None if weight is None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty((m, n), dtype=x.dtype, device=x.device)
    nw = None if weight is None else _f32_norm_weight(weight)
    args = la.GemvAddNormArgs(
        x=x, xs=x.stride(0), w=w, wsr=w.stride(0), part=part, M=m, N=n, K=x.shape[1], kchunk=kchunk,
        vec_ok=int(_gemv_vec_ok(x, w)), r=residual, rs=residual.stride(0), nw=nw, y=y, s=s, cnt=cnt, eps=eps,
    )  # fmt: skip
    _launch_gemv(name + "_an", x.dtype, x.device, grid, block, args, smem)
    return y, s


def _add_norm_operands_ok(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, m: int, n: int) -> bool:
    """The fused add + norm forms' residual [m, n] (x's dtype, unit column stride) and norm weight [n] (None: the
    deferred form, no norm), on the GPU."""
    return (
        _cuda_ok(residual)
        and residual.shape == (m, n)
        and residual.dtype == x.dtype
        and residual.stride(1) == 1
        and (weight is None or (_cuda_ok(weight) and weight.numel() == n))
    )


def _f32_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The norm weight as the kernels read it: flat fp32 (exact: they norm in fp32)."""
    nw = weight.reshape(-1)
    return nw.contiguous() if nw.dtype == torch.float32 else nw.float()


def _gemv_tile_cols(name: str, block: tuple) -> int:
    """The output columns one block of a plain gemv launch makes (its warps * C, or a tensor-core tile's 16 CT)."""
    c = int(name[-1])
    return block[0] // 32 * c if name.startswith("gemv_simt_") else 16 * c


def _gemv_split_silu_pairs(name: str, block: tuple, i: int) -> bool:
    """Whether a K-split gate|up launch (plain kernel `name`, `block`) over [2 i, K] takes the "_ss" form: on
    (_GEMV_SPLIT_SILU) and its column tiles pairing the gate half with the up half (i a whole number of tiles)."""
    return _GEMV_SPLIT_SILU and i % _gemv_tile_cols(name, block) == 0


def gemv_silu_one_launch(x: torch.Tensor, w: torch.Tensor, variant: str | None) -> bool:
    """Whether gemv_silu_mul of `variant` is one launch for these operands: a variant without K splits (the "_sm"
    form), or one that splits K in the "_ss" form (_gemv_split_silu_pairs). Otherwise (or the reference) not."""
    if not gemv_takes(x, w) or w.shape[0] % 2:
        return False
    name, _, block, _, _, splits = _gemv_launch(x, w, variant)
    return splits == 1 or _gemv_split_silu_pairs(name, block, w.shape[0] // 2)


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """silu_mul(gemv(x, w, variant)) for the MLP's packed gate|up weight [2 I, K]: one launch (the kernel's "_sm"
    form: each output column's gate and up rows in one warp or tile, silu_mul's arithmetic on the two rounded
    sums, so the result is bit for bit the two launches' of a variant without K splits). A variant that splits
    K is two: its product into fp32 partials, then gemv_combine_sm; with _GEMV_SPLIT_SILU on, one where its column
    tiles pair up (gemv_silu_one_launch; the "_ss" form: the last of a gate tile's and its up tile's blocks adds
    their partials in split order and applies silu_mul's arithmetic, gemv_combine_sm's code). Either way the same
    bits as gemv then silu_mul. A shape the kernels do not take is the reference."""
    if not gemv_takes(x, w) or not gemv_kernels(x.device, x.dtype)[0] or w.shape[0] % 2:
        return _fallback("gemv_silu_mul", x)(x, w, variant)
    name, grid, block, smem, kchunk, splits = _gemv_launch(x, w, variant)  # the plain product's launch over 2 I rows
    m, k = x.shape
    i = w.shape[0] // 2
    if splits > 1:
        out = torch.empty((m, i), dtype=x.dtype, device=x.device)
        cnt = None
        if _gemv_split_silu_pairs(name, block, i):
            cnt = _counters(x.device, ("gemv_ss", w.data_ptr()), grid[0] // 2)  # a pair of tiles each
        if cnt is not None:
            part = torch.empty((splits, m, 2 * i), dtype=torch.float32, device=x.device)
            args = la.GemvSplitSiluArgs(
                x=x, xs=x.stride(0), w=w, wsr=w.stride(0), out=out, part=part, M=m, N=2 * i, K=k, kchunk=kchunk,
                vec_ok=int(_gemv_vec_ok(x, w)), cnt=cnt,
            )  # fmt: skip
            _launch_gemv(name + "_ss", x.dtype, x.device, grid, block, args, smem)
            return out
        part, splits = _gemv_main(x, w, variant, out)  # out is not written: the product goes to the partials
        combine = la.GemvCombineSiluArgs(part=part, out=out, S=splits, M=m, I=i)
        _launch_gemv("gemv_combine_sm", x.dtype, x.device, (-(-(m * i) // 256),), (256,), combine)
        return out
    vec_ok = _gemv_vec_ok(x, w)  # the up half starts I rows on: aligned with the rows
    if name.startswith("gemv_simt_"):  # simt1 and simt2 sum a column alike (vectors in the same order): the
        name, grid = name[: name.rindex("_c")] + "_c2_sm", (-(-i // (block[0] // 32)),)  # two-row form, a warp a column
    else:  # a tile of 16 CT rows makes 8 CT output columns: the plain launch's grid and shared memory
        name += "_sm"
    out = torch.empty((m, i), dtype=x.dtype, device=x.device)
    args = la.GemvSiluArgs(x=x, xs=x.stride(0), w=w, wsr=w.stride(0), out=out, M=m, N=i, K=k, vec_ok=int(vec_ok))
    _launch_gemv(name, x.dtype, x.device, grid, block, args, smem)
    return out


# The resident MLP (res variants): its staged activation at most this many bytes (with the kernel's static shared memory
# under the 48 KiB a block has without opting in), and at most this many warps an SM (bench/persistent_chain.py: 16
# warps an SM, 8 loads in flight a lane, was the fastest).
_RMLP_SMEM = 40 * 1024
_RMLP_WARPS_PER_SM = 16
# The resident MLP's activation tiles (I / warps) are dealt to its blocks round by round: with the blocks that fit
# (264 on 132 SMs) a 9B-like MLP's 1536 tiles are 5.8 rounds, so 48 blocks end a round early while the rest make
# their sixth tile, and the down product waits for the last. True: as few blocks as make the tiles in the same
# number of rounds (256: six each). False: every block that fits, only to measure it (bench/decode_ab.py
# --rmlp-balance-ab; on an H100, 9B-like target-only 188.6 t/s against 188.3 in each of three interleaved pairs, the same
# tokens: bench/results/h100-balance-2026-12-06.txt).
_RMLP_BALANCE = True
# How the resident MLP is launched (docs/architecture.md). Its blocks wait for one another, so all must be resident at
# once. A cooperative launch makes the driver check that (it refuses a grid it cannot hold at once: an error instead
# of a wait that never ends), but it then starts only once the kernel before it has drained; a plain (PDL) launch's
# blocks are scheduled as that kernel's leave, their first weight loads in flight while it drains. "first"
# (default): the first launch of each grid (kernel, blocks, threads, shared memory) on a device is cooperative, so
# the driver checks that grid once, and the launches after it are plain. On an H100, 9B-like target-only 194.1 /
# 194.1 / 193.9 t/s so against 192.5 / 192.5 / 192.5 with every launch cooperative, the same tokens (bench/results/
# h100-proj-mlp-2026-12-06.txt). True: every launch cooperative; False: none (bench/decode_ab.py --rmlp-coop-ab).
_RMLP_COOPERATIVE: bool | str = "first"
_rmlp_checked: set[tuple] = set()  # (device, kernel, grid, threads, shared memory) a cooperative launch took
_occupancy_cache: dict[tuple, int] = {}


def _rmlp_cooperative(dev: int, name: str, grid: tuple, threads: int, smem: int) -> bool:
    """Whether this resident launch is cooperative (_RMLP_COOPERATIVE): with "first", until a cooperative launch of
    the same grid on the device has been taken eagerly (inside a capture the driver's check would come only at the
    graph's launch, so a captured launch is cooperative until an eager one has been)."""
    if not pdl.available() or _RMLP_COOPERATIVE is False:
        return False
    return _RMLP_COOPERATIVE is True or (dev, name, grid, threads, smem) not in _rmlp_checked


def occupancy(fn, threads: int, smem: int) -> int:
    """How many blocks of `fn` (a CuPy RawKernel's function) with `threads` threads and `smem` bytes of dynamic
    shared memory the driver says one SM holds at once; 0 where the driver cannot say."""
    key = (fn.ptr, threads, smem)
    if key not in _occupancy_cache:
        n = ctypes.c_int(0)
        try:
            err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), ctypes.c_void_p(fn.ptr), ctypes.c_int(threads), ctypes.c_size_t(smem)
            )
        except (OSError, AttributeError):
            err = -1
        _occupancy_cache[key] = n.value if err == 0 else 0
    return _occupancy_cache[key]


def _resident_grid(fn, dev: int, threads: int, smem: int) -> int:
    """Blocks of `fn` to launch so that all are resident on the GPU at once: the driver's occupancy for `threads`
    threads and `smem` bytes of shared memory (at most _RMLP_WARPS_PER_SM warps), times the SMs; 0 where the driver
    cannot say or none fits."""
    per_sm = min(occupancy(fn, threads, smem), max(1, _RMLP_WARPS_PER_SM * 32 // threads))
    return per_sm * _sms(torch.device("cuda", dev))


def gemv_mlp_fits(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, variant: str | None) -> bool:
    """Whether gemv_mlp_add_rmsnorm runs its one-launch kernel for these operands (else its two ops): one row,
    16-byte vectors, a CUDA-core variant ("simt1|simt2.wW.sS") or a resident one ("res1|res2.wW.s1": no K split,
    an activation of at most _RMLP_SMEM bytes) whose W warps divide the activation's width and whose tile (W * C
    columns) divides the output's."""
    parsed = registry.parse_gemv_variant(variant) if variant is not None else None
    if parsed is None or parsed[0].startswith("tc") or x.dim() != 2 or x.shape[0] != 1:
        return False
    resident = parsed[0].startswith("res")
    if resident and (parsed[2] != 1 or w_gate_up.shape[0] // 2 * x.element_size() > _RMLP_SMEM):
        return False  # no K split; the activation staged in a block's shared memory
    if w_gate_up.dim() != 2 or w_down.dim() != 2 or w_gate_up.shape[0] % 2 or x.shape[1] != w_gate_up.shape[1]:
        return False
    i, n = w_gate_up.shape[0] // 2, w_down.shape[0]
    warps, c = parsed[1], int(parsed[0][-1])
    es = x.element_size()
    return (
        w_down.shape[1] == i
        and n > 0
        and n % (16 // es) == 0  # the norm's rows are whole 16-byte vectors (as gemv_add_rmsnorm asks)
        and gemv_takes(x, w_gate_up)
        and w_down.device == x.device  # the activation [1, I] @ w_down^T (made aligned and contiguous):
        and w_down.dtype == x.dtype  # what gemv_takes asks of its operands
        and w_down.stride(1) == 1
        and 0 < i < 2**31 - _GEMV_STEP
        and _gemv_vec_ok(x, w_gate_up)
        and i % (16 // es) == 0
        and w_down.data_ptr() % 16 == 0
        and (n == 1 or w_down.stride(0) * es % 16 == 0)
        and i % warps == 0
        and n % (warps * c) == 0
        and (not resident or _rmlp_grid(x, c, warps, i) > 0)  # the driver says its blocks fit at once
    )


def _unit_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) with no weight through this module's rmsnorm (reference.unit_rmsnorm)."""
    return reference.unit_rmsnorm(x, eps, rmsnorm)


def _rmlp_grid(x: torch.Tensor, c: int, warps: int, i: int) -> int:
    """Blocks of the resident MLP's launch for an activation of i elements of x's dtype (staged in shared memory): 0
    where the gemv module is not loaded or the driver says none fits."""
    if not gemv_kernels(x.device, x.dtype)[0]:
        return 0
    dev = _dev_index(x.device)
    fn = _gemv_function(dev, _KIND[x.dtype], f"gemv_simt_m1_c{c}_rmlp")
    grid = _resident_grid(fn, dev, warps * 32, i * x.element_size())
    if grid and _RMLP_BALANCE:  # as few blocks as make the activation's tiles in as many rounds: each its share
        tiles = i // warps
        grid = -(-tiles // -(-tiles // grid))
    return grid


def gemv_mlp_add_rmsnorm(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variant: str | None = None,
    x_norm: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The MLP of one row and the residual add + norm after it in one launch (gemv_simt_m1_c{C}_mlp): the gate|up
    product with silu_mul (gemv_silu_mul's code, a warp a column, no K split, `variant`'s warps) and the down
    projection with the add and norm (gemv_add_rmsnorm's code with `variant`), the down blocks starting on each K
    split as soon as its part of the activation is stored. The same bits as those two ops with those variants;
    where it does not fit (gemv_mlp_fits), or before one eager call (the counters), those two ops (gate|up with the
    variant's unsplit form, registry.gemv_mlp_launches, whatever the rows). A resident variant ("res{C}.wW.s1",
    gemv_simt_m1_c{C}_rmlp) launches only the blocks that are resident together, each making its share of the
    activation, then (after a counter says every block is done) its down tiles from the activation staged in its
    shared memory: the bits of the two ops with simt{C}.wW.s1 (registry.gemv_twin).
    x_norm (the deferred norm, after gemv_add): x is the residual stream s, the norm before the MLP has its weight
    folded into w_gate_up (Model.fold_norms: W (1 + w) columnwise), so the MLP's input is rmsnorm(x) with no weight; a
    resident variant's activation warps sum x's squares as they read it and scale their two sums by rsqrt(mean(x^2) +
    eps) after their FMAs (within a rounding of the norm then the product: the normed row is not rounded to the
    dtype between them); any other form norms first.
    weight None (the norm after it deferred to the next layer's product: gemv_conv_delta_rule_norm's x_eps): (None,
    s); the resident form stores s only, any other form is gemv_silu_mul then gemv_add."""
    i, n = w_gate_up.shape[0] // 2, w_down.shape[0]
    fits = (
        gemv_mlp_fits(x, w_gate_up, w_down, variant)
        and gemv_kernels(x.device, x.dtype)[0]
        and _add_norm_operands_ok(x, residual, weight, 1, n)
    )
    resident = fits and registry.parse_gemv_variant(variant)[0].startswith("res")
    fits = fits and (resident or weight is not None)  # s alone: the resident form's
    if x_norm and not resident:
        x, x_norm = _unit_rmsnorm(x, eps), False
    family, warps, splits = registry.parse_gemv_variant(variant) if fits else ("", 0, 0)
    c = int(family[-1]) if fits else 0
    kchunk, splits = _gemv_splits(i, splits) if fits else (0, 0)
    ntiles = n // (warps * c) if fits else 0
    grid = (i // warps + ntiles * splits,) if fits else (0,)
    smem = 0
    if resident and fits:
        smem = i * x.element_size()
        grid = (_rmlp_grid(x, c, warps, i),)  # > 0: gemv_mlp_fits asked
    cnt = _counters(x.device, ("gemv", w_down.data_ptr()), ntiles + 2) if fits else None
    mkey = ("gemv_rmlp" if resident else "gemv_mlp", w_down.data_ptr(), variant)
    mcnt = _counters(x.device, mkey, 2 if resident else 1 + splits) if cnt is not None else None
    if mcnt is None:
        if x_norm:
            x = _unit_rmsnorm(x, eps)
        named = registry.parse_gemv_variant(variant) is not None
        gu, down = registry.gemv_mlp_launches(variant) if named else (None, variant)
        if weight is None:
            return None, gemv_add(gemv_silu_mul(x, w_gate_up, gu), w_down, residual, down)
        return gemv_add_rmsnorm(gemv_silu_mul(x, w_gate_up, gu), w_down, residual, weight, eps, down)
    act = torch.empty((1, i), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, 1, n), dtype=torch.float32, device=x.device)
    y = None if weight is None else torch.empty((1, n), dtype=x.dtype, device=x.device)
    s = torch.empty((1, n), dtype=x.dtype, device=x.device)
    nw = None if weight is None else _f32_norm_weight(weight)
    args = la.GemvMlpArgs(
        x=x, wg=w_gate_up, wgs=w_gate_up.stride(0), act=act, I=i, K=x.shape[1], wd=w_down, wds=w_down.stride(0),
        part=part, N=n, kchunk=kchunk, S=splits, r=residual, nw=nw, y=y, s=s, cnt=cnt, mcnt=mcnt, eps=eps,
        xnorm=int(x_norm),
    )  # fmt: skip
    name = f"gemv_simt_m1_c{c}_{'rmlp' if resident else 'mlp'}"
    key = (_dev_index(x.device), name, grid, warps * 32, smem)
    coop = resident and _rmlp_cooperative(*key)
    _launch_gemv(name, x.dtype, x.device, grid, (warps * 32,), args, smem, cooperative=coop)
    if coop and not torch.cuda.is_current_stream_capturing():  # the driver took this grid as one resident launch
        _rmlp_checked.add(key)
    return y, s


def _gemv_main(
    x: torch.Tensor, w: torch.Tensor, variant: str | None, out: torch.Tensor
) -> tuple[torch.Tensor | None, int]:
    """Launch the gemv kernel of `variant` (None or unusable here: the default) for x @ w^T: into `out`, or into
    fp32 partials [splits, M, N] (returned) when it splits K. Returns (partials or None, splits)."""
    m, k = x.shape
    n = w.shape[0]
    name, grid, block, smem, kchunk, splits = _gemv_launch(x, w, variant)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else None
    args = la.GemvArgs(
        x=x,
        xs=x.stride(0),
        w=w,
        wsr=w.stride(0),
        out=out,
        part=part,
        M=m,
        N=n,
        K=k,
        kchunk=kchunk,
        vec_ok=int(_gemv_vec_ok(x, w)),
    )
    _launch_gemv(name, x.dtype, x.device, grid, block, args, smem)
    return part, splits


def _gemv_launch(x: torch.Tensor, w: torch.Tensor, variant: str | None) -> tuple[str, tuple, tuple, int, int, int]:
    """(kernel name, grid, block, shared memory bytes, kchunk, splits) of `variant` for x @ w^T (None or unusable
    here: the default)."""
    m, k = x.shape
    n = w.shape[0]
    vec_ok = _gemv_vec_ok(x, w)
    parsed = registry.parse_gemv_variant(variant) if variant is not None else None
    if variant is not None and parsed is None:
        raise ValueError(f"unknown gemv variant {variant!r}")
    if (
        parsed is None
        or parsed[0].startswith("res")  # the resident MLP's family: not a plain product's launch
        or (parsed[0].startswith("tc") and not (vec_ok and _tensor_cores(x.dtype, x.device)))
    ):
        parsed = registry.parse_gemv_variant(gemv_default(m, n, k, x.dtype, x.device, vec_ok))
    family, warps, splits = parsed
    kchunk, splits = _gemv_splits(k, splits)
    if family.startswith("tc"):
        ct, mt = int(family[2]), -(-m // 8)
        return (
            f"gemv_tc_t{mt}_c{ct}",
            (-(-n // (16 * ct)), splits),
            (warps * 32,),
            warps * 16 * ct * 8 * mt * 4,
            kchunk,
            splits,
        )
    c = int(family[4])
    return f"gemv_simt_m{_gemv_bucket_rows(m)}_c{c}", (-(-n // (warps * c)), splits), (warps * 32,), 0, kchunk, splits


def _launch_gemv(
    name: str, dtype: torch.dtype, device: torch.device, grid, block, args, shared_mem: int = 0, cooperative=False
) -> None:
    args = la.pack(name, args)
    dev = _dev_index(device)
    _call(_gemv_function(dev, _KIND[dtype], name), dev, grid, block, args, shared_mem, _stream(device), cooperative)


# ---- warm-up ------------------------------------------------------------------------------------------
_KERNELS_PER_DTYPE = (
    [
        "rmsnorm_ws",
        "rmsnorm_wf",
        "add_rmsnorm_ws",
        "add_rmsnorm_wf",
        "attn_combine",
        "attn_combine_par",
        "attn_vecb_u2_g4_f",
        "argmax_partial",
        "argmax_combine",
        "argmax_accept",
        "greedy_accept",
        "attn_prep_ws",
        "attn_prep_wf",
        "silu_mul",
        "gdn_gates",
        "mtp_prefc_ws",
        "mtp_prefc_wf",
        "embed_rmsnorm_ws",
        "embed_rmsnorm_wf",
        "store_rows",
    ]
    + [f"gated_rmsnorm_w{a}_g{b}" for a in "sf" for b in "sf"]
    + [f"attn_vec_u{u}_g{g}" for u in (2, 4) for g in (1, 2, 4, 8)]
    + [f"attn_{kind}_e{e}" for kind in ("split", "tile") for e in (1, 2, 4, 8)]
    + [f"conv_update_k{k}_w{a}" for k in range(2, 9) for a in "sf"]
    + [f"gdr_dk{d}_b{a}" for d in (16, 32, 64, 128) for a in "sf"]
    + [f"gdr_dk{d}_ab" for d in (16, 32, 64, 128)]
    + [f"gdr_dk{d}_abn" for d in (16, 32, 64, 128)]
    + [f"gdr_dk{d}_cabn" for d in (16, 32, 64, 128)]
)


def warm_up(device: torch.device | str | int, dtype: torch.dtype) -> None:
    """Compile and load every kernel for `dtype` on `device`, then run each op once on tiny inputs (so that
    no module is compiled or loaded, and no lazy CUDA loading happens, inside a graph capture).
    Raises RuntimeError when the kernels are not available here."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"CUDA kernels unavailable: {why}")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype not in _KIND:
        raise ValueError(f"unsupported dtype {dtype}")
    dev, kind = device.index, _KIND[dtype]
    for name in _KERNELS_PER_DTYPE:
        _function(dev, kind, name)
    _sampling_ready(device)  # compiled and loaded here, or reported once and left to the references
    gemv_kernels(device, dtype)  # the same: a failure leaves the products to cuBLAS / the reference
    _counter_pool(device)
    _sms(device)
    with torch.cuda.device(device):
        _exercise(device, dtype)
        torch.cuda.current_stream(device).synchronize()


def _exercise(device: torch.device, dtype: torch.dtype) -> None:
    """Run every op once (tiny shapes): first launches happen here, not inside a capture."""
    z = torch.zeros
    kw = {"device": device, "dtype": dtype}
    x = torch.randn(2, 64, **kw)
    w = z(64, **kw)
    rmsnorm(x, w, 1e-6)
    rmsnorm(x, w.float(), 1e-6)
    add_rmsnorm(x, x, w, 1e-6)
    add_rmsnorm(x, x, w.float(), 1e-6)
    for wa in (w, w.float()):
        for ga in (x, x.float()):
            gated_rmsnorm(x, ga, wa, 1e-6)
    start = torch.zeros(1, dtype=torch.int64, device=device)
    for d in (32, 64, 128, 256):
        q = torch.randn(2, 2, d, **kw)
        kc, vc = z(256, 1, d, **kw), z(256, 1, d, **kw)  # long enough for split keys + combine
        attention_cached(q, kc, vc, start, d**-0.5)
        attention_cached(q, kc, vc, 0, d**-0.5)
        attention_cached(q, kc, vc, start, d**-0.5, q)
        for wn in (z(d, **kw), z(d, device=device)):
            attn_prep(q, q[:, :1], q[:, :1], wn, wn, 1e-6, torch.ones(d // 4, device=device), kc, vc, start)
    silu_mul(x)
    gdn_gates(x[:, :4], x[:, 4:8], z(4, device=device), z(4, device=device))
    for k in range(2, 9):
        ring = z(4, 8, k - 1, **kw)
        cx = torch.randn(2, 8, **kw)
        conv_update(cx, ring, z(8, k, **kw), start)
        conv_update(cx, ring, z(8, k, device=device), start)
    for dk in (16, 32, 64, 128):
        st = z(4, 2, dk, 32, device=device, dtype=torch.float32)
        qq = torch.randn(2, 1, dk, **kw)
        vv = torch.randn(2, 2, 32, **kw)
        gg = z(2, 2, device=device)
        gated_delta_rule(qq, qq, vv, gg, z(2, 2, **kw), st, start)
        gated_delta_rule(qq, qq, vv, gg, z(2, 2, device=device), st, start)
        gated_delta_rule_ab(qq, qq, vv, z(2, 2, **kw), z(2, 2, **kw), z(2, device=device), z(2, **kw), st, start)
    for wa in (w, w.float()):
        mtp_prefc(torch.ones(2, dtype=torch.int64, device=device), x, x, wa, wa, 1e-6)
        embed_rmsnorm(torch.ones(2, dtype=torch.int64, device=device), x, wa, 1e-6)
    store_rows(z(4, 64, **kw), x, start)
    lg = torch.randn(2, 3 * _AM_MIN_PER_BLOCK, **kw)
    argmax_prob(lg, 0)
    argmax_prob(lg, 100)
    out = z(5, dtype=torch.int64, device=device)
    greedy_accept(
        z(2, dtype=torch.int64, device=device),
        torch.ones(2, device=device),
        z(3, dtype=torch.int64, device=device),
        0.5,
        z(1, dtype=torch.int64, device=device),
        out,
        start,
    )
    argmax_greedy_accept(lg, 0, z(1, dtype=torch.int64, device=device), torch.ones(1, device=device), 0.5,
                         z(1, dtype=torch.int64, device=device), out, start)  # fmt: skip
    seed = z(1, dtype=torch.int64, device=device)
    probs = sample_probs(lg[:, :100], 0, 0.7, 5, 0.9, 0.05)
    tok, prob = sample_token(probs, seed, start, 0, 1)
    spec_accept(tok[:1], prob[:1], probs[:1], probs, 0.0, seed, start, z(1, dtype=torch.int64, device=device), out[:4])
    rates = torch.full((2,), 0.5, device=device)
    synthetic_accept(tok[:1], prob[:1], tok, 0.0, rates, seed, start, z(1, dtype=torch.int64, device=device), out[:4])
    if gemv_kernels(device, dtype)[0]:
        wg = torch.randn(40, 1024, **kw)
        for m in (1, 4, 8, 17):
            xg = torch.randn(m, 1024, **kw)
            for variant in gemv_variants(m, 40, 1024, dtype, device):
                gemv(xg, wg, variant)
            gemv(xg[:, 1:], wg[:, 1:])  # unaligned: the scalar loads
        hk, hv, dv = 1, 2, 64  # the in_proj product's fused form, both rule sizes' code paths
        for dkk in (dk for dk in _GEMV_DR_DK if gemv_rule_kernels(device, dtype, dk)):
            c = 2 * hk * dkk + hv * dv
            st = z(4, hv, dkk, dv, device=device, dtype=torch.float32)
            for variant in ("simt1.w4.s1", "tc2.w4.s1"):
                gemv_conv_delta_rule_norm(
                    torch.randn(1, 64, **kw), z(c + hv * dv + 2 * hv, 64, **kw), z(4, c, 3, **kw), z(c, 4, **kw), hk,
                    z(hv, device=device), z(hv, device=device), st, start, torch.ones(dv, device=device), 1e-6,
                    variant,
                )  # fmt: skip
