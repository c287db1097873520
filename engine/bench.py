"""A/B benchmarks on the fixed workloads, printed as the seed's tables.

Arms run alternately (A,B then B,A in the next round) on a fresh session each time, so neither arm
profits from the other's warm state; each arm gets one untimed warm-up first. Generation tokens/s
counts decode rounds only (prefill excluded), as the seed's server timings did. The CLI
(`specdeck bench`) and the app's bench tab both call `run_bench`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .sampling import SamplingParams
from .settings import EngineSettings
from .workloads import WORKLOAD_NAMES, load_workloads


@dataclass(frozen=True)
class BenchArm:
    name: str
    settings: EngineSettings
    sampling: SamplingParams | None = None  # None: greedy (every arm's text must then be the same)


@dataclass
class BenchRow:
    arm: str
    round: int
    workload: str
    tokens_per_second: float
    mean_accepted_length: float
    acceptance_rate: float
    generated: int
    output_hash: str


@dataclass
class BenchReport:
    arms: list[BenchArm]
    workloads: list[str]
    rounds: int
    max_new_tokens: int
    rows: list[BenchRow] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    # ---- figures --------------------------------------------------------------------------------
    def _rows(self, arm: str, workload: str | None = None, rnd: int | None = None) -> list[BenchRow]:
        return [
            r
            for r in self.rows
            if r.arm == arm and (workload is None or r.workload == workload) and (rnd is None or r.round == rnd)
        ]

    def round_means(self, arm: str) -> list[float]:
        """Mean generation t/s over the workloads, per round (the seed's 'Round results')."""
        out = []
        for rnd in range(self.rounds):
            rows = self._rows(arm, rnd=rnd)
            if rows:
                out.append(statistics.fmean(r.tokens_per_second for r in rows))
        return out

    def mean_tps(self, arm: str, workload: str | None = None) -> float:
        rows = self._rows(arm, workload)
        return statistics.fmean(r.tokens_per_second for r in rows) if rows else float("nan")

    def mean_of(self, arm: str, workload: str, key: str) -> float:
        rows = self._rows(arm, workload)
        return statistics.fmean(getattr(r, key) for r in rows) if rows else float("nan")

    def hashes(self, arm: str, workload: str) -> set[str]:
        return {r.output_hash for r in self._rows(arm, workload)}

    @property
    def arms_agree(self) -> bool:
        """Every greedy arm produced the same text on every workload (speculation must never change text).
        Sampled arms are left out: speculation keeps their distribution, not their text."""
        for w in self.workloads:
            seen = set()
            for a in self.arms:
                if a.sampling is not None and not a.sampling.greedy:
                    continue
                seen |= self.hashes(a.name, w)
            if len(seen) > 1:
                return False
        return True

    # ---- output ---------------------------------------------------------------------------------
    def format_tables(self) -> str:
        lines: list[str] = []
        head = f"{'Config':<24} {'Depth':>5}  {'Round results':<32} {'Mean':>8}"
        lines += [head, "-" * len(head)]
        for a in self.arms:
            depth = a.settings.draft_depth if a.settings.speculative else 0
            rr = ", ".join(f"{v:.1f}" for v in self.round_means(a.name))
            lines.append(f"{a.name:<24} {depth:>5}  {rr:<32} {self.mean_tps(a.name):>8.1f}")
        lines.append("")
        names = [a.name for a in self.arms]
        head = f"{'Category':<12}" + "".join(f" {n[:14]:>14}" for n in names)
        if len(names) == 2:
            head += f" {'Change':>8}"
        lines += [head, "-" * len(head)]
        for w in [*self.workloads, "mixed avg"]:
            vals = [self.mean_tps(n) if w == "mixed avg" else self.mean_tps(n, w) for n in names]
            line = f"{w:<12}" + "".join(f" {v:>14.1f}" for v in vals)
            if len(names) == 2:
                line += f" {_pct(vals[0], vals[1]):>8}"
            lines.append(line)
        lines.append("")
        head = f"{'Accepted length / acceptance':<30}" + "".join(f" {n[:20]:>20}" for n in names)
        lines += [head, "-" * len(head)]
        for w in self.workloads:
            cells = [
                f"{self.mean_of(n, w, 'mean_accepted_length'):.2f} / {100 * self.mean_of(n, w, 'acceptance_rate'):.0f}%"
                for n in names
            ]
            lines.append(f"{w:<30}" + "".join(f" {c:>20}" for c in cells))
        lines.append("")
        head = f"{'Output hash':<12}" + "".join(f" {n[:14]:>14}" for n in names)
        lines += [head, "-" * len(head)]
        for w in self.workloads:
            cells = [",".join(sorted(self.hashes(n, w))) for n in names]
            lines.append(f"{w:<12}" + "".join(f" {c:>14}" for c in cells))
        lines.append("")
        if any(a.sampling is not None for a in self.arms):
            lines.append(
                "sampled arms: left out of the text check (speculation keeps their distribution, not their text)"
            )
        lines.append("outputs identical across arms" if self.arms_agree else "WARNING: the arms' output texts differ")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "rounds": self.rounds,
            "max_new_tokens": self.max_new_tokens,
            "workloads": self.workloads,
            "arms": [
                {"name": a.name, "settings": a.settings.to_dict()}
                | ({"sampling": a.sampling.to_dict()} if a.sampling is not None else {})
                for a in self.arms
            ],
            "summary": {
                a.name: {
                    "mean_tokens_per_second": self.mean_tps(a.name),
                    "round_results": self.round_means(a.name),
                    "per_workload": {w: self.mean_tps(a.name, w) for w in self.workloads},
                }
                for a in self.arms
            },
            "arms_agree": self.arms_agree,
            "rows": [asdict(r) for r in self.rows],
            "meta": self.meta,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = list(BenchRow.__dataclass_fields__)
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        for r in self.rows:
            writer.writerow(asdict(r))
        return buf.getvalue()


def _pct(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.1f}%" if a > 0 else "n/a"


def output_hash(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]


def run_bench(
    engine,
    arms: list[BenchArm],
    workloads: list[str] | None = None,
    rounds: int = 2,
    max_new_tokens: int = 128,
    progress: Callable[[int, int, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    warmup: bool = True,
) -> BenchReport:
    workloads = list(workloads or WORKLOAD_NAMES)
    available = load_workloads()
    unknown = [w for w in workloads if w not in available]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    for a in arms:
        engine.check_settings(a.settings)
    report = BenchReport(arms, workloads, rounds, max_new_tokens, meta={"model": engine.info})
    total = rounds * len(workloads) * len(arms)
    done = 0
    session = engine.new_session()
    if warmup:  # one untimed full-length run per arm: its plans (CUDA graphs) get captured here
        for a in arms:
            session.reset()
            prompt = available[workloads[0]].prompt_for(engine.tokenizer)
            engine.generate(prompt, max_new_tokens, a.settings, session, sampling=a.sampling)
    for rnd in range(rounds):
        order = arms if rnd % 2 == 0 else list(reversed(arms))
        for w in workloads:
            prompt = available[w].prompt_for(engine.tokenizer)
            for a in order:
                if should_stop is not None and should_stop():
                    return report
                session.reset()
                res = engine.generate(prompt, max_new_tokens, a.settings, session, sampling=a.sampling)
                s = res.stats
                report.rows.append(
                    BenchRow(
                        a.name,
                        rnd,
                        w,
                        s["tokens_per_second"],
                        s["mean_accepted_length"],
                        s["acceptance_rate"],
                        s["generated"],
                        output_hash(res.tokens),
                    )
                )
                done += 1
                if progress is not None:
                    progress(done, total, f"round {rnd + 1}/{rounds} {w} {a.name}: {s['tokens_per_second']:.1f} t/s")
    return report
