"""SpecDeck's engine: Qwen3.5-hybrid models with MTP speculative decoding. No Qt in here."""

from . import own_kernels

own_kernels.ensure()  # before anything below imports `kernels` (see engine/own_kernels.py)

from .engine import Engine, GenerateResult, bundled_model_dir  # noqa: E402
from .errors import EngineError, ModelLoadError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .settings import EngineSettings  # noqa: E402
from .state import Session  # noqa: E402
from .stats import RoundEvent  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "EngineError",
    "EngineSettings",
    "GenerateResult",
    "ModelLoadError",
    "RoundEvent",
    "SamplingParams",
    "Session",
    "__version__",
    "bundled_model_dir",
]
