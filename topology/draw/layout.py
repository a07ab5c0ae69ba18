"""Where everything goes: the title, the datacenter boxes in a row, the WAN links.

`Layout` measures the node boxes (all one size, wide enough for the longest name),
places the datacenters side by side with room between them for their WAN labels,
draws each datacenter's header, network bar and grid of node boxes
(`topology.draw.nodes`), the WAN links, and the legend under it all
(`topology.draw.legend`). It records where it drew what in `Layout.anchors`.
"""

from __future__ import annotations

import math

from weightfabric.topology.draw.anchors import Anchors, Segment
from weightfabric.topology.draw.cells import dc_totals, grid_cells, group_size, roles_tag
from weightfabric.topology.draw.labels import cpu_label, network_label, plural, wan_label
from weightfabric.topology.draw.legend import draw_legend
from weightfabric.topology.draw.nodes import NodeDrawer
from weightfabric.topology.draw.painter import Painter
from weightfabric.topology.draw.style import (
    CELL_GAP,
    COLUMNS,
    DC_EDGE,
    DC_FACE,
    DC_PAD,
    DOMAIN_INK,
    GPU,
    GPU_COLOURS,
    GPU_GAP,
    GPUS_PER_ROW,
    INK,
    LANE,
    MARGIN,
    MAX_INNER,
    MUTED,
    NAME_H,
    NET_H,
    NETWORK,
    NIC_H,
    NVLINK_GAP,
    NVLINK_H,
    PAD,
    PCIE_H,
    WAN,
    WAN_W,
)
from weightfabric.topology.schema import Cluster, Datacenter

_Line = tuple[str, float, bool, str]  # a line of a datacenter's header: text, size, bold, colour


class Layout:
    """Places and draws the title, the datacenters, the WAN links and the legend."""

    def __init__(self, cluster: Cluster, painter: Painter) -> None:
        self.cluster = cluster
        self.p = painter
        self.cells = {dc.name: grid_cells(cluster, dc) for dc in cluster.datacenters}
        self.types = list({g.type: cluster.node_types[g.type]
                           for dc in cluster.datacenters for g in dc.nodes}.values())
        models = dict.fromkeys(t.gpu.model if t.gpu else "GPU" for t in self.types if t.gpus)
        self.colours = {m: GPU_COLOURS[i % len(GPU_COLOURS)] for i, m in enumerate(models)}
        max_gpus = max((t.gpus for t in self.types), default=0)
        per_row = min(max(max_gpus, 1), GPUS_PER_ROW)
        gpu_rows = max(1, math.ceil(max_gpus / GPUS_PER_ROW))
        wanted = [per_row * GPU + (per_row - 1) * GPU_GAP, 1.3]
        for cell in (c for cells in self.cells.values() for c in cells if not c.hidden):
            tag, trainer = roles_tag(cluster, cell.label)
            wanted.append(painter.width(cell.label, 8.5)
                          + (painter.width(tag, 8, bold=trainer) + 0.1 if tag else 0))
            if cell.type and not cell.type.gpus:
                wanted.append(painter.width(cpu_label(cell.type), 8) + 0.1)
        self.cell_w = 2 * PAD + min(max(wanted), MAX_INNER)
        self.cell_h = (PAD + NAME_H + gpu_rows * GPU + (gpu_rows - 1) * GPU_GAP
                       + NVLINK_GAP + NVLINK_H + PCIE_H + NIC_H + PAD)
        self.anchors = Anchors()
        self.nodes = NodeDrawer(painter, cluster, self.colours, self.cell_w, self.cell_h,
                                gpu_rows, self.anchors)

    # -- whole picture -------------------------------------------------------------

    def draw(self, title: str, notes: tuple[str, ...] = ()) -> tuple[float, float]:
        """Draw everything, with `notes` as lines under the title.

        Return the figure's (width, height) in inches.
        """
        p, cluster = self.p, self.cluster
        totals = [dc_totals(cluster, dc) for dc in cluster.datacenters]
        nodes, gpus, nics = (sum(t[i] for t in totals) for i in range(3))
        n_dc = len(cluster.datacenters)
        subtitle = (f"{plural(n_dc, 'datacenter')} · {plural(nodes, 'node')} · "
                    f"{plural(gpus, 'GPU')} · {plural(nics, 'NIC')} · bandwidths per direction")
        p.text(MARGIN, MARGIN, title, 16, bold=True)
        for i, line in enumerate((subtitle, *notes)):
            p.text(MARGIN, MARGIN + 0.34 + 0.22 * i, line, 10, color=MUTED if i == 0 else INK)
        top = MARGIN + 0.8 + 0.22 * len(notes)

        headers = [self._header(dc, t) for dc, t in zip(cluster.datacenters, totals, strict=True)]
        widths = [self._dc_width(dc, h) for dc, h in zip(cluster.datacenters, headers, strict=True)]
        header_h = max(0.32 + 0.24 * (len(h) - 1) for h in headers) + 0.12
        gaps = [self._gap_width(i) for i in range(n_dc - 1)]
        xs = [MARGIN]
        for w, gap in zip(widths, gaps, strict=False):
            xs.append(xs[-1] + w + gap)
        names = [dc.name for dc in cluster.datacenters]
        lanes = sum(_adjacent(names, w.between) is None for w in cluster.wan)
        lane_top, top = top, top + LANE * lanes
        self._wan(xs, widths, lane_top, top + DC_PAD + header_h + NET_H / 2)
        boxes = [(x, x + w, self._datacenter(dc, x, top, w, header, header_h))
                 for dc, x, w, header in zip(cluster.datacenters, xs, widths, headers, strict=True)]
        content_w = xs[-1] + widths[-1]
        legend_w, legend_bottom = draw_legend(p, cluster, self.types, self.colours, boxes,
                                                content_w - MARGIN)
        width = max(content_w, MARGIN + legend_w, MARGIN + p.width(title, 16, bold=True),
                    *(MARGIN + p.width(line, 10) for line in (subtitle, *notes))) + MARGIN
        return width, max(legend_bottom, *(b for _, _, b in boxes)) + MARGIN

    # -- datacenters ---------------------------------------------------------------

    def _header(self, dc: Datacenter, totals: tuple[int, int, int]) -> list[_Line]:
        """Header lines of a datacenter box: name, counts, NVLink domains."""
        nodes, gpus, nics = totals
        lines = [(dc.name, 13.0, True, INK),
                 (f"{plural(nodes, 'node')} · {plural(gpus, 'GPU')} · {plural(nics, 'NIC')}",
                  10.0, False, MUTED)]
        domains: dict[str, tuple[int, int]] = {}
        for g in dc.nodes:
            if g.nvlink_domain:
                n, k = domains.get(g.nvlink_domain, (0, 0))
                size = group_size(g)
                gpus = size * self.cluster.node_types[g.type].gpus
                domains[g.nvlink_domain] = (n + size, k + gpus)
        for name, (n, k) in domains.items():
            lines.append((f"NVLink domain {name}: {plural(n, 'node')} · {plural(k, 'GPU')}",
                          9.5, False, DOMAIN_INK))
        return lines

    def _grid_size(self, dc: Datacenter) -> tuple[float, float]:
        n = len(self.cells[dc.name])
        cols = min(n, COLUMNS)
        rows = math.ceil(n / cols)
        return (cols * self.cell_w + (cols - 1) * CELL_GAP,
                rows * self.cell_h + (rows - 1) * CELL_GAP)

    def _dc_width(self, dc: Datacenter, header: list[_Line]) -> float:
        text_w = max(self.p.width(t, s, bold=b) for t, s, b, _ in header)
        net_w = self.p.width(network_label(dc), 9) + 0.3
        return 2 * DC_PAD + max(self._grid_size(dc)[0], text_w, net_w)

    def _datacenter(self, dc: Datacenter, x: float, y: float, w: float,
                    header: list[_Line], header_h: float) -> float:
        """Draw a datacenter box with its top-left corner at (x, y); return its bottom."""
        p = self.p
        ty = y + DC_PAD
        for text, size, bold, colour in header:
            p.text(x + DC_PAD, ty, text, size, bold=bold, color=colour)
            ty += 0.32 if bold else 0.24
        net_y = y + DC_PAD + header_h
        p.box(x + DC_PAD, net_y, w - 2 * DC_PAD, NET_H, face=NETWORK, radius=0.08, z=3)
        self.anchors.networks[dc.name] = (x + DC_PAD, net_y, w - 2 * DC_PAD, NET_H)
        p.text(x + w / 2, net_y + NET_H / 2, network_label(dc), 9, color="white",
               ha="center", va="center")
        grid_w, grid_h = self._grid_size(dc)
        gx, gy = x + (w - grid_w) / 2, net_y + NET_H + 0.25
        cells = self.cells[dc.name]
        cols = min(len(cells), COLUMNS)
        for row_start in range(0, len(cells), cols):
            row = cells[row_start:row_start + cols]
            cy = gy + (row_start // cols) * (self.cell_h + CELL_GAP)
            self.nodes.domain_bands(row, gx, cy)
            for col, cell in enumerate(row):
                cx = gx + col * (self.cell_w + CELL_GAP)
                if cell.hidden:
                    self.nodes.more(cell, cx, cy)
                else:
                    self.nodes.node(cell, cx, cy)
        bottom = gy + grid_h + DC_PAD
        p.box(x, y, w, bottom - y, face=DC_FACE, edge=DC_EDGE, lw=1.4, radius=0.16, z=0)
        self.anchors.datacenters.append((x, y, w, bottom - y))
        return bottom

    # -- WAN -----------------------------------------------------------------------

    def _gap_width(self, i: int) -> float:
        """Room between datacenters i and i + 1: enough for their WAN labels."""
        names = [dc.name for dc in self.cluster.datacenters]
        labels = [line for w in self.cluster.wan if _adjacent(names, w.between) == i
                  for line in wan_label(w.bandwidth, w.latency)]
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
            label = wan_label(w.bandwidth, w.latency)
            gateways = (f"{names[a]}/wan", f"{names[b]}/wan")  # left, right
            x0, x1 = xs[a] + widths[a] - DC_PAD, xs[b] + DC_PAD
            if b == a + 1:
                k = in_gap.get(a, 0)
                in_gap[a] = k + 1
                y = line_y + 0.06 + 0.9 * k
                p.lines([((x0, y), (x1, y))], color=WAN, lw=WAN_W, z=2)
                self._wan_anchors(gateways, [((x0, y), (x1, y))])
                p.text((xs[a] + widths[a] + xs[b]) / 2, y - 0.12, "\n".join(label), 9.5,
                       bold=True, color=WAN, ha="center", va="bottom", linespacing=1.3)
                continue
            # up the gaps next to the two boxes, across above the boxes
            y = lane_top + LANE * (lane + 0.5)
            xa, xb = xs[a] + widths[a] + 0.12 * (lane + 1), xs[b] - 0.12 * (lane + 1)
            lane += 1
            join = line_y - 0.08
            route = [((x0, join), (xa, join)), ((xa, join), (xa, y)), ((xa, y), (xb, y)),
                     ((xb, y), (xb, join)), ((xb, join), (x1, join))]
            p.lines(route, color=WAN, lw=WAN_W * 0.6, z=2)
            self._wan_anchors(gateways, route)
            p.text((xa + xb) / 2, y, " · ".join(label), 9, bold=True, color=WAN, ha="center",
                   va="center", z=7, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})

    def _wan_anchors(self, gateways: tuple[str, str], route: list[Segment]) -> None:
        """Record a WAN link's line, drawn from the left gateway to the right one."""
        left, right = gateways
        self.anchors.add_link(left, right, *route)
        self.anchors.wan_ends[(left, right)] = route[0][0]
        self.anchors.wan_ends[(right, left)] = route[-1][1]


def _adjacent(names: list[str], between: tuple[str, str]) -> int | None:
    """The gap index a WAN link crosses when it joins neighbouring datacenters."""
    a, b = sorted(names.index(n) for n in between)
    return a if b == a + 1 else None


__all__ = ["Layout"]
