"""Where a chained draft step's time goes on the 9B-real model (issue 15: a 32k sub-vocab step should cost a third
of a full-vocabulary one): the captured draft plan replayed alone, its wall time (CUDA events) against the sum of
its kernels' GPU time (torch.profiler), per kernel, for the full vocabulary and a sub-vocab.

    python bench/profile_draft.py [--depth 6] [--subs 0,32768] [--gemm cublas] [--replays 20]
                                  [--attention fold:64,par:64]   (decode attention's combine : least keys a split)

"wall - kernels" is the time the GPU sat between kernels of the graph (launch latency, dependency waits);
"kernels" over the bytes the step reads is how close the kernels themselves come to the copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import QWEN3_NEXT_RATES, REAL_9B, IdsOnly, random_9b_weights  # noqa: E402
from timing import copy_bandwidth, kernel_times  # noqa: E402

from engine import Engine, EngineSettings  # noqa: E402


def draft_graph(eng: Engine, depth: int, sub: int):
    sess = eng.new_session()
    prompt = torch.randint(0, REAL_9B["vocab_size"], (512,), generator=torch.Generator().manual_seed(2)).tolist()
    st = EngineSettings(synthetic_rates=QWEN3_NEXT_RATES, plan_pool=16, draft_depth=depth, chain=True, sub_vocab=sub)
    eng.generate(prompt, 64, st, sess)
    keys = [k for k in sess.plans.graphs if k[0] == "draft" and k[2] == depth]
    if not keys:
        raise SystemExit(f"no captured draft plan of depth {depth} (keys: {list(sess.plans.graphs)})")
    key = max(keys, key=lambda k: k[1])  # the static depth's plan: rows = depth + 1
    return sess, key, sess.plans.graphs[key][0]


def mtp_layer_bytes(eng: Engine) -> int:
    """Bytes of the MTP layer's weight matrices (everything under "mtp.", the head and embedding aside)."""
    return sum(t.numel() * t.element_size() for k, t in eng.model.w.items() if k.startswith("mtp.") and t.dim() == 2)


def profile_one(eng: Engine, depth: int, sub: int, replays: int, bw: float) -> float:
    sess, key, graph = draft_graph(eng, depth, sub)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_name = kernel_times(prof)
    busy = sum(v[0] for v in by_name.values()) / replays
    count = sum(v[1] for v in by_name.values()) / replays
    cfg = eng.model.cfg
    h = cfg.hidden_size
    head = (sub or cfg.vocab_size) * h * 2
    layer = mtp_layer_bytes(eng)
    print(
        f"== draft plan {key[:4]} (depth {depth}, sub-vocab {sub or 'full'}): {wall_us / depth:.1f} us a step "
        f"(graph wall {wall_us:.1f} us), kernels {busy / depth:.1f} us a step, between kernels "
        f"{(wall_us - busy) / depth:.1f} us a step; {count / depth:.1f} kernels a step; head {head / 1e6:.0f} MB"
        + f", MTP layer {layer / 1e6:.0f} MB; the step's bytes at copy bandwidth {1e6 * (head + layer) / bw:.1f} us"
        + " =="
    )
    print(f"{'us/step':>8} {'calls/step':>10}  kernel")
    for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:24]:
        print(f"{t / replays / depth:>8.1f} {c / replays / depth:>10.2f}  {name[:100]}")
    print()
    del sess, graph
    return wall_us / depth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--subs", default="0,32768")
    ap.add_argument("--gemm", default="cublas")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--attention",
        default="",
        help="comma list of COMBINE:MIN_KEYS (kernels.cuda _ATT_COMBINE, _ATT_FOLD_MIN_KEYS) to profile each under",
    )
    ap.add_argument(
        "--no-pdl",
        dest="pdl",
        action="store_false",
        help="plans captured without programmatic dependent launch (under PDL a kernel's span includes its wait)",
    )
    a = ap.parse_args()
    bw = copy_bandwidth()
    eng = Engine.from_factory(
        random_9b_weights, (REAL_9B,), IdsOnly(), Path("random-9b-real"), 4096, [torch.device("cuda")]
    )
    if not a.pdl:  # PDL is the default on sm_90+; before the gemm mode, so that "auto" times its candidates alike
        eng.set_model_option("pdl", False)
    eng.model.set_gemm(a.gemm)
    pdl = "  PDL" if eng.model.pdl else ""
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  gemm {a.gemm}{pdl}")
    from kernels import cuda as kc

    variants = [v.split(":") for v in a.attention.split(",")] if a.attention else [[kc._ATT_COMBINE, None]]
    cfg = eng.model.cfg
    layer = mtp_layer_bytes(eng)
    for combine, min_keys in variants:
        kc._ATT_COMBINE = combine
        if min_keys is not None:
            kc._ATT_FOLD_MIN_KEYS = kc._ATT_FOLD_MIN_KEYS_ONE_ROW = int(min_keys)
        print(f"-- attention combine {combine}, least keys a split {kc._ATT_FOLD_MIN_KEYS}")
        steps = {}
        for sub in (int(s) for s in a.subs.split(",")):
            steps[sub] = profile_one(eng, a.depth, sub, a.replays, bw)
        if 0 in steps:
            for sub, t in steps.items():
                if sub:
                    full_b, sub_b = cfg.vocab_size * cfg.hidden_size * 2 + layer, sub * cfg.hidden_size * 2 + layer
                    print(
                        f"sub-vocab {sub}: draft step {steps[0] / t:.2f}x cheaper than the full vocabulary "
                        f"(at most {full_b / sub_b:.2f}x: the step's bytes read once at copy bandwidth, nothing "
                        "else costing time)"
                    )
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
