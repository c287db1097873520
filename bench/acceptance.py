"""Acceptance of the bundled model's MTP head, per workload and draft depth (greedy, engine, any device).

  python bench/acceptance.py [--device cpu] [--n 128] [--depths 1-8] [--model DIR]

Prints mean accepted length (tokens per round, bonus included) and acceptance rate; checks every
speculative output against plain greedy decoding of the same prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.workloads import load_workloads  # noqa: E402
from engine import Engine, EngineSettings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--depths", default="1-8")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    lo, _, hi = a.depths.partition("-")
    depths = list(range(int(lo), int(hi or lo) + 1))
    eng = Engine.load(a.model, device=a.device, dtype=a.dtype)
    wl = load_workloads()
    print(f"model {eng.info['name']}, {a.device} {a.dtype}, greedy, {a.n} new tokens, chain on")
    print("mean accepted length (tokens per round, bonus included) / acceptance rate")
    print(f"{'depth':>5} " + " ".join(f"{w:>15}" for w in wl))
    sess = eng.new_session()
    greedy = {}
    for name, w in wl.items():
        sess.reset()
        greedy[name] = eng.generate(w.prompt_for(eng.tokenizer), a.n, EngineSettings(speculative=False), sess).tokens
    lossless = True
    for d in depths:
        cells = []
        for name, w in wl.items():
            sess.reset()
            r = eng.generate(w.prompt_for(eng.tokenizer), a.n, EngineSettings(draft_depth=d), sess)
            lossless &= r.tokens == greedy[name]
            s = r.stats
            cells.append(f"{s['mean_accepted_length']:.2f} / {100 * s['acceptance_rate']:3.0f}%")
        print(f"{d:>5} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    print("speculative output identical to plain greedy:", lossless)
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
