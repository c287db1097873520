"""Writing a file so that a reader sees the old one or the new one, never half: the bytes go to a temp file in
the same folder (a rename is atomic only within one file system), which is fsynced, then renamed over the
target, and the folder is fsynced so the rename survives a power cut. Used by the engine's sub-vocab order
files and by the application's profiles; failures are the caller's OSError to turn into its own message."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_temp_beside(path: Path, data: bytes) -> str:
    """`data` in a new fsynced temp file in `path`'s folder; returns its name (removed again on failure)."""
    # A short prefix: `path.name` may already be near the file-name limit.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:24]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    return tmp_name


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable, where the platform lets a folder be opened."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still done
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def move_into_place(tmp_name: str, path: Path) -> None:
    """Rename a temp file from write_temp_beside over `path` (the temp is removed if that fails)."""
    try:
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def replace_file(path: Path, data: bytes) -> None:
    """Replace (or create) `path` with `data` atomically; an OSError leaves the old file as it was."""
    move_into_place(write_temp_beside(path, data), path)
