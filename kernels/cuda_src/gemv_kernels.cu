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
// Two families, the same parameter list (kernels/launch_args.py GemvArgs), each also with a fused form:
//  ..._an   (GemvAddNormArgs) the projection whose output joins the residual stream and is normed, in one
//           launch (op gemv_add_rmsnorm): every block stores its fp32 partials; the last split of a column tile
//           to finish (a per-tile counter; no split: the block itself) adds the splits in split order, rounds
//           the product once, adds the residual and rounds again (s, the new residual stream: bit for bit
//           gemv -> add_rmsnorm); the last tile to finish (a counter for the launch) norms the row, or with M
//           rows the last M tiles a row each, the whole block a row: its sum of squares in a fixed order whatever
//           M is (so a row's bits never depend on the rows beside it), then y. The counters are left at zero.
//           (The MLP's silu_mul is not folded into the down projection's loads: every warp would work out the
//           activation of the same x elements again, which makes the product ALU-bound past one row.)
//  ..._sm   (GemvSiluArgs) the MLP's packed gate|up product [2 I, K] and silu_mul in one launch (op gemv_silu_mul):
//           each output column's gate row n and up row n + I are summed by one warp (CUDA cores, C = 2) or one
//           tile (tensor cores: gate in tile rows 16 ct + g, up in 16 ct + 8 + g), exactly as the plain form sums
//           them, then silu_mul's arithmetic on the two rounded sums; no K split.
//  ..._ss   (GemvSplitSiluArgs) the packed gate|up product with K splits and silu_mul in one launch (op gemv_silu_mul
//           with kernels/cuda.py _GEMV_SPLIT_SILU on; off by default, measured slower than the product then
//           gemv_combine_sm): each block stores its split's fp32 partials, and the last of a gate tile's and its up
//           tile's blocks to count in adds them in split order and applies the activation (gv_split_silu).
//  ..._mlp  (GemvMlpArgs, one row, CUDA cores) the MLP and the add + norm after it in one launch (op
//           gemv_mlp_add_rmsnorm): the _sm code for the activation, then the _an code for the down product, its
//           blocks ordered by tickets and waiting for their K split's part of the activation (see there).
//  gemv_simt_m{MB}_c{C}   CUDA cores, any dtype. Each warp owns C consecutive output columns and its K range;
//                         lanes stream the W rows with 16-byte loads (vec_ok) or scalar loads (otherwise),
//                         read the x rows (L1/L2-resident) at the same offsets, FMA in fp32 and reduce with
//                         shuffles. MB = the row bucket's largest M (1, 4, 8, 17): accumulators C x MB.
//  gemv_tc_t{MT}_c{CT}    bf16/fp16 tensor cores (mma.sync m16n8k16, sm_80+), needs vec_ok. A warp computes
//                         C^T[16 CT columns, 8 MT rows] over interleaved 64-element K steps; the block's warps
//                         split the K range and add their tiles in shared memory (fixed warp order). Each
//                         thread loads 16 contiguous bytes of W rows g and g+8 and of x row g at the same
//                         K offsets (the 4 threads of a row side by side: a warp load reads 64 contiguous
//                         bytes of each of 8 rows); since a dot product does not depend on the order of k, those 8 elements
//                         are fed to the mma's k-slots of that thread directly (the same permutation of k for
//                         W and x), so every load is a 16-byte vector, no shuffles, no shared-memory staging.

// Programmatic dependent launch (kernels/pdl.py): every kernel opens with PDL_ENTER(): let the next kernel of
// the stream be scheduled, then wait until the previous kernel has completed and its writes are visible. No
// kernel touches global memory before it (but the products below, and the MLP form's ticket, see there). Without
// the launch attribute (or before sm_90) both do nothing.
//
// The products themselves (gemv_simt_*, gemv_tc_*, their _an and _sm forms) split it: PDL_TRIGGER() first, then
// each thread issues its first batch of W loads, and only then PDL_WAIT(), before any read of x or write of
// out, part, counters. W is a weight, which no kernel of a decode step writes, so reading it before the
// previous kernel is done is safe; with the launch attribute those loads are in flight while the previous
// kernel drains (the memory pipe is not left idle at the boundary). Nothing else is touched before the wait,
// but in the MLP form (..._mlp) each block's ticket, an atomic on a counter of its own launch site taken before
// PDL_TRIGGER() (see there for why that is safe).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_ENTER()
#define PDL_TRIGGER()
#define PDL_WAIT()
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

// Rounded to scalar_t and back (the value a tensor of the dtype holds).
__device__ __forceinline__ float gv_rnd(float f) {
#if SCALAR_KIND == 0
    return f;
#else
    return gv_f(gv_out(f));
#endif
}

// 8 (or 4 fp32) values packed into a 16-byte vector of scalar_t (the lower index in the low half).
__device__ __forceinline__ uint4 gv_pack(const float* f) {
    uint4 r;
#if SCALAR_KIND == 0
    r.x = __float_as_uint(f[0]);
    r.y = __float_as_uint(f[1]);
    r.z = __float_as_uint(f[2]);
    r.w = __float_as_uint(f[3]);
#else
    r.x = (unsigned int)gv_out(f[0]) | ((unsigned int)gv_out(f[1]) << 16);
    r.y = (unsigned int)gv_out(f[2]) | ((unsigned int)gv_out(f[3]) << 16);
    r.z = (unsigned int)gv_out(f[4]) | ((unsigned int)gv_out(f[5]) << 16);
    r.w = (unsigned int)gv_out(f[6]) | ((unsigned int)gv_out(f[7]) << 16);
#endif
    return r;
}

// The fused epilogue's operands (the _an kernels): residual r [M, N] at row stride rs, the norm's fp32
// weight nw [N], outputs y = rmsnorm(s) and s = product + r ([M, N] contiguous), the launch's counters cnt
// (one for the launch, one per column tile, then one for the rows' norms; zero between launches), eps.
// tile, ntiles: the block's column tile and the tiles of the product (tile < 0: blockIdx.x, gridDim.x); zero,
// nzero: more counters the launch's last block leaves at zero, and ticket: one it takes gridDim.x off (the MLP
// form's chunk counters and ticket counter).
struct GvEpi {
    const scalar_t* r;
    long long rs;
    const float* nw;
    scalar_t* y;
    scalar_t* s;
    int* cnt;
    float eps;
    int tile = -1;
    int ntiles = 0;
    int* zero = nullptr;
    int nzero = 0;
    int* ticket = nullptr;
};

// The sum of v over the block, in a fixed order (lanes, then warps in order); every thread gets it.
__device__ __forceinline__ float gv_block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = gv_warp_sum(v);
    __syncthreads();  // sh is free (an earlier call's readers are done)
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += sh[i];
    return t;
}

// y's vector v of a row: s * rsq * (1 + w), rounded once.
__device__ __forceinline__ void gv_norm_store(const uint4& sv, float rsq, const float* __restrict__ nw, scalar_t* yr,
                                              int v) {
    float f[GV_VEC];
    gv_unpack(sv, f);
#pragma unroll
    for (int j = 0; j < GV_VEC; ++j) f[j] = f[j] * rsq * (1.0f + nw[(long long)v * GV_VEC + j]);
    *reinterpret_cast<uint4*>(yr + (long long)v * GV_VEC) = gv_pack(f);
}

// A 16-byte load that bypasses L1: data other blocks of this launch wrote.
__device__ __forceinline__ uint4 gv_ld_cg(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float gv_sum_squares(const uint4& sv) {
    float f[GV_VEC], ss = 0.f;
    gv_unpack(sv, f);
#pragma unroll
    for (int j = 0; j < GV_VEC; ++j) ss = __fmaf_rn(f[j], f[j], ss);
    return ss;
}

// Thread 0 counts the block in at *cnt (release: the block's stores before it; acquire: what the blocks counted
// before it stored) and tells the block whether it was the `of`-th, the last (which leaves *cnt at zero).
__device__ __forceinline__ bool gv_last_in(int* cnt, int of, int* flag) {
    __syncthreads();  // the block's stores are done
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory");
        *flag = old == of - 1;
        if (*flag) *cnt = 0;
    }
    __syncthreads();
    return *flag;
}

// Thread 0 waits until *c >= target (acquire: what the blocks counted in there stored is visible after).
__device__ __forceinline__ void gv_wait_count(const int* c, int target) {
    for (;;) {
        int v;
        asm volatile("ld.acquire.gpu.s32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
        if (v >= target) return;
        __nanosleep(100);
    }
}

#define GV_NORM_KEEP 4  // 16-byte vectors of a row a thread keeps in registers between the norm's two passes
// One row's norm by the whole block: yr = sr * rsqrt(mean(sr^2) + eps) * (1 + w), add_rmsnorm's arithmetic, the sum
// of squares in a fixed order (each thread's vectors v = t, t + nt, ... in order, then gv_block_sum), so the same
// bits for the same block size. sr read past L1 (other blocks stored it); yr 16-byte aligned; N % GV_VEC == 0. Every
// thread of the block calls it.
__device__ __forceinline__ void gv_norm_row(const scalar_t* sr, scalar_t* yr, const float* __restrict__ nw, float eps,
                                            int N) {
    __shared__ float gv_nsh[GV_MAX_WARPS];
    const int nt = blockDim.x, nv = N / GV_VEC;
    uint4 keep[GV_NORM_KEEP];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < GV_NORM_KEEP; ++i) {
        const int v = threadIdx.x + i * nt;
        if (v < nv) keep[i] = gv_ld_cg(sr + (long long)v * GV_VEC);
    }
#pragma unroll
    for (int i = 0; i < GV_NORM_KEEP; ++i)
        if (threadIdx.x + i * nt < nv) ss += gv_sum_squares(keep[i]);
    for (int v = threadIdx.x + GV_NORM_KEEP * nt; v < nv; v += nt)
        ss += gv_sum_squares(gv_ld_cg(sr + (long long)v * GV_VEC));
    const float rsq = rsqrtf(gv_block_sum(ss, gv_nsh) / (float)N + eps);
#pragma unroll
    for (int i = 0; i < GV_NORM_KEEP; ++i) {
        const int v = threadIdx.x + i * nt;
        if (v < nv) gv_norm_store(keep[i], rsq, nw, yr, v);
    }
    for (int v = threadIdx.x + GV_NORM_KEEP * nt; v < nv; v += nt)
        gv_norm_store(gv_ld_cg(sr + (long long)v * GV_VEC), rsq, nw, yr, v);
}

// Called by every thread of every block once its split's partials of columns [nb, nb + cols) are stored.
// Needs N % GV_VEC == 0 and y, s 16-byte aligned (kernels/cuda.py checks). y == nullptr: the deferred form (op
// gemv_add): s only, no norm and no counter but a K split's; the consumer scales by the norm itself (NX below).
__device__ __forceinline__ void gv_add_norm(const float* __restrict__ part, int S, int M, int N, long long nb,
                                            int cols, const GvEpi& e) {
    __shared__ int gv_flag;
    const int tile = e.tile >= 0 ? e.tile : (int)blockIdx.x, ntiles = e.tile >= 0 ? e.ntiles : (int)gridDim.x;
    if (S > 1 && !gv_last_in(e.cnt + 1 + tile, S, &gv_flag)) return;  // the tile's last split goes on
    if (S == 1) __syncthreads();  // the block's own partials
    // The tile's splits added in split order, rounded once (gemv_combine), then s = product + residual.
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols;
        const long long n = nb + i % cols;
        if (n >= N) continue;
        float sum = 0.f;
        for (int j = 0; j < S; ++j) sum += __ldcg(part + ((long long)j * M + m) * N + n);
        e.s[(long long)m * N + n] = gv_out(gv_rnd(gv_rnd(sum) + gv_f(e.r[m * e.rs + n])));
    }
    if (e.y == nullptr) return;  // deferred: the consumer norms the rows
    // The rows' norms. One row: by the last tile to count in at the launch's counter (cnt[0]). Several rows (M
    // no more than the tiles): by the last M tiles to count in, a row each (the (ntiles - M + r)-th to arrive
    // norms row r), each waiting until every tile has counted in; before, one block normed every row in turn, M
    // serial passes over s. Each of them counts in at cnt[1 + ntiles] when its row is done; the last leaves both
    // counters at zero (every one of them has seen cnt[0] complete by then). No deadlock: at most M - 1 blocks
    // wait at once, and the tiles still to come need only a free block slot. A row is normed by the same code
    // either way, so its bits do not depend on M.
    __syncthreads();  // the block's stores are done
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(e.cnt) : "memory");
        gv_flag = old;
    }
    __syncthreads();
    const int arrived = gv_flag;
    const bool spread = M > 1 && M <= ntiles;
    int m_lo = 0, m_hi = M;
    if (spread) {
        if (arrived < ntiles - M) return;
        m_lo = arrived - (ntiles - M);
        m_hi = m_lo + 1;
        if (threadIdx.x == 0) gv_wait_count(e.cnt, ntiles);
        __syncthreads();
    } else {
        if (arrived != ntiles - 1) return;
        if (threadIdx.x == 0) {
            *e.cnt = 0;
            for (int i = 0; i < e.nzero; ++i) e.zero[i] = 0;
            if (e.ticket != nullptr) atomicSub(e.ticket, (int)gridDim.x);
        }
    }
    // Every row of s is complete. The whole block a row (gv_norm_row: a fixed order whatever M is).
    for (int m = m_lo; m < m_hi; ++m) gv_norm_row(e.s + (long long)m * N, e.y + (long long)m * N, e.nw, e.eps, N);
    if (spread && threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(e.cnt + 1 + ntiles) : "memory");
        if (old == M - 1) {
            e.cnt[1 + ntiles] = 0;
            *e.cnt = 0;
            for (int i = 0; i < e.nzero; ++i) e.zero[i] = 0;
            if (e.ticket != nullptr) atomicSub(e.ticket, (int)gridDim.x);
        }
    }
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
//
// The MLP's activation form (_sm, op gemv_silu_mul): W is the packed gate|up matrix [2 I, K], N = I; a warp owns
// ONE output column n and its two W rows, gate row n and up row n + I (C = 2), and stores silu_mul's arithmetic
// of the two rounded sums: (silu(gate).to(dtype) * up).to(dtype). No K split (S = 1).

// silu_mul's arithmetic (decode_kernels.cu silu_mul) on the two fp32 sums of a column: each rounded to the dtype
// first, as the product's output would be.
__device__ __forceinline__ scalar_t gv_silu_mul(float gate, float up) {
    const float g = gv_rnd(gate);
    return gv_out(gv_rnd(g / (1.0f + expf(-g))) * gv_rnd(up));
}

// The _ss forms' epilogue (op gemv_silu_mul with K splits, one launch instead of the product and gemv_combine_sm):
// called by every thread of every block once its split's fp32 partials of its tile of the packed gate|up product
// [M, 2 I] are stored. The launch's tiles of `cols` columns are gridDim.x = 2 I / cols (I a multiple of cols), the
// gate half's tile p paired with the up half's tile p + gridDim.x / 2; the last of the pair's 2 S blocks to count
// in at cnt[p] (leaving it at zero) adds each column's gate and up partials in split order and stores silu_mul's
// arithmetic on them: gemv_combine_sm's code, so the same bits as the two launches.
__device__ __forceinline__ void gv_split_silu(const float* __restrict__ part, int S, int M, int I, int cols,
                                              scalar_t* __restrict__ out, int* cnt) {
    __shared__ int gv_flag;
    const int pair = (int)blockIdx.x % ((int)gridDim.x >> 1);
    if (!gv_last_in(cnt + pair, 2 * S, &gv_flag)) return;
    const long long MN = 2LL * M * I;
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols;
        const long long n = (long long)pair * cols + i % cols, g0 = (long long)m * 2 * I + n;
        float gate = 0.f, up = 0.f;
        for (int j = 0; j < S; ++j) {
            gate += __ldcg(part + j * MN + g0);
            up += __ldcg(part + j * MN + g0 + I);
        }
        out[(long long)m * I + n] = gv_silu_mul(gate, up);
    }
}

// One batch of U vectors of each of the C rows at vectors v, v + 32, ... into acc (the order of k per lane
// is the same whatever U is: vectors in increasing order).
// XM, where x is read from: 0 global (read-only loads), 1 global past L1 (x was stored by other blocks of this launch:
// the MLP form's activation), 2 shared memory (the resident MLP form's activation, staged by the block).
template <int XM>
__device__ __forceinline__ uint4 gv_ld_xm(const scalar_t* p) {
    if (XM == 2) return *reinterpret_cast<const uint4*>(p);
    return XM == 1 ? gv_ld_cg(p) : gv_ld_x(p);
}
// NX: also each row's sum of squares of x into ssq (the deferred norm: gv_simt_cols).
template <int MB, int C, int U, int XM = 0, bool NX = false>
__device__ __forceinline__ void gv_simt_batch(float (&acc)[C][MB], const uint4 (&wv)[U][C],
                                              const scalar_t* __restrict__ x, long long xs, int M, int v,
                                              float* ssq = nullptr) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float wf[C][GV_VEC];
#pragma unroll
        for (int c = 0; c < C; ++c) gv_unpack(wv[u][c], wf[c]);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
            if (m < M) {
                float xf[GV_VEC];
                const scalar_t* xp = x + m * xs + (long long)(v + u * 32) * GV_VEC;
                gv_unpack(gv_ld_xm<XM>(xp), xf);
                if (NX)
#pragma unroll
                    for (int e = 0; e < GV_VEC; ++e) ssq[m] = __fmaf_rn(xf[e], xf[e], ssq[m]);
#pragma unroll
                for (int c = 0; c < C; ++c)
#pragma unroll
                    for (int e = 0; e < GV_VEC; ++e) acc[c][m] = __fmaf_rn(wf[c][e], xf[e], acc[c][m]);
            }
        }
    }
}

// U vectors of each of the C rows at vectors v, v + 32, ... (weights only).
template <int U, int C>
__device__ __forceinline__ void gv_ld_w_batch(uint4 (&wv)[U][C], const scalar_t* const (&wr)[C], int v) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int c = 0; c < C; ++c) wv[u][c] = gv_ld_w(wr[c] + (long long)(v + u * 32) * GV_VEC);
}

// The warp's C columns from n0 (< N); SM: its one output column n0 (< N = I), rows n0 and n0 + N. split: the K split
// (blockIdx.y where negative). wait_at: after the PDL wait, lane 0 also waits until *wait_at >= wait_for (the MLP form:
// the activation's K range of this split stored by the launch's other blocks), x then read past L1 (XM 1).
// UL: 16-byte W loads in flight per lane (U * C; the order of k per lane is the same whatever it is).
// XM: where x is read from (gv_ld_xm). NX (the deferred norm, issue 20): x is the residual stream s of rows whose
// norm's weight is folded into W (W (1 + w) columnwise: Model.fold_norms), so x's norm is only its scale
// rsqrt(mean(s^2) + xeps); the warp sums each row's squares as it reads x (its lanes' vectors in order, then
// gv_warp_sum: every warp that reads the whole row gets the same bits) and scales its sums by it at the end, after
// every FMA: no wait for the norm before the product. Needs vec_ok and no K split.
template <int MB, int C, bool SM, int XM = 0, int UL = 4, bool NX = false>
__device__ __forceinline__ void gv_simt_cols(const scalar_t* __restrict__ x, long long xs,
                                             const scalar_t* __restrict__ w, long long wsr, scalar_t* __restrict__ out,
                                             float* __restrict__ part, int M, int N, int K, int kchunk, int vec_ok,
                                             long long n0, int split, const int* wait_at, int wait_for, float xeps) {
    constexpr int U = UL / C;  // 16-byte W loads in flight per lane: U * C = UL
    const int lane = threadIdx.x & 31;
    const int s = split >= 0 ? split : (int)blockIdx.y;
    const int k0 = s * kchunk;
    const int k1 = K < k0 + kchunk ? K : k0 + kchunk;
    const scalar_t* wr[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        if (SM)
            wr[c] = w + (n0 + (long long)c * N) * wsr;
        else
            wr[c] = w + (n0 + c < N ? n0 + c : n0) * wsr;  // a column past N reads n0
    }
    float acc[C][MB];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int m = 0; m < MB; ++m) acc[c][m] = 0.f;
    float ssq[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) ssq[m] = 0.f;

    if (vec_ok) {
        const int v1 = k1 / GV_VEC;
        int v = k0 / GV_VEC + lane;
        uint4 wv[U][C];
        // The first batch of W is loaded before the wait (see PDL_TRIGGER above), then used first.
        const bool pre = v + (U - 1) * 32 < v1;
        if (pre) gv_ld_w_batch<U, C>(wv, wr, v);
        PDL_WAIT();
        if (wait_at != nullptr) {
            if (lane == 0) gv_wait_count(wait_at, wait_for);
            __syncwarp();
        }
        if (pre) {
            gv_simt_batch<MB, C, U, XM, NX>(acc, wv, x, xs, M, v, ssq);
            v += U * 32;
        }
        for (; v + (U - 1) * 32 < v1; v += U * 32) {
            gv_ld_w_batch<U, C>(wv, wr, v);
            gv_simt_batch<MB, C, U, XM, NX>(acc, wv, x, xs, M, v, ssq);
        }
        for (; v < v1; v += 32) {
            uint4 w1[1][C];
            gv_ld_w_batch<1, C>(w1, wr, v);
            gv_simt_batch<MB, C, 1, XM, NX>(acc, w1, x, xs, M, v, ssq);
        }
    } else {
        PDL_WAIT();  // (the MLP form needs vec_ok: kernels/cuda.py checks)
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
    if (NX)
#pragma unroll
        for (int m = 0; m < MB; ++m)
            if (m < M) {
                const float rsq = rsqrtf(gv_warp_sum(ssq[m]) / (float)K + xeps);
#pragma unroll
                for (int c = 0; c < C; ++c) acc[c][m] *= rsq;
            }
    if (lane == 0) {
        if (SM) {
#pragma unroll
            for (int m = 0; m < MB; ++m)
                if (m < M) out[(long long)m * N + n0] = gv_silu_mul(acc[0][m], acc[C - 1][m]);
        } else {
#pragma unroll
            for (int c = 0; c < C; ++c)
                if (n0 + c < N)
#pragma unroll
                    for (int m = 0; m < MB; ++m)
                        if (m < M) gv_store(out, part, s, M, N, m, n0 + c, acc[c][m]);
        }
    }
}

// EPI: the fused add + norm after the product (gv_add_norm; part given, out unused). SM: the activation form
// (one output column a warp).
// bx: the block's column tile (blockIdx.x, but for the fused in_proj form's own order of tiles).
// split, S, wait_at, wait_for: the MLP form's (see gv_simt_cols; split < 0: blockIdx.y of gridDim.y splits).
template <int MB, int C, bool EPI, bool SM, int XM = 0, int UL = 4, bool NX = false>
__device__ __forceinline__ void gv_simt(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,
                                        long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,
                                        int N, int K, int kchunk, int vec_ok, const GvEpi& epi, int bx,
                                        int split = -1, int S = 0, const int* wait_at = nullptr, int wait_for = 0,
                                        float xeps = 0.f) {
    const int nw = blockDim.x >> 5;
    constexpr int OC = SM ? 1 : C;  // output columns a warp
    const long long n0 = ((long long)bx * nw + (threadIdx.x >> 5)) * OC;
    if (n0 < N)
        gv_simt_cols<MB, C, SM, XM, UL, NX>(x, xs, w, wsr, out, part, M, N, K, kchunk, vec_ok, n0, split, wait_at,
                                            wait_for, xeps);
    else
        PDL_WAIT();
    if (EPI) gv_add_norm(part, split >= 0 ? S : (int)gridDim.y, M, N, (long long)bx * nw * C, nw * C, epi);
}

#define GEMV_SIMT(GV_MB, GV_C)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32)                                              \
        gemv_simt_m##GV_MB##_c##GV_C(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, \
                                     long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,   \
                                     int N, int K, int kchunk, int vec_ok) {                                       \
        PDL_TRIGGER();                                                                                            \
        gv_simt<GV_MB, GV_C, false, false>(x, xs, w, wsr, out, part, M, N, K, kchunk, vec_ok, GvEpi{},           \
                                            blockIdx.x);                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m##GV_MB##_c##GV_C##_an(             \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        float* __restrict__ part, int M, int N, int K, int kchunk, int vec_ok, const scalar_t* __restrict__ r,     \
        long long rs, const float* __restrict__ nw, scalar_t* __restrict__ y, scalar_t* __restrict__ s,           \
        int* __restrict__ cnt, float eps) {                                                                       \
        PDL_TRIGGER();                                                                                            \
        gv_simt<GV_MB, GV_C, true, false>(x, xs, w, wsr, nullptr, part, M, N, K, kchunk, vec_ok,                 \
                                          GvEpi{r, rs, nw, y, s, cnt, eps}, blockIdx.x);                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m##GV_MB##_c##GV_C##_ss(             \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, float* __restrict__ part, int M, int N, int K, int kchunk, int vec_ok,        \
        int* __restrict__ cnt) {                                                                                  \
        PDL_TRIGGER();                                                                                            \
        gv_simt<GV_MB, GV_C, false, false>(x, xs, w, wsr, nullptr, part, M, N, K, kchunk, vec_ok, GvEpi{},       \
                                           blockIdx.x);                                                          \
        gv_split_silu(part, (int)gridDim.y, M, N / 2, (int)(blockDim.x >> 5) * GV_C, out, cnt);                  \
    }
// The activation form: C = 2 only (a warp's gate and up rows).
#define GEMV_SIMT_SM(GV_MB)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m##GV_MB##_c2_sm(                   \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, int vec_ok) {                                            \
        PDL_TRIGGER();                                                                                            \
        gv_simt<GV_MB, 2, false, true>(x, xs, w, wsr, out, nullptr, M, N, K, K, vec_ok, GvEpi{}, blockIdx.x);    \
    }

// The product of a layer's input row (op gemv_norm, GemvNormArgs; one row, no K split): x is the residual stream and
// W carries the input norm's weight (folded: Model.fold_norms), so the product's input is rmsnorm(x) with no weight;
// each warp sums x's squares as it reads it and scales its sums by the norm after its FMAs (gv_simt_cols's NX).
#define GEMV_SIMT_NX(GV_C)                                                                                        \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m1_c##GV_C##_nx(                    \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, float xeps) {                                           \
        PDL_TRIGGER();                                                                                            \
        gv_simt<1, GV_C, false, false, 0, 4, true>(x, xs, w, wsr, out, nullptr, M, N, K, K, 1, GvEpi{},          \
                                                   blockIdx.x, -1, 0, nullptr, 0, xeps);                         \
    }

// ---- the MLP of one row in one launch (op gemv_mlp_add_rmsnorm) ------------------------------------------
// gemv_simt_m1_c{C}_mlp (GemvMlpArgs): act [1, I] = silu_mul of the packed gate|up product x @ Wg^T (Wg [2 I, K],
// gemv_simt_m1_c2_sm's code: a warp a column), then the down projection act @ Wd^T (Wd [N, I], gemv_simt_m1_c{C}'s
// code in S K splits of kchunk) with the residual add and norm (gv_add_norm, as gemv_simt_m1_c{C}_an): the same
// bits as gemv_silu_mul then gemv_add_rmsnorm with those variants, in one launch instead of two or three.
//  - Each block takes a ticket at mcnt[0] (an atomic, before anything else, even PDL_TRIGGER): its role is the ticket
//    modulo the launch's blocks G. Roles [0, I / warps) make the activation's columns (role t: columns [t warps,
//    (t + 1) warps)), the rest the down product, split by split (role ngu + sp ntiles + tile: column tile `tile` of
//    split sp), so every split-0 tile comes first. The ticket is the one thing touched before the PDL wait: a later
//    launch of the same kernel on the same counters (the MTP head's MLP, draft step after draft step) can take
//    tickets before this one is done, but only once every block of this one has taken its ticket and triggered (so
//    its tickets follow all of ours); this launch's last block takes G off the counter (not a reset), which leaves
//    the tickets already taken by the next launch valid modulo G.
//  - An activation block, once its columns are stored, counts in at the chunk counter mcnt[1 + c] of each K split c
//    its columns fall in (release). A down block issues its first W loads, waits for the previous kernel (PDL),
//    then each warp's lane 0 until its split's chunk counter has every activation block of that K range (acquire),
//    and reads the activation past L1.
//  - Deadlock-free in any scheduling order: a block waits only for blocks of lower tickets, which had started
//    when it took its ticket and never wait themselves. The launch's last block (gv_add_norm's) leaves mcnt at zero
//    with the _an counters cnt (G off mcnt[0]); needs I a multiple of the warps, N of warps * C (kernels/cuda.py
//    checks), and the counters of one launch shape (kernels/cuda.py keys them by the variant too).
#define GEMV_SIMT_MLP(GV_C)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m1_c##GV_C##_mlp(                   \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ wg, long long wgs, scalar_t* act, int I,     \
        int K, const scalar_t* __restrict__ wd, long long wds, float* __restrict__ part, int N, int kchunk, int S, \
        const scalar_t* __restrict__ r, const float* __restrict__ nw, scalar_t* __restrict__ y,                   \
        scalar_t* __restrict__ s, int* __restrict__ cnt, int* __restrict__ mcnt, float eps,                       \
        int xnorm) {                                                                                              \
        __shared__ int s_ticket;                                                                                  \
        if (threadIdx.x == 0) s_ticket = atomicAdd(mcnt, 1) % (int)gridDim.x;                                     \
        __syncthreads();                                                                                          \
        PDL_TRIGGER();                                                                                            \
        (void)xnorm; /* kernels/cuda.py gives the deferred norm to the resident form only */                      \
        const int t = s_ticket, warps = blockDim.x >> 5, ngu = I / warps;                                        \
        if (t < ngu) {                                                                                            \
            gv_simt<1, 2, false, true>(x, 0, wg, wgs, act, nullptr, 1, I, K, K, 1, GvEpi{}, t);                   \
            __syncthreads(); /* the block's columns are stored */                                                 \
            if (threadIdx.x == 0) {                                                                               \
                const int lo = t * warps, hi = lo + warps;                                                        \
                for (int c = lo / kchunk; c <= (hi - 1) / kchunk && c < S; ++c)                                   \
                    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(mcnt + 1 + c) : "memory");      \
            }                                                                                                     \
            return;                                                                                               \
        }                                                                                                         \
        const int d = t - ngu, ntiles = N / (warps * GV_C), tile = d % ntiles, sp = d / ntiles;                  \
        const int lo = sp * kchunk, hi = I < lo + kchunk ? I : lo + kchunk;                                       \
        GvEpi e{r, N, nw, y, s, cnt, eps};                                                                        \
        e.tile = tile;                                                                                            \
        e.ntiles = ntiles;                                                                                        \
        e.zero = mcnt + 1;                                                                                        \
        e.nzero = S;                                                                                              \
        e.ticket = mcnt;                                                                                          \
        gv_simt<1, GV_C, true, false, 1>(act, 0, wd, wds, nullptr, part, 1, N, I, kchunk, 1, e, tile, sp, S,      \
                                            mcnt + 1 + sp, (hi - 1) / warps - lo / warps + 1);                    \
    }

// gemv_simt_m1_c{C}_rmlp (GemvMlpArgs; kchunk = I, S = 1): the MLP of one row in one launch with every block resident
// at once (grid: the blocks that fit on the GPU together, kernels/cuda.py; the "res{C}.wW.s1" variants), so no block
// takes a role and none is scheduled late (bench/persistent_chain.py measured the design):
//  1. each block makes the activation's column tiles blockIdx.x, + G, ... (gemv_simt_m1_c2_sm's code: a warp a
//     column, no K split), then counts in at mcnt[0] (release);
//  2. each block with a column tile of the down product issues its warps' first W loads, waits until every block
//     has counted in (acquire), stages the whole activation in shared memory (read past L1, once a block instead of
//     once a warp), then makes the tile (gemv_simt_m1_c{C}'s code, its vectors in the same order, so the same sums)
//     and gv_add_norm's add + norm (the _an form's code and counters cnt, no split).
// The same bits as gemv_silu_mul (variant simt{C}.wW.s1) then gemv_add_rmsnorm (simt{C}.wW.s1). xnorm (the deferred
// norm): x is the residual stream s and wg carries its norm's weight (folded), each activation warp scales its two
// sums by rsqrt(mean(s^2) + eps) after its FMAs (gv_simt_cols NX): within a rounding of the norm then the product
// (y is not rounded to the dtype between them), and nothing waits for the norm. The launch's last
// tile (gv_add_norm's) leaves mcnt and cnt at zero; every block has counted in at mcnt by then. y == nullptr (the
// norm after it deferred to the next layer's product, kernels/cuda.py gemv_conv_delta_rule_norm's x_eps): s only,
// and mcnt[0] (the arrivals) is reset with mcnt[1] by the last block past its wait (no block reads them again in
// this launch). A block waits only
// while every block is resident (the grid is sized so), so the wait always ends (no
// other kernel holding SMs indefinitely meanwhile: docs/architecture.md). Needs vec_ok, I a multiple of the
// warps and of GV_VEC, N of warps * C, and I elements of shared memory (kernels/cuda.py checks).
#define GV_RMLP_LOADS 8  // 16-byte W loads in flight per lane (fewer, fatter blocks than the per-launch forms')
template <int C>
__device__ __forceinline__ void gv_resident_mlp(const scalar_t* __restrict__ x, const scalar_t* __restrict__ wg,
                                                long long wgs, scalar_t* act, int I, int K,
                                                const scalar_t* __restrict__ wd, long long wds,
                                                float* __restrict__ part, int N, const scalar_t* __restrict__ r,
                                                const float* __restrict__ nw, scalar_t* __restrict__ y,
                                                scalar_t* __restrict__ s, int* __restrict__ cnt, int* mcnt, float eps,
                                                int xnorm) {
    extern __shared__ uint4 gv_act4[];
    constexpr int U = GV_RMLP_LOADS / C;  // twice gv_simt_cols's loads in flight (the same order of k per lane)
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31, ngu = I / warps, ntiles = N / (warps * C);
    if (xnorm == 0) {
        for (int t = blockIdx.x; t < ngu; t += gridDim.x)
            gv_simt<1, 2, false, true, 0, GV_RMLP_LOADS>(x, 0, wg, wgs, act, nullptr, 1, I, K, K, 1, GvEpi{}, t);
    } else {  // x is the residual stream, its norm's weight folded into wg: each warp scales its sums (NX)
        for (int t = blockIdx.x; t < ngu; t += gridDim.x)
            gv_simt<1, 2, false, true, 0, GV_RMLP_LOADS, true>(x, 0, wg, wgs, act, nullptr, 1, I, K, K, 1, GvEpi{},
                                                               t, -1, 0, nullptr, 0, eps);
    }
    PDL_WAIT();  // (a block without an activation tile has not waited yet)
    __syncthreads();  // the block's columns are stored
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(mcnt) : "memory");
    const int v1 = I / GV_VEC;
    const scalar_t* xa = reinterpret_cast<const scalar_t*>(gv_act4);
    bool staged = false;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const long long n0 = ((long long)tile * warps + (threadIdx.x >> 5)) * C;
        const scalar_t* wr[C];
#pragma unroll
        for (int c = 0; c < C; ++c) wr[c] = wd + (n0 + c) * wds;
        float acc[C][1];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c][0] = 0.f;
        int v = lane;
        uint4 wv[U][C];
        const bool pre = v + (U - 1) * 32 < v1;
        if (pre) gv_ld_w_batch<U, C>(wv, wr, v);  // in flight during the wait and the staging
        if (!staged) {
            if (threadIdx.x == 0) {
                gv_wait_count(mcnt, (int)gridDim.x);
                if (y == nullptr) {  // no norm at the end to reset mcnt: the last block past the wait does (mcnt[1])
                    const int passers = ntiles < (int)gridDim.x ? ntiles : (int)gridDim.x;  // each waits once
                    if (atomicAdd(mcnt + 1, 1) == passers - 1) {
                        mcnt[1] = 0;
                        mcnt[0] = 0;
                    }
                }
            }
            __syncthreads();
            for (int i = threadIdx.x; i < v1; i += blockDim.x) gv_act4[i] = gv_ld_cg(act + (long long)i * GV_VEC);
            __syncthreads();
            staged = true;
        }
        if (pre) {
            gv_simt_batch<1, C, U, 2>(acc, wv, xa, 0, 1, v);
            v += U * 32;
        }
        for (; v + (U - 1) * 32 < v1; v += U * 32) {
            gv_ld_w_batch<U, C>(wv, wr, v);
            gv_simt_batch<1, C, U, 2>(acc, wv, xa, 0, 1, v);
        }
        for (; v < v1; v += 32) {
            uint4 w1[1][C];
            gv_ld_w_batch<1, C>(w1, wr, v);
            gv_simt_batch<1, C, 1, 2>(acc, w1, xa, 0, 1, v);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c][0] = gv_warp_sum(acc[c][0]);
        if (lane == 0)
#pragma unroll
            for (int c = 0; c < C; ++c) part[n0 + c] = acc[c][0];
        GvEpi e{r, N, nw, y, s, cnt, eps};
        e.tile = tile;
        e.ntiles = ntiles;
        e.zero = mcnt;
        e.nzero = 1;
        gv_add_norm(part, 1, 1, N, (long long)tile * warps * C, warps * C, e);
    }
}
#define GEMV_SIMT_RMLP(GV_C)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m1_c##GV_C##_rmlp(                  \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ wg, long long wgs, scalar_t* act, int I,     \
        int K, const scalar_t* __restrict__ wd, long long wds, float* __restrict__ part, int N, int kchunk, int S, \
        const scalar_t* __restrict__ r, const float* __restrict__ nw, scalar_t* __restrict__ y,                   \
        scalar_t* __restrict__ s, int* __restrict__ cnt, int* __restrict__ mcnt, float eps,                       \
        int xnorm) {                                                                                              \
        PDL_TRIGGER();                                                                                            \
        gv_resident_mlp<GV_C>(x, wg, wgs, act, I, K, wd, wds, part, N, r, nw, y, s, cnt, mcnt, eps, xnorm);       \
    }
#ifndef GV_DR_DK  // the plain module (kernels/cuda.py); the _dr forms are a module of their own per DK
GEMV_SIMT(1, 1)
GEMV_SIMT(1, 2)
GEMV_SIMT(4, 1)
GEMV_SIMT(4, 2)
GEMV_SIMT(8, 1)
GEMV_SIMT(8, 2)
GEMV_SIMT(17, 1)
GEMV_SIMT(17, 2)
GEMV_SIMT_SM(1)
GEMV_SIMT_SM(4)
GEMV_SIMT_MLP(1)
GEMV_SIMT_MLP(2)
GEMV_SIMT_RMLP(1)
GEMV_SIMT_RMLP(2)
GEMV_SIMT_SM(8)
GEMV_SIMT_SM(17)
GEMV_SIMT_NX(1)
GEMV_SIMT_NX(2)
#endif

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
// a K step is 64 elements; thread t holds elements [8 t, 8 t + 8) and [32 + 8 t, 32 + 8 t + 8) of the step as
// two vectors v = 0, 1, each four 32-bit words (so one load instruction of the warp reads 64 contiguous bytes
// of each of its 8 rows: whole 32-byte sectors). mma (v, p), p = 0, 1, takes words 2p and 2p + 1 of vector v:
//   A regs {a0, a1, a2, a3} = {W[g] word 2p, W[g+8] word 2p, W[g] word 2p+1, W[g+8] word 2p+1}
//   B regs {b0, b1}         = {x[g] word 2p, x[g] word 2p+1}
// so the mma's k-slots (2t, 2t+1 | 2t+8, 2t+9) of thread t are elements 8t + 32v + 4p + (0, 1 | 2, 3) for both
// operands; over t, v and p the 4 mmas of a step cover its 64 elements once. Accumulator c_i of thread (g, t):
// tile row 16 ct + g + 8 (i >= 2), x row 8 j + 2 t + (i & 1).
//
// Tile rows: 16 ct + 8 h + g is W row nb + 16 ct + 8 h + g (nb = 16 CT blockIdx.x). The activation form (SM,
// N = I): output column o = ob + 8 ct + g (ob = 8 CT blockIdx.x) has its gate row o in tile row 16 ct + g and
// its up row I + o in tile row 16 ct + 8 + g, so a tile makes 8 CT output columns.
// NX (the fused in_proj forms, x the residual stream whose norm's weight is folded into W; no K split): each lane
// also sums the squares of the x it loads; the warps' sums, added in warp order, are the block's per row over K, and
// its sums are scaled by rsqrt(sum / K + xeps) after every mma (within a rounding of the norm then the product).
template <int MT, int CT, bool EPI, bool SM, bool NX = false>
__device__ __forceinline__ void gv_tc(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,
                                      long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,
                                      int N, int K, int kchunk, const GvEpi& epi, int bx, float xeps = 0.f) {
#if SCALAR_KIND != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int U = 1;  // K steps a buffer holds per warp: U * CT * 2 KB of W
    constexpr int RW = 16 * CT * 8 * MT;  // floats of one warp's tile in shared memory
    extern __shared__ float gv_red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long nb = (long long)bx * (16 * CT);
    const long long ob = (long long)bx * (8 * CT);
    const int s = blockIdx.y;
    const int k0 = s * kchunk;
    const int k1 = K < k0 + kchunk ? K : k0 + kchunk;
    const int nsteps = (k1 - k0 + 63) >> 6;

    const scalar_t* wp[CT][2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            long long row;
            if (SM) {
                const long long o = ob + 8 * ct + g;
                row = (o < N ? o : (long long)N - 1) + h * (long long)N;  // columns past I: read, dropped
            } else {
                const long long n = nb + 16 * ct + 8 * h + g;
                row = n < N ? n : (long long)N - 1;  // rows past N: read, dropped
            }
            wp[ct][h] = w + row * wsr + k0 + 8 * t;
        }
    const scalar_t* xp[MT];
    bool xin[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        const int m = 8 * j + g;
        xin[j] = m < M;
        xp[j] = x + (xin[j] ? m : 0) * xs + k0 + 8 * t;
    }
    float acc[CT][MT][4];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[ct][j][i] = 0.f;
    float ssq[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) ssq[j] = 0.f;

    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    // One tile column (CT = 1): two buffers of W steps, wa and wb, the next step's loads issued before the current
    // one is multiplied, so the warp's loads stay in flight while it computes; two (CT = 2): one buffer of a step
    // (the registers of a second would cost occupancy). Either way the steps are multiplied in the order of one
    // buffer, so the same bits.
    uint4 wa[U][CT][2][2];
    // kk from the pointers (k0 + 8 t); (k1 - k0) % 8 == 0: a vector is wholly in or out
#define GV_TC_IN(stp, off) ((stp) < nsteps && k0 + (stp) * 64 + 8 * t + (off) < k1)
#define GV_TC_LOAD_W(buf, st0)                                                                                    \
    _Pragma("unroll") for (int u = 0; u < U; ++u) {                                                               \
        const int stp = (st0) + u * nw;                                                                           \
        const bool in0 = GV_TC_IN(stp, 0), in1 = GV_TC_IN(stp, 32);                                               \
        _Pragma("unroll") for (int ct = 0; ct < CT; ++ct) _Pragma("unroll") for (int h = 0; h < 2; ++h) {         \
            buf[u][ct][h][0] = in0 ? gv_ld_w(wp[ct][h] + stp * 64) : zero;                                         \
            buf[u][ct][h][1] = in1 ? gv_ld_w(wp[ct][h] + stp * 64 + 32) : zero;                                    \
        }                                                                                                         \
    }
    // The warp's first steps of W are loaded before the wait (see PDL_TRIGGER above).
    GV_TC_LOAD_W(wa, warp)
    PDL_WAIT();
    // x of the U steps from st, then their mmas with the W steps in buf
#define GV_TC_STEPS(buf, st)                                                                                      \
    {                                                                                                             \
        uint4 xb[U][MT][2];                                                                                       \
        _Pragma("unroll") for (int u = 0; u < U; ++u) {                                                           \
            const int stp = (st) + u * nw;                                                                        \
            const bool in0 = GV_TC_IN(stp, 0), in1 = GV_TC_IN(stp, 32);                                           \
            _Pragma("unroll") for (int j = 0; j < MT; ++j) {                                                      \
                xb[u][j][0] = in0 && xin[j] ? gv_ld_x(xp[j] + stp * 64) : zero;                                   \
                xb[u][j][1] = in1 && xin[j] ? gv_ld_x(xp[j] + stp * 64 + 32) : zero;                              \
                if (NX) ssq[j] += gv_sum_squares(xb[u][j][0]) + gv_sum_squares(xb[u][j][1]);                      \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("unroll") for (int u = 0; u < U; ++u) _Pragma("unroll") for (int v = 0; v < 2; ++v)               \
            _Pragma("unroll") for (int p = 0; p < 2; ++p) _Pragma("unroll") for (int ct = 0; ct < CT; ++ct) {     \
            const unsigned int a0 = gv_word(buf[u][ct][0][v], 2 * p);                                             \
            const unsigned int a1 = gv_word(buf[u][ct][1][v], 2 * p);                                             \
            const unsigned int a2 = gv_word(buf[u][ct][0][v], 2 * p + 1);                                         \
            const unsigned int a3 = gv_word(buf[u][ct][1][v], 2 * p + 1);                                         \
            _Pragma("unroll") for (int j = 0; j < MT; ++j)                                                        \
                gv_mma(acc[ct][j], a0, a1, a2, a3, gv_word(xb[u][j][v], 2 * p), gv_word(xb[u][j][v], 2 * p + 1)); \
        }                                                                                                         \
    }
    const int span = nw * U;  // steps one buffer holds, over the block's warps
    if constexpr (CT == 1) {
        uint4 wb[U][CT][2][2];
        for (int st = warp; st < nsteps; st += 2 * span) {
            if (st + span < nsteps) GV_TC_LOAD_W(wb, st + span)
            GV_TC_STEPS(wa, st)
            if (st + span >= nsteps) break;
            if (st + 2 * span < nsteps) GV_TC_LOAD_W(wa, st + 2 * span)
            GV_TC_STEPS(wb, st + span)
        }
    } else {
        for (int st = warp; st < nsteps; st += span) {
            if (st != warp) GV_TC_LOAD_W(wa, st)
            GV_TC_STEPS(wa, st)
        }
    }
#undef GV_TC_STEPS
#undef GV_TC_LOAD_W
#undef GV_TC_IN

    // The warps' tiles, [8 MT rows][16 CT tile rows] each, added in warp order.
    __shared__ float gv_nxw[GV_MAX_WARPS * 8 * MT];  // NX: the warps' sums of squares, [warp][8 MT rows]
    __shared__ float gv_nxs[8 * MT];                  // NX: the rows' scales
    if (NX)
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            float q = ssq[j];  // lane (g, t): row 8 j + g, a quarter of each step
            q += __shfl_xor_sync(0xffffffffu, q, 1);
            q += __shfl_xor_sync(0xffffffffu, q, 2);
            if (t == 0) gv_nxw[warp * 8 * MT + 8 * j + g] = q;
        }
    float* r = gv_red + warp * RW;
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                r[(8 * j + 2 * t + (i & 1)) * (16 * CT) + 16 * ct + g + 8 * (i >> 1)] = acc[ct][j][i];
    __syncthreads();
    if (NX) {
        if (threadIdx.x < 8 * MT) {
            float q = 0.f;
            for (int wi = 0; wi < nw; ++wi) q += gv_nxw[wi * 8 * MT + threadIdx.x];
            gv_nxs[threadIdx.x] = rsqrtf(q / (float)K + xeps);
        }
        __syncthreads();
    }
    if (SM) {
        for (int e = threadIdx.x; e < 8 * CT * M; e += blockDim.x) {
            const int m = e / (8 * CT), ol = e % (8 * CT);  // neighbouring threads: neighbouring columns
            const long long o = ob + ol;
            if (o >= N) continue;
            const int tr = m * (16 * CT) + 16 * (ol >> 3) + (ol & 7);  // the gate's tile row; up's is 8 further
            float gate = 0.f, up = 0.f;
            for (int wi = 0; wi < nw; ++wi) gate += gv_red[wi * RW + tr];
            for (int wi = 0; wi < nw; ++wi) up += gv_red[wi * RW + tr + 8];
            out[(long long)m * N + o] = gv_silu_mul(gate, up);
        }
    } else {
        for (int e = threadIdx.x; e < 16 * CT * M; e += blockDim.x) {
            const int m = e / (16 * CT), nl = e % (16 * CT);  // neighbouring threads: neighbouring columns
            const long long n = nb + nl;
            if (n >= N) continue;
            float sum = 0.f;
            for (int wi = 0; wi < nw; ++wi) sum += gv_red[wi * RW + m * (16 * CT) + nl];
            if (NX) sum *= gv_nxs[m];
            gv_store(out, part, s, M, N, m, n, sum);
        }
        if (EPI) gv_add_norm(part, gridDim.y, M, N, nb, 16 * CT, epi);
    }
#else
    __trap();  // never launched: kernels/cuda.py uses these for bf16/fp16 on sm_80+ only
#endif
}

#define GEMV_TC(GV_MT, GV_CT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32)                                              \
        gemv_tc_t##GV_MT##_c##GV_CT(const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w,  \
                                    long long wsr, scalar_t* __restrict__ out, float* __restrict__ part, int M,    \
                                    int N, int K, int kchunk, int vec_ok) {                                        \
        PDL_TRIGGER();                                                                                            \
        (void)vec_ok;                                                                                             \
        gv_tc<GV_MT, GV_CT, false, false>(x, xs, w, wsr, out, part, M, N, K, kchunk, GvEpi{}, blockIdx.x);       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_tc_t##GV_MT##_c##GV_CT##_an(              \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        float* __restrict__ part, int M, int N, int K, int kchunk, int vec_ok, const scalar_t* __restrict__ r,     \
        long long rs, const float* __restrict__ nw, scalar_t* __restrict__ y, scalar_t* __restrict__ s,           \
        int* __restrict__ cnt, float eps) {                                                                       \
        PDL_TRIGGER();                                                                                            \
        (void)vec_ok;                                                                                             \
        gv_tc<GV_MT, GV_CT, true, false>(x, xs, w, wsr, nullptr, part, M, N, K, kchunk,                          \
                                         GvEpi{r, rs, nw, y, s, cnt, eps}, blockIdx.x);                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_tc_t##GV_MT##_c##GV_CT##_sm(              \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, int vec_ok) {                                            \
        PDL_TRIGGER();                                                                                            \
        (void)vec_ok;                                                                                             \
        gv_tc<GV_MT, GV_CT, false, true>(x, xs, w, wsr, out, nullptr, M, N, K, K, GvEpi{}, blockIdx.x);          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_tc_t##GV_MT##_c##GV_CT##_ss(              \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, float* __restrict__ part, int M, int N, int K, int kchunk, int vec_ok,        \
        int* __restrict__ cnt) {                                                                                  \
        PDL_TRIGGER();                                                                                            \
        (void)vec_ok;                                                                                             \
        gv_tc<GV_MT, GV_CT, false, false>(x, xs, w, wsr, nullptr, part, M, N, K, kchunk, GvEpi{}, blockIdx.x);   \
        gv_split_silu(part, (int)gridDim.y, M, N / 2, 16 * GV_CT, out, cnt);                                     \
    }
// op gemv_norm's tensor-core form (as gemv_simt_m1_c{C}_nx: one row, no K split; the block's warps' sums of squares added in
// warp order, its sums scaled after the mmas: gv_tc's NX).
#define GEMV_TC_NX(GV_CT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_tc_t1_c##GV_CT##_nx(                     \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, float xeps) {                                           \
        PDL_TRIGGER();                                                                                            \
        gv_tc<1, GV_CT, false, false, true>(x, xs, w, wsr, out, nullptr, M, N, K, K, GvEpi{}, blockIdx.x, xeps); \
    }
#ifndef GV_DR_DK
GEMV_TC(1, 1)
GEMV_TC(2, 1)
GEMV_TC(3, 1)
GEMV_TC(1, 2)
GEMV_TC(2, 2)
GEMV_TC(3, 2)
GEMV_TC_NX(1)
GEMV_TC_NX(2)
#endif

// ---- split-K combine ----------------------------------------------------------------------------------------
// out[i] = sum over s of part[s * MN + i], in split order, rounded once. grid ceil(MN / 256), block 256.
#ifndef GV_DR_DK
extern "C" __global__ void gemv_combine(const float* __restrict__ part, scalar_t* __restrict__ out, int S, int MN) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += part[(long long)s * MN + i];
    out[i] = gv_out(sum);
}

// gemv_combine then silu_mul in one launch, for the MLP's packed gate|up product [M, 2 I] made with K splits: out
// [M, I] = silu_mul's arithmetic on each column's gate and up sums, each added in split order and rounded once as
// gemv_combine rounds them (gv_silu_mul), so the same bits as the two launches.
extern "C" __global__ void gemv_combine_sm(const float* __restrict__ part, scalar_t* __restrict__ out, int S, int M,
                                           int I) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M * I) return;
    const int m = i / I;
    const long long MN = 2LL * M * I, g0 = (long long)m * 2 * I + (i - m * I);
    float gate = 0.f, up = 0.f;
    for (int s = 0; s < S; ++s) {
        gate += part[s * MN + g0];
        up += part[s * MN + g0 + I];
    }
    out[i] = gv_silu_mul(gate, up);
}
#endif

// ---- the delta-net's in_proj product and its decode step in one launch (op gemv_conv_delta_rule_norm) ------
// gemv_{simt_m{MB}_c{C},tc_t{MT}_c{CT}}_dr{DK} (GemvDeltaArgs): the packed in_proj product [M, N] = x @ W^T (N =
// C + Hv dv + 2 Hv: the conv channels q | k | v, then z, b, a), stored in `out` exactly as the plain launch of
// that variant stores it (no K split), and the step conv_delta_rule_norm makes of it (delta_rule.cuh's gdr_impl
// with CONV, then gdr_norm_rows: the same code as gdr_dk{DK}_cabn, so the same bits), run by blocks of this launch:
//  - Tiles of `width` columns (the variant's: warps * C or 16 CT) are taken in the rule's order (gv_dr_tile):
//    first the b | a tiles, then per key head g (a "group") its q and k columns and the v columns of its r =
//    Hv / Hk value heads, and last the z columns of every head (the gate only the norm at the very end reads: the
//    rule runs while they are made). A tile lies in one group or one head's z (width divides dk and dv).
//  - A block that has stored its tile counts itself in at its group's counter (gcnt[g]; the b | a tiles at
//    gcnt[Hk]). The group's P = r * ceil(dv / 32) pieces of the rule (a value head's 32 columns each: one
//    gdr_dk*_cabn block without its norm) are run by the last P blocks to count in (the arrival order, not the
//    block index): each waits until the group's tiles and the b | a tiles are all counted, then runs its piece on
//    its first DK threads (gdr_impl's barriers are then named barriers over those threads). With fewer tiles than
//    pieces, the last block runs the rest.
//  - A value head's norm needs its ceil(dv / 32) pieces and its dv / width z tiles: each counts in at the head's
//    counter (ncnt[h]) when done, and whichever comes last norms the head's rows (no waiting).
//  - xnorm (the tensor-core forms; kernels/cuda.py gemv_conv_delta_rule_norm's x_eps): x is the residual stream and
//    W carries its norm's weight (folded), so each tile scales its sums by the norm after its mmas (gv_tc's NX).
//  - Deadlock-free whatever order the blocks are scheduled in: a block waits only after its own tile is stored,
//    at most P - 1 per group wait at once, and kernels/cuda.py launches this form only where Hk (P - 1) is below
//    the SM count (fewer than the blocks the GPU holds at once), so a block whose tile is missing always finds
//    room to run. The last piece to finish (gcnt[Hk + 1] counts them) leaves the group counters at zero, the last
//    arrival at a head's counter leaves it at zero.
// The rule and the norm read the stored columns with L1-bypassing loads (gdr_ld<true>): other blocks of this
// launch wrote them.

// What delta_rule.cuh needs, on this module's 16-bit patterns (the same roundings as decode_kernels.cu's).
__device__ __forceinline__ float to_f(float v) { return v; }
#if SCALAR_KIND != 0
__device__ __forceinline__ float to_f(scalar_t v) { return gv_f(v); }
#endif
template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ scalar_t from_f<scalar_t>(float f) { return gv_out(f); }
#if SCALAR_KIND != 0
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
#endif
template <typename T> __device__ __forceinline__ float rnd(float f) { return to_f(from_f<T>(f)); }

#include "common.cuh"
#include "delta_rule.cuh"

// The first column of tile bx in the rule's order, and what it holds: group >= 0, the q | k | v columns of key
// head `group`; -1, the b | a columns; <= -2, the z columns of value head -2 - group.
__device__ __forceinline__ long long gv_dr_tile(int bx, int width, int C, int Hk, int Hv, int dk, int dv,
                                                int& group) {
    const int r = Hv / Hk;
    const int n_ab = (2 * Hv + width - 1) / width;
    if (bx < n_ab) {
        group = -1;
        return (long long)C + (long long)Hv * dv + (long long)bx * width;
    }
    const int per = (2 * dk + r * dv) / width;
    const int b = bx - n_ab;
    if (b >= Hk * per) {  // z, head by head
        const long long zc = (long long)(b - Hk * per) * width;
        group = -2 - (int)(zc / dv);
        return (long long)C + zc;
    }
    const int g = b / per, j = (b % per) * width;
    group = g;
    if (j < dk) return (long long)g * dk + j;                              // q of key head g
    if (j < 2 * dk) return (long long)Hk * dk + (long long)g * dk + (j - dk);  // k
    return 2LL * Hk * dk + (long long)g * r * dv + (j - 2 * dk);              // v of its value heads
}

// The rule's operands (the kernel's parameters after the product's).
struct GvDr {
    scalar_t* cring;
    const scalar_t* cw;
    int C;
    const float* neg_exp_a;
    const float* dt_bias;
    float* ring;
    scalar_t* o;
    const long long* sp;
    long long sv;
    int Hk, Hv, dk, dv, n_planes;
    float qscale;
    const float* nw;
    scalar_t* y;
    int* ncnt;
    int* gcnt;
    float eps;
};

// One piece of the rule (value head h, column block cb) on the block's first NT threads, without the norm.
// (Inlined: as a call the rule takes ~240 registers, which would leave the product one block per SM.)
template <int DK, int NT>
__device__ __forceinline__ void gv_dr_piece(int cb, int h, int ncb, const scalar_t* prod, int M, int N, const GvDr& d) {
    const long long ab = (long long)d.C + (long long)d.Hv * d.dv;  // b's first column; a's is Hv further
    gdr_impl<DK, scalar_t, true, false, true, NT, true>(
        nullptr, 0, 0, nullptr, 0, 0, nullptr, 0, 0, prod + ab + d.Hv, N, prod + ab, N, d.neg_exp_a, d.dt_bias,
        d.ring, d.o, d.sp, d.sv, M, d.Hk, d.Hv, d.dk, d.dv, d.n_planes, d.qscale, GdrAt{cb, h, ncb}, GdrNorm{},
        GdrConv{prod, N, d.cring, d.cw, d.C});
}

// After the block's stores (a piece's rule output or a z tile of head h) are done: count in at the head's norm
// counter (of `of` arrivals); the last norms the head's rows on its first NT threads.
template <int DK>
__device__ __forceinline__ void gv_dr_norm_arrive(int h, int of, const scalar_t* prod, int M, int N, const GvDr& d) {
    constexpr int NT = DK >= 32 ? DK : 32;  // the threads of a gdr_dk{DK}_cabn block, which norms with as many
    __shared__ int s_last;
    __syncthreads();  // the block's stores are done
    if (threadIdx.x == 0) {
        int old;  // release: this block's stores; acquire: the other arrivals'
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(d.ncnt + h) : "memory");
        s_last = old == of - 1;
        if (s_last) d.ncnt[h] = 0;
    }
    __syncthreads();
    if (!s_last || threadIdx.x >= NT) return;
    const GdrNorm nm{prod + d.C, N, d.nw, d.y, d.ncnt, d.eps};
    const float z0 = (int)threadIdx.x < d.dv ? to_f(gdr_ld<true>(nm.z + (long long)h * d.dv + threadIdx.x)) : 0.f;
    gdr_norm_rows<NT, true>(d.o, M, d.Hv, d.dv, h, NT, nm, z0);
}

// Called by every thread once the block's tile (of `group`, gv_dr_tile) of the product is stored in prod [M, N].
template <int DK>
__device__ __forceinline__ void gv_dr_after(int group, int width, const scalar_t* prod, int M, int N, const GvDr& d) {
    constexpr int NT = DK >= 32 ? DK : 32;  // the threads of a gdr_dk{DK}_cabn block
    __shared__ int s_first;
    const int r = d.Hv / d.Hk, ncb = (d.dv + 31) / 32, P = r * ncb;
    const int n_g = (2 * d.dk + r * d.dv) / width, n_ab = (2 * d.Hv + width - 1) / width;
    const int norm_of = ncb + d.dv / width;  // a head's pieces and z tiles
    if (group <= -2) {
        gv_dr_norm_arrive<DK>(-2 - group, norm_of, prod, M, N, d);
        return;
    }
    __syncthreads();  // the block's stores of its tile are done
    if (threadIdx.x == 0) {
        int old;  // release: this block's tile; acquire: nothing yet (the wait below)
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;"
                     : "=r"(old)
                     : "l"(d.gcnt + (group < 0 ? d.Hk : group))
                     : "memory");
        const int first = group < 0 ? -1 : old - (n_g - P);  // >= 0: one of the group's last P blocks
        if (first >= 0) {
            gv_wait_count(d.gcnt + group, n_g);
            gv_wait_count(d.gcnt + d.Hk, n_ab);
        }
        s_first = first;
    }
    __syncthreads();
    const int first = s_first;
    if (first < 0) return;
    int ran = 0;
    for (int p = first; p >= 0; p -= n_g) {  // piece `first`, and with fewer tiles than pieces every n_g-th below
        const int h = group * r + p / ncb;
        if (threadIdx.x < NT) gv_dr_piece<DK, NT>(p % ncb, h, ncb, prod, M, N, d);
        gv_dr_norm_arrive<DK>(h, norm_of, prod, M, N, d);
        ++ran;
        __syncthreads();  // the piece's shared memory is free again
    }
    if (threadIdx.x == 0) {
        int old;  // the launch's last piece leaves the group counters at zero for the next launch
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;"
                     : "=r"(old)
                     : "l"(d.gcnt + d.Hk + 1), "r"(ran)
                     : "memory");
        if (old + ran == d.Hk * P)
            for (int i = 0; i <= d.Hk + 1; ++i) d.gcnt[i] = 0;
    }
}

#define GEMV_SIMT_DR(GV_MB, GV_C, DK)                                                                            \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_simt_m##GV_MB##_c##GV_C##_dr##DK(       \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, int vec_ok, scalar_t* cring, const scalar_t* cw, int C, \
        const float* neg_exp_a, const float* dt_bias, float* ring, scalar_t* o, const long long* sp,             \
        long long sv, int Hk, int Hv, int dk, int dv, int n_planes, float qscale, const float* nw, scalar_t* y,  \
        int* ncnt, int* gcnt, float eps, int xnorm, float xeps) {                                                \
        PDL_TRIGGER();                                                                                            \
        (void)xnorm; /* x normed first on CUDA cores: kernels/cuda.py */                                         \
        (void)xeps;                                                                                               \
        const int width = (blockDim.x >> 5) * GV_C;                                                              \
        int group;                                                                                               \
        const long long n0 = gv_dr_tile(blockIdx.x, width, C, Hk, Hv, dk, dv, group);                            \
        gv_simt<GV_MB, GV_C, false, false>(x, xs, w, wsr, out, nullptr, M, N, K, K, vec_ok, GvEpi{},             \
                                           (int)(n0 / width));                                                   \
        gv_dr_after<DK>(group, width, out, M, N,                                                                 \
                        GvDr{cring, cw, C, neg_exp_a, dt_bias, ring, o, sp, sv, Hk, Hv, dk, dv, n_planes, qscale, \
                             nw, y, ncnt, gcnt, eps});                                                           \
    }
#define GEMV_TC_DR(GV_MT, GV_CT, DK)                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_MAX_WARPS * 32) gemv_tc_t##GV_MT##_c##GV_CT##_dr##DK(        \
        const scalar_t* __restrict__ x, long long xs, const scalar_t* __restrict__ w, long long wsr,              \
        scalar_t* __restrict__ out, int M, int N, int K, int vec_ok, scalar_t* cring, const scalar_t* cw, int C, \
        const float* neg_exp_a, const float* dt_bias, float* ring, scalar_t* o, const long long* sp,             \
        long long sv, int Hk, int Hv, int dk, int dv, int n_planes, float qscale, const float* nw, scalar_t* y,  \
        int* ncnt, int* gcnt, float eps, int xnorm, float xeps) {                                                \
        PDL_TRIGGER();                                                                                            \
        (void)vec_ok;                                                                                             \
        const int width = 16 * GV_CT;                                                                            \
        int group;                                                                                               \
        const long long n0 = gv_dr_tile(blockIdx.x, width, C, Hk, Hv, dk, dv, group);                            \
        if (xnorm) /* x the residual stream, normed in the product (gv_tc's NX) */                               \
            gv_tc<GV_MT, GV_CT, false, false, true>(x, xs, w, wsr, out, nullptr, M, N, K, K, GvEpi{},            \
                                                    (int)(n0 / width), xeps);                                    \
        else                                                                                                      \
            gv_tc<GV_MT, GV_CT, false, false>(x, xs, w, wsr, out, nullptr, M, N, K, K, GvEpi{},                  \
                                              (int)(n0 / width));                                                \
        gv_dr_after<DK>(group, width, out, M, N,                                                                 \
                        GvDr{cring, cw, C, neg_exp_a, dt_bias, ring, o, sp, sv, Hk, Hv, dk, dv, n_planes, qscale, \
                             nw, y, ncnt, gcnt, eps});                                                           \
    }
// GV_DR_DK: the module of the _dr forms for that DK (kernels/cuda.py compiles one per DK on first use).
#if GV_DR_DK == 64
GEMV_SIMT_DR(1, 1, 64)
GEMV_SIMT_DR(1, 2, 64)
GEMV_SIMT_DR(4, 1, 64)
GEMV_SIMT_DR(4, 2, 64)
GEMV_SIMT_DR(8, 1, 64)
GEMV_SIMT_DR(8, 2, 64)
GEMV_SIMT_DR(17, 1, 64)
GEMV_SIMT_DR(17, 2, 64)
GEMV_TC_DR(1, 1, 64)
GEMV_TC_DR(2, 1, 64)
GEMV_TC_DR(3, 1, 64)
GEMV_TC_DR(1, 2, 64)
GEMV_TC_DR(2, 2, 64)
GEMV_TC_DR(3, 2, 64)
#elif GV_DR_DK == 128
GEMV_SIMT_DR(1, 1, 128)
GEMV_SIMT_DR(1, 2, 128)
GEMV_SIMT_DR(4, 1, 128)
GEMV_SIMT_DR(4, 2, 128)
GEMV_SIMT_DR(8, 1, 128)
GEMV_SIMT_DR(8, 2, 128)
GEMV_SIMT_DR(17, 1, 128)
GEMV_SIMT_DR(17, 2, 128)
GEMV_TC_DR(1, 1, 128)
GEMV_TC_DR(2, 1, 128)
GEMV_TC_DR(3, 1, 128)
GEMV_TC_DR(1, 2, 128)
GEMV_TC_DR(2, 2, 128)
GEMV_TC_DR(3, 2, 128)
#endif
