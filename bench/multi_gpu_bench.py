"""Multi-GPU benchmark: one process per GPU (torch.distributed), every figure side by side in one run:

  python bench/multi_gpu_bench.py [--devices cuda:0,cuda:1] [--n 128] [--out FILE] [--skip-9b]

1. fp32 check on the bundled model: logits of the split vs one GPU; speculative output == plain greedy.
2. the bundled model (bf16): 1 GPU vs 2 GPUs, target-only and speculative; mirror on / off (distributed
   argmax) / off (logits gathered); plans (CUDA graphs, captured on every rank) vs none (plan_pool=0, eager).
3. the Qwen3.5-9B-like random model (bf16), target-only: 1 GPU vs 2 GPUs, mirror on / off.
4. the all-reduce of 1..17 rows x 4096 bf16 inside a captured graph: NCCL vs symmetric memory (one-shot),
   as timed at load, and which one the engine kept per size.
5. per-GPU memory as the engine reports it (every rank) beside NVML's figure for each process.
Symmetric memory is set up by the first multi-device engine of a process only: run each section in its
own process (--only check|bundled|9b) to give each its own first engine, as bench/run_multi_gpu.sh does.
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
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings, bundled_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import (  # noqa: E402
    IdsOnly,
    random_9b_engine,
    random_9b_weights,
    run_prompts,
    save,
    say,
    workload_prompts,
)


def tps(eng: Engine, settings: EngineSettings, n: int) -> tuple[float, list]:
    """Mean t/s over the prompts (the random model: one token-id prompt), and the runs' stats."""
    ids_only = isinstance(eng.tokenizer, IdsOnly)
    prompts = [list(range(100, 164))] * 3 if ids_only else workload_prompts(eng)
    runs = run_prompts(eng, settings, n, prompts, warm_n=n)
    return statistics.fmean(r["tokens_per_second"] for r in runs), runs


def outputs(eng: Engine, settings: EngineSettings, n: int) -> list[list[int]]:
    sess = eng.new_session()
    out = []
    for prompt in workload_prompts(eng):
        sess.reset()
        out.append(eng.generate(prompt, n, settings, sess).tokens)
    return out


def check_equal(model_dir: Path, devices: list[str]) -> None:
    one = Engine.load(model_dir, device=devices[0], dtype="float32")
    workloads = load_workloads()
    ids = one.tokenizer.encode(workloads["code_echo"].prompt)[:200]
    ref = one.logits(ids).cpu()
    greedy = outputs(one, EngineSettings(speculative=False), 64)
    del one
    two = Engine.load(model_dir, devices=devices, dtype="float32")
    diff = (ref - two.logits(ids).cpu()).abs().max().item()
    rel = diff / ref.abs().max().item()
    same = {
        f"depth {d} mirror {'on' if m else 'off'}": outputs(two, EngineSettings(draft_depth=d, mirror_output=m), 64)
        == greedy
        for d in (3, 5)
        for m in (True, False)
    }
    two.close()
    say(f"fp32: max |logits(1 GPU) - logits({len(devices)} GPUs)| = {diff:.2e} ({rel:.1e} relative)")
    say(f"fp32: speculative on {len(devices)} GPUs == plain greedy on 1 GPU, 4 workloads x 64 tokens: {same}")


def nvml_per_process() -> dict[int, dict[int, int]]:
    """GPU index -> {pid: bytes used}, from NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        say(f"(NVML unavailable: {exc})")
        return {}
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out[i] = {p.pid: p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    return out


def run_bundled(model_dir: Path, devices: list[str], n: int) -> None:
    say("== bundled model (bf16): 1 GPU vs 2 GPUs ==")
    one = Engine.load(model_dir, device=devices[0], dtype="bfloat16")
    target = EngineSettings(speculative=False, plan_pool=8)
    spec = EngineSettings(draft_depth=5, chain=True, plan_pool=8)
    t1, _ = tps(one, target, n)
    s1, _ = tps(one, spec, n)
    greedy = outputs(one, target, n)
    del one
    torch.cuda.empty_cache()
    say(f"1 GPU  target-only {t1:9.1f} t/s   speculative (depth 5, chain) {s1:9.1f} t/s")
    tp = Engine.load(model_dir, devices=devices, dtype="bfloat16")
    greedy2 = outputs(tp, target, n)
    say(
        f"2 GPUs plain greedy == 1 GPU plain greedy (bf16; sums in another order may flip a near-tie): {greedy2 == greedy}"
    )
    rows = []
    for label, settings, combine in (
        ("target-only, mirror on", target, "argmax"),
        ("target-only, mirror off (argmax)", target.replace(mirror_output=False), "argmax"),
        ("spec d5, mirror on", spec, "argmax"),
        ("spec d5, mirror off (distributed argmax)", spec.replace(mirror_output=False), "argmax"),
        ("spec d5, mirror off (logits gathered)", spec.replace(mirror_output=False), "gather"),
        ("spec d3, mirror on", spec.replace(draft_depth=3), "argmax"),
        ("target-only, no plans (plan_pool=0, eager)", target.replace(plan_pool=0), "argmax"),
        ("spec d5, no plans (plan_pool=0, eager)", spec.replace(plan_pool=0), "argmax"),
    ):
        tp.set_model_option("combine", combine)
        t, runs = tps(tp, settings, n)
        base = s1 if settings.speculative else t1
        same = outputs(tp, settings, n) == greedy2
        rows.append((label, t, t / base, same))
        say(f"2 GPUs {label:<45} {t:9.1f} t/s  {t / base:5.2f}x of 1 GPU  output == greedy on 2 GPUs: {same}")
    tp.set_model_option("combine", "argmax")
    t2_target = next(r[1] for r in rows if r[0] == "target-only, mirror on")
    for label, t, _, _ in rows:
        if label.startswith("spec"):
            say(f"2 GPUs {label:<45} {t / t2_target:5.2f}x of target-only on 2 GPUs")
    tp.close()
    say()


def run_9b(devices: list[str], n: int) -> None:
    say("== Qwen3.5-9B-like shapes, random (bf16), target-only: 1 GPU vs 2 GPUs ==")
    one = random_9b_engine([devices[0]])
    target = EngineSettings(speculative=False, plan_pool=8)
    t1, _ = tps(one, target, n)
    one.set_model_option("pdl", True)
    t1_pdl, _ = tps(one, target, n) if one.model.pdl else (0.0, None)
    del one
    torch.cuda.empty_cache()
    say(f"1 GPU                         {t1:9.1f} t/s")
    if t1_pdl:
        say(f"1 GPU, PDL                    {t1_pdl:9.1f} t/s  {t1_pdl / t1:5.2f}x")
    # The bound of a 2-way split without communication: one rank's shapes (half the heads and MLP
    # columns, the whole head as with mirror on) on one GPU, no all-reduce at all.
    half = {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "intermediate_size": 6144,
    }
    rank_shapes = Engine.from_factory(
        random_9b_weights, (half,), IdsOnly(), Path("rank-shape"), 2048, [torch.device(devices[0])]
    )
    tr, _ = tps(rank_shapes, target, n)
    del rank_shapes
    torch.cuda.empty_cache()
    say(f"1 GPU, one rank's shapes, no communication (the bound of 2 GPUs) {tr:9.1f} t/s  {tr / t1:5.2f}x")
    tp = random_9b_engine(devices)
    for label, settings in (
        ("mirror on", target),
        ("mirror off (distributed argmax)", target.replace(mirror_output=False)),
        ("no plans (plan_pool=0, eager)", target.replace(plan_pool=0)),
        ("mirror on, PDL (kernels/pdl.py)", None),
    ):
        if settings is None:
            tp.set_model_option("pdl", True)
            if not tp.model.pdl:
                continue
            settings = target
        t, runs = tps(tp, settings, n)
        say(f"2 GPUs {label:<32} {t:9.1f} t/s  {t / t1:5.2f}x")
    tp.set_model_option("pdl", False)
    say()
    say("== all-reduce inside a captured graph, [rows, 4096] bf16, microseconds per call (timed at load) ==")
    table = tp.collectives.get("table_us") or {}
    if not table:
        say(f"no table: {tp.collectives}")
    say(f"{'rows':>4} {'NCCL':>8} {'symm one-shot':>14}  kept")
    for rows, t in sorted(table.items()):
        kept = "symm" if t["symm"] < t["nccl"] else "nccl"
        say(f"{rows:>4} {t['nccl']:8.2f} {t['symm']:14.2f}  {kept}")
    say()
    say("== per-GPU memory: the engine's count from every rank vs NVML per process (MiB) ==")
    stats = tp.generate(list(range(100, 164)), 16, target, tp.new_session()).stats
    nvml = nvml_per_process()
    pids = [os.getpid(), *[p.pid for p in tp.cluster.procs]]
    for rank, (label, mem) in enumerate(stats["memory_by_device"].items()):
        index = torch.device(devices[rank]).index
        theirs = nvml.get(index, {}).get(pids[rank])
        ours = mem.get("process", 0)
        diff = f"{(ours - theirs) / 2**20:+.0f}" if theirs else "n/a"
        say(
            f"{label}: weights {mem['weights'] / 2**20:.0f}, engine process figure {ours / 2**20:.0f}, "
            f"NVML {theirs / 2**20 if theirs else float('nan'):.0f}, difference {diff}"
        )
    tp.close()
    say()


T0 = time.perf_counter()


def stamp(what: str) -> None:
    say(f"[{time.perf_counter() - T0:6.1f} s] {what}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out")
    ap.add_argument("--skip-9b", action="store_true")
    ap.add_argument("--only", choices=["check", "bundled", "9b"], help="one section (its own process)")
    a = ap.parse_args()
    devices = a.devices.split(",")
    if torch.cuda.device_count() < len(devices):
        print(f"needs {len(devices)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    try:
        model_dir = bundled_model_dir()
        if a.only in (None, "check"):
            check_equal(model_dir, devices)
            stamp("check done")
        if a.only in (None, "bundled"):
            run_bundled(model_dir, devices, a.n)
            stamp("bundled done")
        if a.only in (None, "9b") and not a.skip_9b:
            run_9b(devices, a.n)
            stamp("9B done")
    finally:
        save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
