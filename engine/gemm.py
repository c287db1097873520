"""How the model's one-token products (decode steps) are computed: the GEMM backend.

- "cublas" (default): `F.linear`, i.e. cuBLAS on the GPU. Nothing to compile.
- "autotune": one-token products go through `torch.compile` with max-autotune: at the first use of each
  weight shape PyTorch's compiler times its cuBLAS call against generated Triton GEMM kernels and keeps the
  fastest. It pays off on large models, where a decode step is a read of every weight and cuBLAS reads
  4096-wide projections at well under the copy bandwidth (bench/profile_9b.py, bench/gpu_bench.py section d).
  Costs a few seconds per distinct weight shape, once, at the first round; needs CUDA and Triton.

Products of more than one token (verify batches, prefill) and the LM head always use `F.linear`. GEMMs stay
PyTorch's either way: nothing here is a hand-written kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import EngineError

GEMM_MODES = ("cublas", "autotune")

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
    if mode == "autotune" and device.type != "cuda":
        raise EngineError(f"gemm='autotune' needs a CUDA device, and the model is on {device}; use gemm='cublas'")
