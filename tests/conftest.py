"""Shared fixtures: tiny random models (written once per test session), GPU marker handling."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import write_tiny_model  # noqa: E402

try:  # the tests' models are tiny: one thread is as fast, and immune to oversubscribed cores
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5-hybrid model with an MTP head (text-only layout)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from engine import Engine

    return Engine.load(tiny_model_dir)
