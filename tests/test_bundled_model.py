"""The bundled model: transformers agrees with the engine, and speculation on it is lossless (CPU, fp32).

It drafts well (unlike random tiny models), so many accepted counts and rollbacks are exercised."""

from __future__ import annotations

import pytest
import torch

from app.workloads import load_workloads
from engine import Engine, EngineSettings, bundled_model_dir

N_NEW = 48


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine.load()  # no model given: the bundled one


def test_bundled_model_is_the_default(eng):
    assert eng.model_dir == bundled_model_dir()
    assert eng.model.has_mtp and eng.cfg.vocab_size == 16384


def test_transformers_logits_match_engine(eng):
    transformers = pytest.importorskip("transformers")
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(eng.model_dir, dtype=torch.float32).eval()
    ids = eng.tokenizer.encode(load_workloads()["code_edit"].prompt)[:80]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (eng.logits(ids) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("workload", ["code_gen", "code_edit", "code_echo", "prose"])
def test_speculative_identical_to_greedy(eng, workload):
    prompt = load_workloads()[workload].prompt_for(eng.tokenizer)
    sess = eng.new_session()
    greedy = eng.generate(prompt, N_NEW, EngineSettings(speculative=False), sess).tokens
    accepted = 0
    for depth, chain, p_min in [(1, True, 0.0), (3, True, 0.0), (5, False, 0.5), (8, True, 0.5), (8, False, 0.0)]:
        sess.reset()
        res = eng.generate(prompt, N_NEW, EngineSettings(draft_depth=depth, chain=chain, p_min=p_min), sess)
        assert res.tokens == greedy, (depth, chain, p_min)
        accepted += res.stats["accepted"]
    assert accepted > 0  # the MTP head really drafts on this model


def test_acceptance_is_real_on_code_echo(eng):
    prompt = load_workloads()["code_echo"].prompt_for(eng.tokenizer)
    s = eng.generate(prompt, 64, EngineSettings(draft_depth=3), eng.new_session()).stats
    assert s["mean_accepted_length"] >= 2.0


def test_streamed_text_pieces_add_up_to_the_whole_text(eng):
    for w in load_workloads().values():
        prompt = w.prompt_for(eng.tokenizer)
        events = list(eng.stream(prompt, N_NEW, EngineSettings(draft_depth=4), eng.new_session()))
        tokens = [t for ev in events for t in ev.tokens]
        assert "".join(ev.text for ev in events) == eng.tokenizer.decode(tokens)
    pieces = [eng.tokenizer.encode("é ü → ✓ 日本")]  # multi-byte characters split across tokens
    from engine.engine import _StreamText

    stream = _StreamText(eng.tokenizer)
    assert "".join(stream.add([t]) for t in pieces[0]) == "é ü → ✓ 日本"


def test_streamed_text_of_a_line_that_never_ends_adds_up_and_decodes_a_bounded_window(eng):
    from engine.engine import _StreamText

    # one long line (no line break): words, multi-byte characters split across tokens, runs of spaces
    text = " ".join(f"w{i} é→✓ 日本  x{i * 7}" for i in range(120))
    ids = eng.tokenizer.encode(text)
    assert len(ids) > 4 * _StreamText.WINDOW
    for chunk in (1, 3, 6):  # target-only rounds and speculative rounds of several tokens
        stream = _StreamText(eng.tokenizer)
        pieces, longest = [], 0
        for i in range(0, len(ids), chunk):
            pieces.append(stream.add(ids[i : i + chunk]))
            longest = max(longest, len(stream.line))
        assert "".join(pieces) == eng.tokenizer.decode(ids), chunk
        # never the whole line: the window, a round's tokens, and a character's bytes split over tokens still waiting
        assert longest <= _StreamText.WINDOW + chunk + 4, (chunk, longest)
