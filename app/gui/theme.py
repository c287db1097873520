"""Light, dark, or the system's choice, for the widgets and the plots alike.

"system" keeps the platform's palette (a dark desktop gives a dark window) and styles the plots
to match it; "light" and "dark" set the Fusion style with a fixed palette. pyqtgraph does not
follow the Qt palette, so every plot in a window is restyled here (background, axes, titles, and
the settings markers' label boxes), and new plots get the same colours through pyqtgraph's
config options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyqtgraph as pg
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QWidget

THEMES = ("system", "light", "dark")


@dataclass(frozen=True)
class PlotColors:
    background: str
    foreground: str
    marker_text: str
    marker_fill: tuple[int, int, int, int]
    muted: str  # secondary text (hints, pending changes)
    readonly_background: str  # a read-only text field (the workload's prompt)


LIGHT = PlotColors("#ffffff", "#333333", "#a01010", (255, 255, 255, 140), "#666666", "#f4f4f4")
DARK = PlotColors("#1e1f22", "#d0d0d0", "#ff8a80", (30, 31, 34, 150), "#a0a0a0", "#2b2d30")

_system_style: str | None = None
current: PlotColors = LIGHT
current_mode = "system"


def dark_palette() -> QPalette:
    p = QPalette()
    window, base, text = QColor("#2b2d30"), QColor("#1e1f22"), QColor("#dfe1e5")
    roles = {
        QPalette.ColorRole.Window: window,
        QPalette.ColorRole.WindowText: text,
        QPalette.ColorRole.Base: base,
        QPalette.ColorRole.AlternateBase: QColor("#26282b"),
        QPalette.ColorRole.ToolTipBase: QColor("#3c3f41"),
        QPalette.ColorRole.ToolTipText: text,
        QPalette.ColorRole.PlaceholderText: QColor("#8c8f94"),
        QPalette.ColorRole.Text: text,
        QPalette.ColorRole.Button: QColor("#393b40"),
        QPalette.ColorRole.ButtonText: text,
        QPalette.ColorRole.BrightText: QColor("#ff6b68"),
        QPalette.ColorRole.Link: QColor("#589df6"),
        QPalette.ColorRole.Highlight: QColor("#2f65ca"),
        QPalette.ColorRole.HighlightedText: QColor("#ffffff"),
        QPalette.ColorRole.Light: QColor("#4a4d52"),
        QPalette.ColorRole.Midlight: QColor("#3c3f44"),
        QPalette.ColorRole.Mid: QColor("#303236"),
        QPalette.ColorRole.Dark: QColor("#1a1b1e"),
        QPalette.ColorRole.Shadow: QColor("#000000"),
    }
    for role, color in roles.items():
        p.setColor(role, color)
    disabled = QColor("#7a7d82")
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    p.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Base, QColor("#26282b"))
    p.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Button, QColor("#303236"))
    return p


def palette_is_dark(palette: QPalette) -> bool:
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def system_is_dark() -> bool:
    """The desktop's choice: Qt's colour scheme hint where the platform gives one, else the palette."""
    app = QGuiApplication.instance()
    if app is None:
        return False
    try:
        from PySide6.QtCore import Qt

        scheme = QGuiApplication.styleHints().colorScheme()
        if scheme == Qt.ColorScheme.Dark:
            return True
        if scheme == Qt.ColorScheme.Light:
            return False
    except AttributeError:  # Qt < 6.5
        pass
    return palette_is_dark(app.palette())


def apply_theme(mode: str) -> PlotColors:
    """Set the application's palette for `mode` (system / light / dark); returns the plot colours."""
    global _system_style, current, current_mode
    if mode not in THEMES:
        mode = "system"
    app = QApplication.instance()
    if app is None:
        return current
    if _system_style is None:  # the platform's own style, to go back to it
        _system_style = app.style().name()
    if mode == "system":
        if _system_style and app.style().name() != _system_style:
            app.setStyle(_system_style)
        # An empty palette resolves against the platform's, so it keeps following the desktop.
        app.setPalette(QPalette())
        dark = system_is_dark()
    else:
        app.setStyle("Fusion")
        dark = mode == "dark"
        app.setPalette(dark_palette() if dark else app.style().standardPalette())
    current = DARK if dark else LIGHT
    current_mode = mode
    pg.setConfigOptions(background=current.background, foreground=current.foreground)
    return current


def style_plots(root: QWidget, colors: PlotColors | None = None) -> int:
    """Restyle every pyqtgraph plot under `root`; returns how many plot items were styled."""
    colors = colors or current
    count = 0
    for view in root.findChildren(pg.GraphicsView):
        view.setBackground(colors.background)
        scene = view.scene()
        if scene is None:
            continue
        for item in scene.items():
            if isinstance(item, pg.PlotItem):
                style_plot_item(item, colors)
                count += 1
            elif isinstance(item, pg.InfiniteLine) and getattr(item, "label", None) is not None:
                style_marker_label(item.label, colors)
    return count


def style_plot_item(item: pg.PlotItem, colors: PlotColors) -> None:
    for name in ("left", "bottom"):
        axis = item.getAxis(name)
        axis.setPen(pg.mkPen(colors.foreground))
        axis.setTextPen(pg.mkPen(colors.foreground))
        style = dict(axis.labelStyle)
        style["color"] = colors.foreground
        axis.labelStyle = style
        axis._updateLabel()  # pyqtgraph's own refresh of the label's text and colour
        axis.picture = None
        axis.update()
    title = item.titleLabel
    title.opts["color"] = colors.foreground
    title.setText(title.text)
    legend = item.legend
    if legend is not None:
        legend.setLabelTextColor(colors.foreground)


def style_marker_label(label: Any, colors: PlotColors) -> None:
    label.fill = pg.mkBrush(*colors.marker_fill)
    label.setColor(colors.marker_text)
    label.update()
