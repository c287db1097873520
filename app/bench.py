"""A/B benchmarks on the fixed workloads, printed in the llama.cpp PR #27173 table format
(Config / Round results / Mean, then one row per workload with the change).

Arms run alternately (A,B then B,A in the next round) on a fresh session each time, so neither arm
profits from the other's warm state; each arm gets one untimed warm-up first. Generation tokens/s
counts decode rounds only (prefill excluded), as llama.cpp's server timings do. The CLI
(`specdeck bench`) and the app's bench tab both call `run_bench`.

Every figure comes with the spread of its repeats (min / median / max over the rounds), and a
difference whose ranges overlap is called "no clear difference", never a win: on a busy or
oversubscribed CPU the same A/B can change sign from one run to the next.

Synthetic acceptance (`--synthetic-rates`, the Bench tab's field, or a bench profile): the arms draft and verify
as usual but accept as many drafts as the rates draw, so the figures measure speed at those rates and the text
is not the model's output. The report says so first (SYNTHETIC_BANNER), marks every row and leaves those arms
out of the text check.
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

from engine.sampling import SamplingParams
from engine.settings import EngineSettings

from .workloads import WORKLOAD_NAMES, load_workloads

SYNTHETIC_BANNER = "SYNTHETIC ACCEPTANCE — figures measure speed only, the text is not the model's output"


def parse_synthetic_rates(text: str) -> tuple[float, ...]:
    """'0.87,0.78,0.68' -> (0.87, 0.78, 0.68): the rate of each draft position (the last one continuing); empty
    text -> () (off). A ValueError names the bad value."""
    parts = [p.strip() for p in str(text).replace(" ", ",").split(",") if p.strip()]
    rates = []
    for i, part in enumerate(parts):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(
                f"synthetic rate {part!r} (position {i + 1}) is not a number; give rates in 0..1"
            ) from None
        if not 0.0 <= rate <= 1.0:  # NaN fails this too
            raise ValueError(f"synthetic rate {part!r} (position {i + 1}) is not in 0..1")
        rates.append(rate)
    EngineSettings(synthetic_rates=tuple(rates))  # the count limit, said the engine's way
    return tuple(rates)


def rates_text(rates: tuple[float, ...]) -> str:
    """(0.87, 0.78) -> '0.87, 0.78 (then 0.78)': the rates and what deeper positions take."""
    return ", ".join(f"{r:g}" for r in rates) + f" (then {rates[-1]:g})" if rates else "off"


def compare_ranges(va: list[float], vb: list[float]) -> str:
    """B against A from their repeats: 'faster' / 'slower' when B's range lies wholly above / below A's, else
    'no clear difference' (one repeat has no spread: 'one round, no spread')."""
    if not va or not vb:
        return "not measured"
    if len(va) < 2 or len(vb) < 2:
        return "one round, no spread"
    if min(vb) > max(va):
        return "faster"
    if max(vb) < min(va):
        return "slower"
    return "no clear difference"


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
    synthetic: bool = False  # synthetic acceptance: speed only, the text is not the model's output


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
        """Mean generation t/s over the workloads, per round (the 'Round results' column)."""
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

    def round_values(self, arm: str, workload: str | None = None) -> list[float]:
        """One figure per round: the workload's t/s, or (workload None) the mean over the workloads."""
        if workload is None:
            return self.round_means(arm)
        return [r.tokens_per_second for r in sorted(self._rows(arm, workload), key=lambda r: r.round)]

    def spread(self, arm: str, workload: str | None = None) -> tuple[float, float, float]:
        """(min, median, max) of the per-round figures; NaNs when nothing was measured."""
        values = self.round_values(arm, workload)
        if not values:
            return (float("nan"),) * 3
        return min(values), statistics.median(values), max(values)

    def verdict(self, a: str, b: str, workload: str | None = None) -> str:
        """'faster' / 'slower' when B's per-round range lies wholly above / below A's, else
        'no clear difference'. One round has no spread: 'one round, no spread'."""
        return compare_ranges(self.round_values(a, workload), self.round_values(b, workload))

    @property
    def synthetic(self) -> bool:
        """Some arm ran with synthetic acceptance: the figures measure speed, not the model's output."""
        return any(a.settings.synthetic for a in self.arms)

    def hashes(self, arm: str, workload: str) -> set[str]:
        return {r.output_hash for r in self._rows(arm, workload)}

    @property
    def arms_agree(self) -> bool:
        """Every greedy arm produced the same text on every workload (speculation must never change text).
        Sampled arms are left out: speculation keeps their distribution, not their text; so are synthetic arms,
        whose text is not the model's output."""
        for w in self.workloads:
            seen = set()
            for a in self.arms:
                if (a.sampling is not None and not a.sampling.greedy) or a.settings.synthetic:
                    continue
                seen |= self.hashes(a.name, w)
            if len(seen) > 1:
                return False
        return True

    # ---- output ---------------------------------------------------------------------------------
    def format_tables(self) -> str:
        lines: list[str] = []
        if self.synthetic:
            lines.append(SYNTHETIC_BANNER)
            for a in self.arms:
                lines.append(f"  {a.name}: synthetic acceptance rates {rates_text(a.settings.synthetic_rates)}")
            lines.append("")
        threads = self.meta.get("cpu_threads")
        if threads is not None:
            source = self.meta.get("cpu_threads_source")
            lines.append(
                f"CPU threads: {threads}" + (f" ({source})" if source else "") + f"; {self.rounds} round(s) x "
                f"{len(self.workloads)} workload(s) x {self.max_new_tokens} tokens per arm, arms alternating"
            )
            lines.append("")
        order = (self.meta.get("model") or {}).get("sub_vocab_order") or {}
        if order.get("size"):
            k, source = order["size"], order.get("source") or "no source given"
            lines += [f"Sub-vocab order: {k:,} ids ({source}); arms with sub_vocab 1..{k} draft through it", ""]
        elif order.get("notice"):
            lines += [f"Sub-vocab order: none, ids in id order ({order['notice']})", ""]
        names = [a.name for a in self.arms]
        width = max([6, *(len(n) for n in names)])  # arm names are never cut, the columns follow them
        rr_width = max([len("Round results"), *(len(self._round_text(n)) for n in names)])
        head = f"{'Config':<{width}}  {'Depth':>5}  {'Round results':<{rr_width}}  {'Mean':>8}  {'Min':>8}  {'Median':>8}  {'Max':>8}"
        lines += [head, "-" * len(head)]
        for a in self.arms:
            depth = a.settings.draft_depth if a.settings.speculative else 0
            lo, med, hi = self.spread(a.name)
            lines.append(
                f"{a.name:<{width}}  {depth:>5}  {self._round_text(a.name):<{rr_width}}  {self.mean_tps(a.name):>8.1f}"
                f"  {lo:>8.1f}  {med:>8.1f}  {hi:>8.1f}"
            )
        lines.append("")
        col = max(14, *(len(n) for n in names))
        two = len(names) == 2
        head = f"{'Category':<12}" + "".join(f"  {n:>{col}}" for n in names)
        if two:
            head += f"  {'Change':>8}  {'Verdict (spread of the rounds)':<30}"
        lines += [head, "-" * len(head)]
        for w in [*self.workloads, "mixed avg"]:
            wl = None if w == "mixed avg" else w
            vals = [self.mean_tps(n, wl) for n in names]
            line = f"{w:<12}" + "".join(f"  {v:>{col}.1f}" for v in vals)
            if two:
                line += f"  {_pct(vals[0], vals[1]):>8}  {self.verdict(names[0], names[1], wl):<30}"
            lines.append(line.rstrip())
        lines.append("")
        col = max(20, *(len(n) for n in names))
        head = f"{'Accepted length / acceptance':<30}" + "".join(f"  {n:>{col}}" for n in names)
        lines += [head, "-" * len(head)]
        for w in self.workloads:
            cells = [
                f"{self.mean_of(n, w, 'mean_accepted_length'):.2f} / {100 * self.mean_of(n, w, 'acceptance_rate'):.0f}%"
                for n in names
            ]
            lines.append(f"{w:<30}" + "".join(f"  {c:>{col}}" for c in cells))
        lines.append("")
        col = max(14, *(len(n) for n in names))
        head = f"{'Output hash':<12}" + "".join(f"  {n:>{col}}" for n in names)
        lines += [head, "-" * len(head)]
        for w in self.workloads:
            cells = [",".join(sorted(self.hashes(n, w))) for n in names]
            lines.append(f"{w:<12}" + "".join(f"  {c:>{col}}" for c in cells))
        lines.append("")
        if any(a.sampling is not None for a in self.arms):
            lines.append(
                "sampled arms: left out of the text check (speculation keeps their distribution, not their text)"
            )
        if self.synthetic:
            lines.append("synthetic arms: left out of the text check (their text is not the model's output)")
        if not self.arms_agree:
            lines.append("WARNING: the arms' output texts differ")
        elif not self.synthetic:  # with synthetic arms left out, "identical" would claim more than was checked
            lines.append("outputs identical across arms")
        if two:
            lines.append(self.summary_line())
        return "\n".join(lines)

    def _round_text(self, arm: str) -> str:
        return ", ".join(f"{v:.1f}" for v in self.round_means(arm))

    def summary_line(self) -> str:
        """One sentence on B vs A over the mixed average, with the spread it is judged by."""
        a, b = self.arms[0].name, self.arms[1].name
        alo, _, ahi = self.spread(a)
        blo, _, bhi = self.spread(b)
        change = _pct(self.mean_tps(a), self.mean_tps(b))
        ranges = f"{a}: {alo:.1f}-{ahi:.1f} t/s, {b}: {blo:.1f}-{bhi:.1f} t/s over {self.rounds} round(s)"
        verdict = self.verdict(a, b)
        if verdict in ("faster", "slower"):
            return f"{b} is {verdict} than {a}: {change} ({ranges}; the ranges do not overlap)"
        if verdict == "no clear difference":
            return f"no clear difference between {a} and {b}: {change} is inside the spread ({ranges})"
        return f"{b} vs {a}: {change}; {verdict} (use --rounds 3 or more for a verdict)"

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
                    "spread": dict(zip(("min", "median", "max"), self.spread(a.name))),
                    "per_workload": {w: self.mean_tps(a.name, w) for w in self.workloads},
                }
                for a in self.arms
            },
            "synthetic": self.synthetic,
            "arms_agree": self.arms_agree,
            "verdict": self.verdict(self.arms[0].name, self.arms[1].name) if len(self.arms) == 2 else None,
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
    import torch

    meta: dict[str, Any] = {"model": engine.info, "cpu_threads": torch.get_num_threads()}
    report = BenchReport(arms, workloads, rounds, max_new_tokens, meta=meta)
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
                        synthetic=bool(s["synthetic"]),
                    )
                )
                done += 1
                if progress is not None:
                    progress(done, total, f"round {rnd + 1}/{rounds} {w} {a.name}: {s['tokens_per_second']:.1f} t/s")
    return report
