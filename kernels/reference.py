"""PyTorch references for every custom op on the decode path.

Each function here is the ground truth for the CUDA kernel of the same name in `kernels/cuda.py`;
both take and return the same things. They are plain functions on tensors: no model knowledge, no
state of their own (state lives in buffers the caller passes in).

Conventions
- Token-major layouts: activations are [T, ...] for a batch of T tokens of one sequence.
- Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32.
- Recurrent state lives in a *ring* of snapshot planes indexed by position: plane (p % n_planes) holds
  the state after the first p tokens. A batch of T tokens starting at `start` reads plane start and
  writes planes start+1 .. start+T; every other plane keeps what it holds (see engine/state.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Start = int | torch.Tensor  # a host int, or a 1-element int64 device tensor (what a captured graph reads)


def _host(start: Start) -> int:
    return int(start) if isinstance(start, int) else int(start.reshape(-1)[0].item())


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim, in fp32, cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def unit_rmsnorm(x: torch.Tensor, eps: float, norm=None) -> torch.Tensor:
    """rmsnorm(x) with no weight (the zero-centred norm's weight zero) through `norm` (rmsnorm's signature; None: the
    reference): a norm whose weight is folded into the product that reads it (Model.fold_norms), made first."""
    return (norm or rmsnorm)(x, torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device), eps)


def embed_rmsnorm(
    ids: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's first step: s = embed[ids] (the residual stream) and its rmsnorm; returns (rmsnorm(s), s),
    like add_rmsnorm. ids [T] int64, embed [V, H]."""
    s = F.embedding(ids, embed)
    return rmsnorm(s, weight, eps), s


def store_rows(dst: torch.Tensor, rows: torch.Tensor, start: Start) -> None:
    """dst[start + r] = rows[r] for r < T (rows [T, H] into dst [N, H], in place; start + T <= N). A device
    start is read on the device (no host sync: capturable)."""
    t = rows.shape[0]
    if isinstance(start, torch.Tensor) and start.device == dst.device:
        at = start.reshape(-1)[:1] + torch.arange(t, device=dst.device)
        dst.index_copy_(0, at, rows)
    else:
        b = _host(start)
        dst[b : b + t] = rows


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with zero-centred RMSNorm: s = x + residual; returns (rmsnorm(s), s)."""
    s = x + residual
    return rmsnorm(s, weight, eps), s


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta-net output norm: rmsnorm with a PLAIN weight (no +1), times silu(gate). x, gate [..., d]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rope_partial(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE on the first 2*len(inv_freq) dims of each head (rotate_half pairs i, i + rot/2).

    x [T, heads, head_dim]; positions [T] (int); returns a new tensor.
    """
    rot = inv_freq.numel() * 2
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Write T new keys/values at positions start .. start+T-1 of the static cache [max_ctx, Hkv, D]."""
    t = k.shape[0]
    k_cache[start : start + t] = k
    v_cache[start : start + t] = v


QUERY_BLOCK = 64  # attention_cached: query rows whose scores are held at once


def attention_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: Start,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of T queries (positions start..start+T-1) over the static KV cache.

    The T new keys must already be in the cache. q [T, Hq, D], caches [max_ctx, Hkv, D] -> [T, Hq, D].
    With `gate` ([T, Hq, D], any strides) the output is gated: out * sigmoid(gate), in q's dtype.
    """
    start = _host(start)
    t, hq, d = q.shape
    total = start + t
    hkv = k_cache.shape[1]
    k = k_cache[:total].transpose(0, 1)  # [Hkv, total, D]
    v = v_cache[:total].transpose(0, 1)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=0)
        v = v.repeat_interleave(hq // hkv, dim=0)
    kf, vf = k.float(), v.float()
    k_pos = torch.arange(total, device=q.device)[None, :]
    qf = q.transpose(0, 1).float()  # [Hq, T, D]
    out = torch.empty((hq, t, d), dtype=torch.float32, device=q.device)
    # Query rows in blocks: each row's softmax is the same as over all rows at once, and the scores held
    # at a time are [Hq, block, total], not [Hq, T, total] (a long prompt would need T x total).
    for r0 in range(0, t, QUERY_BLOCK):
        r1 = min(t, r0 + QUERY_BLOCK)
        scores = torch.matmul(qf[:, r0:r1], kf.transpose(1, 2)) * scale  # [Hq, rows, total]
        q_pos = torch.arange(start + r0, start + r1, device=q.device)[:, None]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[:, r0:r1] = torch.matmul(torch.softmax(scores, dim=-1), vf)
        del scores
    out = out.transpose(0, 1).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)


def attn_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    """Attention inputs of T tokens at positions start..: q and k zero-centred-RMS-normed per head and
    partially RoPE'd; k and v written to the caches (kv_write). q [T, Hq, D], k, v [T, Hkv, D] (any row and
    head strides). Returns the prepared q [T, Hq, D]."""
    t = q.shape[0]
    s = _host(start)
    positions = torch.arange(s, s + t, device=q.device)
    q = rope_partial(rmsnorm(q, q_weight, eps), positions, inv_freq)
    k = rope_partial(rmsnorm(k, k_weight, eps), positions, inv_freq)
    kv_write(k_cache, v_cache, k, v, s)
    return q


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """The MLP's activation on a packed gate|up row: silu(x[..., :I]) * x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, neg_exp_a: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-net gates of T tokens: g = -exp(A_log) * softplus(a + dt_bias) (fp32 log-decay) and
    beta = sigmoid(b) (b's dtype). a, b [T, Hv]; neg_exp_a = -exp(A_log) (fp32), dt_bias [Hv]."""
    return neg_exp_a * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def conv_update(x: torch.Tensor, conv_ring: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Causal depthwise conv + SiLU over T new raw inputs, with the window kept in a ring of planes.

    x [T, C] raw (pre-conv) values; conv_ring [n_planes, C, K-1]: plane p % n holds the raw inputs of
    tokens p-K+1 .. p-1 (the window before token p). weight [C, K]. Reads plane `start`, writes planes
    start+1 .. start+T (each the window after that many tokens). Returns silu(conv) [T, C].
    """
    start = _host(start)
    t, c = x.shape
    n = conv_ring.shape[0]
    k = weight.shape[1]
    window = conv_ring[start % n]  # [C, K-1]
    ext = torch.cat((window, x.transpose(0, 1).to(window.dtype)), dim=1)  # [C, K-1+T]
    out = F.conv1d(ext[None].float(), weight.float()[:, None, :], groups=c)[0]  # [C, T]
    for j in range(max(1, t - n + 1), t + 1):
        conv_ring[(start + j) % n] = ext[:, j : j + k - 1]
    return F.silu(out).transpose(0, 1).to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    """Recurrent gated delta rule over T tokens, one snapshot plane written per token.

    q, k [T, Hk, dk] (raw: l2-normalised here, q also scaled by dk^-0.5); v [T, Hv, dv];
    g [T, Hv] log-decay (fp32); beta [T, Hv]; state_ring [n_planes, Hv, dk, dv] fp32.
    Value head h reads key head h // (Hv / Hk). Per token: S = exp(g)*S; u = S^T k;
    S += k (beta (v - u))^T; o = S^T q. Reads plane start % n, writes planes (start + j) % n for
    j = 1..T (T must be < n_planes). Returns o [T, Hv, dv] in v's dtype.
    """
    start = _host(start)
    t, hk, dk = q.shape
    hv = v.shape[1]
    n = state_ring.shape[0]
    if t >= n:
        raise ValueError(f"a recurrent batch of {t} tokens needs more than {n} snapshot planes")
    rep = hv // hk
    qf = _l2norm(q.float()).repeat_interleave(rep, dim=1) * dk**-0.5
    kf = _l2norm(k.float()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    s = state_ring[start % n].clone()
    out = torch.empty(t, hv, v.shape[2], dtype=torch.float32, device=v.device)
    for i in range(t):
        s = s * gf[i].exp()[:, None, None]
        u = torch.einsum("hkv,hk->hv", s, kf[i])
        s = s + kf[i][:, :, None] * (bf[i][:, None] * (vf[i] - u))[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", s, qf[i])
        state_ring[(start + i + 1) % n] = s
    return out.to(v.dtype)


def gated_delta_rule_ab(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
) -> torch.Tensor:
    """The recurrent gated delta rule with its gates given raw: gated_delta_rule(q, k, v, *gdn_gates(a, b,
    neg_exp_a, dt_bias), state_ring, start). a, b [T, Hv] (the delta-net projection's columns); the decode
    path's form, one kernel on a GPU where the two ops were two."""
    g, beta = gdn_gates(a, b, neg_exp_a, dt_bias)
    return gated_delta_rule(q, k, v, g, beta, state_ring, start)


def gated_delta_rule_ab_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The delta-net's recurrent rule and its output norm: gated_rmsnorm(gated_delta_rule_ab(q, k, v, a, b,
    neg_exp_a, dt_bias, state_ring, start), z, weight, eps). z [T, Hv, dv] (the projection's gate columns);
    the decode path's form, one launch on a GPU where the two ops were two."""
    o = gated_delta_rule_ab(q, k, v, a, b, neg_exp_a, dt_bias, state_ring, start)
    return gated_rmsnorm(o, z, weight, eps)


def conv_delta_rule_norm(
    x: torch.Tensor,
    conv_ring: torch.Tensor,
    conv_weight: torch.Tensor,
    key_heads: int,
    a: torch.Tensor,
    b: torch.Tensor,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The delta-net's recurrent step after its projection: conv_update of the raw q|k|v columns x [T, C], split
    into q, k [T, key_heads, dk] and v [T, Hv, dv] (Hv, dv from z [T, Hv, dv]; C = 2 key_heads dk + Hv dv), then
    gated_delta_rule_ab_norm. The decode path's form, one launch on a GPU where the ops were two."""
    q, k, v = split_conv_heads(conv_update(x, conv_ring, conv_weight, start), key_heads, z)
    return gated_delta_rule_ab_norm(q, k, v, a, b, neg_exp_a, dt_bias, state_ring, start, z, weight, eps)


def conv_key_dim(channels: int, key_heads: int, z: torch.Tensor) -> int:
    """dk of a delta-net's conv channels q | k | v (key_heads x dk each for q and k, then z's Hv x dv for v);
    ValueError when the channels are not of that form."""
    hv, dv = z.shape[1], z.shape[2]
    dk = (channels - hv * dv) // (2 * key_heads) if key_heads > 0 else 0
    if dk <= 0 or 2 * key_heads * dk + hv * dv != channels:
        raise ValueError(f"{channels} conv channels are not q|k of {key_heads} heads and v of {hv} x {dv}")
    return dk


def split_conv_heads(
    qkv: torch.Tensor, key_heads: int, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, key_heads, dk] and v [T, Hv, dv] (Hv, dv from z [T, Hv, dv]): views of the conv's rows [T, C]."""
    t, c = qkv.shape
    dk = conv_key_dim(c, key_heads, z)
    hv, dv = z.shape[1], z.shape[2]
    q, k, v = torch.split(qkv, [key_heads * dk, key_heads * dk, hv * dv], dim=-1)
    return q.reshape(t, key_heads, dk), k.reshape(t, key_heads, dk), v.reshape(t, hv, dv)


def split_in_proj(
    prod: torch.Tensor, conv_channels: int, value_heads: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta-net's packed in_proj product [T, C + Hv dv + 2 Hv] as views: the raw conv columns qkv [T, C],
    the gate z [T, Hv, dv], then b and a [T, Hv] (the order Model._pack concatenates the projections in)."""
    t = prod.shape[0]
    qkv, z, b, a = prod.split([conv_channels, value_heads * dv, value_heads, value_heads], dim=-1)
    return qkv, z.reshape(t, value_heads, dv), b, a


def in_proj_step(
    prod: torch.Tensor,
    conv_ring: torch.Tensor,
    conv_weight: torch.Tensor,
    key_heads: int,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    weight: torch.Tensor,
    eps: float,
    step=None,
) -> torch.Tensor:
    """The decode step after the in_proj product `prod`: split_in_proj, then `step` (conv_delta_rule_norm's
    signature; None: the reference) on the views. Hv is neg_exp_a's size, dv the state planes' last dim."""
    hv, dv = neg_exp_a.numel(), state_ring.shape[-1]
    qkv, z, b, a = split_in_proj(prod, conv_weight.shape[0], hv, dv)
    return (step or conv_delta_rule_norm)(
        qkv, conv_ring, conv_weight, key_heads, a, b, neg_exp_a, dt_bias, state_ring, start, z, weight, eps
    )


def gemv_conv_delta_rule_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    conv_ring: torch.Tensor,
    conv_weight: torch.Tensor,
    key_heads: int,
    neg_exp_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ring: torch.Tensor,
    start: Start,
    weight: torch.Tensor,
    eps: float,
    variant: str | None = None,
    x_eps: float | None = None,
) -> torch.Tensor:
    """The delta-net's decode step from its input rows x [T, K]: the packed in_proj product x @ w^T (gemv), then
    conv_delta_rule_norm of its columns (in_proj_step): y [T, Hv, dv]. One launch on a GPU where a gemv kernel
    makes the product; `variant` names that kernel's launch and means nothing here. x_eps given (the deferred norm):
    x is the residual stream before the layer's input norm, whose weight is folded into w (Model.fold_norms), so the
    product's input is rmsnorm(x) with no weight."""
    if x_eps is not None:
        x = unit_rmsnorm(x, x_eps)
    return in_proj_step(
        gemv(x, w), conv_ring, conv_weight, key_heads, neg_exp_a, dt_bias, state_ring, start, weight, eps
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_ring: torch.Tensor,
    start: int,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The same rule for a long batch (prefill), in the chunked (GEMM) form; writes only plane start+T.

    Same inputs as `gated_delta_rule`; any T. Intermediate states are not kept, so positions inside
    the batch cannot be rolled back to (the caller records that).
    """
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = state_ring.shape[0]
    rep = hv // hk
    c = chunk_size
    pad = (c - t % c) % c
    nc = (t + pad) // c
    # Everything is laid out chunk-major, [nc, Hv, C, d] fp32: the batched products below and the state
    # recurrence read it without transposes. Each input is written there in one pass (the key heads
    # repeated for their value heads, q and k l2-normed on the way); rows past T (the last chunk's pad) are 0.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x for x in (q, k, v))
    beta, g = (F.pad(x.float(), (0, 0, 0, pad)) for x in (beta, g))

    def chunked(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """x [Tp, h, d] times factor [Tp, h or Hv, 1] -> [nc, Hv, C, d] fp32 (key head i: value heads i*rep ..)."""
        h, d = x.shape[1], x.shape[2]
        out = torch.empty((nc, h, hv // h, c, d), dtype=torch.float32, device=x.device)
        xs = x.unflatten(0, (nc, c)).permute(0, 2, 1, 3)[:, :, None].expand(out.shape)  # [nc, h, rep, C, d]
        fs = factor.reshape(nc, c, h, -1, 1).permute(0, 2, 3, 1, 4)  # [nc, h, rep or 1, C, 1]
        torch.mul(xs, fs, out=out)
        return out.view(nc, hv, c, d)

    def l2_factor(x: torch.Tensor) -> torch.Tensor:  # as _l2norm: x * rsqrt(sum x^2 + 1e-6)
        sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
        return sq.add_(1e-6).rsqrt_()

    bt = beta.unsqueeze(-1)  # [Tp, Hv, 1]
    k_norm = l2_factor(k)
    query = chunked(q, l2_factor(q).mul_(dk**-0.5))
    key = chunked(k, k_norm)
    k_beta = chunked(k, k_norm.repeat_interleave(rep, dim=1) * bt)
    # the right-hand sides of the triangular solve, side by side: [V * beta | K * beta * exp(cum)]
    rhs = torch.empty((nc, hv, c, dv + dk), dtype=torch.float32, device=q.device)
    torch.mul(v.unflatten(0, (nc, c)).transpose(1, 2), bt.unflatten(0, (nc, c)).transpose(1, 2), out=rhs[..., :dv])
    cum = g.unflatten(0, (nc, c)).permute(0, 2, 1).cumsum(-1)  # [nc, Hv, C]
    torch.mul(k_beta, cum.exp()[..., None], out=rhs[..., dv:])
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill_(upper, float("-inf")).exp_()
    ut = torch.matmul(k_beta, key.transpose(-1, -2)).mul_(pair)
    intra = torch.matmul(query, key.transpose(-1, -2)).mul_(pair)
    both = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)  # both right-hand sides at once
    u_c, w_c = both[..., :dv], both[..., dv:]  # the corrected values and the decay-weighted cumulative keys
    query.mul_(cum.exp()[..., None])
    key.mul_((cum[..., -1:] - cum).exp_()[..., None])
    chunk_decay = cum[..., -1].exp()  # [nc, Hv]
    # The only sequential part is the state entering each chunk: S_{i+1} = decay_i S_i + K_i^T (U_i - W_i S_i)
    # = A_i S_i + B_i with A_i = decay_i I - K_i^T W_i and B_i = K_i^T U_i (K: the decay-weighted keys, W: k_cum,
    # U: new_v). A and B of every chunk are two batched products; the recurrence is then one launch a chunk;
    # the corrected values and the outputs of all chunks are three batched products over the kept states.
    # Held at once: nc + 1 states, A and B (Hv x 128 x 128 fp32 each a chunk: ~200 MiB at 32 heads and 2048
    # tokens, bounded by the prefill chunk, not by the prompt).
    key_t = key.transpose(-1, -2)  # [nc, Hv, dk, C]
    a_mat = torch.matmul(key_t, w_c).neg_()  # [nc, Hv, dk, dk]
    a_mat.diagonal(dim1=-2, dim2=-1).add_(chunk_decay[..., None])
    b_mat = torch.matmul(key_t, u_c)  # [nc, Hv, dk, dv]
    states = torch.empty((nc + 1, hv, dk, dv), dtype=torch.float32, device=q.device)
    states[0] = state_ring[start % n]
    for i in range(nc):
        torch.baddbmm(b_mat[i], a_mat[i], states[i], out=states[i + 1])
    state_ring[(start + t) % n] = states[nc]
    v_new = u_c - torch.matmul(w_c, states[:nc])  # [nc, Hv, C, dv]
    out = torch.matmul(query, states[:nc]).add_(torch.matmul(intra, v_new))  # [nc, Hv, C, dv]
    return out.transpose(1, 2).reshape(nc * c, hv, dv)[:t].to(v.dtype, memory_format=torch.contiguous_format)


def gemv_add_rmsnorm(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection whose output joins the residual stream and is normed: add_rmsnorm(gemv(x, w), residual,
    weight, eps) -> (rmsnorm(s), s). The CUDA form fuses the split-K combine, the add and the norm."""
    return add_rmsnorm(gemv(x, w, variant), residual, weight, eps)


def gemv_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """A projection whose output joins the residual stream, without the norm after it (its consumer norms it:
    gemv_mlp_add_rmsnorm's x_norm): gemv(x, w) + residual -> s, gemv_add_rmsnorm's s."""
    return gemv(x, w, variant) + residual


def gemv_norm(x: torch.Tensor, w: torch.Tensor, eps: float, variant: str | None = None) -> torch.Tensor:
    """The product of a layer's input rows whose norm is deferred to it (issue 20): x is the residual stream and w
    carries the norm's weight folded into its columns (Model.fold_norms), so the product's input is rmsnorm(x) with no
    weight: gemv(rmsnorm(x, 0), w). The CUDA form norms in the product's launch (one row)."""
    return gemv(unit_rmsnorm(x, eps), w, variant)


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """The MLP's product and activation: silu_mul(gemv(x, w)) for the packed gate|up weight w [2 I, K] -> [M, I].
    The CUDA form makes both in one launch."""
    return silu_mul(gemv(x, w, variant))


def gemv_mlp_add_rmsnorm(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variant: str | None = None,
    x_norm: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The MLP (packed gate|up [2 I, K], down [N, I]) and the residual add + norm after it: gemv_add_rmsnorm(
    gemv_silu_mul(x, w_gate_up), w_down, residual, weight, eps) -> (rmsnorm(s), s). `variant` names the down
    product's launch; the CUDA form makes all of it in one launch for one row. x_norm: x is the residual stream
    before its norm (gemv_add's s) and that norm's weight is folded into w_gate_up, so the MLP's input is rmsnorm(x)
    with no weight (the deferred norm). weight None (the norm after it deferred to the next layer): (None, s)."""
    if x_norm:
        x = unit_rmsnorm(x, eps)
    if weight is None:
        return None, gemv_add(gemv_silu_mul(x, w_gate_up), w_down, residual, variant)
    return gemv_add_rmsnorm(gemv_silu_mul(x, w_gate_up), w_down, residual, weight, eps, variant)


def argmax_prob(
    logits: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy pick over the first n vocabulary ids (n = 0: all), and its softmax probability over them.

    logits [T, V] -> (token [T] int64, prob [T] fp32). Only these two numbers per row leave the op.
    `out` = (token, prob) tensors of those shapes and dtypes (views of a round's buffers) to write them into,
    returned: the chained draft puts each step's pick where the verify reads it, with no copy after.
    """
    scores = logits if n <= 0 else logits[:, :n]
    scores = scores.float()
    top, idx = scores.max(dim=-1)
    prob = 1.0 / torch.exp(scores - top[:, None]).sum(dim=-1)
    if out is None:
        return idx, prob
    out[0].copy_(idx)
    out[1].copy_(prob)
    return out


def mtp_prefc(
    tokens: torch.Tensor,
    hiddens: torch.Tensor,
    embed: torch.Tensor,
    w_embed: torch.Tensor,
    w_hidden: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The MTP head's fc input: cat(rmsnorm(embed[tokens], w_embed), rmsnorm(hiddens, w_hidden)), embedding
    first. tokens [T] int64, hiddens [T, H], embed [V, H] -> [T, 2H] in hiddens' dtype."""
    e = rmsnorm(F.embedding(tokens, embed), w_embed, eps)
    return torch.cat((e, rmsnorm(hiddens, w_hidden, eps)), dim=-1)


def greedy_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_tokens: torch.Tensor,
    p_min: float,
    cache_len: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor | None = None,
) -> None:
    """Greedy acceptance, written into device buffers so no host decision sits inside a round.

    drafts [n] int64 and draft_probs [n] fp32 (n >= 0); target_tokens [n+1] int64 (the target's argmax
    at each verify row). A draft counts only while every draft before it, and itself, has prob >= p_min
    (n_valid). k = longest prefix of the valid drafts equal to the target's picks; the bonus token is
    target_tokens[k]. Writes out[0] = k + 1 (tokens emitted), out[1] = n_valid, out[2 : 3 + k] = drafts[:k]
    then the bonus, and adds k + 1 to cache_len[0] (the target consumed the last token and k drafts); with
    `start` (one int64, the round's first position) it sets cache_len[0] = start + k + 1 instead.
    out must hold n + 3 int64.
    """
    n = drafts.shape[0]
    n_valid = 0
    while n_valid < n and float(draft_probs[n_valid]) >= p_min:
        n_valid += 1
    k = 0
    while k < n_valid and int(drafts[k]) == int(target_tokens[k]):
        k += 1
    out[0] = k + 1
    out[1] = n_valid
    out[2 : 2 + k] = drafts[:k]
    out[2 + k] = target_tokens[k]
    if start is not None:
        cache_len[0] = start.reshape(-1)[0] + k + 1
    else:
        cache_len[0] += k + 1


def argmax_greedy_accept(
    logits: torch.Tensor,
    n: int,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    p_min: float,
    cache_len: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify's pick and acceptance: argmax_prob(logits, n) over its T = len(drafts) + 1 rows, then
    greedy_accept of the drafts against those tokens (its writes to `out` and `cache_len`). Returns the
    (token [T], prob [T]) of argmax_prob."""
    tok, prob = argmax_prob(logits, n)
    greedy_accept(drafts, draft_probs, tok, p_min, cache_len, out, start)
    return tok, prob


# ---- sampling ---------------------------------------------------------------------------------------------
# Random numbers are counter-based: u = hash(seed, round position, slot, purpose), a pure function of integers,
# so a captured CUDA graph draws new numbers at every replay (the position is read from a device buffer) with no
# generator state, the host can draw the same numbers (chain-off drafting), and every rank of a tensor-parallel
# model draws the same ones. The CUDA kernels compute the same integers (kernels/cuda_src/sampling_kernels.cu).
# Nothing in these references synchronises with the host (no .item(), no data-dependent shapes): on a GPU they
# may run inside a captured graph.
RNG_DRAFT, RNG_ACCEPT, RNG_RESAMPLE = 1, 2, 3  # the purposes: a draft pick, an acceptance test, a target pick
RNG_SYNTH = 4  # a synthetic acceptance test (synthetic_accept: a measurement mode, not sampling)
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 in int64 without overflow (two 16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32), on int64 tensors holding 0 <= x < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rng_uniform(seed: torch.Tensor, start: Start, slots: torch.Tensor, purpose: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) (multiples of 2^-24, fp32), one per slot: hash(seed, start, slot, purpose).

    seed: 1-element int64 tensor (0 <= seed < 2^63); start: the round's position (host int or 1-element int64
    tensor); slots: int64 tensor of any shape, on the device the result should be on."""
    dev = slots.device
    s = seed.reshape(-1)[:1].to(dev)
    pos = torch.tensor([int(start)], device=dev) if isinstance(start, int) else start.reshape(-1)[:1].to(dev)
    h = _mix32((s & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (pos & _M32))
    h = _mix32(h ^ ((slots * 8 + purpose) & _M32))
    return (h >> 8).float() * (2.0**-24)


def sample_probs(
    logits: torch.Tensor, n: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The sampling distribution of each row over its first n ids (n = 0: all): logits / temperature, top-k
    (keep values >= the k-th largest: ties at the k-th are kept), softmax, top-p (keep p >= t where t is the
    smallest probability whose strictly-larger mass is < top_p: the smallest set reaching top_p, ties kept),
    min-p (keep p >= min_p * max p), renormalised. logits [T, V] -> probs [T, n] fp32 (zeros where cut).
    temperature > 0; top_k 0 = off; top_p 1 = off; min_p 0 = off."""
    x = logits if n <= 0 else logits[:, :n]
    x = x.float() / temperature
    width = x.shape[-1]
    if 0 < top_k < width:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp = p.sort(dim=-1, descending=True).values
        kept = ((sp.cumsum(-1) - sp) < top_p).sum(-1, keepdim=True).clamp(min=1)
        p = p.masked_fill(p < sp.gather(-1, kept - 1), 0.0)
    if min_p > 0.0:
        p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0.0)
    return p / p.sum(-1, keepdim=True)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative weights w [B, V] (need not sum to 1) with uniforms u [B]:
    the first index whose running sum exceeds u * total, never an index of weight 0."""
    cs = w.cumsum(-1)
    idx = (cs <= (u * cs[:, -1])[:, None]).sum(-1)
    cols = torch.arange(w.shape[-1], device=w.device)
    last = torch.where(w > 0, cols, torch.zeros_like(cols)).amax(-1)
    return torch.minimum(idx, last)


def sample_token(
    probs: torch.Tensor, seed: torch.Tensor, start: Start, slot: int, purpose: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one id per row of probs [T, n] with the uniforms of slots slot .. slot+T-1: (token [T] int64,
    its probability [T] fp32)."""
    t = probs.shape[0]
    slots = torch.arange(slot, slot + t, device=probs.device)
    tok = _inverse_cdf(probs.float(), rng_uniform(seed, start, slots, purpose))
    return tok, probs.float().gather(1, tok[:, None])[:, 0]


def speculative_accept_rows(
    drafts: torch.Tensor,
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    n_valid: torch.Tensor,
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
    rule: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule on a batch of B rounds (the ground truth `spec_accept` runs with B = 1).

    drafts [B, n] int64 (drawn from q); q_rows [B, n, Vq] the draft distributions (over the first Vq ids, zero
    beyond); p_rows [B, n+1, V] the target's; n_valid [B] drafts that count; u_accept [B, n], u_resample [B, n+1]
    uniforms in [0, 1). Draft i is accepted when u_accept[i] * q_i(x_i) < p_i(x_i) (probability
    min(1, p/q)); k = accepted prefix (<= n_valid). The new token is drawn with u_resample[k] from
    normalise(max(0, p_k - q_k)) when draft k was rejected, else (all valid drafts accepted) from p_k.
    Returns (k [B] int64, new token [B] int64). `rule` other than "exact" is a deliberately wrong rule for the
    statistical test: "accept_always" or "residual_p" (resample from p_k instead of max(0, p_k - q_k))."""
    b, n = drafts.shape
    v = p_rows.shape[-1]
    dev = p_rows.device
    p_rows = p_rows.float()
    q_full = F.pad(q_rows.float(), (0, v - q_rows.shape[-1]))  # [B, n, V]
    if n > 0:
        px = p_rows[:, :n].gather(2, drafts[..., None])[..., 0]
        qx = q_full.gather(2, drafts[..., None])[..., 0]
        ok = u_accept * qx < px if rule != "accept_always" else torch.ones_like(px, dtype=torch.bool)
        ok = ok & (torch.arange(n, device=dev)[None, :] < n_valid[:, None])
        k = ok.long().cumprod(-1).sum(-1)
    else:
        k = torch.zeros(b, dtype=torch.long, device=dev)
    pk = p_rows.gather(1, k[:, None, None].expand(b, 1, v))[:, 0]
    rejected = k < n_valid
    if n > 0:
        qk = q_full.gather(1, k.clamp(max=n - 1)[:, None, None].expand(b, 1, v))[:, 0]
        resid = pk if rule == "residual_p" else (pk - qk).clamp(min=0.0)
        w = torch.where(rejected[:, None], resid, pk)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, pk)  # p == q on the row (rounding): draw from p
    else:
        w = pk
    return k, _inverse_cdf(w, u_resample.gather(1, k[:, None])[:, 0])


def spec_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    p_min: float,
    seed: torch.Tensor,
    start: Start,
    cache_len: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Speculative-sampling acceptance, written into device buffers like `greedy_accept` (same out layout).

    drafts [n] int64 (drawn from q_rows), draft_probs [n] fp32 (q of each draft: only for p_min, as in
    greedy_accept), q_rows [n, Vq] the draft's processed distributions (any row stride), p_rows [n+1, V] the
    target's processed distributions (sample_probs). Uniforms: slot i with RNG_ACCEPT for draft i's test, slot k
    with RNG_RESAMPLE for the new token (see speculative_accept_rows). Writes out[0] = k + 1, out[1] = n_valid,
    out[2 : 3 + k] = drafts[:k] then the new token; adds k + 1 to cache_len[0]. out must hold n + 3 int64."""
    n = drafts.shape[0]
    dev = p_rows.device
    n_valid = (draft_probs.float() >= p_min).long().cumprod(-1).sum(-1, keepdim=True) if n else drafts.new_zeros(1)
    slots = torch.arange(n + 1, device=dev)
    u_acc = rng_uniform(seed, start, slots[:n], RNG_ACCEPT)
    u_res = rng_uniform(seed, start, slots, RNG_RESAMPLE)
    k, tok = speculative_accept_rows(drafts[None], q_rows[None], p_rows[None], n_valid, u_acc[None], u_res[None])
    emitted = torch.where(slots < k, F.pad(drafts, (0, 1)), tok)
    out[2 : 3 + n].copy_(emitted)
    out[0:1].copy_(k + 1)
    out[1:2].copy_(n_valid)
    cache_len.reshape(-1)[:1].add_(k + 1)


def synthetic_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_tokens: torch.Tensor,
    p_min: float,
    rates: torch.Tensor,
    seed: torch.Tensor,
    start: Start,
    cache_len: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Synthetic acceptance (a measurement mode): `greedy_accept` with the accepted count drawn instead of
    compared, written into the same device buffers, with no host synchronisation.

    drafts [n] int64, draft_probs [n] fp32, target_tokens [n+1] int64 as in greedy_accept; rates [m] fp32
    (m >= 1): the chance that draft i is accepted once every draft before it was, rates[min(i, m-1)] (positions
    past the list take its last rate). n_valid as in greedy_accept (p_min cuts the drafts first). Draft i passes
    when rng_uniform(seed, start, slot i, RNG_SYNTH) < its rate; k = the passing prefix of the valid drafts.
    Writes out[0] = k + 1, out[1] = n_valid, out[2 : 3 + n] = drafts[:k] then target_tokens[k] (repeated to
    the end), and adds k + 1 to cache_len[0]: the layout greedy_accept writes, so the round's one read, its
    rollback and its statistics are unchanged. out must hold n + 3 int64."""
    n = drafts.shape[0]
    m = rates.shape[0]
    if m < 1:
        raise ValueError("synthetic_accept needs at least one rate")
    dev = target_tokens.device
    slots = torch.arange(n + 1, device=dev)
    if n:
        n_valid = (draft_probs.double() >= p_min).long().cumprod(-1).sum(-1, keepdim=True)
        rate = rates.float().to(dev).index_select(0, slots[:n].clamp(max=m - 1))
        passed = rng_uniform(seed, start, slots[:n], RNG_SYNTH) < rate
        k = (passed & (slots[:n] < n_valid)).long().cumprod(-1).sum(-1, keepdim=True)
    else:
        n_valid = k = torch.zeros(1, dtype=torch.long, device=dev)
    emitted = torch.where(slots < k, F.pad(drafts, (0, 1)), target_tokens.index_select(0, k))
    out[2 : 3 + n].copy_(emitted)
    out[0:1].copy_(k + 1)
    out[1:2].copy_(n_valid)
    cache_len.reshape(-1)[:1].add_(k + 1)


# Weight elements converted to fp32 at a time by `gemv` (64 MiB): a 248k-row LM head is never copied whole.
_GEMV_CHUNK = 1 << 24


def gemv(x: torch.Tensor, w: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (F.linear without bias), accumulated in fp32 and rounded once to x's dtype: the
    ground truth of the skinny-GEMM kernels of decode shapes. `variant` names a kernel's launch shape (see
    kernels/registry.py) and means nothing here."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.linear(x, w)
    xf = x.float()
    rows = max(1, _GEMV_CHUNK // max(1, w.shape[-1]))
    if w.shape[0] <= rows:
        return F.linear(xf, w.float()).to(x.dtype)
    out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)
    for a in range(0, w.shape[0], rows):
        out[..., a : a + rows] = F.linear(xf, w[a : a + rows].float())
    return out
