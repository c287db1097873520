// SpecDeck decode-path kernels (compiled by CuPy/NVRTC, launched on PyTorch's current stream).
//
// kernels/cuda.py prepends `#define SCALAR_KIND k` (0 = fp32, 1 = bf16, 2 = fp16) and compiles one
// module per (device, dtype). Every kernel mirrors a function of kernels/reference.py; the comments
// name the reference expression each step reproduces, including the roundings to the activation dtype
// that the reference performs (so bf16 results agree to the last bit in most elements).
//
// `start` convention: every kernel that needs the position of the first new token takes
// (const long long* start_ptr, long long start_val): it reads *start_ptr when the pointer is non-null
// (a 1-element int64 device tensor, what a captured CUDA graph reads), else uses start_val.

#ifndef SPECDECK_OWN_HALF
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat16 bf16_t;
typedef __half f16_t;
__device__ __forceinline__ float to_f(bf16_t v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(f16_t v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) { return __float2bfloat16_rn(f); }
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) { return __float2half_rn(f); }
#else
// Fallback when the CUDA half headers cannot be compiled by NVRTC: 2-byte storage types converted
// with the same PTX instructions the headers use (round to nearest even).
struct __align__(2) bf16_t { unsigned short x; };
struct __align__(2) f16_t { unsigned short x; };
__device__ __forceinline__ float to_f(bf16_t v) { return __uint_as_float(((unsigned int)v.x) << 16); }
__device__ __forceinline__ float to_f(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}
#endif

// Programmatic dependent launch (kernels/pdl.py): every kernel opens with PDL_ENTER(): let the next kernel of
// the stream be scheduled, then wait until the previous kernel has completed and its writes are visible. No
// kernel touches global memory before it. Without the launch attribute (or before sm_90) both do nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define PDL_ENTER()
#endif

__device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }

// Round a float to the precision of T (identity for float): reproduces a PyTorch op whose result is T.
template <typename T> __device__ __forceinline__ float rnd(float f) { return to_f(from_f<T>(f)); }

#ifndef SCALAR_KIND
#define SCALAR_KIND 0
#endif
#if SCALAR_KIND == 0
typedef float scalar_t;
#elif SCALAR_KIND == 1
typedef bf16_t scalar_t;
#else
typedef f16_t scalar_t;
#endif

#include "common.cuh"  // read_start, pmod, warp_sum, silu_f

#define NEG_INF __int_as_float(0xff800000)
#define I32_MAX 0x7fffffff

__device__ __forceinline__ long long ll_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long ll_max(long long a, long long b) { return a > b ? a : b; }

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();  // sh may still be read by a previous call
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : 0.f;
    return warp_sum(r);
}


// The attention output, optionally gated: (out.to(dtype) * sigmoid(gate).to(dtype)).to(dtype) when gate is
// non-null (element goff of it), else out.to(dtype).
__device__ __forceinline__ scalar_t gated_out(float o, const scalar_t* __restrict__ gate, long long goff) {
    if (gate == nullptr) return from_f<scalar_t>(o);
    const float g = rnd<scalar_t>(1.0f / (1.0f + expf(-to_f(gate[goff]))));
    return from_f<scalar_t>(rnd<scalar_t>(o) * g);
}

// ------------------------------------------------------------------------------------------------
// rmsnorm / add_rmsnorm / gated_rmsnorm: one block per row of d elements.
// x rows may be strided (row stride xs, elements contiguous); outputs are contiguous [rows, d].
// W is the weight's type: scalar_t (same dtype as x) or float (anything else, upcast on the host).
// ------------------------------------------------------------------------------------------------

// Rows of up to NORM_REG * blockDim.x elements (every launch of kernels/cuda.py: d <= 8 * 1024) keep their
// elements in registers: all loads of a thread are issued before the first use, so a row costs one memory
// latency instead of one per element (a decode step has one row per block; latency is the whole cost).
// Longer rows take the looped path. Both compute the same expressions.
#define NORM_REG 8

// The register path's second half: a row's NORM_REG values a thread holds (v, the sum s; wv, the weight) are
// stored to s (when sr is non-null), summed over the block and normed into y.
__device__ __forceinline__ void norm_store_regs(const float (&v)[NORM_REG], const float (&wv)[NORM_REG],
                                                scalar_t* __restrict__ sr, scalar_t* __restrict__ yr, int d,
                                                float eps, float* sh) {
    const int nt = blockDim.x;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) {
        const int i = threadIdx.x + k * nt;
        if (sr && i < d) sr[i] = from_f<scalar_t>(v[k]);
        ss += v[k] * v[k];
    }
    ss = block_sum(ss, sh);
    const float rs = rsqrtf(ss / (float)d + eps);
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) {
        const int i = threadIdx.x + k * nt;
        if (i < d) yr[i] = from_f<scalar_t>(v[k] * rs * (1.0f + wv[k]));
    }
}

// add_rmsnorm: s = x + residual (one rounding to dtype), y = rmsnorm(s). With r == nullptr it is rmsnorm of x
// (nothing added, s not written): one implementation for both ops.
// add_rmsnorm_row: one row, its pointers given (xr, rr: this row's input and residual; yr, sr: its outputs).
template <typename W>
__device__ __forceinline__ void add_rmsnorm_row(const scalar_t* __restrict__ xr, const scalar_t* __restrict__ rr,
                                                const W* __restrict__ w, scalar_t* __restrict__ yr,
                                                scalar_t* __restrict__ sr, int d, float eps) {
    __shared__ float sh[32];
    const int nt = blockDim.x;
    if (d <= NORM_REG * nt) {
        float v[NORM_REG], wv[NORM_REG];
#pragma unroll
        for (int k = 0; k < NORM_REG; ++k) {
            const int i = threadIdx.x + k * nt;
            const float a = i < d ? to_f(xr[i]) : 0.f;
            v[k] = rr ? rnd<scalar_t>(a + (i < d ? to_f(rr[i]) : 0.f)) : a;  // s = x + residual (in dtype)
            wv[k] = i < d ? to_f(w[i]) : 0.f;
        }
        norm_store_regs(v, wv, sr, yr, d, eps, sh);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += nt) {
        const float v = rr ? rnd<scalar_t>(to_f(xr[i]) + to_f(rr[i])) : to_f(xr[i]);  // s = x + residual
        if (sr) sr[i] = from_f<scalar_t>(v);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float rs = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += nt) {
        const float v = (rr ? rnd<scalar_t>(to_f(xr[i]) + to_f(rr[i])) : to_f(xr[i])) * rs;
        yr[i] = from_f<scalar_t>(v * (1.0f + to_f(w[i])));
    }
}

// One block per row (blockIdx.x) of x [rows, xs] (and r [rows, rs_]); y, s [rows, d].
template <typename W>
__device__ __forceinline__ void add_rmsnorm_impl(const scalar_t* __restrict__ x, long long xs,
                                                 const scalar_t* __restrict__ r, long long rs_,
                                                 const W* __restrict__ w, scalar_t* __restrict__ y,
                                                 scalar_t* __restrict__ s, int d, float eps) {
    const long long row = blockIdx.x;
    add_rmsnorm_row<W>(x + row * xs, r ? r + row * rs_ : nullptr, w, y + row * (long long)d,
                       s ? s + row * (long long)d : nullptr, d, eps);
}

extern "C" __global__ void rmsnorm_ws(const scalar_t* x, long long xs, const scalar_t* w, scalar_t* y, int d,
                                      float eps) {
    PDL_ENTER();
    add_rmsnorm_impl<scalar_t>(x, xs, nullptr, 0, w, y, nullptr, d, eps);
}
extern "C" __global__ void rmsnorm_wf(const scalar_t* x, long long xs, const float* w, scalar_t* y, int d,
                                      float eps) {
    PDL_ENTER();
    add_rmsnorm_impl<float>(x, xs, nullptr, 0, w, y, nullptr, d, eps);
}

extern "C" __global__ void add_rmsnorm_ws(const scalar_t* x, long long xs, const scalar_t* r, long long rs,
                                          const scalar_t* w, scalar_t* y, scalar_t* s, int d, float eps) {
    PDL_ENTER();
    add_rmsnorm_impl<scalar_t>(x, xs, r, rs, w, y, s, d, eps);
}
extern "C" __global__ void add_rmsnorm_wf(const scalar_t* x, long long xs, const scalar_t* r, long long rs,
                                          const float* w, scalar_t* y, scalar_t* s, int d, float eps) {
    PDL_ENTER();
    add_rmsnorm_impl<float>(x, xs, r, rs, w, y, s, d, eps);
}

// mtp_prefc: the MTP head's fc input, y [T, 2d] = cat(rmsnorm(embed[tokens], we), rmsnorm(h, wh)), the
// embedding gather, both norms and the concatenation in one launch (they were four). Grid (T, 2): blockIdx.y 0
// norms the token's embedding row into y[:, :d], 1 the hidden into y[:, d:], each with add_rmsnorm_row (the
// arithmetic of rmsnorm's kernel, so each half equals it bit for bit). A token id outside 0..vocab-1 (never
// one the engine picks) is clamped instead of read out of bounds.
template <typename W>
__device__ __forceinline__ void mtp_prefc_impl(const long long* __restrict__ tokens,
                                               const scalar_t* __restrict__ embed, long long es, long long vocab,
                                               const scalar_t* __restrict__ h, long long hs,
                                               const W* __restrict__ we, const W* __restrict__ wh,
                                               scalar_t* __restrict__ y, int d, float eps) {
    const long long row = blockIdx.x;
    scalar_t* yr = y + row * 2LL * d;
    if (blockIdx.y == 0) {
        long long t = tokens[row];
        t = t < 0 ? 0 : (t >= vocab ? vocab - 1 : t);
        add_rmsnorm_row<W>(embed + t * es, nullptr, we, yr, nullptr, d, eps);
    } else {
        add_rmsnorm_row<W>(h + row * hs, nullptr, wh, yr + d, nullptr, d, eps);
    }
}
extern "C" __global__ void mtp_prefc_ws(const long long* tokens, const scalar_t* embed, long long es,
                                        long long vocab, const scalar_t* h, long long hs, const scalar_t* we,
                                        const scalar_t* wh, scalar_t* y, int d, float eps) {
    PDL_ENTER();
    mtp_prefc_impl<scalar_t>(tokens, embed, es, vocab, h, hs, we, wh, y, d, eps);
}
extern "C" __global__ void mtp_prefc_wf(const long long* tokens, const scalar_t* embed, long long es,
                                        long long vocab, const scalar_t* h, long long hs, const float* we,
                                        const float* wh, scalar_t* y, int d, float eps) {
    PDL_ENTER();
    mtp_prefc_impl<float>(tokens, embed, es, vocab, h, hs, we, wh, y, d, eps);
}

// embed_rmsnorm: the target's first step, residual s [T, d] = embed[ids] and y = rmsnorm(s, w), in one launch
// (they were the embedding gather and rmsnorm's kernel). One block per row, add_rmsnorm_row with no residual
// added (the arithmetic of rmsnorm's kernel: y bit for bit rmsnorm(embedding(ids))). An id outside 0..vocab-1
// (never one the engine passes: prompts are checked against the vocabulary) is clamped, as in mtp_prefc.
template <typename W>
__device__ __forceinline__ void embed_rmsnorm_impl(const long long* __restrict__ ids,
                                                   const scalar_t* __restrict__ embed, long long es,
                                                   long long vocab, const W* __restrict__ w,
                                                   scalar_t* __restrict__ y, scalar_t* __restrict__ s, int d,
                                                   float eps) {
    const long long row = blockIdx.x;
    long long t = ids[row];
    t = t < 0 ? 0 : (t >= vocab ? vocab - 1 : t);
    add_rmsnorm_row<W>(embed + t * es, nullptr, w, y + row * (long long)d, s + row * (long long)d, d, eps);
}
extern "C" __global__ void embed_rmsnorm_ws(const long long* ids, const scalar_t* embed, long long es,
                                            long long vocab, const scalar_t* w, scalar_t* y, scalar_t* s, int d,
                                            float eps) {
    PDL_ENTER();
    embed_rmsnorm_impl<scalar_t>(ids, embed, es, vocab, w, y, s, d, eps);
}
extern "C" __global__ void embed_rmsnorm_wf(const long long* ids, const scalar_t* embed, long long es,
                                            long long vocab, const float* w, scalar_t* y, scalar_t* s, int d,
                                            float eps) {
    PDL_ENTER();
    embed_rmsnorm_impl<float>(ids, embed, es, vocab, w, y, s, d, eps);
}

// store_rows: dst[start + r, :d] = src[r, :d] for the T rows of src (grid T, a block a row): a round's hidden
// rows saved where the MTP head reads them, at the device-side start (one launch; it was an index add and
// index_copy). A row whose place lies outside dst's n_dst rows is not written.
extern "C" __global__ void store_rows(const scalar_t* __restrict__ src, long long ss, scalar_t* __restrict__ dst,
                                      long long ds, const long long* start_ptr, long long start_val, int d,
                                      long long n_dst) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    const long long at = read_start(start_ptr, start_val) + row;
    if (at < 0 || at >= n_dst) return;
    const scalar_t* sr = src + row * ss;
    scalar_t* dr = dst + at * ds;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dr[i] = sr[i];
}

// gated_rmsnorm: y = weight * rmsnorm_plain(x).to(dtype); out = (y * silu(gate.float())).to(dtype).
// With W == scalar_t the product weight * y is a dtype op (rounded to dtype); with W == float it is fp32.
template <typename W, typename G>
__device__ __forceinline__ void gated_rmsnorm_impl(const scalar_t* __restrict__ x, long long xs,
                                                   const G* __restrict__ gate, long long gs,
                                                   const W* __restrict__ w, scalar_t* __restrict__ y, int d,
                                                   float eps) {
    __shared__ float sh[32];
    const long long row = blockIdx.x;
    const scalar_t* xr = x + row * xs;
    const G* gr = gate + row * gs;
    scalar_t* yr = y + row * (long long)d;
    const int nt = blockDim.x;
    if (d <= NORM_REG * nt) {
        float v[NORM_REG], wv[NORM_REG], gv[NORM_REG];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NORM_REG; ++k) {
            const int i = threadIdx.x + k * nt;
            v[k] = i < d ? to_f(xr[i]) : 0.f;
            wv[k] = i < d ? to_f(w[i]) : 0.f;
            gv[k] = i < d ? to_f(gr[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < NORM_REG; ++k) ss += v[k] * v[k];
        ss = block_sum(ss, sh);
        const float rs = rsqrtf(ss / (float)d + eps);
#pragma unroll
        for (int k = 0; k < NORM_REG; ++k) {
            const int i = threadIdx.x + k * nt;
            if (i < d) {
                const float n = rnd<scalar_t>(v[k] * rs);  // y.to(x.dtype)
                const float p = rnd<W>(wv[k] * n);         // weight * y
                yr[i] = from_f<scalar_t>(p * silu_f(gv[k]));
            }
        }
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += nt) {
        const float v = to_f(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float rs = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += nt) {
        const float n = rnd<scalar_t>(to_f(xr[i]) * rs);  // y.to(x.dtype)
        const float p = rnd<W>(to_f(w[i]) * n);           // weight * y
        yr[i] = from_f<scalar_t>(p * silu_f(to_f(gr[i])));
    }
}

#define GATED_RMSNORM(NAME, WT, GT)                                                                   \
    extern "C" __global__ void NAME(const scalar_t* x, long long xs, const GT* gate, long long gs,     \
                                    const WT* w, scalar_t* y, int d, float eps) { PDL_ENTER();                      \
        gated_rmsnorm_impl<WT, GT>(x, xs, gate, gs, w, y, d, eps);                                     \
    }
GATED_RMSNORM(gated_rmsnorm_ws_gs, scalar_t, scalar_t)
GATED_RMSNORM(gated_rmsnorm_ws_gf, scalar_t, float)
GATED_RMSNORM(gated_rmsnorm_wf_gs, float, scalar_t)
GATED_RMSNORM(gated_rmsnorm_wf_gf, float, float)

// ------------------------------------------------------------------------------------------------
// rope_elem: the arithmetic of partial RoPE (kernels/reference.py rope_partial), used by attn_prep.
// ------------------------------------------------------------------------------------------------
// Element d of a RoPE'd row (NeoX pairs d, d +- half; dims >= 2 * half pass through), given the row's
// element x_d and its pair element x_p: the arithmetic of the reference rope_partial.
__device__ __forceinline__ float rope_elem(float x_d, float x_p, int d, int half, long long pos,
                                           const float* __restrict__ inv_freq) {
    if (d >= 2 * half) return x_d;
    const int i = d < half ? d : d - half;
    const float f = (float)pos * inv_freq[i];  // positions.float() * inv_freq
    const float c = rnd<scalar_t>(cosf(f));     // emb.cos().to(dtype)
    const float s = rnd<scalar_t>(sinf(f));
    const float rv = d < half ? -x_p : x_p;     // rotate_half
    return rnd<scalar_t>(x_d * c) + rnd<scalar_t>(rv * s);
}

// ------------------------------------------------------------------------------------------------
// attention_cached: flash-decoding. Grid (S splits, Hq, T); 4 warps per block; each warp runs an
// online softmax over its keys (a key per step, the warp's lanes splitting D: element d = e*32 + lane).
// Query row t (position start + t) sees keys 0 .. start + t. Split s covers a contiguous chunk of
// those keys; with S == 1 the block writes the output, else partial (acc, max, sum) to a workspace
// that attn_combine merges.
// ------------------------------------------------------------------------------------------------
#define ATT_WARPS 4
#define ATT_UNROLL 2
#define ATT_MIN_CHUNK (ATT_WARPS * ATT_UNROLL * 4)  // keys: four steps of every warp of a block

// Query row t's keys n (position start + t: it sees keys 0 .. start + t) and the keys a split of S takes, at least
// min_chunk (key_split, key_busy).
__device__ __forceinline__ void key_chunk(const long long* start_ptr, long long start_val, int t, long long max_ctx,
                                          int S, long long min_chunk, long long& n, long long& chunk) {
    const long long start = read_start(start_ptr, start_val);
    n = ll_max(ll_min(start + t + 1, max_ctx), 0);  // the row's keys
    chunk = ll_max((n + S - 1) / S, min_chunk);      // a split's
}
// The keys [b, e) of split s of S for query row t: the host sizes S for the longest context (it does not know the
// length inside a captured plan), so at short lengths the last splits find no keys (b >= e) and do no work.
__device__ __forceinline__ void key_split(const long long* start_ptr, long long start_val, int t, long long max_ctx,
                                          int S, int s, long long min_chunk, long long& b, long long& e) {
    long long n, chunk;
    key_chunk(start_ptr, start_val, t, max_ctx, S, min_chunk, n, chunk);
    b = (long long)s * chunk;
    e = ll_min(n, b + chunk);
}

// How many of key_split's S splits of row t hold keys (its first ones; at least 1, so a row without keys still
// has a split to write it). (64-bit like key_split: in 32 bits ptxas spilled the fold kernel's registers.)
__device__ __forceinline__ int key_busy(const long long* start_ptr, long long start_val, int t, long long max_ctx,
                                        int S, long long min_chunk) {
    long long n, chunk;
    key_chunk(start_ptr, start_val, t, max_ctx, S, min_chunk, n, chunk);
    const long long nb = (n + chunk - 1) / chunk;
    return nb < 1 ? 1 : nb > S ? S : (int)nb;
}

template <int EPL>
__device__ __forceinline__ void attn_split_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                                const scalar_t* __restrict__ kc, const scalar_t* __restrict__ vc,
                                                const long long* start_ptr, long long start_val, int Hq, int Hkv,
                                                int D, long long max_ctx, float scale, float* __restrict__ ws_acc,
                                                float* __restrict__ ws_ml, scalar_t* __restrict__ out,
                                                const scalar_t* __restrict__ gate, long long gs0, long long gs1) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS], s_w[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][EPL * 32];
    const int S = gridDim.x, T = gridDim.z;
    const int s = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long b, e;
    key_split(start_ptr, start_val, t, max_ctx, S, s, ATT_MIN_CHUNK, b, e);
    const int kvh = h / (Hq / Hkv);
    const long long rstride = (long long)Hkv * D;
    const scalar_t* kb = kc + (long long)kvh * D;
    const scalar_t* vb = vc + (long long)kvh * D;

    float qv[EPL], acc[EPL];
    const scalar_t* qr = q + t * qs0 + h * qs1;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int d = i * 32 + lane;
        qv[i] = d < D ? to_f(qr[d]) : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (long long j0 = b + warp * ATT_UNROLL; j0 < e; j0 += ATT_WARPS * ATT_UNROLL) {
        float sc[ATT_UNROLL];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            const long long j = j0 + u;
            float dot = 0.f;
            if (j < e) {
                const scalar_t* kr = kb + j * rstride;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    if (d < D) dot += qv[i] * to_f(kr[d]);
                }
            }
            sc[u] = dot;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < ATT_UNROLL; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], o);
        }
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            const long long j = j0 + u;
            if (j < e) {
                const float sv = sc[u] * scale;  // (q @ k^T) * scale
                const float mn = fmaxf(m, sv);
                const float corr = expf(m - mn);
                const float p = expf(sv - mn);
                l = l * corr + p;
                const scalar_t* vr = vb + j * rstride;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    const float vv = d < D ? to_f(vr[d]) : 0.f;
                    acc[i] = acc[i] * corr + p * vv;
                }
                m = mn;
            }
        }
    }
    // merge the warps of the block
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) s_acc[warp][i * 32 + lane] = acc[i];
    __syncthreads();
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, s_m[w]);
    float L = 0.f;
    float wt[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
        wt[w] = s_m[w] == NEG_INF ? 0.f : expf(s_m[w] - M);
        L += s_l[w] * wt[w];
    }
    const long long orow = ((long long)t * Hq + h) * D;
    if (S == 1) {
        const float inv = 1.0f / L;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float a = 0.f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) a += s_acc[w][d] * wt[w];
            out[orow + d] = gated_out(a * inv, gate, t * gs0 + h * gs1 + d);
        }
    } else {
        const long long prow = (long long)s * T * Hq + (long long)t * Hq + h;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float a = 0.f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) a += s_acc[w][d] * wt[w];
            ws_acc[prow * D + d] = a;
        }
        if (threadIdx.x == 0) {
            ws_ml[prow * 2] = M;
            ws_ml[prow * 2 + 1] = L;
        }
    }
    (void)s_w;
}

#define ATTN_SPLIT(EPL)                                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                           \
        attn_split_e##EPL(const scalar_t* q, long long qs0, long long qs1, const scalar_t* kc,             \
                          const scalar_t* vc, const long long* start_ptr, long long start_val, int Hq,      \
                          int Hkv, int D, long long max_ctx, float scale, float* ws_acc, float* ws_ml,      \
                          scalar_t* out, const scalar_t* gate, long long gs0, long long gs1) { PDL_ENTER();             \
        attn_split_impl<EPL>(q, qs0, qs1, kc, vc, start_ptr, start_val, Hq, Hkv, D, max_ctx, scale, ws_acc, \
                             ws_ml, out, gate, gs0, gs1);                                                  \
    }
ATTN_SPLIT(1)
ATTN_SPLIT(2)
ATTN_SPLIT(4)
ATTN_SPLIT(8)

// attention_cached, vector form for decode rows (the default for one query token): grid (S splits, Hkv, T).
// A block serves the G query heads of ONE kv head (the GQA group), so each K/V row is read from memory once
// per group, not once per head. A key row is read by LPR lanes (LPR = the power of two >= D / 8), each lane
// loading its 8 contiguous features with 16-byte loads; a warp covers 32 / LPR keys a step and issues the K
// AND the V loads of U steps (U = 2 or 4) before using any of them (V does not depend on the scores), so a warp keeps
// 2 * U 16-byte loads a lane in flight. Scores are kept in the log2 domain (q pre-scaled by
// scale * log2(e), exp2); the partial max written for attn_combine is converted back to the natural log.
// Keys past the split's end are never loaded and weigh exactly 0 (no 0 * inf). Host: D % 8 == 0, D <= 256,
// K/V rows 16-byte aligned, G = Hq / Hkv in {1, 2, 4, 8}.
#define AV_WARPS 4
#define AV_RAW (sizeof(scalar_t) == 4 ? 2 : 1)  // 16-byte words per 8 features
#define AV_MIN_KEYS 64
#define ATT_MAX_SPLITS 256  // the most key splits a combine merges (kernels/cuda.py: _ATT_VEC_MAX_SPLITS)
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

struct Raw8 {
    uint4 r[AV_RAW];
};

__device__ __forceinline__ Raw8 raw8_load(const scalar_t* __restrict__ p) {
    Raw8 v;
    const uint4* s = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < AV_RAW; ++i) v.r[i] = __ldg(s + i);
    return v;
}

__device__ __forceinline__ Raw8 raw8_zero() {
    Raw8 v;
#pragma unroll
    for (int i = 0; i < AV_RAW; ++i) v.r[i] = make_uint4(0u, 0u, 0u, 0u);
    return v;
}

__device__ __forceinline__ unsigned int raw8_word(const Raw8& v, int w) {
    const uint4& q = v.r[w >> 2];
    switch (w & 3) {
        case 0: return q.x;
        case 1: return q.y;
        case 2: return q.z;
        default: return q.w;
    }
}

// Feature i (0..7) of the 8 loaded, as float (exact: the same value to_f gives).
__device__ __forceinline__ float raw8_at(const Raw8& v, int i) {
#if SCALAR_KIND == 0
    return __uint_as_float(raw8_word(v, i));
#elif SCALAR_KIND == 1
    const unsigned int w = raw8_word(v, i >> 1);
    return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
#else
    const unsigned int w = raw8_word(v, i >> 1);
    const unsigned short b = (i & 1) ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
#endif
}

// The butterfly form of a vec step for 4 query heads and 2 key steps with a key row across the whole warp
// (LPR 32): the 8 partial dots are reduce-scattered over the lanes (9 shuffles instead of 40; lane L ends with
// the full dot of value L >> 2 = u * 4 + g), each lane takes the exponent of its own value only (1 instead of
// 8), and the probabilities and new maxima are broadcast back (12 shuffles). `m` is the running max per head
// (the same in every lane); out: p_all[u][g] (0 for a masked key) and mx_all[g], the new max of head g.
__device__ __forceinline__ void butterfly_step(const float (&sc)[2][4], const bool (&ok)[2], const float (&m)[4],
                                               int lane, float (&p_all)[2][4], float (&mx_all)[4]) {
    const unsigned full = 0xffffffffu;
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
    float c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // keep the values whose bit 2 is b4, send the others
        const float send = b4 ? sc[0][i] : sc[1][i];
        const float keep = b4 ? sc[1][i] : sc[0][i];
        c[i] = keep + __shfl_xor_sync(full, send, 16);
    }
    float d[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // then bit 1 by b3
        const float send = b3 ? c[i] : c[i + 2];
        const float keep = b3 ? c[i + 2] : c[i];
        d[i] = keep + __shfl_xor_sync(full, send, 8);
    }
    float e = (b2 ? d[1] : d[0]) + __shfl_xor_sync(full, b2 ? d[0] : d[1], 4);  // then bit 0 by b2
    e += __shfl_xor_sync(full, e, 2);
    e += __shfl_xor_sync(full, e, 1);
    // this lane's value: key step u = b4, head g = 2 * b3 + b2
    const int g = (b3 ? 2 : 0) + (b2 ? 1 : 0);
    const bool okl = b4 ? ok[1] : ok[0];
    const float sv = okl ? e : NEG_INF;
    const float mg = g == 0 ? m[0] : g == 1 ? m[1] : g == 2 ? m[2] : m[3];
    const float mx = fmaxf(mg, fmaxf(sv, __shfl_xor_sync(full, sv, 16)));  // the same head's other key
    const float p = okl ? exp2f(e - mx) : 0.f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int h = 0; h < 4; ++h) p_all[u][h] = __shfl_sync(full, p, ((u << 2) | h) << 2);
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) mx_all[h] = __shfl_sync(full, mx, h << 2);
}

// FOLD (attn_vecb_u2_g4_f): the combine of the splits inside the same launch. key_split gives the keys to the
// first NB splits of a row (NB = key_busy: a short context in a cache sized for a long one leaves most splits
// empty), and only those take part: each counts itself in at cnt[t * Hkv + kvh] once its partial is stored, and
// the last (which leaves the counter at zero) merges the NB partials of the kv head's G query heads; an empty
// split returns at once (no partial, no count: the merge skipped an empty split's zero weight anyway, so the
// same bits as counting all S). Warp g finds head g's max,
// its splits that hold keys (in split order, compacted) and their weights, and the weights' total (lane-strided,
// then a butterfly: a fixed order); then a thread sums 8 consecutive features of one head over those splits in
// split order, two 16-byte loads a split and four splits' loads in flight, and writes them gated. The sums are
// attn_combine_par's (same order and operations); the total's order differs (within a rounding of it).
template <int G>
__device__ __noinline__ void attn_fold_tail(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                            scalar_t* __restrict__ out, const scalar_t* __restrict__ gate,
                                            long long gs0, long long gs1, int S, int T, int Hq, int Hkv, int D,
                                            int t, int kvh, int* cnt) {
    __shared__ int last;
    __shared__ int s_n[G];
    __shared__ int s_idx[G][ATT_MAX_SPLITS];
    __shared__ float s_w[G][ATT_MAX_SPLITS];
    __shared__ float s_inv[G];
    __syncthreads();  // the block's partial is stored
    if (threadIdx.x == 0) {
        int old;  // release: this block's partial; acquire: the other splits'
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt + t * Hkv + kvh) : "memory");
        last = old == S - 1;  // S: the row's busy splits (see above)
        if (last) cnt[t * Hkv + kvh] = 0;
    }
    __syncthreads();
    if (!last) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const long long sstride = (long long)T * Hq;
    for (int g = warp; g < G; g += nw) {
        const long long base = (long long)t * Hq + kvh * G + g;
        float mx = NEG_INF;
        for (int j = lane; j < S; j += 32) mx = fmaxf(mx, __ldcg(ws_ml + (j * sstride + base) * 2));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float l = 0.f;
        int n = 0;
        for (int j0 = 0; j0 < S; j0 += 32) {
            const int j = j0 + lane;
            const float ms = j < S ? __ldcg(ws_ml + (j * sstride + base) * 2) : NEG_INF;
            const float w = ms == NEG_INF ? 0.f : expf(ms - mx);
            if (w != 0.f) l += w * __ldcg(ws_ml + (j * sstride + base) * 2 + 1);
            const unsigned held = __ballot_sync(0xffffffffu, w != 0.f);
            if (w != 0.f) {
                const int at = n + __popc(held & ((1u << lane) - 1u));
                s_idx[g][at] = j;
                s_w[g][at] = w;
            }
            n += __popc(held);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            s_inv[g] = 1.0f / l;
            s_n[g] = n;
        }
    }
    __syncthreads();
    for (int x8 = threadIdx.x; x8 < G * D / 8; x8 += blockDim.x) {
        const int g = x8 * 8 / D, d0 = x8 * 8 - g * D;
        const long long base = (long long)t * Hq + kvh * G + g;
        const float* acc0 = ws_acc + base * D + d0;
        const long long jstride = sstride * D;
        const int n = s_n[g];
        float a[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = 0.f;
        int jj = 0;
        for (; jj + 4 <= n; jj += 4) {
            float4 v[4][2];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float4* p = reinterpret_cast<const float4*>(acc0 + s_idx[g][jj + u] * jstride);
                v[u][0] = __ldcg(p);
                v[u][1] = __ldcg(p + 1);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float w = s_w[g][jj + u];
                a[0] += v[u][0].x * w;
                a[1] += v[u][0].y * w;
                a[2] += v[u][0].z * w;
                a[3] += v[u][0].w * w;
                a[4] += v[u][1].x * w;
                a[5] += v[u][1].y * w;
                a[6] += v[u][1].z * w;
                a[7] += v[u][1].w * w;
            }
        }
        for (; jj < n; ++jj) {
            const float4* p = reinterpret_cast<const float4*>(acc0 + s_idx[g][jj] * jstride);
            const float4 v0 = __ldcg(p), v1 = __ldcg(p + 1);
            const float w = s_w[g][jj];
            a[0] += v0.x * w;
            a[1] += v0.y * w;
            a[2] += v0.z * w;
            a[3] += v0.w * w;
            a[4] += v1.x * w;
            a[5] += v1.y * w;
            a[6] += v1.z * w;
            a[7] += v1.w * w;
        }
        const float inv = s_inv[g];
        const long long goff = t * gs0 + (kvh * G + g) * gs1 + d0;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[base * D + d0 + i] = gated_out(a[i] * inv, gate, goff + i);
    }
}

template <int G, int U, bool BF, bool FOLD = false>
__device__ __forceinline__ void attn_vec_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                              const scalar_t* __restrict__ kc, const scalar_t* __restrict__ vc,
                                              const long long* start_ptr, long long start_val, int Hq, int Hkv,
                                              int D, long long max_ctx, float scale, float* __restrict__ ws_acc,
                                              float* __restrict__ ws_ml, scalar_t* __restrict__ out,
                                              const scalar_t* __restrict__ gate, long long gs0, long long gs1,
                                              int* cnt = nullptr, int min_keys = AV_MIN_KEYS) {
    __shared__ float s_m[AV_WARPS][G], s_l[AV_WARPS][G];
    __shared__ float s_acc[AV_WARPS][G][256];
    const int S = gridDim.x, T = gridDim.z;
    const int s = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lpr = 1;
    while (lpr * 8 < D) lpr <<= 1;
    const int rpw = 32 / lpr;  // keys a warp step
    const int sub = lane / lpr, li = lane & (lpr - 1);
    const int d0 = li * 8;
    const bool act = d0 < D;
    const int lanes_keys = AV_WARPS * rpw;  // keys a block step
    const long long step = (long long)lanes_keys * U;
    long long b, e;
    // At least AV_MIN_KEYS keys a split: a short context keeps a few busy splits instead of many one-step ones
    // (each pays its partial's write and the combine's read)
    const long long least = step > min_keys ? step : min_keys;
    key_split(start_ptr, start_val, t, max_ctx, S, s, least, b, e);
    if (FOLD && b >= e && s > 0) return;  // an empty split, past the busy ones: not in the fold (see there)
    if (b >= e && S > 1) {  // no keys here: a neutral partial; attn_combine never reads a weight-0 accumulator
        for (int x = threadIdx.x; x < G; x += blockDim.x) {
            const long long prow = (long long)s * T * Hq + (long long)t * Hq + kvh * G + x;
            ws_ml[prow * 2] = NEG_INF;
            ws_ml[prow * 2 + 1] = 0.f;
        }
        if (FOLD) {
            const int busy = key_busy(start_ptr, start_val, t, max_ctx, S, least);
            attn_fold_tail<G>(ws_acc, ws_ml, out, gate, gs0, gs1, busy, T, Hq, Hkv, D, t, kvh, cnt);
        }
        return;
    }
    const long long rstride = (long long)Hkv * D;
    const scalar_t* kb = kc + (long long)kvh * D + d0;
    const scalar_t* vb = vc + (long long)kvh * D + d0;
    const float qscale = scale * LOG2E_F;

    float qv[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const scalar_t* qr = q + t * qs0 + (long long)(kvh * G + g) * qs1 + d0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            qv[g][i] = act ? to_f(qr[i]) * qscale : 0.f;
            acc[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    // The loop bound is the same for the whole warp (the shuffles below need every lane): a lane's key is
    // j0 + sub + u * lanes_keys, masked by ok[] past the split's end. The next step's K and V are loaded
    // (into nk/nv) before this step's are used, so a warp's loads overlap its own arithmetic.
    Raw8 nk[U], nv[U];
    bool nok[U];
    auto fetch = [&](long long j0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long j = j0 + sub + (long long)u * lanes_keys;
            nok[u] = j < e;
            if (nok[u] && act) {
                nk[u] = raw8_load(kb + j * rstride);
                nv[u] = raw8_load(vb + j * rstride);
            } else {
                nk[u] = raw8_zero();
                nv[u] = raw8_zero();
            }
        }
    };
    fetch(b + warp * rpw);
    for (long long j0 = b + warp * rpw; j0 < e; j0 += step) {
        Raw8 kr[U], vr[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            kr[u] = nk[u];
            vr[u] = nv[u];
            ok[u] = nok[u];
        }
        if (j0 + step < e) fetch(j0 + step);
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += qv[g][i] * raw8_at(kr[u], i);
                sc[u][g] = dot;
            }
        }
        if constexpr (BF) {  // G == 4, U == 2, LPR == 32 (the host's condition)
            float p_all[2][4], mx_all[4];
            butterfly_step(sc, ok, m, lane, p_all, mx_all);
#pragma unroll
            for (int g = 0; g < 4; ++g) {
                if (mx_all[g] > m[g]) {
                    const float corr = exp2f(m[g] - mx_all[g]);
                    l[g] *= corr;
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
                    m[g] = mx_all[g];
                }
                l[g] += p_all[0][g] + p_all[1][g];
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    acc[g][i] += p_all[0][g] * raw8_at(vr[0], i) + p_all[1][g] * raw8_at(vr[1], i);
            }
        } else {  // the general form: every lane reduces and weighs every value
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            if (o < lpr) {  // uniform over the warp: a row's lanes sum their partial dots
#pragma unroll
                for (int u = 0; u < U; ++u) {
#pragma unroll
                    for (int g = 0; g < G; ++g) sc[u][g] += __shfl_xor_sync(0xffffffffu, sc[u][g], o);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (ok[u]) mx = fmaxf(mx, sc[u][g]);
            if (mx > m[g]) {  // a new running max: rescale what was summed (m = -inf before the first key: 0)
                const float corr = exp2f(m[g] - mx);
                l[g] *= corr;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
                m[g] = mx;
            }
            float p[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                p[u] = ok[u] ? exp2f(sc[u][g] - mx) : 0.f;
                l[g] += p[u];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float a = acc[g][i];
#pragma unroll
                for (int u = 0; u < U; ++u) a += p[u] * raw8_at(vr[u], i);
                acc[g][i] = a;
            }
        }
        }
    }
    // merge the key streams of a warp (lanes with the same features, other keys)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (o >= lpr) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
                const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
                const float mx = fmaxf(m[g], mo);
                const float wa = m[g] == NEG_INF ? 0.f : exp2f(m[g] - mx);
                const float wb = mo == NEG_INF ? 0.f : exp2f(mo - mx);
                l[g] = l[g] * wa + lo * wb;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                    acc[g][i] = acc[g][i] * wa + ao * wb;
                }
                m[g] = mx;
            }
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (li == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
            if (act) {
#pragma unroll
                for (int i = 0; i < 8; ++i) s_acc[warp][g][d0 + i] = acc[g][i];
            }
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < G * D; x += blockDim.x) {
        const int g = x / D, d = x - g * D;
        const int h = kvh * G + g;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < AV_WARPS; ++w) M = fmaxf(M, s_m[w][g]);
        float L = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < AV_WARPS; ++w) {
            const float wt = s_m[w][g] == NEG_INF ? 0.f : exp2f(s_m[w][g] - M);
            L += s_l[w][g] * wt;
            a += s_acc[w][g][d] * wt;
        }
        if (S == 1) {
            out[((long long)t * Hq + h) * D + d] = gated_out(a / L, gate, t * gs0 + h * gs1 + d);
        } else {
            const long long prow = (long long)s * T * Hq + (long long)t * Hq + h;
            ws_acc[prow * D + d] = a;
            if (d == 0) {
                ws_ml[prow * 2] = M == NEG_INF ? NEG_INF : M * LN2_F;
                ws_ml[prow * 2 + 1] = L;
            }
        }
    }
    if (FOLD && S > 1) {  // (the busy splits worked out here, after the key loop: no register held over it)
        const int busy = key_busy(start_ptr, start_val, t, max_ctx, S, least);
        attn_fold_tail<G>(ws_acc, ws_ml, out, gate, gs0, gs1, busy, T, Hq, Hkv, D, t, kvh, cnt);
    }
}

#define ATTN_VEC(G, U)                                                                                     \
    extern "C" __global__ void __launch_bounds__(AV_WARPS * 32)                                            \
        attn_vec_u##U##_g##G(const scalar_t* q, long long qs0, long long qs1, const scalar_t* kc, const scalar_t* vc, \
                      const long long* start_ptr, long long start_val, int Hq, int Hkv, int D,             \
                      long long max_ctx, float scale, float* ws_acc, float* ws_ml, scalar_t* out,          \
                      const scalar_t* gate, long long gs0, long long gs1) { PDL_ENTER();                   \
        attn_vec_impl<G, U, false>(q, qs0, qs1, kc, vc, start_ptr, start_val, Hq, Hkv, D, max_ctx, scale, ws_acc, \
                                  ws_ml, out, gate, gs0, gs1);                                             \
    }
ATTN_VEC(1, 2)
ATTN_VEC(1, 4)
ATTN_VEC(2, 2)
ATTN_VEC(2, 4)
ATTN_VEC(4, 2)
ATTN_VEC(4, 4)
ATTN_VEC(8, 2)
ATTN_VEC(8, 4)

// The butterfly form (butterfly_step): 4 query heads a kv head, head_dim 129..256, key steps of 2. At least 4
// blocks a SM (128 registers; 157 unbounded, 3 blocks a SM, measured with nvcc 13 -Xptxas -v, no spills).
extern "C" __global__ void __launch_bounds__(AV_WARPS * 32, 4)
    attn_vecb_u2_g4(const scalar_t* q, long long qs0, long long qs1, const scalar_t* kc, const scalar_t* vc,
                    const long long* start_ptr, long long start_val, int Hq, int Hkv, int D, long long max_ctx,
                    float scale, float* ws_acc, float* ws_ml, scalar_t* out, const scalar_t* gate, long long gs0,
                    long long gs1) {
    PDL_ENTER();
    attn_vec_impl<4, 2, true>(q, qs0, qs1, kc, vc, start_ptr, start_val, Hq, Hkv, D, max_ctx, scale, ws_acc, ws_ml,
                              out, gate, gs0, gs1);
}

// The butterfly form with the splits' combine in the same launch (FOLD above) and the least keys a split takes
// as a parameter; cnt: T * Hkv counters, zero between launches.
extern "C" __global__ void __launch_bounds__(AV_WARPS * 32, 4)
    attn_vecb_u2_g4_f(const scalar_t* q, long long qs0, long long qs1, const scalar_t* kc, const scalar_t* vc,
                      const long long* start_ptr, long long start_val, int Hq, int Hkv, int D, long long max_ctx,
                      float scale, float* ws_acc, float* ws_ml, scalar_t* out, const scalar_t* gate, long long gs0,
                      long long gs1, int* cnt, int min_keys) {
    PDL_ENTER();
    attn_vec_impl<4, 2, true, true>(q, qs0, qs1, kc, vc, start_ptr, start_val, Hq, Hkv, D, max_ctx, scale, ws_acc,
                                    ws_ml, out, gate, gs0, gs1, cnt, min_keys);
}

// attention_cached, tiled form (the default): grid (S splits, Hkv, row groups); 4 warps per block.
// A block owns up to RB = 4 * RPW query rows of ONE kv head (rows r = t * rep + (h % rep), so the T query
// tokens and the GQA heads of the group share every K/V tile loaded to shared memory). Per tile of KT
// keys: scores with lane = key (dot over D from shared memory), an online-softmax update per row (the
// row's own causal limit start + t), then P.V with lane = feature. Output / partials as attn_split.
#define ATT_TILE_KT (sizeof(scalar_t) == 4 ? 16 : 32)
#define ATT_TILE_RPW (sizeof(scalar_t) == 4 ? 2 : 4)

template <int EPL>
__device__ __forceinline__ void attn_tile_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                               const scalar_t* __restrict__ kc, const scalar_t* __restrict__ vc,
                                               const long long* start_ptr, long long start_val, int T, int Hq,
                                               int Hkv, int D, long long max_ctx, float scale, int vec_ok,
                                               float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                                               scalar_t* __restrict__ out, const scalar_t* __restrict__ gate,
                                               long long gs0, long long gs1) {
    constexpr int DP = EPL * 32;
    constexpr int NW = ATT_WARPS;
    constexpr int KT = ATT_TILE_KT;
    constexpr int RPW = ATT_TILE_RPW;
    constexpr int RB = NW * RPW;
    constexpr int NP = 32 / KT;
    constexpr int DPP = DP / NP;
    constexpr int PADK = 4 / (int)sizeof(scalar_t);
    __shared__ __align__(16) scalar_t sQ[RB][DP];
    __shared__ __align__(16) scalar_t sK[KT][DP + PADK];
    __shared__ __align__(16) scalar_t sV[KT][DP];
    __shared__ float sP[RB][KT];

    const int S = gridDim.x, s = blockIdx.x, kvh = blockIdx.y, rg = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rep = Hq / Hkv;
    const int R = T * rep;
    const int row0 = rg * RB;
    const int nrows = R - row0 < RB ? R - row0 : RB;
    const long long start = read_start(start_ptr, start_val);
    const long long N = ll_max(0, ll_min(start + T, max_ctx));
    long long chunk = (N + S - 1) / S;
    chunk = ll_max((chunk + KT - 1) / KT * KT, 2 * KT);  // whole tiles, at least two (see ATT_MIN_CHUNK)
    const long long b = (long long)s * chunk;
    const long long e = ll_min(N, b + chunk);
    const long long rstride = (long long)Hkv * D;
    const scalar_t* kb = kc + (long long)kvh * D;
    const scalar_t* vb = vc + (long long)kvh * D;
    const scalar_t zero = from_f<scalar_t>(0.f);

    // Every load of a thread is issued before the first store (one memory latency, not one per element).
    constexpr int QPT = (RB * DP + NW * 32 - 1) / (NW * 32);
    {
        float qv[QPT];
#pragma unroll
        for (int u = 0; u < QPT; ++u) {
            const int i = threadIdx.x + u * NW * 32;
            const int r = i / DP, d = i - r * DP;
            qv[u] = 0.f;
            if (i < RB * DP && r < nrows && d < D) {
                const int gr = row0 + r;
                const int t = gr / rep, h = kvh * rep + gr % rep;
                qv[u] = to_f(q[t * qs0 + h * qs1 + d]);
            }
        }
#pragma unroll
        for (int u = 0; u < QPT; ++u) {
            const int i = threadIdx.x + u * NW * 32;
            if (i < RB * DP) sQ[i / DP][i % DP] = from_f<scalar_t>(qv[u]);
        }
    }
    for (int i = threadIdx.x; i < KT * (DP + PADK - D); i += blockDim.x) {
        const int j = i / (DP + PADK - D);
        sK[j][D + i - j * (DP + PADK - D)] = zero;
    }
    for (int i = threadIdx.x; i < KT * (DP - D); i += blockDim.x) {
        const int j = i / (DP - D);
        sV[j][D + i - j * (DP - D)] = zero;
    }

    int nsl = 0;  // live slots of this warp: rows warp + NW * r < nrows (a prefix of r)
    float m[RPW], l[RPW], acc[RPW][EPL];
    long long nrow[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int lr = warp + NW * r;
        if (lr < nrows) nsl = r + 1;
        const int t = (row0 + lr) / rep;
        nrow[r] = lr < nrows ? ll_min(start + t + 1, max_ctx) : 0;
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) acc[r][i] = 0.f;
    }
    const int kk = lane % KT, part = lane / KT;

    for (long long j0 = b; j0 < e; j0 += KT) {
        const int kv = (int)ll_min(KT, e - j0);
        __syncthreads();  // the previous tile is consumed (first pass: sQ and the pads are written)
        if (vec_ok) {
            // The tile's 16-byte chunks: all loads of a thread first, then the shared-memory stores.
            constexpr int VEC = 16 / (int)sizeof(scalar_t);
            constexpr int KVPT = (KT * DP / VEC + NW * 32 - 1) / (NW * 32);
            const int cpr = D / VEC;
            const int nch = kv * cpr;
            uint4 kx[KVPT], vx[KVPT];
#pragma unroll
            for (int u = 0; u < KVPT; ++u) {
                const int c = threadIdx.x + u * NW * 32;
                if (c < nch) {
                    const int jj = c / cpr, dd = (c - jj * cpr) * VEC;
                    const long long goff = (j0 + jj) * rstride + dd;
                    kx[u] = *reinterpret_cast<const uint4*>(kb + goff);
                    vx[u] = *reinterpret_cast<const uint4*>(vb + goff);
                }
            }
#pragma unroll
            for (int u = 0; u < KVPT; ++u) {
                const int c = threadIdx.x + u * NW * 32;
                if (c < nch) {
                    const int jj = c / cpr, dd = (c - jj * cpr) * VEC;
                    unsigned int* dk = reinterpret_cast<unsigned int*>(&sK[jj][dd]);
                    dk[0] = kx[u].x;
                    dk[1] = kx[u].y;
                    dk[2] = kx[u].z;
                    dk[3] = kx[u].w;
                    *reinterpret_cast<uint4*>(&sV[jj][dd]) = vx[u];
                }
            }
        } else {
            for (int c = threadIdx.x; c < kv * D; c += blockDim.x) {
                const int jj = c / D, dd = c - jj * D;
                const long long goff = (j0 + jj) * rstride + dd;
                sK[jj][dd] = kb[goff];
                sV[jj][dd] = vb[goff];
            }
        }
        __syncthreads();
        if (nsl == 0) continue;
        float sc[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) sc[r] = 0.f;
        const int d0 = part * DPP;
#pragma unroll 4
        for (int d = d0; d < d0 + DPP; ++d) {
            const float kd = to_f(sK[kk][d]);
#pragma unroll
            for (int r = 0; r < RPW; ++r)
                if (r < nsl) sc[r] += to_f(sQ[warp + NW * r][d]) * kd;
        }
        const long long j = j0 + kk;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            if (r < nsl) {
                if (NP > 1) sc[r] += __shfl_xor_sync(0xffffffffu, sc[r], 16);
                const float sv = (kk < kv && j < nrow[r]) ? sc[r] * scale : NEG_INF;  // causal mask per row
                float mt = sv;
#pragma unroll
                for (int o = KT / 2; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
                const float mn = fmaxf(m[r], mt);
                float p, corr;
                if (mn == NEG_INF) {
                    p = 0.f;
                    corr = 1.f;
                } else {
                    p = sv == NEG_INF ? 0.f : expf(sv - mn);
                    corr = expf(m[r] - mn);
                }
                float ps = p;
#pragma unroll
                for (int o = KT / 2; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                l[r] = l[r] * corr + ps;
                m[r] = mn;
                if (part == 0) sP[warp + NW * r][kk] = p;
#pragma unroll
                for (int i = 0; i < EPL; ++i) acc[r][i] *= corr;
            }
        }
        __syncwarp();
        for (int jj = 0; jj < kv; ++jj) {
            float vv[EPL];
#pragma unroll
            for (int i = 0; i < EPL; ++i) vv[i] = to_f(sV[jj][i * 32 + lane]);
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const float p = r < nsl ? sP[warp + NW * r][jj] : 0.f;
                if (p != 0.f) {  // a key masked for this row adds nothing, not 0 * V (V may be inf or NaN)
#pragma unroll
                    for (int i = 0; i < EPL; ++i) acc[r][i] += p * vv[i];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        if (r < nsl) {
            const int gr = row0 + warp + NW * r;
            const int t = gr / rep, h = kvh * rep + gr % rep;
            const long long orow = (long long)t * Hq + h;
            if (S == 1) {
                const float inv = 1.0f / l[r];
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    if (d < D) out[orow * D + d] = gated_out(acc[r][i] * inv, gate, t * gs0 + h * gs1 + d);
                }
            } else {
                const long long prow = (long long)s * T * Hq + orow;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    const int d = i * 32 + lane;
                    if (d < D) ws_acc[prow * D + d] = acc[r][i];
                }
                if (lane == 0) {
                    ws_ml[prow * 2] = m[r];
                    ws_ml[prow * 2 + 1] = l[r];
                }
            }
        }
    }
}

#define ATTN_TILE(EPL)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                            \
        attn_tile_e##EPL(const scalar_t* q, long long qs0, long long qs1, const scalar_t* kc,               \
                         const scalar_t* vc, const long long* start_ptr, long long start_val, int T, int Hq, \
                         int Hkv, int D, long long max_ctx, float scale, int vec_ok, float* ws_acc,          \
                         float* ws_ml, scalar_t* out, const scalar_t* gate, long long gs0, long long gs1) { PDL_ENTER();  \
        attn_tile_impl<EPL>(q, qs0, qs1, kc, vc, start_ptr, start_val, T, Hq, Hkv, D, max_ctx, scale, vec_ok, \
                            ws_acc, ws_ml, out, gate, gs0, gs1);                                            \
    }
ATTN_TILE(1)
ATTN_TILE(2)
ATTN_TILE(4)
ATTN_TILE(8)

// Grid (Hq, T); merges the S partials of each (query row, head).
extern "C" __global__ void attn_combine(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                        scalar_t* __restrict__ out, int S, int D, const scalar_t* __restrict__ gate,
        long long gs0, long long gs1) {
    PDL_ENTER();
    __shared__ float s_wt[ATT_MAX_SPLITS];
    __shared__ float s_L;
    const int h = blockIdx.x, t = blockIdx.y;
    const int Hq = gridDim.x, T = gridDim.y;
    const long long base = (long long)t * Hq + h;
    const long long sstride = (long long)T * Hq;
    if (threadIdx.x == 0) {
        float M = NEG_INF;
        for (int s = 0; s < S; ++s) M = fmaxf(M, ws_ml[(s * sstride + base) * 2]);
        float L = 0.f;
        for (int s = 0; s < S; ++s) {
            const float ms = ws_ml[(s * sstride + base) * 2];
            const float w = ms == NEG_INF ? 0.f : expf(ms - M);
            s_wt[s] = w;
            L += ws_ml[(s * sstride + base) * 2 + 1] * w;
        }
        s_L = L;
    }
    __syncthreads();
    const float inv = 1.0f / s_L;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; ++s)
            if (s_wt[s] != 0.f) a += ws_acc[(s * sstride + base) * D + d] * s_wt[s];  // an empty split: not read
        out[base * D + d] = gated_out(a * inv, gate, t * gs0 + h * gs1 + d);
    }
}

// Parallel form of attn_combine (the default): grid (Hq, T), blockDim >= S (a multiple of 32). Thread s
// reads split s's (max, sum); the block reduces them; every thread then sums its features over the splits
// with independent loads (8 in flight).
__device__ __forceinline__ float block_max(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : NEG_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, o));
    return r;
}

extern "C" __global__ void attn_combine_par(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                            scalar_t* __restrict__ out, int S, int D, const scalar_t* __restrict__ gate,
        long long gs0, long long gs1) {
    PDL_ENTER();
    __shared__ float s_wt[ATT_MAX_SPLITS];
    __shared__ float sh[32];
    const int h = blockIdx.x, t = blockIdx.y;
    const int Hq = gridDim.x, T = gridDim.y;
    const long long base = (long long)t * Hq + h;
    const long long sstride = (long long)T * Hq;
    const int tid = threadIdx.x;
    float ms = NEG_INF, ls = 0.f;
    if (tid < S) {
        ms = ws_ml[(tid * sstride + base) * 2];
        ls = ws_ml[(tid * sstride + base) * 2 + 1];
    }
    const float M = block_max(ms, sh);
    const float w = (tid < S && ms != NEG_INF) ? expf(ms - M) : 0.f;
    if (tid < S) s_wt[tid] = w;
    const float L = block_sum(w * ls, sh);  // its barriers also publish s_wt
    const float inv = 1.0f / L;
    for (int d = tid; d < D; d += blockDim.x) {
        float a = 0.f;
#pragma unroll 8
        for (int s = 0; s < S; ++s)
            if (s_wt[s] != 0.f) a += ws_acc[(s * sstride + base) * D + d] * s_wt[s];  // an empty split: not read
        out[base * D + d] = gated_out(a * inv, gate, t * gs0 + h * gs1 + d);
    }
}

// conv_step (conv_update's arithmetic for one token) and the recurrent delta rule (gdr_impl): a header of its own,
// also compiled into the gemv module (the in_proj product's fused form, gemv_kernels.cu).
#include "delta_rule.cuh"

// ------------------------------------------------------------------------------------------------
// conv_update: one thread per channel and run of tokens, sliding window in registers (no races: a
// thread reads and writes only its own channel). gridDim.y splits the T tokens into runs of
// ceil(T / gridDim.y) (prefill: many runs in parallel; decode: one). A run starting at token j0 > 0
// takes its window from x where it can; the window before token 0 comes from `win` ([C, K-1], a copy of
// plane `start` the host made: with several runs, the run that overwrites plane `start` may go first),
// or, with win NULL (one run), from plane `start` itself, read before this thread writes any plane.
// ------------------------------------------------------------------------------------------------
template <int K, typename W>
__device__ __forceinline__ void conv_update_impl(const scalar_t* __restrict__ x, long long xs0,
                                                 scalar_t* __restrict__ ring, const scalar_t* __restrict__ win0,
                                                 const W* __restrict__ w, scalar_t* __restrict__ y,
                                                 const long long* start_ptr, long long start_val, int T, int C,
                                                 int n_planes) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int span = (T + (int)gridDim.y - 1) / (int)gridDim.y;
    const int j0 = (int)blockIdx.y * span;
    const int j1 = j0 + span < T ? j0 + span : T;
    if (c >= C || j0 >= T) return;
    const long long start = read_start(start_ptr, start_val);
    const long long plane = (long long)C * (K - 1);
    const scalar_t* rp = (win0 ? win0 : ring + pmod(start, n_planes) * plane) + (long long)c * (K - 1);
    float win[K - 1], wt[K];
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {  // the raw inputs of tokens j0 - K + 1 .. j0 - 1
        const int r = j0 - (K - 1) + i;
        win[i] = r >= 0 ? to_f(x[(long long)r * xs0 + c]) : to_f(rp[r + K - 1]);
    }
#pragma unroll
    for (int i = 0; i < K; ++i) wt[i] = to_f(w[(long long)c * K + i]);
    const int jfirst = T - n_planes + 1 > 1 ? T - n_planes + 1 : 1;
    for (int j = j0; j < j1; ++j) {
        const float xv = to_f(x[(long long)j * xs0 + c]);
        y[(long long)j * C + c] = conv_step<K>(win, wt, xv);
        if (j + 1 >= jfirst) {  // plane (start + j + 1) holds the window after j + 1 tokens
            scalar_t* wp = ring + pmod(start + j + 1, n_planes) * plane + (long long)c * (K - 1);
#pragma unroll
            for (int i = 0; i < K - 1; ++i) wp[i] = from_f<scalar_t>(win[i]);
        }
    }
}

#define CONV_UPDATE(K)                                                                                     \
    extern "C" __global__ void conv_update_k##K##_ws(const scalar_t* x, long long xs0, scalar_t* ring,     \
                                                     const scalar_t* win, const scalar_t* w, scalar_t* y,   \
                                                     const long long* sp, long long sv, int T, int C,       \
                                                     int n_planes) {                                        \
        PDL_ENTER();                                                                                       \
        conv_update_impl<K, scalar_t>(x, xs0, ring, win, w, y, sp, sv, T, C, n_planes);                    \
    }                                                                                                      \
    extern "C" __global__ void conv_update_k##K##_wf(const scalar_t* x, long long xs0, scalar_t* ring,     \
                                                     const scalar_t* win, const float* w, scalar_t* y,      \
                                                     const long long* sp, long long sv, int T, int C,       \
                                                     int n_planes) {                                        \
        PDL_ENTER();                                                                                       \
        conv_update_impl<K, float>(x, xs0, ring, win, w, y, sp, sv, T, C, n_planes);                       \
    }
CONV_UPDATE(2)
CONV_UPDATE(3)
CONV_UPDATE(4)
CONV_UPDATE(5)
CONV_UPDATE(6)
CONV_UPDATE(7)
CONV_UPDATE(8)

// The standalone kernels: a block is column block blockIdx.x of value head blockIdx.y (gdr_impl's `at`).
#define GDR_AT GdrAt{(int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x}
#define GDR(DK)                                                                                              \
    extern "C" __global__ void __launch_bounds__((DK >= 32 ? DK : 32))                                      \
        gdr_dk##DK##_bs(const scalar_t* q, long long qs0, long long qs1, const scalar_t* k, long long ks0,   \
                        long long ks1, const scalar_t* v, long long vs0, long long vs1, const float* g,      \
                        long long gs0, const scalar_t* beta, long long bs0, float* ring, scalar_t* out,      \
                        const long long* sp, long long sv, int T, int Hk, int Hv, int dk, int dv,            \
                        int n_planes, float qscale) { PDL_ENTER();                                                        \
        gdr_impl<DK, scalar_t, false, false>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, g, gs0, beta, bs0,       \
                                             nullptr, nullptr, ring, out, sp, sv, T, Hk, Hv, dk, dv,         \
                                             n_planes, qscale, GDR_AT, GdrNorm{});                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__((DK >= 32 ? DK : 32))                                      \
        gdr_dk##DK##_bf(const scalar_t* q, long long qs0, long long qs1, const scalar_t* k, long long ks0,   \
                        long long ks1, const scalar_t* v, long long vs0, long long vs1, const float* g,      \
                        long long gs0, const float* beta, long long bs0, float* ring, scalar_t* out,         \
                        const long long* sp, long long sv, int T, int Hk, int Hv, int dk, int dv,            \
                        int n_planes, float qscale) { PDL_ENTER();                                                        \
        gdr_impl<DK, float, false, false>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, g, gs0, beta, bs0, nullptr, \
                                          nullptr, ring, out, sp, sv, T, Hk, Hv, dk, dv, n_planes, qscale,   \
                                          GDR_AT, GdrNorm{});                                                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__((DK >= 32 ? DK : 32))                                      \
        gdr_dk##DK##_ab(const scalar_t* q, long long qs0, long long qs1, const scalar_t* k, long long ks0,   \
                        long long ks1, const scalar_t* v, long long vs0, long long vs1, const scalar_t* a,   \
                        long long as0, const scalar_t* b, long long bs0, const float* neg_exp_a,             \
                        const float* dt_bias, float* ring, scalar_t* out, const long long* sp, long long sv, \
                        int T, int Hk, int Hv, int dk, int dv, int n_planes, float qscale) {                 \
        PDL_ENTER();                                                                                         \
        gdr_impl<DK, scalar_t, true, false>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, a, as0, b, bs0,           \
                                            neg_exp_a, dt_bias, ring, out, sp, sv, T, Hk, Hv, dk, dv,        \
                                            n_planes, qscale, GDR_AT, GdrNorm{});                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__((DK >= 32 ? DK : 32))                                      \
        gdr_dk##DK##_abn(const scalar_t* q, long long qs0, long long qs1, const scalar_t* k, long long ks0,  \
                         long long ks1, const scalar_t* v, long long vs0, long long vs1, const scalar_t* a,  \
                         long long as0, const scalar_t* b, long long bs0, const float* neg_exp_a,            \
                         const float* dt_bias, float* ring, scalar_t* out, const long long* sp,              \
                         long long sv, int T, int Hk, int Hv, int dk, int dv, int n_planes, float qscale,    \
                         const scalar_t* z, long long zs0, const float* nw, scalar_t* y, int* cnt,           \
                         float eps) {                                                                        \
        PDL_ENTER();                                                                                         \
        gdr_impl<DK, scalar_t, true, true>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, a, as0, b, bs0, neg_exp_a, \
                                           dt_bias, ring, out, sp, sv, T, Hk, Hv, dk, dv, n_planes, qscale,  \
                                           GDR_AT, GdrNorm{z, zs0, nw, y, cnt, eps});                        \
    }
GDR(16)
GDR(32)
GDR(64)
GDR(128)

// The delta-net's decode step after its projection in one launch: conv + SiLU, gates, the rule and the output
// norm (CONV above; q, k, v are worked out from the raw columns x, so the q/k/v parameters are absent).
#define GDR_CABN(DK)                                                                                          \
    extern "C" __global__ void __launch_bounds__((DK >= 32 ? DK : 32))                                      \
        gdr_dk##DK##_cabn(const scalar_t* x, long long xs0, scalar_t* cring, const scalar_t* cw, int C,     \
                          const scalar_t* a, long long as0, const scalar_t* b, long long bs0,               \
                          const float* neg_exp_a, const float* dt_bias, float* ring, scalar_t* out,          \
                          const long long* sp, long long sv, int T, int Hk, int Hv, int dk, int dv,          \
                          int n_planes, float qscale, const scalar_t* z, long long zs0, const float* nw,     \
                          scalar_t* y, int* cnt, float eps) {                                                \
        PDL_ENTER();                                                                                         \
        gdr_impl<DK, scalar_t, true, true, true>(nullptr, 0, 0, nullptr, 0, 0, nullptr, 0, 0, a, as0, b, bs0,  \
                                                 neg_exp_a, dt_bias, ring, out, sp, sv, T, Hk, Hv, dk, dv,     \
                                                 n_planes, qscale, GDR_AT, GdrNorm{z, zs0, nw, y, cnt, eps}, \
                                                 GdrConv{x, xs0, cring, cw, C});                              \
    }
GDR_CABN(16)
GDR_CABN(32)
GDR_CABN(64)
GDR_CABN(128)

// ------------------------------------------------------------------------------------------------
// silu_mul: x [T, 2I] (row stride xs, gate = first I, up = last I) -> y [T, I] contiguous;
// y = (silu(gate).to(dtype) * up).to(dtype). One thread per output element.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void silu_mul(const scalar_t* __restrict__ x, long long xs, scalar_t* __restrict__ y, int T,
                                    int I) {
    PDL_ENTER();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * I) return;
    const int t = (int)(idx / I), i = (int)(idx - (long long)t * I);
    const scalar_t* xr = x + t * xs;
    const float g = to_f(xr[i]), u = to_f(xr[I + i]);
    y[idx] = from_f<scalar_t>(rnd<scalar_t>(silu_f(g)) * u);
}

// ------------------------------------------------------------------------------------------------
// gdn_gates: the delta-net gates of T tokens x H value heads, one thread per (t, h):
// beta = sigmoid(b) (in b's dtype); g = neg_exp_A * softplus(a.float() + dt_bias) (fp32, softplus
// threshold 20 as in torch). a, b rows strided (as0, bs0), heads contiguous. dt_bias, neg_exp_A fp32.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void gdn_gates(const scalar_t* __restrict__ a, long long as0, const scalar_t* __restrict__ b,
                                     long long bs0, const float* __restrict__ neg_exp_a,
                                     const float* __restrict__ dt_bias, float* __restrict__ g,
                                     scalar_t* __restrict__ beta, int T, int H) {
    PDL_ENTER();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * H) return;
    const int t = idx / H, h = idx - t * H;
    beta[idx] = gdn_beta(to_f(b[t * bs0 + h]));
    g[idx] = gdn_log_decay(to_f(a[t * as0 + h]), dt_bias[h], neg_exp_a[h]);
}

// ------------------------------------------------------------------------------------------------
// attn_prep: the attention inputs of T tokens in one launch. Grid (Hq + Hkv, T), blockDim >= D / 8.
// Block (h < Hq, t): q row -> rmsnorm(q_weight) -> partial RoPE at position start + t -> q_out [T, Hq, D].
// Block (Hq + j, t): k row j -> rmsnorm(k_weight) -> RoPE -> k_cache[start + t, j]; v row j ->
// v_cache[start + t, j]. Same roundings as rope_partial(rmsnorm(x)) and kv_write.
// ------------------------------------------------------------------------------------------------
#define PREP_MAX_D 1024
template <typename W>
__device__ __forceinline__ void attn_prep_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                               const scalar_t* __restrict__ k, long long ks0, long long ks1,
                                               const scalar_t* __restrict__ v, long long vs0, long long vs1,
                                               const W* __restrict__ wq, const W* __restrict__ wk,
                                               const float* __restrict__ inv_freq, scalar_t* __restrict__ q_out,
                                               scalar_t* __restrict__ kc, scalar_t* __restrict__ vc,
                                               const long long* start_ptr, long long start_val, int Hq, int Hkv,
                                               int D, int half, long long max_ctx, float eps) {
    __shared__ float sh[32];
    __shared__ float sy[PREP_MAX_D];
    const int hh = blockIdx.x, t = blockIdx.y;
    const bool is_q = hh < Hq;
    const int j = is_q ? hh : hh - Hq;
    const scalar_t* xr = is_q ? q + t * qs0 + (long long)j * qs1 : k + t * ks0 + (long long)j * ks1;
    const W* w = is_q ? wq : wk;
    const long long start = read_start(start_ptr, start_val);
    const long long pos = start + t;
    const int nt = blockDim.x;
    float xv[NORM_REG], wv[NORM_REG], vv[NORM_REG];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < NORM_REG; ++u) {
        const int i = threadIdx.x + u * nt;
        xv[u] = i < D ? to_f(xr[i]) : 0.f;
        wv[u] = i < D ? to_f(w[i]) : 0.f;
        vv[u] = (!is_q && i < D) ? to_f(v[t * vs0 + (long long)j * vs1 + i]) : 0.f;
        ss += xv[u] * xv[u];
    }
    ss = block_sum(ss, sh);
    const float rs = rsqrtf(ss / (float)D + eps);
#pragma unroll
    for (int u = 0; u < NORM_REG; ++u) {
        const int i = threadIdx.x + u * nt;
        if (i < D) sy[i] = rnd<scalar_t>(xv[u] * rs * (1.0f + wv[u]));  // rmsnorm(x).to(dtype)
    }
    __syncthreads();
    const bool in_ctx = pos >= 0 && pos < max_ctx;
    scalar_t* dst = is_q ? q_out + ((long long)t * Hq + j) * D : kc + (pos * Hkv + j) * D;
    scalar_t* vdst = vc + (pos * Hkv + j) * D;
#pragma unroll
    for (int u = 0; u < NORM_REG; ++u) {
        const int i = threadIdx.x + u * nt;
        if (i >= D) continue;
        const float x_p = i < 2 * half ? sy[i < half ? i + half : i - half] : 0.f;
        const float o = rope_elem(sy[i], x_p, i, half, pos, inv_freq);
        if (is_q) {
            dst[i] = from_f<scalar_t>(o);
        } else if (in_ctx) {
            dst[i] = from_f<scalar_t>(o);
            vdst[i] = from_f<scalar_t>(vv[u]);
        }
    }
}

#define ATTN_PREP(NAME, WT)                                                                                   \
    extern "C" __global__ void NAME(const scalar_t* q, long long qs0, long long qs1, const scalar_t* k,       \
                                    long long ks0, long long ks1, const scalar_t* v, long long vs0,           \
                                    long long vs1, const WT* wq, const WT* wk, const float* inv_freq,         \
                                    scalar_t* q_out, scalar_t* kc, scalar_t* vc, const long long* sp,         \
                                    long long sv, int Hq, int Hkv, int D, int half, long long max_ctx,        \
                                    float eps) { PDL_ENTER();                                                              \
        attn_prep_impl<WT>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, wq, wk, inv_freq, q_out, kc, vc, sp, sv, Hq, \
                           Hkv, D, half, max_ctx, eps);                                                       \
    }
ATTN_PREP(attn_prep_ws, scalar_t)
ATTN_PREP(attn_prep_wf, float)

// ------------------------------------------------------------------------------------------------
// argmax_prob: grid (P parts, T rows), 256 threads. Each thread keeps (max, lowest index of it,
// sum of exp(x - max)) over a strided range; merged over the block, then (P > 1) over the parts.
// prob = 1 / sum_i exp(x_i - max).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void am_merge(float& m, float& s, int& i, float m2, float s2, int i2) {
    const float M = fmaxf(m, m2);
    const float a = m == NEG_INF ? 0.f : s * expf(m - M);
    const float b = m2 == NEG_INF ? 0.f : s2 * expf(m2 - M);
    int idx;
    if (m2 > m) idx = i2;
    else if (m > m2) idx = i;
    else idx = i < i2 ? i : i2;
    m = M;
    s = a + b;
    i = idx;
}

__device__ __forceinline__ void am_push(float& m, float& s, int& idx, float v, int i) {
    if (v > m) {  // strict: within a thread indices increase, so ties keep the lowest index
        s = (m == NEG_INF ? 0.f : s * expf(m - v)) + 1.0f;
        m = v;
        idx = i;
    } else if (v != NEG_INF) {
        s += expf(v - m);
    }
}

// (max, its lowest index, sum of exp) merged over the warp's lanes (a butterfly: every lane gets the result).
__device__ __forceinline__ void am_warp(float& m, float& s, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        am_merge(m, s, idx, m2, s2, i2);
    }
}

__device__ __forceinline__ void am_block(float& m, float& s, int& idx) {
    __shared__ float sm[32], ss[32];
    __shared__ int si[32];
    am_warp(m, s, idx);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm[w] = m;
        ss[w] = s;
        si[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        m = lane < nw ? sm[lane] : NEG_INF;
        s = lane < nw ? ss[lane] : 0.f;
        idx = lane < nw ? si[lane] : I32_MAX;
        am_warp(m, s, idx);
    }
}

// The P partials of row `row` merged by one warp (lane = threadIdx.x < 32) into tok / prob: argmax_combine's
// launch, or (coherent, the partials written by other blocks of this launch) argmax_partial's last part.
__device__ __forceinline__ void argmax_merge_row(const float* pm, const float* ps, const int* pi, int P, int row,
                                                 long long* __restrict__ tok, float* __restrict__ prob,
                                                 bool coherent) {
    const int lane = threadIdx.x;
    float m = NEG_INF, s = 0.f;
    int idx = I32_MAX;
    for (int p = lane; p < P; p += 32) {
        const int at = row * P + p;
        if (coherent) am_merge(m, s, idx, __ldcg(pm + at), __ldcg(ps + at), __ldcg(pi + at));
        else am_merge(m, s, idx, pm[at], ps[at], pi[at]);
    }
    am_warp(m, s, idx);
    if (lane == 0) {
        tok[row] = idx == I32_MAX ? 0 : idx;
        prob[row] = 1.0f / s;
    }
}

// One part of argmax_partial (block p of row `row`); returns, in every thread, whether this block stored the
// row's token and prob (its only part, or the last part to finish, which merged the row).
__device__ __forceinline__ bool argmax_part(const scalar_t* __restrict__ logits, long long ls0, int n, int chunk,
                                            int vec_ok, float* __restrict__ pm, float* __restrict__ ps,
                                            int* __restrict__ pi, long long* __restrict__ tok,
                                            float* __restrict__ prob, int* __restrict__ cnt) {
    const int p = blockIdx.x, P = gridDim.x, row = blockIdx.y;
    const scalar_t* lr = logits + (long long)row * ls0;
    const int b = p * chunk;
    const int e = n < b + chunk ? n : b + chunk;
    float m = NEG_INF, s = 0.f;
    int idx = I32_MAX;
    const int step = blockDim.x;
    int tail = b;
    if (vec_ok && e > b) {
        // 16-byte loads (b is a multiple of 8 elements, the row 16-byte aligned); two in flight per thread.
        // A thread's indices still increase, so ties keep the lowest index.
        constexpr int VEC = 16 / (int)sizeof(scalar_t);
        const int nvec = (e - b) / VEC;
        const uint4* vp = reinterpret_cast<const uint4*>(lr + b);
        for (int c = threadIdx.x; c < nvec; c += 2 * step) {
            const bool two = c + step < nvec;
            __align__(16) scalar_t h0[VEC];
            __align__(16) scalar_t h1[VEC];
            *reinterpret_cast<uint4*>(h0) = vp[c];
            if (two) *reinterpret_cast<uint4*>(h1) = vp[c + step];
#pragma unroll
            for (int i = 0; i < VEC; ++i) am_push(m, s, idx, to_f(h0[i]), b + c * VEC + i);
            if (two) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) am_push(m, s, idx, to_f(h1[i]), b + (c + step) * VEC + i);
            }
        }
        tail = b + nvec * VEC;
    }
    int i = tail + threadIdx.x;
    for (; i + 3 * step < e; i += 4 * step) {
        const float v0 = to_f(lr[i]), v1 = to_f(lr[i + step]), v2 = to_f(lr[i + 2 * step]),
                    v3 = to_f(lr[i + 3 * step]);
        am_push(m, s, idx, v0, i);
        am_push(m, s, idx, v1, i + step);
        am_push(m, s, idx, v2, i + 2 * step);
        am_push(m, s, idx, v3, i + 3 * step);
    }
    for (; i < e; i += step) am_push(m, s, idx, to_f(lr[i]), i);
    am_block(m, s, idx);
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = P == 1;
        if (P == 1) {
            tok[row] = idx == I32_MAX ? 0 : idx;
            prob[row] = 1.0f / s;
        } else {
            pm[row * P + p] = m;
            ps[row * P + p] = s;
            pi[row * P + p] = idx;
            if (cnt != nullptr) {
                int old;  // release: this part's partial; acquire: the other parts'
                asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt + row) : "memory");
                last = old == P - 1;
                if (last) cnt[row] = 0;  // zero again for the next launch (a captured plan replays with no reset)
            }
        }
    }
    __syncthreads();
    const bool stored = last;
    if (P > 1 && stored && threadIdx.x < 32) argmax_merge_row(pm, ps, pi, P, row, tok, prob, true);
    return stored;
}

extern "C" __global__ void argmax_partial(const scalar_t* __restrict__ logits, long long ls0, int n, int chunk,
                                          int vec_ok, float* __restrict__ pm, float* __restrict__ ps,
                                          int* __restrict__ pi, long long* __restrict__ tok,
                                          float* __restrict__ prob, int* __restrict__ cnt) {
    PDL_ENTER();
    argmax_part(logits, ls0, n, chunk, vec_ok, pm, ps, pi, tok, prob, cnt);
}

// One warp per row: merges the P partials of argmax_partial (the same merges in the same order either way).
extern "C" __global__ void argmax_combine(const float* __restrict__ pm, const float* __restrict__ ps,
                                          const int* __restrict__ pi, int P, long long* __restrict__ tok,
                                          float* __restrict__ prob) {
    PDL_ENTER();
    argmax_merge_row(pm, ps, pi, P, blockIdx.x, tok, prob, false);
}

// ------------------------------------------------------------------------------------------------
// greedy_accept: a single thread; see reference.greedy_accept. p_min is compared in double, like the
// reference's float(draft_probs[i]) >= p_min. With `start` non-null the cache length is start + k + 1 (the
// round's copy of start into cache_len folded in), else cache_len + k + 1.
// ------------------------------------------------------------------------------------------------
// The acceptance of one thread. coherent: `target` was stored by other blocks of this launch (argmax_accept).
__device__ __forceinline__ void greedy_accept_one(const long long* __restrict__ drafts, const float* __restrict__ probs,
                                                  const long long* target, double p_min,
                                                  long long* __restrict__ cache_len, long long* __restrict__ out,
                                                  int n, const long long* __restrict__ start, bool coherent) {
    int nv = 0;
    while (nv < n && (double)probs[nv] >= p_min) ++nv;
    int k = 0;
    while (k < nv && drafts[k] == (coherent ? __ldcg(target + k) : target[k])) ++k;
    out[0] = k + 1;
    out[1] = nv;
    for (int i = 0; i < k; ++i) out[2 + i] = drafts[i];
    out[2 + k] = coherent ? __ldcg(target + k) : target[k];
    cache_len[0] = (start != nullptr ? start[0] : cache_len[0]) + k + 1;
}

extern "C" __global__ void greedy_accept(const long long* __restrict__ drafts, const float* __restrict__ probs,
                                         const long long* __restrict__ target, double p_min,
                                         long long* __restrict__ cache_len, long long* __restrict__ out, int n,
                                         const long long* __restrict__ start) {
    PDL_ENTER();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    greedy_accept_one(drafts, probs, target, p_min, cache_len, out, n, start, false);
}

// argmax_partial over the verify's T = nd + 1 rows, then greedy_accept on their tokens, in one launch (op
// argmax_greedy_accept): cnt holds T row counters (argmax_partial's, for rows of several parts) and one for the
// rows: the block that stores a row's token (its only part, or its last, which merged it) counts it in there
// (release; acquire: the rows counted before), and the last row's runs the acceptance on its thread 0, reading
// the tokens past L1, then leaves that counter at zero. The same bits as the two launches.
extern "C" __global__ void argmax_accept(const scalar_t* __restrict__ logits, long long ls0, int n, int chunk,
                                         int vec_ok, float* __restrict__ pm, float* __restrict__ ps,
                                         int* __restrict__ pi, long long* __restrict__ tok,
                                         float* __restrict__ prob, int* __restrict__ cnt,
                                         const long long* __restrict__ drafts, const float* __restrict__ probs,
                                         double p_min, long long* __restrict__ cache_len, long long* __restrict__ out,
                                         int nd, const long long* __restrict__ start) {
    PDL_ENTER();
    const bool stored = argmax_part(logits, ls0, n, chunk, vec_ok, pm, ps, pi, tok, prob, cnt);
    if (!stored || threadIdx.x != 0) return;  // thread 0 stored the token (P = 1) or merged it (lane 0)
    int* rows = cnt + gridDim.y;
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(rows) : "memory");
    if (old != (int)gridDim.y - 1) return;
    *rows = 0;
    greedy_accept_one(drafts, probs, tok, p_min, cache_len, out, nd, start, true);
}
