#!/usr/bin/env bash
# Build SpecDeck's one-folder desktop bundle with PyInstaller:  bash packaging/build.sh [--clean] [--tar]
#
#   packaging/dist/specdeck/specdeck     the executable (bare: the window; --version; screenshot PATH; ...)
#   packaging/dist/specdeck/share/       .desktop entry, AppStream metainfo, icons (used by install.sh)
#   packaging/dist/specdeck/install.sh   installs the bundle for one user (~/.local) or system-wide (PREFIX=...)
#
# Everything the build makes stays in packaging/build/ (its own venv, a snapshot of the sources, PyInstaller's
# work files) and packaging/dist/; both are ignored by git. Nothing is written elsewhere in the repository.
#
#   --clean   start from a new venv (default: reuse packaging/build/venv; pip then installs nothing new)
#   --tar     also write packaging/dist/specdeck-VERSION-linux-ARCH.tar.gz
#
# Environment:
#   PYTHON            the interpreter for the venv (default: python3; 3.11 or newer)
#   SPECDECK_TORCH    the torch requirement installed first (default: torch==2.13.0, the CPU build; a bare
#                     "torch" would pull a CUDA build of several GB, see packaging/README.md)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$HERE/build"
DIST="$HERE/dist"
VENV="$BUILD/venv"
SRC="$BUILD/src"
APP="$DIST/specdeck"
PYTHON="${PYTHON:-python3}"
TORCH_REQ="${SPECDECK_TORCH:-torch==2.13.0}"
PYINSTALLER_REQ="pyinstaller>=6.10,<7"
PY="$VENV/bin/python"

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# pip, without the local-mirror noise of some machines ("WARNING: Location 'file://...' is ignored").
pip_install() {
    "$PY" -m pip install --quiet "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
}

# The libraries the kept Qt platform plugins link that are neither in the bundle nor on this machine: the
# user's machine must have them (PyInstaller carries what it finds here, so building where they are installed
# carries them too).
report_missing_qt_libs() {
    local plugin missing=""
    for plugin in "$APP"/_internal/PySide6/Qt/plugins/platforms/libq{xcb,wayland}.so; do
        [[ -f "$plugin" ]] || continue
        missing+=" $(LD_LIBRARY_PATH="$APP/_internal" ldd "$plugin" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')"
    done
    missing="$(echo "$missing" | tr ' ' '\n' | sed '/^$/d' | sort -u | tr '\n' ' ')"
    if [[ -n "$missing" ]]; then
        log "note: the window's Qt platform plugins need these on the user's machine (not found here): $missing"
    fi
}

# Symbol tables of the largest unstripped libraries: ~90 MB in libtorch_cpu.so, ~17 MB in libpython. Only
# those (torch's own and Python's); the auditwheel/patchelf-repaired ones (numpy.libs, ...) are left alone.
strip_big_libs() {
    if ! command -v strip >/dev/null; then
        log "strip not found (binutils): the libraries keep their symbol tables"
        return 0
    fi
    local lib
    for lib in "$APP"/_internal/torch/lib/libtorch_cpu.so "$APP"/_internal/torch/lib/libtorch_python.so \
        "$APP"/_internal/libpython3*.so*; do
        if [[ -f "$lib" && ! -L "$lib" ]]; then
            strip --strip-unneeded "$lib"
        fi
    done
}

main() {
    local clean=0 tarball=0 arg start
    for arg in "$@"; do
        case "$arg" in
            --clean) clean=1 ;;
            --tar) tarball=1 ;;
            -h | --help)
                sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
                return 0
                ;;
            *)
                echo "build.sh: unknown option $arg (try --help)" >&2
                return 2
                ;;
        esac
    done
    start=$(date +%s)

    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "build.sh: $PYTHON is missing or older than Python 3.11" >&2
        return 1
    fi

    # 1. The build's own venv, outside the app folder that gets frozen (packaging/build/venv, never dist/).
    if [[ $clean == 1 ]]; then
        log "removing $BUILD and $DIST"
        rm -rf "$BUILD" "$DIST"
    fi
    mkdir -p "$BUILD"
    if [[ ! -x "$PY" ]]; then
        log "creating the venv $VENV"
        "$PYTHON" -m venv "$VENV"
    fi

    # 2. A snapshot of the sources: pip builds its wheel from it (setuptools writes build/ beside the sources,
    #    so not in the repository root) and PyInstaller freezes exactly this snapshot, whatever changes in the
    #    working tree while the build runs.
    log "copying the sources to $SRC"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    cp -a "$ROOT/pyproject.toml" "$ROOT/README.md" "$SRC/"
    local pkg
    for pkg in app engine kernels assets; do
        cp -a "$ROOT/$pkg" "$SRC/$pkg"
    done
    if [[ -f "$ROOT/LICENSE" ]]; then cp -a "$ROOT/LICENSE" "$SRC/"; fi
    find "$SRC" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
    mkdir -p "$SRC/assets/models" "$SRC/assets/icons"
    if ! compgen -G "$SRC/assets/models/*/config.json" >/dev/null; then
        log "warning: assets/models holds no model; the bundle will need --model DIR"
    fi

    # 3. Install: the CPU torch first (pip takes it from the local wheel on these machines), then the project
    #    and PyInstaller. With torch==2.13.0 installed, the project's torch>=2.4 installs nothing more.
    log "pip install $TORCH_REQ"
    pip_install "$TORCH_REQ"
    log "pip install the project and $PYINSTALLER_REQ"
    pip_install "$SRC" "$PYINSTALLER_REQ"
    local version
    version="$("$PY" -c 'import engine; print(engine.__version__)')"
    log "specdeck $version, torch $("$PY" -c 'import torch; print(torch.__version__)'), PyInstaller $("$PY" -m PyInstaller --version)"

    # 4. Freeze. The spec reads SPECDECK_SRC for the sources and data files.
    log "running PyInstaller (a few minutes)"
    rm -rf "$APP"
    SPECDECK_SRC="$SRC" "$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
        --distpath "$DIST" --workpath "$BUILD/pyinstaller" "$HERE/specdeck.spec"

    strip_big_libs

    # 5. Desktop integration files beside the executable, and the installer.
    mkdir -p "$APP/share/applications" "$APP/share/metainfo" "$APP/share/icons"
    cp "$HERE/specdeck.desktop" "$APP/share/applications/specdeck.desktop"
    cp "$HERE/io.specdeck.SpecDeck.metainfo.xml" "$APP/share/metainfo/io.specdeck.SpecDeck.metainfo.xml"
    local icons=()
    shopt -s nullglob
    icons=("$SRC"/assets/icons/specdeck*.svg "$SRC"/assets/icons/specdeck*.png)
    shopt -u nullglob
    if [[ ${#icons[@]} -gt 0 ]]; then
        cp "${icons[@]}" "$APP/share/icons/"
    else
        log "warning: no icons in assets/icons (expected specdeck.svg and specdeck-SIZE.png)"
    fi
    cp "$HERE/install.sh" "$APP/install.sh"
    chmod +x "$APP/install.sh" "$APP/specdeck"
    report_missing_qt_libs

    # 6. A check that the bundle starts at all (no window, no model: just the command line).
    log "checking: $APP/specdeck --version"
    "$APP/specdeck" --version

    if [[ $tarball == 1 ]]; then
        local tgz
        tgz="$DIST/specdeck-$version-linux-$(uname -m).tar.gz"
        log "writing $tgz"
        rm -f "$tgz"
        tar -C "$DIST" -czf "$tgz" specdeck
        log "$(du -h "$tgz" | cut -f1) $tgz"
    fi

    log "bundle: $(du -sh "$APP" | cut -f1) in $APP ($(($(date +%s) - start)) s)"
}

# Everything runs inside main, so bash has read the whole file before the build starts: editing this script
# while a build runs cannot change that build.
main "$@"
