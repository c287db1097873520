"""The delta-net's decode step from its input rows, per layer: the in_proj product and the step after it (conv,
gates, rule, norm) as two launches (cuBLAS or a gemv variant, then conv_delta_rule_norm) against the gemv kernel's
fused "_dr" form (ops.gemv_conv_delta_rule_norm), on the 9B-like shape (16 key / 32 value heads of 128, K 4096).
Each figure: a CUDA graph of 24 layers (distinct weights and states, PDL as the engine captures), us per layer,
the fastest of 5 replays; then whether the fused form's output, rings and planes equal the two launches'.

    python bench/in_proj_step.py [--rows 1,4] [--variants simt1.w8.s1,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cuda as kc  # noqa: E402

HK, HV, DK, DV, K, LAYERS, PLANES = 16, 32, 128, 128, 4096, 24, 8


def layers(dtype):
    c = 2 * HK * DK + HV * DV
    n = c + HV * DV + 2 * HV
    out = []
    for i in range(LAYERS):
        g = torch.Generator(device="cuda").manual_seed(i)
        out.append(
            {
                "w": (torch.randn(n, K, device="cuda", generator=g) * K**-0.5).to(dtype),
                "conv": (torch.randn(PLANES, c, 3, device="cuda", generator=g)).to(dtype),
                "conv_w": (torch.randn(c, 4, device="cuda", generator=g) * 0.5).to(dtype),
                "state": torch.randn(PLANES, HV, DK, DV, device="cuda", generator=g) * 0.3,
                "nea": -torch.rand(HV, device="cuda", generator=g).mul(2).add(0.05),
                "dtb": torch.randn(HV, device="cuda", generator=g),
                "nw": torch.randn(DV, device="cuda", generator=g) + 1.0,
            }
        )
    return out


def step(lay, start):
    return (lay["conv"], lay["conv_w"], HK, lay["nea"], lay["dtb"], lay["state"], start, lay["nw"], 1e-6)


def two_launches(prod, conv, conv_w, hk, nea, dtb, state, start, nw, eps):
    """The step after the product through kernels.cuda.conv_delta_rule_norm (its own split of the columns, so
    that the script also runs from a tree before ops.in_proj_step: tools/tree_ab.sh step)."""
    t, c = prod.shape[0], conv_w.shape[0]
    qkv, z, b, a = prod.split([c, HV * DV, HV, HV], dim=-1)
    return kc.conv_delta_rule_norm(qkv, conv, conv_w, hk, a, b, nea, dtb, state, start, z.reshape(t, HV, DV), nw, eps)


def graph_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / LAYERS)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--variants", default="simt1.w8.s1,simt1.w4.s1,simt2.w4.s1,tc2.w8.s1,tc2.w4.s1,tc1.w8.s1")
    a = ap.parse_args()
    dtype = torch.bfloat16
    kc.gemv_kernels(torch.device("cuda"), dtype)
    print(f"PDL: {kc.set_pdl(True)}")
    start = torch.tensor([3], device="cuda")
    lays = layers(dtype)
    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, K, device="cuda").to(dtype)
        two = lambda x=x: [  # noqa: E731
            two_launches(F.linear(x, L["w"]), *step(L, start)) for L in lays
        ]
        print(f"{m} rows: cublas + step {graph_us(two):.2f} us a layer")
        for v in a.variants.split(","):
            two = lambda v=v, x=x: [  # noqa: E731
                two_launches(kc.gemv(x, L["w"], v), *step(L, start)) for L in lays
            ]
            one = lambda v=v, x=x: [kc.gemv_conv_delta_rule_norm(x, L["w"], *step(L, start), v) for L in lays]  # noqa: E731
            prod = lambda v=v, x=x: [kc.gemv(x, L["w"], v) for L in lays]  # noqa: E731
            t2, tp = graph_us(two), graph_us(prod)
            if not hasattr(kc, "gemv_conv_delta_rule_norm"):  # an older tree: the two launches only
                print(f"{m} rows {v}: product {tp:.2f}, product + step {t2:.2f} us a layer")
                continue
            t1 = graph_us(one)
            L = lays[0]
            c0, s0 = L["conv"].clone(), L["state"].clone()
            y1 = kc.gemv_conv_delta_rule_norm(x, L["w"], *step(L, start), v)
            c1, s1 = L["conv"].clone(), L["state"].clone()
            L["conv"].copy_(c0)
            L["state"].copy_(s0)
            again = torch.equal(kc.gemv_conv_delta_rule_norm(x, L["w"], *step(L, start), v), y1)
            L["conv"].copy_(c0)
            L["state"].copy_(s0)
            y2 = two_launches(kc.gemv(x, L["w"], v), *step(L, start))
            same = torch.equal(y1, y2), torch.equal(c1, L["conv"]), torch.equal(s1, L["state"])
            diff = (y1.float() - y2.float()).abs()
            bad = (diff > 0).nonzero()
            heads = sorted({int(h) for h in bad[:, 1].tolist()})[:12] if bad.numel() else []
            print(
                f"{m} rows {v}: product {tp:.2f}, product + step {t2:.2f}, fused {t1:.2f} us a layer; "
                f"equal y/conv/state {same}, repeat equal {again}, y max diff {float(diff.max()):.3g} in {bad.shape[0]} elements, heads {heads}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
