"""Custom ops of the decode path: a PyTorch reference for each, and a CuPy CUDA kernel beside it.

`kernels.ops` is the dispatcher the engine calls: by default every op is the reference;
`use_cuda_kernels(True)` (done by the engine for device="cuda" when CuPy works) swaps in the kernels.
"""

from . import ops

__all__ = ["ops"]
