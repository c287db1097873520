"""CPU tests of the default-model training pipeline (tools/train_*.py) and of the bundled model's files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))

import train_corpus  # noqa: E402
import train_tokenizer as tt  # noqa: E402

BUNDLED = REPO / "assets" / "models" / "specdeck-tiny"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE_ROOTS = [("stdlib", STDLIB / "email"), ("stdlib", STDLIB / "json"), ("stdlib", STDLIB / "logging")]


def _sample_corpus():
    return train_corpus.collect_corpus(
        roots=SAMPLE_ROOTS, code_cap_bytes=250_000, prose_cap_bytes=120_000, seed=0, workers=1, log=lambda m: None
    )


@pytest.fixture(scope="module")
def corpus():
    c = _sample_corpus()
    assert len(c.train) > 20 and c.stats["train_code_bytes"] > 100_000 and c.stats["train_prose_bytes"] > 50_000
    return c


@pytest.fixture(scope="module")
def built(corpus):
    texts = [d.text for d in corpus.train]
    return tt.build_tokenizer(texts, texts, 1200, log=lambda m: None)


# ------------------------------------------------------------------------------------------------------ corpus
def test_corpus_is_deterministic(corpus):
    again = _sample_corpus()
    assert [(d.path, d.kind, d.text) for d in again.train] == [(d.path, d.kind, d.text) for d in corpus.train]
    assert [d.path for d in again.heldout] == [d.path for d in corpus.heldout]
    assert [d.path for d in corpus.train] == sorted(d.path for d in corpus.train)


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_corpus_dedup_filters_split_and_docstrings(tmp_path):
    body = "def f(x):\n    return x + 1\n" * 10
    doc_src = '"""Module docstring that explains a lot of things about this module, at length."""\n' + (
        'def g():\n    """A function docstring long enough to be kept by the extractor."""\n    return 1\n' * 3
    )
    _write(tmp_path / "pkg" / "a.py", body)
    _write(tmp_path / "pkg" / "copy_of_a.py", body)  # duplicate content
    _write(tmp_path / "pkg" / "nul.py", body + "\x00")  # binary
    _write(tmp_path / "pkg" / "long.py", body + "x = '" + "y" * 2000 + "'\n")  # minified / data
    _write(tmp_path / "pkg" / "tiny.py", "x = 1\n")  # too small
    _write(tmp_path / "pkg" / "latin1.txt", ("caf\xe9 " * 60).encode("latin-1"))  # not UTF-8
    _write(tmp_path / "pkg" / "README.md", "# Title\r\n\r\n" + "Some prose about the package. " * 20)
    _write(tmp_path / "pkg" / "zz_docs.py", doc_src + "\n" + body.replace("f(", "h("))
    c = train_corpus.collect_corpus(
        roots=[("site-packages", tmp_path)],
        code_cap_bytes=10**6,
        prose_cap_bytes=10**6,
        heldout_mod=1,
        workers=1,
        log=lambda m: None,
    )
    docs = {d.path: d for d in c.train + c.heldout}
    assert c.train == []  # heldout_mod=1: every file is held out
    code = sorted(p for p, d in docs.items() if d.kind == "code")
    assert len(code) == 2 and code[1] == "site-packages/pkg/zz_docs.py"
    assert code[0] in ("site-packages/pkg/a.py", "site-packages/pkg/copy_of_a.py")  # one of the duplicates
    assert c.stats["duplicates_dropped"] == 1
    readme = docs["site-packages/pkg/README.md"]
    assert readme.kind == "prose" and "\r" not in readme.text
    for bad in ("nul.py", "long.py", "tiny.py", "latin1.txt"):
        assert not any(p.endswith(bad) for p in docs), bad
    # with no room for code, Python files contribute their docstrings as prose
    c0 = train_corpus.collect_corpus(
        roots=[("site-packages", tmp_path)], code_cap_bytes=0, prose_cap_bytes=10**6, workers=1, log=lambda m: None
    )
    docs0 = {d.path: d for d in c0.train + c0.heldout}
    assert not any(d.kind == "code" for d in docs0.values())
    ds = docs0["site-packages/pkg/zz_docs.py#docstrings"]
    assert ds.kind == "prose" and ds.text.startswith("Module docstring") and "return" not in ds.text
    assert "site-packages/pkg/a.py#docstrings" not in docs0  # no docstrings, no document
    # the held-out split is by path, and a docstring document follows its source file
    c50 = train_corpus.collect_corpus(
        roots=[("site-packages", tmp_path)],
        code_cap_bytes=10**6,
        prose_cap_bytes=10**6,
        heldout_mod=50,
        workers=1,
        log=lambda m: None,
    )
    for d in c50.heldout:
        assert train_corpus.is_heldout(d.path.split("#")[0], 50)
    for d in c50.train:
        assert not train_corpus.is_heldout(d.path.split("#")[0], 50)


# --------------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_training_is_deterministic(corpus, built):
    texts = [d.text for d in corpus.train]
    tok2, enc2, counts2 = tt.build_tokenizer(texts, texts, 1200, log=lambda m: None)
    first = tt.tokenizer_json(built[0])
    assert tt.tokenizer_json(tok2) == first
    assert np.array_equal(built[2], counts2)
    # and in a fresh process (other hash seeds in Python and Rust)
    code = (
        f"import sys, hashlib; sys.path.insert(0, {str(TOOLS)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_default_model_training as t, train_tokenizer as tt\n"
        "c = t._sample_corpus(); x = [d.text for d in c.train]\n"
        "tok, _, _ = tt.build_tokenizer(x, x, 1200, log=lambda m: None)\n"
        "print(hashlib.sha256(tt.tokenizer_json(tok).encode()).hexdigest())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == hashlib.sha256(first.encode()).hexdigest()


def test_ids_ordered_by_frequency(corpus, built):
    tok, encoded, counts = built
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == 1200
    assert tok.token_to_id(tt.EOT) == 0
    b2u = tt.bytes_to_unicode()
    assert [tok.token_to_id(b2u[b]) for b in range(256)] == list(range(1, 257))
    rest = counts[257:]
    assert rest[0] > 0 and np.all(rest[:-1] >= rest[1:]), "ids after the bytes must be by descending frequency"
    # the counts are those of the final ids: re-encoding with the saved tokenizer gives the same numbers
    texts = [d.text for d in corpus.train]
    re_enc = tt.encode_docs(tok, texts)
    assert all(np.array_equal(a, b) for a, b in zip(re_enc, encoded))
    assert np.array_equal(tt.count_ids(re_enc, size), counts)
    # the saved tokenizer.json is standard: merges are string pairs, the vocab is re-numbered
    d = json.loads(tt.tokenizer_json(tok))
    assert d["model"]["type"] == "BPE" and d["pre_tokenizer"]["type"] == "ByteLevel"
    assert d["decoder"]["type"] == "ByteLevel"
    assert all(isinstance(m, (list, str)) for m in d["model"]["merges"])
    assert sorted(d["model"]["vocab"].values()) == list(range(size))
    assert d["added_tokens"][0]["content"] == tt.EOT and d["added_tokens"][0]["id"] == 0


def test_round_trip_and_special_token(built):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tt.tokenizer_json(built[0]))
    for text in ("def f(x):\n\treturn {'a': [1, 2]}  # ok\n", "Ünïcødé ✓ 中文 🙂\r\n", "  lead and trail  ", ""):
        assert tok.decode(tok.encode(text).ids) == text
    ids = tok.encode("end" + tt.EOT + "next").ids
    assert ids.count(0) == 1
    assert tok.id_to_token(0) == tt.EOT


def test_renumbering_preserves_encoding(corpus):
    texts = [d.text for d in corpus.train][:30]
    base = tt.train_bpe(texts, 600)
    counts = tt.count_ids(tt.encode_docs(base, texts), base.get_vocab_size())
    perm = tt.frequency_order(base, counts)
    new = tt.renumber(base, perm)
    tt.check_renumbering(base, new, perm, texts[:5])
    assert sorted(perm.tolist()) == list(range(base.get_vocab_size()))
    # a wrong permutation (two used, merged tokens swapped) is caught
    used = sorted({i for t in texts[:5] for i in base.encode(t).ids if perm[i] > 256})
    a, b = used[0], used[1]
    wrong = perm.copy()
    wrong[[a, b]] = wrong[[b, a]]
    with pytest.raises(AssertionError):
        tt.check_renumbering(base, new, wrong, texts[:5])


# ------------------------------------------------------------------------------------------------- model / MTP
pytest.importorskip("transformers")
import train_model as tm  # noqa: E402


def _tiny_cfg(vocab=300):
    return tm.config_dict(
        vocab,
        hidden_size=64,
        layer_types=(tm.LINEAR, tm.FULL, tm.LINEAR),
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )


def _randomise(*modules, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in modules:
            for p in mod.parameters():
                if p.ndim == 1:  # norms (zero-centred), A_log, dt_bias: make them matter
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def tiny():
    cfg = _tiny_cfg()
    model = tm.build_target(cfg, 0)
    torch.manual_seed(1)
    mtp = tm.MTPHead(model.config)
    _randomise(model, mtp)
    tm.round_to_bf16_(model, mtp)
    model.eval()
    mtp.eval()
    return cfg, model, mtp


EXPECTED_MTP = {
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
    "mtp.layers.0.mlp.gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight",
    "mtp.layers.0.mlp.down_proj.weight",
}


def test_export_names_shards_and_transformers_load(tiny, tmp_path):
    from safetensors import safe_open

    cfg, model, mtp = tiny
    limit = 160 * 1024
    index = tm.export_model(tmp_path, model, mtp, cfg, '{"dummy": true}', max_shard_bytes=limit)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2, "the small limit must force several shards"
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    seen: dict[str, str] = {}
    total = 0
    for s in shards:
        assert s.stat().st_size <= limit
        with safe_open(str(s), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(k)
                assert t.dtype == torch.bfloat16
                seen[k] = s.name
                total += t.numel() * 2
    assert index["weight_map"] == seen and index["metadata"]["total_size"] == total
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index and set(on_disk) == {"metadata", "weight_map"}
    names = set(seen)
    assert "lm_head.weight" not in names and not any(k.startswith("model.layers") for k in names)
    assert {k for k in names if k.startswith("mtp.")} == EXPECTED_MTP
    target = {"model.language_model." + k[len("model.") :] for k in model.state_dict() if k != "lm_head.weight"}
    assert {k for k in names if not k.startswith("mtp.")} == target
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in names
    H = cfg["hidden_size"]
    with safe_open(str(tmp_path / seen["mtp.fc.weight"]), "pt") as f:
        assert tuple(f.get_tensor("mtp.fc.weight").shape) == (H, 2 * H)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3_5ForCausalLM"] and conf["model_type"] == "qwen3_5_text"
    assert conf["mtp_num_hidden_layers"] == 1 and conf["eos_token_id"] == 0 and conf["tie_word_embeddings"] is True
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 0
    # transformers loads the target part (no missing keys) with the same logits; the MTP reloads exactly
    ids = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    check = tm.verify_export(tmp_path, model, mtp, ids)
    assert check["max_abs_logit_diff_target"] <= 1e-4 and check["max_abs_logit_diff_mtp"] <= 1e-4


def test_export_rejects_a_tensor_over_the_limit(tiny, tmp_path):
    cfg, model, mtp = tiny
    with pytest.raises(ValueError):
        tm.write_shards(tm.export_tensors(model, mtp), tmp_path, max_shard_bytes=64 * 1024 + 1000)


def _norm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def _rope(x, pos, rot, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    ang = pos * inv
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    xr = x[..., :rot]
    half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return torch.cat([xr * cos + half * sin, x[..., rot:]], -1)


def _mtp_step(mtp, cfg, x, pos, cache):
    """One MTP row computed the way an engine does it: x [H] at RoPE position pos, cache list of (k, v)."""
    L = mtp.layers[0]
    a = L.self_attn
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rot = int(hd * cfg["rope_parameters"]["partial_rotary_factor"])
    h = _norm(x, L.input_layernorm.weight)
    qg = (a.q_proj.weight @ h).view(nh, 2 * hd)
    q, gate = qg[:, :hd], qg[:, hd:].reshape(-1)
    q = _rope(_norm(q, a.q_norm.weight), pos, rot)
    k = _rope(_norm((a.k_proj.weight @ h).view(nkv, hd), a.k_norm.weight), pos, rot)
    v = (a.v_proj.weight @ h).view(nkv, hd)
    cache.append((k, v))
    K = torch.stack([c[0] for c in cache])  # [n, nkv, hd]
    V = torch.stack([c[1] for c in cache])
    out = []
    for head in range(nh):
        kv = head // (nh // nkv)
        s = (K[:, kv] @ q[head]) * hd**-0.5
        out.append(torch.softmax(s, 0) @ V[:, kv])
    o = torch.cat(out) * torch.sigmoid(gate)
    x = x + a.o_proj.weight @ o
    m = _norm(x, L.post_attention_layernorm.weight)
    x = x + L.mlp.down_proj.weight @ (torch.nn.functional.silu(L.mlp.gate_proj.weight @ m) * (L.mlp.up_proj.weight @ m))
    return _norm(x, mtp.norm.weight)


def test_mtp_semantics_match_an_incremental_reference(tiny):
    """The parallel training forward equals row-by-row decoding with a KV cache, for the first draft step and for
    the chained step (hidden = previous y, one position further, attending to rows 0..r and itself)."""
    cfg, model, mtp = tiny
    T = 9
    ids = torch.randint(0, cfg["vocab_size"], (1, T + 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        (_, l1, l2), (_, t1, t2) = tm.forward_all(model, mtp, ids, chain=True)
        h = model.model(input_ids=ids[:, :T], use_cache=False).last_hidden_state[0]
        E = model.model.embed_tokens.weight
        for r in range(T):
            cache = []
            y = None
            for j in range(r + 1):  # rows 0..r of the first step
                e = _norm(E[ids[0, j + 1]], mtp.pre_fc_norm_embedding.weight)
                hn = _norm(h[j], mtp.pre_fc_norm_hidden.weight)
                y = _mtp_step(mtp, cfg, mtp.fc.weight @ torch.cat([e, hn]), j, cache)
            logits1 = E @ y
            assert torch.allclose(logits1, l1[0, r], atol=1e-4), r
            e2 = _norm(E[ids[0, r + 2]], mtp.pre_fc_norm_embedding.weight)
            y2 = _mtp_step(
                mtp, cfg, mtp.fc.weight @ torch.cat([e2, _norm(y, mtp.pre_fc_norm_hidden.weight)]), r + 1, cache
            )
            assert torch.allclose(E @ y2, l2[0, r], atol=1e-4), r
    assert torch.equal(t1[0], ids[0, 2 : T + 2]) and torch.equal(t2[0], ids[0, 3 : T + 3])


def test_mtp_layer_matches_transformers_decoder_layer(tiny):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    cfg, model, mtp = tiny
    hf_cfg = model.config
    hf_cfg._attn_implementation = "eager"
    layer = q.Qwen3_5DecoderLayer(hf_cfg, hf_cfg.layer_types.index(tm.FULL))
    layer.load_state_dict(mtp.layers[0].state_dict())
    layer.eval()
    T = 7
    x = torch.randn(2, T, cfg["hidden_size"], generator=torch.Generator().manual_seed(2))
    rope = q.Qwen3_5TextRotaryEmbedding(hf_cfg)
    pos = torch.arange(T)[None, None, :].expand(3, 2, T)
    cos_sin = rope(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
    with torch.no_grad():
        ref = layer(x, position_embeddings=cos_sin, attention_mask=mask)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ours, _ = mtp.layer_forward(x, torch.arange(T))
    assert torch.allclose(ours, ref, atol=1e-5)


def test_lr_schedule():
    assert tm.lr_at(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert tm.lr_at(9, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert tm.lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    vals = [tm.lr_at(s, 100, 1.0, 10, 0.1) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_batches_cover_the_stream():
    import train_default_model as tdm

    stream = torch.arange(1000, dtype=torch.int32)
    b = tdm.Batches(stream, seq=16, batch=4, seed=0)
    starts = []
    for _ in range(b.n // 4):
        w = b.next()
        assert w.shape == (4, 19) and torch.equal(w[:, 1:] - w[:, :-1], torch.ones(4, 18, dtype=torch.long))
        starts.extend(w[:, 0].tolist())
    assert len(set(starts)) == len(starts) and all(s % 16 == 0 for s in starts)


# ---------------------------------------------------------------------------------------------- bundled model
@pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="bundled model not exported yet")
def test_bundled_model_files():
    from tokenizers import Tokenizer

    files = [p for p in BUNDLED.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 48_000_000
    index = json.loads((BUNDLED / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    for s in shards:
        assert (BUNDLED / s).stat().st_size <= 15 * 1024 * 1024
    assert {k for k in index["weight_map"] if k.startswith("mtp.")} == EXPECTED_MTP
    assert "lm_head.weight" not in index["weight_map"]
    conf = json.loads((BUNDLED / "config.json").read_text())
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    assert tok.get_vocab_size() == conf["vocab_size"] and tok.token_to_id(tt.EOT) == conf["eos_token_id"] == 0
    layer_types = conf["layer_types"]
    assert layer_types.count(tm.LINEAR) >= 2 and tm.FULL in layer_types
    card = (BUNDLED / "MODEL_CARD.md").read_text()
    assert "held-out" in card and "MTP accuracy" in card and "python tools/train_default_model.py" in card

    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32, output_loading_info=True)
    assert [k for k in info["missing_keys"] if k != "lm_head.weight"] == []
    ids = torch.tensor([tok.encode("def main():\n    return 0\n").ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(logits).all()
