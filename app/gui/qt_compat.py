"""A guard against a reference-counting bug of PySide6 6.12.0 on Python 3.11.

Seen on this project's machines (PySide6-Essentials 6.12.0, CPython 3.11.7): every Python-side
`signal.emit()` drops one reference to True, and every Python slot called from C++ (a QTimer's
timeout, a queued signal) drops one reference to None. In Python 3.11 these singletons are
ordinary refcounted objects, so after a few thousand signals the interpreter aborts with
"Fatal Python error: bool_dealloc / none_dealloc". PySide6 6.11.3 does not do this, and from
Python 3.12 on None / True / False are immortal, so a lost reference is harmless there.

When (and only when) the bug is detected, we give None, True and False 2**40 extra references:
they are never freed anyway, and at a few thousand lost references a second it would take
years to use them up. Pinning PySide6 != 6.12.0 or running on Python >= 3.12 makes this a no-op.
"""

from __future__ import annotations

import ctypes
import sys

EXTRA_REFERENCES = 1 << 40
_applied = False


def emit_loses_references() -> bool:
    """True when emitting a signal drops a reference to True (the 6.12.0 bug)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(8):
        probe.ping.emit()
    return sys.getrefcount(True) < before


def guard_singleton_refcounts() -> bool:
    """Apply the guard if this PySide6 / Python needs it. Returns whether it was applied."""
    global _applied
    if _applied:
        return True
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False  # immortal singletons: nothing can run out
    if not emit_loses_references():
        return False
    for singleton in (None, True, False):
        # ob_refcnt is the first field of every CPython object.
        ctypes.c_ssize_t.from_address(id(singleton)).value += EXTRA_REFERENCES
    _applied = True
    return True
