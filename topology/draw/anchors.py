"""Where a cluster picture put each graph vertex and link, for drawing over it.

`Layout` fills an `Anchors` as it draws; `topology.draw.overlay` reads it to draw a
broadcast plan on the same picture. Keys are vertex names of `topology.graph` and
links as `topology.plan.link` writes them; positions are in inches, y downwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightfabric.topology.plan import Link, link

Point = tuple[float, float]
Segment = tuple[Point, Point]
Rect = tuple[float, float, float, float]  # left, top, width, height


@dataclass
class Anchors:
    """Positions of what a plan overlay draws on.

    Attributes:
        devices (dict): GPU vertex -> (its square, its colour); host vertex of a node without
            GPUs -> (its grey box, colour).
        nics (dict): NIC vertex -> its mark.
        links (dict): Link -> the segments drawn for it: a GPU's stretch of its NVLink bar, its
            PCIe port (a stem under the GPU), the port's line on to a NIC, a WAN line.
        wan_ends (dict): (gateway, other gateway) -> where their WAN line leaves the first one's
            datacenter.
        cells (dict): Node drawn -> its box.
        folded (dict): Node not drawn -> the "+N more" box standing for it.
        networks (dict): Datacenter -> its network bar.
        datacenters (list): The datacenters' boxes.
    """

    devices: dict[str, tuple[Rect, str]] = field(default_factory=dict)
    nics: dict[str, Rect] = field(default_factory=dict)
    links: dict[Link, list[Segment]] = field(default_factory=dict)
    wan_ends: dict[tuple[str, str], Point] = field(default_factory=dict)
    cells: dict[str, Rect] = field(default_factory=dict)
    folded: dict[str, Rect] = field(default_factory=dict)
    networks: dict[str, Rect] = field(default_factory=dict)
    datacenters: list[Rect] = field(default_factory=list)

    def add_link(self, u: str, v: str, *segments: Segment) -> None:
        """Add `segments` to the link between `u` and `v`."""
        self.links.setdefault(link(u, v), []).extend(segments)

    def box(self, node: str) -> Rect | None:
        """The box showing `node`: its own, or the "+N more" box folding it."""
        return self.cells.get(node) or self.folded.get(node)


def centre(rect: Rect) -> Point:
    """The centre of `rect`."""
    x, y, w, h = rect
    return x + w / 2, y + h / 2


__all__ = ["Anchors", "Point", "Rect", "Segment", "centre"]
