"""A chain of decode products in one persistent launch, against the same chain as the engine launches it today.

Issue 20's last goals (a 4096x4096 product at 90% of copy bandwidth, a 9B-like token at 85%) are lost at kernel
boundaries: each launch ramps up, drains, and waits for the one before (bench/results/h200-boundaries-*.txt). This
bench measures the one design no per-launch kernel can be: every block of one launch (a whole number per SM, all
resident) runs the products of a chain in turn, and between two products a block

  1. issues the first batch of its warps' weight loads of the next product (registers; weights are never written),
  2. waits until every block has stored its part of the product before (a counter per product, one atomic a block),
  3. makes the next product's input x in shared memory from what the product before stored, already in the form the
     glue needs (bf16; the MLP's silu_mul made by the warp that sums a column's gate and up rows; s = product +
     residual, normed here by every block), then streams the rest of its rows.

So the HBM stream never stops at a boundary: the loads of 1. are in flight during 2. and 3.

Chains (one row, bf16 weights past L2, fp32 sums; modes: the wait and/or the staging left out, to see what each costs):
  square   8 products 4096x4096, each one's output the next one's input (x = bf16(y));
  layer    2 x [o_proj 4096x4096 -> add+norm -> gate|up 24576x4096 -> silu_mul -> down 4096x12288 -> add+norm ->
           in_proj 12352x4096], the next o_proj taking in_proj's first 4096 outputs (the delta-net step left out).
Beside it, the same chain through the engine's kernels (kernels/cuda.py gemv, gemv_add_rmsnorm, gemv_silu_mul with
the variants given, PDL on), timed the same way (engine/gemm.py _graph_seconds: one CUDA graph, fastest of 3).
The persistent chain's last output is checked against a torch reference of the same arithmetic.

    PYTHONPATH=$PWD python3 bench/persistent_chain.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy as cp
import numpy as np
import torch

from bench.timing import copy_bandwidth
from engine.gemm import _graph_seconds
from kernels import cuda as kc
from kernels import pdl

SRC = r"""
typedef unsigned short bf16;

// One product of the chain: W [N, K] (bf16, row-major) @ x, x made in shared memory by `glue` from what the step
// before stored (0: x0; 1: its bf16 output as is; 3: the RMSnorm of its bf16 output s), and stored as `out` says,
// ready for the next step's glue (0: fp32 sums; 1: bf16; 2: the MLP's silu_mul of gate row n and up row n + N/2,
// one warp summing both, so out is bf16 [N/2]; 3: s = bf16(bf16(sum) + res), the new residual stream, bf16).
struct Step {
    const uint4* w;
    void* y;
    int N;
    int K;
    int glue;
    int out;
};

__device__ __forceinline__ uint4 ldw(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ float bf(bf16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ bf16 tobf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
__device__ __forceinline__ float rbf(float f) { return bf(tobf(f)); }
__device__ __forceinline__ void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// x of a product in shared memory (16-byte loads past L1: the step before was stored by other blocks of this launch).
__device__ __forceinline__ void stage_x(const Step& st, const void* py, const bf16* __restrict__ x0,
                                        const float* __restrict__ nw, float eps, uint4* xs4, float* red) {
    const int KV = st.K / 8, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const uint4* src = st.glue == 0 ? (const uint4*)x0 : (const uint4*)py;
    float ss = 0.f;
#pragma unroll 4
    for (int v = threadIdx.x; v < KV; v += blockDim.x) {
        const uint4 a = __ldcg(src + v);
        xs4[v] = a;
        if (st.glue == 3) {
            float f[8];
            unpack(a, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
        }
    }
    if (st.glue == 3) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        if (warp == 0) {
            float t = lane < nwarps ? red[lane] : 0.f;
            t = warp_sum(t);
            if (lane == 0) red[0] = rsqrtf(t / (float)st.K + eps);
        }
        __syncthreads();
        const float inv = red[0];
        for (int v = threadIdx.x; v < KV; v += blockDim.x) {
            float f[8];
            unpack(xs4[v], f);
            const float4 w0 = __ldg((const float4*)nw + 2 * v), w1 = __ldg((const float4*)nw + 2 * v + 1);
            const float wf[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
            bf16 o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = tobf(f[e] * inv * wf[e]);
            xs4[v] = make_uint4(o[0] | ((unsigned int)o[1] << 16), o[2] | ((unsigned int)o[3] << 16),
                                o[4] | ((unsigned int)o[5] << 16), o[6] | ((unsigned int)o[7] << 16));
        }
    }
}

// The chain in one launch: every block (all resident) takes part in every product; before each product it issues
// the first batch of its warps' weight loads (registers), waits for every block's part of the product before (a
// counter a product), stages x, then streams its rows: warp gw takes units gw, gw + TW, ... (C rows each).
// mode (measurement only): 1 skips the wait, 2 skips the staging.
extern "C" __global__ void __launch_bounds__(256) pchain(const Step* __restrict__ steps, int P,
                                                         const bf16* __restrict__ x0, const bf16* __restrict__ res,
                                                         const float* __restrict__ nw, float eps,
                                                         unsigned int* __restrict__ done, int* __restrict__ err,
                                                         int mode) {
    extern __shared__ uint4 xs4[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int gw = blockIdx.x * nwarps + warp, TW = gridDim.x * nwarps;
    for (int p = 0; p < P; ++p) {
        const Step st = steps[p];
        const int KV = st.K / 8;
        const int units = st.N / C;
        const long long pair = st.out == 2 ? (long long)(st.N / 2) * KV : KV;  // row c of a unit: + c * pair
        int u = gw;
        uint4 wv[U][C];
        const uint4* wr = st.w + (long long)u * (st.out == 2 ? 1 : C) * KV;
        if (u < units) {
#pragma unroll
            for (int i = 0; i < U; ++i)
#pragma unroll
                for (int c = 0; c < C; ++c) wv[i][c] = ldw(wr + c * pair + lane + i * 32);
        }
        if (p > 0) {
            if (threadIdx.x == 0 && !(mode & 1)) {
                long long spins = 0;
                while (ld_acquire(done + p - 1) < gridDim.x) {
                    if (++spins > (1LL << 26)) { atomicExch(err, 1); break; }
                }
            }
            __syncthreads();
        }
        if (!(mode & 2)) stage_x(st, p > 0 ? steps[p - 1].y : nullptr, x0, nw, eps, xs4, red);
        __syncthreads();
        bool first = true;
        for (; u < units; u += TW) {
            wr = st.w + (long long)u * (st.out == 2 ? 1 : C) * KV;
            if (!first) {
#pragma unroll
                for (int i = 0; i < U; ++i)
#pragma unroll
                    for (int c = 0; c < C; ++c) wv[i][c] = ldw(wr + c * pair + lane + i * 32);
            }
            first = false;
            float acc[C];
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c] = 0.f;
            for (int v = lane;;) {
#pragma unroll
                for (int i = 0; i < U; ++i) {
                    float xf[8];
                    unpack(xs4[v + i * 32], xf);
#pragma unroll
                    for (int c = 0; c < C; ++c) {
                        float wf[8];
                        unpack(wv[i][c], wf);
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[c] = __fmaf_rn(wf[e], xf[e], acc[c]);
                    }
                }
                v += U * 32;
                if (v >= KV) break;
#pragma unroll
                for (int i = 0; i < U; ++i)
#pragma unroll
                    for (int c = 0; c < C; ++c) wv[i][c] = ldw(wr + c * pair + v + i * 32);
            }
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c] = warp_sum(acc[c]);
            if (lane == 0) {
                if (st.out == 2) {
                    const float g = rbf(acc[0]), up = rbf(acc[C - 1]);
                    ((bf16*)st.y)[u] = tobf(rbf(g / (1.f + __expf(-g))) * up);
                } else {
#pragma unroll
                    for (int c = 0; c < C; ++c) {
                        const int n = u * C + c;
                        if (st.out == 0) ((float*)st.y)[n] = acc[c];
                        else if (st.out == 1) ((bf16*)st.y)[n] = tobf(acc[c]);
                        else ((bf16*)st.y)[n] = tobf(rbf(acc[c]) + bf(res[n]));
                    }
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // this block's part of product p is stored
            __threadfence();
            const unsigned int old = atomicAdd(done + p, 1u);
            if (p == P - 1 && old == gridDim.x - 1) {  // every block has passed every wait: leave the counters at 0
                for (int q = 0; q < P; ++q) done[q] = 0u;
                __threadfence();
            }
        }
    }
}
"""

LAYER = [  # (N, K, glue, name)
    (4096, 4096, "x0", "o_proj"),
    (24576, 4096, "norm", "gate|up"),
    (4096, 12288, "silu", "down"),
    (12352, 4096, "norm", "in_proj"),
    (4096, 4096, "copy", "o_proj"),
    (24576, 4096, "norm", "gate|up"),
    (4096, 12288, "silu", "down"),
    (12352, 4096, "norm", "in_proj"),
]
SQUARE = [(4096, 4096, "x0" if i == 0 else "copy", "sq") for i in range(8)]
GLUE = {"x0": 0, "copy": 1, "silu": 1, "norm": 3}  # the consumer's staging
OUT = {None: 0, "copy": 1, "silu": 2, "norm": 3}  # what the product before the glue stores


def _next_glue(spec, i: int) -> str | None:
    """The glue of the step after step i (None for the last): what step i's output feeds."""
    return spec[i + 1][2] if i + 1 < len(spec) else None


class Chain:
    """Weights (distinct, past L2), outputs, and the reference for one chain spec."""

    def __init__(self, spec, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        self.spec = spec
        self.w = [torch.randn(n, k, device=dev, generator=g).mul_(k**-0.5).to(torch.bfloat16) for n, k, _, _ in spec]
        self.y = [torch.zeros(n, device=dev, dtype=torch.float32) for n, _, _, _ in spec]
        self.x0 = torch.randn(spec[0][1], device=dev, generator=g).to(torch.bfloat16)
        self.res = torch.randn(4096, device=dev, generator=g).to(torch.bfloat16)
        self.nw = (1 + 0.1 * torch.randn(4096, device=dev, generator=g)).float()
        self.nbytes = sum(n * k * 2 for n, k, _, _ in spec)
        desc = np.zeros((len(spec), 4), dtype=np.int64)  # Step: w, y, (N, K), (glue, out)
        for i, (n, k, glue, _) in enumerate(spec):
            desc[i, 0] = self.w[i].data_ptr()
            desc[i, 1] = self.y[i].data_ptr()
            desc[i, 2] = n | (k << 32)
            desc[i, 3] = GLUE[glue] | (OUT[_next_glue(spec, i)] << 32)
        self.desc = torch.from_numpy(desc).to(dev)
        self.done = torch.zeros(len(spec), dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)

    def glue_ref(self, i: int) -> torch.Tensor:
        _, k, glue, _ = self.spec[i]
        if glue == "x0":
            return self.x0
        prev = self.ref_y[i - 1]
        if glue == "copy":
            return prev[:k].to(torch.bfloat16)
        if glue == "silu":
            gt = prev[:k].to(torch.bfloat16).float()
            up = prev[k : 2 * k].to(torch.bfloat16).float()
            return (torch.nn.functional.silu(gt).to(torch.bfloat16).float() * up).to(torch.bfloat16)
        s = (prev[:k].to(torch.bfloat16).float() + self.res.float()).to(torch.bfloat16).float()
        inv = torch.rsqrt(s.pow(2).mean() + 1e-6)
        return (s * inv * self.nw).to(torch.bfloat16)

    def reference(self) -> torch.Tensor:
        self.ref_y = []
        for i in range(len(self.spec)):
            x = self.glue_ref(i)
            self.ref_y.append(self.w[i].float() @ x.float())
        return self.ref_y[-1]


def persistent_seconds(chain: Chain, fn, grid: int, threads: int, smem: int, mode: int = 0) -> float:
    args = (
        np.uint64(chain.desc.data_ptr()), np.int32(len(chain.spec)), np.uint64(chain.x0.data_ptr()), np.uint64(chain.res.data_ptr()), np.uint64(chain.nw.data_ptr()),
        np.float32(1e-6), np.uint64(chain.done.data_ptr()), np.uint64(chain.err.data_ptr()), np.int32(mode),
    )  # fmt: skip

    def run():
        pdl.launch(fn.ptr, (grid, 1, 1), (threads, 1, 1), args, smem, torch.cuda.current_stream().cuda_stream)

    return _graph_seconds(run, torch.device("cuda"))


def engine_seconds(chain: Chain, variants: dict[str, str | None]) -> float:
    """The chain through the engine's kernels as a decode step launches them (PDL on)."""
    eps = 1e-6
    res = chain.res.view(1, -1)
    nwt = chain.nw

    def run():
        x = chain.x0.view(1, -1)
        for i, (*_, name) in enumerate(chain.spec):
            v = variants.get(name)
            nxt = _next_glue(chain.spec, i)
            if name == "gate|up":
                x = kc.gemv_silu_mul(x, chain.w[i], v)
            elif nxt == "norm":
                x, _ = kc.gemv_add_rmsnorm(x, chain.w[i], res, nwt, eps, v)
            else:
                x = kc.gemv(x, chain.w[i], v)
                if nxt == "copy":  # in_proj's first outputs as the next o_proj's input
                    x = x[:, : chain.spec[i + 1][1]]
        return x

    # the _an forms need one eager call before a capture (their counters)
    run()
    torch.cuda.synchronize()
    return _graph_seconds(run, torch.device("cuda"))


def main() -> int:
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"device: {props.name}, {sms} SMs, L2 {props.L2_cache_size >> 20} MiB, copy bandwidth {bw / 1e12:.2f} TB/s")
    kc.set_pdl(True)
    kernels = []  # (label, RawKernel, threads, blocks an SM)
    for c, u, bps in [(2, 4, 2), (2, 4, 3), (2, 2, 2), (2, 2, 4), (2, 8, 1)]:
        rk = cp.RawModule(code=SRC, options=("-std=c++17", f"-DC={c}", f"-DU={u}")).get_function("pchain")
        kernels.append((f"C={c} U={u}", rk, 256, bps))
    modes = {0: "as is", 1: "no wait", 2: "no glue", 3: "neither"}
    for label, spec, eng_variants in (
        ("square", SQUARE, [{"sq": v} for v in (None, "simt2.w4.s2", "simt2.w4.s1", "tc1.w4.s4", "tc1.w8.s2")]),
        (
            "layer",
            LAYER,
            [
                {},
                {"o_proj": "simt2.w4.s2", "gate|up": "simt2.w4.s2", "down": "simt2.w4.s2", "in_proj": "tc2.w8.s1"},
                {"o_proj": "simt2.w4.s2", "gate|up": "simt2.w4.s2", "down": "tc1.w8.s2", "in_proj": "simt2.w4.s1"},
            ],
        ),
    ):
        chain = Chain(spec, dev)
        ref = chain.reference()
        kmax = max(k for _, k, _, _ in spec)
        print(f"\n== chain {label}: {len(spec)} products, {chain.nbytes / 2**20:.0f} MiB of weights ==")
        for v in eng_variants:
            try:
                t = engine_seconds(chain, v)
            except Exception as e:  # a variant a shape does not take
                print(f"engine {v}: {type(e).__name__}: {e}")
                continue
            print(
                f"engine kernels {v or 'defaults'}: {t * 1e6:8.2f} us  {100 * chain.nbytes / t / bw:5.1f}% of copy bw"
            )
        smem = kmax * 2  # x in bf16 (24 KiB at most here: under the 48 KiB a block has without opting in)
        for name, rk, threads, bps in kernels:
            fn = rk.kernel
            fits = kc.occupancy(fn, threads, smem)
            if bps > fits:
                print(
                    f"persistent {name}: skipped, {bps} blocks an SM asked, the driver says {fits} fit (0: it cannot say)"
                )
                continue
            for mode, what in modes.items():
                chain.err.zero_()
                for y in chain.y:
                    y.zero_()
                t = persistent_seconds(chain, fn, sms * bps, threads, smem, mode)
                torch.cuda.synchronize()
                bad = int(chain.err.item())
                rel = float((chain.y[-1] - ref).norm() / ref.norm()) if mode == 0 else float("nan")
                print(
                    f"persistent {name} blocks/SM {bps} [{what}]: {t * 1e6:8.2f} us  "
                    f"{100 * chain.nbytes / t / bw:5.1f}% of copy bw  rel err {rel:.1e}{'  TIMEOUT' if bad else ''}"
                )
        del chain
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
