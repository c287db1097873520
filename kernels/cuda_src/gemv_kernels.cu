// SpecDeck skinny-GEMM ("gemv") kernels for decode shapes: out[M, N] = x[M, K] @ W[N, K]^T, M = 1..17 rows.
//
// A module of its own (kernels/cuda.py compiles it once per (device, dtype) beside decode_kernels.cu), so a
// failure here disables only these kernels: the engine's products then stay on cuBLAS. It needs no CUDA
// header: bf16/fp16 values are handled as their 16-bit patterns and converted with bit operations or PTX.
// kernels/cuda.py prepends `#define SCALAR_KIND k` (0 = fp32, 1 = bf16, 2 = fp16): x, W and out share it.
//
// Mirrors reference.gemv (F.linear, fp32 accumulation, one rounding to the dtype at the end). Every sum has
// a fixed order (no atomics), so a kernel gives the same bits on every run.
//
// Layout: x rows at stride xs (elements, unit inner stride), W rows at stride wsr (unit inner stride), out
// contiguous [M, N]. With S > 1 K-splits (grid.y), each split writes fp32 partial sums part[S, M, N] and
// gemv_combine adds them in split order and rounds once (chosen over fp32 atomics: deterministic, and the
// extra launch reads only S * M * N * 4 bytes).
//
// Two families, the same parameter list (kernels/launch_args.py GemvArgs):
//  gemv_simt_m{MB}_c{C}   CUDA cores, any dtype. Each warp owns C consecutive output columns and its K range;
//                         lanes stream the W rows with 16-byte loads (vec_ok) or scalar loads (otherwise),
//                         read the x rows (L1/L2-resident) at the same offsets, FMA in fp32 and reduce with
//                         shuffles. MB = the row bucket's largest M (1, 4, 8, 17): accumulators C x MB.
//  gemv_tc_t{MT}_c{CT}    bf16/fp16 tensor cores (mma.sync m16n8k16, sm_80+), needs vec_ok. A warp computes
//                         C^T[16 CT columns, 8 MT rows] over interleaved 64-element K steps; the block's warps
//                         split the K range and add their tiles in shared memory (fixed warp order). Each
//                         thread loads 16 contiguous bytes of W rows g and g+8 and of x row g at the same
//                         K offsets; since a dot product does not depend on the order of k, those 8 elements
//                         are fed to the mma's k-slots of that thread directly (the same permutation of k for
//                         W and x), so every load is a 16-byte vector, no shuffles, no shared-memory staging.

// Programmatic dependent launch (kernels/pdl.py): every kernel opens with PDL_ENTER(): let the next kernel of
// the stream be scheduled, then wait until the previous kernel has completed and its writes are visible. No
// kernel touches global memory before it. Without the launch attribute (or before sm_90) both do nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define PDL_ENTER()
#endif

#ifndef SCALAR_KIND
#define SCALAR_KIND 0
#endif

#if SCALAR_KIND == 0
typedef float scalar_t;
#else
typedef unsigned short scalar_t;  // the bf16 or fp16 bit pattern
#endif

#define GV_MAX_WARPS 8

// ---- conversions -----------------------------------------------------------------------------------------
__device__ __forceinline__ float gv_f(float v) { return v; }
__device__ __forceinline__ float gv_f(unsigned short h) {
#if SCALAR_KIND == 2
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((unsigned int)h) << 16);
#endif
}

// The two elements of a 32-bit word (the lower address in the low half).
__device__ __forceinline__ float gv_lo(unsigned int w) {
#if SCALAR_KIND == 1
    return __uint_as_float(w << 16);
#else
    return gv_f((unsigned short)(w & 0xffffu));
#endif
}
__device__ __forceinline__ float gv_hi(unsigned int w) {
#if SCALAR_KIND == 1
    return __uint_as_float(w & 0xffff0000u);
#else
    return gv_f((unsigned short)(w >> 16));
#endif
}

// float -> scalar_t, rounded to nearest even (NaN stays NaN).
__device__ __forceinline__ scalar_t gv_out(float f) {
#if SCALAR_KIND == 0
    return f;
#elif SCALAR_KIND == 1
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// Elements per 16-byte vector, and a vector unpacked to fp32.
#define GV_VEC (16 / (int)sizeof(scalar_t))

__device__ __forceinline__ void gv_unpack(const uint4& v, float* f) {
#if SCALAR_KIND == 0
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
#else
    f[0] = gv_lo(v.x);
    f[1] = gv_hi(v.x);
    f[2] = gv_lo(v.y);
    f[3] = gv_hi(v.y);
    f[4] = gv_lo(v.z);
    f[5] = gv_hi(v.z);
    f[6] = gv_lo(v.w);
    f[7] = gv_hi(v.w);
#endif
}

// ---- loads ---------------------------------------------------------------------------------------------
// W is read once per call: streamed past L1 (and, on sm_80+, with a 256-byte L2 prefetch of the line pair).
// Volatile: a load guarded by a bounds test must never be speculated above it (a row's end may be the end of
// the allocation); it also keeps each iteration's loads issued before its first use, as written.
__device__ __forceinline__ uint4 gv_ld_w(const void* p) {
    uint4 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#else
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#endif
    return r;
}

// x is read by every block (it stays in L1/L2): a plain read-only load.
__device__ __forceinline__ uint4 gv_ld_x(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float gv_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One output: rounded into out, or an fp32 partial of split s.
__device__ __forceinline__ void gv_store(scalar_t* __restrict__ out, float* __restrict__ part, int s, int M, int N,
                                         int m, long long n, float v) {
    if (part != nullptr)
        part[((long long)s * M + m) * N + n] = v;
    else
        out[(long long)m * N + n] = gv_out(v);
}

// ---- CUDA-core kernel ----------------------------------------------------------------------------------
// grid (ceil(N / (warps * C)), S), block warps * 32. Split s covers k in [s * kchunk, min(K, (s+1) * kchunk)),
// kchunk a multiple of 64. vec_ok: x, W, their row strides and K allow 16-byte vectors.
template <int MB, int C>
__device__ __forceinline__ void gv_simt(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,
                                        long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,
                                        int N, int K, int kchunk, int vec_ok) {
    constexpr int U = C == 1 ? 4 : 2;  // 16-byte W loads in flight per lane: U * C = 4
    const int lane = threadIdx.x & 31;
    const int nw = blockDim.x >> 5;
    const long long n0 = ((long long)blockIdx.x * nw + (threadIdx.x >> 5)) * C;
    if (n0 >= N) return;  // the whole warp: nothing below synchronises the block
    const int s = blockIdx.y;
    const int k0 = s * kchunk;
    const int k1 = K < k0 + kchunk ? K : k0 + kchunk;
    const scalar_t* wr[C];
#pragma unroll
    for (int c = 0; c < C; ++c) wr[c] = w + (n0 + c < N ? n0 + c : n0) * wsr;  // a column past N reads n0
    float acc[C][MB];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < MB; ++m) acc[c][m] = 0.f;

    if (vec_ok) {
        const int v1 = k1 / GV_VEC;
        int v = k0 / GV_VEC + lane;
        for (; v + (U - 1) * 32 < v1; v += U * 32) {
            uint4 wv[U][C];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int c = 0; c < C; ++c) wv[u][c] = gv_ld_w(wr[c] + (long long)(v + u * 32) * GV_VEC);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float wf[C][GV_VEC];
#pragma unroll
                for (int c = 0; c < C; ++c) gv_unpack(wv[u][c], wf[c]);
#pragma unroll
                for (int m = 0; m < MB; ++m) {
                    if (m < M) {
                        float xf[GV_VEC];
                        gv_unpack(gv_ld_x(x + m * xs + (long long)(v + u * 32) * GV_VEC), xf);
#pragma unroll
                        for (int c = 0; c < C; ++c)
#pragma unroll
                            for (int e = 0; e < GV_VEC; ++e) acc[c][m] = __fmaf_rn(wf[c][e], xf[e], acc[c][m]);
                    }
                }
            }
        }
        for (; v < v1; v += 32) {
            float wf[C][GV_VEC];
#pragma unroll
            for (int c = 0; c < C; ++c) gv_unpack(gv_ld_w(wr[c] + (long long)v * GV_VEC), wf[c]);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                if (m < M) {
                    float xf[GV_VEC];
                    gv_unpack(gv_ld_x(x + m * xs + (long long)v * GV_VEC), xf);
#pragma unroll
                    for (int c = 0; c < C; ++c)
#pragma unroll
                        for (int e = 0; e < GV_VEC; ++e) acc[c][m] = __fmaf_rn(wf[c][e], xf[e], acc[c][m]);
                }
            }
        }
    } else {
        for (int k = k0 + lane; k < k1; k += 32) {
            float wf[C];
#pragma unroll
            for (int c = 0; c < C; ++c) wf[c] = gv_f(wr[c][k]);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                if (m < M) {
                    const float xv = gv_f(x[m * xs + k]);
#pragma unroll
                    for (int c = 0; c < C; ++c) acc[c][m] = __fmaf_rn(wf[c], xv, acc[c][m]);
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < MB; ++m)
            if (m < M) acc[c][m] = gv_warp_sum(acc[c][m]);  // m < M is the same in every lane
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < C; ++c)
            if (n0 + c < N)
#pragma unroll
                for (int m = 0; m < MB; ++m)
                    if (m < M) gv_store(out, part, s, M, N, m, n0 + c, acc[c][m]);
    }
}

#define GEMV_SIMT(GV_MB, GV_C)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32)                                              \
        gemv_simt_m##GV_MB##_c##GV_C(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, \
                                     long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,   \
                                     int N, int K, int kchunk, int vec_ok) { PDL_ENTER();                                      \
        gv_simt<GV_MB, GV_C>(x, xs, w, wsr, out, part, M, N, K, kchunk, vec_ok);                                  \
    }
GEMV_SIMT(1, 1)
GEMV_SIMT(1, 2)
GEMV_SIMT(4, 1)
GEMV_SIMT(4, 2)
GEMV_SIMT(8, 1)
GEMV_SIMT(8, 2)
GEMV_SIMT(17, 1)
GEMV_SIMT(17, 2)

// ---- tensor-core kernel (bf16 / fp16, sm_80+) -------------------------------------------------------------
#if SCALAR_KIND != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// D = A[16 x 16] B[16 x 8] + D. A = 16 W rows (output columns), B = 8 x rows transposed; fp32 accumulators.
__device__ __forceinline__ void gv_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                       unsigned int b0, unsigned int b1) {
#if SCALAR_KIND == 1
#define GV_MMA_AB "bf16.bf16"
#else
#define GV_MMA_AB "f16.f16"
#endif
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." GV_MMA_AB
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#undef GV_MMA_AB
}

__device__ __forceinline__ unsigned int gv_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
#endif

// grid (ceil(N / (16 CT)), S), block warps * 32 (warps <= GV_MAX_WARPS), dynamic shared memory
// warps * 16 CT * 8 MT * 4 bytes. Needs vec_ok (16-byte aligned x, W, row strides, K % 8 == 0).
//
// Fragments (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4), with the k permutation described above:
// a K step is 64 elements; thread t holds elements [16 t, 16 t + 16) of the step as two vectors v = 0, 1, each
// four 32-bit words. mma (v, p), p = 0, 1, takes words 2p and 2p + 1 of vector v:
//   A regs {a0, a1, a2, a3} = {W[g] word 2p, W[g+8] word 2p, W[g] word 2p+1, W[g+8] word 2p+1}
//   B regs {b0, b1}         = {x[g] word 2p, x[g] word 2p+1}
// so the mma's k-slots (2t, 2t+1 | 2t+8, 2t+9) of thread t are elements 16t + 8v + 4p + (0, 1 | 2, 3) for both
// operands; over t, v and p the 4 mmas of a step cover its 64 elements once. Accumulator c_i of thread (g, t):
// output column 16 ct + g + 8 (i >= 2), x row 8 j + 2 t + (i & 1).
template <int MT, int CT>
__device__ __forceinline__ void gv_tc(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,
                                      long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,
                                      int N, int K, int kchunk) {
#if SCALAR_KIND != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int U = CT == 1 ? 2 : 1;  // K steps in flight per warp: U * CT * 2 KB of W
    constexpr int RW = 16 * CT * 8 * MT;  // floats of one warp's tile in shared memory
    extern __shared__ float gv_red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long nb = (long long)blockIdx.x * (16 * CT);
    const int s = blockIdx.y;
    const int k0 = s * kchunk;
    const int k1 = K < k0 + kchunk ? K : k0 + kchunk;
    const int nsteps = (k1 - k0 + 63) >> 6;

    const scalar_t* wp[CT][2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long n = nb + 16 * ct + 8 * h + g;
            wp[ct][h] = w + (n < N ? n : (long long)N - 1) * wsr + k0 + 16 * t;  // rows past N: read, dropped
        }
    const scalar_t* xp[MT];
    bool xin[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        const int m = 8 * j + g;
        xin[j] = m < M;
        xp[j] = x + (xin[j] ? m : 0) * xs + k0 + 16 * t;
    }
    float acc[CT][MT][4];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[ct][j][i] = 0.f;

    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    for (int st = warp; st < nsteps; st += nw * U) {
        uint4 wa[U][CT][2][2];
        uint4 xb[U][MT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int stp = st + u * nw;
            const int kk = stp * 64;  // from the pointers (k0 + 16 t); (k1 - k0) % 8 == 0: a vector is wholly in or out
            const bool in0 = stp < nsteps && k0 + kk + 16 * t < k1;
            const bool in1 = stp < nsteps && k0 + kk + 16 * t + 8 < k1;
#pragma unroll
            for (int ct = 0; ct < CT; ++ct)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    wa[u][ct][h][0] = in0 ? gv_ld_w(wp[ct][h] + kk) : zero;
                    wa[u][ct][h][1] = in1 ? gv_ld_w(wp[ct][h] + kk + 8) : zero;
                }
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                xb[u][j][0] = in0 && xin[j] ? gv_ld_x(xp[j] + kk) : zero;
                xb[u][j][1] = in1 && xin[j] ? gv_ld_x(xp[j] + kk + 8) : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int v = 0; v < 2; ++v)
#pragma unroll
                for (int p = 0; p < 2; ++p)
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct) {
                        const unsigned int a0 = gv_word(wa[u][ct][0][v], 2 * p);
                        const unsigned int a1 = gv_word(wa[u][ct][1][v], 2 * p);
                        const unsigned int a2 = gv_word(wa[u][ct][0][v], 2 * p + 1);
                        const unsigned int a3 = gv_word(wa[u][ct][1][v], 2 * p + 1);
#pragma unroll
                        for (int j = 0; j < MT; ++j)
                            gv_mma(acc[ct][j], a0, a1, a2, a3, gv_word(xb[u][j][v], 2 * p),
                                   gv_word(xb[u][j][v], 2 * p + 1));
                    }
    }

    // The warps' tiles, [8 MT rows][16 CT columns] each, added in warp order.
    float* r = gv_red + warp * RW;
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                r[(8 * j + 2 * t + (i & 1)) * (16 * CT) + 16 * ct + g + 8 * (i >> 1)] = acc[ct][j][i];
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * CT * M; e += blockDim.x) {
        const int m = e / (16 * CT), nl = e % (16 * CT);  // neighbouring threads: neighbouring columns
        const long long n = nb + nl;
        if (n >= N) continue;
        float sum = 0.f;
        for (int wi = 0; wi < nw; ++wi) sum += gv_red[wi * RW + m * (16 * CT) + nl];
        gv_store(out, part, s, M, N, m, n, sum);
    }
#else
    __trap();  // never launched: kernels/cuda.py uses these for bf16/fp16 on sm_80+ only
#endif
}

#define GEMV_TC(GV_MT, GV_CT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32)                                              \
        gemv_tc_t##GV_MT##_c##GV_CT(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,  \
                                    long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,    \
                                    int N, int K, int kchunk, int vec_ok) { PDL_ENTER();                                       \
        (void)vec_ok;                                                                                             \
        gv_tc<GV_MT, GV_CT>(x, xs, w, wsr, out, part, M, N, K, kchunk);                                           \
    }
GEMV_TC(1, 1)
GEMV_TC(2, 1)
GEMV_TC(3, 1)
GEMV_TC(1, 2)
GEMV_TC(2, 2)
GEMV_TC(3, 2)

// ---- split-K combine ----------------------------------------------------------------------------------------
// out[i] = sum over s of part[s * MN + i], in split order, rounded once. grid ceil(MN / 256), block 256.
extern "C" __global__ void gemv_combine(const float* __restrict__ part, scalar_t* __restrict__ out, int S, int MN) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += part[(long long)s * MN + i];
    out[i] = gv_out(sum);
}
