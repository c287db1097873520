"""Long prompts: the prefill runs in chunks carrying the KV cache and the recurrent state, so its memory
beyond the session's own buffers does not grow with the prompt as it did (an 8k prompt on the tiny model
took 2.1 GiB more peak memory than a 1k one); a context that cannot fit is refused before allocation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, EngineError, EngineSettings
from engine.state import session_bytes

PEAK = """
import resource, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from engine import Engine, EngineSettings
n = {n}
eng = Engine.load({model!r}, max_context=n + 64)
sess = eng.new_session()
ids = [(i * 7) % 300 + 1 for i in range(n)]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
eng.generate(ids, 2, EngineSettings(speculative=False), sess)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def _prefill_peak_bytes(model_dir: Path, n: int) -> int:
    """Peak memory a prefill of n tokens adds beyond the loaded model and its session (its own process)."""
    code = PEAK.format(tests=str(Path(__file__).parent), model=str(model_dir), n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("long") / "m", seed=0, max_position_embeddings=20000)


def test_an_8k_prompt_takes_bounded_extra_memory(long_model_dir):
    mib = 2**20
    short = _prefill_peak_bytes(long_model_dir, 1024)
    long = _prefill_peak_bytes(long_model_dir, 8192)
    # Unchunked, the 8k prefill's attention scores alone were 4 heads x 8192 x 8192 fp32 = 1 GiB (2.1 GiB
    # peak measured); chunked, what grows with the prompt is one block of query rows against the keys.
    assert long < 256 * mib, (short / mib, long / mib)


def test_chunked_prefill_gives_the_same_tokens_as_one_pass(long_model_dir, monkeypatch):
    """A prompt longer than a chunk (2048 + 451 tokens): the same greedy tokens as feeding it in one pass,
    and speculation on top of it still exactly greedy."""
    from engine import spec

    eng = Engine.load(long_model_dir, max_context=3000)
    ids = [(i * 11) % 300 + 1 for i in range(2500)]
    greedy = eng.generate(ids, 16, EngineSettings(speculative=False), eng.new_session()).tokens
    chunked = eng.generate(ids, 16, EngineSettings(draft_depth=3), eng.new_session()).tokens
    monkeypatch.setattr(spec, "PREFILL_CHUNK", 10_000)  # one pass over the whole prompt
    whole = eng.generate(ids, 16, EngineSettings(draft_depth=3), eng.new_session()).tokens
    assert chunked == whole == greedy


def test_an_impossible_context_is_refused_before_allocation_in_one_line(tiny_model_dir):
    eng = Engine.load(tiny_model_dir, max_context=2**40)
    need = sum(session_bytes(eng.model.cfg, eng.model.dtype, 2**40, eng.n_planes, eng.model.has_mtp).values())
    with pytest.raises(EngineError) as err:
        eng.new_session()
    message = str(err.value)
    assert "\n" not in message and "GiB is free" in message and "smaller max_context" in message
    assert f"{need / 2**30:,.1f} GiB" in message
    fits = Engine.load(tiny_model_dir, max_context=4096).new_session()
    counted = {k: sum(t.numel() * t.element_size() for t in v) for k, v in fits.state.buffers().items()}
    estimate = session_bytes(fits.state.cfg, torch_dtype(), 4096, fits.state.n_planes, True)
    assert estimate["kv_cache"] == counted["kv_cache"] and estimate["snapshot_planes"] == counted["snapshot_planes"]


def torch_dtype():
    import torch

    return torch.float32
