"""A broadcast plan drawn over the picture of its cluster.

`draw_plan` draws the cluster as `topology.draw.draw_cluster` does, fades it under a
white veil, then draws on top what the plan uses:

- each link the plan sends bytes over, where the picture shows it (a GPU's stretch
  of its NVLink bar, its PCIe port as a stem under it and the port's line on to a
  NIC, a WAN line), the line's width proportional to the bytes it carries, both
  directions summed: `FULL_W` points for a whole version between machines,
  `NODE_W` inside machines (NVLink bars carry up to twice the version);
- the network hops, NIC to NIC (through the WAN line where they cross it), as
  arrows of the same width scale: the route through leaf and spine switches is not
  drawn, and the NIC links carry what the arrows at them carry. A stripe whose byte
  sub-ranges reach a datacenter over several WAN paths keeps its colour on each; the
  WAN lines leaving one side of a datacenter meet its hops at one point, so the arrow
  on from there is as wide as the sub-ranges together, and each WAN line is labelled
  with the bytes it carries;
- the NICs and network bars in use, unfaded; sources (black) and readers (in their
  GPU colour);
- a legend of the above, under the cluster's.

Legibility: when the plan has more than `MAX_ARCS` hops between machines, only the
tree of the stripe with the most hops is drawn (the others are alike on other NICs,
which show lit). Nodes folded into a "+N more" box send and receive at the box; hops
among folded nodes are left out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import networkx as nx
from matplotlib.figure import Figure

from weightfabric.topology.draw.anchors import Anchors, Point, Rect, centre
from weightfabric.topology.draw.labels import plural, size_text
from weightfabric.topology.draw.layout import Layout
from weightfabric.topology.draw.legend import Table
from weightfabric.topology.draw.painter import Painter, save_palette_png
from weightfabric.topology.draw.style import DPI, MARGIN, NETWORK, NIC, NVLINK, WAN, WAN_W
from weightfabric.topology.plan import Plan, Transfer, link_bytes
from weightfabric.topology.schema import Cluster

FULL_W = 8.0  # points: a line between machines carrying the whole version once
NODE_W = 3.0  # points: the same inside machines
MIN_W = 0.75  # points: the thinnest line drawn
MAX_ARCS = 64  # hops between machines drawn, every stripe's; more: one stripe's tree
VEIL = 0.72  # opacity of the white veil over the cluster
# Stripes: unlike NVLink green, WAN red, the sources' black and, the first ones most,
# the GPU models' colours.
STRIPE_COLOURS = ("#D81B60", "#00838F", "#1A237E", "#F57C00", "#6A1B9A", "#5D4037",
                  "#FBC02D", "#00B8D4", "#F06292", "#827717")
SOURCE, PCIE_INK = "#111111", "#4D4D4D"
TIER_INK = {"nvlink": NVLINK, "pcie": PCIE_INK, "wan": WAN}

Waypoint = str | tuple[str, str]  # a NIC, or a WAN line's end: (gateway, other gateway)
Leg = tuple[Waypoint, Waypoint, int]  # from, to, stripe
PlacedLeg = tuple[Point, Point, int]  # from, to (where the picture shows them), stripe


def draw_plan(cluster: Cluster, plan: Plan, path: str | Path, *, title: str | None = None,
              notes: tuple[str, ...] = (), graph: nx.DiGraph | None = None) -> None:
    """Draw `plan` over the picture of `cluster` to a PNG file.

    Args:
        cluster, plan: The cluster and a plan of a broadcast on it (`topology.planner`).
        path: The PNG file to write (overwritten).
        title: Heading; by default the cluster, the size and the predicted time.
        notes: Lines under the heading, after the cluster's counts and the plan's.
        graph: ``cluster.graph()``, if already built.
    """
    graph = graph if graph is not None else cluster.graph()
    fig = Figure(dpi=DPI)
    painter = Painter(fig)
    layout = Layout(cluster, painter)
    title = title or (f"{cluster.name}: broadcast of {size_text(plan.size)}, "
                      f"predicted {plan.predicted_s:.3g} s")
    width, height = layout.draw(title, (plan_line(plan), *notes))
    overlay = _Overlay(painter, layout.anchors, plan, graph)
    overlay.draw()
    legend_w, bottom = overlay.legend(MARGIN, height - MARGIN + 0.1)
    width, height = max(width, 2 * MARGIN + legend_w), bottom + MARGIN
    fig.set_size_inches(width, height)
    painter.ax.set_xlim(0, width)
    painter.ax.set_ylim(height, 0)
    save_palette_png(fig, path)


def plan_line(plan: Plan) -> str:
    """The plan in one line: sources, readers, stripes, chunk, depth."""
    return (f"{plural(len(plan.sources), 'source')} · {plural(len(plan.needs), 'reader')} · "
            f"{plural(len(plan.stripes), 'stripe')} · chunks of {size_text(plan.chunk)} · "
            f"trees {plan.depth()} hops deep")


def network_legs(transfers: Iterable[Transfer], kinds: Mapping[str, str]) -> Counter[Leg]:
    """Bytes of each stripe on each network leg of the transfers' paths.

    A path's legs run from its first NIC to its last, broken where the path crosses
    a WAN link: NIC -> end of the WAN line at the first gateway, then from the end
    at the other gateway on. `kinds` maps vertices to their kind (``"nic"``,
    ``"wan"``, ...), as `topology.layout.Layout.kinds` does.
    """
    out: Counter[Leg] = Counter()
    for t in transfers:
        nics = [v for v in t.path if kinds[v] == "nic"]
        if not nics:
            continue
        stops: list[Waypoint] = [nics[0]]
        for u, v in zip(t.path, t.path[1:], strict=False):
            if kinds[u] == kinds[v] == "wan":
                stops += [(u, v), (v, u)]
        stops.append(nics[-1])
        for a, b in zip(stops[::2], stops[1::2], strict=True):
            out[(a, b, t.stripe)] += t.nbytes
    return out


def split_stripes(transfers: Iterable[Transfer], kinds: Mapping[str, str]) -> list[int]:
    """The stripes whose bytes enter some datacenter over more than one WAN link, sorted."""
    came_from: defaultdict[tuple[int, str], set[str]] = defaultdict(set)
    for t in transfers:
        for u, v in zip(t.path, t.path[1:], strict=False):
            if kinds[u] == kinds[v] == "wan":
                came_from[(t.stripe, v)].add(u)
    return sorted({stripe for (stripe, _), gateways in came_from.items() if len(gateways) > 1})


def wan_points(anchors: Anchors, graph: nx.DiGraph) -> dict[tuple[str, str], Point]:
    """Where hops meet each WAN line's end: level with the middle of its network bar.

    The WAN lines leaving one side of a datacenter all start at the bar's end, so they
    share this point whatever their height.
    """
    out: dict[tuple[str, str], Point] = {}
    for (gateway, other), (x, _) in anchors.wan_ends.items():
        _, y, _, h = anchors.networks[graph.nodes[gateway]["datacenter"]]
        out[(gateway, other)] = (x, y + h / 2)
    return out


def placed_legs(legs: Counter[Leg], anchors: Anchors, graph: nx.DiGraph) -> Counter[PlacedLeg]:
    """The legs between the points the picture shows their ends at, summed.

    A NIC is shown by its mark, or by the bottom edge of the box its node is folded
    into; a WAN line's end by its `wan_points` point, so the legs of a stripe that
    reaches a datacenter over several WAN links from one side join there. Legs between
    nodes folded into "+N more" boxes are left out, and so are those through a gateway
    that enter and leave on one side (the WAN lines show their bytes).
    """
    ends = wan_points(anchors, graph)
    folded = {(x + w / 2, y + h) for x, y, w, h in set(anchors.folded.values())}

    def point(waypoint: Waypoint) -> Point | None:
        if isinstance(waypoint, tuple):
            return ends.get(waypoint)
        if waypoint in anchors.nics:
            return centre(anchors.nics[waypoint])
        box = anchors.box(graph.nodes[waypoint]["node"])
        return (box[0] + box[2] / 2, box[1] + box[3]) if box is not None else None  # bottom

    out: Counter[PlacedLeg] = Counter()
    for (a, b, stripe), nbytes in legs.items():
        pa, pb = point(a), point(b)
        if pa is not None and pb is not None and pa != pb and not (pa in folded and pb in folded):
            out[(pa, pb, stripe)] += nbytes
    return out


def line_width(nbytes: float, size: int, full: float = FULL_W) -> float:
    """Points for a line carrying `nbytes` of a version of `size` bytes."""
    return max(MIN_W, full * nbytes / size)


def stripe_colour(stripe: int) -> str:
    """The colour of stripe `stripe`."""
    return STRIPE_COLOURS[stripe % len(STRIPE_COLOURS)]


class _Overlay:
    """Draws a plan over a cluster picture whose `Anchors` it is given."""

    def __init__(self, painter: Painter, anchors: Anchors, plan: Plan,
                 graph: nx.DiGraph) -> None:
        self.p, self.a, self.plan, self.graph = painter, anchors, plan, graph
        self.loads = link_bytes(plan.transfers)
        kinds = graph.nodes(data="kind")
        self.wan_ends = set(wan_points(anchors, graph).values())
        self.split = split_stripes(plan.transfers, kinds)
        legs = placed_legs(network_legs(plan.transfers, kinds), anchors, graph)
        hops = Counter(stripe for _, _, stripe in legs)
        self.stripes = sorted(hops)  # those with network hops
        if len(legs) > MAX_ARCS:  # one tree: the stripe with the most hops, the first
            tree = min(hops, key=lambda s: (-hops[s], s))
            legs = Counter({leg: n for leg, n in legs.items() if leg[2] == tree})
        self.legs = legs

    def draw(self) -> None:
        self._veil()
        self._links()
        self._network()
        self._endpoints()
        self._hops()

    def _veil(self) -> None:
        for x, y, w, h in self.a.datacenters:
            self.p.rect(x - 0.05, y - 0.05, w + 0.1, h + 0.1, face="white", alpha=VEIL, z=5.5)
        for key, segments in self.a.links.items():
            if self.graph.edges[key]["tier"] == "wan":
                self.p.lines(segments, color="white", lw=WAN_W + 1, alpha=VEIL, z=5.5)

    def _links(self) -> None:
        """Every drawn link the plan uses, as wide as the bytes it carries."""
        for key, segments in self.a.links.items():
            nbytes = self.loads.get(key, 0)
            if not nbytes:
                continue
            tier = self.graph.edges[key]["tier"]
            full = FULL_W if tier == "wan" else NODE_W
            self.p.lines(segments, color=TIER_INK[tier], z=5.6 if tier == "nvlink" else 5.62,
                         lw=line_width(nbytes, self.plan.size, full))
            if tier == "wan":
                (x0, y0), (x1, y1) = max(segments, key=lambda s: abs(s[1][0] - s[0][0]))
                self.p.text((x0 + x1) / 2, max(y0, y1) + 0.12 + full / 144, size_text(nbytes),
                            9.5, bold=True, color=WAN, ha="center", z=7)

    def _network(self) -> None:
        """Unfade the NICs and the network bars the plan sends through."""
        used: set[str] = set()
        for (u, v), nbytes in self.loads.items():
            if nbytes and self.graph.edges[u, v]["tier"] == "nic":
                nic = u if self.graph.nodes[u]["kind"] == "nic" else v
                used.add(self.graph.nodes[nic]["datacenter"])
                if nic in self.a.nics:
                    x, y, w, h = self.a.nics[nic]
                    self.p.rect(x, y, w, h, face=NIC, edge=NIC, z=5.66)
        for dc in used:
            x, y, w, h = self.a.networks[dc]
            self.p.box(x, y, w, h, face=NETWORK, radius=0.08, z=5.55)

    def _endpoints(self) -> None:
        """Sources in black, readers in their own colour.

        Where a device is not drawn, its node's box (or "+N more" box) outlined.
        """
        outlined: set[Rect] = set()
        for devices, colour in ((self.plan.sources, SOURCE), (self.plan.needs, None)):
            for device in devices:
                if device in self.a.devices:
                    (x, y, w, h), face = self.a.devices[device]
                    self.p.rect(x, y, w, h, face=colour or face, edge="white", z=5.65)
                    continue
                box = self.a.box(self.graph.nodes[device]["node"])
                if box is not None and box not in outlined:
                    outlined.add(box)
                    x, y, w, h = box
                    self.p.rect(x, y, w, h, face="none", edge=colour or PCIE_INK, lw=1.6, z=5.65)

    def _hops(self) -> None:
        """The network legs, NIC to NIC or to and from the WAN line."""
        for (a, b, stripe), nbytes in self.legs.items():
            bend = -0.1 if a in self.wan_ends or b in self.wan_ends else 0.25  # up to the WAN
            self.p.arc(a, b, color=stripe_colour(stripe), lw=line_width(nbytes, self.plan.size),
                       z=5.8, bend=bend)

    # -- legend --------------------------------------------------------------------

    def legend(self, x: float, y: float) -> tuple[float, float]:
        """Draw the plan's legend with its top-left corner at (x, y); return its (width, bottom)."""
        table = Table(self.p, ("", "plan", ""), swatch=self._swatch)
        size = self.plan.size
        table.add("source", "source",
                  f"holds the version: {plural(len(self.plan.sources), 'device')}")
        table.add("reader", "reader", plural(len(self.plan.needs), "device"))
        drawn = sorted({s for _, _, s in self.legs})
        if len(drawn) > 1:
            table.add("trees", "network hops", "NIC to NIC, one colour per stripe: "
                      + ", ".join(str(s) for s in drawn))
        elif drawn:
            others = len(self.stripes) - 1
            table.add(f"tree:{drawn[0]}", "network hops", f"stripe {drawn[0]}'s tree, NIC to NIC"
                      + (f"; the other {plural(others, 'stripe')}' trees, alike on other NICs, "
                         "are not drawn" if others else ""))
        if self.split:
            split = self.split
            listed = ", ".join(str(k) for k in split[:8]) + (
                f" and {len(split) - 8} more" if len(split) > 8 else "")
            table.add(f"split:{split[0]}", "split stripes",
                      f"{'stripe' if len(split) == 1 else 'stripes'} {listed}: byte ranges reach "
                      "a datacenter over several WAN links, in the stripe's colour on each; each "
                      "WAN line is labelled with the bytes it carries")
        table.add("full", "line width", f"{FULL_W:g} pt = {size_text(size)} between machines, "
                  f"{NODE_W:g} pt inside them (both directions)")
        table.add("faint", "faint", "not used by this plan")
        w, h = table.size()
        table.draw(x, y)
        return w, y + h

    def _swatch(self, p: Painter, kind: str, x: float, cy: float, w: float) -> None:
        if kind in ("source", "reader"):
            face = SOURCE if kind == "source" else next(
                (c for d, (_, c) in self.a.devices.items() if d in self.plan.needs), "white")
            p.rect(x + (w - 0.17) / 2, cy - 0.085, 0.17, 0.17, face=face, edge="white")
        elif kind == "trees":
            for k in range(4):
                p.arc((x, cy - 0.06 + 0.04 * k), (x + w, cy - 0.06 + 0.04 * k),
                      color=stripe_colour(k), lw=1.2, z=6)
        elif kind.startswith("tree:"):
            p.arc((x, cy - 0.05), (x + w, cy - 0.05), color=stripe_colour(int(kind[5:])),
                  lw=1.5, z=6)
        elif kind.startswith("split:"):  # two paths joining
            colour = stripe_colour(int(kind[6:]))
            for dy in (-0.07, 0.07):
                p.lines([((x, cy + dy), (x + w / 2, cy))], color=colour, lw=1.2, z=6)
            p.arc((x + w / 2, cy), (x + w, cy), color=colour, lw=1.5, z=6, bend=0)
        elif kind == "full":
            p.lines([((x, cy), (x + w, cy))], color=WAN, lw=FULL_W, z=6)
        else:  # faint
            p.rect(x, cy - 0.08, w, 0.16, face=NETWORK, alpha=1 - VEIL, z=6)


__all__ = ["FULL_W", "MAX_ARCS", "NODE_W", "draw_plan", "line_width", "network_legs",
           "placed_legs", "plan_line", "split_stripes", "stripe_colour", "wan_points"]
