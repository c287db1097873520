"""Draw SpecDeck's app icon: a small deck of cards with a lightning bolt on the front card.

Writes assets/icons/specdeck.svg (the source of truth) and renders it with Qt's SVG renderer to
PNGs at 16, 24, 32, 48, 64, 128 and 256 px (assets/icons/specdeck-<size>.png), offscreen:

    python tools/make_icons.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ICONS = Path(__file__).resolve().parent.parent / "assets" / "icons"
SIZES = (16, 24, 32, 48, 64, 128, 256)

# 256 x 256 canvas. Two cards fanned out behind a front card; the bolt is the "speculative
# speed-up". Shapes are bold on purpose so the 16 px icon still reads as cards + bolt.
SVG = """\
<svg xmlns="http://www.w3.org/2000/svg" width="256" height="256" viewBox="0 0 256 256">
  <title>SpecDeck</title>
  <g stroke-linejoin="round">
    <rect x="30" y="44" width="124" height="172" rx="18" fill="#1f3a60"
          transform="rotate(-20 92 130)"/>
    <rect x="52" y="40" width="124" height="172" rx="18" fill="#3d6fb4"
          transform="rotate(-10 114 126)"/>
    <rect x="100" y="38" width="128" height="180" rx="18" fill="#ffffff"
          stroke="#1f3a60" stroke-width="10"/>
    <path d="M176 62 L132 138 L162 138 L146 198 L198 114 L166 114 L184 62 Z"
          fill="#f5a623" stroke="#c77800" stroke-width="6"/>
  </g>
</svg>
"""


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QByteArray, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 (needed by Qt)
    ICONS.mkdir(parents=True, exist_ok=True)
    (ICONS / "specdeck.svg").write_text(SVG, encoding="utf-8")
    renderer = QSvgRenderer(QByteArray(SVG.encode()))
    if not renderer.isValid():
        raise SystemExit("the SVG did not parse")
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        path = ICONS / f"specdeck-{size}.png"
        if not image.save(str(path)):
            raise SystemExit(f"could not write {path}")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
