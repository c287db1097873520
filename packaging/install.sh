#!/usr/bin/env bash
# Install the SpecDeck bundle this script sits in (packaging/build.sh copies it to dist/specdeck/).
#
#   ./install.sh                    for you: ~/.local (the app in ~/.local/lib/specdeck, `specdeck` in ~/.local/bin)
#   sudo PREFIX=/usr/local ./install.sh     for everyone
#   ./install.sh --uninstall        remove what install.sh put there (same PREFIX)
#
# It copies the folder, links PREFIX/bin/specdeck to it, and installs the .desktop entry (its Exec made an
# absolute path, so the menu finds it whatever PATH the desktop session has), the icons (hicolor theme) and
# the AppStream metainfo.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX="${PREFIX:-$HOME/.local}"
APPDIR="$PREFIX/lib/specdeck"
BIN="$PREFIX/bin/specdeck"
DESKTOP="$PREFIX/share/applications/specdeck.desktop"
METAINFO="$PREFIX/share/metainfo/io.specdeck.SpecDeck.metainfo.xml"
ICONS="$PREFIX/share/icons/hicolor"

refresh_caches() {
    if command -v update-desktop-database >/dev/null; then
        update-desktop-database -q "$PREFIX/share/applications" 2>/dev/null || true
    fi
    if command -v gtk-update-icon-cache >/dev/null && [[ -f "$ICONS/index.theme" ]]; then
        gtk-update-icon-cache -q -t "$ICONS" 2>/dev/null || true
    fi
}

if [[ "${1:-}" == "--uninstall" ]]; then
    rm -rf "$APPDIR"
    rm -f "$BIN" "$DESKTOP" "$METAINFO" "$ICONS"/*/apps/specdeck.png "$ICONS"/scalable/apps/specdeck.svg
    refresh_caches
    echo "removed SpecDeck from $PREFIX"
    exit 0
elif [[ $# -gt 0 ]]; then
    echo "install.sh: unknown option $1 (usage: [PREFIX=DIR] install.sh [--uninstall])" >&2
    exit 2
fi

if [[ ! -x "$HERE/specdeck" || ! -d "$HERE/_internal" ]]; then
    echo "install.sh: run the copy inside the built bundle (packaging/dist/specdeck/install.sh)" >&2
    exit 1
fi

if [[ "$HERE" != "$APPDIR" ]]; then
    rm -rf "$APPDIR"
    mkdir -p "$APPDIR"
    cp -a "$HERE/." "$APPDIR/"
fi
mkdir -p "$PREFIX/bin" "$(dirname "$DESKTOP")" "$(dirname "$METAINFO")"
ln -sfn "$APPDIR/specdeck" "$BIN"

sed -e "s|^Exec=specdeck|Exec=$APPDIR/specdeck|" -e "s|^TryExec=specdeck|TryExec=$APPDIR/specdeck|" \
    "$HERE/share/applications/specdeck.desktop" >"$DESKTOP"
cp "$HERE/share/metainfo/io.specdeck.SpecDeck.metainfo.xml" "$METAINFO"

shopt -s nullglob
if [[ -f "$HERE/share/icons/specdeck.svg" ]]; then
    install -D -m 644 "$HERE/share/icons/specdeck.svg" "$ICONS/scalable/apps/specdeck.svg"
fi
for png in "$HERE"/share/icons/specdeck-*.png; do
    size="${png##*/specdeck-}"
    size="${size%.png}"
    if [[ "$size" =~ ^[0-9]+$ ]]; then
        install -D -m 644 "$png" "$ICONS/${size}x${size}/apps/specdeck.png"
    fi
done
shopt -u nullglob
refresh_caches

echo "installed SpecDeck in $APPDIR"
echo "  command: $BIN$(case ":$PATH:" in *":$PREFIX/bin:"*) ;; *) echo " ($PREFIX/bin is not on your PATH)" ;; esac)"
echo "  menu entry: $DESKTOP"
