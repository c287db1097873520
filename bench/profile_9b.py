"""Where a 9B-shape decode token's time goes: GEMMs vs everything else, and how fast each GEMM reads.

    python bench/profile_9b.py [--rounds 20] [--blas cublas,cublaslt]

1. Per weight shape of the 9B-like model: F.linear of one token ([1, K] x [N, K]^T) replayed from a CUDA
   graph, its read bandwidth against the device copy bandwidth, for each BLAS backend torch offers.
2. torch.profiler over `rounds` target-only decode rounds of the random 9B-shape engine: GPU time per token
   grouped by kernel, GEMM total vs the rest, and the kernel count per token.
3. --timeline: the same rounds profiled with programmatic dependent launch and without, one engine and one set of
   gemm choices: per kernel, its own duration (PDL off) and how much each of its launches moves the token's end
   (the time from the previous kernel's end to its end), with PDL and without; the difference is the time at that
   boundary in no kernel. Then the gaps (PDL off) by the pair of kernels around them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import random_9b_engine  # noqa: E402
from timing import copy_bandwidth, graph_time, kernel_times  # noqa: E402

from engine import EngineSettings  # noqa: E402

SHAPES = {  # name: (N, K, count per token)
    "full qkv_packed": (16 * 512 + 2 * 4 * 256, 4096, 8),
    "full o_proj": (4096, 16 * 256, 8),
    "linear in_proj_packed": (2 * 16 * 128 + 32 * 128 + 32 * 128 + 64, 4096, 24),
    "linear out_proj": (4096, 32 * 128, 24),
    "mlp gate_up_packed": (2 * 12288, 4096, 32),
    "mlp down_proj": (4096, 12288, 32),
    "lm_head": (32768, 4096, 1),
}


def gemv_table(bw: float, backends: list[str]) -> None:
    print(f"{'weight':<24} {'N x K':>13} {'x/tok':>5} " + " ".join(f"{b + ' us':>12} {'%bw':>5}" for b in backends))
    totals = dict.fromkeys(backends, 0.0)
    total_bytes = 0
    for name, (n, k, count) in SHAPES.items():
        # Distinct weights per call, as in the model (no L2 reuse between calls).
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        total_bytes += nbytes * count
        cells = []
        for b in backends:
            torch.backends.cuda.preferred_blas_library(b)
            i = [0]

            def call(ws=ws, x=x, i=i):
                F.linear(x, ws[i[0] % 4])
                i[0] += 1

            t = graph_time(call)
            totals[b] += t * count
            cells.append(f"{t * 1e6:>12.1f} {100 * nbytes / t / bw:>4.0f}%")
        print(f"{name:<24} {f'{n}x{k}':>13} {count:>5} " + " ".join(cells))
        del ws
    torch.backends.cuda.preferred_blas_library("cublas")
    for b in backends:
        print(
            f"all GEMMs of a token, {b}: {totals[b] * 1e3:.3f} ms = {100 * total_bytes / totals[b] / bw:.0f}% of copy bw"
            f" (bound {bw / total_bytes:.0f} t/s if nothing else ran)"
        )
    print()


GEMV_VARIANTS = ["linear", "mv", "W@x", "x@Wt", "linear noRPR", "linear M=2"]


def _variant_cells(n: int, k: int, bw: float) -> list[str]:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    wts = [w.t().contiguous() for w in ws]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)
    xc, xv = x.reshape(k, 1), x.reshape(k)
    calls = {
        "linear": lambda i: F.linear(x, ws[i]),
        "mv": lambda i: torch.mv(ws[i], xv),
        "W@x": lambda i: torch.matmul(ws[i], xc),
        "x@Wt": lambda i: torch.matmul(x, wts[i]),
        "linear noRPR": lambda i: F.linear(x, ws[i]),
        "linear M=2": lambda i: F.linear(x2, ws[i]),
    }
    cells = []
    for name in GEMV_VARIANTS:
        fn = calls[name]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = name != "linear noRPR"
        i = [0]

        def call(fn=fn, i=i):
            fn(i[0] % 4)
            i[0] += 1

        t = graph_time(call)
        cells.append(f"{t * 1e6:>7.1f} {100 * n * k * 2 / t / bw:>4.0f}%")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return cells


def gemv_variants(bw: float) -> None:
    """The same one-token product written the ways PyTorch offers, per weight shape (graph-timed)."""
    shapes = {k: v for k, v in SHAPES.items() if k in ("full o_proj", "linear in_proj_packed", "mlp down_proj")}
    print(f"{'weight':<24} " + " ".join(f"{n:>13}" for n in GEMV_VARIANTS) + "   (us, %bw)")
    for label, (n, k, _) in shapes.items():
        print(f"{label:<24} " + " ".join(_variant_cells(n, k, bw)))
    print()


ATT_SHAPES = {"9b": (16, 4, 256), "bundled": (6, 2, 64)}


def _attention_us(kc, impl: str, shape: str, t: int, ctx: int) -> float:
    hq, hkv, d = ATT_SHAPES[shape]
    kcache = torch.randn(2048, hkv, d, device="cuda", dtype=torch.bfloat16)
    vcache = torch.randn_like(kcache)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    start = torch.tensor([ctx - t], device="cuda")
    kc._ATT_IMPL = impl
    try:
        return graph_time(lambda: kc.attention_cached(q, kcache, vcache, start, d**-0.5)) * 1e6
    finally:
        kc._ATT_IMPL = "auto"


def attention_times() -> None:
    """attention_cached per call (us) for T query tokens at a few context lengths: the tiled kernel vs the
    per-row one, device start over a 2048-row cache (what a captured plan runs)."""
    import kernels.cuda as kc

    if not kc.available()[0]:
        return
    kc.warm_up("cuda", torch.bfloat16)
    print(f"{'shape':<8} {'T':>3} {'context':>8} {'tile us':>8} {'warp us':>8}")
    for shape in ATT_SHAPES:
        for t in (1, 4, 6, 9):
            for ctx in (96, 512, 2000):
                tile, warp = (_attention_us(kc, impl, shape, t, ctx) for impl in ("tile", "warp"))
                print(f"{shape:<8} {t:>3} {ctx:>8} {tile:>8.1f} {warp:>8.1f}")
    print()


def profile_rounds(rounds: int, gemm: str = "cublas", pdl: bool = True) -> None:
    eng = random_9b_engine()
    if not pdl:  # PDL is the default on sm_90+; before the gemm mode, so that "auto" times its candidates alike
        eng.set_model_option("pdl", False)
    eng.model.set_gemm(gemm)
    n, prof = _profiled(eng, rounds)
    by_name = kernel_times(prof)
    total = sum(v[0] for v in by_name.values()) / n
    gemm_us = sum(v[0] for k, v in by_name.items() if _is_gemm(k)) / n
    count = sum(v[1] for v in by_name.values()) / n
    print(
        f"== 9B-shape target-only, gemm {gemm}{', PDL' if pdl else ''}: {n} tokens; GPU busy {total / 1e3:.3f} ms/token; GEMM {gemm_us / 1e3:.3f} ms; "
        f"other {(total - gemm_us) / 1e3:.3f} ms; {count:.0f} kernels/token =="
    )
    print(f"{'us/token':>9} {'calls/tok':>9}  kernel")
    for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:28]:
        print(f"{t / n:>9.1f} {c / n:>9.1f}  {name[:110]}")
    print()


def _kernel_rows(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and copy of a finished profile, in start order (from its
    Chrome trace, which carries each kernel's start and duration)."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    rows = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(rows)


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:40]


def _profiled(eng, rounds: int):
    """(rounds, the finished torch.profiler run) of about `rounds` target-only rounds of `eng`, its plans captured
    before (a first generation) and the first round of the profiled stream outside the profile. The rounds
    returned are those whose kernels the profile holds, counted by their one embedding kernel each: the round
    pipelined behind the first one has already run when the profile starts (the synchronize), so the window holds
    one round fewer than the events it yields (dividing by the events put every per-token figure at 0.95 of a
    round's, before 2026-12-04)."""
    prompt = list(range(100, 164))
    sess = eng.new_session()
    s = EngineSettings(speculative=False, plan_pool=8)
    eng.generate(prompt, rounds + 4, s, sess)
    sess.reset()
    stream = eng.stream(prompt, rounds + 1, s, sess)
    next(stream)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = sum(1 for _ in stream)
        torch.cuda.synchronize()
    embeds = sum(1 for e in prof.events() if e.device_type.name == "CUDA" and e.name.startswith("embed_rmsnorm"))
    return embeds or n, prof


def timeline(rounds: int, gemm: str) -> None:
    """Where the time between kernels goes: see the module's docstring, 3."""

    eng = random_9b_engine()
    eng.model.set_gemm(gemm)
    runs = {}
    for pdl in (True, False):
        eng.set_model_option("pdl", pdl)
        n, prof = _profiled(eng, rounds)
        runs[pdl] = (n, _kernel_rows(prof))
    eng.close()
    timeline_report(runs, gemm)


def timeline_report(runs: dict[bool, tuple[int, list[tuple[float, float, str]]]], gemm: str) -> None:
    """Print the timeline of `runs` (PDL on/off -> tokens, kernel rows)."""
    from collections import defaultdict

    own: dict[str, list[float]] = defaultdict(list)  # name -> durations, PDL off
    moved: dict[bool, dict[str, list[float]]] = {True: defaultdict(list), False: defaultdict(list)}
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for pdl, (n, rows) in runs.items():
        span = rows[-1][1] - rows[0][0]
        busy = sum(e - s for s, e, _ in rows)
        print(
            f"== timeline, gemm {gemm}, PDL {'on' if pdl else 'off'}: {n} tokens, {len(rows) / n:.1f} kernels a token; "
            f"first start to last end {span / n:.1f} us a token, kernels' spans summed {busy / n:.1f} us =="
        )
        last_end = rows[0][1]
        for i, (start, end, name) in enumerate(rows):
            k = _short(name)
            if not pdl:
                own[k].append(end - start)
            if i:
                moved[pdl][k].append(end - last_end)
                if not pdl:
                    pairs[(_short(rows[i - 1][2]), k)].append(start - rows[i - 1][1])
            last_end = max(last_end, end)
    n = runs[True][0]
    print(
        f"{'kernel':<40} {'calls/tok':>9} {'own us':>8} {'moves PDL':>10} {'moves off':>10} {'no-kernel us/tok PDL':>21}"
    )
    lost = 0.0
    for k in sorted(own, key=lambda k: -sum(moved[True].get(k, [0.0]))):
        d = sum(own[k]) / len(own[k])
        on = moved[True].get(k, [])
        off = moved[False].get(k, [])
        if not on or not off:
            continue
        m_on, m_off = sum(on) / len(on), sum(off) / len(off)
        extra = (m_on - d) * len(on) / n
        lost += extra
        print(f"{k:<40} {len(on) / n:>9.1f} {d:>8.2f} {m_on:>10.2f} {m_off:>10.2f} {extra:>21.1f}")
    print(f"no-kernel time with PDL, summed: {lost:.1f} us a token")
    print(f"{'gaps, PDL off: before -> after':<70} {'count/tok':>9} {'mean us':>8} {'us/tok':>8}")
    for (a, b), g in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:20]:
        print(
            f"{a + ' -> ' + b:<70} {len(g) / runs[False][0]:>9.1f} {sum(g) / len(g):>8.2f} {sum(g) / runs[False][0]:>8.1f}"
        )
    print()


def _is_gemm(name: str) -> bool:
    low = name.lower()
    return any(
        s in low for s in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk", "cublas", "triton_tem", "_mm")
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--blas", default="cublas,cublaslt")
    ap.add_argument("--no-gemv", dest="gemv", action="store_false", help="skip the GEMM tables")
    ap.add_argument("--no-attention", dest="attention", action="store_false", help="skip the attention table")
    ap.add_argument("--gemm", default="cublas", help="GEMM backends to profile the decode with, comma list")
    ap.add_argument("--timeline", action="store_true", help="only the timeline of each --gemm backend (see 3. above)")
    ap.add_argument(
        "--no-pdl",
        dest="pdl",
        action="store_false",
        help="plans captured without programmatic dependent launch (under PDL a kernel's span includes its wait)",
    )
    a = ap.parse_args()
    if a.timeline:
        for gemm in a.gemm.split(","):
            timeline(a.rounds, gemm)
        return 0
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s")
    if a.gemv:
        gemv_table(bw, a.blas.split(","))
        gemv_variants(bw)
    if a.attention:
        attention_times()
    for gemm in a.gemm.split(","):
        profile_rounds(a.rounds, gemm, a.pdl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
