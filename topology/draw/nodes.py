"""Node boxes: a node's name and roles, its GPUs, NVLink bars, NICs and PCIe lines.

Also the "+N more" boxes standing for nodes not drawn, and the green bands behind
the nodes of one NVLink domain. Every box of a picture has the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightfabric.topology.draw.anchors import Anchors, Segment
from weightfabric.topology.draw.cells import Cell, roles_tag
from weightfabric.topology.draw.labels import cpu_label, plural
from weightfabric.topology.draw.painter import Painter
from weightfabric.topology.draw.style import (
    BAND,
    BAND_PAD,
    CELL_GAP,
    EDGE,
    GPU,
    GPU_GAP,
    GPUS_PER_ROW,
    MUTED,
    NAME_H,
    NIC,
    NIC_H,
    NIC_W,
    NVLINK,
    NVLINK_GAP,
    NVLINK_H,
    PAD,
    PCIE,
    PCIE_H,
    TRAINER,
)
from weightfabric.topology.graph import gpu_vertex, host_vertex, nic_vertex, pcie_vertex
from weightfabric.topology.plan import link
from weightfabric.topology.schema import Cluster, NodeType


@dataclass
class NodeDrawer:
    """Draws node boxes of one size (``cell_w`` by ``cell_h`` inches).

    ``colours`` maps GPU models to their colour; ``gpu_rows`` is the number of GPU
    rows every box has room for. Where GPUs, NICs and links went is recorded in
    ``anchors``.
    """

    p: Painter
    cluster: Cluster
    colours: dict[str, str]
    cell_w: float
    cell_h: float
    gpu_rows: int
    anchors: Anchors

    def domain_bands(self, row: list[Cell], gx: float, cy: float) -> None:
        """A green band behind each run of cells of one NVLink domain, with a shared bar."""
        step = self.cell_w + CELL_GAP
        start = 0
        while start < len(row):
            end = start
            domain = row[start].domain
            while end + 1 < len(row) and domain and row[end + 1].domain == domain:
                end += 1
            t = row[start].type
            if domain and t and t.nvlink and t.nvlink.groups is None:
                x0, x1 = gx + start * step, gx + end * step + self.cell_w
                self.p.box(x0 - BAND_PAD, cy - BAND_PAD, x1 - x0 + 2 * BAND_PAD,
                           self.cell_h + 2 * BAND_PAD, face=BAND, edge=NVLINK, lw=1.0,
                           radius=0.1, z=1)
                self.p.rect(x0 + PAD, self._nvlink_y(cy), x1 - x0 - 2 * PAD, NVLINK_H,
                            face=NVLINK, z=5)
            start = end + 1

    def _nvlink_y(self, cy: float) -> float:
        return (cy + PAD + NAME_H + self.gpu_rows * GPU + (self.gpu_rows - 1) * GPU_GAP
                + NVLINK_GAP)

    def node(self, cell: Cell, x: float, y: float) -> None:
        """The box of node `cell`, its top-left corner at (x, y)."""
        p, t, name = self.p, cell.type, cell.label
        assert t is not None
        inner = self.cell_w - 2 * PAD
        self.anchors.cells[name] = (x, y, self.cell_w, self.cell_h)
        tag, trainer = roles_tag(self.cluster, cell.label)
        p.box(x, y, self.cell_w, self.cell_h, face="white", edge=TRAINER if trainer else EDGE,
              lw=1.8 if trainer else 0.9, z=3)
        room = inner
        if tag:  # right of the name, the trainer's in colour
            room -= p.width(tag, 8, bold=trainer) + 0.1
            p.text(x + self.cell_w - PAD, y + PAD, tag, 8, bold=trainer,
                   color=TRAINER if trainer else MUTED, ha="right")
        p.text(x + PAD, y + PAD - 0.01, p.fit(cell.label, room, 8.5), 8.5)
        gy = y + PAD + NAME_H
        nv_y = self._nvlink_y(y)
        nic_y = nv_y + NVLINK_H + PCIE_H
        gpus: list[tuple[float, float]] = []  # top-left corners
        if t.gpus == 0:
            p.box(x + PAD, gy, inner, GPU + 0.04, face="#EDEDED", edge="#BDBDBD", lw=0.8,
                  radius=0.03, z=4)
            self.anchors.devices[host_vertex(name)] = ((x + PAD, gy, inner, GPU + 0.04),
                                                       "#EDEDED")
            p.text(x + self.cell_w / 2, gy + (GPU + 0.04) / 2, p.fit(cpu_label(t), inner, 8),
                   8, color=MUTED, ha="center", va="center")
        else:
            colour = self.colours[t.gpu.model if t.gpu else "GPU"]
            per_row = min(t.gpus, GPUS_PER_ROW)
            x0 = x + (self.cell_w - (per_row * GPU + (per_row - 1) * GPU_GAP)) / 2
            for j in range(t.gpus):
                gx = x0 + (j % per_row) * (GPU + GPU_GAP)
                gpus.append((gx, gy + (j // per_row) * (GPU + GPU_GAP)))
                p.rect(gx, gpus[-1][1], GPU, GPU, face=colour, edge="white")
                self.anchors.devices[gpu_vertex(name, j)] = ((gx, gpus[-1][1], GPU, GPU), colour)
            if t.nvlink is not None and (cell.domain is None or t.nvlink.groups is not None):
                for group in t.nvlink.groups or (tuple(range(t.gpus)),):
                    left = min(gpus[j][0] for j in group)
                    right = max(gpus[j][0] for j in group) + GPU
                    p.rect(left, nv_y, right - left, NVLINK_H, face=NVLINK, z=5)
            if t.nvlink is not None:
                self._nvlink_anchors(cell, t, gpus, nv_y + NVLINK_H / 2)
        if t.nics is not None:
            self._nics(name, t, x, nic_y, gpus)

    def _nvlink_anchors(self, cell: Cell, t: NodeType, gpus: list[tuple[float, float]],
                        y: float) -> None:
        """Record each NVLink link on the bar.

        A GPU's stretch of it to the NVSwitch, or the stretch between the two GPUs of a link
        within ``nvlink.groups``.
        """
        assert t.nvlink is not None
        name = cell.label
        if t.nvlink.groups is None:
            switch = f"nvdomain/{cell.domain}" if cell.domain else f"{name}/nvswitch"
            for j, (gx, _) in enumerate(gpus):
                self.anchors.add_link(gpu_vertex(name, j), switch,
                                      ((gx - GPU_GAP / 2, y), (gx + GPU + GPU_GAP / 2, y)))
            return
        for group in t.nvlink.groups:
            for a in group:
                for b in (b for b in group if b > a):
                    self.anchors.add_link(gpu_vertex(name, a), gpu_vertex(name, b),
                                          ((gpus[a][0] + GPU / 2, y), (gpus[b][0] + GPU / 2, y)))

    def _nics(self, name: str, t: NodeType, x: float, nic_y: float,
              gpus: list[tuple[float, float]]) -> None:
        """NIC marks under the GPUs they serve, joined to them by PCIe lines."""
        nics = t.nics
        assert nics is not None
        inner = self.cell_w - 2 * PAD
        mark_w = min(NIC_W, 0.8 * inner / nics.count)
        if gpus and nics.count <= len(gpus):
            served: dict[int, list[float]] = {}
            for j, k in nics.rails(t.gpus):
                served.setdefault(k, []).append(gpus[j][0] + GPU / 2)
            centres = [sum(served[k]) / len(served[k]) for k in range(nics.count)]
        else:  # spread evenly, under the GPUs if there is room
            mid = x + self.cell_w / 2
            span = min(inner, max(2 * (mid - gpus[0][0]) if gpus else inner,
                                  1.5 * mark_w * nics.count))
            step = span / nics.count
            centres = [mid - span / 2 + (k + 0.5) * step for k in range(nics.count)]
        if gpus:
            rows_bottom = max(g[1] for g in gpus) + GPU
            lines = {(j, k): ((gpus[j][0] + GPU / 2, rows_bottom if gpus[j][1] + GPU >= rows_bottom
                               else gpus[j][1] + GPU), (centres[k], nic_y))
                     for j, k in nics.rails(t.gpus)}
            self.p.lines(list(lines.values()), color=PCIE, lw=0.8, z=3.5)
            self._rail_anchors(name, lines, (rows_bottom + nic_y) / 2)
        rdma = nics.kind == "rdma"
        for k, c in enumerate(centres):
            self.p.rect(c - mark_w / 2, nic_y, mark_w, NIC_H, face=NIC if rdma else "white",
                        edge=NIC, z=5)
            self.anchors.nics[nic_vertex(name, k)] = (c - mark_w / 2, nic_y, mark_w, NIC_H)

    def _rail_anchors(self, name: str, lines: dict[tuple[int, int], Segment],
                      mid_y: float) -> None:
        """Record the PCIe links of the line from GPU j to NIC k.

        A stem straight down from the GPU to `mid_y` is its port (shared by host and NIC
        traffic), the rest of the way the port's link to the NIC.
        """
        for (j, k), ((x0, y0), end) in lines.items():
            port = pcie_vertex(name, j)
            if link(gpu_vertex(name, j), port) not in self.anchors.links:  # one stem per port
                self.anchors.add_link(gpu_vertex(name, j), port, ((x0, y0), (x0, mid_y)))
            self.anchors.add_link(port, nic_vertex(name, k), ((x0, mid_y), end))

    def more(self, cell: Cell, x: float, y: float) -> None:
        """The box standing for nodes not drawn."""
        p = self.p
        inner = self.cell_w - 2 * PAD
        p.box(x, y, self.cell_w, self.cell_h, face="#F1F1F1", edge=EDGE, lw=0.9, ls="--", z=3)
        self.anchors.folded.update(dict.fromkeys(cell.members(), (x, y, self.cell_w, self.cell_h)))
        p.text(x + self.cell_w / 2, y + PAD, cell.label, 10, bold=True, ha="center")
        p.text(x + self.cell_w / 2, y + PAD + NAME_H + 0.03, p.fit(cell.detail, inner, 8.5),
               8.5, color=MUTED, ha="center")
        if cell.type is not None and cell.type.gpus:
            gpus = cell.hidden * cell.type.gpus
            p.text(x + self.cell_w / 2, y + self.cell_h - PAD, plural(gpus, "GPU"), 8.5,
                   color=MUTED, ha="center", va="bottom")


__all__ = ["NodeDrawer"]
