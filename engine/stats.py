"""Per-round events and per-run statistics. Names carry their unit (_s seconds, _bytes bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .settings import EngineSettings


@dataclass(kw_only=True)  # built with keywords only: a dozen numeric fields cannot be swapped unseen
class RoundEvent:
    index: int
    tokens: list[int]
    text: str
    from_draft: list[bool]
    drafted: int
    accepted: int
    settings: EngineSettings
    time_draft_s: float
    time_verify_s: float
    time_accept_s: float
    time_host_s: float
    time_round_s: float
    plan_hits: int = 0
    plan_misses: int = 0
    plan_capture_s: float = 0.0
    run: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    stop_reason: str | None = None
    # The depth this round drafted at (0 = no drafting); with draft_depth="auto", what the controller
    # decided from: {"depth", "expected_tokens_per_s" (per depth 1..max), "acceptance", "switches"}.
    depth: int = 0
    adaptive: dict[str, Any] | None = None
    # The draft scored its sub-vocabulary through the model's sub-vocab order (run stats: remap_size, remap_rounds).
    remapped: bool = False
    # Synthetic acceptance (settings.synthetic_rates): the accepted count was drawn, not decided by the target,
    # so this round's text is not the model's output and its figures measure speed only.
    synthetic: bool = False
    # Queued on the device behind the round before it, its input taken there (target-only; run stats:
    # pipelined_rounds): the device did not wait for the host between the two.
    pipelined: bool = False

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.time_round_s if self.time_round_s > 0 else 0.0


class RunStats:
    """Accumulates rounds into the numbers `generate` returns in `result.stats`."""

    def __init__(self) -> None:
        self.rounds = 0
        self.generated = 0
        self.drafted = 0
        self.accepted = 0
        self.position_drafted: list[int] = []
        self.position_accepted: list[int] = []
        self.time_draft_s = 0.0
        self.time_verify_s = 0.0
        self.time_accept_s = 0.0
        self.time_host_s = 0.0
        self.time_rounds_s = 0.0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.plan_hits = 0
        self.plan_misses = 0
        self.plan_capture_s = 0.0
        self.remap_rounds = 0
        self.pipelined_rounds = 0
        self.stop_reason: str | None = None
        # the round cost model: depth -> [rounds, draft, verify, accept, host, whole round seconds], over
        # rounds that captured no plan (a capture is a one-off, not the cost of a depth)
        self._cost: dict[int, list[float]] = {}
        self.synthetic = False  # any round ran with synthetic acceptance: the run's text is not the model's

    def add(self, ev: RoundEvent) -> None:
        if ev.plan_misses == 0:
            c = self._cost.setdefault(ev.depth, [0, 0.0, 0.0, 0.0, 0.0, 0.0])
            c[0] += 1
            for i, v in enumerate(
                (ev.time_draft_s, ev.time_verify_s, ev.time_accept_s, ev.time_host_s, ev.time_round_s), 1
            ):
                c[i] += v
        self.rounds += 1
        self.synthetic = self.synthetic or ev.synthetic
        self.generated += len(ev.tokens)
        self.drafted += ev.drafted
        self.accepted += ev.accepted
        while len(self.position_drafted) < ev.drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(ev.drafted):
            self.position_drafted[i] += 1
            if i < ev.accepted:
                self.position_accepted[i] += 1
        self.time_draft_s += ev.time_draft_s
        self.time_verify_s += ev.time_verify_s
        self.time_accept_s += ev.time_accept_s
        self.time_host_s += ev.time_host_s
        self.time_rounds_s += ev.time_round_s
        self.plan_hits += ev.plan_hits
        self.plan_misses += ev.plan_misses
        self.plan_capture_s += ev.plan_capture_s
        self.remap_rounds += ev.remapped
        self.pipelined_rounds += ev.pipelined

    def round_cost(self) -> dict[int, dict[str, float]]:
        """Mean seconds of each phase of a round, per depth drafted (0 = no drafting), over rounds that
        captured no plan: what a round at each depth costs on this model and device."""
        names = ("draft_s", "verify_s", "accept_s", "host_s", "round_s")
        return {
            d: {"rounds": int(c[0]), **{k: c[i] / c[0] for i, k in enumerate(names, 1)}}
            for d, c in sorted(self._cost.items())
        }

    def as_dict(self, memory: dict[str, int] | None = None) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "generated": self.generated,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_length": self.generated / self.rounds if self.rounds else 0.0,
            "per_position_acceptance": [
                a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted, strict=True)
            ],
            "tokens_per_second": self.generated / self.time_rounds_s if self.time_rounds_s > 0 else 0.0,
            "time_draft_s": self.time_draft_s,
            "time_verify_s": self.time_verify_s,
            "time_accept_s": self.time_accept_s,
            "time_host_s": self.time_host_s,
            "round_cost_by_depth": self.round_cost(),
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "plan_hits": self.plan_hits,
            "plan_misses": self.plan_misses,
            "plan_capture_s": self.plan_capture_s,
            "remap_rounds": self.remap_rounds,
            "pipelined_rounds": self.pipelined_rounds,
            "stop_reason": self.stop_reason,
            "synthetic": self.synthetic,
            "memory": dict(memory or {}),
        }
