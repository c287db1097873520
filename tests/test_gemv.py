"""The skinny-GEMM op `gemv` on the CPU: its reference is F.linear accumulated in fp32 and rounded once, the
CUDA entry point takes the reference for CPU tensors (not a fallback) and counts a fallback for a call meant
for a GPU that its kernel cannot take, and launch variant names are parsed strictly. The kernels themselves
are compared with the reference in tests/test_gemv_gpu.py."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from kernels import ops, reference, registry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_linear_accumulated_in_fp32(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 96).to(dtype)
    w = (torch.randn(40, 96) * 0.1).to(dtype)
    out = reference.gemv(x, w)
    assert out.dtype == dtype and out.shape == (5, 40)
    expect = F.linear(x, w) if dtype == torch.float32 else F.linear(x.float(), w.float()).to(dtype)
    assert torch.equal(out, expect)
    assert torch.equal(reference.gemv(x, w, "tc1.w8.s2"), expect)  # a variant means nothing here


def test_reference_converts_a_large_weight_in_chunks(monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(100, 64).bfloat16()
    whole = reference.gemv(x, w)
    monkeypatch.setattr(reference, "_GEMV_CHUNK", 64 * 7)  # 7 rows at a time: 15 chunks, the last short
    assert torch.equal(reference.gemv(x, w), whole)
    assert torch.equal(reference.gemv(x[0], w), whole[0])  # F.linear's shapes: a vector too


def test_the_kernel_entry_point_has_the_reference_signature_and_takes_cpu_calls():
    import kernels.cuda as kc

    assert str(inspect.signature(kc.gemv)) == str(inspect.signature(reference.gemv))
    registry.reset_fallbacks()
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    assert torch.equal(kc.gemv(x, w), F.linear(x, w))
    assert not kc.gemv_takes(x, w)
    assert registry.fallbacks() == {}


def test_a_gpu_call_the_kernel_cannot_take_is_a_counted_fallback(monkeypatch):
    import kernels.cuda as kc

    registry.reset_fallbacks()
    monkeypatch.setattr(registry, "on_gpu", lambda first: isinstance(first, torch.Tensor))
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    kc.gemv(x, w)
    kc.gemv(x, w, "simt1.w4.s1")
    assert registry.fallbacks() == {"gemv": 2}
    registry.reset_fallbacks()


def test_without_the_cuda_kernels_the_engine_helpers_say_no(monkeypatch):
    monkeypatch.setattr(ops, "_cuda_enabled", False)
    ok, why = ops.gemv_kernels(torch.device("cpu"), torch.float32)
    assert ok is False and why
    assert ops.gemv_takes(torch.randn(1, 8), torch.randn(4, 8)) is False


@pytest.mark.parametrize(
    "name,parsed",
    [
        ("tc1.w8.s2", ("tc1", 8, 2)),
        ("tc2.w4.s1", ("tc2", 4, 1)),
        ("simt1.w1.s64", ("simt1", 1, 64)),
        ("simt2.w2.s10", ("simt2", 2, 10)),
        ("res2.w8.s1", ("res2", 8, 1)),
        ("res3.w8.s1", None),
        ("tc1.w3.s2", None),  # 3 warps: not a power of two
        ("tc1.w8.s0", None),
        ("tc1.w8.s65", None),
        ("tc1.w8.s02", None),
        ("tc3.w8.s1", None),
        ("cublas", None),
        ("tc1.w8.s1 ", None),
        ("", None),
        (None, None),
        (7, None),
        ("tc1.w8.s1" * 3, None),
    ],
)
def test_variant_names_are_parsed_strictly(name, parsed):
    assert registry.parse_gemv_variant(name) == parsed


def test_a_resident_mlp_variant_names_the_launches_whose_bits_it_gives():
    assert registry.gemv_twin("res2.w8.s1") == "simt2.w8.s1"
    assert registry.gemv_twin("res1.w4.s1") == "simt1.w4.s1"
    assert registry.gemv_twin("tc1.w8.s2") == "tc1.w8.s2"
    assert registry.gemv_unsplit(registry.gemv_twin("res2.w4.s1")) == "simt2.w4.s1"
    assert registry.gemv_mlp_launches("res2.w4.s1") == ("simt2.w4.s1", "simt2.w4.s1")
    assert registry.gemv_mlp_launches("simt1.w8.s4") == ("simt1.w8.s1", "simt1.w8.s4")
