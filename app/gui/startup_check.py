"""Before Qt starts: are the system libraries of Qt's xcb (X11) platform plugin there?

Without them Qt aborts (exit 134) with a message that names libxcb-cursor0 whatever is really
missing (on a clean Debian 12 it is libxcb-icccm4 and libxcb-keysyms1). This check runs `ldd` on
the plugin of the installed PySide6 and, when libraries are not found, returns one line naming
them and the command that installs them. No Qt import here: it must run before QApplication.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# soname -> (Debian/Ubuntu package, Fedora package): everything libqxcb.so and libQt6XcbQpa
# link that a minimal desktop may lack (from `ldd` on PySide6 6.12's plugin).
XCB_LIBRARIES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
}

_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


def missing_from_ldd(ldd_output: str) -> list[str]:
    """The sonames `ldd` reported as 'not found', each once, in order."""
    seen: list[str] = []
    for name in _NOT_FOUND.findall(ldd_output):
        if name not in seen:
            seen.append(name)
    return seen


def xcb_plugin_paths() -> list[Path]:
    """libqxcb.so and the Qt library it loads (libQt6XcbQpa), in the installed PySide6."""
    try:
        import PySide6
    except ImportError:
        return []
    root = Path(PySide6.__file__).resolve().parent / "Qt"
    candidates = [root / "plugins" / "platforms" / "libqxcb.so", *sorted((root / "lib").glob("libQt6XcbQpa.so*"))]
    return [p for p in candidates if p.is_file()][:2]


def _run_ldd(path: Path) -> str:
    ldd = shutil.which("ldd")
    if ldd is None:
        return ""
    try:
        return subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _loadable(soname: str) -> bool:
    """Whether the dynamic loader finds this library after all (e.g. beside a bundled app, through
    LD_LIBRARY_PATH): ldd's 'not found' is then not a reason to refuse to start."""
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def uses_xcb(env: Mapping[str, str]) -> bool:
    """Whether Qt will load the xcb plugin: asked for by name, or the default on an X11 session."""
    platform = env.get("QT_QPA_PLATFORM", "").strip()
    if platform:
        return platform.split(";")[0].split(":")[0] == "xcb"
    # Unset: Qt prefers Wayland where there is a Wayland session, xcb where there is an X display.
    return bool(env.get("DISPLAY")) and not env.get("WAYLAND_DISPLAY")


def _distro(os_release: str) -> str:
    ids = " ".join(re.findall(r"^ID(?:_LIKE)?=\"?([^\"\n]*)", os_release, re.MULTILINE)).lower().split()
    if any(i in ("fedora", "rhel", "centos") for i in ids):
        return "fedora"
    if any(i in ("debian", "ubuntu") for i in ids):
        return "debian"
    return "unknown"


def install_line(missing: list[str], distro: str) -> str:
    debian = sorted({XCB_LIBRARIES[m][0] for m in missing if m in XCB_LIBRARIES})
    fedora = sorted({XCB_LIBRARIES[m][1] for m in missing if m in XCB_LIBRARIES})
    apt = f"sudo apt-get install {' '.join(debian)}" if debian else ""
    dnf = f"sudo dnf install {' '.join(fedora)}" if fedora else ""
    if distro == "debian" and apt:
        return apt
    if distro == "fedora" and dnf:
        return dnf
    if apt and dnf:
        return f"{apt} (Debian/Ubuntu) or {dnf} (Fedora)"
    return "install them with your distribution's package manager"


def xcb_problem(
    env: Mapping[str, str] | None = None,
    run_ldd: Callable[[Path], str] = _run_ldd,
    plugins: list[Path] | None = None,
    os_release: str | None = None,
    loadable: Callable[[str], bool] = _loadable,
) -> str | None:
    """One line naming the xcb plugin's missing libraries and the install command, or None
    when the window can open (or the check does not apply: not Linux, not xcb, no ldd)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or not uses_xcb(env):
        return None
    missing: list[str] = []
    for plugin in xcb_plugin_paths() if plugins is None else plugins:
        for name in missing_from_ldd(run_ldd(plugin)):
            if name not in missing and not loadable(name):
                missing.append(name)
    if not missing:
        return None
    if os_release is None:
        try:
            os_release = Path("/etc/os-release").read_text(encoding="utf-8")
        except OSError:
            os_release = ""
    return (
        f"specdeck: the window cannot open: Qt's X11 (xcb) plugin needs {', '.join(missing)}, not installed here. "
        f"Install: {install_line(missing, _distro(os_release))}"
    )
