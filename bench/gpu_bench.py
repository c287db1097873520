"""GPU benchmarks of issue 10, every figure a ratio measured side by side in this one run.

  python bench/gpu_bench.py [--model DIR] [--sections copy,a,b,c,d,bf16,s,auto,ctx,real,gemv,gemv-table,pdl,overlap] [--ctx 1024,8192,32768,131072] [--n 128] [--out FILE]

copy  device-to-device copy bandwidth (2 x bytes / time: read + write), the yardstick for (d)
a     bundled model, target-only: SpecDeck vs transformers `generate` (same weights, dtype, greedy)
b     each knob: chain off vs on at depths 3/5/8; sub_vocab full vs 25% vs 50%; plan_pool 1 vs depth+1
      (p_min 0.5)
c     the best speculative configuration of (b) vs target-only, per workload, in the seed's table format
d     a random model of Qwen3.5-9B-like shapes built in memory (bf16), target-only: weight bytes read per
      token / time per token, against the copy bandwidth
bf16  speculative vs target-only in bf16: first divergence per workload and the top-2 logit gap there
gemv  issue 20: the gemv kernels vs cuBLAS per 9B-like product at 1 and 6 rows (us and % of copy bandwidth),
      each product with its epilogue (gate|up + silu_mul, o_proj/down + add_rmsnorm) fused vs cuBLAS + the
      epilogue's kernel, then (d) with --gemm cublas, cupy and auto side by side (gemv-table: without (d))
pdl   issue 20: programmatic dependent launch off vs on, plans captured each way, 9B-like (cublas, auto) and
      the bundled model (target-only, speculative), with whether the tokens are the same
s     sampling (issue 17): speculative sampling vs target-only sampling at the same temperature (0.7, 1.0, and
      Qwen's card: 0.6 / top-k 20 / top-p 0.95), bundled model bf16, chain on, depths 3/5/8, best depth;
      mean t/s of the four workloads x 2 seeds
overlap  rounds queued ahead (Engine.overlap_rounds, Engine.pipeline_rounds): off, the next round queued once this
      one is read, and rounds pipelined (queued before the one ahead is read: target-only and chained drafts,
      greedy or sampled, static or adaptive depth): bundled target-only / depth 5 chain (greedy, T 0.7) / auto,
      9B-like target-only and depth 3 with synthetic acceptance (gemm auto); whether the tokens are the same
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.bench import BenchArm, compare_ranges, run_bench  # noqa: E402
from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings, SamplingParams  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.loader import FP32_SUFFIXES, expected_shapes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copy_bandwidth, set_gemm_fresh  # noqa: E402

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def save(path: str | None) -> None:
    """Write everything `say` printed to `path` (when given)."""
    if path:
        Path(path).write_text("\n".join(LINES) + "\n")


def workload_prompts(eng: Engine) -> list:
    """The four workloads' prompts for this engine's tokenizer (chat template applied when it has one)."""
    return [w.prompt_for(eng.tokenizer) for w in load_workloads().values()]


def run_prompts(
    eng: Engine,
    settings: EngineSettings,
    n: int,
    prompts: list,
    warm_n: int = 16,
    after_warm_up=None,
    sampling: list | None = None,
) -> list[dict]:
    """Run stats of `n` new tokens from each prompt, on one session reset in between, after a warm-up run
    on the first prompt (which captures the plans); `after_warm_up()` is called between the two.
    `sampling`: one SamplingParams per prompt (None: greedy)."""
    sess = eng.new_session()
    eng.generate(prompts[0], warm_n, settings, sess, sampling=sampling[0] if sampling else None)
    if after_warm_up is not None:
        after_warm_up()
    out = []
    for i, prompt in enumerate(prompts):
        sess.reset()
        out.append(eng.generate(prompt, n, settings, sess, sampling=sampling[i] if sampling else None).stats)
    return out


def mean_tps(eng: Engine, settings: EngineSettings, n: int, reps: int = 1) -> tuple[float, dict]:
    """Mean generation t/s over the four workloads (fresh session each run, one warm-up)."""
    runs = run_prompts(eng, settings, n, workload_prompts(eng) * reps)
    return statistics.fmean(r["tokens_per_second"] for r in runs), {
        "accepted_length": statistics.fmean(r["mean_accepted_length"] for r in runs),
        "last": runs[-1],
    }


def section_a(model_dir: Path, n: int) -> None:
    say("== (a) bundled model, target-only: SpecDeck vs transformers generate (bf16, greedy) ==")
    eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
    ours, _ = mean_tps(eng, EngineSettings(speculative=False, plan_pool=8), n)
    from transformers import Qwen3_5ForCausalLM

    ref = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    wl = load_workloads()
    tps = []
    n_hf = min(n, 64)
    for w in wl.values():
        ids = torch.tensor([eng.tokenizer.encode(w.prompt)], device="cuda")
        ref.generate(ids, max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ref.generate(ids, max_new_tokens=n_hf, min_new_tokens=n_hf, do_sample=False)
        torch.cuda.synchronize()
        tps.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
    hf = statistics.fmean(tps)
    say(f"SpecDeck target-only   {ours:10.1f} t/s")
    say(f"transformers generate  {hf:10.1f} t/s   (includes its prefill; {n_hf} new tokens)")
    say(f"ratio                  {ours / hf:10.1f} x")
    say()
    del ref
    torch.cuda.empty_cache()


def section_b(eng: Engine, n: int) -> EngineSettings:
    say("== (b) each knob (bundled model, bf16, mean of the four workloads) ==")
    best, best_tps = None, 0.0
    say(f"{'depth':>5} {'chain off t/s':>14} {'chain on t/s':>13} {'on/off':>7} {'acc.len':>8}")
    for depth in (3, 5, 8):
        off, _ = mean_tps(eng, EngineSettings(draft_depth=depth, chain=False, plan_pool=8), n)
        on, info = mean_tps(eng, EngineSettings(draft_depth=depth, chain=True, plan_pool=8), n)
        say(f"{depth:>5} {off:>14.1f} {on:>13.1f} {on / off:>6.2f}x {info['accepted_length']:>8.2f}")
        if on > best_tps:
            best, best_tps = EngineSettings(draft_depth=depth, chain=True, plan_pool=8), on
    vocab = eng.cfg.vocab_size
    say()
    say(f"{'sub_vocab':>10} {'t/s':>10} {'acc.len':>8}   (chain on, depth {best.draft_depth})")
    full = None
    for frac in (0, 0.5, 0.25):
        sub = int(vocab * frac)
        s = best.replace(sub_vocab=sub)
        tps, info = mean_tps(eng, s, n)
        full = full or tps
        say(f"{sub or 'full':>10} {tps:>10.1f} {info['accepted_length']:>8.2f}   {tps / full:.3f}x of full")
        if tps > best_tps:
            best, best_tps = s, tps
    say()
    depth = 5
    say(f"plan_pool with p_min 0.5, depth {depth}, chain on (catch-up widths vary 1..depth+1):")
    say(f"{'pool':>5} {'t/s':>10} {'hits':>6} {'misses':>7} {'capture s':>10}")
    base = None
    for pool in (1, depth + 1):
        s = EngineSettings(draft_depth=depth, chain=True, p_min=0.5, plan_pool=pool)
        tps, info = mean_tps(eng, s, n)
        st = info["last"]
        base = base or tps
        say(
            f"{pool:>5} {tps:>10.1f} {st['plan_hits']:>6} {st['plan_misses']:>7} {st['plan_capture_s']:>10.3f}   {tps / base:.2f}x"
        )
    say()
    say(f"best speculative configuration: {best.to_dict()}  ({best_tps:.1f} t/s)")
    say()
    return best


def section_c(eng: Engine, best: EngineSettings, n: int) -> None:
    say("== (c) best speculative configuration vs target-only, per workload (seed's tables) ==")
    arms = [BenchArm("target-only", EngineSettings(speculative=False, plan_pool=8)), BenchArm("best spec", best)]
    report = run_bench(eng, arms, rounds=2, max_new_tokens=n)
    say(report.format_tables())
    say()


class IdsOnly:
    """The random model has no tokenizer: prompts are token ids and nothing is decoded."""

    eos_token_ids = frozenset()
    eos_token_id = None
    chat_template = None

    def decode(self, ids):
        return ""

    def encode(self, text):
        raise ValueError("token ids only")


RANDOM_9B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 32768,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def random_9b_weights(device: torch.device, overrides: dict | None = None):
    """(cfg, weights, has_mtp) of a random model of Qwen3.5-9B-like shapes (bf16), built on `device` from a
    fixed seed: every process that calls it gets the same weights (a worker rank builds its own copy)."""
    cfg = ModelConfig.from_dict(RANDOM_9B | (overrides or {}))
    target, mtp = expected_shapes(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    w = {}
    for name, shape in (target | mtp).items():
        if name.endswith("A_log"):
            w[name] = torch.log(torch.rand(shape, device=device, generator=g) * 8 + 0.5)
        elif name.endswith(FP32_SUFFIXES):  # kept in fp32, as the loader keeps them
            t = torch.randn(shape, device=device, generator=g, dtype=torch.float32) * 0.05
            w[name] = t + 1 if "linear_attn.norm" in name else t
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
            w[name] = t.mul_(fan_in**-0.5) if len(shape) > 1 and "embed" not in name else t
    for name in list(w):
        if name.endswith("conv1d.weight"):  # [C, 1, K] -> [C, K], as load_weights returns it
            w[name] = w[name][:, 0, :].contiguous()
    return cfg, w, bool(mtp)


# The exact Qwen3.5-9B text shapes: its real 248,320-id vocabulary (an untied 2 GB LM head) and one MTP layer.
REAL_9B = {"vocab_size": 248320, "mtp_num_hidden_layers": 1}
# Qwen3-Next's published MTP acceptance for draft positions 1..3, then 0.05 less a position (our extension),
# used as each position's acceptance given the ones before it.
QWEN3_NEXT_RATES = (0.873, 0.778, 0.675, 0.6, 0.55, 0.5, 0.45, 0.4)


def random_9b_weights_fp32(device: torch.device, overrides: dict | None = None):
    """The same random 9B-like model in fp32 (for checks that must not depend on bf16 rounding)."""
    cfg, w, has_mtp = random_9b_weights(device, overrides)
    return cfg, {k: v.float() for k, v in w.items()}, has_mtp


def random_9b_engine(devices: list[str] | None = None, max_context: int = 2048, mtp: bool = False) -> Engine:
    """A random model of Qwen3.5-9B-like shapes, built in memory (bf16); split over `devices` if several
    (one process per device, each building its own shard). `mtp`: with a (random) one-layer MTP head."""
    devs = [torch.device(d) for d in devices] if devices else [torch.device("cuda")]
    args = ({"mtp_num_hidden_layers": 1},) if mtp else ()
    eng = Engine.from_factory(random_9b_weights, args, IdsOnly(), Path("random-9b-shape"), max_context, devs)
    torch.cuda.empty_cache()
    return eng


def section_d(bandwidth: float, modes: tuple[str, ...] = ("cublas", "autotune")) -> None:
    say("== (d) Qwen3.5-9B-like shapes (random, bf16, in memory), target-only decode ==")
    eng = random_9b_engine()
    params = sum(t.numel() for t in eng.model.w.values())
    weight_bytes = sum(t.numel() * t.element_size() for t in eng.model.w.values())
    embed = eng.model.w["embed_tokens.weight"]
    read_per_token = weight_bytes - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()
    prompt = list(range(100, 164))
    s = EngineSettings(speculative=False, plan_pool=8)
    say(f"parameters               {params / 1e9:.2f} B")
    say(f"weight bytes read/token  {read_per_token / 1e9:.2f} GB")
    say(f"copy-bandwidth bound     {bandwidth / read_per_token:.1f} t/s")
    say(f"{'gemm':<9} {'t/s':>8} {'ms/token':>9} {'TB/s':>6} {'% of copy bw':>13} {'first use s':>12} {'set s':>6}")
    cache = tempfile.mkdtemp(prefix="specdeck-gemm-")  # "auto" measures from scratch: its whole cost shows
    for mode in modes:
        t_set = time.perf_counter()
        try:
            eng.model.set_gemm(mode, cache_dir=cache)
        except EngineError as e:
            say(f"{mode:<9} unavailable: {e}")
            continue
        t_set = time.perf_counter() - t_set
        if eng.model.gemm_notice:
            say(f"{mode:<9} notice: {eng.model.gemm_notice}")
        sess = eng.new_session()
        t0 = time.perf_counter()
        eng.generate(prompt, 16, s, sess)  # warm: compiles (autotune) and captures every plan
        first = time.perf_counter() - t0
        sess.reset()
        tps = eng.generate(prompt, 128, s, sess).stats["tokens_per_second"]
        achieved = read_per_token * tps
        say(
            f"{mode:<9} {tps:>8.1f} {1000 / tps:>9.2f} {achieved / 1e12:>6.2f} {100 * achieved / bandwidth:>12.0f}%"
            f" {first:>12.1f} {t_set:>6.1f}"
        )
        del sess
    if eng.model.gemm == "auto":
        say("auto's choices: " + ", ".join(f"{k} {v}" for k, v in eng.model.gemm_choices.items()))
    shutil.rmtree(cache, ignore_errors=True)
    say()
    del eng
    torch.cuda.empty_cache()


# The 9B-like model's products [N, K] (RANDOM_9B): attention qkv|gate (16 heads x 256 x 2 + k, v of 4 x 256),
# o_proj and the delta-net out_proj (4096 x 4096), the delta-net in_proj (qkv 8192 | z 4096 | b 32 | a 32),
# MLP gate|up and down, the MTP head's fc, and the LM head at 32k (RANDOM_9B) and 248k (Qwen3.5-9B) rows.
GEMV_SHAPES = {
    "attn qkv|gate": (16 * 256 * 2 + 2 * 4 * 256, 4096),
    "o_proj/out_proj": (4096, 4096),
    "delta in_proj": (2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32, 4096),
    "mlp gate|up": (2 * 12288, 4096),
    "mlp down": (4096, 12288),
    "mtp fc": (4096, 8192),
    "lm_head 32k": (32768, 4096),
    "lm_head 248k": (248320, 4096),
}


@contextlib.contextmanager
def pdl_captures(on: bool):
    """Graphs captured inside are captured with programmatic dependent launch (on) or without; the process's
    setting before is restored after."""
    from kernels import cuda as C

    before = C._PDL
    C.set_pdl(on)
    try:
        yield
    finally:
        C.set_pdl(before)


def section_gemv(bandwidth: float, decode: bool = True) -> None:
    """The gemv kernels against cuBLAS per 9B-like product, 1 and 6 rows, bf16: each timed as gemm "auto" times
    it (graph replays over distinct weights past L2; engine/gemm.py), with the graph captured without and with
    programmatic dependent launch (with it, each product's first W loads are in flight while the product before
    it drains); % of copy bandwidth = (bytes of W + x + out) / time / copy bandwidth. The MLP's gate|up product
    with its activation in one launch against the two launches. Then the 9B-like target-only decode with --gemm
    cublas, cupy and auto (not with section "gemv-table")."""
    from engine.gemm import GemvProducts
    from kernels import cuda as C
    from kernels import ops

    say("== gemv: 9B-like products, bf16, 1 and 6 rows: gemv kernels vs cuBLAS (graph-timed, distinct weights) ==")
    ops.use_cuda_kernels(True)
    tuner = GemvProducts("auto", torch.device("cuda"), torch.bfloat16, None)
    if not tuner.ok:
        say(f"gemv kernels unavailable: {tuner.notice}")
        return
    with pdl_captures(True):
        pdl_ok = C._PDL
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    say(
        f"{'product':<16} {'N x K':>12} {'M':>2} {'best, no PDL':>12} {'us':>7} {'%bw':>4} {'best, PDL':>12} {'us':>7}"
        f" {'%bw':>4} {'cuBLAS us':>9} {'%bw':>4} {'auto (PDL)':>12}"
    )
    fused_rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        each = n * k * 2
        count = max(2, min(8, -(-3 * l2 // each)))
        try:
            ws = [(torch.randn(n, k, device="cuda") * k**-0.5).bfloat16() for _ in range(count)]
        except torch.OutOfMemoryError:
            say(f"{name:<16} does not fit")
            continue
        for m in (1, 6):
            moved = each + m * k * 2 + m * n * 2
            found = {}
            for pdl in (False, True) if pdl_ok else (False,):
                with pdl_captures(pdl):
                    found[pdl] = tuner._measure(m, n, k, ws)

            def cell(t, moved=moved, width=7):
                if not t:
                    return f"{'-':>{width}} {'-':>4}"
                return f"{t:>{width}.1f} {100 * moved / (t * 1e-6) / bandwidth:>3.0f}%"

            cols = []
            for pdl in (False, True):
                if pdl not in found:
                    cols.append(f"{'-':>12} {cell(0)}")
                    continue
                times = found[pdl][1]
                kernels = {c: t for c, t in times.items() if c != "cublas"}
                top = min(kernels, key=kernels.get) if kernels else "-"
                cols.append(f"{top:>12} {cell(kernels.get(top))}")
            best = found.get(True, found[False])[0]
            say(
                f"{name:<16} {f'{n}x{k}':>12} {m:>2} {cols[0]} {cols[1]} {cell(found[False][1]['cublas'], width=9)} {best:>12}"
            )
            # with the epilogue the engine runs after it: cuBLAS + that kernel vs the gemv variants' fused forms
            epilogue = {"mlp gate|up": "silu", "o_proj/out_proj": "norm", "mlp down": "norm"}.get(name)
            if epilogue and pdl_ok:
                with pdl_captures(True):
                    best_epi, times = tuner._measure(m, n, k, ws, epilogue=epilogue)
                kernels = {c: t for c, t in times.items() if c != "cublas"}
                top = min(kernels, key=kernels.get)
                fused_rows.append((name, epilogue, m, top, times["cublas"], kernels[top], best_epi))
        del ws
        torch.cuda.empty_cache()
    for name, epilogue, m, variant, two, one, best_epi in fused_rows:
        kernel = {"silu": "silu_mul", "norm": "add_rmsnorm"}[epilogue]
        say(
            f"{name} + {kernel}, {m} row(s), PDL: cuBLAS + {kernel} {two:.1f} us, fastest fused form ({variant}) "
            f"{one:.1f} us ({two / one:.3f}x); auto picks {best_epi}"
        )
    say()
    if decode:
        section_d(bandwidth, ("cublas", "cupy", "auto"))


def section_pdl(model_dir: Path, n: int) -> None:
    """Programmatic dependent launch off vs on (kernels/pdl.py), plans captured each way on fresh sessions,
    alternated off/on/off/on (best of two each): the 9B-like model target-only with --gemm cublas and auto, the
    bundled model (bf16) target-only and speculative (depth 5, chain); and whether the tokens are the same."""
    from kernels import cuda as C

    say("== pdl: programmatic dependent launch off vs on (plans captured each way) ==")
    if not C.set_pdl(True):
        say("PDL is not available here (a driver without cuLaunchKernelEx, or a GPU before sm_90)")
        return
    C.set_pdl(False)
    say(f"{'what':<34} {'off t/s':>8} {'on t/s':>8} {'on/off':>7} {'same tokens':>11}")

    def measure(eng: Engine, prompt, settings: EngineSettings) -> tuple[float, float, bool]:
        rates: dict[bool, list[float]] = {False: [], True: []}
        tokens = []
        try:
            for on in (False, True, False, True):
                eng.set_model_option("pdl", on)
                sess = eng.new_session()
                eng.generate(prompt, 16, settings, sess)  # captures this session's plans, with PDL or not
                sess.reset()
                out = eng.generate(prompt, n, settings, sess)
                rates[on].append(out.stats["tokens_per_second"])
                tokens.append(out.tokens)
        finally:
            eng.set_model_option("pdl", False)
        return max(rates[False]), max(rates[True]), all(t == tokens[0] for t in tokens)

    def row(what: str, off: float, on: float, same: bool) -> None:
        say(f"{what:<34} {off:>8.1f} {on:>8.1f} {on / off:>6.3f}x {str(same):>11}")

    eng = random_9b_engine()
    target = EngineSettings(speculative=False, plan_pool=8)
    for mode in ("cublas", "auto"):
        set_gemm_fresh(eng, mode)
        row(f"9B-like target-only, gemm {mode}", *measure(eng, list(range(100, 164)), target))
    # auto measured with PDL on (its choices timed in graphs with PDL's edges, as the plans will run them)
    with pdl_captures(True):
        set_gemm_fresh(eng, "auto")
    row("9B-like target-only, auto (PDL-tuned)", *measure(eng, list(range(100, 164)), target))
    say("auto (PDL-tuned) choices: " + ", ".join(f"{k} {v}" for k, v in eng.model.gemm_choices.items()))
    # the fused projection + residual add + norm (Model.proj_add_norm) off vs on, gemm auto, PDL off
    eng.model.fuse_norm = False
    off, _, same_off = measure(eng, list(range(100, 164)), target)
    eng.model.fuse_norm = True
    on_, _, same_on = measure(eng, list(range(100, 164)), target)
    say(
        f"{'9B-like auto: fused add+norm off/on':<34} {off:>8.1f} {on_:>8.1f} {on_ / off:>6.3f}x {str(same_off and same_on):>11}"
    )
    del eng
    torch.cuda.empty_cache()
    small = Engine.load(model_dir, device="cuda", dtype="bfloat16")
    prompt = workload_prompts(small)[0]
    row("bundled target-only", *measure(small, prompt, target))
    row("bundled spec depth 5, chain", *measure(small, prompt, EngineSettings(draft_depth=5, chain=True, plan_pool=8)))
    say()


def section_bf16(model_dir: Path, n: int) -> None:
    say("== bf16: speculative (depth 5, chain) vs target-only, first divergence per workload ==")
    eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
    for name, w in load_workloads().items():
        prompt = eng.tokenizer.encode(w.prompt_for(eng.tokenizer))
        a = eng.generate(prompt, n, EngineSettings(speculative=False), eng.new_session()).tokens
        b = eng.generate(prompt, n, EngineSettings(draft_depth=5, chain=True), eng.new_session()).tokens
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            say(f"{name:<10} identical over {n} tokens")
            continue
        logits = eng.logits(prompt + a[:first])[-1]
        top2 = torch.topk(logits, 2).values
        say(
            f"{name:<10} first divergence at token {first}: target-only {a[first]} vs spec {b[first]}, "
            f"top-2 logit gap there {float(top2[0] - top2[1]):.4f}"
        )
    say()


def section_s(eng: Engine, n: int) -> None:
    say("== (s) sampling: speculative sampling vs target-only sampling at the same settings (bf16, chain on) ==")
    say("mean t/s over the four workloads x seeds 0 and 1; acc.len = tokens per round")
    prompts = workload_prompts(eng) * 2
    cases = [
        ("T 0.7", SamplingParams(temperature=0.7)),
        ("T 1.0", SamplingParams(temperature=1.0)),
        ("T 0.6 k20 p0.95", SamplingParams(temperature=0.6, top_k=20, top_p=0.95)),
    ]
    greedy, _ = mean_tps(eng, EngineSettings(speculative=False, plan_pool=8), n)
    say(f"greedy target-only for reference: {greedy:.1f} t/s")
    say(f"{'sampling':<17} {'target t/s':>10} {'depth':>5} {'spec t/s':>9} {'acc.len':>8} {'speedup':>8}")
    for label, sp in cases:
        per_prompt = [sp.replace(seed=i // 4) for i in range(len(prompts))]

        def tps(settings: EngineSettings, sp_list=per_prompt) -> tuple[float, float]:
            runs = run_prompts(eng, settings, n, prompts, sampling=sp_list)
            return (
                statistics.fmean(r["tokens_per_second"] for r in runs),
                statistics.fmean(r["mean_accepted_length"] for r in runs),
            )

        target, _ = tps(EngineSettings(speculative=False, plan_pool=8))
        best = (0.0, 0, 0.0)
        for depth in (3, 5, 8):
            spec, acc = tps(EngineSettings(draft_depth=depth, chain=True, plan_pool=8))
            say(f"{label:<17} {target:>10.1f} {depth:>5} {spec:>9.1f} {acc:>8.2f} {spec / target:>7.2f}x")
            if spec > best[0]:
                best = (spec, depth, acc)
        say(
            f"{label:<17} best: depth {best[1]}, {best[0] / target:.2f}x target-only sampling ({best[2]:.2f} per round)"
        )
    say()


def interleaved(
    eng: Engine,
    cells: dict,
    prompt,
    n: int,
    reps: int,
    warm_n: int,
    before=None,
    warm_tokens: dict | None = None,
    sampling: SamplingParams | None = None,
) -> dict[str, list[dict]]:
    """Run stats of `reps` timed runs per cell (label -> settings), each cell on its own session, warmed once
    (its plans captured; auto's controller makes its sweep over the depths there), then `reps` passes over all
    cells, each pass in another order (rotated, every other one reversed), so that drift (clocks, another load
    on the machine) falls on every cell alike instead of on whichever ran last; a garbage collection before
    each timed run keeps a collector pause out of the timings. `before(label)`: called before each of the
    cell's runs (what settings cannot say, e.g. an engine attribute); `warm_tokens`: filled with each cell's
    warm-up tokens; `sampling`: every run's (None: greedy)."""
    sessions = {}
    for label, st in cells.items():
        sessions[label] = eng.new_session()
        if before is not None:
            before(label)
        tokens = eng.generate(prompt, warm_n, st, sessions[label], sampling=sampling).tokens
        if warm_tokens is not None:
            warm_tokens[label] = tokens
    labels = list(cells)
    out: dict[str, list[dict]] = {label: [] for label in labels}
    for r in range(reps):
        k = r % len(labels)
        order = labels[k:] + labels[:k]
        for label in reversed(order) if r % 2 else order:
            sessions[label].reset()
            if before is not None:
                before(label)
            gc.collect()
            out[label].append(eng.generate(prompt, n, cells[label], sessions[label], sampling=sampling).stats)
    return out


def auto_verdict(values: dict, row: dict, depths: list) -> tuple[int, str]:
    """The best static depth by median and auto against it: the ratio of medians and the ranges' verdict."""
    best_d = max((d for d in depths if d != "auto"), key=lambda d: row[d])
    lo, hi = min(values[best_d]), max(values[best_d])
    return best_d, (
        f"auto {min(values['auto']):.0f}..{max(values['auto']):.0f} vs depth {best_d} {lo:.0f}..{hi:.0f}: "
        f"{row['auto'] / row[best_d]:.3f}, auto {compare_ranges(values[best_d], values['auto'])}"
    )


def rounds_by_depth(runs: list[dict]) -> str:
    """Timed rounds per depth over `runs`, each with its mean wall time: "8:1689x1.040ms"."""
    spent: dict[int, list[float]] = {}
    for r in runs:
        for depth, c in r["round_cost_by_depth"].items():
            row = spent.setdefault(depth, [0, 0.0])
            row[0] += c["rounds"]
            row[1] += c["rounds"] * c["round_s"]
    return " ".join(f"{k}:{n}x{1e3 * t / n:.3f}ms" for k, (n, t) in sorted(spent.items()) if n)


def section_auto(eng: Engine, n: int, reps: int = 7) -> None:
    """draft_depth="auto" against every static depth 1..8 (chain on), per workload, side by side: every cell on
    its own session, the cells interleaved over `reps` passes (see `interleaved`), the median of each cell, and
    auto against the best static depth by their ranges (app/bench.py's rule: a difference inside the spread is
    no clear difference)."""
    say(
        f"== (auto) adaptive depth vs every static depth 1..8, per workload (bf16, chain on), {n} tokens, "
        f"median of {reps} interleaved passes =="
    )
    prompts = {name: w.prompt_for(eng.tokenizer) for name, w in load_workloads().items()}
    depths: list[int | str] = [*range(1, 9), "auto"]
    say(f"{'workload':<10} " + " ".join(f"{str(d):>7}" for d in depths) + "   auto vs best static / vs depth 3")
    means = {d: [] for d in depths}
    notes = []
    for name, prompt in prompts.items():
        cells = {d: EngineSettings(draft_depth=d, max_draft_depth=8, chain=True, plan_pool=16) for d in depths}
        runs = interleaved(eng, cells, prompt, n, reps, warm_n=n)
        values = {d: [r["tokens_per_second"] for r in runs[d]] for d in depths}
        row = {d: statistics.median(values[d]) for d in depths}
        for d in depths:
            means[d].append(row[d])
        best_d, verdict = auto_verdict(values, row, depths)
        say(
            f"{name:<10} "
            + " ".join(f"{row[d]:7.0f}" for d in depths)
            + f"   {row['auto'] / row[best_d]:5.3f} / {row['auto'] / row[3]:5.3f}"
        )
        notes.append(
            f"{name:<10} {verdict}; rounds by depth: auto {rounds_by_depth(runs['auto'])}, depth {best_d} "
            f"{rounds_by_depth(runs[best_d])}"
        )
    mean = {d: statistics.fmean(v) for d, v in means.items()}
    best_static = max(mean[d] for d in depths if d != "auto")
    say(
        f"{'mean':<10} "
        + " ".join(f"{mean[d]:7.0f}" for d in depths)
        + f"   {mean['auto'] / best_static:5.3f} / {mean['auto'] / mean[3]:5.3f}"
    )
    for line in notes:
        say(line)
    say()


def section_overlap(model_dir: Path, n: int, reps: int = 5) -> None:
    """Overlapped rounds (Engine.overlap_rounds, Engine.pipeline_rounds): off, the next round queued once this one
    is read (before its event is handed over), and a round queued before the one ahead of it is read (pipelined,
    its inputs taken on the device); interleaved passes on one session a cell, the bundled model (target-only,
    depth 5 chain greedy and sampled at temperature 0.7, auto) and the 9B-like model (target-only, depth 3
    synthetic); and whether the tokens are the same."""
    say(f"== (overlap) rounds queued ahead: off / after the read / pipelined, median of {reps} ==")
    modes = {"off": (False, False), "queued": (True, False), "pipelined": (True, "all")}

    def measure(eng: Engine, label: str, settings: EngineSettings, prompt, tokens: int, sampling=None) -> None:
        was, texts = (eng.overlap_rounds, eng.pipeline_rounds), {}
        cells = dict.fromkeys(modes, settings)

        def before(mode):
            eng.overlap_rounds, eng.pipeline_rounds = modes[mode]

        runs = interleaved(
            eng, cells, prompt, tokens, reps, tokens, before=before, warm_tokens=texts, sampling=sampling
        )
        eng.overlap_rounds, eng.pipeline_rounds = was
        out = {m: [r["tokens_per_second"] for r in v] for m, v in runs.items()}
        med = {m: statistics.median(v) for m, v in out.items()}
        cols = "  ".join(f"{m} {med[m]:8.1f}" for m in cells)
        ratios = "  ".join(
            f"{m}/off {med[m] / med['off']:5.3f}x ({compare_ranges(out['off'], out[m])})" for m in cells if m != "off"
        )
        ratios += f"  pipelined/queued {med['pipelined'] / med['queued']:5.3f}x"
        same = all(texts[m] == texts["off"] for m in cells)
        piped = runs["pipelined"][-1]
        share = f"{piped['pipelined_rounds']}/{piped['rounds']}"
        say(f"{label:<26} {cols} t/s  {ratios}; rounds pipelined {share}; same tokens: {same}")

    eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    for label, st in (
        ("bundled target-only", EngineSettings(speculative=False, plan_pool=8)),
        ("bundled depth 5 chain", EngineSettings(draft_depth=5, chain=True, plan_pool=16)),
        ("bundled auto", EngineSettings(draft_depth="auto", max_draft_depth=8, chain=True, plan_pool=16)),
    ):
        measure(eng, label, st, prompt, n)
    sampled = EngineSettings(draft_depth=5, chain=True, plan_pool=16)
    measure(eng, "bundled depth 5 T 0.7", sampled, prompt, n, SamplingParams(temperature=0.7, seed=1))
    eng.close()
    del eng
    torch.cuda.empty_cache()
    eng = random_9b_engine(mtp=True)  # a draft head for the speculative cell (target-only rounds never run it)
    set_gemm_fresh(eng, "auto")
    prompt = list(range(100, 164))
    measure(eng, "9B-like target-only", EngineSettings(speculative=False, plan_pool=8), prompt, 256)
    synthetic = EngineSettings(draft_depth=3, chain=True, plan_pool=16, synthetic_rates=QWEN3_NEXT_RATES)
    measure(eng, "9B-like depth 3 synthetic", synthetic, prompt, 256)
    eng.close()
    say()


def section_real(n: int) -> None:
    """Speculation at real scale: the 9B-real model (248k vocabulary, one MTP layer, random bf16) with synthetic
    acceptance at Qwen3-Next's MTP rates: the real draft and verify work, the accepted count drawn from the rates."""
    rates = ", ".join(f"{r:g}" for r in QWEN3_NEXT_RATES)
    say("== (real) 9B-real: Qwen3.5-9B shapes, 248,320-id vocabulary, one MTP layer (random bf16) ==")
    say(f"synthetic acceptance, per position given the ones before accepted: {rates}")
    eng = Engine.from_factory(
        random_9b_weights, (REAL_9B,), IdsOnly(), Path("random-9b-real"), 4096, [torch.device("cuda")]
    )
    torch.cuda.empty_cache()
    prompt = torch.randint(0, REAL_9B["vocab_size"], (512,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(settings: EngineSettings, warm_n: int = 32) -> list[dict]:
        return run_prompts(eng, settings, n, [prompt] * 2, warm_n=warm_n)

    def tps(runs: list[dict]) -> float:
        return statistics.fmean(r["tokens_per_second"] for r in runs)

    def syn(**kw) -> EngineSettings:
        return EngineSettings(synthetic_rates=QWEN3_NEXT_RATES, plan_pool=16, **kw)

    # target-only, every static depth and auto side by side: interleaved passes, one session a cell
    cells = {"target": EngineSettings(speculative=False, plan_pool=16)}
    cells |= {d: syn(draft_depth=d, chain=True) for d in range(1, 9)}
    cells["auto"] = syn(draft_depth="auto", max_draft_depth=8, chain=True)
    side = interleaved(eng, cells, prompt, n, 3, warm_n=n)  # auto's warm-up: its sweep over the depths
    med = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in side.items()}
    target = med["target"]
    say(f"target-only: {target:.1f} t/s (median of 3 interleaved passes, as every row below)")
    say("round cost model (ms a round, means over rounds that captured nothing):")
    say(f"{'depth':>5} {'t/s':>8} {'vs target':>9} {'acc.len':>7} {'draft':>7} {'verify':>7} {'accept':>7} {'host':>6}")

    def e_tokens(d: int) -> float:  # a round's expected tokens at depth d under the rates
        run_p = total = 1.0
        for p in QWEN3_NEXT_RATES[:d]:
            run_p *= p
            total += run_p
        return total

    def expected_tps(stats: dict) -> float:
        """t/s at the rates' exact acceptance: every timed round's expected tokens at the depth it ran, over the
        rounds' measured wall time. The seeded draws of a run of a few hundred tokens are luckier at one depth
        than at another by several %; this is what each depth (and auto's choices) costs without that luck."""
        cost = stats["round_cost_by_depth"]
        time_s = sum(c["rounds"] * c["round_s"] for d, c in cost.items() if d > 0)
        return sum(c["rounds"] * e_tokens(d) for d, c in cost.items() if d > 0) / time_s if time_s else 0.0

    for d in range(1, 9):
        t, acc = med[d], statistics.fmean(r["mean_accepted_length"] for r in side[d])
        c = side[d][-1]["round_cost_by_depth"].get(d, {})
        ms = [1e3 * c.get(k, 0.0) for k in ("draft_s", "verify_s", "accept_s", "host_s")]
        say(f"{d:>5} {t:>8.1f} {t / target:>8.2f}x {acc:>7.2f} " + " ".join(f"{x:>7.3f}" for x in ms))
    depths: list[int | str] = [*range(1, 9), "auto"]
    values = {k: [r["tokens_per_second"] for r in side[k]] for k in depths}
    best_d, verdict = auto_verdict(values, med, depths)
    best = (med[best_d], best_d)
    say(f"best depth with chain: {best_d}, {best[0] / target:.2f}x target-only (goal >= 2.2x)")
    say(
        f"depth auto (max 8): {med['auto']:.1f} t/s, {med['auto'] / target:.2f}x target-only; {verdict}; "
        f"auto's rounds by depth: {rounds_by_depth(side['auto'])}"
    )
    e_values = {k: [expected_tps(r) for r in side[k]] for k in depths}
    e_med = {k: statistics.median(v) for k, v in e_values.items()}
    e_best, e_verdict = auto_verdict(e_values, e_med, depths)
    say(
        "at the rates' exact acceptance (expected tokens of each timed round over its time; no luck of the draws): "
        + ", ".join(f"{d}: {e_med[d]:.0f}" for d in depths)
        + f"; best static {e_best}; {e_verdict}"
    )
    del side
    torch.cuda.empty_cache()
    say()
    d = best[1]
    say(f"sub-vocab at depth {d} (chain on): {'N':>7} {'draft ms/step':>13} {'t/s':>8} {'vs full':>8}")
    full_step = full_tps = 0.0
    for sub in (0, 65536, 32768, 16384):
        runs = run(syn(draft_depth=d, chain=True, sub_vocab=sub))
        step = 1e3 * runs[-1]["round_cost_by_depth"][d]["draft_s"] / d
        t = tps(runs)
        full_step, full_tps = (step, t) if sub == 0 else (full_step, full_tps)
        say(
            f"{'':<28}{sub or 'full':>7} {step:>13.3f} {t:>8.1f} {t / full_tps:>7.2f}x"
            + (f"   draft step {full_step / step:.1f}x cheaper (goal >= 3x at 32768)" if sub else "")
        )
        if sub == 32768:
            with_sub = t
    say(f"depth {d} with chain and sub-vocab 32768: {with_sub / target:.2f}x target-only (goal >= 2.2x)")
    # a sub-vocab order (as `specdeck subvocab build` writes for a real tokenizer): 65,536 ids spread over the
    # vocabulary, their head rows gathered once; the draft step should cost what the prefix's does
    eng.set_sub_vocab_order(list(range(0, REAL_9B["vocab_size"], 3))[:65536], "bench: every third id")
    runs = run(syn(draft_depth=d, chain=True, sub_vocab=32768))
    step = 1e3 * runs[-1]["round_cost_by_depth"][d]["draft_s"] / d
    say(f"{'':<20}32768 of an order {step:>13.3f} {tps(runs):>8.1f} {tps(runs) / full_tps:>7.2f}x")
    eng.set_sub_vocab_order(None)

    def draft_steps(label: str) -> None:  # the full and the 32k draft step again, as the model is set now
        steps = {}
        for sub in (0, 32768):
            runs = run(syn(draft_depth=d, chain=True, sub_vocab=sub))
            steps[sub] = (1e3 * runs[-1]["round_cost_by_depth"][d]["draft_s"] / d, tps(runs))
        say(
            f"{label}: draft step full {steps[0][0]:.3f} ms, 32768 {steps[32768][0]:.3f} ms "
            f"({steps[0][0] / steps[32768][0]:.1f}x cheaper); {steps[0][1]:.1f} / {steps[32768][1]:.1f} t/s"
        )

    # the same two draft steps with the gemv kernels where they beat cuBLAS (--gemm auto, measured from scratch),
    # then with programmatic dependent launch (a step's ~20 small kernels start while the previous one ends)
    cache = tempfile.mkdtemp(prefix="specdeck-gemm-")
    try:
        eng.model.set_gemm("auto", cache_dir=cache)
        draft_steps("with --gemm auto")
    except EngineError as e:
        say(f"with --gemm auto: unavailable ({e})")
    finally:
        eng.model.set_gemm("cublas")
        shutil.rmtree(cache, ignore_errors=True)
    eng.set_model_option("pdl", True)
    if eng.model.pdl:
        draft_steps("with PDL (gemm cublas)")
    else:
        say("with PDL: unavailable on this GPU")
    eng.set_model_option("pdl", False)
    on, off = tps(run(syn(draft_depth=5, chain=True))), tps(run(syn(draft_depth=5, chain=False)))
    say(f"depth 5: chain on {on:.1f} t/s, chain off {off:.1f} t/s: chain {on / off:.2f}x")
    say()
    sess = eng.new_session()
    for label, st in (
        ("target-only", EngineSettings(speculative=False, plan_pool=16)),
        ("depth 5 chain", syn(draft_depth=5, chain=True)),
        ("depth 5 chain sub 32k", syn(draft_depth=5, chain=True, sub_vocab=32768)),
        ("depth 3 chain p_min 0.3", syn(draft_depth=3, chain=True, p_min=0.3)),
    ):
        sess.reset()
        eng.generate(prompt, 24, st, sess)
        sess.reset()
        stream = eng.stream(prompt, 40, st, sess)
        next(stream)
        rounds, verdict = 0, "one host sync per round"
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in stream:
                rounds += 1
        except RuntimeError as exc:
            verdict = f"a hidden sync: {str(exc).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        say(f"{label:<26} {rounds:>3} rounds under sync debug 'error': {verdict}")
    say()
    eng.close()


def decode_by_context(eng: Engine, lengths: list[int], gen: torch.Generator, n: int = 128) -> None:
    """Target-only decode t/s after a random prompt of each length, then the first length once more (clocks and
    plans are warm by then); each share is of the faster of the two first-length runs, so a slow first run
    cannot flatter the long contexts."""
    target = EngineSettings(speculative=False, plan_pool=8)
    sess = eng.new_session()
    rates = []
    for length in [*lengths, lengths[0]]:
        sess.reset()
        ids = torch.randint(0, eng.model.cfg.vocab_size, (length,), generator=gen).tolist()
        rates.append((length, eng.generate(ids, n, target, sess).stats["tokens_per_second"]))
    base = max(rates[0][1], rates[-1][1])
    say(f"{'context':>8} {'decode t/s':>11} {'vs ' + str(lengths[0]):>8}")
    for i, (length, rate) in enumerate(rates):
        again = " (again, last)" if i == len(rates) - 1 else ""
        say(f"{length:>8} {rate:>11.1f} {rate / base:>8.1%}{again}")


def section_ctx(model_dir: Path, lengths: list[int]) -> None:
    """Long context on the 9B-like model: prefill speed and peak memory, decode speed at each context length,
    and speculative == greedy at 32k (also on the bundled model in fp32)."""
    top = max(lengths)
    say(f"== (ctx) long context, 9B-like shapes (bf16), max_context {top + 512} ==")
    eng = random_9b_engine(max_context=top + 512, mtp=True)
    cfg = eng.model.cfg
    n_full = sum(t == "full_attention" for t in cfg.layer_types)
    kv_gib = 2 * n_full * (top + 512) * cfg.num_key_value_heads * cfg.head_dim * 2 / 2**30
    gen = torch.Generator().manual_seed(1)
    target = EngineSettings(speculative=False, plan_pool=8)

    def ids(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    sess = eng.new_session()
    eng.generate(ids(4096), 4, target, sess)  # warm-up: kernels, cuBLAS, plans
    say(f"KV cache of the session: {kv_gib:.2f} GiB ({n_full} attention layers x {top + 512} positions)")
    say(f"{'prompt':>8} {'prefill t/s':>12} {'peak extra GiB':>15}")
    for n in [x for x in (4096, 32768, 131072) if x <= top]:
        sess.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        st = eng.generate(ids(n), 1, target, sess).stats
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        say(f"{n:>8} {st['prefill_tokens'] / st['prefill_s']:>12,.0f} {peak:>15.2f}")
    say()
    decode_by_context(eng, lengths, gen)
    say()
    n = 32768 if top >= 32768 else lengths[-1]
    prompt = ids(n)
    spec_vs_greedy(eng, sess, prompt, 48, (1, 3, 5), f"9B-like, {n} context")
    # --gemm exact: every decode product and attention computed the same way at any row count (bf16 too)
    eng.model.set_gemm("exact")
    spec_vs_greedy(eng, sess, prompt, 48, (1, 3, 5), f"9B-like --gemm exact, {n} context")
    eng.model.set_gemm("cublas")
    del eng, sess
    torch.cuda.empty_cache()
    # bf16 sums in another order (a verify of width d+1 vs one row) can flip a near-tie of the random
    # model's flat logits; in fp32 the speculative output must be the greedy output exactly
    eng = Engine.from_factory(
        random_9b_weights_fp32,
        ({"mtp_num_hidden_layers": 1},),
        IdsOnly(),
        Path("random-9b-fp32"),
        n + 512,
        [torch.device("cuda")],
    )
    spec_vs_greedy(eng, eng.new_session(), prompt, 48, (1, 3, 5), f"9B-like fp32, {n} context")
    del eng
    torch.cuda.empty_cache()
    small = Engine.load(model_dir, device="cuda", dtype="float32", max_context=n + 512)
    text = small.tokenizer.encode("def f(x):\n    return x + 1\n" * 4000)[: n - 8]
    spec_vs_greedy(small, small.new_session(), text, 96, (3, 5), f"bundled fp32, {len(text)} context")
    say()


def spec_vs_greedy(eng: Engine, sess, prompt: list[int], n: int, depths: tuple[int, ...], label: str) -> None:
    """Target-only greedy output, then speculative (chain) at each depth on the same session: equal or not."""
    greedy = eng.generate(prompt, n, EngineSettings(speculative=False, plan_pool=8), sess).tokens
    for depth in depths:
        spec = eng.generate(prompt, n, EngineSettings(draft_depth=depth, chain=True, plan_pool=8), sess)
        say(
            f"{label}, spec depth {depth} == greedy ({n} tokens): {spec.tokens == greedy} "
            f"(accepted per round {spec.stats['mean_accepted_length']:.2f})"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--sections", default="copy,a,b,c,d,bf16")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ctx", default="1024,8192,32768,131072", help="context lengths of the ctx section")
    a = ap.parse_args()
    from engine import bundled_model_dir

    model_dir = Path(a.model) if a.model else bundled_model_dir()
    sections = a.sections.split(",")
    say(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  model: {model_dir.name}")
    bw = 0.0
    if "copy" in sections or "d" in sections or "gemv" in sections or "gemv-table" in sections:
        bw = copy_bandwidth()
        say(f"device copy bandwidth (2 x bytes / time): {bw / 1e12:.2f} TB/s")
        say()
    try:
        if "a" in sections:
            section_a(model_dir, a.n)
        if "b" in sections or "c" in sections:
            eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
            best = section_b(eng, a.n) if "b" in sections else EngineSettings(draft_depth=5, plan_pool=8)
            if "c" in sections:
                section_c(eng, best, a.n)
            del eng
        if "d" in sections:
            section_d(bw)
        if "gemv" in sections or "gemv-table" in sections:
            section_gemv(bw, decode="gemv" in sections)
        if "bf16" in sections:
            section_bf16(model_dir, a.n)
        if "pdl" in sections:
            section_pdl(model_dir, a.n)
        if "s" in sections:
            eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
            section_s(eng, a.n)
            del eng
        if "real" in sections:
            section_real(a.n)
        if "ctx" in sections:
            section_ctx(model_dir, [int(x) for x in a.ctx.split(",")])
        if "auto" in sections:
            eng = Engine.load(model_dir, device="cuda", dtype="bfloat16")
            section_auto(eng, a.n)
            del eng
        if "overlap" in sections:
            section_overlap(model_dir, a.n)
    finally:
        save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
