"""The draft's sub-vocabulary order (FR-Spec style): which token ids the draft head scores, most frequent first.

With `sub_vocab` N the draft head scores N ids instead of the whole vocabulary. Without an order those are
ids 0..N-1; a tokenizer's id order is not its frequency order, so a model folder may hold an order:

    subvocab.json   {"format": "specdeck-subvocab", "version": 1, "vocab_size": 248320,
                     "source": "...", "tokens_counted": 1234567, "ids": [13, 11, 279, ...]}

`ids` (required): K distinct token ids, 1 <= K <= vocab_size, most useful first; `version` (required): 1;
`vocab_size` and `size` (optional): the vocabulary it was built for and K, which must match; `source` and
`tokens_counted` (optional): where it came from; other keys are ignored. With an order of K ids and 0 < N <= K the draft scores
ids[:N] (the engine gathers those K rows of the LM head once at load: K x hidden x 2 bytes in bf16, e.g.
512 MiB for K = 64k on a 4096-wide model); N > K or N = 0 scores ids 0..N-1 or everything, as without one.
The target always verifies against the whole vocabulary, so the order changes speed, never text.

The file is untrusted input (engine/untrusted.py): a bounded read, then every id checked. A bad file does not
stop a model from loading: the engine says what is wrong with it in one warning and drafts in id order (the
file is left as it is). `specdeck subvocab build` makes one from a text sample (`build_file`), `specdeck
subvocab show` describes one (`describe`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import EngineError
from .files import replace_file
from .untrusted import MiB, check_regular, exists, load_json, one_line

FILE_NAME = "subvocab.json"
FORMAT = "specdeck-subvocab"
VERSION = 1
MAX_FILE_BYTES = 16 * MiB  # 248k ids take ~1.7 MiB
MAX_SOURCE_CHARS = 500
MAX_TEXT_BYTES = 1 << 30  # a text sample to count; a few MiB of representative text is plenty
TEXT_CHUNK_CHARS = 1 << 20  # characters tokenized at a time (cut at a line end)
DEFAULT_SIZE = 32768


class SubVocabError(EngineError):
    """A sub-vocab order file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class SubVocabOrder:
    ids: tuple[int, ...]  # distinct token ids, most useful first
    source: str = ""  # where it came from (one line)
    path: Path | None = None  # the file it was read from, if any
    tokens_counted: int | None = None

    @property
    def size(self) -> int:
        return len(self.ids)


def fix_hint(model_dir: Path | str) -> str:
    return f"rebuild it with `specdeck subvocab build --model {model_dir} --text FILE --force`, or remove it"


def check_ids(ids: object, vocab_size: int, where: str) -> tuple[int, ...]:
    """`ids` as a tuple of distinct token ids of a `vocab_size` vocabulary, at least one; else SubVocabError
    naming `where` and the first bad entry."""
    if not isinstance(ids, (list, tuple)):
        raise SubVocabError(f"{where}: 'ids' must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise SubVocabError(f"{where}: the ids list is empty; it needs at least one token id")
    if len(ids) > vocab_size:
        raise SubVocabError(f"{where}: {len(ids)} ids listed, more than the model's vocabulary of {vocab_size}")
    seen: dict[int, int] = {}
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise SubVocabError(f"{where}: ids[{i}] is {ascii(t)[:40]}, not a token id (an integer)")
        if not 0 <= t < vocab_size:
            raise SubVocabError(f"{where}: ids[{i}] = {t} is outside the model's vocabulary 0..{vocab_size - 1}")
        if t in seen:
            raise SubVocabError(f"{where}: id {t} is listed twice (ids[{seen[t]}] and ids[{i}])")
        seen[t] = i
    return tuple(ids)


def read_order(path: Path, vocab_size: int) -> SubVocabOrder:
    """Read and check a sub-vocab order file for a model of `vocab_size` ids (SubVocabError on any problem)."""
    data = load_json(path, MAX_FILE_BYTES, "sub-vocab order", SubVocabError)
    if not isinstance(data, dict) or "ids" not in data:
        raise SubVocabError(f"{path}: not a sub-vocab order (a JSON object with an 'ids' list)")
    version = data.get("version")
    if version != VERSION:
        raise SubVocabError(
            f"{path}: sub-vocab order version {ascii(version)[:20]} is not supported (this SpecDeck reads {VERSION})"
        )
    built_for = data.get("vocab_size")
    if built_for is not None and built_for != vocab_size:
        raise SubVocabError(
            f"{path}: built for a vocabulary of {ascii(built_for)[:20]} ids; this model has {vocab_size}"
        )
    source = data.get("source", "")
    if not isinstance(source, str):
        raise SubVocabError(f"{path}: 'source' must be text, got {type(source).__name__}")
    counted = data.get("tokens_counted")
    if counted is not None and (type(counted) is not int or counted < 0):
        raise SubVocabError(f"{path}: 'tokens_counted' must be an integer >= 0, got {ascii(counted)[:20]}")
    ids = check_ids(data["ids"], vocab_size, str(path))
    size = data.get("size")
    if size is not None and size != len(ids):
        raise SubVocabError(f"{path}: says 'size' {ascii(size)[:20]} but lists {len(ids)} ids (cut short or edited?)")
    return SubVocabOrder(ids, one_line(source, MAX_SOURCE_CHARS) if source else "", path, counted)


def find_order(model_dir: Path, vocab_size: int) -> SubVocabOrder | None:
    """The model folder's order, None when it has no subvocab.json (SubVocabError when it has a bad one)."""
    path = model_dir / FILE_NAME
    return read_order(path, vocab_size) if exists(path) else None


# ---- building one ---------------------------------------------------------------------------------------------
def _text_chunks(path: Path):
    """The text of a sample file in pieces of about TEXT_CHUNK_CHARS characters, each cut after a line end (so no
    word is split between two pieces); bytes that are not UTF-8 become U+FFFD."""
    st = check_regular(path, "text sample", SubVocabError)
    if st.st_size > MAX_TEXT_BYTES:
        raise SubVocabError(f"{path}: text sample is larger than {MAX_TEXT_BYTES // MiB} MiB; use a smaller sample")
    read = 0
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            pending: list[str] = []
            size = 0
            for line in f:
                read += len(line)
                if read > MAX_TEXT_BYTES:  # a file that grew while being read
                    raise SubVocabError(f"{path}: text sample is larger than {MAX_TEXT_BYTES // MiB} MiB")
                pending.append(line)
                size += len(line)
                if size >= TEXT_CHUNK_CHARS:
                    yield "".join(pending)
                    pending, size = [], 0
            if pending:
                yield "".join(pending)
    except OSError as exc:
        raise SubVocabError(f"{path}: text sample cannot be read ({exc.strerror or exc})") from None


def count_ids(encode, texts) -> Counter:
    """How often each token id occurs in the texts (each tokenized with `encode`: str -> list[int])."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(encode(text))
    return counts


def build_order(counts: Counter, vocab_size: int, size: int, keep: list[int] | tuple[int, ...] = ()) -> list[int]:
    """An order of `size` ids: `keep` first (special and end-of-text ids: a draft must be able to propose them),
    then the counted ids, most frequent first (ties in id order), then ids never seen, in id order, up to size."""
    if not 1 <= size <= vocab_size:
        raise SubVocabError(f"the size must be in 1..{vocab_size} (the model's vocabulary), got {size}")
    out: list[int] = []
    taken: set[int] = set()

    def add(t: int) -> None:
        if 0 <= t < vocab_size and t not in taken and len(out) < size:
            taken.add(t)
            out.append(t)

    for t in sorted(set(keep)):
        add(t)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        add(t)
    t = 0
    while len(out) < size and t < vocab_size:
        add(t)
        t += 1
    return out


def write_order(path: Path, order: SubVocabOrder, vocab_size: int, force: bool = False) -> None:
    """Write an order file atomically (a temporary file beside it, then a rename): a reader never sees half a
    file. An existing file is replaced only with `force`."""
    if exists(path) and not force:
        raise SubVocabError(f"{path}: already exists; pass --force to replace it")
    body = {
        "format": FORMAT,
        "version": VERSION,
        "vocab_size": vocab_size,
        "source": order.source,
        "tokens_counted": order.tokens_counted,
        "size": order.size,
    }
    text = json.dumps(body, ensure_ascii=True)[:-1] + ', "ids": ' + json.dumps(list(order.ids)) + "}\n"
    try:
        replace_file(path, text.encode("ascii"))
    except OSError as exc:
        raise SubVocabError(f"{path}: cannot write the sub-vocab order ({exc.strerror or exc})") from None


def _model_parts(model_dir: Path):
    from .config import ModelConfig
    from .tokenizer import Tokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SubVocabError(f"{model_dir}: not a model directory")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    return cfg, Tokenizer(model_dir, cfg.eos_token_ids)


def build_file(
    model_dir: Path | str,
    texts: list[Path | str],
    size: int | None = None,
    out: Path | str | None = None,
    force: bool = False,
) -> tuple[Path, SubVocabOrder]:
    """Tokenize text samples with the model's tokenizer, count the ids and write the order (`size` ids, default
    min(32768, vocabulary)) to `out` (default: subvocab.json in the model folder). Returns (path, order)."""
    model_dir = Path(model_dir)
    cfg, tok = _model_parts(model_dir)
    vocab = cfg.vocab_size
    size = min(DEFAULT_SIZE, vocab) if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab:
        raise SubVocabError(f"--size must be in 1..{vocab} (the model's vocabulary), got {size!r}")
    path = Path(out) if out is not None else model_dir / FILE_NAME
    if exists(path) and not force:  # before the counting, which may take a while
        raise SubVocabError(f"{path}: already exists; pass --force to replace it")
    paths = [Path(t) for t in texts]
    if not paths:
        raise SubVocabError("give at least one text sample (--text FILE)")
    counts: Counter = Counter()
    for p in paths:
        counts += count_ids(tok.encode, _text_chunks(p))
    total = sum(counts.values())
    if total == 0:
        raise SubVocabError(f"{', '.join(map(str, paths))}: no tokens in the text sample; use a file with text in it")
    keep = sorted(tok.eos_token_ids | set(tok.special_ids()))
    ids = build_order(counts, vocab, size, keep)
    names = ", ".join(p.name for p in paths)
    source = (
        f"specdeck subvocab build: {total:,} tokens of {names} ({len(counts):,} distinct ids); "
        f"{len(keep)} special id(s) first, then by count, then unseen ids in id order"
    )
    order = SubVocabOrder(tuple(ids), one_line(source, MAX_SOURCE_CHARS), path, total)
    write_order(path, order, vocab, force)
    return path, order


def describe(model_dir: Path | str, path: Path | str | None = None, first: int = 20) -> str:
    """A few lines on a model's sub-vocab order: file, size, source, memory, the first ids decoded."""
    model_dir = Path(model_dir)
    cfg, tok = _model_parts(model_dir)
    file = Path(path) if path is not None else model_dir / FILE_NAME
    if not exists(file):
        raise SubVocabError(
            f"{file}: no sub-vocab order there (the draft scores ids in id order); build one with "
            f"`specdeck subvocab build --model {model_dir} --text FILE`"
        )
    order = read_order(file, cfg.vocab_size)
    k, v, h = order.size, cfg.vocab_size, cfg.hidden_size
    lines = [
        f"file     {file}",
        f"size     {k:,} of {v:,} ids ({100 * k / v:.1f}% of the vocabulary)",
        f"source   {order.source or '(not given)'}",
        f"memory   {k:,} x {h:,} head rows gathered at load: {k * h * 2 / MiB:,.1f} MiB in bf16",
        f"first {min(first, k)} ids:",
    ]
    for rank, t in enumerate(order.ids[:first], 1):
        lines.append(f"  {rank:>4}. {t:>7}  {ascii(tok.decode_one(t))}")
    return "\n".join(lines)
