"""Byte-level BPE tokenizer for the bundled default model, with ids ordered by corpus frequency.

Training uses the `tokenizers` library (ByteLevel pre-tokenizer and decoder, GPT-2 style). Afterwards the
vocabulary is re-numbered: the special tokens first (`<|endoftext|>` = 0), then the 256 single-byte tokens in byte
order (id 1 + byte value), then every other token by descending frequency on the training corpus (ties: the
original id), so that "the first N ids" are the N most common tokens. Merges stay string pairs, so only the ids
change; `check_renumbering` verifies that encoding is the same up to the id permutation and that decoding
round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
SPECIAL_TOKENS = (EOT,)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(texts: Sequence[str], vocab_size: int, max_token_length: int = 32) -> Tokenizer:
    """Train a byte-level BPE on `texts` (one document each). Deterministic for the same texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_docs(tok: Tokenizer, texts: Sequence[str], batch: int = 2048) -> list[np.ndarray]:
    """Encode documents (special-token strings inside a document are plain text), one int32 array each."""
    tok.encode_special_tokens = True
    try:
        out: list[np.ndarray] = []
        for start in range(0, len(texts), batch):
            encs = tok.encode_batch_fast(list(texts[start : start + batch]), add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int32) for e in encs)
        return out
    finally:
        tok.encode_special_tokens = False


def count_ids(encoded: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in encoded:
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def frequency_order(tok: Tokenizer, counts: np.ndarray) -> np.ndarray:
    """perm[old_id] = new_id: specials, then the 256 byte tokens in byte order, then by descending count."""
    vocab = tok.get_vocab(with_added_tokens=True)
    size = len(vocab)
    if counts.shape[0] < size:
        counts = np.concatenate([counts, np.zeros(size - counts.shape[0], dtype=counts.dtype)])
    specials = [vocab[s] for s in SPECIAL_TOKENS]
    b2u = bytes_to_unicode()
    byte_ids = [vocab[b2u[b]] for b in range(256)]
    fixed = specials + byte_ids
    fixed_set = set(fixed)
    rest = [i for i in range(size) if i not in fixed_set]
    rest.sort(key=lambda i: (-int(counts[i]), i))
    order = fixed + rest  # order[new_id] = old_id
    if sorted(order) != list(range(size)):
        raise ValueError("vocabulary ids are not contiguous")
    perm = np.empty(size, dtype=np.int64)
    perm[np.asarray(order)] = np.arange(size)
    return perm


def renumber(tok: Tokenizer, perm: np.ndarray) -> Tokenizer:
    """A tokenizer identical to `tok` except that token old_id is now perm[old_id]."""
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    new_vocab = {t: int(perm[i]) for t, i in vocab.items()}
    d["model"]["vocab"] = dict(sorted(new_vocab.items(), key=lambda kv: kv[1]))
    for added in d.get("added_tokens", []):
        added["id"] = int(perm[added["id"]])
    d["added_tokens"] = sorted(d.get("added_tokens", []), key=lambda a: a["id"])
    return Tokenizer.from_str(json.dumps(d, ensure_ascii=False))


def check_renumbering(old: Tokenizer, new: Tokenizer, perm: np.ndarray, samples: Sequence[str]) -> None:
    """Raise if the renumbered tokenizer does not encode as perm[old ids] or does not round-trip."""
    if new.token_to_id(EOT) != 0:
        raise AssertionError(f"{EOT} must be id 0, got {new.token_to_id(EOT)}")
    b2u = bytes_to_unicode()
    for b in range(256):
        if new.token_to_id(b2u[b]) != 1 + b:
            raise AssertionError(f"byte {b} must be id {1 + b}")
    for text in samples:
        o = old.encode(text, add_special_tokens=False).ids
        n = new.encode(text, add_special_tokens=False).ids
        if [int(perm[i]) for i in o] != n:
            raise AssertionError("renumbered tokenizer encodes differently")
        if new.decode(n, skip_special_tokens=False) != text:
            raise AssertionError("renumbered tokenizer does not round-trip")
    eot = new.encode("a" + EOT + "b", add_special_tokens=False).ids
    if 0 not in eot:
        raise AssertionError(f"{EOT} is not encoded as one special token")


def tokenizer_json(tok: Tokenizer) -> str:
    """The standard (pretty) tokenizer.json text; byte-identical for the same tokenizer."""
    return tok.to_str(pretty=True)


def build_tokenizer(
    train_texts: Sequence[str],
    sample_texts: Sequence[str],
    vocab_size: int,
    log=print,
) -> tuple[Tokenizer, list[np.ndarray], np.ndarray]:
    """Train on `sample_texts`, count on `train_texts`, renumber. Returns (tokenizer, encoded train docs in new
    ids, counts indexed by new id)."""
    base = train_bpe(sample_texts, vocab_size)
    size = base.get_vocab_size(with_added_tokens=True)
    encoded = encode_docs(base, train_texts)
    counts_old = count_ids(encoded, size)
    perm = frequency_order(base, counts_old)
    tok = renumber(base, perm)
    check_renumbering(base, tok, perm, [t[:2000] for t in sample_texts[:: max(1, len(sample_texts) // 64)]])
    encoded = [perm[e].astype(np.int32) for e in encoded]
    counts = np.zeros(size, dtype=np.int64)
    counts[perm] = counts_old
    log(
        f"tokenizer: vocab {size}, {int(counts.sum())} training tokens, "
        f"{sum(len(t) for t in train_texts) / max(1, int(counts.sum())):.2f} chars/token"
    )
    return tok, encoded, counts
