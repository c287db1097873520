"""Soak: many prompts and 100k+ generated tokens with the knobs toggled every few seconds.

  python bench/soak.py [--tokens 100000] [--device cuda] [--dtype float32] [--toggle-s 2]

A thread flips the session's settings (depth, p_min, chain, sub_vocab, plan_pool) every `--toggle-s`
seconds while runs go on, the way a user drives the app. Every output is checked against plain greedy
decoding of the same prompt (computed once per prompt); GPU memory is printed over time and must not
grow after warm-up. Exit status 1 on any divergence or growth.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings  # noqa: E402


def nvml_used_mib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--toggle-s", type=float, default=2.0)
    ap.add_argument("--n", type=int, default=256, help="new tokens per prompt")
    a = ap.parse_args()
    rng = random.Random(0)
    eng = Engine.load(device=a.device, dtype=a.dtype)
    vocab = eng.cfg.vocab_size
    texts = [w.prompt for w in load_workloads().values()]
    prompts = []
    for t in texts:  # the workloads and slices of them: 20 distinct prompts
        ids = eng.tokenizer.encode(t)
        prompts.append(ids)
        for _ in range(4):
            lo = rng.randrange(0, max(1, len(ids) - 16))
            prompts.append(ids[lo : lo + rng.randrange(8, 64)])
    greedy_sess = eng.new_session()
    greedy = {}
    for p in prompts:
        greedy_sess.reset()
        greedy[tuple(p)] = eng.generate(p, a.n, EngineSettings(speculative=False), greedy_sess).tokens
    sessions = [eng.new_session(), eng.new_session()]
    stop = threading.Event()
    toggles = [0]

    def toggler() -> None:
        while not stop.wait(a.toggle_s):
            s = EngineSettings(
                draft_depth=rng.randint(1, 8),
                p_min=rng.choice([0.0, 0.0, 0.3, 0.6]),
                chain=rng.random() < 0.7,
                sub_vocab=rng.choice([0, 0, vocab // 4, vocab // 2]),
                plan_pool=rng.choice([0, 1, 4, 8, 16]),
            )
            for sess in sessions:
                sess.settings = s
            toggles[0] += 1

    thread = threading.Thread(target=toggler, daemon=True)
    thread.start()
    generated = diverged = runs = 0
    t0 = time.perf_counter()
    samples: list[tuple[int, float, float | None]] = []
    print(f"{'tokens':>8} {'elapsed s':>9} {'t/s':>8} {'torch MiB':>10} {'NVML MiB':>9} {'toggles':>8}")
    try:
        while generated < a.tokens:
            p = rng.choice(prompts)
            sess = sessions[runs % 2]
            sess.reset() if rng.random() < 0.5 else None
            out = eng.generate(p, a.n, None, sess).tokens
            if out != greedy[tuple(p)]:
                diverged += 1
                print(f"DIVERGED on run {runs}: prompt of {len(p)} tokens, settings {sess.settings}")
            generated += len(out)
            runs += 1
            if runs % 25 == 0:
                used = torch.cuda.memory_allocated() / 2**20 if a.device.startswith("cuda") else 0.0
                nv = nvml_used_mib() if a.device.startswith("cuda") else None
                el = time.perf_counter() - t0
                samples.append((generated, used, nv))
                print(
                    f"{generated:>8} {el:>9.1f} {generated / el:>8.0f} {used:>10.1f} {nv if nv is not None else float('nan'):>9.0f} {toggles[0]:>8}",
                    flush=True,
                )
    finally:
        stop.set()
    warm = samples[len(samples) // 4 :] if len(samples) >= 4 else samples
    growth = (max(s[1] for s in warm) - warm[0][1]) if warm else 0.0
    print(f"runs {runs}, generated {generated} tokens, settings toggled {toggles[0]} times")
    print(f"lossless: {runs - diverged}/{runs} runs identical to plain greedy")
    print(f"torch memory growth after warm-up: {growth:.1f} MiB (the plan pools of up to 16 graphs count here)")
    return 1 if diverged or growth > 256 else 0


if __name__ == "__main__":
    sys.exit(main())
