"""The chunked (GEMM) form of the gated delta rule that prefill uses gives what the recurrent form gives, token
by token: the outputs and the state it leaves, for any length (shorter than a chunk, not a multiple of it, many
chunks), grouped key heads, a carried-in state and a ring position that wraps. Runs on the CPU in fp32 (references only)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref


def _inputs(t, hk, hv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    q, k, v = r(t, hk, dk), r(t, hk, dk), r(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen) * 0.5  # log-decay in (-0.5, 0]
    beta = torch.rand(t, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("t", [1, 5, 64, 100, 200])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(t, hk, hv, chunk):
    dk, dv, planes = 16, 8, 256
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, seed=t * 7 + hv + chunk)
    start = planes - 3  # the written plane wraps around the ring
    ring_a = torch.zeros(planes, hv, dk, dv)
    ring_a[start % planes] = torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.3
    ring_b = ring_a.clone()
    want = ref.gated_delta_rule(q, k, v, g, beta, ring_a, start)
    got = ref.chunk_gated_delta_rule(q, k, v, g, beta, ring_b, start, chunk_size=chunk)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=2e-4, rtol=2e-4), (got - want).abs().max()
    end = (start + t) % planes
    assert torch.allclose(ring_b[end], ring_a[end], atol=2e-4, rtol=2e-4), (ring_b[end] - ring_a[end]).abs().max()
    # the chunked form writes only the final plane; the plane it started from is unchanged
    assert torch.equal(ring_b[start % planes], ring_a[start % planes])


def test_chunked_in_bf16_stays_close_to_fp32():
    t, hk, hv, dk, dv = 130, 2, 4, 32, 16
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, seed=5)
    ring32 = torch.zeros(4, hv, dk, dv)
    ring16 = ring32.clone()
    want = ref.chunk_gated_delta_rule(q, k, v, g, beta, ring32, 0)
    got = ref.chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), ring16, 0)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
