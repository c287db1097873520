"""Where a 9B-like delta-net layer's kernels spend the time after their product: a timeline from the GPU's global
timer, stamped by each block's thread 0 at named points (the gemv module compiled with GV_TRACE, which
kernels/cuda.py never defines; see gemv_kernels.cu). One graph replays LAYERS layers with distinct weights, each
  in_proj + the delta step (one launch, _dr) -> out_proj + add + norm (_an) -> the MLP + add + norm (resident),
with PDL as the engine captures them; the stamps kept are the last layer's (a launch of the same kind overwrites
them). Per launch, us from its first block's start: when its blocks start, when they have stored their product
(percentiles over blocks), when the serial epilogue (the norm, the rule's pieces) starts and ends, and the
launch's last stamp; and the gap from one launch's last stamp to the next one's first product. Also each launch's
weight bytes at the device's copy bandwidth, and the graph's us a layer with the stamps and without them.

    python bench/tail_trace.py [--layers 6] [--proj simt1.w8.s1] [--mlp res2.w8.s1] [--inproj tc2.w8.s1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import copy_bandwidth, graph_time  # noqa: E402
from kernels import cuda as kc  # noqa: E402

HK, HV, DK, DV, K, INTER, PLANES = 16, 32, 128, 128, 4096, 12288, 8
SLOTS = ("start", "product", "epi start", "epi done", "act done", "barrier", "piece done")


def make_layer(i: int, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(100 + i)
    c = 2 * HK * DK + HV * DV
    n_in = c + HV * DV + 2 * HV

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    return {
        "w_in": rnd(n_in, K, scale=K**-0.5),
        "conv": rnd(PLANES, c, 3),
        "conv_w": rnd(c, 4, scale=0.5),
        "state": torch.randn(PLANES, HV, DK, DV, device="cuda", generator=g) * 0.3,
        "nea": -torch.rand(HV, device="cuda", generator=g).mul(2).add(0.05),
        "dtb": torch.randn(HV, device="cuda", generator=g),
        "gnw": torch.randn(DV, device="cuda", generator=g) + 1.0,
        "w_out": rnd(K, HV * DV, scale=(HV * DV) ** -0.5),
        "nw1": torch.randn(K, device="cuda", generator=g) * 0.1,
        "w_gu": rnd(2 * INTER, K, scale=K**-0.5),
        "w_down": rnd(K, INTER, scale=INTER**-0.5),
        "nw2": torch.randn(K, device="cuda", generator=g) * 0.1,
    }


def layer_bytes(L: dict) -> dict[str, int]:
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"inproj": nb(L["w_in"]), "proj": nb(L["w_out"]), "mlp": nb(L["w_gu"]) + nb(L["w_down"])}


def run_layers(lays, x, r, start, a):
    for L in lays:
        step = (L["conv"], L["conv_w"], HK, L["nea"], L["dtb"], L["state"], start, L["gnw"], 1e-6)
        o = kc.gemv_conv_delta_rule_norm(x, L["w_in"], *step, a.inproj).reshape(1, HV * DV)
        if a.proj_plain:  # the bound: no add + norm after the projection (the MLP reads a stale h)
            kc.gemv(o, L["w_out"], a.proj)
            h, s = x, r
        else:
            h, s = kc.gemv_add_rmsnorm(o, L["w_out"], r, L["nw1"], 1e-6, a.proj)
        x, r = kc.gemv_mlp_add_rmsnorm(h, L["w_gu"], L["w_down"], s, L["nw2"], 1e-6, a.mlp)
    return x, r


def trace_buffers():
    """The gv_trace arrays of the plain gemv module and the DK 128 in_proj module (cupy views)."""
    import cupy as cp

    dev, kind = torch.cuda.current_device(), kc._KIND[torch.bfloat16]
    out = {}
    for dk, label in ((0, "plain"), (128, "dr")):
        mod = kc._gemv_modules[(dev, kind, dk)]
        ptr = mod.get_global("gv_trace")
        out[label] = cp.ndarray((3, 4096, 8), dtype=cp.uint64, memptr=ptr)
    return out


def summarize(name: str, st, t0: int) -> tuple[int, int]:
    """Print one launch's timeline (st: [blocks, 8] stamps, 0 = none); returns (first start, last stamp)."""
    used = st[:, 0] > 0
    st = st[used].astype("int64")
    st[st < st[:, :1]] = 0  # a stamp older than its block's start is an earlier launch's
    us = lambda v: (int(v) - t0) / 1e3  # noqa: E731

    def col(j):
        v = st[:, j]
        return sorted(int(e) for e in v[v > 0])

    first, last = min(col(0)), int(st.max())
    parts = [f"{name:10s} {len(st):4d} blocks: start {us(first):7.2f} (last block {us(max(col(0))):6.2f})"]
    p = col(1)
    if p:
        q = lambda f: p[min(len(p) - 1, int(f * len(p)))]  # noqa: E731
        parts.append(f"product p10 {us(q(0.1)):6.2f} p50 {us(q(0.5)):6.2f} p90 {us(q(0.9)):6.2f} last {us(p[-1]):6.2f}")
    for j in (4, 5, 2, 6, 3):
        v = col(j)
        if v:
            parts.append(f"{SLOTS[j]} {us(v[0]):6.2f}..{us(v[-1]):6.2f}")
    parts.append(f"end {us(last):6.2f}; tail after the last product {((last - p[-1]) / 1e3) if p else 0:5.2f} us")
    print("  " + " | ".join(parts))
    return first, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--proj", default="simt1.w8.s1")
    ap.add_argument("--mlp", default="res2.w8.s1")
    ap.add_argument("--inproj", default="tc2.w8.s1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--proj-plain", action="store_true", help="out_proj without its add + norm (a bound, not a layer)")
    a = ap.parse_args()
    dtype = torch.bfloat16
    dev = torch.device("cuda")
    plain_code = kc._gemv_code
    print(f"device: {torch.cuda.get_device_name()}  PDL: {kc.set_pdl(True)}")
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s")
    lays = [make_layer(i, dtype) for i in range(a.layers)]
    x0 = (torch.randn(1, K, device="cuda") * 0.5).to(dtype)
    r0 = torch.randn(1, K, device="cuda").to(dtype)
    start = torch.tensor([3], device="cuda")
    nbytes = layer_bytes(lays[0])
    print("copy-speed us: " + ", ".join(f"{k} {v / bw * 1e6:.2f}" for k, v in nbytes.items()) + " (weights read once)")

    results = {}
    for traced in (False, True):
        kc._gemv_modules.clear()
        kc._gemv_fns.clear()
        kc._gemv_ready.clear()
        kc._gemv_code = (lambda kind, dk=0: "#define GV_TRACE 1\n" + plain_code(kind, dk)) if traced else plain_code
        kc.gemv_kernels(dev, dtype)
        assert kc.gemv_rule_kernels(dev, dtype, DK)
        x, r = x0.clone(), r0.clone()
        t = graph_time(lambda x=x, r=r: run_layers(lays, x, r, start, a), calls=1, reps=5) * 1e6 / a.layers
        results.setdefault(traced, []).append(t)
        print(f"{'traced  ' if traced else 'untraced'}: {t:.2f} us a layer (in_proj+step, out_proj+norm, MLP)")
        if not traced:
            continue
        bufs = trace_buffers()
        for rep in range(a.reps):
            for b in bufs.values():
                b.fill(0)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run_layers(lays, x, r, start, a)
                with torch.cuda.graph(g, stream=s):
                    run_layers(lays, x, r, start, a)
            torch.cuda.current_stream().wait_stream(s)
            for b in bufs.values():
                b.fill(0)
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            dr, pl = bufs["dr"].get(), bufs["plain"].get()
            t0 = int(dr[2][dr[2][:, 0] > 0][:, 0].min())
            print(f"-- replay {rep}: the last layer, us from the in_proj launch's first block")
            f1, e1 = summarize("in_proj+dr", dr[2], t0)
            f2, e2 = summarize("out_proj+n", pl[0], t0) if not a.proj_plain else (e1, e1)
            f3, e3 = summarize("mlp", pl[1], t0)
            print(
                f"  from one launch's last stamp to the next one's: out_proj {(e2 - e1) / 1e3:.2f} us, "
                f"mlp {(e3 - e2) / 1e3:.2f} us; next launch's first block after the last stamp before it: "
                f"{(f2 - e1) / 1e3:+.2f}, {(f3 - e2) / 1e3:+.2f} us"
            )
            res = [int(v) for v in dr[2][:, :].ravel() if v]
            steps = sorted({(v - t0) % 1000 for v in res})
            print(f"  timer: {len(set(res))} distinct stamps, {len(steps)} distinct sub-us residues (resolution check)")
    kc._gemv_code = plain_code
    print("us a layer, untraced / traced: " + " / ".join(f"{v:.2f}" for v in results[False] + results[True]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
