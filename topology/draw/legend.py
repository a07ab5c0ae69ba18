"""The legend under a cluster picture: link tiers and GPU models, as tables."""

from __future__ import annotations

from collections.abc import Callable

from weightfabric.topology.draw.cells import group_size
from weightfabric.topology.draw.labels import latency_text, nic_bandwidth, size_text
from weightfabric.topology.draw.painter import Painter
from weightfabric.topology.draw.style import (
    INK,
    MARGIN,
    MUTED,
    NETWORK,
    NIC,
    NIC_H,
    NIC_W,
    NVLINK,
    NVLINK_H,
    PCIE,
    WAN,
    WAN_W,
)
from weightfabric.topology.schema import Cluster, NodeType
from weightfabric.topology.units import human_bandwidth


def draw_legend(p: Painter, cluster: Cluster, types: list[NodeType], colours: dict[str, str],
                boxes: list[tuple[float, float, float]], room: float) -> tuple[float, float]:
    """Draw the link-tier and GPU-model tables under the datacenter boxes.

    `boxes` holds each box's (left, right, bottom). The tables go side by side when
    they fit in `room`, else one under the other, whichever leaves the picture
    shorter; they rise into the space under short boxes. Returns (width, bottom).
    """
    tiers = Table(p, ("", "link tier", "bandwidth per direction", "latency", "where"))
    for row in _tier_rows(cluster, types):
        tiers.add(*row)
    models = Table(p, ("", "GPU", "memory", "count"))
    for model, (memory, count) in _gpu_models(cluster).items():
        models.add(f"gpu:{colours[model]}", model, memory, f"{count:,}")
    (tw, th), (mw, mh) = tiers.size(), models.size()
    layouts = [((0.0, th + 0.2), max(tw, mw), th + 0.2 + mh)]  # models under tiers
    if not models.rows:
        layouts = [((0.0, 0.0), tw, th)]
    elif tw + 0.5 + mw <= max(room, tw):
        layouts.insert(0, ((tw + 0.5, 0.0), tw + 0.5 + mw, max(th, mh)))

    def top(width: float) -> float:
        return max(b for left, _, b in boxes if left < MARGIN + width) + 0.3

    (mx, my), width, height = min(layouts, key=lambda lay: top(lay[1]) + lay[2])
    y = top(width)
    tiers.draw(MARGIN, y)
    if models.rows:
        models.draw(MARGIN + mx, y + my)
    return width, y + height


Swatch = Callable[[Painter, str, float, float, float], None]
"""Draws a legend row's sample: (painter, kind, left, centre y, width)."""


class Table:
    """A legend table: a swatch, then text columns; the first row is the heading.

    `swatch` draws each row's sample from the row's first entry, a kind (default:
    link tiers and GPU models).
    """

    SIZE, ROW_H, SWATCH_W, COL_GAP = 9.5, 0.26, 0.45, 0.25

    def __init__(self, painter: Painter, heading: tuple[str, ...],
                 swatch: Swatch | None = None) -> None:
        self.p = painter
        self.heading = heading
        self.swatch = swatch or _swatch
        self.rows: list[tuple[str, ...]] = []

    def add(self, swatch: str, *texts: str) -> None:
        """Add a row: a swatch kind, then its texts."""
        self.rows.append((swatch, *texts))

    def _widths(self) -> list[float]:
        cols = list(zip(self.heading, *self.rows, strict=True))[1:]
        return [max(self.p.width(t, self.SIZE, bold=i == 0) for t in col)
                for i, col in enumerate(cols)]

    def size(self) -> tuple[float, float]:
        """Width and height of the table, in inches."""
        widths = self._widths()
        return (self.SWATCH_W + 0.1 + sum(widths) + self.COL_GAP * (len(widths) - 1),
                self.ROW_H * (len(self.rows) + 1))

    def draw(self, x: float, y: float) -> None:
        """Draw the table with its top left corner at (`x`, `y`)."""
        widths = self._widths()
        for r, row in enumerate([self.heading, *self.rows]):
            cy = y + self.ROW_H * (r + 0.5)
            if r:
                self.swatch(self.p, row[0], x, cy, self.SWATCH_W)
            tx = x + self.SWATCH_W + 0.1
            for i, (text, w) in enumerate(zip(row[1:], widths, strict=True)):
                self.p.text(tx, cy, text, self.SIZE if r else 8.5, bold=r > 0 and i == 0,
                            color=INK if r else MUTED, va="center")
                tx += w + self.COL_GAP


def _swatch(p: Painter, kind: str, x: float, cy: float, w: float) -> None:
    """The legend's sample of a link tier or a GPU model, centred on `cy`."""
    if kind == "nvlink":
        p.rect(x, cy - NVLINK_H / 2, w, NVLINK_H, face=NVLINK)
    elif kind == "pcie":
        p.lines([((x, cy), (x + w, cy))], color=PCIE, lw=1.2, z=4)
    elif kind in ("rdma", "tcp"):
        for k in range(3):
            p.rect(x + 0.04 + k * 0.14, cy - NIC_H / 2, NIC_W, NIC_H,
                   face=NIC if kind == "rdma" else "white", edge=NIC)
    elif kind == "network":
        p.box(x, cy - 0.08, w, 0.16, face=NETWORK, radius=0.04, z=4)
    elif kind == "wan":
        p.lines([((x, cy), (x + w, cy))], color=WAN, lw=WAN_W, z=4)
    elif kind.startswith("gpu:"):
        p.rect(x + (w - 0.2) / 2, cy - 0.1, 0.2, 0.2, face=kind[4:], edge="white")


def _tier_rows(cluster: Cluster, types: list[NodeType]) -> list[tuple[str, str, str, str, str]]:
    """Legend rows (swatch, tier, bandwidth, latency, where), alike values merged."""
    found: dict[tuple[str, str, str, str], list[str]] = {}

    def add(kind: str, tier: str, bandwidth: str, latency: float, where: str) -> None:
        found.setdefault((kind, tier, bandwidth, latency_text(latency)), []).append(where)

    for t in types:
        if t.nvlink:
            joined = "per GPU, NVSwitch" if t.nvlink.groups is None else "per GPU, in groups"
            add("nvlink", "NVLink", f"{human_bandwidth(t.nvlink.bandwidth)} {joined}",
                t.nvlink.latency, t.name)
    for t in types:
        if t.pcie:
            add("pcie", "PCIe", f"{human_bandwidth(t.pcie.bandwidth)} per GPU port (host and NIC share it)",
                t.pcie.latency, t.name)
    for t in types:
        if t.nics:
            nics = t.nics
            add(nics.kind, f"NIC ({nics.kind.upper()})",
                f"{nic_bandwidth(nics.bandwidth)} × {nics.count} per node", nics.latency, t.name)
    for dc in cluster.datacenters:
        oversub = dc.network.oversubscription
        uplink = "leaf uplinks = Σ NICs" + (f" ÷ {oversub:g}" if oversub != 1 else "")
        add("network", "Datacenter", uplink, dc.network.latency, dc.name)
    for w in cluster.wan:
        add("wan", "WAN", nic_bandwidth(w.bandwidth), w.latency, " ↔ ".join(w.between))
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
                memory = size_text(t.gpu.memory) if t.gpu and t.gpu.memory else "–"
                models[model] = (memory, models.get(model, ("", 0))[1] + group_size(g) * t.gpus)
    return models


__all__ = ["Swatch", "Table", "draw_legend"]
