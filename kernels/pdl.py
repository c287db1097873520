"""Programmatic dependent launch (PDL) for SpecDeck's CuPy kernels.

A decode step is a chain of a few hundred small kernels, each waiting for the one before it to finish and its
blocks to drain before its own blocks are even scheduled. With PDL (compute capability 9.0+) a kernel launched
with the "programmatic stream serialization" attribute may be scheduled while the kernel before it still runs;
it then waits inside, at `griddepcontrol.wait`, until that kernel has completed and its writes are visible.
Every kernel in `cuda_src/*.cu` opens with `PDL_ENTER()` (let the next kernel be scheduled, then wait for the
previous one), so no kernel touches memory before its predecessor is done: PDL changes when blocks are
scheduled, never what they compute. A kernel launched without the attribute passes both instructions at once.

CuPy launches through `cuLaunchKernel`, which takes no attributes; this module calls the driver's
`cuLaunchKernelEx` through ctypes with the loaded kernel's CUfunction. It is used while a plan (CUDA graph) is
being captured, where the attribute becomes a programmatic edge of the graph and the ctypes cost is paid once;
eager launches keep CuPy's faster path, but a cooperative one (the resident MLP, whose blocks wait for one another:
`launch_config`). The engine turns it on for every model on an sm_90+ GPU
(engine/model.py PDL_DEFAULT; the model option "pdl" turns it off); `kernels.cuda.set_pdl` is the switch
(bench/gpu_bench.py's section `pdl` measures both in one run). Needs no GPU to import.

The gemv products (cuda_src/gemv_kernels.cu) are the exception to "nothing before the wait": they issue their
first weight loads between PDL_TRIGGER() and PDL_WAIT(), since no kernel of a decode step writes a weight; with
the attribute those loads are in flight while the kernel before drains. Their one-launch MLP form also takes each
block's ticket (an atomic on its launch site's own counter) before PDL_TRIGGER(); gemv_kernels.cu says why that is
safe.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, padding to 8, then a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig, in the order of cuda.h."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_CTYPE_OF = {
    np.uint64: ctypes.c_uint64,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.float32: ctypes.c_float,
    np.float64: ctypes.c_double,
}

_lock = threading.Lock()
_driver: list = []  # [cuLaunchKernelEx] once loaded, [None] when the driver has none


def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None (no libcuda, or a driver older than CUDA 12)."""
    if not _driver:
        with _lock:
            if not _driver:
                fn = None
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                    fn = lib.cuLaunchKernelEx
                    fn.restype = ctypes.c_int
                    fn.argtypes = [
                        ctypes.POINTER(LaunchConfig),
                        ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_void_p),
                        ctypes.c_void_p,
                    ]
                except (OSError, AttributeError):
                    fn = None
                _driver.append(fn)
    return _driver[0]


def available() -> bool:
    return _launch_kernel_ex() is not None


def kernel_params(args: Sequence) -> tuple[ctypes.Array, list]:
    """The `void** kernelParams` array for packed launch arguments (numpy scalars, launch_args.pack), and
    the ctypes values it points to (keep them alive until the launch returns)."""
    values = []
    for a in args:
        ctype = _CTYPE_OF.get(type(a))
        if ctype is None:
            raise TypeError(f"cannot pass a {type(a).__name__} to a kernel launched with PDL")
        values.append(ctype(a.item()))
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return params, values


def launch_config(
    grid, block, shared_mem: int, stream_ptr: int, programmatic: bool = True, cooperative: bool = False
) -> tuple[LaunchConfig, ctypes.Array]:
    """The CUlaunchConfig of a launch and its attributes array (keep it alive until the launch returns): programmatic
    stream serialization (PDL) and/or a cooperative launch (every block resident at once, or the launch fails with
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE instead of some blocks waiting for ever on ones never scheduled)."""
    grid = (*tuple(grid), 1, 1)[:3]
    block = (*tuple(block), 1, 1)[:3]
    ids = [i for i, on in ((CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, programmatic),
                           (CU_LAUNCH_ATTRIBUTE_COOPERATIVE, cooperative)) if on]  # fmt: skip
    attrs = (LaunchAttribute * max(1, len(ids)))()
    for attr, i in zip(attrs, ids):
        attr.id = i
        ctypes.memmove(ctypes.addressof(attr) + LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    first = ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute))
    return LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream_ptr), first, len(ids)), attrs


def launch(
    function_ptr: int,
    grid,
    block,
    args: Sequence,
    shared_mem: int,
    stream_ptr: int,
    programmatic: bool = True,
    cooperative: bool = False,
) -> None:
    """Launch a loaded kernel (its CUfunction) on `stream_ptr` through cuLaunchKernelEx: with programmatic stream
    serialization, and/or cooperatively (launch_config)."""
    fn = _launch_kernel_ex()
    if fn is None:
        raise RuntimeError("cuLaunchKernelEx is not available in this CUDA driver")
    config, _attrs = launch_config(grid, block, shared_mem, stream_ptr, programmatic, cooperative)
    params, _keep = kernel_params(args)
    err = fn(ctypes.byref(config), ctypes.c_void_p(function_ptr), params, None)
    if err != 0:
        raise RuntimeError(launch_error(err, grid, cooperative))


CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720


def launch_error(err: int, grid, cooperative: bool) -> str:
    """What a failed cuLaunchKernelEx says: the one failure a user can meet and act on (a cooperative grid the GPU
    cannot hold at once, e.g. while another process shares it) named, with what to do; any other by its CUresult."""
    if cooperative and err == CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
        blocks = int(np.prod([int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))]))
        return (
            f"a resident launch of {blocks} blocks cannot have them all on the GPU at once "
            f"(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE); another process sharing this GPU (MPS with a thread limit) "
            f"can cause it: decode with --gemm cublas, which makes no resident launch"
        )
    return f"cuLaunchKernelEx failed with CUresult {err}"
