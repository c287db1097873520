"""EngineSettings: every knob of the engine, as one frozen, validated value, each described once.

The app, the CLI, saved profiles and the bench all pass this one value to the engine.
A running generation picks up a new value at its next round boundary.

Each field carries its description as `dataclasses.field(metadata=...)`: `label` (a control's name),
`short` (a plot marker's name), `help` (tooltip and --help text), `unit`, `range` ((lo, hi) with hi None
for "no upper bound", or None for a switch), `flag` (the command line's option). `knobs()` lists them;
validation reads the same ranges, so a control, a flag and the check cannot disagree. Adding a knob is one
field here plus its use in the engine.

One field is not a knob: `synthetic_rates`, a measurement mode (its metadata says `knob: False`, so `knobs()`,
and with it the command line's knob flags, the window's knob panel, the plot markers and the tune grid, leave
it out). It is set only by `specdeck bench --synthetic-rates`, the Bench tab, or a profile marked as a bench
profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_DRAFT_DEPTH = 16
MAX_PLAN_POOL = 64


def _knob(
    default: Any, label: str, short: str, help: str, flag: str, unit: str | None = None, range: tuple | None = None
) -> Any:
    meta = {"label": label, "short": short, "help": help, "unit": unit, "range": range, "flag": flag}
    return dataclasses.field(default=default, metadata=meta)


def _not_a_knob(default: Any, help: str) -> Any:
    """A field that is no tuning knob: left out of `knobs()` (no flag, no control, no marker, no tune cell)."""
    return dataclasses.field(default=default, metadata={"knob": False, "help": help})


@dataclass(frozen=True)
class EngineSettings:
    """The engine's knobs (each field's metadata says what it does; `knobs()` lists them)."""

    speculative: bool = _knob(
        True,
        "Speculative decoding",
        "speculative",
        "Draft with the MTP head and let the target verify several tokens per round. "
        "Off: plain greedy decoding, one target token per round (the baseline).",
        "--spec",
    )
    draft_depth: int | str = _knob(
        3,
        "Draft depth",
        "depth",
        f"Tokens drafted per round (1–{MAX_DRAFT_DEPTH}), or 'auto': the engine picks the depth of every round "
        "from the acceptance it measures at each draft position and the time a round takes at each depth "
        "(engine/adaptive.py), up to max_draft_depth. Deeper drafts pay off while acceptance stays high.",
        "--depth",
        "tokens",
        (1, MAX_DRAFT_DEPTH),
    )
    p_min: float = _knob(
        0.0,
        "p_min",
        "p_min",
        "Stop drafting once the draft's probability of its pick falls below this (0 = always draft the full depth).",
        "--p-min",
        "probability",
        (0.0, 1.0),
    )
    chain: bool = _knob(
        True,
        "Chain draft steps",
        "chain",
        "All draft steps in one submission with the pick made on the device, returning only (token, probability). "
        "Off: one submission per step, the full vocabulary row copied to the host each time.",
        "--chain",
    )
    sub_vocab: int = _knob(
        0,
        "Sub-vocab",
        "sub-vocab",
        "The draft scores only N token ids: the first N of the model's sub-vocab order (subvocab.json next to "
        "the model, most frequent first; `specdeck subvocab build` makes one) when it holds N ids, else ids "
        "0..N-1. The target still checks against the full vocabulary, so the output does not change. "
        "0 ('all') = the full vocabulary.",
        "--sub-vocab",
        "token ids",
        (0, None),
    )
    mirror_output: bool = _knob(
        True,
        "Mirror output layer",
        "mirror",
        "With several GPUs: every GPU keeps the whole LM head (one layer of extra memory per GPU, no GPU-to-GPU "
        "traffic at each verify). Off: each GPU holds a slice of the vocabulary.",
        "--mirror-output",
    )
    plan_pool: int = _knob(
        8,
        "Plan pool",
        "pool",
        "Captured plans (CUDA graphs) kept, keyed by batch width, least recently used dropped first "
        f"(0–{MAX_PLAN_POOL}; 0 = no graphs). With draft depth Auto: at least two per depth up to its "
        "maximum, and two.",
        "--plan-pool",
        "graphs",
        (0, MAX_PLAN_POOL),
    )
    prefill_chunk: int = _knob(
        2048,
        "Prefill chunk",
        "chunk",
        "Prompt tokens per forward pass when a prompt is read in: larger runs the prefill faster on a GPU, "
        "smaller bounds the memory it takes (64–65536). Never changes the text.",
        "--prefill-chunk",
        "tokens",
        (64, 65536),
    )
    max_draft_depth: int = _knob(
        8,
        "Draft depth: Auto, up to",
        "max depth",
        f"With draft_depth 'auto': the deepest the engine may draft (1–{MAX_DRAFT_DEPTH}).",
        "--max-depth",
        "tokens",
        (1, MAX_DRAFT_DEPTH),
    )
    synthetic_rates: tuple[float, ...] = _not_a_knob(
        (),
        "Synthetic acceptance, a measurement mode (not a knob): empty = off. Otherwise the engine still drafts "
        "and verifies (the same GPU work, the same one host read per round), but how many drafts a round "
        "accepts is drawn on the device: draft i (from 0) is accepted, once every draft before it was, with "
        "probability rates[i]; positions past the list take its last rate. The round emits the accepted "
        "drafts and the target's token after them, so the figures measure speed at these rates and the text "
        "is not the model's output. Greedy only (temperature 0); p_min still cuts the drafts first. "
        f"At most {MAX_DRAFT_DEPTH} rates, each in 0..1.",
    )

    def __post_init__(self) -> None:
        kinds = {f.name: f.type for f in dataclasses.fields(self)}
        for name in (n for n, t in kinds.items() if t == "bool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.draft_depth != "auto":
            if isinstance(self.draft_depth, str):
                raise ValueError(
                    f"draft_depth must be an integer in 1..{MAX_DRAFT_DEPTH} or 'auto', got {self.draft_depth!r}"
                )
            _check_int("draft_depth", self.draft_depth, *_RANGES["draft_depth"])
        for name in (n for n, t in kinds.items() if t == "int"):
            _check_int(name, getattr(self, name), *_RANGES[name])
        for name in (n for n, t in kinds.items() if t == "float"):
            lo, hi = _RANGES[name]
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not (lo <= p <= hi):  # no float(): overflow
                raise ValueError(f"{name} must be a number in {lo:g}..{hi:g}, got {str(p)[:40]}")
            object.__setattr__(self, name, float(p))
        object.__setattr__(self, "synthetic_rates", _check_rates(self.synthetic_rates))

    @property
    def adaptive(self) -> bool:
        """The depth is chosen by the engine each round (draft_depth="auto")."""
        return self.draft_depth == "auto"

    @property
    def auto_plan_pool(self) -> int:
        """The plans kept while the depth is "auto": at least a draft and a verify plan for every depth it may
        use, and the one-row verify (fewer, and the plans of the depths it moves between would be captured
        again and again in the middle of a run). plan_pool 0 (no graphs) stays 0."""
        if self.plan_pool <= 0:
            return 0
        return min(MAX_PLAN_POOL, max(self.plan_pool, 2 * self.max_draft_depth + 2))

    @property
    def synthetic(self) -> bool:
        """Synthetic acceptance is on: a round's accepted count is drawn, its text is not the model's output."""
        return bool(self.synthetic_rates)

    def synthetic_rate(self, position: int) -> float:
        """The synthetic acceptance rate of draft `position` (from 0): the last rate continues past the list."""
        rates = self.synthetic_rates
        return rates[min(position, len(rates) - 1)] if rates else 1.0

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with some fields changed (validated like any new value)."""
        return dataclasses.replace(self, **changes)

    def fitted_to(self, vocab_size: int, sub_vocab_fraction: float | None = None) -> EngineSettings:
        """These settings for a model with `vocab_size` tokens: the one fit-to-model rule.

        `sub_vocab_fraction` (a profile's sub-vocab saved as a share of its model's vocabulary): sub_vocab
        becomes that share of this vocabulary, at least 1, and 0 ("all") when it reaches the whole of it.
        Without one, a sub_vocab larger than the vocabulary (a count tuned on a bigger model) becomes 0, the
        closest meaning; anything else is unchanged."""
        if sub_vocab_fraction is None:
            return self.replace(sub_vocab=0) if self.sub_vocab > vocab_size else self
        sub_vocab = max(1, round(sub_vocab_fraction * vocab_size))
        return self.replace(sub_vocab=0 if sub_vocab >= vocab_size else sub_vocab)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSettings:
        """Build from a mapping; unknown keys are an error naming them."""
        return from_known_keys(cls, data, "setting")

    def diff(self, other: EngineSettings) -> dict[str, tuple[Any, Any]]:
        """Fields that differ: name -> (self's value, other's value)."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


@dataclass(frozen=True)
class Knob:
    """One EngineSettings field and its description (what a control, a flag or a marker is built from)."""

    name: str
    type: type
    default: Any
    label: str
    short: str
    help: str
    unit: str | None
    range: tuple[Any, Any] | None
    flag: str


_TYPES = {"bool": bool, "int": int, "float": float, "int | str": int}  # draft_depth: an int, or "auto"


def knobs() -> tuple[Knob, ...]:
    """Every knob of EngineSettings, in field order (fields marked `knob: False` are not knobs)."""
    return tuple(
        Knob(f.name, _TYPES[f.type], f.default, **f.metadata)
        for f in dataclasses.fields(EngineSettings)
        if f.metadata.get("knob", True)
    )


_RANGES = {k.name: k.range for k in knobs() if k.range is not None}


def from_known_keys(cls: type, data: dict[str, Any], noun: str) -> Any:
    """`cls(**data)` for a dataclass, refusing keys that are not its fields with a message naming them."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {noun}(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**data)


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {allowed}, got {value}")


def _check_rates(value: Any) -> tuple[float, ...]:
    """synthetic_rates as a tuple of floats, each in 0..1, at most MAX_DRAFT_DEPTH of them (a list, as a
    profile file gives it, is taken too); a ValueError names the bad entry."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ValueError(f"synthetic_rates must be a list of numbers in 0..1 (empty = off), got {value!r}")
    if len(value) > MAX_DRAFT_DEPTH:
        raise ValueError(f"synthetic_rates has {len(value)} rates; at most {MAX_DRAFT_DEPTH} (one per draft position)")
    out = []
    for i, rate in enumerate(value):
        ok = not isinstance(rate, bool) and isinstance(rate, (int, float)) and 0 <= rate <= 1  # NaN fails too
        if not ok:  # (compared as given: float() of a huge integer would overflow)
            raise ValueError(f"synthetic_rates[{i}] must be a number in 0..1, got {str(rate)[:40]}")
        out.append(float(rate))
    return tuple(out)
