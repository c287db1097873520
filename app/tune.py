"""Staged autotune: find the settings that decode fastest on this model, these workloads and this machine.

Stage 1, a coarse search: the baseline first (the settings the user has), then drafting off, depth x chain,
then sub-vocab, p_min (and on several GPUs the output mirror) tried on the best cells so far; each cell is
one pass over the workloads after an untimed warm-up. Stage 2 confirms the three best with repeats,
alternating their order, with the baseline among them, so drift (heat, other load) shows in the
baseline's own spread. The winner is reported with min / median / max of its repeats, and a difference
inside the spread is called "no clear difference", never a win.

The budget is wall time: stage 1 stops at 60% of it, stage 2 uses the rest (at least one repeat).
Cancelling keeps every finished cell. `specdeck tune` and the app's Tune panel both call `run_tune`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.settings import EngineSettings

from .workloads import WORKLOAD_NAMES, load_workloads

STAGE1_SHARE = 0.6


@dataclass
class TuneCell:
    name: str
    settings: EngineSettings
    runs: list[float] = field(default_factory=list)  # tokens/s of each pass (mean over the workloads)
    stage: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else 0.0

    @property
    def spread(self) -> tuple[float, float, float]:
        if not self.runs:
            return (0.0, 0.0, 0.0)
        return (min(self.runs), statistics.median(self.runs), max(self.runs))

    def describe(self) -> str:
        lo, med, hi = self.spread
        return f"{self.name}: {med:.1f} t/s (min {lo:.1f}, max {hi:.1f}, {len(self.runs)} runs)"


@dataclass
class TuneReport:
    baseline: TuneCell
    cells: list[TuneCell]
    workloads: list[str]
    max_new_tokens: int
    budget_s: float
    elapsed_s: float = 0.0
    cancelled: bool = False
    finalists: list[TuneCell] = field(default_factory=list)

    @property
    def winner(self) -> TuneCell:
        pool = self.finalists or self.cells
        measured = [c for c in pool if c.runs] or [self.baseline]
        return max(measured, key=lambda c: c.median)

    @property
    def clear(self) -> bool:
        """The winner beats the baseline beyond both spreads (its slowest run above the baseline's fastest)."""
        w, b = self.winner, self.baseline
        if w is b or not w.runs or not b.runs:
            return False
        return min(w.runs) > max(b.runs)

    @property
    def drift(self) -> float:
        """The baseline's spread relative to its median (heat, other load, noise)."""
        lo, med, hi = self.baseline.spread
        return (hi - lo) / med if med else 0.0

    def verdict(self) -> str:
        w, b = self.winner, self.baseline
        if w is b:
            return f"the baseline is the best found ({b.describe()})"
        gain = (w.median / b.median - 1) * 100 if b.median else 0.0
        if not self.clear:
            return f"no clear difference: {w.describe()} vs baseline {b.describe()} ({gain:+.1f}%, inside the spread)"
        return f"{w.describe()} beats the baseline {b.describe()} by {gain:+.1f}%"

    def format(self) -> str:
        lines = [f"tuned on {', '.join(self.workloads)}, {self.max_new_tokens} tokens each, {self.elapsed_s:.0f} s"]
        if self.cancelled:
            lines.append("cancelled: the cells below are the ones that finished")
        for c in self.cells:
            lines.append(f"  stage {c.stage}  {c.describe()}")
        lines.append(f"baseline drift over the tune: {self.drift * 100:.1f}%")
        lines.append(self.verdict())
        return "\n".join(lines)

    def figures(self) -> dict[str, Any]:
        """What a profile saved from the winner keeps."""
        w, b = self.winner, self.baseline
        lo, med, hi = w.spread
        blo, bmed, bhi = b.spread
        return {
            "source": "tune",
            "workloads": list(self.workloads),
            "max_new_tokens": self.max_new_tokens,
            "tokens_per_second": med,
            "tokens_per_second_min": lo,
            "tokens_per_second_max": hi,
            "baseline_tokens_per_second": bmed,
            "baseline_min": blo,
            "baseline_max": bhi,
            "clear_win": self.clear,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }


def _label(s: EngineSettings, base: EngineSettings) -> str:
    if not s.speculative:
        return "no drafting"
    diff = s.diff(base)
    if not diff:
        return "baseline"
    names = {"draft_depth": "depth", "chain": "chain", "sub_vocab": "sub-vocab", "p_min": "p_min"}
    parts = []
    for key, (new, _) in diff.items():
        if key == "chain":
            parts.append(f"chain {'on' if new else 'off'}")
        elif key == "mirror_output":
            parts.append(f"mirror {'on' if new else 'off'}")
        else:
            parts.append(f"{names.get(key, key)} {new}")
    return ", ".join(parts)


def run_tune(
    engine,
    baseline: EngineSettings | None = None,
    workloads: list[str] | None = None,
    budget_s: float = 120.0,
    max_new_tokens: int = 64,
    progress: Callable[[float, str, TuneCell | None], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    score: Callable[[dict, EngineSettings], float] | None = None,
) -> TuneReport:
    """Tune within `budget_s` seconds. `progress(fraction of the budget used, message, finished cell)`.
    `score(run stats, settings)` is what is maximised: decode tokens/s unless given (tests give a
    deterministic one, to check the search rather than the machine)."""
    score = score or (lambda stats, _settings: stats["tokens_per_second"])
    workloads = list(workloads or WORKLOAD_NAMES)
    available = load_workloads()
    unknown = [w for w in workloads if w not in available]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    base = (baseline or EngineSettings()).replace()
    engine.check_settings(base)
    prompts = [available[w].prompt_for(engine.tokenizer) for w in workloads]
    session = engine.new_session()
    t0 = clock()
    report = TuneReport(TuneCell("baseline", base), [], workloads, max_new_tokens, budget_s)
    report.cells.append(report.baseline)
    warmed: set[EngineSettings] = set()

    def used() -> float:
        return (clock() - t0) / budget_s if budget_s > 0 else 1.0

    def stopped() -> bool:
        return should_stop is not None and should_stop()

    def measure(cell: TuneCell) -> bool:
        """One pass over the workloads (after a warm-up the first time). False when cancelled."""
        if cell.settings not in warmed:
            session.reset()
            engine.generate(prompts[0], max_new_tokens, cell.settings, session)
            warmed.add(cell.settings)
        speeds = []
        for prompt in prompts:
            if stopped():
                return False
            session.reset()
            stats = engine.generate(prompt, max_new_tokens, cell.settings, session).stats
            speeds.append(score(stats, cell.settings))
        cell.runs.append(statistics.fmean(speeds))
        if progress is not None:
            progress(min(used(), 1.0), f"stage {cell.stage}: {cell.describe()}", cell)
        return True

    def try_cell(settings: EngineSettings) -> TuneCell | None:
        if any(c.settings == settings for c in report.cells):
            return None
        try:
            engine.check_settings(settings)
        except Exception:  # noqa: BLE001 - a cell that does not fit this model is skipped
            return None
        cell = TuneCell(_label(settings, base), settings)
        report.cells.append(cell)
        return cell

    try:
        # ---- stage 1 --------------------------------------------------------------------------------
        if not measure(report.baseline):
            raise _Cancelled
        vocab = engine.cfg.vocab_size
        several = len(engine.info.get("devices", [])) > 1
        first = [base.replace(speculative=False)]
        first += [
            base.replace(speculative=True, draft_depth=d, chain=c)
            for c in (True, False)
            for d in (1, 2, 3, 5, 8, "auto")
            if d == "auto" or d <= 16
        ]

        def refinements(best: list[TuneCell]) -> list[EngineSettings]:
            out = []
            for cell in best:
                s = cell.settings
                if not s.speculative:
                    continue
                if vocab >= 4096 and s.chain:
                    out += [s.replace(sub_vocab=vocab // 4), s.replace(sub_vocab=vocab // 8)]
                out.append(s.replace(p_min=0.3))
                if several:
                    out.append(s.replace(mirror_output=not s.mirror_output))
            return out

        queue = list(first)
        refined = False
        since_baseline = 0
        while used() < STAGE1_SHARE:
            if not queue:
                if refined:
                    break
                best = sorted((c for c in report.cells if c.runs), key=lambda c: -c.median)[:2]
                queue = refinements(best)
                refined = True
                continue
            cell = try_cell(queue.pop(0))
            if cell is None:
                continue
            if not measure(cell):
                raise _Cancelled
            since_baseline += 1
            if since_baseline >= 6:  # the baseline again: drift shows in its spread
                since_baseline = 0
                if not measure(report.baseline):
                    raise _Cancelled
        # ---- stage 2 --------------------------------------------------------------------------------
        ranked = sorted((c for c in report.cells if c.runs and c is not report.baseline), key=lambda c: -c.median)
        report.finalists = [*ranked[:3], report.baseline]
        for c in ranked[:3]:
            c.stage = 2
        for repeat in range(5):  # alternate the order; every finalist runs at least once
            order = report.finalists if repeat % 2 == 0 else list(reversed(report.finalists))
            for cell in order:
                if repeat and used() >= 1.0:
                    raise _Done
                if not measure(cell):
                    raise _Cancelled
    except _Done:
        pass
    except _Cancelled:
        report.cancelled = True
    report.elapsed_s = clock() - t0
    return report


class _Cancelled(Exception):
    pass


class _Done(Exception):
    pass


def winner_profile(report: TuneReport, name: str, model_name: str = "", gpu_names: list[str] | None = None):
    """The winner as a profile: its settings, the verdict as its notes, the measured figures and the
    hardware they were measured on."""
    from .profiles import Profile, hardware_fingerprint

    figures = report.figures()
    if model_name:
        figures["model"] = model_name
    return Profile(
        name=name,
        settings=report.winner.settings,
        notes=f"specdeck tune: {report.verdict()}",
        hardware=hardware_fingerprint(gpu_names),
        bench=figures,
    )
