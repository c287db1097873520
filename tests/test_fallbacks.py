"""A fallback to a reference op (CuPy missing, or a shape its kernel does not cover) is counted per op,
reported once per op, and shown in the engine's run stats. On the CPU the GPU is pretended by the one seam
`kernels.registry.on_gpu`."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineSettings
from kernels import ops, reference, registry


@pytest.fixture
def pretend_gpu(monkeypatch):
    registry.reset_fallbacks()
    # Whatever the dispatcher binds now (CUDA kernels on a GPU machine) is bound again afterwards.
    for name in (*registry.NAMES, "_cuda_enabled"):
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setattr(registry, "on_gpu", lambda first: isinstance(first, torch.Tensor))
    yield
    registry.reset_fallbacks()


def test_a_kernel_that_cannot_take_the_call_counts_and_reports_once(pretend_gpu, caplog):
    import kernels.cuda as kc

    x, w = torch.randn(3, 32), torch.randn(32)
    with caplog.at_level(logging.WARNING, logger="specdeck.kernels"):
        for _ in range(3):
            torch.testing.assert_close(kc.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6), rtol=0, atol=0)
        kc.silu_mul(x)
        kc.silu_mul(x)
    assert registry.fallbacks() == {"rmsnorm": 3, "silu_mul": 2}
    reports = [r.getMessage() for r in caplog.records if r.name == "specdeck.kernels"]
    assert len(reports) == 2
    assert reports[0].startswith("rmsnorm ran as its PyTorch reference") and reports[1].startswith("silu_mul")


def test_cpu_calls_are_not_fallbacks():
    import kernels.cuda as kc

    registry.reset_fallbacks()
    kc.rmsnorm(torch.randn(2, 8), torch.randn(8), 1e-6)
    assert registry.fallbacks() == {}


def test_cupy_missing_counts_every_op_in_the_engine_stats(pretend_gpu, tiny_engine, monkeypatch, caplog):
    import kernels.cuda as kc

    monkeypatch.setattr(kc, "available", lambda: (False, "CuPy is not installed"))
    assert ops.use_cuda_kernels(True) == (False, "CuPy is not installed")
    assert not ops.cuda_enabled()
    with caplog.at_level(logging.WARNING, logger="specdeck.kernels"):
        out = tiny_engine.generate("def main():", 6, EngineSettings(draft_depth=2))
        again = tiny_engine.generate("def main():", 6, EngineSettings(draft_depth=2), tiny_engine.new_session())
    first, second = out.stats["fallbacks"], again.stats["fallbacks"]
    assert first["attn_prep"] > 0 and first["argmax_greedy_accept"] > 0 and "chunk_gated_delta_rule" not in first
    assert all(second[op] > n for op, n in first.items())  # counted per call, for the process
    reports = [r.getMessage() for r in caplog.records if r.name == "specdeck.kernels"]
    assert len(reports) == len(second)  # once per op, however often it fell back
    assert all("CuPy is not installed" in m for m in reports)


def test_no_fallback_no_entry(tiny_engine):
    registry.reset_fallbacks()
    assert tiny_engine.generate("def", 4).stats["fallbacks"] == {}
