"""Probe: does a product whose weight was brought into L2 while the memory pipe idled (the attention's short-context
splits, the delta rule's tail) run faster, and by how much? One graph of 8 layers with distinct bf16 weights of
N x 4096 (256 MiB at the 9B-like N = 4096, past the L2). Each layer is a stand-in for the latency-bound kernel before
the output projection: a kernel of 4 blocks an SM that waits SPIN microseconds, its blocks first asking L2 for a share
of the next weight (cp.async.bulk.prefetch.L2) when staged. Then comes the projection + add + norm
(gemv_add_rmsnorm, PDL on), or the product alone with --plain.
Prints us a layer, over the stand-in alone, for:
  cold       no prefetch
  staged     the whole weight staged
  staged-el  the same with an evict_last policy
  half       the first half staged
  hot        every layer on one weight, so it could stay in L2
bench/results/h200-l2-stage-2026-12-04.txt has the figures.

    python3 bench/l2_stage.py [--n 4096] [--spin 12,6] [--rows 1,6] [--plain]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import graph_time  # noqa: E402
from kernels import cuda as kc  # noqa: E402
from kernels import ops  # noqa: E402

K = 4096
LAYERS = 8
_SRC = r"""
extern "C" __global__ void spin_pf(const char* pf, unsigned long long bytes, unsigned long long ns, int evict_last) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0 && bytes) {
        unsigned long long share = ((bytes + gridDim.x - 1) / gridDim.x + 255ull) & ~255ull;
        unsigned long long b0 = share * blockIdx.x, b1 = b0 + share < bytes ? b0 + share : bytes;
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        for (unsigned long long o = b0; o < b1; o += 32768ull) {
            unsigned int n = (unsigned int)(b1 - o < 32768ull ? b1 - o : 32768ull);
            if (evict_last)
                asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                             :: "l"(pf + o), "r"(n), "l"(pol) : "memory");
            else
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(pf + o), "r"(n) : "memory");
        }
    }
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spin", default="12,6", help="the stand-in's wait, us (comma list)")
    ap.add_argument("--rows", default="1,6")
    ap.add_argument("--variants", default="auto,tc1.w8.s2,simt1.w8.s1,simt2.w4.s2,tc1.w4.s4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", default="4096", help="the weight's output columns (comma list; K stays 4096)")
    ap.add_argument("--plain", action="store_true", help="the product alone (gemv), not gemv_add_rmsnorm")
    a = ap.parse_args()
    ok, why = ops.use_cuda_kernels(True)
    if not ok:
        print(f"no CUDA kernels: {why}")
        return 1
    import cupy as cp

    kc.set_pdl(True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB")
    spin = cp.RawKernel(_SRC, "spin_pf", options=("-std=c++17",))
    blocks = 4 * props.multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)

    def stand_in(pf: torch.Tensor | None, nbytes: int, us: float, evict_last: int) -> None:
        s = kc._stream(dev)
        ptr = pf.data_ptr() if pf is not None else 0
        args = (cp.uint64(ptr), cp.uint64(nbytes if pf is not None else 0), cp.uint64(int(us * 1000)),
                cp.int32(evict_last))  # fmt: skip
        spin((blocks,), (128,), args, stream=s)

    def timed(run) -> float:  # us a layer: a graph of one run (LAYERS layers), the median of a.reps replays
        return graph_time(run, calls=1, reps=a.reps) / LAYERS * 1e6

    for n in (int(v) for v in a.n.split(",")):
        ws = [torch.randn(n, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(LAYERS)]
        nw = torch.rand(n, device=dev, generator=g) + 0.5
        print(f"== {n}x{K}, {n * K * 2 / 2**20:.0f} MiB a weight")
        whole = n * K * 2
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16, generator=g)
            res = torch.randn(rows, n, device=dev, dtype=torch.bfloat16, generator=g)
            for us in (float(s) for s in a.spin.split(",")):
                alone = timed(lambda us=us, ws=ws: [stand_in(None, 0, us, 0) for _ in ws])
                line = [f"rows {rows} spin {us:g} us: stand-in alone {alone:.2f}"]
                for var in a.variants.split(","):
                    v = None if var == "auto" else var

                    def layer(pf_bytes, evict, v=v, us=us, x=x, res=res, hot=False, ws=ws, nw=nw):
                        for w in ws:
                            w = ws[0] if hot else w
                            stand_in(w if pf_bytes else None, pf_bytes, us, evict)
                            if a.plain:
                                kc.gemv(x, w, v)
                            else:
                                kc.gemv_add_rmsnorm(x, w, res, nw, 1e-6, v)

                    cells = []
                    for tag, nb, ev in (
                        ("cold", 0, 0),
                        ("staged", whole, 0),
                        ("staged-el", whole, 1),
                        ("half", whole // 2, 0),
                    ):
                        cells.append(f"{tag} {timed(lambda nb=nb, ev=ev: layer(nb, ev)) - alone:.2f}")
                    cells.append(f"hot {timed(lambda: layer(0, 0, hot=True)) - alone:.2f}")
                    line.append(f"{var}: " + ", ".join(cells))
                print(" | ".join(line), flush=True)
    # the staged result must be the cold one's (the prefetch moves no data the product sees)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=g)
    res = torch.randn(1, n, device=dev, dtype=torch.bfloat16, generator=g)
    y0, s0 = kc.gemv_add_rmsnorm(x, ws[0], res, nw, 1e-6, None)
    stand_in(ws[0], whole, 2.0, 0)
    y1, s1 = kc.gemv_add_rmsnorm(x, ws[0], res, nw, 1e-6, None)
    torch.cuda.synchronize()
    print(f"equal after staging: {torch.equal(y0, y1) and torch.equal(s0, s1)}")
    print(
        "(columns: us a layer over the stand-in alone: the product (+ add + norm unless --plain) and the boundary; a "
        "copy of 32 MiB at "
        "4.2 TB/s = 8.0 us)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
