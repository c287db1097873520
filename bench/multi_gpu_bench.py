"""Multi-GPU benchmark (issue 6), all figures side by side in one run:

  python bench/multi_gpu_bench.py [--devices cuda:0,cuda:1] [--n 128] [--out FILE]

For the bundled model and the Qwen3.5-9B-like random model (bf16): one GPU vs the split over the listed
devices; mirror_output on vs off, with both combining strategies (gather logits / distributed argmax);
with vs without cached split plans; all-reduce latency per call and per decode step. Also checks, before
timing, that the split gives logits equal (fp32, 1e-5) to one GPU and greedy-identical speculative output.
Keep NCCL_NVLS_ENABLE=0 (set below if unset): NVLink multicast stays off on the lent machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineSettings, bundled_model_dir  # noqa: E402
from engine.workloads import load_workloads  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import IdsOnly, random_9b_engine, run_prompts, save, say, workload_prompts  # noqa: E402


def tps(eng: Engine, settings: EngineSettings, n: int) -> tuple[float, int]:
    """Mean t/s, and all-reduce calls per round (0 on one device)."""
    ids_only = isinstance(eng.tokenizer, IdsOnly)  # the random model: one token-id prompt, target-only
    prompts = [list(range(100, 164))] if ids_only else workload_prompts(eng)
    reduce = getattr(eng.model, "reduce", None)
    calls0 = [0]

    def mark() -> None:
        calls0[0] = reduce.calls if reduce else 0

    runs = run_prompts(eng, settings, n, prompts, warm_n=8, after_warm_up=mark)
    calls = (reduce.calls - calls0[0]) if reduce else 0
    rounds = sum(r["rounds"] for r in runs)
    return statistics.fmean(r["tokens_per_second"] for r in runs), calls // max(rounds, 1)


def _sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def allreduce_latency(eng: Engine, rows: int, reps: int = 200) -> float:
    parts = [torch.randn(rows, eng.cfg.hidden_size, device=d, dtype=eng.model.dtype) for d in eng.model.devices]
    for _ in range(10):
        eng.model.reduce(parts)
    _sync(eng.model.devices)
    t0 = time.perf_counter()
    for _ in range(reps):
        eng.model.reduce(parts)
    _sync(eng.model.devices)
    return (time.perf_counter() - t0) / reps


def check_equal(model_dir: Path, devices: list[str]) -> None:
    one = Engine.load(model_dir, device=devices[0], dtype="float32")
    two = Engine.load(model_dir, devices=devices, dtype="float32")
    workloads = load_workloads()
    ids = one.tokenizer.encode(workloads["code_echo"].prompt)[:200]
    ref = one.logits(ids).cpu()
    diff = (ref - two.logits(ids).cpu()).abs().max().item()
    rel = diff / ref.abs().max().item()
    prompt = workloads["code_gen"].prompt
    g = one.generate(prompt, 64, EngineSettings(speculative=False)).tokens
    same = all(
        two.generate(prompt, 64, EngineSettings(draft_depth=5, mirror_output=m), two.new_session()).tokens == g
        for m in (True, False)
    )
    say(
        f"fp32 check: max |logits(1 GPU) - logits({len(devices)} GPUs)| = {diff:.2e} ({rel:.1e} of the largest "
        f"logit; the all-reduce sums in another order than one GEMM); "
        f"speculative == greedy: {same}"
    )


def run_model(name: str, make_one, make_tp, n: int) -> None:
    say(f"== {name} ==")
    one = make_one()
    base = EngineSettings(draft_depth=5, chain=True, plan_pool=8, speculative=one.model.has_mtp)
    t1, _ = tps(one, base, n)
    say(f"1 GPU                                  {t1:9.1f} t/s")
    del one
    torch.cuda.empty_cache()
    tp = make_tp()
    for mirror, combine in ((True, "-"), (False, "gather"), (False, "argmax")):
        tp.model.combine = combine if combine != "-" else "argmax"
        s = base.replace(mirror_output=mirror)
        t, calls = tps(tp, s, n)
        mem = {d: v["weights"] / 2**20 for d, v in tp.memory_by_device().items()}
        label = f"{len(tp.model.devices)} GPUs mirror={'on ' if mirror else 'off'} combine={combine:<6}"
        say(f"{label} {t:9.1f} t/s  {t / t1:5.2f}x  all-reduces/round {calls}  weights MiB {mem}")
    tp.model.combine = "argmax"
    for cached in (True, False):
        tp.model.cache_split_plans = cached
        t, _ = tps(tp, base, n)
        say(f"cached split plans {'on ' if cached else 'off'}                  {t:9.1f} t/s")
    tp.model.cache_split_plans = True
    for rows in (1, 6):
        lat = allreduce_latency(tp, rows)
        per_step = 2 * tp.cfg.num_layers * lat
        say(
            f"all-reduce latency, {rows} row(s): {1e6 * lat:8.1f} us per call, {1e3 * per_step:6.2f} ms per decode step "
            f"({2 * tp.cfg.num_layers} calls)"
        )
    say()
    del tp
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out")
    ap.add_argument("--skip-9b", action="store_true", help="bundled model only (e.g. a CPU smoke run)")
    a = ap.parse_args()
    devices = a.devices.split(",")
    gpus = {d for d in devices if d.startswith("cuda")}
    if torch.cuda.device_count() < len(gpus):
        print(f"needs {len(gpus)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    try:
        model_dir = bundled_model_dir()
        dtype = "bfloat16" if gpus else "float32"
        check_equal(model_dir, devices)
        run_model(
            f"bundled model ({dtype})",
            lambda: Engine.load(model_dir, device=devices[0], dtype=dtype),
            lambda: Engine.load(model_dir, devices=devices, dtype=dtype),
            a.n,
        )
        if a.skip_9b:
            return 0
        run_model(
            "Qwen3.5-9B-like shapes, random (bf16), target-only",
            lambda: random_9b_engine([devices[0]]),
            lambda: random_9b_engine(devices),
            a.n,
        )
    finally:
        save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
