"""WAN trees: a stripe's way across datacenters, split over several WAN paths.

The datacenters and their WAN links form a small graph. A stripe must reach every
datacenter with readers (*needed*) from the ones holding it (*roots*), at a rate of
at most ``F = min over needed d of maxflow(roots -> d)``. One tree over the
datacenters can be far below that: with ``train -> east`` at 100 Gb/s, ``train ->
west`` at 400 and ``west -> east`` at 50, the widest tree feeds east at 100 Gb/s and
the max-flow is 150. `wan_trees` packs trees of total width ``F`` instead (Edmonds'
branching theorem, fractional form: arborescences of total width ``min_d
maxflow(r -> d)`` exist when every datacenter is needed), peeling them off the residual
capacities one at a time:

1. Grow a tree from the roots, widest extension first (an arc, or a path through
   datacenters without readers; among equally wide ones, the one with the most
   capacity left of its own, so that trees share few links). An extension is taken only if, with a sliver
   ``delta0`` of width taken from the tree and it, every needed datacenter keeps a
   max-flow of ``F - delta0`` (Lovász's proof of Edmonds' theorem: such an arc
   exists when every datacenter is needed); if none qualifies, the widest.
2. Give it the largest width ``delta`` that leaves ``F - delta`` to the others: start
   at its bottleneck and, while the minimum cut ``C`` of some needed datacenter falls
   short, move to the root of ``cap(C) - delta m(C) = F - delta`` (``m(C)``: tree arcs
   across ``C``; a few Dinkelbach-like steps).
3. Subtract ``delta`` from the arcs it uses and repeat until under 1% of the first
   ``F`` is left. The `most`-th tree is the widest one on what is left, as wide as
   its bottleneck (``most=1``: the single widest tree).

On the example: ``{train -> west, train -> east}`` of width 100 and ``{train -> west
-> east}`` of width 50. The planner cuts each stripe into sub-ranges in proportion to
the widths, one per tree (`topology.forest`): every remote datacenter receives each
byte once, from its parent in that byte's tree, and each byte crosses each WAN link
at most once, except into a datacenter without readers (it cannot relay), whose
in-link a byte crosses once per datacenter it leads to.

Cost: ``O(D)`` max-flows per extension tried and per width step, on a graph of ``D``
datacenters; the planner computes the trees once per (roots, needed) pair.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import networkx as nx

SUPER = "__roots__"
SLIVER = 1e-3  # delta0 / F: the width a candidate extension is tested with
LEFTOVER = 1e-2  # stop when less than this fraction of the first F is left
Arc = tuple[str, str]


@dataclass(frozen=True)
class WanTree:
    """One tree over the datacenters and its width (the rate it can carry).

    Attributes:
        width (float): Bytes/s it carries alongside the other trees.
        parent (dict): Datacenter -> the datacenter that feeds it (roots have none).
        path (dict): Datacenter -> the WAN gateways from its parent's to its own.
    """

    width: float
    parent: dict[str, str]
    path: dict[str, tuple[str, ...]]


def datacenter_graph(gateways: nx.DiGraph) -> nx.DiGraph:
    """The datacenters joined by their WAN links (``bandwidth``), from the gateway graph."""
    dc = nx.get_node_attributes(gateways, "datacenter")
    out = nx.DiGraph()
    out.add_nodes_from(dc.values())
    out.add_edges_from((dc[u], dc[v], {"bandwidth": bw})
                       for u, v, bw in gateways.edges(data="bandwidth"))
    return out


def wan_trees(wan: nx.DiGraph, roots: set[str], needed: set[str], *,
              most: int = 4) -> list[WanTree]:
    """Trees over the datacenters whose widths add up to the WAN's broadcast rate.

    Args:
        wan (networkx.DiGraph): Datacenters, arcs with ``bandwidth`` (`datacenter_graph`).
        roots (set of str): Datacenters holding the bytes.
        needed (set of str): Datacenters with readers.
        most (int): The most trees (1: the widest tree only).

    Returns:
        list of WanTree: In the order found. Needed datacenters that cannot be reached
            are left out; one tree without parents when nothing needs to cross the WAN.

    Raises:
        ValueError: `most` is below 1.
    """
    if most < 1:
        raise ValueError(f"most must be at least 1 WAN tree, got {most}")
    reach = set().union(*(nx.descendants(wan, r) for r in roots if r in wan)) - roots
    needed = {d for d in needed if d in reach}
    if not needed:
        return [WanTree(0.0, {}, {})]
    resid: dict[Arc, float] = {(u, v): bw for u, v, bw in wan.edges(data="bandwidth")}
    transit = reach - needed
    first = rate = _rate(resid, roots, needed)
    trees: list[WanTree] = []
    while len(trees) < most and rate > LEFTOVER * first:
        last = len(trees) == most - 1  # the widest tree, all it can carry
        parent, paths, uses, safe = _grow(resid, roots, needed, transit, rate, check=not last)
        width = _width(resid, roots, needed, uses, rate) if safe and not last else 0.0
        if width <= SLIVER * rate:
            width = min(resid[a] / m for a, m in uses.items())
        for a, m in uses.items():
            resid[a] -= width * m
        trees.append(WanTree(width, parent,
                             {d: tuple(f"{x}/wan" for x in p) for d, p in paths.items()}))
        rate = _rate(resid, roots, needed)
    return trees


def _flow_graph(resid: dict[Arc, float], roots: set[str], needed: set[str]) -> nx.DiGraph:
    h = nx.DiGraph()
    h.add_edges_from((u, v, {"capacity": c}) for (u, v), c in resid.items() if c > 0)
    h.add_edges_from((SUPER, r) for r in roots)  # no capacity: infinite
    h.add_nodes_from(needed)
    return h


def _rate(resid: dict[Arc, float], roots: set[str], needed: set[str]) -> float:
    """The broadcast rate left: the smallest max-flow from the roots to a needed datacenter."""
    h = _flow_graph(resid, roots, needed)
    return min(nx.maximum_flow_value(h, SUPER, d) for d in needed)


def _grow(resid: dict[Arc, float], roots: set[str], needed: set[str], transit: set[str],
          rate: float, *, check: bool = True
          ) -> tuple[dict[str, str], dict[str, list[str]], Counter[Arc], bool]:
    """One tree from the roots: parents, paths, arc uses, and whether every step was safe.

    Without `check`, the widest tree (every extension the widest).
    """
    reached = {r: float("inf") for r in roots}  # datacenter -> bottleneck from the roots
    parent: dict[str, str] = {}
    paths: dict[str, list[str]] = {}
    uses: Counter[Arc] = Counter()
    safe = True
    floor = 1e-9 * rate
    while len(reached) < len(roots) + len(needed):
        candidates = []
        for d in sorted(needed - set(reached)):
            for u in sorted(reached):
                for p in _paths(resid, u, d, transit, floor):
                    arcs = list(zip(p, p[1:], strict=False))
                    own = min(resid[a] / (uses[a] + 1) for a in arcs)
                    candidates.append((-min(reached[u], own), -own, len(p), p, arcs))
        candidates.sort()
        pick = next((c for c in candidates if not check
                     or _keeps(resid, roots, needed, uses + Counter(c[4]), rate)), None)
        if pick is None:  # no extension keeps the rate (a datacenter without readers)
            safe, pick = False, candidates[0]
        neg, _, _, p, arcs = pick
        reached[p[-1]], parent[p[-1]], paths[p[-1]] = -neg, p[0], p
        uses.update(arcs)
    return parent, paths, uses, safe


def _paths(resid: dict[Arc, float], u: str, d: str, transit: set[str],
           floor: float) -> list[list[str]]:
    """Simple paths ``u -> ... -> d`` over arcs with capacity left, through `transit` only."""
    out: list[list[str]] = []
    stack = [[u]]
    while stack:
        p = stack.pop()
        for (a, b), c in resid.items():
            if a != p[-1] or c <= floor or b in p:
                continue
            if b == d:
                out.append(p + [b])
            elif b in transit:
                stack.append(p + [b])
    return out


def _keeps(resid: dict[Arc, float], roots: set[str], needed: set[str], uses: Counter[Arc],
           rate: float) -> bool:
    """Whether a sliver of width on the arcs `uses` leaves every needed datacenter `rate` - it."""
    sliver = SLIVER * rate
    left = dict(resid)
    for a, m in uses.items():
        left[a] -= sliver * m
        if left[a] < 0:
            return False
    return _rate(left, roots, needed) >= rate - sliver - 1e-9 * rate


def _width(resid: dict[Arc, float], roots: set[str], needed: set[str], uses: Counter[Arc],
           rate: float) -> float:
    """The largest width for the tree using arcs `uses` that leaves ``rate - width`` to others."""
    width = min(resid[a] / m for a, m in uses.items())
    for _ in range(len(resid) * len(needed) + 1):  # each step moves to another cut
        left = {a: c - width * uses.get(a, 0) for a, c in resid.items()}
        h = _flow_graph(left, roots, needed)
        value, (side, _) = min((nx.minimum_cut(h, SUPER, d) for d in sorted(needed)),
                               key=lambda cut: cut[0])
        if value >= rate - width - 1e-9 * rate:
            return width
        cut = [a for a in resid if a[0] in side and a[1] not in side]
        cap, m = sum(resid[a] for a in cut), sum(uses.get(a, 0) for a in cut)
        if m <= 1:  # cannot fall short (cap >= rate); rounding
            return width
        width = min(width * (1 - 1e-12), (cap - rate) / (m - 1))
        if width <= 0:
            return 0.0
    return width


__all__ = ["WanTree", "datacenter_graph", "wan_trees"]
