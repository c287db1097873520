"""Prefill's delta-net layer on the GPU, before and after, in one run: the chunked delta rule of
kernels/reference.py against its previous batched form (kept below only to be timed against) and variants
(TF32 products), on the 9B-like delta-net shape; then the 9B-like
prefill of a 4k prompt end to end with each, and with the causal conv as the reference's conv1d (before)
or the CUDA kernel's parallel runs (after). --profile: the GPU kernels of one call of each.

    python bench/prefill_delta.py [--tokens 2048,4096] [--profile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import time_eager  # noqa: E402

from kernels import reference as R  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B's gated delta-net


def previous_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_ring: torch.Tensor,
    start: int,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The batched form before 2026-12-01 (2): [Hv, nc, C, d] layout, the inputs copied several times, the
    right-hand sides concatenated, a transposed output."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = state_ring.shape[0]
    rep = hv // hk
    query = (R._l2norm(q.float()).repeat_interleave(rep, dim=1) * dk**-0.5).transpose(0, 1)  # [Hv, T, dk]
    key = R._l2norm(k.float()).repeat_interleave(rep, dim=1).transpose(0, 1)
    value = v.float().transpose(0, 1)
    bt = beta.float().transpose(0, 1)  # [Hv, T]
    decay = g.float().transpose(0, 1)
    pad = (chunk_size - t % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    bt, decay = F.pad(bt, (0, pad)), F.pad(decay, (0, pad))
    nc = (t + pad) // chunk_size
    v_beta = value * bt[..., None]
    k_beta = key * bt[..., None]
    query, key, k_beta, v_beta = (x.reshape(hv, nc, chunk_size, -1) for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(hv, nc, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(-1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    dk_beta = k_beta * cum.exp()[..., None]
    both = torch.linalg.solve_triangular(ut, torch.cat((v_beta, dk_beta), -1), upper=False, unitriangular=True)
    new_v, k_cum = both[..., :dv], both[..., dv:]
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, nc, 1, 1]
    # The only sequential part is the state entering each chunk: S_{i+1} = decay_i S_i + K_i^T (U_i - W_i S_i)
    # = A_i S_i + B_i with A_i = decay_i I - K_i^T W_i and B_i = K_i^T U_i (K: the decay-weighted keys, W: k_cum,
    # U: new_v). A and B of every chunk are two batched products; the recurrence is then one launch a chunk;
    # the corrected values and the outputs of all chunks are three batched products over the kept states.
    # Held at once: nc + 1 states, A and B (Hv x 128 x 128 fp32 each a chunk: ~200 MiB at 32 heads and 2048
    # tokens, bounded by the prefill chunk, not by the prompt).
    w_c = k_cum.transpose(0, 1)  # [nc, Hv, C, dk]
    key_t = key.transpose(-1, -2).transpose(0, 1)  # [nc, Hv, dk, C]
    u_c = new_v.transpose(0, 1)  # [nc, Hv, C, dv]
    a_mat = torch.matmul(key_t, w_c).neg_()  # [nc, Hv, dk, dk]
    a_mat.diagonal(dim1=-2, dim2=-1).add_(chunk_decay.transpose(0, 1)[..., 0])
    b_mat = torch.matmul(key_t, u_c)  # [nc, Hv, dk, dv]
    states = torch.empty((nc + 1, hv, dk, dv), dtype=torch.float32, device=q.device)
    states[0] = state_ring[start % n]
    for i in range(nc):
        torch.baddbmm(b_mat[i], a_mat[i], states[i], out=states[i + 1])
    v_new = (u_c - torch.matmul(w_c, states[:nc])).transpose(0, 1)  # [Hv, nc, C, dv]
    state_ring[(start + t) % n] = states[nc]
    s_in = states[:nc].transpose(0, 1)  # [Hv, nc, dk, dv]: the state entering each chunk
    out = torch.matmul(query, s_in) + torch.matmul(intra, v_new)
    out = out.reshape(hv, -1, dv)[:, :t].transpose(0, 1)
    return out.to(v.dtype).contiguous()


BATCHED = R.chunk_gated_delta_rule  # kept: the 9B section below swaps the module's entry for each form


class Form:
    """A way to run the chunked rule: the batched form with its fp32 products in full fp32 or TF32, or the
    previous batched form. (The triangular solve as a product of powers was timed here too, on 2026-12-01:
    slower in fp32; bench/results/h200-prefill-2026-12-01.txt.)"""

    def __init__(self, name: str, tf32: bool = False, previous: bool = False):
        self.name, self.tf32, self.previous = name, tf32, previous

    def __call__(self, *args):
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        try:
            return (previous_form if self.previous else BATCHED)(*args)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved


FORMS = [Form("previous", previous=True), Form("batched"), Form("batched, tf32", tf32=True)]


def profile_top(fn, n: int = 14) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--profile", action="store_true", help="also print the GPU kernels' time of one call")
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    print(f"== chunk_gated_delta_rule, one 9B-like layer ({HK} key / {HV} value heads, {DK} x {DV}), bf16 in ==")
    print("ms per call; max |diff| against the batched fp32 form with torch's triangular solve")
    print(f"{'tokens':>7} " + " ".join(f"{f.name:>20}" for f in FORMS))
    for t in (int(x) for x in a.tokens.split(",")):
        gen = torch.Generator(device=dev).manual_seed(t)
        q = torch.randn(t, HK, DK, device=dev, generator=gen).bfloat16()
        k = torch.randn(t, HK, DK, device=dev, generator=gen).bfloat16()
        v = torch.randn(t, HV, DV, device=dev, generator=gen).bfloat16()
        g = -torch.rand(t, HV, device=dev, generator=gen) * 0.1
        beta = torch.rand(t, HV, device=dev, generator=gen).bfloat16()
        args = (q, k, v, g, beta)
        ref_ring = torch.randn(4, HV, DK, DV, device=dev, generator=gen) * 0.1
        ref = FORMS[1](*args, ref_ring.clone(), 0).float()
        times, diffs = [], []
        for f in FORMS:
            ring = ref_ring.clone()
            diffs.append((f(*args, ring, 0).float() - ref).abs().max().item())
            times.append(time_eager(lambda f=f, a=args, r=ring: f(*a, r, 0), iters=5))
        print(f"{t:>7} " + " ".join(f"{x * 1e3:>20.2f}" for x in times))
        print(f"{'':>7} " + " ".join(f"{d:>20.1e}" for d in diffs))
        if a.profile:
            for f in FORMS[1:]:
                print(f"-- {f.name}, {t} tokens: GPU kernels of one call --")
                profile_top(lambda f=f, a=args, r=ref_ring: f(*a, r, 0), n=10)
    print()
    print("== 9B-like prefill of a 4096-token prompt (24 delta-net layers), each form ==")
    import gpu_bench as G

    from engine import EngineSettings
    from kernels import cuda as C
    from kernels import ops

    eng = G.random_9b_engine(max_context=8192, mtp=False)
    ids = torch.randint(0, 32768, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    target = EngineSettings(speculative=False)
    sess = eng.new_session()
    eng.generate(ids, 1, target, sess)  # warm-up
    conv_kernel = C.conv_update

    def conv_reference(x, ring, w, start):  # the path before 2026-12-01 (2) for prefill-sized batches
        return (
            R.conv_update(x, ring, w, start)
            if x.shape[0] > 64 and isinstance(start, int)
            else conv_kernel(x, ring, w, start)
        )

    before = (FORMS[0], conv_reference, "previous rule, conv1d (before)")
    after = (FORMS[1], conv_kernel, "batched rule, conv kernel (after)")
    runs = [before, (FORMS[1], conv_reference, "batched rule, conv1d"), after]
    runs += [(f, conv_kernel, f"{f.name}, conv kernel") for f in FORMS[2:]] + [before, after]
    first = None
    for f, conv, label in runs:
        for mod in (R, C, ops):
            mod.chunk_gated_delta_rule = f
        ops.conv_update = C.conv_update = conv
        sess.reset()
        res = eng.generate(ids, 4, target, sess)
        st = res.stats
        first = first or list(res.tokens)
        same = list(res.tokens) == first
        print(f"{label:>36}: {st['prefill_tokens'] / st['prefill_s']:>8,.0f} t/s  tokens as the first run's: {same}")
    if a.profile:
        for mod in (R, C, ops):
            mod.chunk_gated_delta_rule = FORMS[1]
        ops.conv_update = C.conv_update = conv_kernel

        def run():
            sess.reset()
            eng.generate(ids, 1, target, sess)

        print("-- 9B-like prefill of 4096 tokens (after): GPU kernels --")
        profile_top(run, n=25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
