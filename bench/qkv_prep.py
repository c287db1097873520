"""The attention layer's input per layer: the packed q|gate, k, v product and attn_prep (q/k norms, RoPE, the cache
write) as two launches (cuBLAS or a gemv variant, then attn_prep) against the gemv kernel's fused "_ap" form
(kernels.cuda.gemv_attn_prep), on the 9B-like shape (16 q heads, 4 kv heads of 256, K 4096). Each figure: a CUDA
graph of 16 layers (distinct weights and caches, PDL as the engine captures), us per layer, the fastest of 5
replays; then whether the fused form's q and caches equal the two launches'.

    python bench/qkv_prep.py [--rows 1,4] [--variants simt1.w4.s1,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from in_proj_step import graph_us  # noqa: E402

from kernels import cuda as kc  # noqa: E402

HQ, HKV, D, K, LAYERS, CTX = 16, 4, 256, 4096, 16, 2048


def two_launches(prod, qnw, knw, eps, inv, kc_, vc_, start, hq):
    """attn_prep of the product's views through kernels.cuda (its own split: also runs from an older tree)."""
    t = prod.shape[0]
    qg, k, v = prod.split([hq * 2 * D, HKV * D, HKV * D], dim=-1)
    qg = qg.reshape(t, hq, 2 * D)
    return kc.attn_prep(qg[..., :D], k.reshape(t, HKV, D), v.reshape(t, HKV, D), qnw, knw, eps, inv, kc_, vc_, start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--variants", default="simt1.w4.s1,simt2.w4.s1,simt1.w8.s1,tc2.w8.s1,tc1.w4.s1")
    a = ap.parse_args()
    dtype = torch.bfloat16
    kc.gemv_kernels(torch.device("cuda"), dtype)
    print(f"PDL: {kc.set_pdl(True)}")
    start = torch.tensor([700], device="cuda")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64))
    lays = []
    for i in range(LAYERS):
        g = torch.Generator(device="cuda").manual_seed(i)
        lays.append(
            {
                "w": (torch.randn((2 * HQ + 2 * HKV) * D, K, device="cuda", generator=g) * K**-0.5).to(dtype),
                "qnw": torch.randn(D, device="cuda", generator=g).to(dtype) * 0.1,
                "knw": torch.randn(D, device="cuda", generator=g).to(dtype) * 0.1,
                "kc": torch.zeros(CTX, HKV, D, device="cuda", dtype=dtype),
                "vc": torch.zeros(CTX, HKV, D, device="cuda", dtype=dtype),
            }
        )

    def prep(L):
        return (L["qnw"], L["knw"], 1e-6, inv, L["kc"], L["vc"], start, HQ)

    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, K, device="cuda").to(dtype)
        two = lambda x=x: [two_launches(F.linear(x, L["w"]), *prep(L)) for L in lays]  # noqa: E731
        print(f"{m} rows: cublas + attn_prep {graph_us(two, LAYERS):.2f} us a layer")
        for v in a.variants.split(","):
            prod = lambda v=v, x=x: [kc.gemv(x, L["w"], v) for L in lays]  # noqa: E731
            two = lambda v=v, x=x: [two_launches(kc.gemv(x, L["w"], v), *prep(L)) for L in lays]  # noqa: E731
            tp, t2 = graph_us(prod, LAYERS), graph_us(two, LAYERS)
            if not hasattr(kc, "gemv_attn_prep"):
                print(f"{m} rows {v}: product {tp:.2f}, product + attn_prep {t2:.2f} us a layer")
                continue
            one = lambda v=v, x=x: [kc.gemv_attn_prep(x, L["w"], *prep(L), v) for L in lays]  # noqa: E731
            t1 = graph_us(one, LAYERS)
            L = lays[0]
            q1, _ = kc.gemv_attn_prep(x, L["w"], *prep(L), v)
            k1, v1 = L["kc"].clone(), L["vc"].clone()
            q2 = two_launches(kc.gemv(x, L["w"], v), *prep(L))
            same = torch.equal(q1, q2) and torch.equal(k1, L["kc"]) and torch.equal(v1, L["vc"])
            print(
                f"{m} rows {v}: product {tp:.2f}, product + attn_prep {t2:.2f}, fused {t1:.2f} us a layer; "
                f"equal q/caches {same}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
