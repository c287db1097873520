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
