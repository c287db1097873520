"""SpecDeck's engine: Qwen3.5-hybrid models with MTP speculative decoding. No Qt in here."""

from .engine import Engine, GenerateResult, bundled_model_dir
from .errors import EngineError, ModelLoadError
from .sampling import SamplingParams
from .settings import EngineSettings
from .state import Session
from .stats import RoundEvent

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
