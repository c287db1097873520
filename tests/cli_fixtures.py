"""Fixtures of the command-line tests: import what a test module needs (`from cli_fixtures import config, ...`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def config(tmp_path, monkeypatch):
    """A config folder of the test's own (SPECDECK_CONFIG_DIR), never the user's."""
    directory = tmp_path / "config"
    monkeypatch.setenv("SPECDECK_CONFIG_DIR", str(directory))
    return directory


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The CLI sets torch's thread count; the next test gets back what it had."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
