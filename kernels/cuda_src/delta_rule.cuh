// The recurrent gated delta rule of decode and verify (gdr_impl) and the conv step it shares with conv_update:
// included by decode_kernels.cu (the gdr_dk* kernels, conv_update) and by gemv_kernels.cu (the in_proj product's
// fused form, which runs gdr_impl in some of its blocks once the columns they read are stored). Needs, from the
// including file: scalar_t, to_f(scalar_t), to_f(float), from_f<scalar_t>(float), rnd<scalar_t>(float), and
// common.cuh.
#pragma once

// One token of one channel: silu(conv) of the window and the new raw input xv, rounded to scalar_t, and the
// window moved on by xv. conv_update and the delta-net step's fused form (gdr_*_cabn) share it, so their bits
// are the same.
template <int K>
__device__ __forceinline__ scalar_t conv_step(float (&win)[K - 1], const float (&wt)[K], float xv) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < K - 1; ++i) acc += win[i] * wt[i];
    acc += xv * wt[K - 1];
#pragma unroll
    for (int i = 0; i < K - 2; ++i) win[i] = win[i + 1];
    win[K - 2] = xv;
    return from_f<scalar_t>(silu_f(acc));
}

// The barriers of gdr_impl: NT = 0, the whole block (__syncthreads); NT > 0, named barrier 1 over the block's
// first NT threads (the fused form: the block may have more threads than the rule uses, and they have left).
template <int NT>
__device__ __forceinline__ void gdr_sync() {
    if constexpr (NT == 0)
        __syncthreads();
    else
        asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
}

// block_sum's arithmetic over the rule's threads (nt of them; NT as above): every thread gets the sum.
template <int NT>
__device__ __forceinline__ float gdr_block_sum(float v, float* sh, int nt) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = nt >> 5;
    gdr_sync<NT>();  // sh may still be read by a previous call
    if (lane == 0) sh[w] = v;
    gdr_sync<NT>();
    float r = lane < nw ? sh[lane] : 0.f;
    return warp_sum(r);
}

// A load of the projection's columns: CG (the fused form, where other blocks of the same launch stored them)
// bypasses L1; else a plain load (an earlier launch wrote them).
template <bool CG>
__device__ __forceinline__ scalar_t gdr_ld(const scalar_t* p) {
    if constexpr (CG)
        return __ldcg(p);
    else
        return *p;
}

// Which part of the rule a block runs: value columns [32 cb, 32 cb + 32) of value head h, of ncb such column
// blocks per head (the standalone kernels: blockIdx.x, blockIdx.y, gridDim.x).
struct GdrAt {
    int cb, h, ncb;
};

// ------------------------------------------------------------------------------------------------
// gated_delta_rule (recurrent form). Grid (ceil(dv / 32), Hv); block 32 x NS threads: lane = value
// column within the block's 32, warp = slice of ROWS = DK / NS rows of the dk x dv state. Each thread
// keeps its ROWS state entries in registers for all T tokens; u = S^T k and o = S^T q are summed over
// the slices through shared memory. q and k of a chunk of tokens are l2-normalised into shared memory.
// DK is dk rounded up to a power of two (16 .. 128); rows >= dk are zero and never stored.
// RAW (the gdr_dk*_ab kernels, op gated_delta_rule_ab): g and beta are the raw projections a and b (scalar_t)
// and each token's gates are worked out here with gdn_gates' arithmetic (beta rounded to scalar_t as that
// kernel stores it), so the result equals gdn_gates -> gdr_dk*_bs bit for bit, in one launch instead of two.
// ------------------------------------------------------------------------------------------------
#define GDR_TC 16

// The delta-net gates of one (token, head) from the raw projection columns a, b: g = neg_exp_A * softplus(a +
// dt_bias) in fp32 (softplus threshold 20 as in torch), beta = sigmoid(b) rounded to b's dtype. gdn_gates stores
// them; the rule's RAW kernels use them directly.
__device__ __forceinline__ float gdn_log_decay(float a, float dt_bias, float neg_exp_a) {
    const float x = a + dt_bias;
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    return neg_exp_a * sp;
}
__device__ __forceinline__ scalar_t gdn_beta(float b) { return from_f<scalar_t>(1.0f / (1.0f + expf(-b))); }

// NORM (the gdr_dk*_abn kernels, op gated_delta_rule_ab_norm): the delta-net's output norm after the rule, in
// the same launch. Each block counts itself in at its head's counter once its columns of every token are
// stored; the head's last block (which leaves the counter at zero) norms the head's rows as gated_rmsnorm does
// with an fp32 weight and a gate of the activation dtype: y = (w * rmsnorm(out).to(dtype)) * silu(z), the sum
// of squares over the block in a fixed order whatever T is.
struct GdrNorm {
    const scalar_t* z;  // the gate rows [T, Hv, dv] at row stride zs0 (heads and columns contiguous)
    long long zs0;
    const float* w;     // [dv]
    scalar_t* y;        // [T, Hv, dv]
    int* cnt;           // [Hv], zero between launches
    float eps;
};

// CONV (the gdr_dk*_cabn kernels, op conv_delta_rule_norm): the delta-net's causal conv + SiLU in the same
// launch, before the rule. q, k and v are not given: the block works out the conv of the channels it reads from
// the projection's raw columns x [T, C] (row stride xs0; channels q = kh * dk + d, k = Hk * dk + kh * dk + d,
// v = 2 Hk dk + h * dv + col), with conv_update's arithmetic (conv_step), into shared memory. The conv ring
// [n_planes, C, GDR_CONV_K - 1] is read at plane start and written at planes start + 1 .. start + T (T <
// n_planes): the q and k channels of a key head by one block (column block 0 of the head's first value head),
// the v channels by the block that owns those columns. The weight cw [C, GDR_CONV_K] has the activation dtype.
#define GDR_CONV_K 4
struct GdrConv {
    const scalar_t* x;
    long long xs0;
    scalar_t* ring;
    const scalar_t* w;
    int C;
};

// The norm of head h's rows of `out` (every token), on the first nt threads (NT: gdr_sync's), gated_rmsnorm's
// arithmetic with an fp32 weight: y = (w * rmsnorm(out).to(dtype)) * silu(z), the sum of squares over the threads
// in a fixed order whatever T is. z0: this thread's gate value of token 0 (column threadIdx.x), loaded earlier.
template <int NT, bool CG>
__device__ __forceinline__ void gdr_norm_rows(const scalar_t* out, int T, int Hv, int dv, int h, int nt,
                                              const GdrNorm& nm, float z0) {
    __shared__ float sh[32];
    for (int t = 0; t < T; ++t) {
        const scalar_t* orow = out + ((long long)t * Hv + h) * dv;
        float ss = 0.f;
        for (int c = threadIdx.x; c < dv; c += nt) {
            const float o = to_f(__ldcg(orow + c));
            ss += o * o;
        }
        const float rs = rsqrtf(gdr_block_sum<NT>(ss, sh, nt) / (float)dv + nm.eps);
        const scalar_t* zr = nm.z + t * nm.zs0 + (long long)h * dv;
        scalar_t* yr = nm.y + ((long long)t * Hv + h) * dv;
        for (int c = threadIdx.x; c < dv; c += nt) {
            const float n = rnd<scalar_t>(to_f(__ldcg(orow + c)) * rs);  // rmsnorm(out).to(dtype)
            const float zv = t == 0 && c == (int)threadIdx.x ? z0 : to_f(gdr_ld<CG>(zr + c));
            yr[c] = from_f<scalar_t>(nm.w[c] * n * silu_f(zv));  // fp32 weight: no rounding between
        }
    }
}

// NORM's tail: the block counts itself in at its head's counter once its columns of every token are stored; the
// head's last block (of ncb; it leaves the counter at zero) norms the head's rows.
template <int NT, bool CG>
__device__ __forceinline__ void gdr_norm_tail(const scalar_t* out, int T, int Hv, int dv, int h, int ncb, int nt,
                                              const GdrNorm& nm, float z0) {
    __shared__ int last;
    gdr_sync<NT>();  // the block's columns of every token are stored
    if (threadIdx.x == 0) {
        int old;  // release: this block's stores; acquire: the head's other blocks'
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(nm.cnt + h) : "memory");
        last = old == ncb - 1;
        if (last) nm.cnt[h] = 0;
    }
    gdr_sync<NT>();
    if (last) gdr_norm_rows<NT, CG>(out, T, Hv, dv, h, nt, nm, z0);
}

// NT, CG: gdr_sync and gdr_ld above (0, false in the standalone kernels); `at`: which block of the rule this is.
template <int DK, typename BT, bool RAW, bool NORM, bool CONV = false, int NT = 0, bool CG = false>
__device__ __forceinline__ void gdr_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                         const scalar_t* __restrict__ k, long long ks0, long long ks1,
                                         const scalar_t* __restrict__ v, long long vs0, long long vs1,
                                         const void* __restrict__ g, long long gs0, const void* __restrict__ beta,
                                         long long bs0, const float* __restrict__ neg_exp_a,
                                         const float* __restrict__ dt_bias, float* __restrict__ ring,
                                         scalar_t* __restrict__ out, const long long* start_ptr, long long start_val,
                                         int T, int Hk, int Hv, int dk, int dv, int n_planes, float qscale,
                                         const GdrAt& at, const GdrNorm& nm, const GdrConv& cv = GdrConv{}) {
    constexpr int NS = DK >= 32 ? DK / 32 : 1;
    constexpr int ROWS = DK / NS;
    constexpr int EPL = (DK + 31) / 32;
    __shared__ float s_q[GDR_TC][DK];
    __shared__ float s_k[GDR_TC][DK];
    __shared__ float s_u[2][NS][32];
    __shared__ float s_o[2][NS][32];

    const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
    const int h = at.h;
    const int col = at.cb * 32 + lane;
    const bool active = col < dv;
    const int kh = h / (Hv / Hk);
    // What does not depend on `start` is loaded before it is read (decode is a chain of dependent loads: issuing
    // these first takes two memory round trips off it): token 0's raw conv inputs, gate columns and norm gate,
    // the head's gate constants, the conv weights (below). Later tokens load theirs where they are used.
    constexpr int CK = GDR_CONV_K;
    const int tid = threadIdx.x;
    const bool own_qk = CONV && tid < dk, own_v = CONV && slice == 0 && active;
    const int cq = kh * dk + tid, ck = Hk * dk + kh * dk + tid, cvc = 2 * Hk * dk + h * dv + col;
    float x0q = 0.f, x0k = 0.f, x0v = 0.f, tq[CK], tk[CK], tv[CK];
    if (CONV && T > 0) {
        if (own_qk) x0q = to_f(gdr_ld<CG>(cv.x + cq));
        if (own_qk) x0k = to_f(gdr_ld<CG>(cv.x + ck));
        if (own_v) x0v = to_f(gdr_ld<CG>(cv.x + cvc));
#pragma unroll
        for (int i = 0; i < CK; ++i) {
            tq[i] = own_qk ? to_f(cv.w[(long long)cq * CK + i]) : 0.f;
            tk[i] = own_qk ? to_f(cv.w[(long long)ck * CK + i]) : 0.f;
            tv[i] = own_v ? to_f(cv.w[(long long)cvc * CK + i]) : 0.f;
        }
    }
    float a0 = 0.f, b0 = 0.f, nea = 0.f, dtb = 0.f, z0 = 0.f;
    if (RAW && T > 0) {
        a0 = to_f(gdr_ld<CG>(static_cast<const scalar_t*>(g) + h));
        b0 = to_f(gdr_ld<CG>(static_cast<const scalar_t*>(beta) + h));
        nea = neg_exp_a[h];
        dtb = dt_bias[h];
    }
    if (NORM && T > 0 && tid < dv) z0 = to_f(gdr_ld<CG>(nm.z + (long long)h * dv + tid));
    const long long start = read_start(start_ptr, start_val);
    const long long plane = (long long)Hv * dk * dv;
    const long long head_off = (long long)h * dk * dv;
    const int r0 = slice * ROWS;

    float S[ROWS];
    {
        const float* sin_ = ring + pmod(start, n_planes) * plane + head_off;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int r = r0 + i;
            S[i] = (active && r < dk) ? sin_[(long long)r * dv + col] : 0.f;
        }
    }
    // CONV: thread tid < dk owns q channel tid and k channel tid of key head kh; lanes of slice 0 own the v
    // channel of their column. Their windows and weights stay in registers over every token.
    __shared__ float s_v[CONV ? GDR_TC : 1][32];
    const bool write_qk = own_qk && at.cb == 0 && h % (Hv / Hk) == 0;
    const long long cplane = (long long)cv.C * (CK - 1);
    float wq[CK - 1], wk[CK - 1], wvv[CK - 1];
    if (CONV) {
        const scalar_t* rp = cv.ring + pmod(start, n_planes) * cplane;
#pragma unroll
        for (int i = 0; i < CK - 1; ++i) {
            wq[i] = own_qk ? to_f(rp[(long long)cq * (CK - 1) + i]) : 0.f;
            wk[i] = own_qk ? to_f(rp[(long long)ck * (CK - 1) + i]) : 0.f;
            wvv[i] = own_v ? to_f(rp[(long long)cvc * (CK - 1) + i]) : 0.f;
        }
    }

    for (int t0 = 0; t0 < T; t0 += GDR_TC) {
        const int tc = T - t0 < GDR_TC ? T - t0 : GDR_TC;
        gdr_sync<NT>();  // the previous chunk's q/k are no longer read
        if (CONV) {  // the chunk's conv outputs (rounded as conv_update stores them) into s_q, s_k, s_v
            for (int tt = 0; tt < tc; ++tt) {
                const long long xrow = (long long)(t0 + tt) * cv.xs0;
                scalar_t* wp = cv.ring + pmod(start + t0 + tt + 1, n_planes) * cplane;
                if (own_qk) {
                    const bool first = t0 + tt == 0;
                    s_q[tt][tid] = to_f(conv_step<CK>(wq, tq, first ? x0q : to_f(gdr_ld<CG>(cv.x + xrow + cq))));
                    s_k[tt][tid] = to_f(conv_step<CK>(wk, tk, first ? x0k : to_f(gdr_ld<CG>(cv.x + xrow + ck))));
                    if (write_qk) {
#pragma unroll
                        for (int i = 0; i < CK - 1; ++i) {
                            wp[(long long)cq * (CK - 1) + i] = from_f<scalar_t>(wq[i]);
                            wp[(long long)ck * (CK - 1) + i] = from_f<scalar_t>(wk[i]);
                        }
                    }
                }
                if (own_v) {
                    const float xv = t0 + tt == 0 ? x0v : to_f(gdr_ld<CG>(cv.x + xrow + cvc));
                    s_v[tt][lane] = to_f(conv_step<CK>(wvv, tv, xv));
#pragma unroll
                    for (int i = 0; i < CK - 1; ++i) wp[(long long)cvc * (CK - 1) + i] = from_f<scalar_t>(wvv[i]);
                }
            }
            gdr_sync<NT>();
        }
        for (int tt = slice; tt < tc; tt += NS) {
            const int t = t0 + tt;
            const scalar_t* qr = q + t * qs0 + kh * qs1;
            const scalar_t* kr = k + t * ks0 + kh * ks1;
            float qa[EPL], ka[EPL];
            float sq = 0.f, sk = 0.f;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const int d = i * 32 + lane;
                if (CONV) {
                    qa[i] = d < dk ? s_q[tt][d] : 0.f;
                    ka[i] = d < dk ? s_k[tt][d] : 0.f;
                } else {
                    qa[i] = d < dk ? to_f(qr[d]) : 0.f;
                    ka[i] = d < dk ? to_f(kr[d]) : 0.f;
                }
                sq += qa[i] * qa[i];
                sk += ka[i] * ka[i];
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const float rq = rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);  // l2norm, eps 1e-6
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const int d = i * 32 + lane;
                if (d < DK) {
                    s_q[tt][d] = (qa[i] * rq) * qscale;  // l2norm(q) * dk^-0.5
                    s_k[tt][d] = ka[i] * rk;
                }
            }
        }
        gdr_sync<NT>();
        for (int tt = 0; tt < tc; ++tt) {
            const int t = t0 + tt;
            const int buf = t & 1;
            float eg, bt;
            if (RAW) {
                const float at_ = t == 0 ? a0 : to_f(gdr_ld<CG>(static_cast<const scalar_t*>(g) + t * gs0 + h));
                const float bt_ = t == 0 ? b0 : to_f(gdr_ld<CG>(static_cast<const scalar_t*>(beta) + t * bs0 + h));
                eg = expf(gdn_log_decay(at_, dtb, nea));
                bt = to_f(gdn_beta(bt_));
            } else {
                eg = expf(static_cast<const float*>(g)[t * gs0 + h]);
                bt = to_f(static_cast<const BT*>(beta)[t * bs0 + h]);
            }
            const float vv = !active ? 0.f : CONV ? s_v[tt][lane] : to_f(v[t * vs0 + h * vs1 + col]);
            float u = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                S[i] *= eg;                       // S = exp(g) * S
                u += S[i] * s_k[tt][r0 + i];      // u = S^T k
            }
            if (NS > 1) {
                s_u[buf][slice][lane] = u;
                gdr_sync<NT>();
                u = 0.f;
#pragma unroll
                for (int z = 0; z < NS; ++z) u += s_u[buf][z][lane];
            }
            const float delta = bt * (vv - u);
            float o = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                S[i] += s_k[tt][r0 + i] * delta;  // S += k (beta (v - u))^T
                o += S[i] * s_q[tt][r0 + i];      // o = S^T q
            }
            if (NS > 1) {
                s_o[buf][slice][lane] = o;
                gdr_sync<NT>();
                o = 0.f;
#pragma unroll
                for (int z = 0; z < NS; ++z) o += s_o[buf][z][lane];
            }
            if (active) {
                if (slice == 0) out[((long long)t * Hv + h) * dv + col] = from_f<scalar_t>(o);
                float* sout = ring + pmod(start + t + 1, n_planes) * plane + head_off;
#pragma unroll
                for (int i = 0; i < ROWS; ++i) {
                    const int r = r0 + i;
                    if (r < dk) sout[(long long)r * dv + col] = S[i];
                }
            }
        }
    }
    if (NORM) gdr_norm_tail<NT, CG>(out, T, Hv, dv, h, at.ncb, NS * 32, nm, z0);
}
