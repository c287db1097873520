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


def test_chunked_prefill_gives_the_same_tokens_as_one_pass(long_model_dir):
    """A prompt longer than a chunk (2048 + 451 tokens): the same greedy tokens as feeding it in one pass or
    in 64-token passes (the prefill_chunk setting), and speculation on top of it still exactly greedy."""
    eng = Engine.load(long_model_dir, max_context=3000)
    ids = [(i * 11) % 300 + 1 for i in range(2500)]
    greedy = eng.generate(ids, 16, EngineSettings(speculative=False), eng.new_session()).tokens
    chunked = eng.generate(ids, 16, EngineSettings(draft_depth=3), eng.new_session()).tokens
    whole = eng.generate(ids, 16, EngineSettings(draft_depth=3, prefill_chunk=4096), eng.new_session()).tokens
    small = eng.generate(ids, 16, EngineSettings(draft_depth=3, prefill_chunk=64), eng.new_session()).tokens
    assert chunked == whole == small == greedy


def test_the_prefill_chunk_setting_sets_the_passes_a_prompt_takes(long_model_dir, monkeypatch):
    """prefill_chunk is one EngineSettings field (a knob: CLI flag, window control and tooltip come from its
    metadata) and its use in the engine: a 1000-token prompt is read in ceil(999 / chunk) passes."""
    from engine import EngineSettings as S
    from engine.settings import knobs

    assert "prefill_chunk" in {k.name for k in knobs()}
    eng = Engine.load(long_model_dir, max_context=2000)
    passes = []
    real = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda ids, state: passes.append(len(ids)) or real(ids, state))
    ids = [(i * 7) % 300 + 1 for i in range(1000)]
    for chunk, expected in ((64, 16), (256, 4), (2048, 1)):
        passes.clear()
        eng.generate(ids, 2, S(speculative=False, prefill_chunk=chunk), eng.new_session())
        assert len(passes) == expected and max(passes) <= chunk, (chunk, passes)
    with pytest.raises(ValueError, match="prefill_chunk must be in 64..65536, got 8"):
        S(prefill_chunk=8)


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


def test_max_context_defaults_to_the_models_trained_length(long_model_dir, tiny_model_dir, tmp_path):
    eng = Engine.load(long_model_dir)  # config.json: max_position_embeddings 20000
    assert eng.max_context == 20000 and eng.info["max_context"] == 20000
    assert "trained length" in eng.info["context_note"]
    assert Engine.load(long_model_dir, max_context=3000).max_context == 3000  # asked for: kept
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("max_position_embeddings", None)
    (bare / "config.json").write_text(json.dumps(cfg))
    assert Engine.load(bare).max_context == 4096  # the config does not say: the default


def test_the_default_context_is_cut_to_what_a_quarter_of_the_free_memory_holds(long_model_dir, monkeypatch):
    """A trained length whose session would not fit: the longest multiple of 1024 that a quarter of the free
    memory holds (a second session, the Bench tab's, fits beside it), said in one line with the sizes."""
    from engine import engine as engine_module

    ref = Engine.load(long_model_dir, max_context=20000)
    full = sum(session_bytes(ref.model.cfg, ref.model.dtype, 20000, ref.n_planes, True).values())
    monkeypatch.setattr(engine_module, "free_bytes", lambda device: 2 * full)  # a quarter: half a full session
    eng = Engine.load(long_model_dir)
    assert 1024 <= eng.max_context < 20000 and eng.max_context % 1024 == 0
    need = sum(session_bytes(eng.model.cfg, eng.model.dtype, eng.max_context, eng.n_planes, True).values())
    assert (
        need
        <= full // 2
        < sum(session_bytes(eng.model.cfg, eng.model.dtype, eng.max_context + 1024, eng.n_planes, True).values())
    )
    note = eng.info["context_note"]
    assert "\n" not in note and "of the model's 20,000" in note and "GiB is free" in note
    eng.new_session()  # and a session of it is made


def test_a_bad_trained_length_in_config_json_is_a_clear_error(tiny_model_dir, tmp_path):
    import json
    import shutil

    from engine import ModelLoadError

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["max_position_embeddings"] = -5
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="max_position_embeddings must be an integer in 0"):
        Engine.load(bad)


@pytest.mark.gpu
def test_speculative_equals_greedy_past_100k_positions_on_the_gpu():
    """Verify rows past 100k positions (decode attention split over the whole cache, KV and delta-net state
    rolled back after each rejection) stay lossless: the bundled model in fp32 on a 100k-token prompt,
    speculative (chain, depth 3 and 5) == plain greedy."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine import bundled_model_dir

    n = 100_000
    eng = Engine.load(bundled_model_dir(), device="cuda", dtype="float32", max_context=n + 256)
    prompt = eng.tokenizer.encode("def f(x):\n    return x + 1\n" * 12_000)[:n]
    assert len(prompt) == n
    sess = eng.new_session()
    greedy = eng.generate(prompt, 64, EngineSettings(speculative=False, plan_pool=8), sess).tokens
    for depth in (3, 5):
        sess.reset()
        out = eng.generate(prompt, 64, EngineSettings(draft_depth=depth, chain=True, plan_pool=8), sess)
        assert out.tokens == greedy, depth
        assert out.stats["accepted"] > 0  # rounds really verified drafts at these positions
