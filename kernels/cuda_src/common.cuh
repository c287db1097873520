// Helpers of decode_kernels.cu that the gemv module's fused forms use too (kernels/cuda.py expands each
// `#include "<name>.cuh"` line of a source with the header's text, once, before NVRTC sees it; nvcc finds the
// headers beside the sources). Needs nothing of the including file.
#pragma once

// A kernel's `start`: *p when the pointer is given (a 1-element int64 device tensor, what a captured graph
// reads), else the host value v.
__device__ __forceinline__ long long read_start(const long long* p, long long v) { return p ? *p : v; }

// Non-negative modulo (start is never negative in practice; this keeps a bad value in bounds).
__device__ __forceinline__ long long pmod(long long a, long long n) {
    long long r = a % n;
    return r < 0 ? r + n : r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// The barriers of a block's work that may run on part of it (the rule, attn_prep's rows): NT = 0, the whole block
// (__syncthreads); NT > 0, named barrier 1 over the block's first NT threads (the gemv module's fused forms: the
// block has more threads than that work uses, and the others have left it).
template <int NT>
__device__ __forceinline__ void nt_sync() {
    if constexpr (NT == 0)
        __syncthreads();
    else
        asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
}

// block_sum's arithmetic (decode_kernels.cu) over nt threads (NT as above): every thread gets the sum.
template <int NT>
__device__ __forceinline__ float nt_block_sum(float v, float* sh, int nt) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = nt >> 5;
    nt_sync<NT>();  // sh may still be read by a previous call
    if (lane == 0) sh[w] = v;
    nt_sync<NT>();
    float r = lane < nw ? sh[lane] : 0.f;
    return warp_sum(r);
}

// A load of a projection's columns: CG (a fused form, where other blocks of the same launch stored them) bypasses
// L1; else a plain load (an earlier launch wrote them).
template <bool CG, typename T>
__device__ __forceinline__ T ld_cg_if(const T* p) {
    if constexpr (CG)
        return __ldcg(p);
    else
        return *p;
}
