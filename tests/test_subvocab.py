"""The draft's sub-vocab order (subvocab.json, engine/subvocab.py): read as untrusted input, used by the draft
with the pick mapped back to token ids on the device, never changing the text, built and shown by the command
line, and paying on the bundled model (frequency order keeps the tokens the draft needs)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from app.cli import main
from app.workloads import load_workloads
from engine import Engine, EngineSettings, bundled_model_dir
from engine.subvocab import FILE_NAME, SubVocabError, build_file, read_order

N_NEW = 24
GREEDY = EngineSettings(speculative=False)
VOCAB = 320  # the tiny test models'


def shuffled_order(k: int, seed: int = 1) -> list[int]:
    """k distinct ids of the tiny vocabulary in a random order: far from id order on purpose."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:k].tolist()


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    """A copy of the tiny model folder this test may write into."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def write_file(path, **fields):
    body = {"version": 1, "ids": [3, 1, 2]} | fields
    path.write_text(json.dumps(body))
    return path


# ---- the engine uses the order, and never changes the text -----------------------------------------------------
def test_draft_pick_scores_the_orders_rows_and_maps_back_on_the_device(eng):
    order = shuffled_order(200)
    eng.set_sub_vocab_order(order, "test")
    try:
        model = eng.model
        hidden = torch.randn(5, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        head = model.head.float()
        for n in (1, 7, 64, 200):
            tok, prob = model.draft_pick(hidden, n)
            scores = hidden @ head[order[:n]].T  # [5, n]: the order's rows only, in its order
            want = torch.tensor(order[:n])[scores.argmax(-1)]
            assert tok.tolist() == want.tolist(), n
            assert torch.allclose(prob, torch.softmax(scores, -1).amax(-1), atol=1e-6), n
            assert model.draft_ids(n).tolist() == order[:n]
        assert model.draft_ids(201) is None and model.draft_ids(0) is None  # past the order: id order, as before
        assert model.draft_pick(hidden, 250)[0].tolist() == (hidden @ head[:250].T).argmax(-1).tolist()
    finally:
        eng.set_sub_vocab_order(None)


@pytest.mark.parametrize("workload", ["code_gen", "prose"])
def test_speculation_with_an_order_is_plain_greedy(eng, prompts, workload):
    greedy = eng.generate(prompts[workload], N_NEW, GREEDY, eng.new_session()).tokens
    eng.set_sub_vocab_order(shuffled_order(200), "test")
    try:
        sess = eng.new_session()
        for sub in (1, 7, 64, 200, 250, 0):
            for depth, chain in ((1, True), (3, True), (5, True), (3, False)):
                out = eng.generate(
                    prompts[workload], N_NEW, EngineSettings(draft_depth=depth, chain=chain, sub_vocab=sub), sess
                )
                assert out.tokens == greedy, (sub, depth, chain)
                used = chain and 0 < sub <= 200
                assert out.stats["remap_size"] == 200
                assert (out.stats["remap_rounds"] == out.stats["rounds"]) if used else out.stats["remap_rounds"] == 0
    finally:
        eng.set_sub_vocab_order(None)
    assert eng.info["sub_vocab_order"]["size"] == 0


def test_an_order_changed_between_runs_is_used_at_once(eng, prompts):
    """A new order is a new plan key: nothing captured with the old order's tensors is reused."""
    ids = prompts["code_edit"]
    settings = EngineSettings(draft_depth=3, sub_vocab=40)
    sess = eng.new_session()
    tags = set()
    for order in (shuffled_order(40, 1), shuffled_order(60, 2), None):
        eng.set_sub_vocab_order(order)
        tags.add(eng.model.plan_tag)
        out = eng.generate(ids, 8, settings, sess)
        assert out.stats["remap_rounds"] == (out.stats["rounds"] if order else 0)
        assert eng.info["sub_vocab_order"]["size"] == (len(order) if order else 0)
    assert len(tags) == 3


def test_the_order_is_counted_in_memory(eng):
    base = eng.memory()["weights"]
    eng.set_sub_vocab_order(shuffled_order(100))
    try:
        # the gathered rows [100, H] and the ids [100] (fp32 and int64 on this CPU engine)
        assert eng.memory()["weights"] - base == 100 * eng.cfg.hidden_size * 4 + 100 * 8
    finally:
        eng.set_sub_vocab_order(None)
    assert eng.memory()["weights"] == base


def test_bad_orders_given_to_the_engine_are_refused(eng):
    for bad, match in (
        ([], "empty"),
        ([1, 2, 1], "listed twice"),
        ([0, VOCAB], "outside the model's vocabulary"),
        ([0, -1], "outside"),
        ([0, True], "not a token id"),
        ([0, 1.0], "not a token id"),
    ):
        with pytest.raises(SubVocabError, match=match):
            eng.set_sub_vocab_order(bad)
    assert eng.model.remap_size == 0


# ---- the file next to the model --------------------------------------------------------------------------------
def test_engine_load_reads_the_models_order(model_copy, prompts, eng):
    order = shuffled_order(150, 5)
    write_file(model_copy / FILE_NAME, ids=order, vocab_size=VOCAB, source="hand made")
    loaded = Engine.load(model_copy)
    info = loaded.info["sub_vocab_order"]
    assert info == {"size": 150, "source": "hand made", "file": str(model_copy / FILE_NAME), "notice": ""}
    assert loaded.model.draft_ids(150).tolist() == order
    ids = prompts["code_echo"]
    greedy = eng.generate(ids, N_NEW, GREEDY, eng.new_session()).tokens
    out = loaded.generate(ids, N_NEW, EngineSettings(draft_depth=4, sub_vocab=100))
    assert out.tokens == greedy and out.stats["remap_rounds"] == out.stats["rounds"]


BAD_FILES = [
    ("not json", "not valid JSON"),
    ('{"version": 1, "ids": [1, NaN]}', "not valid JSON"),
    ("[1, 2, 3]", "not a sub-vocab order"),
    ('{"version": 1}', "not a sub-vocab order"),
    ('{"version": 2, "ids": [1]}', "version 2 is not supported"),
    ('{"ids": [1]}', "version None is not supported"),
    ('{"version": 1, "vocab_size": 1000, "ids": [1]}', "built for a vocabulary of 1000 ids; this model has 320"),
    ('{"version": 1, "ids": "1,2,3"}', "must be a list"),
    ('{"version": 1, "ids": []}', "empty"),
    ('{"version": 1, "ids": [5, 6, 5]}', "id 5 is listed twice"),
    ('{"version": 1, "ids": [5, 320]}', r"ids\[1\] = 320 is outside the model's vocabulary 0..319"),
    ('{"version": 1, "ids": [5, -1]}', "outside"),
    ('{"version": 1, "ids": [5, "6"]}', "not a token id"),
    ('{"version": 1, "ids": [5, true]}', "not a token id"),
    ('{"version": 1, "ids": [5, 6.0]}', "not a token id"),
    ('{"version": 1, "ids": [5, 6], "size": 3}', "cut short or edited"),
    ('{"version": 1, "ids": [5], "source": 7}', "'source' must be text"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"version": 1, "ids": [' + ",".join(map(str, range(321))) + "]}", "more than the model's vocabulary"),
]


@pytest.mark.parametrize("text, problem", BAD_FILES, ids=range(len(BAD_FILES)))
def test_a_bad_file_is_reported_and_the_model_drafts_in_id_order(model_copy, text, problem, capsys):
    path = model_copy / FILE_NAME
    path.write_text(text)
    with pytest.raises(SubVocabError, match=problem) as err:
        read_order(path, VOCAB)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    loaded = Engine.load(model_copy)  # the model still loads: the order only ever changes speed
    warning = capsys.readouterr().err
    assert warning.startswith(f"specdeck: warning: {path}") and warning.count("\n") == 1
    assert "drafts in id order" in warning or "scores ids in id order" in warning
    assert "specdeck subvocab build" in warning and "--force" in warning  # what to do
    info = loaded.info["sub_vocab_order"]
    assert info["size"] == 0 and info["notice"] in warning
    assert path.read_text() == text  # nothing the user had is touched
    out = loaded.generate("def main():", 8, EngineSettings(sub_vocab=50))
    assert out.stats["remap_rounds"] == 0 and out.stats["remap_size"] == 0


def test_files_that_are_not_files_or_too_big_are_never_read(model_copy, capsys):
    path = model_copy / FILE_NAME
    path.mkdir()
    with pytest.raises(SubVocabError, match="is a folder"):
        read_order(path, VOCAB)
    path.rmdir()
    os.mkfifo(path)  # would block a naive open()
    with pytest.raises(SubVocabError, match="is a FIFO"):
        read_order(path, VOCAB)
    assert Engine.load(model_copy).model.remap_size == 0
    assert "FIFO" in capsys.readouterr().err
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(17 << 20)  # sparse: larger than the cap, never read
    with pytest.raises(SubVocabError, match="larger than 16 MiB"):
        read_order(path, VOCAB)
    path.unlink()
    path.symlink_to(model_copy / "missing.json")
    with pytest.raises(SubVocabError, match="not found"):
        read_order(path, VOCAB)


# ---- sampling: q rows over token ids, so the verify stays exact -------------------------------------------------
def test_sampled_draft_rows_are_scattered_to_token_ids(eng):
    from engine import SamplingParams

    order = shuffled_order(120, 7)
    eng.set_sub_vocab_order(order)
    try:
        sess = eng.new_session()
        sp = SamplingParams(temperature=3.0, seed=2)
        out = eng.generate("def main():", 6, EngineSettings(draft_depth=3, sub_vocab=90), sess, sampling=sp)
        assert out.stats["remap_rounds"] == out.stats["rounds"]
        q = sess.state.sampling_buffers.q_buf[:3]
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[order[:90]] = False
        assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)  # each row a distribution over token ids
        assert (q[:, outside] == 0).all()  # nothing outside the 90 scored ids
        drafts = sess.state.ids_buf[1:4]
        assert set(drafts.tolist()) <= set(order[:90])
        # the probability of each draft sits in its token id's column
        assert torch.allclose(q.gather(1, drafts[:, None])[:, 0], sess.state.probs_buf[:3])
    finally:
        eng.set_sub_vocab_order(None)


# ---- the command line ------------------------------------------------------------------------------------------
def test_cli_builds_shows_and_refuses_to_overwrite(model_copy, tmp_path, capsys, eng):
    sample = tmp_path / "sample.txt"
    sample.write_text("def main():\n    return 0\n" * 30 + "print(i)\n" * 5)
    path = model_copy / FILE_NAME
    assert main(["subvocab", "build", "--model", str(model_copy), "--text", str(sample), "--size", "100"]) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["format"] == "specdeck-subvocab" and data["version"] == 1 and data["vocab_size"] == VOCAB
    ids = data["ids"]
    assert len(ids) == 100 == len(set(ids)) and data["tokens_counted"] > 0
    assert ids[0] == 0  # the end-of-text id first, though the sample never contains it
    counts = {}
    for t in eng.tokenizer.encode(sample.read_text()):
        counts[t] = counts.get(t, 0) + 1
    by_count = sorted(counts, key=lambda t: (-counts[t], t))
    assert ids[1 : 1 + len(by_count)] == by_count  # then most frequent first
    rest = ids[1 + len(by_count) :]
    assert rest == sorted(rest) and not set(rest) & set(counts)  # then unseen ids, in id order
    assert not [p for p in model_copy.iterdir() if p.name.endswith(".tmp")]  # written atomically

    before = path.read_bytes()
    assert main(["subvocab", "build", "--model", str(model_copy), "--text", str(sample)]) == 2
    err = capsys.readouterr().err
    assert "already exists; pass --force" in err and err.count("\n") == 1
    assert path.read_bytes() == before
    assert main(["subvocab", "build", "--model", str(model_copy), "--text", str(sample), "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert len(json.loads(path.read_text())["ids"]) == VOCAB  # default size: 32768, or the whole vocabulary

    assert main(["subvocab", "show", "--model", str(model_copy), "--first", "3"]) == 0
    shown = capsys.readouterr().out
    assert f"{VOCAB} of {VOCAB} ids" in shown and "tokens of sample.txt" in shown
    assert "'<|endoftext|>'" in shown and shown.rstrip().count("\n") == 4 + 3

    out = tmp_path / "elsewhere.json"
    assert main(["subvocab", "build", "--model", str(model_copy), "--text", str(sample), "--out", str(out)]) == 0
    assert read_order(out, VOCAB).size == VOCAB
    assert Engine.load(model_copy).info["sub_vocab_order"]["size"] == VOCAB


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--size", "0"], "--size must be in 1..320"),
        (["--size", "321"], "--size must be in 1..320"),
        (["--text", "MISSING"], "text sample not found"),
        (["--text", "EMPTY"], "no tokens in the text sample"),
    ],
)
def test_cli_build_errors_are_one_line(model_copy, tmp_path, capsys, args, problem):
    sample = tmp_path / "sample.txt"
    sample.write_text("def main():\n")
    (tmp_path / "EMPTY").write_text("")
    args = [str(tmp_path / a) if a in ("MISSING", "EMPTY") else a for a in args]
    text = [] if "--text" in args else ["--text", str(sample)]
    assert main(["subvocab", "build", "--model", str(model_copy), *text, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdeck: error:") and problem in err and err.count("\n") == 1
    assert not (model_copy / FILE_NAME).exists()


def test_generate_and_bench_say_when_an_order_is_used(model_copy, capsys):
    write_file(model_copy / FILE_NAME, ids=shuffled_order(150), source="hand made")
    args = ["--model", str(model_copy), "-n", "6"]
    assert main(["generate", *args, "--prompt", "def main():", "--sub-vocab", "100"]) == 0
    assert "sub-vocab order of 150 ids" in capsys.readouterr().err
    assert main(["generate", *args, "--prompt", "def main():", "--sub-vocab", "151"]) == 0
    assert "sub-vocab order" not in capsys.readouterr().err  # past the order: not used, not claimed
    assert main(["bench", *args, "--workloads", "prose", "--rounds", "1", "--sub-vocab", "100"]) == 0
    assert (
        "Sub-vocab order: 150 ids (hand made); arms with sub_vocab 1..150 draft through it" in capsys.readouterr().out
    )


def test_cli_show_without_or_with_a_bad_file(model_copy, capsys):
    assert main(["subvocab", "show", "--model", str(model_copy)]) == 2
    err = capsys.readouterr().err
    assert "no sub-vocab order there" in err and "specdeck subvocab build" in err
    write_file(model_copy / FILE_NAME, ids=[1, 1])
    assert main(["subvocab", "show", "--model", str(model_copy)]) == 2
    assert "listed twice" in capsys.readouterr().err


# ---- it pays: the bundled model, workloads' text, 1/8 and 1/16 of the vocabulary ---------------------------------
def test_a_frequency_order_beats_id_order_on_the_bundled_model(tmp_path):
    """On the bundled model (16,384 ids) an order built from the four workloads' text keeps the tokens the draft
    needs: at 1/8 and 1/16 of the vocabulary the mean accepted length is higher than with the first N ids
    (measured: 1/8 4.13 vs 3.71, 1/16 4.06 vs 3.01, full vocabulary 4.20, depth 4, 64 tokens), and the text is
    the greedy text every time."""
    sample = tmp_path / "workloads.txt"
    sample.write_text("\n".join(t for w in load_workloads().values() for t in (w.prompt, w.chat)))
    out = tmp_path / FILE_NAME
    build_file(bundled_model_dir(), [sample], out=out)  # tmp only: the bundled folder is never written
    order = read_order(out, 16384)
    eng = Engine.load()
    assert eng.info["sub_vocab_order"]["size"] == 0  # the bundled model ships no order

    def mean_accepted(sub: int) -> tuple[float, dict[str, list[int]]]:
        rounds = generated = 0
        texts = {}
        for name, w in load_workloads().items():
            res = eng.generate(w.prompt, 64, EngineSettings(draft_depth=4, sub_vocab=sub), eng.new_session())
            rounds += res.stats["rounds"]
            generated += res.stats["generated"]
            texts[name] = res.tokens
        return generated / rounds, texts

    greedy = {
        name: eng.generate(w.prompt, 64, GREEDY, eng.new_session()).tokens for name, w in load_workloads().items()
    }
    full, _ = mean_accepted(0)
    for sub in (16384 // 8, 16384 // 16):
        eng.set_sub_vocab_order(None)
        prefix, texts_prefix = mean_accepted(sub)
        eng.set_sub_vocab_order(order.ids, order.source)
        remap, texts_remap = mean_accepted(sub)
        print(f"sub_vocab {sub}: id order {prefix:.2f}, frequency order {remap:.2f}, full {full:.2f}")
        assert texts_prefix == greedy == texts_remap
        assert remap > prefix + 0.2, (sub, remap, prefix)
        assert remap > full - 0.3  # close to the whole vocabulary's acceptance at 1/8 or 1/16 of its cost
