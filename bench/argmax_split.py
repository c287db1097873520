"""How the greedy pick's split over the vocabulary (kernels/cuda.py _AM_MIN_PER_BLOCK: at least this many logits a
block) sets its time for one row, as the chained draft step runs it (captured, replayed): us a call per split size
and vocabulary. `python bench/argmax_split.py`"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.cuda as kc  # noqa: E402
from kernels import reference as ref  # noqa: E402


def time_us(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * reps)


def main() -> int:
    kc.warm_up("cuda", torch.bfloat16)
    was = kc._AM_MIN_PER_BLOCK
    sizes = (16384, 8192, 4096, 2048, 1024)
    print(f"{'n':>8} " + " ".join(f"{'min ' + str(m):>11}" for m in sizes) + "   (us a call, one row, bf16)")
    for n in (16384, 32768, 65536, 248320):
        lg = (torch.randn(1, n, device="cuda") * 2).to(torch.bfloat16)
        want = ref.argmax_prob(lg, 0)
        row = []
        for m in sizes:
            kc._AM_MIN_PER_BLOCK = m
            tok, prob = kc.argmax_prob(lg, 0)
            assert torch.equal(tok, want[0]), (n, m)
            row.append(time_us(lambda lg=lg: kc.argmax_prob(lg, 0)))
        print(f"{n:>8} " + " ".join(f"{t:>11.2f}" for t in row))
    kc._AM_MIN_PER_BLOCK = was
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
