"""Adaptive draft depth (`EngineSettings(draft_depth="auto")`): the depth of each round is chosen on the host
from what the round's one device read already brings back, so it adds no synchronisation.

Model of a round at depth d:
- acceptance: p_i = P(draft i is accepted | drafts 1..i-1 were), tracked per position as exponentially
  decayed counts (a position is "tried" in a round when every draft before it was accepted);
  expected tokens per round E(d) = 1 + sum_{i<=d} prod_{j<=i} p_j;
- cost: T(d), the wall time of a round at depth d, decayed means of the rounds measured at d (rounds that
  captured a plan are left out, and so are hiccups: a round far slower than the depth is believed to cost);
  a depth not measured yet is extrapolated from the measured ones (linear in d through the two nearest, or
  +12% a step from one). The means are kept relative to the machine's current speed: a host that slows
  down for a while (other load) slows every depth at once, but only the depth being run sees it, and a
  neighbour's mean measured before would look cheaper than it is (the controller then moves there and
  back). So a round's time updates `speed` (how the current depth's rounds compare with its mean, a fast
  moving average) and is stored divided by it; T(d) = mean(d) x speed.
The controller picks argmax E(d) / T(d) over 1..max_depth, moving only when the best beats the current
depth by more than `hysteresis` (so it does not flap), and now and then probes a neighbouring depth so
that the curve it decides from stays measured on both sides.
"""

from __future__ import annotations

import math

PRIOR_ACCEPT = 0.7  # p_1 before anything was seen
PRIOR_STEP_DECAY = 1.0  # an untried position: the previous one's rate times this (optimistic: go and look)
PRIOR_WEIGHT = 3.0  # rounds' worth of belief in the prior (one unlucky early round does not drop the depth)
EXPLORE_ROUNDS = 32  # after these, a probe goes only to a depth already measured (its plans exist: no capture)
PRIOR_STEP_COST = 0.12  # an unmeasured depth from one measured one: +12% per step
# A round slower than SPIKE x what the depth is believed to cost (its measured mean, or the extrapolation from
# the other depths) is a hiccup of the host or the GPU, not the depth's cost: it is not timed (a depth without
# a time yet is timed again next round), unless SPIKE_RUN rounds in a row are: then the costs really changed.
SPIKE = 1.6
SPIKE_RUN = 3
SPEED_RATE = 0.1  # how fast the machine-speed factor follows the rounds (an average over ~10 rounds)


class DepthController:
    def __init__(
        self,
        max_depth: int,
        start_depth: int = 3,
        decay: float = 0.97,
        hysteresis: float = 0.03,
        probe_every: int = 64,
    ) -> None:
        self.max_depth = max_depth
        self.depth = max(1, min(start_depth, max_depth))
        self.decay = decay
        self.hysteresis = hysteresis
        self.probe_every = probe_every
        self.tried = [0.0] * max_depth  # decayed counts per position
        self.hits = [0.0] * max_depth
        self.time_sum = [0.0] * (max_depth + 1)  # per depth (index = depth), decayed
        self.time_n = [0.0] * (max_depth + 1)
        self.speed = 1.0  # the machine's speed now relative to when the means were taken (see the docstring)
        self.rounds = 0
        self.switches = 0
        self._probe_up = True
        self._probe_gap = 2  # rounds between probes, doubling up to probe_every
        self._next_probe = 2
        self._remeasure: int | None = None
        self._spikes = 0  # rounds in a row not timed as hiccups
        self._settling: int | None = None  # a depth whose plans were just captured: its next round is not timed
        self._decided: tuple[list[float], list[float]] | None = None  # the curve and acceptance of the last choice
        # First, one visit to every other depth (its first round captures its plans, the next is timed), so
        # every T(d) is measured and later probes and moves find their plans: exploration costs its captures
        # once, at the start of a session, not in the middle of later runs.
        start = self.depth
        self._sweep = [*range(start + 1, max_depth + 1), *range(start - 1, 0, -1)]
        self.last_choice = self.depth
        self._prepared = False  # prepare() ran since the last choose()

    # ---- what it learned ----------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """p_1 .. p_max: measured where tried, else the prior continued from the previous position."""
        out, prev = [], PRIOR_ACCEPT
        for i in range(self.max_depth):
            if self.tried[i] >= 1.0:
                p = (self.hits[i] + PRIOR_WEIGHT * prev) / (self.tried[i] + PRIOR_WEIGHT)  # shrunk to the previous
            else:
                p = prev * PRIOR_STEP_DECAY if i else PRIOR_ACCEPT
            out.append(min(max(p, 0.0), 0.999))
            prev = out[-1]
        return out

    def expected_tokens(self, acceptance: list[float] | None = None) -> list[float]:
        """E(d) for d = 1..max_depth (from `acceptance`, default: what was learned)."""
        out, run, total = [], 1.0, 1.0
        for p in acceptance if acceptance is not None else self.acceptance():
            run *= p
            total += run
            out.append(total)
        return out

    def round_time(self) -> list[float | None]:
        """T(d) for d = 1..max_depth (seconds; None until some depth was measured)."""
        measured = {
            d: self.speed * self.time_sum[d] / self.time_n[d]
            for d in range(1, self.max_depth + 1)
            if self.time_n[d] > 0
        }
        if not measured:
            return [None] * self.max_depth
        out = []
        for d in range(1, self.max_depth + 1):
            if d in measured:
                out.append(measured[d])
                continue
            near = sorted(measured, key=lambda m: (abs(m - d), m))[:2]
            if len(near) == 2 and near[0] != near[1]:
                (d0, t0), (d1, t1) = ((m, measured[m]) for m in near)
                slope = max((t1 - t0) / (d1 - d0), 0.02 * min(t0, t1))  # deeper never cheaper
                out.append(max(t0 + slope * (d - d0), 1e-9))
            else:
                d0 = near[0]
                out.append(measured[d0] * (1 + PRIOR_STEP_COST * (d - d0)))
        return out

    def curve(self, acceptance: list[float] | None = None) -> list[float]:
        """Expected tokens per second for d = 1..max_depth (0 where no time is known yet)."""
        times = self.round_time()
        return [e / t if t else 0.0 for e, t in zip(self.expected_tokens(acceptance), times)]

    # ---- deciding -----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Work the curve out, and move the current depth, ahead of the next choose(): the engine calls this
        while the GPU runs a round (the host only waits then), so the round boundary keeps only choose()'s
        few steps. On the bundled model a round is ~1 ms of mostly host work, and an auto round at the
        boundary-decided depth cost 3.7% more than a static one (the curve's few dozen Python steps are most
        of that work; they ran cache-cold after the round's launches: ~40 us a round). The curve then lags
        one round (it has not seen the round running), two where rounds are pipelined (the next round's depth is
        chosen before the round ahead of it is read), which a decay over ~30 rounds does not notice."""
        self._decide()
        self._prepared = True

    def choose(self) -> int:
        """The depth of the next round (worked out here unless prepare() did it since the last choice)."""
        if not self._prepared:
            self._decide()
        self._prepared = False
        choice = self.depth
        if self._remeasure is not None:  # a probe whose round captured its plans: time it now they exist
            choice, self._remeasure = self._remeasure, None
        elif self._sweep and self.rounds:
            choice = self._sweep.pop(0)
        elif self.rounds >= self._next_probe:  # keep both neighbours measured: often at first, then rarely
            self._probe_gap = min(2 * self._probe_gap, self.probe_every)
            self._next_probe = self.rounds + self._probe_gap
            steps = (1, -1) if self._probe_up else (-1, 1)
            self._probe_up = not self._probe_up
            for step in steps:
                d = choice + step
                if 1 <= d <= self.max_depth and (self.rounds < EXPLORE_ROUNDS or self.time_n[d] > 0):
                    choice = d
                    break
        self.last_choice = choice
        return choice

    def _decide(self) -> None:
        """Move the current depth to the best of the curve when it beats it by more than the hysteresis."""
        acceptance = self.acceptance()
        curve = self.curve(acceptance)
        self._decided = (curve, acceptance)
        if any(curve):
            best = max(range(self.max_depth), key=lambda i: curve[i]) + 1
            here = curve[self.depth - 1]
            if best != self.depth and (here <= 0 or curve[best - 1] > here * (1 + self.hysteresis)):
                self.depth = best
                self.switches += 1

    def observe(self, depth: int, drafted: int, accepted: int, round_s: float, captured: bool) -> None:
        """What the round at `depth` did: `drafted` drafts were valid (p_min may cut some), `accepted` of them
        matched; `captured` rounds (a plan was recorded) are not timed, nor is the round after one at its depth."""
        self.rounds += 1
        if captured:  # its plans exist now: the depth runs again, first untimed (a graph's first launch
            self._remeasure = self._settling = depth  # uploads it to the GPU), then timed
        elif depth == self._settling:
            self._remeasure, self._settling, captured = depth, None, True
        for i in range(self.max_depth):
            self.tried[i] *= self.decay
            self.hits[i] *= self.decay
        for i in range(min(drafted, accepted + 1, self.max_depth)):
            self.tried[i] += 1.0
            if i < accepted:
                self.hits[i] += 1.0
        if not captured and round_s > 0 and math.isfinite(round_s) and 1 <= depth <= self.max_depth:
            measured = self.time_n[depth] > 0  # its own mean, else the extrapolation (only then all depths' curve)
            mean = self.time_sum[depth] / self.time_n[depth] if measured else None
            believed = self.speed * mean if mean is not None else self.round_time()[depth - 1]
            if believed is not None and round_s > SPIKE * believed and self._spikes < SPIKE_RUN - 1:
                self._spikes += 1
                if not measured:
                    self._remeasure = depth
                return
            self._spikes = 0
            if mean is not None:
                self.speed += SPEED_RATE * (round_s / mean - self.speed)
                self.speed = min(max(self.speed, 0.2), 5.0)
            for d in range(1, self.max_depth + 1):
                self.time_sum[d] *= self.decay
                self.time_n[d] *= self.decay
            self.time_sum[depth] += round_s / self.speed
            self.time_n[depth] += 1.0

    def snapshot(self) -> dict:
        """For the app: the depth chosen and the curve it decided from (kept by choose(): a round's host
        work stays one curve, not two)."""
        curve, acceptance = self._decided if self._decided is not None else (self.curve(), self.acceptance())
        return {
            "depth": self.last_choice,
            "expected_tokens_per_s": curve,
            "acceptance": acceptance,
            "switches": self.switches,
        }
