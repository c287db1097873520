"""Faults and long, random use: every output stays plain greedy; a failure stops one run only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineError, EngineSettings

N_MAX = 12


@pytest.fixture(scope="module")
def oracle(eng):
    """Plain greedy decoding, memoised: (prompt tuple, n) -> tokens."""
    cache: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = eng.generate(prompt, n, EngineSettings(speculative=False), eng.new_session()).tokens
        return cache[key]

    return greedy


knobs = st.builds(
    EngineSettings,
    speculative=st.booleans(),
    draft_depth=st.integers(1, 8),
    p_min=st.sampled_from([0.0, 0.2, 0.5, 0.9]),
    chain=st.booleans(),
    sub_vocab=st.sampled_from([0, 64, 200, 320]),
    plan_pool=st.integers(0, 8),
)
step = st.tuples(
    st.integers(0, 2),  # which session
    st.sampled_from(["new", "continue", "extend"]),  # how the prompt relates to the session
    st.integers(1, 6),  # a seed for the new prompt
    st.integers(1, N_MAX),  # tokens to generate
    st.lists(knobs, min_size=1, max_size=4),  # settings, changed round by round
    st.one_of(st.none(), st.integers(0, 3)),  # cancel after this many rounds
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=2, max_size=6))
def test_random_use_is_always_greedy(eng, oracle, steps):
    sessions = [eng.new_session() for _ in range(3)]
    for which, how, seed, n, changes, cancel_after in steps:
        sess = sessions[which]
        if how == "new" or not sess.tokens:
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(1, 300, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        elif how == "continue":
            prompt = sess.tokens
        else:
            prompt = sess.tokens + [seed * 7 % 300 + 1]
        out = []
        for i, ev in enumerate(eng.stream(prompt, n, changes[0], sess)):
            out += ev.tokens
            sess.settings = changes[(i + 1) % len(changes)]
            if cancel_after is not None and i == cancel_after:
                sess.cancel()
        assert out == oracle(prompt, n)[: len(out)]
        assert sess.tokens == prompt + out
        if cancel_after is None:
            assert len(out) == n


def test_engine_error_mid_run_stops_that_run_only(tiny_model_dir, monkeypatch):
    eng = Engine.load(tiny_model_dir)
    prompt = list(range(3, 20))
    want = eng.generate(prompt, 20, EngineSettings(speculative=False), eng.new_session()).tokens
    sess = eng.new_session()
    calls = {"n": 0}
    real = eng.model.forward_layers

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated kernel fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward_layers", flaky)
    got = []
    with pytest.raises(EngineError, match="simulated kernel fault") as info:
        for ev in eng.stream(prompt, 20, EngineSettings(draft_depth=3), sess):
            got += ev.tokens
    assert "kept its text" in str(info.value)
    assert sess.tokens == prompt + got  # what was emitted before the fault is kept
    rest = eng.generate(sess.tokens, 20 - len(got), EngineSettings(draft_depth=3), sess)
    assert got + rest.tokens == want  # the session goes on, re-prefilled, still lossless


def test_out_of_memory_mid_run_is_reported_and_session_reusable(tiny_model_dir, monkeypatch):
    eng = Engine.load(tiny_model_dir)
    sess = eng.new_session()
    real = eng.model.forward_layers
    state = {"fail": True}

    def oom(*args, **kwargs):
        if state["fail"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward_layers", oom)
    with pytest.raises(EngineError, match="out of memory"):
        eng.generate("def main():", 8, EngineSettings(), sess)
    state["fail"] = False
    sess.reset()
    assert len(eng.generate("def main():", 8, EngineSettings(), sess).tokens) == 8


def test_cupy_missing_falls_back_with_a_notice(monkeypatch, capsys):
    from engine import engine as engine_mod
    from kernels import ops

    monkeypatch.setattr(ops, "use_cuda_kernels", lambda enable: (False, "CuPy is not installed"))
    monkeypatch.setattr(ops, "cuda_enabled", lambda: False)
    notice = engine_mod._enable_kernels(torch.device("cuda"))
    err = capsys.readouterr().err
    assert "CuPy is not installed" in notice
    assert err.count("\n") == 1 and "using the PyTorch reference ops" in err


def test_kernels_module_imports_without_cuda():
    from kernels import ops

    enabled, reason = ops.use_cuda_kernels(True) if not torch.cuda.is_available() else (False, "skip")
    if not torch.cuda.is_available():
        assert not enabled and reason
        assert not ops.cuda_enabled()


def test_out_of_memory_at_load_is_one_line(tiny_model_dir, monkeypatch):
    from engine import engine as engine_mod

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(engine_mod, "load_weights", oom)
    with pytest.raises(EngineError, match="does not fit"):
        Engine.load(tiny_model_dir)


def test_too_large_a_context_is_reported_not_crashed(tiny_model_dir):
    eng = Engine.load(tiny_model_dir, max_context=2**40)
    with pytest.raises(EngineError, match="smaller max_context"):
        eng.new_session()
    small = Engine.load(tiny_model_dir, max_context=256)
    assert len(small.generate("def", 4).tokens) == 4
