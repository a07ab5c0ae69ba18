"""Drawing primitives on axes whose data unit is one inch, and text measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from PIL import Image

from weightfabric.topology.draw.style import INK


class Painter:
    """Draws on axes whose data unit is one inch (y downwards); measures text."""

    def __init__(self, fig: Figure) -> None:
        self.ax = fig.add_axes((0, 0, 1, 1))
        self.ax.set_axis_off()
        self._renderer = FigureCanvasAgg(fig).get_renderer()
        self._dpi = fig.dpi

    def width(self, text: str, size: float, *, bold: bool = False) -> float:
        """Width of `text` at font `size`, in inches."""
        prop = FontProperties(size=size, weight="bold" if bold else "normal")
        w, _, _ = self._renderer.get_text_width_height_descent(text, prop, ismath=False)
        return w / self._dpi

    def fit(self, text: str, width: float, size: float, *, bold: bool = False) -> str:
        """`text`, shortened with an ellipsis until it is at most `width` wide."""
        if self.width(text, size, bold=bold) <= width:
            return text
        while len(text) > 1 and self.width(text + "…", size, bold=bold) > width:
            text = text[:-1]
        return text + "…"

    def text(self, x: float, y: float, text: str, size: float, *, bold: bool = False,
             color: str = INK, ha: str = "left", va: str = "top", z: float = 6,
             **kwargs: Any) -> None:
        """Draw `text` at (x, y).

        `kwargs` are more matplotlib Text properties (linespacing, bbox, ...), as loosely
        typed as matplotlib's own stubs.
        """
        self.ax.text(x, y, text, fontsize=size, fontweight="bold" if bold else "normal",
                     color=color, ha=ha, va=va, zorder=z, parse_math=False, **kwargs)

    def box(self, x: float, y: float, w: float, h: float, *, face: str, edge: str = "none",
            lw: float = 1.0, radius: float = 0.06, ls: str = "-", z: float = 1) -> None:
        """Draw a rounded box."""
        self.ax.add_patch(FancyBboxPatch(
            (x, y), w, h, boxstyle=f"round,pad=0,rounding_size={radius}", facecolor=face,
            edgecolor=edge, linewidth=lw, linestyle=ls, zorder=z))

    def rect(self, x: float, y: float, w: float, h: float, *, face: str,
             edge: str = "none", lw: float = 0.8, alpha: float = 1.0, z: float = 4) -> None:
        """Draw a rectangle."""
        self.ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge,
                                    linewidth=lw, alpha=alpha, zorder=z))

    def lines(self, segments: list[tuple[tuple[float, float], tuple[float, float]]], *,
              color: str, lw: float, z: float, alpha: float = 1.0) -> None:
        """Draw line `segments`."""
        if segments:
            self.ax.add_collection(LineCollection(segments, colors=color, linewidths=lw,
                                                  alpha=alpha, zorder=z, capstyle="butt"))

    def arc(self, a: tuple[float, float], b: tuple[float, float], *, color: str, lw: float,
            z: float, bend: float = 0.25) -> None:
        """A curved line from `a` to `b` with an arrowhead at `b`.

        A curved line from `a` to `b` with an arrowhead at `b`, bending downwards by `bend`
        times its length (upwards if negative).
        """
        style = f"-|>,head_length={2 + lw:.2g},head_width={1 + lw / 2:.2g}"
        rad = bend if b[0] >= a[0] else -bend  # y grows downwards: > 0 is below the chord
        self.ax.add_patch(FancyArrowPatch(a, b, connectionstyle=f"arc3,rad={rad}",
                                          arrowstyle=style, color=color, linewidth=lw,
                                          zorder=z, shrinkA=0, shrinkB=0))


def save_palette_png(fig: Figure, path: str | Path) -> None:
    """Save `fig` as a PNG of at most 256 colours, on white.

    A plan's curves defeat PNG's compression of full colour (a megabyte for the
    largest reference cluster); its palette is a few dozen colours and their edges.
    """
    canvas = FigureCanvasAgg(fig)
    fig.set_facecolor("white")
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, format="PNG", optimize=True, dpi=(fig.dpi, fig.dpi))


__all__ = ["Painter", "save_palette_png"]
