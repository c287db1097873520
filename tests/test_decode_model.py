"""The round needs only what `DecodeModel` lists, and `Model` provides it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from engine import spec
from engine.decode_model import DecodeModel
from engine.model import Model

MEMBERS = {
    name
    for name, value in vars(DecodeModel).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
} | set(DecodeModel.__annotations__)


def test_model_is_a_decode_model(tiny_engine):
    assert isinstance(tiny_engine.model, DecodeModel)
    assert {"forward_layers", "pick", "lm_head", "mtp_forward", "configure", "plan_tag", "sync"} <= MEMBERS


def test_model_methods_have_the_protocols_signatures():
    for name in MEMBERS:
        proto = getattr(DecodeModel, name, None)
        if callable(proto):
            got = list(inspect.signature(getattr(Model, name)).parameters)
            assert got == list(inspect.signature(proto).parameters), name


def test_something_else_is_not():
    class Half:
        cfg = device = dtype = has_mtp = None

        def pick(self, hidden, n):  # the rest is missing
            raise NotImplementedError

    assert not isinstance(Half(), DecodeModel)


def test_the_round_uses_only_the_protocol():
    tree = ast.parse(Path(inspect.getfile(spec)).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "model"
    }
    assert used and used <= MEMBERS, sorted(used - MEMBERS)


def test_round_records_take_keywords_only():
    import dataclasses

    import pytest

    from engine.spec import RoundOutcome
    from engine.stats import RoundEvent

    for cls in (RoundEvent, RoundOutcome):
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
        with pytest.raises(TypeError):
            cls(0, [], "")
