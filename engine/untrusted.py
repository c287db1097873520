"""Reading files that came from elsewhere: a downloaded model folder, a hand-edited profile.

Each read is bounded before anything is parsed: the path must name a regular file (a FIFO, a device
or a folder is refused from os.stat, so nothing blocks or streams forever), its size must be under a
cap, and the read itself stops one byte past the cap (a file that grows while being read). Symlinks are
followed on purpose: the Hugging Face cache links every file of a model folder to a blob.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n} bytes"


def is_regular_file(path: Path) -> bool:
    """True for a regular file (through symlinks); False for anything else or nothing there."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def exists(path: Path) -> bool:
    """Something is at `path` (a dangling symlink counts: it is reported, not taken for 'missing')."""
    try:
        os.lstat(path)
        return True
    except (OSError, ValueError):
        return False


def check_regular(path: Path, what: str, error: type[Exception]) -> os.stat_result:
    """os.stat of `path`, raising `error` (one line) unless it is a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found (or a broken link)") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: {what} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; replace it with the real file")
    return st


def read_capped(path: Path, cap: int, what: str, error: type[Exception]) -> bytes:
    """The bytes of a regular file of at most `cap` bytes, or `error` with one line naming the file."""
    st = check_regular(path, what, error)
    too_big = f"{path}: {what} is larger than {_size(cap)}, far more than such a file needs; it is not read"
    if st.st_size > cap:
        raise error(too_big)
    try:
        # O_NONBLOCK: should the file be swapped for a FIFO after the stat, opening it does not wait.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise error(f"{path}: {what} cannot be read ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path}: {what} is not a regular file; replace it with the real file")
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(cap + 1 - total, 4 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(f"{path}: {what} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if total > cap:
        raise error(too_big)
    return b"".join(chunks)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(path: Path, cap: int, what: str, error: type[Exception]) -> Any:
    """Parse a capped JSON file (UTF-8; NaN/Infinity refused; deep nesting refused), errors in one line."""
    data = read_capped(path, cap, what, error)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid JSON (not UTF-8 text: byte {exc.start})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise error(f"{path}: not valid JSON ({one_line(exc)})") from None


def one_line(exc: BaseException | str, limit: int = 300) -> str:
    """The first line of an exception's text, cut to `limit` characters."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


class OutOfTime(BaseException):
    """Raised inside `time_limit` at its deadline (a BaseException: no `except Exception` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stop pure-Python work (e.g. tomllib, which is quadratic on long dotted keys) after `seconds`: a trace
    function checks the clock on every 256th function call and raises OutOfTime. C code is not interrupted;
    what runs there must be bounded by size caps. The caller's trace function is put back afterwards."""
    deadline = time.monotonic() + seconds
    calls = 0

    def tracer(frame, event, arg):
        nonlocal calls
        calls += 1
        if not calls & 255 and time.monotonic() > deadline:
            raise OutOfTime
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
