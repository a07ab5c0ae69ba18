"""A lower bound on broadcast time: cut capacity into each reader, plus latency.

``T_lb = max over readers r of need(r) / maxflow(super-source -> r) + L`` where the
super-source feeds every device holding bytes, the max-flow runs on the graph's
``bandwidth`` capacities, and ``L`` is the longest, over readers, of the
lowest-latency path from a holder. With every reader needing all ``S`` bytes the
first term is ``S / min_r maxflow``. No schedule can beat it: every byte a reader
needs must cross every cut between the holders and that reader.

Scaling. One max-flow on a 10,000-GPU graph takes ~0.5 s in networkx, so one per
reader would take hours. ``method="classes"`` groups readers by a signature
(datacenter, machine shape, device index, whether its machine holds bytes, bytes
needed), keeps the representative's machine in full detail and contracts every
other machine to one vertex (its internal links become infinite, its links to
leaves and NVLink domains are summed). Contracting only raises max-flows and
using a subset of readers only drops terms, so the result is still a valid lower
bound (equal to the exact one when class members are symmetric, as in uniform
clusters). Cost: one max-flow on an O(machines + switches)-vertex graph per class.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import edmonds_karp

from topology.layout import Layout
from topology.plan import Interval

SUPER = "__super_source__"


@dataclass(frozen=True)
class Bound:
    """A broadcast lower bound and how it was computed."""

    seconds: float
    rate: float        # min over readers of maxflow, bytes/s (for the worst reader)
    latency: float     # longest needed lowest-latency path, s
    reader: str        # the reader attaining the bandwidth term
    method: str        # "exact" or "classes"
    flows: int         # max-flows computed
    elapsed: float     # seconds spent

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def lower_bound(layout: Layout, sources: Mapping[str, list[Interval]] | list[str],
                needs: Mapping[str, list[Interval]], *, method: str = "auto") -> Bound:
    """Lower bound on the time to give every reader the bytes it needs.

    Parameters
    ----------
    layout : Layout
        The indexed cluster graph.
    sources : list of devices, or mapping device -> byte ranges
        Devices holding (some of) the bytes.
    needs : mapping reader -> byte ranges
        What each reader needs.
    method : {"auto", "exact", "classes"}
        One max-flow per reader on the full graph, or per reader class on a
        contracted graph (see the module docstring). "auto" picks exact for small
        inputs.

    Returns
    -------
    Bound

    Raises
    ------
    ValueError
        Unknown method, or no readers.
    """
    started = time.perf_counter()
    if not needs:
        raise ValueError("no readers: the bound needs at least one reader")
    holders = list(sources)
    g = layout.graph
    if method == "auto":
        method = "exact" if len(needs) * g.number_of_nodes() <= 60_000 else "classes"
    if method == "exact":
        worst = _exact(g, holders, needs)
    elif method == "classes":
        worst = _classes(layout, holders, needs)
    else:
        raise ValueError(f"unknown method {method!r}; use 'auto', 'exact' or 'classes'")
    time_bw, rate, reader, flows = worst
    latency = _latency(g, holders, list(needs))
    return Bound(seconds=time_bw + latency, rate=rate, latency=latency, reader=reader,
                 method=method, flows=flows, elapsed=time.perf_counter() - started)


def _need(ranges: list[Interval]) -> int:
    return sum(b - a for a, b in ranges)


def _maxflow(h: nx.DiGraph, target: str) -> float:
    return nx.maximum_flow_value(h, SUPER, target, capacity="bandwidth", flow_func=edmonds_karp)


def _exact(g: nx.DiGraph, holders: list[str], needs: Mapping[str, list[Interval]]):
    h = g.copy()
    h.add_edges_from((SUPER, d) for d in holders)  # no capacity attribute: infinite
    worst = (0.0, float("inf"), "", 0)
    for r, ranges in needs.items():
        rate = _maxflow(h, r)
        t = _need(ranges) / rate if rate > 0 else float("inf")
        worst = max(worst, (t, rate, r, 0), key=lambda w: w[0])
    return worst[0], worst[1], worst[2], len(needs)


def _classes(layout: Layout, holders: list[str], needs: Mapping[str, list[Interval]]):
    g = layout.graph
    holder_machines = {layout.machine_of[d] for d in holders}
    reps: dict[tuple, str] = {}
    for r, ranges in needs.items():
        m = layout.machine(r)
        key = (m.datacenter, len(m.gpus), len(m.nics), m.nvswitch is not None,
               m.devices.index(r), m.name in holder_machines, _need(ranges))
        reps.setdefault(key, r)
    base, member = _contracted(layout)
    for d in holders:
        base.add_edge(SUPER, member.get(d, d))
    worst = (0.0, float("inf"), "", 0)
    for r in reps.values():
        h = _expand(base, g, layout, layout.machine_of[r], member, holders)
        rate = _maxflow(h, r)
        t = _need(needs[r]) / rate if rate > 0 else float("inf")
        worst = max(worst, (t, rate, r, 0), key=lambda w: w[0])
    return worst[0], worst[1], worst[2], len(reps)


def _contracted(layout: Layout) -> tuple[nx.DiGraph, dict[str, str]]:
    """Every machine's vertices merged into ``machine:{name}``; capacities summed."""
    g = layout.graph
    member = {v: f"machine:{m}" for v, m in layout.machine_of.items()}
    cap: dict[tuple[str, str], float] = defaultdict(float)
    for u, v, bw in g.edges(data="bandwidth"):
        a, b = member.get(u, u), member.get(v, v)
        if a != b:
            cap[a, b] += bw
    h = nx.DiGraph()
    h.add_nodes_from(set(member.values()) | {v for v in g if v not in member})
    h.add_edges_from((a, b, {"bandwidth": c}) for (a, b), c in cap.items())
    return h, member


def _expand(base: nx.DiGraph, g: nx.DiGraph, layout: Layout, machine: str,
            member: dict[str, str], holders: list[str]) -> nx.DiGraph:
    """`base` with `machine` put back in full detail."""
    h = base.copy()
    h.remove_node(f"machine:{machine}")
    m = layout.machines[machine]
    inside = set(m.gpus) | set(m.ports.values()) | set(m.nics) | {m.host}
    cap: dict[tuple[str, str], float] = defaultdict(float)
    for v in inside:
        for _, w, bw in g.out_edges(v, data="bandwidth"):
            cap[v, w if w in inside else member.get(w, w)] += bw
        for u, _, bw in g.in_edges(v, data="bandwidth"):
            if u not in inside:
                cap[member.get(u, u), v] += bw
    h.add_edges_from((a, b, {"bandwidth": c}) for (a, b), c in cap.items())
    h.add_edges_from((SUPER, d) for d in holders if d in inside)
    return h


def _latency(g: nx.DiGraph, holders: list[str], readers: list[str]) -> float:
    dist = nx.multi_source_dijkstra_path_length(g, set(holders), weight="latency")
    return max((dist.get(r, float("inf")) for r in readers), default=0.0)
