"""Corpus for the bundled default model: text that any Python installation has locally.

Code documents are Python source files of the standard library and of the installed packages; prose documents
are their markdown / reStructuredText / plain-text files plus the docstrings of Python files that were not taken
as code. Nothing is downloaded.

Rules (all deterministic, so the same installation gives the same corpus):
- files are walked in sorted order; symlinks are not followed; each real file is read once;
- a file is kept if it decodes as UTF-8, has no NUL byte, is 128 B .. 256 KiB and has no line over 1000 characters;
  CRLF becomes LF;
- duplicates are dropped by the SHA-256 of the (normalised) content; the first file in sampling order wins;
- the held-out split is by file: blake2b(relative path) mod `heldout_mod` == 0 (a docstring document follows the
  split of its source file);
- the size caps keep the files with the smallest blake2b(seed, relative path) first (a deterministic pseudo-random
  sample across packages), and the final document order is sorted by relative path.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import site
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CODE_EXTS = (".py",)
PROSE_EXTS = (".md", ".rst", ".txt")
SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules"}
MIN_BYTES = 128
MAX_BYTES = 256 * 1024
MAX_LINE = 1000


@dataclass(frozen=True)
class Document:
    path: str  # relative, labelled path ("stdlib/json/decoder.py", "site-packages/numpy/README.md", ...#docstrings)
    kind: str  # "code" | "prose"
    text: str


@dataclass
class Corpus:
    train: list[Document]
    heldout: list[Document]
    stats: dict = field(default_factory=dict)


def default_roots() -> list[tuple[str, Path]]:
    """(label, directory) pairs: the standard library, then every site-packages directory, no overlaps."""
    roots: list[tuple[str, Path]] = []
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        roots.append(("stdlib", Path(stdlib)))
    sp: list[str] = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            sp.append(p)
    with contextlib.suppress(AttributeError):  # virtualenv's old site.py has no getsitepackages
        sp.extend(site.getsitepackages())
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user:
        sp.append(user)
    seen: set[str] = set()
    for p in sp:
        rp = os.path.realpath(p)
        if rp in seen or not os.path.isdir(rp):
            continue
        seen.add(rp)
        roots.append(("site-packages", Path(p)))
    return roots


def _walk(label: str, root: Path, exclude: list[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    root_s = str(root)
    for dirpath, dirnames, filenames in os.walk(root_s, followlinks=False):
        real = os.path.realpath(dirpath)
        keep = []
        for d in sorted(dirnames):
            if d in SKIP_DIRS or d.startswith("."):
                continue
            full = os.path.realpath(os.path.join(dirpath, d))
            if any(full == e or full.startswith(e + os.sep) for e in exclude):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            if not f.lower().endswith(CODE_EXTS + PROSE_EXTS):
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(os.path.join(real, f), os.path.realpath(root_s))
            out.append((f"{label}/{rel.replace(os.sep, '/')}", full))
    return out


def list_files(roots: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """Sorted (relative labelled path, absolute path) of candidate files; each real file once."""
    real_roots = [os.path.realpath(str(r)) for _, r in roots]
    files: list[tuple[str, str]] = []
    seen_real: set[str] = set()
    for i, (label, root) in enumerate(roots):
        if not os.path.isdir(root):
            continue
        # a root that contains a later root (the stdlib holds site-packages) must not walk into it
        exclude = [r for j, r in enumerate(real_roots) if j != i and r.startswith(real_roots[i] + os.sep)]
        for rel, full in _walk(label, root, exclude):
            if os.path.islink(full):
                continue
            real = os.path.realpath(full)
            if real in seen_real:
                continue
            seen_real.add(real)
            files.append((rel, full))
    files.sort()
    return files


def read_text(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        if size < MIN_BYTES or size > MAX_BYTES:
            return None
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    if max((len(line) for line in text.split("\n")), default=0) > MAX_LINE:
        return None
    if not text.strip():
        return None
    return text


def extract_docstrings(source: str) -> str:
    """Module, class and function docstrings of a Python source, in source order, separated by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    parts: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                parts.append((getattr(node, "lineno", 0), doc.strip()))
    parts.sort(key=lambda p: p[0])
    return "\n\n".join(d for _, d in parts)


def _docstrings_of_file(args: tuple[str, str]) -> tuple[str, str]:
    rel, full = args
    text = read_text(full)
    return rel, extract_docstrings(text) if text else ""


def path_hash(s: str, salt: str = "") -> int:
    return int.from_bytes(hashlib.blake2b((salt + s).encode("utf-8"), digest_size=8).digest(), "little")


def is_heldout(rel: str, mod: int) -> bool:
    return path_hash(rel) % mod == 0


def collect_corpus(
    roots: list[tuple[str, Path]] | None = None,
    code_cap_bytes: int = 100_000_000,
    prose_cap_bytes: int = 40_000_000,
    heldout_mod: int = 50,
    seed: int = 0,
    workers: int | None = None,
    log=print,
) -> Corpus:
    roots = roots if roots is not None else default_roots()
    files = list_files(roots)
    salt = f"specdeck-corpus-{seed}:"
    code_files = [f for f in files if f[0].lower().endswith(CODE_EXTS)]
    prose_files = [f for f in files if f[0].lower().endswith(PROSE_EXTS)]
    log(
        f"corpus: {len(files)} candidate files ({len(code_files)} .py, {len(prose_files)} prose) under "
        + ", ".join(f"{lab}={root}" for lab, root in roots)
    )

    seen_hash: set[bytes] = set()

    def dedup_ok(text: str) -> bool:
        h = hashlib.sha256(text.encode("utf-8")).digest()
        if h in seen_hash:
            return False
        seen_hash.add(h)
        return True

    # code: read in sampling order until the cap
    order = sorted(code_files, key=lambda f: (path_hash(f[0], salt), f[0]))
    code_docs: list[Document] = []
    code_bytes = 0
    not_code: list[tuple[str, str]] = []
    dup = rejected = 0
    for rel, full in order:
        if code_bytes >= code_cap_bytes:
            not_code.append((rel, full))
            continue
        text = read_text(full)
        if text is None:
            rejected += 1
            continue
        if not dedup_ok(text):
            dup += 1
            continue
        code_docs.append(Document(rel, "code", text))
        code_bytes += len(text.encode("utf-8"))

    # prose: documentation files first (all of them, capped), then docstrings of .py files not taken as code
    prose_docs: list[Document] = []
    prose_bytes = 0
    for rel, full in sorted(prose_files, key=lambda f: (path_hash(f[0], salt), f[0])):
        if prose_bytes >= prose_cap_bytes:
            break
        text = read_text(full)
        if text is None:
            rejected += 1
            continue
        if not dedup_ok(text):
            dup += 1
            continue
        prose_docs.append(Document(rel, "prose", text))
        prose_bytes += len(text.encode("utf-8"))
    doc_files_bytes = prose_bytes
    if prose_bytes < prose_cap_bytes and not_code:
        batch = 4096
        workers = workers or max(1, min(16, os.cpu_count() or 1))
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(not_code), batch):
                if prose_bytes >= prose_cap_bytes:
                    break
                chunk = not_code[start : start + batch]
                for rel, doc in pool.map(_docstrings_of_file, chunk, chunksize=64):
                    if prose_bytes >= prose_cap_bytes:
                        break
                    if len(doc) < MIN_BYTES or not dedup_ok(doc):
                        continue
                    prose_docs.append(Document(rel + "#docstrings", "prose", doc))
                    prose_bytes += len(doc.encode("utf-8"))

    docs = sorted(code_docs + prose_docs, key=lambda d: d.path)
    train: list[Document] = []
    heldout: list[Document] = []
    for d in docs:
        (heldout if is_heldout(d.path.split("#", 1)[0], heldout_mod) else train).append(d)

    def nbytes(ds, kind=None):
        return sum(len(d.text.encode("utf-8")) for d in ds if kind is None or d.kind == kind)

    stats = {
        "roots": [f"{lab}={root}" for lab, root in roots],
        "candidate_files": len(files),
        "duplicates_dropped": dup,
        "files_rejected": rejected,
        "code_docs": len(code_docs),
        "code_bytes": code_bytes,
        "prose_docs": len(prose_docs),
        "prose_doc_file_bytes": doc_files_bytes,
        "prose_docstring_bytes": prose_bytes - doc_files_bytes,
        "prose_bytes": prose_bytes,
        "train_docs": len(train),
        "train_bytes": nbytes(train),
        "train_code_bytes": nbytes(train, "code"),
        "train_prose_bytes": nbytes(train, "prose"),
        "heldout_docs": len(heldout),
        "heldout_bytes": nbytes(heldout),
        "heldout_mod": heldout_mod,
        "code_cap_bytes": code_cap_bytes,
        "prose_cap_bytes": prose_cap_bytes,
        "seed": seed,
    }
    log(
        f"corpus: train {len(train)} docs {stats['train_bytes'] / 1e6:.1f} MB "
        f"(code {stats['train_code_bytes'] / 1e6:.1f} MB, prose {stats['train_prose_bytes'] / 1e6:.1f} MB), "
        f"held-out {len(heldout)} docs {stats['heldout_bytes'] / 1e6:.1f} MB, {dup} duplicates dropped"
    )
    return Corpus(train, heldout, stats)
