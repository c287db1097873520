// SpecDeck sampling kernels (compiled by CuPy/NVRTC once per device, launched on PyTorch's current stream).
//
// A module of its own (fp32 inputs only: kernels/cuda.py casts other dtypes), so the decode kernels never depend
// on it. Each kernel mirrors a function of kernels/reference.py:
//   sample_probs_rows   reference.sample_probs   (one block per row)
//   sample_token_rows   reference.sample_token   (one block per row)
//   spec_accept_k       reference.spec_accept    (one block)
//   synthetic_accept_k  reference.synthetic_accept (one thread)
// Random numbers: rng_u is reference.rng_uniform, integer for integer (same hash, same 24-bit uniforms).
// Every reduction has a fixed order (block trees, integer atomics for the top-p masses), so a kernel gives the
// same bits on every run: the same seed gives the same text.
//
// `start` convention as in decode_kernels.cu: (const long long* start_ptr, long long start_val).

// Programmatic dependent launch (kernels/pdl.py): every kernel opens with PDL_ENTER(): let the next kernel of
// the stream be scheduled, then wait until the previous kernel has completed and its writes are visible. No
// kernel touches global memory before it. Without the launch attribute (or before sm_90) both do nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define PDL_ENTER()
#endif

#define SK_THREADS 1024
#define SK_WARPS (SK_THREADS / 32)
#define SK_NEG_INF __int_as_float(0xff800000)
#define SK_M32 0xffffffffLL
// top-p masses are summed as fixed-point integers (2^40 = probability 1): exact, order-independent.
#define SK_FIX 1099511627776.0

__device__ __forceinline__ long long sk_start(const long long* p, long long v) { return p ? *p : v; }

__device__ __forceinline__ unsigned int sk_mix32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// reference.rng_uniform for one slot
__device__ __forceinline__ float rng_u(long long seed, long long pos, long long slot, int purpose) {
    unsigned int h = sk_mix32((unsigned int)(seed & SK_M32) ^ 0x9e3779b9u);
    h = sk_mix32(h ^ (unsigned int)((seed >> 32) & SK_M32));
    h = sk_mix32(h ^ (unsigned int)(pos & SK_M32));
    h = sk_mix32(h ^ (unsigned int)((slot * 8 + purpose) & SK_M32));
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

// Order-preserving map of a float to an unsigned key (larger float -> larger key).
__device__ __forceinline__ unsigned int fkey(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block reductions in a fixed order (blockDim.x == SK_THREADS); `red` is shared scratch of SK_WARPS floats.
__device__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < SK_WARPS ? red[lane] : SK_NEG_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;  // every thread
}

__device__ float block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < SK_WARPS ? red[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // every thread
}

// ------------------------------------------------------------------------------------------------
// sample_probs_rows: reference.sample_probs. One block per row; the row is read several times (L2):
// max -> [top-k: 4 radix passes] -> sum of exp -> [top-p: 4 radix passes] -> [min-p] -> sum -> write.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void sample_probs_rows(const float* __restrict__ logits, long long ls0, int n, float temperature,
                                             int top_k, float top_p, float min_p, float* __restrict__ out,
                                             long long os0) {
    PDL_ENTER();
    __shared__ float red[SK_WARPS];
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long hmass[256];
    __shared__ unsigned int sel_bin;
    __shared__ unsigned long long sel_above;
    const float* lr = logits + (long long)blockIdx.x * ls0;
    float* orow = out + (long long)blockIdx.x * os0;
    const int tid = threadIdx.x;

    // top-k: the key of the k-th largest value (radix select, 8 bits a pass, from the top)
    unsigned int kkey = 0u;  // keep x with fkey(x) >= kkey
    if (top_k > 0 && top_k < n) {
        unsigned int prefix = 0u, pmask = 0u;
        int remaining = top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += SK_THREADS) hist[b] = 0u;
            __syncthreads();
            for (int j = tid; j < n; j += SK_THREADS) {
                const unsigned int key = fkey(lr[j] / temperature);
                if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                int cum = 0;
                unsigned int chosen = 0u;
                for (int b = 255; b >= 0; --b) {
                    if (cum + (int)hist[b] >= remaining) {
                        chosen = (unsigned int)b;
                        break;
                    }
                    cum += (int)hist[b];
                }
                sel_bin = chosen;
                sel_above = (unsigned long long)cum;
            }
            __syncthreads();
            remaining -= (int)sel_above;
            prefix |= sel_bin << shift;
            pmask |= 255u << shift;
            __syncthreads();
        }
        kkey = prefix;
    }

    float m = SK_NEG_INF;
    for (int j = tid; j < n; j += SK_THREADS) {
        const float x = lr[j] / temperature;
        if (fkey(x) >= kkey) m = fmaxf(m, x);
    }
    m = block_max(m, red);
    float s = 0.f;
    for (int j = tid; j < n; j += SK_THREADS) {
        const float x = lr[j] / temperature;
        if (fkey(x) >= kkey) s += expf(x - m);
    }
    s = block_sum(s, red);

    // top-p: the key of the value whose group crosses top_p, going down (masses in fixed point)
    unsigned int pkey = kkey;  // keep x with fkey(x) >= pkey
    if (top_p < 1.0f) {
        const unsigned long long goal = (unsigned long long)((double)top_p * SK_FIX);
        unsigned int prefix = 0u, pmask = 0u;
        unsigned long long above = 0ull;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += SK_THREADS) hmass[b] = 0ull;
            __syncthreads();
            for (int j = tid; j < n; j += SK_THREADS) {
                const float x = lr[j] / temperature;
                const unsigned int key = fkey(x);
                if (key >= kkey && (key & pmask) == prefix) {
                    const float p = expf(x - m) / s;
                    atomicAdd(&hmass[(key >> shift) & 255u], (unsigned long long)((double)p * SK_FIX));
                }
            }
            __syncthreads();
            if (tid == 0) {
                unsigned long long cum = above;
                int chosen = -1, last = -1;
                unsigned long long last_above = above;
                for (int b = 255; b >= 0; --b) {
                    if (hmass[b] == 0ull) continue;
                    if (cum + hmass[b] >= goal) {
                        chosen = b;
                        break;
                    }
                    last = b;
                    last_above = cum;
                    cum += hmass[b];
                }
                if (chosen < 0) {  // rounding: the masses never reach top_p -> keep down to the smallest
                    chosen = last < 0 ? 0 : last;
                    cum = last_above;
                }
                sel_bin = (unsigned int)chosen;
                sel_above = cum;
            }
            __syncthreads();
            above = sel_above;
            prefix |= sel_bin << shift;
            pmask |= 255u << shift;
            __syncthreads();
        }
        pkey = prefix > kkey ? prefix : kkey;
    }

    // min-p relative to the most likely id (probability 1/s), then renormalise
    const float pmax = 1.0f / s;
    const float floor_p = min_p * pmax;
    float s2 = 0.f;
    for (int j = tid; j < n; j += SK_THREADS) {
        const float x = lr[j] / temperature;
        if (fkey(x) >= pkey) {
            const float p = expf(x - m) / s;
            if (!(p < floor_p)) s2 += p;
        }
    }
    s2 = block_sum(s2, red);
    for (int j = tid; j < n; j += SK_THREADS) {
        const float x = lr[j] / temperature;
        float v = 0.f;
        if (fkey(x) >= pkey) {
            const float p = expf(x - m) / s;
            if (!(p < floor_p)) v = p / s2;
        }
        orow[j] = v;
    }
}

// ------------------------------------------------------------------------------------------------
// The draw (reference._inverse_cdf): the first index whose running sum exceeds u * total, never an index of
// weight 0. Each thread owns a contiguous chunk; the chunk sums are scanned across the block (warp shuffles,
// a fixed order), then the threads whose chunk reaches the target walk it; the lowest crossing wins.
// W(j) gives the weight of index j (any functor). Returns the index on every thread.
// ------------------------------------------------------------------------------------------------
template <typename W>
__device__ int block_draw(const W& w, int n, float u, float* wsum, int* pick) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int chunk = (n + SK_THREADS - 1) / SK_THREADS;
    const int b = tid * chunk;
    const int e = n < b + chunk ? n : b + chunk;
    float part = 0.f;
    int last_nz = -1;
    for (int j = b; j < e; ++j) {
        const float v = w(j);
        part += v;
        if (v > 0.f) last_nz = j;
    }
    if (tid == 0) {
        pick[0] = 0x7fffffff;
        pick[1] = -1;
    }
    float inc = part;  // inclusive scan within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    float excl = __shfl_up_sync(0xffffffffu, inc, 1);
    if (lane == 0) excl = 0.f;
    if (lane == 31) wsum[wid] = inc;
    __syncthreads();
    if (last_nz >= 0) atomicMax(&pick[1], last_nz);
    if (wid == 0) {  // inclusive scan of the warp totals
        float ws = lane < SK_WARPS ? wsum[lane] : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float t = __shfl_up_sync(0xffffffffu, ws, o);
            if (lane >= o) ws += t;
        }
        if (lane < SK_WARPS) wsum[SK_WARPS + lane] = ws;
    }
    __syncthreads();
    const float total = wsum[2 * SK_WARPS - 1];
    const float target = u * total;
    float run = excl + (wid > 0 ? wsum[SK_WARPS + wid - 1] : 0.f);
    if (b < e && run + part > target - fabsf(target) * 1e-5f - 1e-30f) {
        for (int j = b; j < e; ++j) {
            run += w(j);
            if (run > target) {
                atomicMin(&pick[0], j);
                break;
            }
        }
    }
    __syncthreads();
    int idx = pick[0];
    const int last = pick[1] < 0 ? 0 : pick[1];
    if (idx > last) idx = last;
    __syncthreads();
    return idx;
}

struct RowW {
    const float* r;
    __device__ float operator()(int j) const { return r[j]; }
};

extern "C" __global__ void sample_token_rows(const float* __restrict__ probs, long long ps0, int n,
                                             const long long* __restrict__ seed, const long long* start_ptr,
                                             long long start_val, int slot, int purpose, long long* __restrict__ tok,
                                             float* __restrict__ prob) {
    PDL_ENTER();
    __shared__ float wsum[2 * SK_WARPS];
    __shared__ int pick[2];
    const int row = blockIdx.x;
    const float* pr = probs + (long long)row * ps0;
    const float u = rng_u(seed[0], sk_start(start_ptr, start_val), (long long)slot + row, purpose);
    const int idx = block_draw(RowW{pr}, n, u, wsum, pick);
    if (threadIdx.x == 0) {
        tok[row] = idx;
        prob[row] = pr[idx];
    }
}

// ------------------------------------------------------------------------------------------------
// spec_accept_k: reference.spec_accept (speculative_accept_rows with B = 1). One block: thread 0 runs the
// acceptance tests, the block draws the new token from max(0, p_k - q_k) (rejected) or p_k.
// ------------------------------------------------------------------------------------------------
struct ResidW {
    const float* p;
    const float* q;  // null: no draft row (take p)
    int vq;
    int use_p;  // 1: the row is p itself (all accepted, or the residual is empty)
    __device__ float operator()(int j) const {
        const float pj = p[j];
        if (use_p || q == nullptr) return pj;
        const float d = pj - (j < vq ? q[j] : 0.f);
        return d > 0.f ? d : 0.f;
    }
};

extern "C" __global__ void spec_accept_k(const long long* __restrict__ drafts, const float* __restrict__ draft_probs,
                                         const float* __restrict__ q_rows, long long qs0, int vq,
                                         const float* __restrict__ p_rows, long long ps0, int vocab, int n,
                                         double p_min, const long long* __restrict__ seed, const long long* start_ptr,
                                         long long start_val, long long* __restrict__ cache_len,
                                         long long* __restrict__ out) {
    PDL_ENTER();
    __shared__ float wsum[2 * SK_WARPS];
    __shared__ int pick[2];
    __shared__ int sh_k, sh_nv;
    __shared__ float red[SK_WARPS];
    const long long sd = seed[0];
    const long long pos = sk_start(start_ptr, start_val);
    if (threadIdx.x == 0) {
        int nv = 0;
        while (nv < n && (double)draft_probs[nv] >= p_min) ++nv;
        int k = 0;
        while (k < nv) {
            const long long x = drafts[k];
            const float px = p_rows[(long long)k * ps0 + x];
            const float qx = x < vq ? q_rows[(long long)k * qs0 + x] : 0.f;
            if (!(rng_u(sd, pos, k, 2) * qx < px)) break;
            ++k;
        }
        sh_k = k;
        sh_nv = nv;
    }
    __syncthreads();
    const int k = sh_k, nv = sh_nv;
    const float* pk = p_rows + (long long)k * ps0;
    const float* qk = (k < nv && n > 0) ? q_rows + (long long)k * qs0 : nullptr;
    int use_p = qk == nullptr ? 1 : 0;
    if (!use_p) {  // an empty residual (p == q on the row, by rounding): draw from p
        float part = 0.f;
        ResidW rw{pk, qk, vq, 0};
        for (int j = threadIdx.x; j < vocab; j += SK_THREADS) part += rw(j);
        if (!(block_sum(part, red) > 0.f)) use_p = 1;
    }
    const float u = rng_u(sd, pos, k, 3);
    const int idx = block_draw(ResidW{pk, qk, vq, use_p}, vocab, u, wsum, pick);
    if (threadIdx.x == 0) {
        out[0] = k + 1;
        out[1] = nv;
        for (int i = 0; i < k; ++i) out[2 + i] = drafts[i];
        out[2 + k] = idx;
        cache_len[0] += k + 1;
    }
}

// ------------------------------------------------------------------------------------------------
// synthetic_accept_k: reference.synthetic_accept (a measurement mode). Modelled on greedy_accept: one thread
// finds n_valid (p_min in double, as the reference's draft_probs.double() >= p_min), then the accepted prefix
// from the draws u(seed, start, slot i, purpose 4 = RNG_SYNTH) < rates[min(i, m-1)], and writes the layout
// greedy_accept writes; out[2 + k .. 2 + n] all hold the target's token k, as in the reference.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void synthetic_accept_k(const long long* __restrict__ drafts, const float* __restrict__ draft_probs,
                                              const long long* __restrict__ target, double p_min,
                                              const float* __restrict__ rates, int m, int n,
                                              const long long* __restrict__ seed, const long long* start_ptr,
                                              long long start_val, long long* __restrict__ cache_len,
                                              long long* __restrict__ out) {
    PDL_ENTER();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const long long sd = seed[0];
    const long long pos = sk_start(start_ptr, start_val);
    int nv = 0;
    while (nv < n && (double)draft_probs[nv] >= p_min) ++nv;
    int k = 0;
    while (k < nv && rng_u(sd, pos, k, 4) < rates[k < m ? k : m - 1]) ++k;
    const long long bonus = target[k];
    out[0] = k + 1;
    out[1] = nv;
    for (int i = 0; i <= n; ++i) out[2 + i] = i < k ? drafts[i] : bonus;
    cache_len[0] += k + 1;
}
