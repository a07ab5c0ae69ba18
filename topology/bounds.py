"""A lower bound on broadcast time: cut capacity into each reader, plus latency.

``T_lb = max over readers r of need(r) / R(r) + l(r)``. ``R(r)`` is the max-flow
from a super-source feeding every device holding bytes to ``r`` (``bandwidth``
capacities); ``l(r)`` is the lowest latency to ``r`` from a device on the holders'
side of a minimum cut ``C`` of that flow (the side the super-source reaches in the
residual network), at most the latency ``L(r)`` from the nearest holder.

Why it holds. In a real network, paths of latency >= L(r) deliver at most
``R(r) (T - L(r))`` bytes by time T (Ford and Fulkerson's flows over time), so
``T >= L(r) + need(r) / R(r)``, and ``l(r) <= L(r)``. In `topology.simulator`'s
fluid model, where a flow's bytes occupy every arc of its path at once, only
``l(r)`` is certain: every byte r needs crosses ``C`` at most ``R(r)`` bytes/s, so
the last flow to cross it ends no earlier than ``need(r) / R(r)``; that flow starts
at a device on the holders' side and its bytes reach r its path latency later
(relays forward nothing before it arrives). A reader's PCIe port fed both over the
network and by a relay on its own machine is where the two differ: the port seems
busy with network bytes before they could reach it.

Scaling. One max-flow on a 10,000-GPU graph takes ~0.5 s in networkx, so one per
reader would take hours. ``method="classes"`` groups readers by a signature
(datacenter, machine shape, device index, whether its machine holds bytes, bytes
needed), keeps the representative's machine in full detail and contracts every
other machine to one vertex (its internal links become infinite with no latency,
its links to leaves and NVLink domains are summed, keeping the lowest latency).
Contracting only raises max-flows and lowers latencies, and using a subset of
readers only drops terms, so the result is still a valid lower bound (equal to the
exact one when class members are symmetric, as in uniform clusters). Cost: one
max-flow and one Dijkstra on an O(machines + switches)-vertex graph per class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import edmonds_karp

from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import Interval

SUPER = "__super_source__"


@dataclass(frozen=True)
class Bound:
    """A broadcast lower bound and how it was computed."""

    seconds: float
    rate: float        # the worst reader's max-flow, bytes/s
    latency: float     # the worst reader's latency term l(r), s
    reader: str        # the reader attaining the bound
    method: str        # "exact" or "classes"
    flows: int         # max-flows computed
    elapsed: float     # seconds spent

    def to_dict(self) -> dict[str, object]:
        """The bound's fields as a dict."""
        return dict(self.__dict__)


def lower_bound(layout: Layout, sources: Mapping[str, list[Interval]] | list[str],
                needs: Mapping[str, list[Interval]], *, method: str = "auto") -> Bound:
    """Lower bound on the time to give every reader the bytes it needs.

    Args:
        layout (Layout): The indexed cluster graph.
        sources (list of devices, or mapping device -> byte ranges): Devices holding (some of)
            the bytes.
        needs (mapping reader -> byte ranges): What each reader needs.
        method ({"auto", "exact", "classes"}): One max-flow per reader on the full graph, or per
            reader class on a contracted graph (see the module docstring). "auto" picks exact
            for small inputs.

    Returns:
        Bound

    Raises:
        ValueError: Unknown method, or no readers.
    """
    started = time.perf_counter()
    if not needs:
        raise ValueError("no readers: the bound needs at least one reader")
    holders = list(sources)
    g = layout.graph
    if method == "auto":
        method = "exact" if len(needs) * g.number_of_nodes() <= 60_000 else "classes"
    flows = 0
    if method == "exact":
        worst = _exact(layout, holders, needs)
    elif method == "classes":
        worst, flows = _classes(layout, holders, needs)
    else:
        raise ValueError(f"unknown method {method!r}; use 'auto', 'exact' or 'classes'")
    seconds, rate, latency, reader = worst
    return Bound(seconds=seconds, rate=rate, latency=latency, reader=reader,
                 method=method, flows=len(needs) if method == "exact" else flows,
                 elapsed=time.perf_counter() - started)


def _need(ranges: list[Interval]) -> int:
    return sum(b - a for a, b in ranges)


def _reader_bound(h: nx.DiGraph, devices: Callable[[str], bool], reader: str,
                  need: int) -> tuple[float, float, float, str]:
    """(seconds, max-flow rate, latency term, reader) for one reader on `h`.

    `devices` tells which vertices can send (see the module docstring).
    """
    residual = edmonds_karp(h, SUPER, reader, capacity="bandwidth")
    rate = residual.graph["flow_value"]
    if rate <= 0:
        return float("inf"), 0.0, float("inf"), reader
    side, stack = {SUPER}, [SUPER]  # the holders' side of a minimum cut
    while stack:
        u = stack.pop()
        for v, arc in residual[u].items():
            if v not in side and arc["capacity"] - arc["flow"] > 1e-9 * arc["capacity"]:
                side.add(v)
                stack.append(v)
    dist = nx.single_source_dijkstra_path_length(h.reverse(copy=False), reader, weight=_latency)
    latency = min((dist[u] for u in side if u in dist and u != reader and devices(u)),
                  default=0.0)
    return need / rate + latency, rate, latency, reader


def _latency(_u: str, _v: str, arc: dict) -> float:
    return arc.get("latency", 0.0)


def _exact(layout: Layout, holders: list[str], needs: Mapping[str, list[Interval]]):
    h = layout.graph.copy()
    h.add_edges_from((SUPER, d) for d in holders)  # no capacity attribute: infinite
    devices = layout.is_device
    return max((_reader_bound(h, devices, r, _need(ranges)) for r, ranges in needs.items()),
               key=lambda w: w[0])


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
    def devices(v: str) -> bool:  # a contracted machine stands for its devices
        return layout.is_device(v) or v.startswith("machine:")

    worst = max((_reader_bound(_expand(base, g, layout, layout.machine_of[r], member, holders),
                               devices, r, _need(needs[r])) for r in reps.values()),
                key=lambda w: w[0])
    return worst, len(reps)


def _contracted(layout: Layout) -> tuple[nx.DiGraph, dict[str, str]]:
    """Every machine's vertices merged into ``machine:{name}``.

    Capacities summed, the lowest latency kept.
    """
    g = layout.graph
    member = {v: f"machine:{m}" for v, m in layout.machine_of.items()}
    arcs: dict[tuple[str, str], list[float]] = {}
    for u, v, data in g.edges(data=True):
        a, b = member.get(u, u), member.get(v, v)
        if a != b:
            _merge(arcs, (a, b), data)
    h = nx.DiGraph()
    h.add_nodes_from(set(member.values()) | {v for v in g if v not in member})
    h.add_edges_from((a, b, {"bandwidth": bw, "latency": lat}) for (a, b), (bw, lat) in arcs.items())
    return h, member


def _expand(base: nx.DiGraph, g: nx.DiGraph, layout: Layout, machine: str,
            member: dict[str, str], holders: list[str]) -> nx.DiGraph:
    """`base` with `machine` put back in full detail."""
    h = base.copy()
    h.remove_node(f"machine:{machine}")
    m = layout.machines[machine]
    inside = set(m.gpus) | set(m.ports.values()) | set(m.nics) | {m.host}
    arcs: dict[tuple[str, str], list[float]] = {}
    for v in inside:
        for _, w, data in g.out_edges(v, data=True):
            _merge(arcs, (v, w if w in inside else member.get(w, w)), data)
        for u, _, data in g.in_edges(v, data=True):
            if u not in inside:
                _merge(arcs, (member.get(u, u), v), data)
    h.add_edges_from((a, b, {"bandwidth": bw, "latency": lat}) for (a, b), (bw, lat) in arcs.items())
    h.add_edges_from((SUPER, d) for d in holders if d in inside)
    return h


def _merge(arcs: dict[tuple[str, str], list[float]], key: tuple[str, str], data: dict) -> None:
    """Add a parallel arc into `arcs[key]` = [summed bandwidth, lowest latency]."""
    if key in arcs:
        arcs[key][0] += data["bandwidth"]
        arcs[key][1] = min(arcs[key][1], data["latency"])
    else:
        arcs[key] = [data["bandwidth"], data["latency"]]
