"""EngineSettings: every knob of the engine, as one frozen, validated value.

The app, the CLI, saved profiles and the bench all pass this one value to the engine.
A running generation picks up a new value at its next round boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_DRAFT_DEPTH = 16
MAX_PLAN_POOL = 64


@dataclass(frozen=True)
class EngineSettings:
    """The engine's knobs.

    speculative    draft with the MTP head and verify (False: plain greedy decoding of the target)
    draft_depth    drafted tokens per round, 1..16, or "auto": chosen every round by the engine from the
                   measured acceptance and round cost (engine/adaptive.py), at most max_draft_depth
    max_draft_depth  the deepest "auto" may go, 1..16
    p_min          stop drafting when the draft's probability of its pick is below this, 0..1
    chain          all draft steps in one submission with the pick made on the device, returning only
                   (token, prob); off: one submission per step and the full vocabulary row to the host
    sub_vocab      the draft scores only the first N token ids (0 = the full vocabulary)
    mirror_output  several devices: every device keeps the whole LM head (off: a vocabulary slice each)
    plan_pool      captured plans (CUDA graphs) kept, keyed by batch width, LRU; 0 = no graphs
    """

    speculative: bool = True
    draft_depth: int | str = 3
    p_min: float = 0.0
    chain: bool = True
    sub_vocab: int = 0
    mirror_output: bool = True
    plan_pool: int = 8
    max_draft_depth: int = 8

    def __post_init__(self) -> None:
        for name in ("speculative", "chain", "mirror_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.draft_depth != "auto":
            if isinstance(self.draft_depth, str):
                raise ValueError(
                    f"draft_depth must be an integer in 1..{MAX_DRAFT_DEPTH} or 'auto', got {self.draft_depth!r}"
                )
            _check_int("draft_depth", self.draft_depth, 1, MAX_DRAFT_DEPTH)
        _check_int("max_draft_depth", self.max_draft_depth, 1, MAX_DRAFT_DEPTH)
        _check_int("sub_vocab", self.sub_vocab, 0, None)
        _check_int("plan_pool", self.plan_pool, 0, MAX_PLAN_POOL)
        p = self.p_min
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= float(p) <= 1.0):
            raise ValueError(f"p_min must be a number in 0..1, got {p!r}")
        object.__setattr__(self, "p_min", float(p))

    @property
    def adaptive(self) -> bool:
        """The depth is chosen by the engine each round (draft_depth="auto")."""
        return self.draft_depth == "auto"

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with some fields changed (validated like any new value)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSettings:
        """Build from a mapping; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def diff(self, other: EngineSettings) -> dict[str, tuple[Any, Any]]:
        """Fields that differ: name -> (self's value, other's value)."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {allowed}, got {value}")
