// Partial RoPE (rope_elem) and attn_prep's rows (attn_prep_impl): included by decode_kernels.cu (the attn_prep
// kernels) and by gemv_kernels.cu (the qkv product's fused form, which preps a head once its columns are stored).
// Needs, from the including file: scalar_t, to_f, from_f<scalar_t>, rnd<scalar_t>, and common.cuh.
#pragma once
#ifndef NORM_REG
#define NORM_REG 8  // elements a thread keeps in registers (decode_kernels.cu's norms: the same)
#endif

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
// attn_prep: the attention inputs of T tokens in one launch. Grid (Hq + Hkv, T), blockDim >= D / 8.
// Block (h < Hq, t): q row -> rmsnorm(q_weight) -> partial RoPE at position start + t -> q_out [T, Hq, D].
// Block (Hq + j, t): k row j -> rmsnorm(k_weight) -> RoPE -> k_cache[start + t, j]; v row j ->
// v_cache[start + t, j]. Same roundings as rope_partial(rmsnorm(x)) and kv_write.
// ------------------------------------------------------------------------------------------------
#define PREP_MAX_D 1024
// hh, t: the block's head and token (the standalone kernel: blockIdx.x, blockIdx.y); nt its threads; NT, CG:
// nt_sync and ld_cg_if (common.cuh; 0, false in the standalone kernel).
template <typename W, int NT = 0, bool CG = false>
__device__ __forceinline__ void attn_prep_impl(const scalar_t* __restrict__ q, long long qs0, long long qs1,
                                               const scalar_t* __restrict__ k, long long ks0, long long ks1,
                                               const scalar_t* __restrict__ v, long long vs0, long long vs1,
                                               const W* __restrict__ wq, const W* __restrict__ wk,
                                               const float* __restrict__ inv_freq, scalar_t* __restrict__ q_out,
                                               scalar_t* __restrict__ kc, scalar_t* __restrict__ vc,
                                               const long long* start_ptr, long long start_val, int Hq, int Hkv,
                                               int D, int half, long long max_ctx, float eps, int hh, int t,
                                               int nt) {
    __shared__ float sh[32];
    __shared__ float sy[PREP_MAX_D];
    const bool is_q = hh < Hq;
    const int j = is_q ? hh : hh - Hq;
    const scalar_t* xr = is_q ? q + t * qs0 + (long long)j * qs1 : k + t * ks0 + (long long)j * ks1;
    const W* w = is_q ? wq : wk;
    const long long start = read_start(start_ptr, start_val);
    const long long pos = start + t;
    float xv[NORM_REG], wv[NORM_REG], vv[NORM_REG];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < NORM_REG; ++u) {
        const int i = threadIdx.x + u * nt;
        xv[u] = i < D ? to_f(ld_cg_if<CG>(xr + i)) : 0.f;
        wv[u] = i < D ? to_f(w[i]) : 0.f;
        vv[u] = (!is_q && i < D) ? to_f(ld_cg_if<CG>(v + t * vs0 + (long long)j * vs1 + i)) : 0.f;
        ss += xv[u] * xv[u];
    }
    ss = nt_block_sum<NT>(ss, sh, nt);
    const float rs = rsqrtf(ss / (float)D + eps);
#pragma unroll
    for (int u = 0; u < NORM_REG; ++u) {
        const int i = threadIdx.x + u * nt;
        if (i < D) sy[i] = rnd<scalar_t>(xv[u] * rs * (1.0f + wv[u]));  // rmsnorm(x).to(dtype)
    }
    nt_sync<NT>();
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
