"""The gemm autotune cache: which product (cuBLAS or a gemv kernel variant) was fastest for a weight shape and
row bucket on a GPU, so that `gemm="auto"` measures each only once per machine.

One JSON file, `gemm_tune.json` in the cache folder: `$SPECDECK_CACHE_DIR` when set, else the platform's user
cache folder for "specdeck" (platformdirs when installed, else $XDG_CACHE_HOME or ~/.cache), or a folder the
caller names. Its content:

    {"format": "specdeck-gemm-tune", "version": 1,
     "entries": {"<key>": {"choice": "tc1.w8.s1", "us": {"cublas": 12.1, "tc1.w8.s1": 9.8, ...}}, ...}}

A key names everything a timing depends on: GPU name, torch and CUDA versions, the gemv kernels' source hash,
dtype, weight shape and row bucket (`cache_key`). The file is untrusted input: a bounded read of a regular file,
every entry checked (a key of at most 400 printable characters, a choice that is "cublas" or a valid variant
name, timings that are finite non-negative numbers); entries of the wrong types are skipped. A file that cannot
be used at all (not JSON, another format or version, too large, not a regular file) is rebuilt: one notice line
on stderr (also in `notice`, shown in Engine.info), its entries measured again, the file replaced. Writes are
atomic (a temporary file in the same folder, then os.replace) and merge with what another process wrote since.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kernels.ops import parse_gemv_variant

from .untrusted import MiB, exists, load_json, one_line

CACHE_DIR_ENV = "SPECDECK_CACHE_DIR"
FILE_NAME = "gemm_tune.json"
FORMAT = "specdeck-gemm-tune"
VERSION = 1
MAX_BYTES = 4 * MiB
MAX_ENTRIES = 20000
MAX_KEY = 400


class TuneCacheError(Exception):
    pass


def default_cache_dir() -> Path:
    """$SPECDECK_CACHE_DIR, else the user cache folder of "specdeck" (without importing the application)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    try:
        import platformdirs
    except ImportError:  # a GPU image without the application's dependencies
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "specdeck"
    return Path(platformdirs.user_cache_dir("specdeck"))


def cache_file(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache file in `cache_dir` (None: `default_cache_dir()`)."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / FILE_NAME


def cache_key(gpu: str, dtype: torch.dtype | str, n: int, k: int, bucket: str, kernels: str) -> str:
    """The key of one measurement: GPU name, torch and CUDA versions, gemv kernels' source hash, dtype, weight
    shape [n, k] and row bucket."""
    dt = str(dtype).replace("torch.", "")
    return f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|gemv {kernels}|{dt}|{n}x{k}|{bucket}"


def valid_choice(choice: object) -> bool:
    return choice == "cublas" or parse_gemv_variant(choice) is not None


def _entry(key: object, value: object) -> dict[str, Any] | None:
    """The checked entry, or None when it is not one (wrong types, bad names)."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isprintable():
        return None
    if not isinstance(value, dict) or not valid_choice(value.get("choice")):
        return None
    out: dict[str, Any] = {"choice": value["choice"]}
    times = value.get("us")
    if isinstance(times, dict) and len(times) <= 64:
        kept = {
            c: float(t)
            for c, t in times.items()
            if valid_choice(c)
            and isinstance(t, (int, float))
            and not isinstance(t, bool)
            and math.isfinite(t)
            and t >= 0
        }
        if kept:
            out["us"] = kept
    return out


class TuneCache:
    """The autotune cache file at `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.notice = ""  # one line: why the file was not used (rebuilt), or could not be written
        self.entries: dict[str, dict[str, Any]] = {}
        self._dirty = False
        if path is not None:
            self.entries = self._read(report=True)

    def _read(self, report: bool) -> dict[str, dict[str, Any]]:
        path = self.path
        if path is None or not exists(path):
            return {}
        try:
            data = load_json(path, MAX_BYTES, "gemm autotune cache", TuneCacheError)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise TuneCacheError(f"{path}: not a SpecDeck gemm autotune cache")
            version = data.get("version")
            if version != VERSION or isinstance(version, bool):
                raise TuneCacheError(f"{path}: written by another version of SpecDeck (version {ascii(version)[:20]})")
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise TuneCacheError(f"{path}: its entries are not a table")
        except TuneCacheError as exc:
            if report:
                self._say(f"{one_line(exc)}; it is rebuilt (the products are measured again)")
            return {}
        kept: dict[str, dict[str, Any]] = {}
        for key, value in entries.items():
            entry = _entry(key, value)
            if entry is not None and len(kept) < MAX_ENTRIES:
                kept[key] = entry
        return kept

    def _say(self, notice: str) -> None:
        self.notice = notice
        print(f"specdeck: notice: {notice}", file=sys.stderr)

    def get(self, key: str) -> str | None:
        entry = self.entries.get(key)
        return entry["choice"] if entry else None

    def put(self, key: str, choice: str, times: dict[str, float] | None = None) -> None:
        entry = _entry(key, {"choice": choice, "us": times or {}})
        if entry is None:
            raise ValueError(f"not a cache entry: {key!r} -> {choice!r}")
        self.entries[key] = entry
        self._dirty = True

    def save(self) -> None:
        """Write the entries (merged over what the file holds now, if it is usable) atomically. A failure to
        write is a notice, never an error: the choices stay in memory for this run."""
        if self.path is None or not self._dirty:
            return
        merged = self._read(report=False)
        merged.update(self.entries)
        while len(merged) > MAX_ENTRIES:
            merged.pop(next(iter(merged)))
        text = json.dumps({"format": FORMAT, "version": VERSION, "entries": merged}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            self._dirty = False
        except OSError as exc:
            self._say(f"{self.path}: the gemm autotune cache cannot be written ({exc.strerror or exc})")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
