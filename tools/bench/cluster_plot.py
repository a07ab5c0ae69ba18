"""A timeline picture of an emulated cluster run: each reader's bytes against time, as a PNG.

matplotlib is imported inside the functions (Agg canvas, never pyplot): `fabric bench`
imports every module of this package when it starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_READER_LEGEND = 8
"""With more readers than this the legend names datacenters (or nothing), not readers."""
LINE_STYLES = ("-", "--", ":", "-.")  # tell apart the few readers of one datacenter


def draw_timeline(progress: Mapping[str, Sequence[tuple[float, int]]],
                  planned: Mapping[str, float], *, size: int, path: str | Path,
                  title: str = "", lower_bound: float | None = None,
                  group: Mapping[str, str] | None = None,
                  forwards: Mapping[str, float] | None = None) -> Path:
    """Draw the readers' progress against their planned finish to a PNG file.

    Args:
        progress: Reader -> samples (seconds since the publish, bytes it holds), in
            increasing time; one sample draws as a dot.
        planned: Reader -> its planned (predicted) finish in seconds, drawn as a tick at
            100% in the reader's colour; readers without progress are left out.
        size: Bytes of the version (100%).
        path: The PNG file to write (overwritten).
        title: Heading of the picture (none if empty).
        lower_bound: Seconds, drawn as a dashed vertical line labelled "lower bound".
        group: Reader -> datacenter: readers coloured by datacenter. Up to
            `MAX_READER_LEGEND` readers the legend names each reader (line styles tell
            apart one datacenter's), beyond that each datacenter.
        forwards: Reader -> seconds at which it (a relay) forwarded its first chunk to
            another reader, drawn as a triangle on its line.

    Returns:
        `path`, as a Path.

    Raises:
        ValueError: `progress` is empty, a reader has no samples or (given `group`) no
            datacenter, or `size` is not positive.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = timeline_figure(progress, planned, size=size, title=title, lower_bound=lower_bound,
                          group=group, forwards=forwards)
    FigureCanvasAgg(fig).print_png(path)
    return Path(path)


def timeline_figure(progress: Mapping[str, Sequence[tuple[float, int]]],
                    planned: Mapping[str, float], *, size: int, title: str = "",
                    lower_bound: float | None = None,
                    group: Mapping[str, str] | None = None,
                    forwards: Mapping[str, float] | None = None) -> Figure:
    """The figure `draw_timeline` saves (same arguments but `path`).

    Its artists carry gids: ``reader:NAME`` (a reader's line), ``planned:NAME`` (its
    tick), ``forward:NAME`` (its first forward) and ``lower bound``.
    """
    if not progress:
        raise ValueError("draw_timeline: no readers in progress; give at least one reader's "
                         "samples (seconds, bytes held)")
    if empty := [r for r, samples in progress.items() if not samples]:
        raise ValueError(f"draw_timeline: reader {empty[0]!r} has no samples; give it at least "
                         "one (seconds, bytes held), e.g. (0.0, 0)")
    if group and (missing := [r for r in progress if r not in group]):
        raise ValueError(f"draw_timeline: reader {missing[0]!r} has no datacenter in group")
    if size <= 0:
        raise ValueError(f"draw_timeline: size must be positive bytes, not {size}")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from weightfabric.topology.draw.labels import plural, size_text
    from weightfabric.topology.draw.style import DPI, INK

    readers = list(progress)
    groups = list(dict.fromkeys(group[r] for r in readers)) if group else []
    per_reader = len(readers) <= MAX_READER_LEGEND
    fig = Figure(figsize=(8, 4), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    seen: dict[str, int] = {}  # readers drawn per datacenter
    for i, reader in enumerate(readers):
        if group:
            dc = group[reader]
            colour = f"C{groups.index(dc) % 10}"
            style = LINE_STYLES[seen.get(dc, 0) % len(LINE_STYLES)] if per_reader else "-"
            seen[dc] = seen.get(dc, 0) + 1
            label = f"{reader} ({dc})" if per_reader else ("_" if seen[dc] > 1 else dc)
        else:
            colour, style, label = f"C{i % 10}", "-", reader if per_reader else "_"
        times = [t for t, _ in progress[reader]]
        held = [100 * n / size for _, n in progress[reader]]
        ax.plot(times, held, color=colour, ls=style, lw=1.4 if per_reader else 0.9,
                alpha=1 if per_reader else 0.7, label=label, gid=f"reader:{reader}",
                marker="o" if len(times) == 1 else None)
        if reader in planned:
            ax.plot([planned[reader]], [100], color=colour, marker="|", ms=14, mew=2,
                    gid=f"planned:{reader}", label="_")
        if forwards and reader in forwards:
            at = forwards[reader]
            ax.plot([at], [_held_at(times, held, at)], color=colour, marker=">", ms=7,
                    ls="none", gid=f"forward:{reader}", label="_")
    if lower_bound is not None:
        ax.axvline(lower_bound, color=INK, ls="--", lw=1, gid="lower bound", label="_")
        ax.text(lower_bound, 0.5, "lower bound ", transform=ax.get_xaxis_transform(),
                rotation=90, ha="right", va="center", color=INK, fontsize=8)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color=INK, marker="|", ms=10, mew=2, ls="none",
                          label="planned finish"))
    if forwards:
        handles.append(Line2D([], [], color=INK, marker=">", ms=7, ls="none",
                              label="first chunk forwarded"))
    if not per_reader and not group:
        handles.append(Line2D([], [], color="none", label=plural(len(readers), "reader")))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since the publish")
    ax.set_ylabel(f"held (% of {size_text(size)})")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    return fig


def _held_at(times: Sequence[float], held: Sequence[float], at: float) -> float:
    """The share held at time `at`: the last sample at or before it (0 before the first)."""
    return next((h for t, h in zip(reversed(times), reversed(held), strict=True) if t <= at),
                0.0)


__all__ = ["MAX_READER_LEGEND", "draw_timeline", "timeline_figure"]
