"""Sampling: temperature, top-k, top-p, min-p and a seed, as one frozen, validated value.

`Engine.generate(..., sampling=SamplingParams(temperature=0.7))` samples instead of picking the argmax;
`sampling=None` or temperature 0 is the greedy path, unchanged (bit-identical output, same code).

Speculative sampling keeps the target's distribution exactly: the MTP head draws each draft token x from its
processed distribution q (the same temperature / top-k / top-p / min-p), the target verifies with its processed
distribution p; draft i is accepted with probability min(1, p(x)/q(x)); at the first rejection the token is
drawn from normalise(max(0, p - q)); when every draft is accepted the bonus token is drawn from p. All of it
runs on the device inside the captured draft and verify plans (kernels `sample_probs`, `sample_token`,
`spec_accept`), with the round's one host read as before.

Random numbers are counter-based (kernels.reference.rng_uniform): hash(seed, the round's start position,
slot, purpose). A round starts at a position no earlier round of the run started at, so every number is
fresh; the same seed and settings give the same text on a rerun. Speculative and plain sampling use the
numbers differently (plain sampling draws one target token per round), so their texts differ while their
distributions are the same.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from .settings import from_known_keys

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn.

    temperature  0 = greedy (the argmax, exactly as without sampling); > 0 divides the logits (0 .. 100)
    top_k        keep the k most likely tokens (ties at the k-th kept); 0 = off
    top_p        keep the smallest set of most likely tokens whose probability reaches top_p; 1 = off (0 < top_p <= 1)
    min_p        drop tokens less likely than min_p times the most likely one; 0 = off (0 .. 1)
    seed         the random numbers' seed (0 .. 2^63-1): the same seed and settings give the same text
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        t = _number("temperature", self.temperature)
        if not (0.0 <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in 0..{MAX_TEMPERATURE:g} (0 = greedy), got {t!r}")
        object.__setattr__(self, "temperature", t)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = _number("top_p", self.top_p)
        if not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        object.__setattr__(self, "top_p", p)
        m = _number("min_p", self.min_p)
        if not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be a number in 0..1 (0 = off), got {m!r}")
        object.__setattr__(self, "min_p", m)
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not (0 <= s <= MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..2^63-1, got {s!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the engine takes the greedy path (no sampling at all)."""
        return self.temperature == 0.0

    @property
    def plan_key(self) -> tuple:
        """What a captured plan bakes in (the seed lives in a device buffer: a new seed is no new plan)."""
        return ("sample", self.temperature, self.top_k, self.top_p, self.min_p)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a mapping; unknown keys are an error naming them."""
        return from_known_keys(cls, data, "sampling setting")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def active(sampling: SamplingParams | None) -> SamplingParams | None:
    """The params when they ask for sampling, None for the greedy path (None or temperature 0)."""
    if sampling is None:
        return None
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    return None if sampling.greedy else sampling


class SamplingBuffers:
    """A session's static device buffers for sampled rounds (allocated at its first sampled round, before any
    capture; captured plans read them in place):

    q_buf     [max drafts, vocab] fp32: the draft's processed distribution of each drafted position (over the
              first sub_vocab ids when drafting a sub-vocabulary; the verify reads a [n, Vq] view): the residual
              max(0, p - q) at a rejected position needs the whole row.
    seed_buf  [1] int64: the seed (written by the host only when it changes; not part of any plan key).
    """

    def __init__(self, max_drafts: int, vocab: int, device: torch.device) -> None:
        self.q_buf = torch.zeros((max_drafts, vocab), dtype=torch.float32, device=device)
        self.seed_buf = torch.zeros(1, dtype=torch.int64, device=device)
        self.seed_host = torch.zeros(1, dtype=torch.int64)  # the same seed, for host-side draws
        self._seed: int | None = None

    def set_seed(self, seed: int) -> None:
        if seed != self._seed:
            self.seed_buf.fill_(seed)  # a launch with a scalar: no host synchronisation
            self.seed_host.fill_(seed)
            self._seed = seed

    def tensors(self) -> list[torch.Tensor]:
        return [self.q_buf, self.seed_buf]


def buffers_for(state, vocab: int) -> SamplingBuffers:
    """The session's sampling buffers (made once; kept on the session state)."""
    bufs = state.sampling_buffers
    if bufs is None:
        max_drafts = state.ids_buf.shape[0] - 1
        bufs = SamplingBuffers(max_drafts, vocab, state.start_buf.device)
        state.sampling_buffers = bufs
    return bufs
