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

`draw_plan` draws a broadcast plan over the same picture (`topology.draw.overlay`).

Modules: `layout` (placing datacenters, WAN links), `nodes` (node boxes: GPUs,
NVLink, NICs, PCIe), `legend` (link tiers, GPU models), `cells` (which boxes a
datacenter's grid shows), `labels` (texts), `painter` (drawing primitives,
text measurement), `style` (sizes, colours), `anchors` (where each vertex and link
was drawn), `overlay` (a plan over the picture).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from weightfabric.topology.draw.layout import Layout
from weightfabric.topology.draw.overlay import draw_plan
from weightfabric.topology.draw.painter import Painter
from weightfabric.topology.draw.style import DPI, MAX_FULL_NODES, SHOWN_PER_GROUP
from weightfabric.topology.schema import Cluster

__all__ = ["MAX_FULL_NODES", "SHOWN_PER_GROUP", "draw_cluster", "draw_plan"]


def draw_cluster(cluster: Cluster, path: str | Path, *, title: str | None = None) -> None:
    """Draw `cluster` to a PNG file.

    Args:
        cluster: The cluster to draw, as `topology.load_cluster` returns it.
        path: The PNG file to write (overwritten).
        title: Heading of the picture; the cluster's name by default.

    Notes:
        Uses matplotlib's Agg canvas directly and never pyplot, so it changes no global
        state and needs no display. Work is bounded by the number of datacenters and node
        groups, not nodes: a 10,000-GPU cluster draws in about a second.
    """
    fig = Figure(dpi=DPI)
    painter = Painter(fig)
    width, height = Layout(cluster, painter).draw(title or cluster.name)
    fig.set_size_inches(width, height)
    painter.ax.set_xlim(0, width)
    painter.ax.set_ylim(height, 0)
    fig.savefig(path, dpi=DPI, facecolor="white", format="png")
