"""`tools.bench.cluster_plot.draw_timeline`: each reader's progress against its planned finish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from draw_helpers import png_size
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from weightfabric.tools.bench.cluster_plot import (
    MAX_READER_LEGEND,
    draw_timeline,
    timeline_figure,
)

SIZE = 10**9


def ramp(end: float, start: float = 0.0) -> list[tuple[float, int]]:
    """Samples of a reader reaching the whole version at `end`, linearly from `start`."""
    return [(start + (end - start) * k / 4, SIZE * k // 4) for k in range(5)]


def lines(fig: Figure, prefix: str) -> dict[str, Line2D]:
    return {str(line.get_gid()).split(":", 1)[1]: line for line in fig.axes[0].lines
            if str(line.get_gid()).startswith(prefix)}


def legend_texts(fig: Figure) -> list[str]:
    legend = fig.axes[0].get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def test_draw_timeline_writes_a_png_and_returns_its_path(tmp_path: Path) -> None:
    progress = {"a-0/gpu0": ramp(2.0), "a-1/gpu0": ramp(2.5), "b-0/gpu0": ramp(3.0, 0.5)}
    out = draw_timeline(progress, {"a-0/gpu0": 1.9, "b-0/gpu0": 2.8}, size=SIZE,
                        path=str(tmp_path / "t.png"), title="three readers", lower_bound=1.5)
    assert out == tmp_path / "t.png"
    width, height = png_size(out)
    assert 600 <= width <= 2000 and 300 <= height <= 1000, (width, height)


def test_each_reader_has_a_line_in_percent_and_a_tick_at_its_planned_finish() -> None:
    progress = {"a-0/gpu0": ramp(2.0), "a-1/gpu0": ramp(2.5), "b-0/gpu0": ramp(3.0, 0.5)}
    fig = timeline_figure(progress, {"a-0/gpu0": 1.9, "b-0/gpu0": 2.8, "gone": 1.0}, size=SIZE,
                          lower_bound=1.5, group={"a-0/gpu0": "dc-a", "a-1/gpu0": "dc-a",
                                                  "b-0/gpu0": "dc-b"})
    readers, ticks = lines(fig, "reader:"), lines(fig, "planned:")
    assert list(readers) == list(progress)
    assert list(readers["b-0/gpu0"].get_xdata()) == [t for t, _ in progress["b-0/gpu0"]]
    assert list(readers["a-1/gpu0"].get_ydata()) == [0, 25, 50, 75, 100]
    assert sorted(ticks) == ["a-0/gpu0", "b-0/gpu0"]  # "gone" has no progress: no tick
    assert list(ticks["b-0/gpu0"].get_xdata()) == [2.8]
    colour = {r: line.get_color() for r, line in readers.items()}
    assert colour["a-0/gpu0"] == colour["a-1/gpu0"] != colour["b-0/gpu0"]
    assert ticks["b-0/gpu0"].get_color() == colour["b-0/gpu0"]
    assert readers["a-0/gpu0"].get_linestyle() != readers["a-1/gpu0"].get_linestyle()
    assert [line.get_gid() for line in fig.axes[0].lines].count("lower bound") == 1
    assert "lower bound " in [t.get_text() for t in fig.axes[0].texts]
    assert legend_texts(fig) == ["a-0/gpu0 (dc-a)", "a-1/gpu0 (dc-a)", "b-0/gpu0 (dc-b)",
                                 "planned finish"]


def test_a_relays_first_forward_is_marked_on_its_line_where_it_was_then() -> None:
    progress = {"relay": ramp(2.0), "leaf": ramp(3.0, 0.5)}
    fig = timeline_figure(progress, {}, size=SIZE, forwards={"relay": 0.7, "gone": 1.0})
    marks = lines(fig, "forward:")
    assert list(marks) == ["relay"]  # a reader without progress is not drawn
    assert (list(marks["relay"].get_xdata()), list(marks["relay"].get_ydata())) == ([0.7], [25])
    assert marks["relay"].get_color() == lines(fig, "reader:")["relay"].get_color()
    assert legend_texts(fig)[-1] == "first chunk forwarded"
    assert "first chunk forwarded" not in legend_texts(timeline_figure(progress, {}, size=SIZE))


def test_many_readers_get_a_legend_per_datacenter() -> None:
    n = MAX_READER_LEGEND + 4
    progress = {f"r{i}": ramp(1.0 + i / 10) for i in range(n)}
    group = {f"r{i}": "dc-a" if i % 3 else "dc-b" for i in range(n)}
    fig = timeline_figure(progress, {}, size=SIZE, group=group)
    assert len(lines(fig, "reader:")) == n
    assert legend_texts(fig) == ["dc-b", "dc-a", "planned finish"]
    assert legend_texts(timeline_figure(progress, {}, size=SIZE)) == [
        "planned finish", f"{n} readers"]


def test_a_reader_with_one_sample_is_drawn_as_a_dot(tmp_path: Path) -> None:
    fig = timeline_figure({"late": [(2.0, 0)], "done": ramp(3.0)}, {"late": 4.0}, size=SIZE)
    late = lines(fig, "reader:")["late"]
    assert (list(late.get_xdata()), late.get_marker()) == ([2.0], "o")
    assert png_size(draw_timeline({"late": [(2.0, 0)]}, {}, size=SIZE,
                                  path=tmp_path / "one.png"))[0] > 0


@pytest.mark.parametrize(("progress", "options", "message"), [
    ({}, {}, "no readers in progress"),
    ({"r": []}, {}, "reader 'r' has no samples"),
    ({"r": [(0.0, 0)]}, {"group": {"s": "dc-a"}}, "reader 'r' has no datacenter"),
    ({"r": [(0.0, 0)]}, {"size": 0}, "size must be positive"),
])
def test_bad_input_raises_value_error_and_writes_nothing(
        progress: dict, options: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        draw_timeline(progress, {}, path=tmp_path / "t.png", **{"size": SIZE, **options})
    assert not (tmp_path / "t.png").exists()


def test_importing_the_module_loads_no_matplotlib() -> None:
    code = ("import sys, weightfabric.tools.bench.cluster_plot; "
            "print([m for m in sys.modules if m.startswith('matplotlib')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"
