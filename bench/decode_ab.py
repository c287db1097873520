"""Decode speed and launches of one tree, for before/after comparisons (tools/tree_ab.sh decode runs it from
two trees in one device call, interleaved): the 9B-like model target-only (bf16, gemm auto measured from
scratch, PDL as the engine defaults), the bundled model target-only and speculative (depth 5, chain), and the
kernels a 9B-like token launches (torch.profiler over captured rounds).

    python bench/decode_ab.py [--n 128] [--reps 3] [--model assets/models/specdeck-tiny] [--rule-ab]

Prints one line per figure ("<what>: <value>"), t/s as the median of --reps generations. --rule-ab: each model's
figures with the delta-net's in_proj product and decode step in one launch and in two (Model.fuse_rule), in the
same process and with the same gemm choices, interleaved (one, two, one, two).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import random_9b_engine  # noqa: E402

from engine import Engine, EngineSettings  # noqa: E402

PROMPT = list(range(100, 164))


def median_tps(eng: Engine, settings: EngineSettings, n: int, reps: int, prompt=PROMPT) -> tuple[float, list[int]]:
    sess = eng.new_session()
    eng.generate(prompt, 16, settings, sess)  # warm: every plan captured
    runs, tokens = [], []
    for _ in range(reps):
        sess.reset()
        out = eng.generate(prompt, n, settings, sess)
        runs.append(out.stats["tokens_per_second"])
        tokens = out.tokens
    return statistics.median(runs), tokens


def launches_per_token(eng: Engine, settings: EngineSettings, n: int = 20) -> float:
    """Kernels (copies aside) of n more decoded tokens: a profiled generation of n + 1 tokens less one of 1 token
    (the prompt's prefill and the first token), over n."""
    sess = eng.new_session()
    eng.generate(PROMPT, n + 1, settings, sess)  # every plan captured

    def kernels(tokens: int) -> int:
        sess.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(PROMPT, tokens, settings, sess)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy"))

    return (kernels(n + 1) - kernels(1)) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="assets/models/specdeck-tiny")
    ap.add_argument("--att-combine", default=None, help="kernels.cuda _ATT_COMBINE for this run (fold, par)")
    ap.add_argument("--rule-ab", action="store_true", help="A/B the in_proj product + delta step fusion")
    a = ap.parse_args()
    if a.att_combine is not None:
        from kernels import cuda as kc

        kc._ATT_COMBINE = a.att_combine
        print(f"attention combine: {a.att_combine}")
    target = EngineSettings(speculative=False, plan_pool=8)
    eng = random_9b_engine()
    with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:
        eng.model.set_gemm("auto", cache_dir=cache)
    for fused in (True, False, True, False) if a.rule_ab else (True,):
        eng.model.fuse_rule = fused
        tag = "" if not a.rule_ab else " [in_proj + step: one launch]" if fused else " [in_proj + step: two launches]"
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"9B-like target-only, gemm auto{tag}: {tps:.1f} t/s")
        print(f"9B-like launches per token, gemm auto{tag}: {launches_per_token(eng, target):.1f}")
    print("9B-like auto's choices: " + ", ".join(f"{k} {v}" for k, v in eng.model.gemm_choices.items()))
    eng.close()
    del eng
    torch.cuda.empty_cache()
    tiny = Engine.load(Path(a.model), device="cuda", dtype="bfloat16")
    spec = EngineSettings(draft_depth=5, chain=True, plan_pool=8)
    for gemm in ("cublas", "auto") if a.rule_ab else ("cublas",):
        if gemm != "cublas":
            with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:
                tiny.model.set_gemm(gemm, cache_dir=cache)
        for fused in (True, False, True, False) if a.rule_ab and gemm != "cublas" else (True,):
            tiny.model.fuse_rule = fused
            tag = "" if gemm == "cublas" else f" [gemm {gemm}, in_proj + step: {'one launch' if fused else 'two'}]"
            tps, plain = median_tps(tiny, target, a.n, a.reps)
            print(f"bundled target-only{tag}: {tps:.1f} t/s")
            tps, drafted = median_tps(tiny, spec, a.n, a.reps)
            print(f"bundled spec depth 5 chain{tag}: {tps:.1f} t/s (tokens as target-only: {drafted == plain})")
            print(f"bundled launches per token, target-only{tag}: {launches_per_token(tiny, target):.1f}")
    if a.rule_ab:
        print("bundled auto's choices: " + ", ".join(f"{k} {v}" for k, v in tiny.model.gemm_choices.items()))
    tiny.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
