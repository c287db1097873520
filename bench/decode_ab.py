"""Decode speed and launches of one tree, for before/after comparisons (tools/tree_ab.sh decode runs it from
two trees in one device call, interleaved): the 9B-like model target-only (bf16, gemm auto measured from
scratch, PDL as the engine defaults), the bundled model target-only and speculative (depth 5, chain), and the
kernels a 9B-like token launches (torch.profiler over captured rounds).

    python bench/decode_ab.py [--n 128] [--reps 3] [--model assets/models/specdeck-tiny] [--rule-ab] [--spec]
                              [--only 9b|bundled] [--norm-ab] [--one-launch-ab] [--exact] [--fold-min-keys 64,16]
                              [--norm-bound] [--mlp-ab] [--rmlp-coop-ab] [--mlp-times 4] [--defer-ab]
                              [--defer-next-ab] [--rmlp-balance-ab] [--defer-attn-ab] [--gemm-ab]

Prints one line per figure ("<what>: <value>"), t/s as the median of --reps generations. --rule-ab: each model's
figures with the delta-net's in_proj product and decode step in one launch and in two (Model.fuse_rule), in the
same process and with the same gemm choices, interleaved (one, two, one, two). --spec: the 9B-like model
speculative too (depth 3, chain, synthetic acceptance at Qwen3-Next's MTP rates: its random MTP head accepts
nothing on its own; the seeded draws accept the same in both trees), where the verify's 4-row products run.
--norm-ab: that speculative decode with auto's choices timed with the add + norm epilogue against choices timed on
the product alone, in one process. --one-launch-ab: target-only with auto's one-row choices against each epilogue
shape's fastest one-launch form (auto's own timings printed), in one process. --exact: only the 9B-like model
speculative (depth 3, chain, synthetic acceptance) in gemm mode "exact", whose verify runs the row-invariant
variant's fused add + norm form at 4 rows. --fold-min-keys: decode attention alone (T = 1 and 4, 128..32k keys)
and 9B-like target-only with the least keys a split takes (kernels.cuda._ATT_FOLD_MIN_KEYS and its _ONE_ROW, both
set) at each value, in one process, the list twice (each run a new session: its plans captured with that value).
--norm-bound: 9B-like target-only as is against the 64 add + norm epilogues of a token left out (a bound on any
design that moves the norm out of the projection before it). --mlp-ab: each model target-only (gemm auto) with the
MLP of one row as auto chose, in its separate launches, in one launch with the fastest per-launch variant auto
timed, and with the fastest resident one ("res": every block resident, kernels/cuda.py gemv_mlp_add_rmsnorm).
--rmlp-coop-ab: 9B-like target-only with the resident MLP's grid checked by one cooperative launch and then launched
as a plain PDL launch (the default), and with every launch cooperative, interleaved. --mlp-times K: auto's timing of
the one-row MLP's forms (engine/gemm.py _measure_mlp) K times over. --gemm-ab: the bundled model target-only and
speculative with gemm cublas and gemm auto (measured from scratch each time), three interleaved rounds (issue 20: the
launch-bound model no slower with the gemv kernels), each run saying whether its tokens are the first run's.
--defer-ab: 9B-like target-only with the norm after each output projection left to the resident MLP (Model.defer_norm,
the projection storing the residual stream only) and in the projection's launch, interleaved, with the launches.
--defer-next-ab: 9B-like target-only with the norm after each resident MLP left to the next delta-net layer's fused
in_proj launch (Model.defer_next: the MLP storing the residual stream only) and in the MLP's launch, interleaved.
--defer-attn-ab: 9B-like target-only with the norm after each resident MLP left to the next attention layer's qkv
product (Model.defer_attn: its input norm folded into qkv_packed, the qkv launch scaling its sums by the norm) and
in the MLP's launch, interleaved.
--rmlp-balance-ab: 9B-like target-only with the resident MLP's grid as few blocks as make its activation tiles in the
same rounds (kernels.cuda._RMLP_BALANCE) and every block that fits, interleaved, each run a new session.
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

from gpu_bench import QWEN3_NEXT_RATES, random_9b_engine  # noqa: E402
from timing import set_gemm_fresh  # noqa: E402

from engine import Engine, EngineSettings  # noqa: E402

PROMPT = list(range(100, 164))
# the 9B-like model speculative: depth 3, chain, synthetic acceptance at Qwen3-Next's MTP rates
SYN = EngineSettings(synthetic_rates=QWEN3_NEXT_RATES, draft_depth=3, chain=True, plan_pool=8)


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
    ap.add_argument("--spec", action="store_true", help="the 9B-like model speculative too (synthetic acceptance)")
    ap.add_argument("--only", choices=("9b", "bundled"), default=None, help="one model's figures only")
    ap.add_argument(
        "--one-launch-ab",
        action="store_true",
        help="9B-like target-only with auto's one-row choices against each epilogue shape's fastest one-launch form",
    )
    ap.add_argument(
        "--norm-ab",
        action="store_true",
        help="9B-like speculative with auto's choices timed with the add + norm epilogue and without, interleaved",
    )
    ap.add_argument(
        "--mlp-ab",
        action="store_true",
        help="9B-like target-only with the MLP of one row in one launch and in the launches it replaces",
    )
    ap.add_argument(
        "--norm-bound",
        action="store_true",
        help="9B-like target-only as is against the add + norm epilogues left out (a bound, not a model)",
    )
    ap.add_argument(
        "--boundary-ab",
        action="store_true",
        help="9B-like target-only with a pipelined round's advance and copy to the host in its plan and outside it",
    )
    ap.add_argument("--fold-min-keys", default=None, help="comma list of _ATT_FOLD_MIN_KEYS values to compare")
    ap.add_argument(
        "--rmlp-warps",
        default=None,
        help="comma list of the resident MLP's warps an SM (_RMLP_WARPS_PER_SM) to compare",
    )
    ap.add_argument(
        "--rmlp-coop-ab",
        action="store_true",
        help="9B-like target-only with the resident MLP's grid checked by one cooperative launch then launched plain,"
        " and with every launch cooperative, interleaved",
    )
    ap.add_argument("--defer-ab", action="store_true", help="A/B the norm deferred to the resident MLP")
    ap.add_argument("--defer-next-ab", action="store_true", help="A/B the norm after the MLP left to the next layer")
    ap.add_argument("--defer-attn-ab", action="store_true", help="A/B the norm after the MLP left to the qkv product")
    ap.add_argument("--rmlp-balance-ab", action="store_true", help="A/B the resident MLP's balanced grid")
    ap.add_argument("--gemm-ab", action="store_true", help="the bundled model with gemm cublas and auto, interleaved")
    ap.add_argument("--mlp-times", type=int, default=0, help="auto's MLP timing this many times over, printed")
    ap.add_argument(
        "--exact",
        action="store_true",
        help="only the 9B-like model speculative in gemm mode exact (its fused add + norm form at every row count)",
    )
    a = ap.parse_args()
    if a.att_combine is not None:
        from kernels import cuda as kc

        kc._ATT_COMBINE = a.att_combine
        print(f"attention combine: {a.att_combine}")
    if a.only != "bundled":
        nine_b(a)
    if a.only != "9b":
        bundled(a)
    return 0


def nine_b(a: argparse.Namespace) -> None:
    target = EngineSettings(speculative=False, plan_pool=8)
    eng = random_9b_engine()
    if a.exact:
        eng.model.set_gemm("exact")
        tps, _ = median_tps(eng, SYN, a.n, a.reps)
        print(f"9B-like spec depth 3 chain (synthetic rates), gemm exact: {tps:.1f} t/s")
    else:
        nine_b_auto(eng, a, target)
    eng.close()
    del eng
    torch.cuda.empty_cache()


def nine_b_auto(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    set_gemm_fresh(eng, "auto")
    if a.norm_ab:
        norm_ab(eng, a)
    if a.one_launch_ab:
        one_launch_ab(eng, a)
    if a.norm_bound:
        norm_bound(eng, a)
    if a.mlp_ab:
        mlp_ab(eng, a)
    if a.fold_min_keys:
        fold_min_keys_ab(eng, a, target)
    if a.boundary_ab:
        boundary_ab(eng, a, target)
    if a.rmlp_warps:
        rmlp_warps_ab(eng, a, target)
    if a.mlp_times:
        g = eng.model._gemv
        for _ in range(a.mlp_times):
            print(f"9B-like MLP timing (us per call): {g._measure_mlp(eng.model._mlp_pairs())}")
    if a.rmlp_coop_ab:
        rmlp_coop_ab(eng, a, target)
    if a.defer_ab:
        defer_ab(eng, a, target)
    if a.defer_next_ab:
        defer_next_ab(eng, a, target)
    if a.defer_attn_ab:
        defer_attn_ab(eng, a, target)
    if a.rmlp_balance_ab:
        tag = {True: "resident MLP grid balanced", False: "resident MLP grid: every block that fits"}.get
        cuda_setting_ab(eng, a, target, "_RMLP_BALANCE", [True, False] * 3, tag)
    for fused in (True, False, True, False) if a.rule_ab else (True,):
        eng.model.fuse_rule = fused
        tag = "" if not a.rule_ab else " [in_proj + step: one launch]" if fused else " [in_proj + step: two launches]"
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"9B-like target-only, gemm auto{tag}: {tps:.1f} t/s")
        print(f"9B-like launches per token, gemm auto{tag}: {launches_per_token(eng, target):.1f}")
    if a.spec:
        tps, _ = median_tps(eng, SYN, a.n, a.reps)
        print(f"9B-like spec depth 3 chain (synthetic rates), gemm auto: {tps:.1f} t/s")
    print("9B-like auto's choices: " + ", ".join(f"{k} {v}" for k, v in eng.model.gemm_choices.items()))


def norm_ab(eng: Engine, a: argparse.Namespace) -> None:
    """Speculative 9B-like decode (4-row verifies) with the choices of auto as the model makes them (the
    projections before add_rmsnorm timed with it) against choices timed on the product alone, one process,
    interleaved; each run a new session (its plans captured with the products then in use)."""
    from engine import gemm as gm

    m = eng.model
    with_norm = m._gemv
    with tempfile.TemporaryDirectory(prefix="specdeck-gemm-") as cache:
        plain = gm.gemv_products("auto", m.device, m.dtype, cache)
        gate_up = {tuple(t.shape) for name, t in m.w.items() if name.endswith("gate_up_packed")}
        plain.tune(m.product_weights(), activation=gate_up)
        plain.prepare_rule([t for name, t in m.w.items() if name.endswith("in_proj_packed")], m.cfg.linear_key_head_dim)
    for products, tag in ((with_norm, "timed with add+norm"), (plain, "timed alone")) * 2:
        m._gemv = products
        tps, _ = median_tps(eng, SYN, a.n, a.reps)
        print(f"9B-like spec depth 3 chain (synthetic rates), gemm auto [{tag}]: {tps:.1f} t/s")
    for products, tag in ((with_norm, "timed with add+norm"), (plain, "timed alone")):
        shown = {k: v for k, v in products.labels.items() if k.startswith(("4096x4096", "4096x12288"))}
        print(f"9B-like choices [{tag}]: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    m._gemv = with_norm


def one_launch_ab(eng: Engine, a: argparse.Namespace) -> None:
    """Target-only 9B-like decode with auto's one-row choices against the same choices where each shape with an
    epilogue (gate|up + silu_mul, the projections + add_rmsnorm) whose choice is more than one launch takes its
    fastest one-launch variant instead (from auto's own timings, printed): t/s and launches, interleaved."""
    from kernels import ops

    g = eng.model._gemv
    auto = dict(g.choices)
    forced = dict(auto)
    for (n, k, b), choice in auto.items():
        epilogue, times = g.epilogues.get((n, k)), g.timings.get((n, k, b), {})
        if b != 0 or epilogue is None or not times:
            continue
        one = [
            c for c in times if ops.parse_gemv_variant(c) and (epilogue == "norm" or ops.parse_gemv_variant(c)[2] == 1)
        ]
        print(
            f"{n}x{k} m1 + {epilogue}: auto {choice}; us " + ", ".join(f"{c} {t:.2f}" for c, t in sorted(times.items()))
        )
        if one and choice not in one:
            forced[(n, k, b)] = min(one, key=times.get)
            print(f"{n}x{k} m1 + {epilogue}: one launch {forced[(n, k, b)]}")
    target = EngineSettings(speculative=False, plan_pool=8)
    for choices, tag in ((auto, "auto's choices"), (forced, "one-launch forms")) * 2:
        g.choices = dict(choices)
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"9B-like target-only, gemm auto [{tag}]: {tps:.1f} t/s")
        print(f"9B-like launches per token, gemm auto [{tag}]: {launches_per_token(eng, target):.1f}")
    g.choices = auto


def mlp_ab(eng: Engine, a: argparse.Namespace, what: str = "9B-like") -> None:
    """Target-only decode (the 9B-like model, or `what`) with the MLP of one row in one launch (Model.fuse_mlp, auto's variant; its
    timings against the launches it replaces printed) and in those launches, interleaved, with the launches a
    token takes; each run a new session (its plans captured with the setting)."""
    m, g = eng.model, eng.model._gemv
    auto = dict(g.mlp_choices)
    forced, resident = dict(auto), dict(auto)
    for (n, k, b), times in g.timings.items():
        if b == -1:
            shown = ", ".join(f"{c} {t:.2f}" for c, t in sorted(times.items(), key=lambda ct: ct[1]))
            print(f"{what} {n}x{k} m1 mlp: auto {auto.get((n, k))}; us {shown}")
            one = [c for c in times if c != "cublas" and not c.startswith("res")]
            if one:
                forced[(n, k)] = min(one, key=times.get)
            res = [c for c in times if c.startswith("res")]
            if res:
                resident[(n, k)] = min(res, key=times.get)
    target = EngineSettings(speculative=False, plan_pool=8)
    cells = [(True, auto, "MLP as auto chose"), (False, auto, "MLP separate launches")]
    if forced != auto:
        cells.append((True, forced, "MLP one launch, " + ", ".join(sorted(set(forced.values())))))
    if resident != auto:
        cells.append((True, resident, "MLP resident, " + ", ".join(sorted(set(resident.values())))))
    for fused, choices, tag in cells * 2:
        m.fuse_mlp = fused
        g.mlp_choices = dict(choices)
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"{what} target-only, gemm auto [{tag}]: {tps:.1f} t/s")
        print(f"{what} launches per token, gemm auto [{tag}]: {launches_per_token(eng, target):.1f}")
    m.fuse_mlp = True
    g.mlp_choices = auto


def boundary_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings, what: str = "9B-like") -> None:
    """Target-only decode with a pipelined round's advance (its input token and position from the round before)
    and the copy of its results to the host captured in its verify plan (engine/spec.py ADVANCE_IN_PLAN) and as
    separate launches between the plans, interleaved, one process (the same gemm choices); each run's tokens against
    an unpipelined run's."""
    from engine import spec

    eng.pipeline_rounds = False
    _, want = median_tps(eng, target, a.n, 1)
    eng.pipeline_rounds = None
    _, again = median_tps(eng, target, a.n, 1)
    print(f"{what} boundary A/B: pipelined tokens == unpipelined: {again == want}")
    try:
        for _ in range(3):
            for inside in (True, False):
                spec.ADVANCE_IN_PLAN = inside
                tps, tokens = median_tps(eng, target, a.n, a.reps)
                first = next((i for i, (x, y) in enumerate(zip(tokens, want)) if x != y), None)
                print(
                    f"{what} target-only [{'advance + copy in the plan' if inside else 'outside'}]: {tps:.1f} t/s; "
                    f"tokens == unpipelined: {tokens == want}"
                    + ("" if first is None else f" (first difference at token {first})")
                )
    finally:
        spec.ADVANCE_IN_PLAN = True


def norm_bound(eng: Engine, a: argparse.Namespace) -> None:
    """What the 64 fused add + norm epilogues of a 9B-like token cost at most: target-only as the model runs
    against the projections before them made alone (their output taken as the next layer's input, the residual
    left as it was: wrong numbers, the same loads), with auto's choice and with the fastest unsplit variant of
    auto's timings, interleaved. An upper bound for any design that moves the norm out of the producer."""
    from kernels import ops

    m, g = eng.model, eng.model._gemv
    auto = dict(g.choices)
    unsplit = dict(auto)
    for (n, k, b), times in g.timings.items():
        if b == 0 and g.epilogues.get((n, k)) == "norm":
            s1 = [c for c in times if ops.parse_gemv_variant(c) and ops.parse_gemv_variant(c)[2] == 1]
            if s1:
                unsplit[(n, k, b)] = min(s1, key=times.get)
                print(
                    f"{n}x{k} m1: auto {auto[(n, k, b)]}, unsplit {unsplit[(n, k, b)]} ({times[unsplit[(n, k, b)]]:.2f} us with the norm)"
                )
    target = EngineSettings(speculative=False, plan_pool=8)

    def alone(x, w, residual, norm_weight, eps):
        return g(x, w), residual

    cells = (("as is", None, auto), ("products alone", alone, auto), ("products alone, unsplit", alone, unsplit))
    for tag, patch, choices in cells * 2:
        g.choices = dict(choices)
        m.fuse_mlp = patch is None  # the MLP's down product then goes through proj_add_norm too
        if patch is None:
            m.__dict__.pop("proj_add_norm", None)
        else:
            m.proj_add_norm = patch
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"9B-like target-only, gemm auto [{tag}]: {tps:.1f} t/s")
        print(f"9B-like launches per token, gemm auto [{tag}]: {launches_per_token(eng, target):.1f}")
    m.__dict__.pop("proj_add_norm", None)
    m.fuse_mlp = True
    g.choices = auto


def fold_min_keys_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    from attention_fold import fold_calls
    from attention_sweep import per_call_us

    from kernels import cuda as kc

    was = kc._ATT_FOLD_MIN_KEYS, kc._ATT_FOLD_MIN_KEYS_ONE_ROW
    values = [int(v) for v in a.fold_min_keys.split(",")]
    # decode attention alone (9B-like heads, bf16, device start as in a plan) over a 32768-slot cache
    for t, ctx, call in fold_calls():
        cells = []
        for v in values:
            kc._ATT_FOLD_MIN_KEYS = kc._ATT_FOLD_MIN_KEYS_ONE_ROW = v
            cells.append(f"min keys {v}: {per_call_us(call):.1f}")
        print(f"attention T={t} context {ctx} (us a call): " + ", ".join(cells))
    for v in values * 2:
        kc._ATT_FOLD_MIN_KEYS = kc._ATT_FOLD_MIN_KEYS_ONE_ROW = v
        tps, _ = median_tps(eng, target, a.n, a.reps)
        print(f"9B-like target-only, gemm auto [attention fold min keys {v}]: {tps:.1f} t/s")
    kc._ATT_FOLD_MIN_KEYS, kc._ATT_FOLD_MIN_KEYS_ONE_ROW = was


def rmlp_warps_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    """Target-only decode with the resident MLP's grid at each of --rmlp-warps warps an SM (its blocks a launch:
    the SMs times the blocks of that many warps that fit), interleaved."""
    values = [int(v) for v in a.rmlp_warps.split(",")] * 2
    resident_setting_ab(eng, a, target, "_RMLP_WARPS_PER_SM", values, lambda v: f"at most {v} warps an SM")


def rmlp_coop_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    """Target-only decode with the resident MLP's grid checked by one cooperative launch, then launched plain (the
    default, kernels.cuda._RMLP_COOPERATIVE "first": its blocks scheduled as the projection's leave) and with every
    launch cooperative (scheduled once the projection has drained), interleaved."""
    tag = {True: "every launch cooperative", "first": "first launch cooperative, then plain PDL"}
    resident_setting_ab(eng, a, target, "_RMLP_COOPERATIVE", ["first", True] * 3, tag.get)


def model_switch_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings, attr: str, tags: tuple) -> None:
    """Target-only decode with the Model switch `attr` on and off, interleaved (on, off three times; tags: what each
    is called), each run a new session (its plans captured with the setting), with the launches a token takes in the
    first two; the tokens of every run against the first's. The switch is left on."""
    m, first = eng.model, None
    try:
        for j, on in enumerate((True, False) * 3):
            setattr(m, attr, on)
            tag = tags[0] if on else tags[1]
            tps, tokens = median_tps(eng, target, a.n, a.reps)
            first = tokens if first is None else first
            print(
                f"9B-like target-only, gemm auto [{tag}]: {tps:.1f} t/s (tokens as the first run's: {tokens == first})"
            )
            if j < 2:
                print(f"9B-like launches per token, gemm auto [{tag}]: {launches_per_token(eng, target):.1f}")
    finally:
        setattr(m, attr, True)


def defer_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    """The norm after each layer's output projection deferred to the resident MLP and in the projection's launch
    (Model.defer_norm), model_switch_ab."""
    print("9B-like MLP choices: " + ", ".join(f"{k} {v}" for k, v in eng.model._gemv.mlp_choices.items()))
    model_switch_ab(eng, a, target, "defer_norm", ("norm deferred to the MLP", "norm in the projection"))


def folded_in(eng: Engine, kind: str) -> int:
    """The layers of `kind` whose input norm Model.fold_norms folded into their first product."""
    return sum(eng.model.cfg.layer_types[i] == kind for i in eng.model._folded_in)


def defer_next_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    """The norm after each resident MLP left to the next delta-net layer's fused in_proj launch (Model.defer_next)
    and made in the MLP's launch, model_switch_ab."""
    print(f"9B-like delta-net layers whose input norm is folded into in_proj: {folded_in(eng, 'linear_attention')}")
    model_switch_ab(eng, a, target, "defer_next", ("next norm in the in_proj launch", "next norm in the MLP"))


def defer_attn_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings) -> None:
    """The norm after each resident MLP left to the next attention layer's qkv product (Model.defer_attn: the MLP
    storing s only, the qkv launch scaling its sums by the norm) and made in the MLP's launch, model_switch_ab."""
    print(f"9B-like attention layers whose input norm is folded into qkv: {folded_in(eng, 'full_attention')}")
    model_switch_ab(eng, a, target, "defer_attn", ("next norm in the qkv launch", "next norm in the MLP"))


def cuda_setting_ab(
    eng: Engine, a: argparse.Namespace, settings: EngineSettings, name: str, values, tag, what: str = "9B-like"
) -> None:
    """Decode with `settings` at each of `values` of the kernels.cuda setting `name`, in that order, each run a new
    session (its plans captured with that value), a line each ("<what>, gemm auto [<tag(value)>]"); the tokens of
    every run against the first's. The setting is restored after."""
    from kernels import cuda as kc

    was, first = getattr(kc, name), None
    try:
        for v in values:
            setattr(kc, name, v)
            tps, tokens = median_tps(eng, settings, a.n, a.reps)
            first = tokens if first is None else first
            print(f"{what}, gemm auto [{tag(v)}]: {tps:.1f} t/s (tokens as the first run's: {tokens == first})")
    finally:
        setattr(kc, name, was)


def resident_setting_ab(eng: Engine, a: argparse.Namespace, target: EngineSettings, name: str, values, tag) -> None:
    """Target-only decode with the resident MLP (res2.w8.s1, whatever auto's timing took) at each of `values` of the
    kernels.cuda setting `name`, in that order, each run a new session (its plans captured with that value); the
    tokens of every run against the first's. The setting and auto's choices are restored after."""
    g = eng.model._gemv
    auto = dict(g.mlp_choices)
    print("9B-like MLP choices: " + ", ".join(f"{k} {v}" for k, v in auto.items()))
    g.mlp_choices = {key: "res2.w8.s1" for key in auto}  # the resident form whatever auto's timing took
    try:
        resident = lambda v: f"resident MLP res2.w8.s1, {tag(v)}"  # noqa: E731
        cuda_setting_ab(eng, a, target, name, values, resident, "9B-like target-only")
    finally:  # the runs after it (the plain target-only figure) as auto chose
        g.mlp_choices = auto


def bundled(a: argparse.Namespace) -> None:
    target = EngineSettings(speculative=False, plan_pool=8)
    tiny = Engine.load(Path(a.model), device="cuda", dtype="bfloat16")
    spec = EngineSettings(draft_depth=5, chain=True, plan_pool=8)
    for gemm in ("cublas", "auto") if a.rule_ab else ("cublas",):
        if gemm != "cublas":
            set_gemm_fresh(tiny, gemm)
        for fused in (True, False, True, False) if a.rule_ab and gemm != "cublas" else (True,):
            tiny.model.fuse_rule = fused
            tag = "" if gemm == "cublas" else f" [gemm {gemm}, in_proj + step: {'one launch' if fused else 'two'}]"
            tps, plain = median_tps(tiny, target, a.n, a.reps)
            print(f"bundled target-only{tag}: {tps:.1f} t/s")
            tps, drafted = median_tps(tiny, spec, a.n, a.reps)
            print(f"bundled spec depth 5 chain{tag}: {tps:.1f} t/s (tokens as target-only: {drafted == plain})")
            print(f"bundled launches per token, target-only{tag}: {launches_per_token(tiny, target):.1f}")
    if a.gemm_ab:
        gemm_ab(tiny, a, (("target-only", target), ("spec depth 5 chain", spec)))
    if a.boundary_ab:
        boundary_ab(tiny, a, target, "bundled")
    if a.mlp_ab:
        set_gemm_fresh(tiny, "auto")
        mlp_ab(tiny, a, "bundled")
    if a.rule_ab or a.mlp_ab:
        print("bundled auto's choices: " + ", ".join(f"{k} {v}" for k, v in tiny.model.gemm_choices.items()))
    tiny.close()


def gemm_ab(eng: Engine, a: argparse.Namespace, runs) -> None:
    """The bundled model's `runs` ((label, settings), ...) with gemm cublas and gemm auto, three interleaved rounds;
    auto measures its choices from scratch each time, as on a new GPU."""
    first: dict[str, list[int]] = {}
    for _ in range(3):
        for gemm in ("cublas", "auto"):
            set_gemm_fresh(eng, gemm)
            for label, settings in runs:
                tps, tokens = median_tps(eng, settings, a.n, a.reps)
                same = first.setdefault(label, tokens) == tokens
                print(f"bundled {label} [gemm {gemm}]: {tps:.1f} t/s (tokens as the first run's: {same})")


if __name__ == "__main__":
    raise SystemExit(main())
