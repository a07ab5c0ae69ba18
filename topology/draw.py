"""A picture of a cluster: datacenters, nodes, GPUs, NICs and link tiers, as a PNG.

`draw_cluster` draws each datacenter as a rounded box (name, counts, network) with
its nodes in a grid. A node shows its GPUs as squares coloured by model, the NVLink
joining them as a green bar, its NICs as marks under the GPUs they serve, and the
PCIe paths between them as thin lines. Nodes sharing an NVLink domain sit on one
green band. Nodes named under ``roles:`` carry their roles, the trainer's box in
purple. WAN links join the datacenters' network bars, and a legend lists each link
tier with its bandwidth per direction and latency, and each GPU model.

Large clusters collapse: a datacenter of more than `MAX_FULL_NODES` nodes shows the
first `SHOWN_PER_GROUP` nodes of each node group and a "+N more" box for the rest,
so the picture's size and drawing time do not grow with the cluster.

The layout is computed in inches (one data unit is one inch, y grows downwards), so
text and boxes keep their size whatever the cluster; the figure is sized to fit.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyBboxPatch, Rectangle

from topology.schema import Cluster, Datacenter, NodeGroup, NodeType
from topology.units import human_bandwidth

__all__ = ["MAX_FULL_NODES", "SHOWN_PER_GROUP", "draw_cluster"]

DPI = 150
MAX_FULL_NODES = 16
"""A datacenter with at most this many nodes shows every one of them."""
SHOWN_PER_GROUP = 3
"""Nodes shown per node group in a larger datacenter, before its "+N more" box."""
_MAX_CELLS = 24  # boxes per datacenter; further node groups fold into one box
_COLUMNS = 4

# Sizes, in inches.
_MARGIN = 0.35
_GPU, _GPU_GAP, _GPUS_PER_ROW = 0.17, 0.045, 8
_PAD = 0.09  # inside a node box
_MAX_INNER = 2.6  # widest content of a node box; longer names are cut short
_NAME_H = 0.21
_NVLINK_GAP, _NVLINK_H = 0.05, 0.065
_PCIE_H = 0.1  # room for the PCIe lines between the NVLink bar and the NICs
_NIC_W, _NIC_H = 0.11, 0.075
_CELL_GAP = 0.2
_BAND_PAD = 0.075  # NVLink-domain band around its nodes
_DC_PAD = 0.22
_NET_H = 0.32
_WAN_W = 6.0  # points
_LANE = 0.45  # height of a WAN path routed above the datacenters

# Colours (GPU models: Okabe-Ito, readable by colour-blind viewers; no green or red,
# which mean NVLink and WAN).
_GPU_COLOURS = ("#0072B2", "#E69F00", "#CC79A7", "#56B4E9", "#8C6D31", "#6A51A3",
                "#F0E442", "#7F7F7F")
_NVLINK = "#76B900"
_BAND, _DOMAIN_INK = "#EAF5D6", "#4E7A00"
_PCIE = "#A0A0A0"
_NIC = "#2B2B2B"
_TRAINER = "#7B3294"
_NETWORK = "#3D5A80"
_WAN = "#C0392B"
_INK, _MUTED, _EDGE = "#1F1F1F", "#6B6B6B", "#8C8C8C"
_DC_FACE, _DC_EDGE = "#F6F8FB", "#9AA8BA"


def draw_cluster(cluster: Cluster, path: str | Path, *, title: str | None = None) -> None:
    """Draw `cluster` to a PNG file.

    Parameters
    ----------
    cluster
        The cluster to draw, as `topology.load_cluster` returns it.
    path
        The PNG file to write (overwritten).
    title
        Heading of the picture; the cluster's name by default.

    Notes
    -----
    Uses matplotlib's Agg canvas directly and never pyplot, so it changes no global
    state and needs no display. Work is bounded by the number of datacenters and node
    groups, not nodes: a 10,000-GPU cluster draws in about a second.
    """
    fig = Figure(dpi=DPI)
    painter = _Painter(fig)
    width, height = _Layout(cluster, painter).draw(title or cluster.name)
    fig.set_size_inches(width, height)
    painter.ax.set_xlim(0, width)
    painter.ax.set_ylim(height, 0)
    fig.savefig(path, dpi=DPI, facecolor="white", format="png")


@dataclass(frozen=True)
class _Cell:
    """One box of a datacenter's grid: a node, or a box standing for `hidden` nodes."""

    label: str
    type: NodeType | None  # None for the box folding several node groups
    domain: str | None = None
    hidden: int = 0
    detail: str = ""


_Line = tuple[str, float, bool, str]  # a line of a datacenter's header: text, size, bold, colour


class _Painter:
    """Draws on axes whose data unit is one inch (y downwards); measures text."""

    def __init__(self, fig: Figure) -> None:
        self.ax = fig.add_axes((0, 0, 1, 1))
        self.ax.set_axis_off()
        self._renderer = FigureCanvasAgg(fig).get_renderer()
        self._dpi = fig.dpi

    def width(self, text: str, size: float, *, bold: bool = False) -> float:
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
             color: str = _INK, ha: str = "left", va: str = "top", z: float = 6,
             **kwargs: object) -> None:
        self.ax.text(x, y, text, fontsize=size, fontweight="bold" if bold else "normal",
                     color=color, ha=ha, va=va, zorder=z, parse_math=False, **kwargs)

    def box(self, x: float, y: float, w: float, h: float, *, face: str, edge: str = "none",
            lw: float = 1.0, radius: float = 0.06, ls: str = "-", z: float = 1) -> None:
        self.ax.add_patch(FancyBboxPatch(
            (x, y), w, h, boxstyle=f"round,pad=0,rounding_size={radius}", facecolor=face,
            edgecolor=edge, linewidth=lw, linestyle=ls, zorder=z))

    def rect(self, x: float, y: float, w: float, h: float, *, face: str,
             edge: str = "none", z: float = 4) -> None:
        self.ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge,
                                    linewidth=0.8, zorder=z))

    def lines(self, segments: list[tuple[tuple[float, float], tuple[float, float]]], *,
              color: str, lw: float, z: float) -> None:
        if segments:
            self.ax.add_collection(LineCollection(segments, colors=color, linewidths=lw,
                                                  zorder=z, capstyle="butt"))


class _Layout:
    """Places and draws the title, the datacenters, the WAN links and the legend."""

    def __init__(self, cluster: Cluster, painter: _Painter) -> None:
        self.cluster = cluster
        self.p = painter
        self.cells = {dc.name: _cells(cluster, dc) for dc in cluster.datacenters}
        self.types = list({g.type: cluster.node_types[g.type]
                           for dc in cluster.datacenters for g in dc.nodes}.values())
        models = dict.fromkeys(t.gpu.model if t.gpu else "GPU" for t in self.types if t.gpus)
        self.colours = {m: _GPU_COLOURS[i % len(_GPU_COLOURS)] for i, m in enumerate(models)}
        max_gpus = max((t.gpus for t in self.types), default=0)
        per_row = min(max(max_gpus, 1), _GPUS_PER_ROW)
        self.gpu_rows = max(1, math.ceil(max_gpus / _GPUS_PER_ROW))
        wanted = [per_row * _GPU + (per_row - 1) * _GPU_GAP, 1.3]
        for cell in (c for cells in self.cells.values() for c in cells if not c.hidden):
            tag, trainer = self._tag(cell.label)
            wanted.append(painter.width(cell.label, 8.5)
                          + (painter.width(tag, 8, bold=trainer) + 0.1 if tag else 0))
            if cell.type and not cell.type.gpus:
                wanted.append(painter.width(_cpu_label(cell.type), 8) + 0.1)
        self.cell_w = 2 * _PAD + min(max(wanted), _MAX_INNER)
        self.cell_h = (_PAD + _NAME_H + self.gpu_rows * _GPU + (self.gpu_rows - 1) * _GPU_GAP
                       + _NVLINK_GAP + _NVLINK_H + _PCIE_H + _NIC_H + _PAD)

    # -- whole picture -------------------------------------------------------------

    def draw(self, title: str) -> tuple[float, float]:
        """Draw everything; return the figure's (width, height) in inches."""
        p, cluster = self.p, self.cluster
        totals = [_dc_totals(cluster, dc) for dc in cluster.datacenters]
        nodes, gpus, nics = (sum(t[i] for t in totals) for i in range(3))
        n_dc = len(cluster.datacenters)
        subtitle = (f"{_plural(n_dc, 'datacenter')} · {_plural(nodes, 'node')} · "
                    f"{_plural(gpus, 'GPU')} · {_plural(nics, 'NIC')} · bandwidths per direction")
        p.text(_MARGIN, _MARGIN, title, 16, bold=True)
        p.text(_MARGIN, _MARGIN + 0.34, subtitle, 10, color=_MUTED)
        top = _MARGIN + 0.8

        headers = [self._header(dc, t) for dc, t in zip(cluster.datacenters, totals, strict=True)]
        widths = [self._dc_width(dc, h) for dc, h in zip(cluster.datacenters, headers, strict=True)]
        header_h = max(0.32 + 0.24 * (len(h) - 1) for h in headers) + 0.12
        gaps = [self._gap_width(i) for i in range(n_dc - 1)]
        xs = [_MARGIN]
        for w, gap in zip(widths, gaps, strict=False):
            xs.append(xs[-1] + w + gap)
        names = [dc.name for dc in cluster.datacenters]
        lanes = sum(_adjacent(names, w.between) is None for w in cluster.wan)
        lane_top, top = top, top + _LANE * lanes
        self._wan(xs, widths, lane_top, top + _DC_PAD + header_h + _NET_H / 2)
        boxes = [(x, x + w, self._datacenter(dc, x, top, w, header, header_h))
                 for dc, x, w, header in zip(cluster.datacenters, xs, widths, headers, strict=True)]
        content_w = xs[-1] + widths[-1]
        legend_w, legend_bottom = self._legend(boxes, content_w - _MARGIN)
        width = max(content_w, _MARGIN + legend_w, _MARGIN + p.width(title, 16, bold=True),
                    _MARGIN + p.width(subtitle, 10)) + _MARGIN
        return width, max(legend_bottom, *(b for _, _, b in boxes)) + _MARGIN

    # -- datacenters ---------------------------------------------------------------

    def _header(self, dc: Datacenter, totals: tuple[int, int, int]) -> list[_Line]:
        """Header lines of a datacenter box: name, counts, NVLink domains."""
        nodes, gpus, nics = totals
        lines = [(dc.name, 13.0, True, _INK),
                 (f"{_plural(nodes, 'node')} · {_plural(gpus, 'GPU')} · {_plural(nics, 'NIC')}",
                  10.0, False, _MUTED)]
        domains: dict[str, tuple[int, int]] = {}
        for g in dc.nodes:
            if g.nvlink_domain:
                n, k = domains.get(g.nvlink_domain, (0, 0))
                size = _size(g)
                gpus = size * self.cluster.node_types[g.type].gpus
                domains[g.nvlink_domain] = (n + size, k + gpus)
        for name, (n, k) in domains.items():
            lines.append((f"NVLink domain {name}: {_plural(n, 'node')} · {_plural(k, 'GPU')}",
                          9.5, False, _DOMAIN_INK))
        return lines

    def _grid_size(self, dc: Datacenter) -> tuple[float, float]:
        n = len(self.cells[dc.name])
        cols = min(n, _COLUMNS)
        rows = math.ceil(n / cols)
        return (cols * self.cell_w + (cols - 1) * _CELL_GAP,
                rows * self.cell_h + (rows - 1) * _CELL_GAP)

    def _dc_width(self, dc: Datacenter, header: list[_Line]) -> float:
        text_w = max(self.p.width(t, s, bold=b) for t, s, b, _ in header)
        net_w = self.p.width(_network_label(dc), 9) + 0.3
        return 2 * _DC_PAD + max(self._grid_size(dc)[0], text_w, net_w)

    def _datacenter(self, dc: Datacenter, x: float, y: float, w: float,
                    header: list[_Line], header_h: float) -> float:
        """Draw a datacenter box with its top-left corner at (x, y); return its bottom."""
        p = self.p
        ty = y + _DC_PAD
        for text, size, bold, colour in header:
            p.text(x + _DC_PAD, ty, text, size, bold=bold, color=colour)
            ty += 0.32 if bold else 0.24
        net_y = y + _DC_PAD + header_h
        p.box(x + _DC_PAD, net_y, w - 2 * _DC_PAD, _NET_H, face=_NETWORK, radius=0.08, z=3)
        p.text(x + w / 2, net_y + _NET_H / 2, _network_label(dc), 9, color="white",
               ha="center", va="center")
        grid_w, grid_h = self._grid_size(dc)
        gx, gy = x + (w - grid_w) / 2, net_y + _NET_H + 0.25
        cells = self.cells[dc.name]
        cols = min(len(cells), _COLUMNS)
        for row_start in range(0, len(cells), cols):
            row = cells[row_start:row_start + cols]
            cy = gy + (row_start // cols) * (self.cell_h + _CELL_GAP)
            self._domain_bands(row, gx, cy)
            for col, cell in enumerate(row):
                cx = gx + col * (self.cell_w + _CELL_GAP)
                if cell.hidden:
                    self._more(cell, cx, cy)
                else:
                    self._node(cell, cx, cy)
        bottom = gy + grid_h + _DC_PAD
        p.box(x, y, w, bottom - y, face=_DC_FACE, edge=_DC_EDGE, lw=1.4, radius=0.16, z=0)
        return bottom

    def _domain_bands(self, row: list[_Cell], gx: float, cy: float) -> None:
        """A green band behind each run of cells of one NVLink domain, with a shared bar."""
        step = self.cell_w + _CELL_GAP
        start = 0
        while start < len(row):
            end = start
            domain = row[start].domain
            while end + 1 < len(row) and domain and row[end + 1].domain == domain:
                end += 1
            t = row[start].type
            if domain and t and t.nvlink and t.nvlink.groups is None:
                x0, x1 = gx + start * step, gx + end * step + self.cell_w
                self.p.box(x0 - _BAND_PAD, cy - _BAND_PAD, x1 - x0 + 2 * _BAND_PAD,
                           self.cell_h + 2 * _BAND_PAD, face=_BAND, edge=_NVLINK, lw=1.0,
                           radius=0.1, z=1)
                self.p.rect(x0 + _PAD, self._nvlink_y(cy), x1 - x0 - 2 * _PAD, _NVLINK_H,
                            face=_NVLINK, z=5)
            start = end + 1

    def _nvlink_y(self, cy: float) -> float:
        return (cy + _PAD + _NAME_H + self.gpu_rows * _GPU + (self.gpu_rows - 1) * _GPU_GAP
                + _NVLINK_GAP)

    # -- nodes ---------------------------------------------------------------------

    def _node(self, cell: _Cell, x: float, y: float) -> None:
        p, t = self.p, cell.type
        assert t is not None
        inner = self.cell_w - 2 * _PAD
        tag, trainer = self._tag(cell.label)
        p.box(x, y, self.cell_w, self.cell_h, face="white", edge=_TRAINER if trainer else _EDGE,
              lw=1.8 if trainer else 0.9, z=3)
        room = inner
        if tag:  # right of the name, the trainer's in colour
            room -= p.width(tag, 8, bold=trainer) + 0.1
            p.text(x + self.cell_w - _PAD, y + _PAD, tag, 8, bold=trainer,
                   color=_TRAINER if trainer else _MUTED, ha="right")
        p.text(x + _PAD, y + _PAD - 0.01, p.fit(cell.label, room, 8.5), 8.5)
        gy = y + _PAD + _NAME_H
        nv_y = self._nvlink_y(y)
        nic_y = nv_y + _NVLINK_H + _PCIE_H
        gpus: list[tuple[float, float]] = []  # top-left corners
        if t.gpus == 0:
            p.box(x + _PAD, gy, inner, _GPU + 0.04, face="#EDEDED", edge="#BDBDBD", lw=0.8,
                  radius=0.03, z=4)
            p.text(x + self.cell_w / 2, gy + (_GPU + 0.04) / 2, p.fit(_cpu_label(t), inner, 8),
                   8, color=_MUTED, ha="center", va="center")
        else:
            colour = self.colours[t.gpu.model if t.gpu else "GPU"]
            per_row = min(t.gpus, _GPUS_PER_ROW)
            x0 = x + (self.cell_w - (per_row * _GPU + (per_row - 1) * _GPU_GAP)) / 2
            for j in range(t.gpus):
                gx = x0 + (j % per_row) * (_GPU + _GPU_GAP)
                gpus.append((gx, gy + (j // per_row) * (_GPU + _GPU_GAP)))
                p.rect(gx, gpus[-1][1], _GPU, _GPU, face=colour, edge="white")
            if t.nvlink is not None and (cell.domain is None or t.nvlink.groups is not None):
                for group in t.nvlink.groups or (tuple(range(t.gpus)),):
                    left = min(gpus[j][0] for j in group)
                    right = max(gpus[j][0] for j in group) + _GPU
                    p.rect(left, nv_y, right - left, _NVLINK_H, face=_NVLINK, z=5)
        if t.nics is not None:
            self._nics(t, x, nic_y, gpus)

    def _tag(self, name: str) -> tuple[str, bool]:
        """The roles of node `name` as shown beside it, and whether it is a trainer."""
        roles = [role for role, patterns in self.cluster.roles.items()
                 if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
        return ("" if roles == [name] else ", ".join(roles)), "trainer" in roles

    def _nics(self, t: NodeType, x: float, nic_y: float, gpus: list[tuple[float, float]]) -> None:
        """NIC marks under the GPUs they serve, joined to them by PCIe lines."""
        nics = t.nics
        assert nics is not None
        inner = self.cell_w - 2 * _PAD
        mark_w = min(_NIC_W, 0.8 * inner / nics.count)
        if gpus and nics.count <= len(gpus):
            served: dict[int, list[float]] = {}
            for j, k in nics.rails(t.gpus):
                served.setdefault(k, []).append(gpus[j][0] + _GPU / 2)
            centres = [sum(served[k]) / len(served[k]) for k in range(nics.count)]
        else:  # spread evenly, under the GPUs if there is room
            mid = x + self.cell_w / 2
            span = min(inner, max(2 * (mid - gpus[0][0]) if gpus else inner,
                                  1.5 * mark_w * nics.count))
            step = span / nics.count
            centres = [mid - span / 2 + (k + 0.5) * step for k in range(nics.count)]
        if gpus:
            rows_bottom = max(g[1] for g in gpus) + _GPU
            self.p.lines([((gpus[j][0] + _GPU / 2, rows_bottom if gpus[j][1] + _GPU >= rows_bottom
                            else gpus[j][1] + _GPU), (centres[k], nic_y))
                          for j, k in nics.rails(t.gpus)], color=_PCIE, lw=0.8, z=3.5)
        rdma = nics.kind == "rdma"
        for c in centres:
            self.p.rect(c - mark_w / 2, nic_y, mark_w, _NIC_H, face=_NIC if rdma else "white",
                        edge=_NIC, z=5)

    def _more(self, cell: _Cell, x: float, y: float) -> None:
        """The box standing for nodes not drawn."""
        p = self.p
        inner = self.cell_w - 2 * _PAD
        p.box(x, y, self.cell_w, self.cell_h, face="#F1F1F1", edge=_EDGE, lw=0.9, ls="--", z=3)
        p.text(x + self.cell_w / 2, y + _PAD, cell.label, 10, bold=True, ha="center")
        p.text(x + self.cell_w / 2, y + _PAD + _NAME_H + 0.03, p.fit(cell.detail, inner, 8.5),
               8.5, color=_MUTED, ha="center")
        if cell.type is not None and cell.type.gpus:
            gpus = cell.hidden * cell.type.gpus
            p.text(x + self.cell_w / 2, y + self.cell_h - _PAD, _plural(gpus, "GPU"), 8.5,
                   color=_MUTED, ha="center", va="bottom")

    # -- WAN -----------------------------------------------------------------------

    def _gap_width(self, i: int) -> float:
        """Room between datacenters i and i + 1: enough for their WAN labels."""
        names = [dc.name for dc in self.cluster.datacenters]
        labels = [line for w in self.cluster.wan if _adjacent(names, w.between) == i
                  for line in _wan_label(w.bandwidth, w.latency)]
        return max([0.6] + [self.p.width(t, 9.5, bold=True) + 0.4 for t in labels])

    def _wan(self, xs: list[float], widths: list[float], lane_top: float, line_y: float) -> None:
        """Draw the WAN links between the datacenters' network bars at height `line_y`.

        Neighbours are joined straight across the gap between them; links between
        farther datacenters run above the boxes, one lane each, starting at `lane_top`.
        """
        p = self.p
        names = [dc.name for dc in self.cluster.datacenters]
        in_gap: dict[int, int] = {}
        lane = 0
        for w in self.cluster.wan:
            a, b = sorted(names.index(n) for n in w.between)
            label = _wan_label(w.bandwidth, w.latency)
            x0, x1 = xs[a] + widths[a] - _DC_PAD, xs[b] + _DC_PAD
            if b == a + 1:
                k = in_gap.get(a, 0)
                in_gap[a] = k + 1
                y = line_y + 0.06 + 0.9 * k
                p.lines([((x0, y), (x1, y))], color=_WAN, lw=_WAN_W, z=2)
                p.text((xs[a] + widths[a] + xs[b]) / 2, y - 0.12, "\n".join(label), 9.5,
                       bold=True, color=_WAN, ha="center", va="bottom", linespacing=1.3)
                continue
            # up the gaps next to the two boxes, across above the boxes
            y = lane_top + _LANE * (lane + 0.5)
            xa, xb = xs[a] + widths[a] + 0.12 * (lane + 1), xs[b] - 0.12 * (lane + 1)
            lane += 1
            join = line_y - 0.08
            p.lines([((x0, join), (xa, join)), ((xa, join), (xa, y)), ((xa, y), (xb, y)),
                     ((xb, y), (xb, join)), ((xb, join), (x1, join))],
                    color=_WAN, lw=_WAN_W * 0.6, z=2)
            p.text((xa + xb) / 2, y, " · ".join(label), 9, bold=True, color=_WAN, ha="center",
                   va="center", z=7, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})

    # -- legend --------------------------------------------------------------------

    def _legend(self, boxes: list[tuple[float, float, float]], room: float) -> tuple[float, float]:
        """Draw the link-tier and GPU-model tables under the datacenter boxes.

        `boxes` holds each box's (left, right, bottom). The tables go side by side when
        they fit in `room`, else one under the other, whichever leaves the picture
        shorter; they rise into the space under short boxes. Returns (width, bottom).
        """
        tiers = _Table(self.p, ("", "link tier", "bandwidth per direction", "latency", "where"))
        for row in _tier_rows(self.cluster, self.types):
            tiers.add(*row)
        models = _Table(self.p, ("", "GPU", "memory", "count"))
        for model, (memory, count) in _gpu_models(self.cluster).items():
            models.add(f"gpu:{self.colours[model]}", model, memory, f"{count:,}")
        (tw, th), (mw, mh) = tiers.size(), models.size()
        layouts = [((0.0, th + 0.2), max(tw, mw), th + 0.2 + mh)]  # models under tiers
        if not models.rows:
            layouts = [((0.0, 0.0), tw, th)]
        elif tw + 0.5 + mw <= max(room, tw):
            layouts.insert(0, ((tw + 0.5, 0.0), tw + 0.5 + mw, max(th, mh)))

        def top(width: float) -> float:
            return max(b for left, _, b in boxes if left < _MARGIN + width) + 0.3

        (mx, my), width, height = min(layouts, key=lambda lay: top(lay[1]) + lay[2])
        y = top(width)
        tiers.draw(_MARGIN, y)
        if models.rows:
            models.draw(_MARGIN + mx, y + my)
        return width, y + height


class _Table:
    """A legend table: a swatch, then text columns; the first row is the heading."""

    SIZE, ROW_H, SWATCH_W, COL_GAP = 9.5, 0.26, 0.45, 0.25

    def __init__(self, painter: _Painter, heading: tuple[str, ...]) -> None:
        self.p = painter
        self.heading = heading
        self.rows: list[tuple[str, ...]] = []

    def add(self, swatch: str, *texts: str) -> None:
        self.rows.append((swatch, *texts))

    def _widths(self) -> list[float]:
        cols = list(zip(self.heading, *self.rows, strict=True))[1:]
        return [max(self.p.width(t, self.SIZE, bold=i == 0) for t in col)
                for i, col in enumerate(cols)]

    def size(self) -> tuple[float, float]:
        widths = self._widths()
        return (self.SWATCH_W + 0.1 + sum(widths) + self.COL_GAP * (len(widths) - 1),
                self.ROW_H * (len(self.rows) + 1))

    def draw(self, x: float, y: float) -> None:
        widths = self._widths()
        for r, row in enumerate([self.heading, *self.rows]):
            cy = y + self.ROW_H * (r + 0.5)
            if r:
                _swatch(self.p, row[0], x, cy, self.SWATCH_W)
            tx = x + self.SWATCH_W + 0.1
            for i, (text, w) in enumerate(zip(row[1:], widths, strict=True)):
                self.p.text(tx, cy, text, self.SIZE if r else 8.5, bold=r > 0 and i == 0,
                            color=_INK if r else _MUTED, va="center")
                tx += w + self.COL_GAP


def _swatch(p: _Painter, kind: str, x: float, cy: float, w: float) -> None:
    """The legend's sample of a link tier or a GPU model, centred on `cy`."""
    if kind == "nvlink":
        p.rect(x, cy - _NVLINK_H / 2, w, _NVLINK_H, face=_NVLINK)
    elif kind == "pcie":
        p.lines([((x, cy), (x + w, cy))], color=_PCIE, lw=1.2, z=4)
    elif kind in ("rdma", "tcp"):
        for k in range(3):
            p.rect(x + 0.04 + k * 0.14, cy - _NIC_H / 2, _NIC_W, _NIC_H,
                   face=_NIC if kind == "rdma" else "white", edge=_NIC)
    elif kind == "network":
        p.box(x, cy - 0.08, w, 0.16, face=_NETWORK, radius=0.04, z=4)
    elif kind == "wan":
        p.lines([((x, cy), (x + w, cy))], color=_WAN, lw=_WAN_W, z=4)
    elif kind.startswith("gpu:"):
        p.rect(x + (w - 0.2) / 2, cy - 0.1, 0.2, 0.2, face=kind[4:], edge="white")


# -- what to draw ----------------------------------------------------------------


def _size(group: NodeGroup) -> int:
    return group.count if group.count is not None else 1


def _node_name(group: NodeGroup, i: int) -> str:
    return group.name.replace("{i}", str(i)) if group.count is not None else group.name


def _cells(cluster: Cluster, dc: Datacenter) -> list[_Cell]:
    """The boxes of a datacenter's grid, collapsed when the datacenter is large."""
    full = sum(_size(g) for g in dc.nodes) <= MAX_FULL_NODES
    cells: list[_Cell] = []
    for k, g in enumerate(dc.nodes):
        t = cluster.node_types[g.type]
        n = _size(g)
        shown = n if full else min(n, SHOWN_PER_GROUP)
        group_cells = [_Cell(_node_name(g, i), t, g.nvlink_domain) for i in range(shown)]
        if shown < n:
            detail = f"{_node_name(g, shown)} … {_node_name(g, n - 1)}"
            group_cells.append(_Cell(f"+{n - shown:,} more", t, g.nvlink_domain,
                                     hidden=n - shown, detail=detail))
        last = k == len(dc.nodes) - 1
        if len(cells) + len(group_cells) > _MAX_CELLS - (0 if last else 1):
            rest = dc.nodes[k:]
            nodes = sum(_size(r) for r in rest)
            gpus = sum(_size(r) * cluster.node_types[r.type].gpus for r in rest)
            cells.append(_Cell(f"+{nodes:,} more", None, hidden=nodes,
                               detail=f"{_plural(len(rest), 'node group')} · {_plural(gpus, 'GPU')}"))
            break
        cells.extend(group_cells)
    return cells


def _cpu_label(t: NodeType) -> str:
    return "CPU only" + (f" · {_size_text(t.host_memory)} memory" if t.host_memory else "")


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def _dc_totals(cluster: Cluster, dc: Datacenter) -> tuple[int, int, int]:
    """(nodes, GPUs, NICs) of a datacenter, without expanding its node groups."""
    nodes = gpus = nics = 0
    for g in dc.nodes:
        t = cluster.node_types[g.type]
        n = _size(g)
        nodes += n
        gpus += n * t.gpus
        nics += n * (t.nics.count if t.nics else 0)
    return nodes, gpus, nics


def _network_label(dc: Datacenter) -> str:
    net = dc.network
    parts = ["leaf/spine network"]
    if net.oversubscription == 1:
        parts.append("non-blocking")
    else:
        parts.append(f"{net.oversubscription:g}:1 oversubscribed")
    if net.nodes_per_leaf != 1:
        parts.append(f"{net.nodes_per_leaf} nodes per leaf")
    if net.latency:
        parts.append(f"{_latency(net.latency)} per hop")
    return " · ".join(parts)


def _tier_rows(cluster: Cluster, types: list[NodeType]) -> list[tuple[str, str, str, str, str]]:
    """Legend rows (swatch, tier, bandwidth, latency, where), alike values merged."""
    found: dict[tuple[str, str, str, str], list[str]] = {}

    def add(kind: str, tier: str, bandwidth: str, latency: float, where: str) -> None:
        found.setdefault((kind, tier, bandwidth, _latency(latency)), []).append(where)

    for t in types:
        if t.nvlink:
            joined = "per GPU, NVSwitch" if t.nvlink.groups is None else "per GPU, in groups"
            add("nvlink", "NVLink", f"{human_bandwidth(t.nvlink.bandwidth)} {joined}",
                t.nvlink.latency, t.name)
    for t in types:
        if t.pcie:
            add("pcie", "PCIe", f"{human_bandwidth(t.pcie.bandwidth)} GPU ↔ host, GPU ↔ NIC",
                t.pcie.latency, t.name)
    for t in types:
        if t.nics:
            nics = t.nics
            add(nics.kind, f"NIC ({nics.kind.upper()})",
                f"{_nic_bandwidth(nics.bandwidth)} × {nics.count} per node", nics.latency, t.name)
    for dc in cluster.datacenters:
        oversub = dc.network.oversubscription
        uplink = "leaf uplinks = Σ NICs" + (f" ÷ {oversub:g}" if oversub != 1 else "")
        add("network", "Datacenter", uplink, dc.network.latency, dc.name)
    for w in cluster.wan:
        add("wan", "WAN", _nic_bandwidth(w.bandwidth), w.latency, " ↔ ".join(w.between))
    return [(kind, tier, bandwidth, latency, ", ".join(where))
            for (kind, tier, bandwidth, latency), where in found.items()]


def _gpu_models(cluster: Cluster) -> dict[str, tuple[str, int]]:
    """GPU model -> (memory, number of GPUs), in order of appearance."""
    models: dict[str, tuple[str, int]] = {}
    for dc in cluster.datacenters:
        for g in dc.nodes:
            t = cluster.node_types[g.type]
            if t.gpus:
                model = t.gpu.model if t.gpu else "GPU"
                memory = _size_text(t.gpu.memory) if t.gpu and t.gpu.memory else "–"
                models[model] = (memory, models.get(model, ("", 0))[1] + _size(g) * t.gpus)
    return models


def _adjacent(names: list[str], between: tuple[str, str]) -> int | None:
    """The gap index a WAN link crosses when it joins neighbouring datacenters."""
    a, b = sorted(names.index(n) for n in between)
    return a if b == a + 1 else None


def _wan_label(bandwidth: float, latency: float) -> list[str]:
    lines = ["WAN", _nic_bandwidth(bandwidth)]
    if latency:
        lines.append(_latency(latency))
    return lines


def _nic_bandwidth(bytes_per_s: float) -> str:
    """Bandwidth in bytes and, as network links are sold, in bits: '50 GB/s (400 Gb/s)'."""
    bits = bytes_per_s * 8
    for name, factor in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6)):
        if bits >= factor:
            return f"{human_bandwidth(bytes_per_s)} ({bits / factor:.3g} {name})"
    return human_bandwidth(bytes_per_s)


def _latency(seconds: float) -> str:
    if not seconds:
        return ""
    for name, factor in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {name}"
    return f"{seconds / 1e-9:.3g} ns"


def _size_text(nbytes: float) -> str:
    for name, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= factor:
            return f"{nbytes / factor:.3g} {name}"
    return f"{nbytes:.3g} B"
