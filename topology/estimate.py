"""Timing estimates of a plan: equal-share rates, pipelined finish times, chunk size.

The planner's own model (`topology.simulator` is the finer, flow-level one):
every arc is shared equally by the transfers on it, a relay forwards no faster
than it receives, and chunks pipeline down a tree with a fixed cost per hop.
"""

from __future__ import annotations

import math
from collections import defaultdict

import networkx as nx

from weightfabric.topology.plan import Plan, Transfer

HOP_OVERHEAD = 10e-6   # seconds of fixed cost per chunk and hop (request, completion)
MIN_CHUNK = 1 << 20
MAX_CHUNK = 256 << 20

def share_rates(graph: nx.DiGraph, transfers: list[Transfer]) -> list[float]:
    """Each transfer's rate under equal sharing of every arc, capped by upstream.

    Each transfer's rate if every arc were shared equally by all transfers on it, capped by
    the rate of its upstream (a relay cannot forward faster than it gets). A WAN gateway's
    link to its spine is left out: it carries the sum of the datacenter's WAN links, so
    those bind first (sharing it equally would slow the flows of a fast WAN link down to
    those of a slow one).
    """
    count: dict[tuple[str, str], int] = defaultdict(int)
    for t in transfers:
        for arc in zip(t.path, t.path[1:], strict=False):
            count[arc] += 1
    edges = graph.edges
    share = {a: edges[a]["bandwidth"] / n for a, n in count.items()}
    for gateway, kind in graph.nodes(data="kind"):
        if kind == "wan":  # its link to the spine: the WAN links bind first
            for spine in graph.successors(gateway):
                if graph.nodes[spine].get("kind") == "spine":
                    for a in ((gateway, spine), (spine, gateway)):
                        if a in share:
                            share[a] = float("inf")
    rates: list[float] = []
    for t in transfers:
        r = min((share[a] for a in zip(t.path, t.path[1:], strict=False)), default=float("inf"))
        if t.upstream is not None:
            r = min(r, rates[t.upstream])
        rates.append(r)
    return rates


def path_latency(graph: nx.DiGraph, path: tuple[str, ...]) -> float:
    """Sum of the latencies of the arcs along `path`."""
    edges = graph.edges
    return sum(edges[a]["latency"] for a in zip(path, path[1:], strict=False))


def choose_chunk(plan: Plan, rates: list[float]) -> int:
    """The chunk minimising (k + D - 1)(alpha + S_stripe/(k B)) for the plan's depth D."""
    depth = plan.depth()
    stripe = max(b - a for a, b in plan.stripes)
    rate = min(rates, default=1.0)
    if depth <= 1:
        return int(max(MIN_CHUNK, min(MAX_CHUNK, stripe)))
    k = math.sqrt((depth - 1) * stripe / (HOP_OVERHEAD * rate))
    return int(max(MIN_CHUNK, min(MAX_CHUNK, stripe / max(k, 1.0))))


def predict(graph: nx.DiGraph, transfers: list[Transfer], chunk: int,
            rates: list[float] | None = None) -> dict[str, float]:
    """Predicted completion time of each reader under the equal-share estimate."""
    done: dict[str, float] = defaultdict(float)
    for t, end in zip(transfers, finish_times(graph, transfers, chunk, rates), strict=True):
        done[t.reader] = max(done[t.reader], end)
    return dict(done)


def finish_times(graph: nx.DiGraph, transfers: list[Transfer], chunk: int,
          rates: list[float] | None = None) -> list[float]:
    """Predicted time each transfer's last byte lands."""
    rates = rates if rates is not None else share_rates(graph, transfers)
    start = [0.0] * len(transfers)
    latency = [path_latency(graph, t.path) for t in transfers]
    ends = []
    for i, t in enumerate(transfers):
        if t.upstream is not None:
            lag = min(chunk, t.nbytes)
            start[i] = start[t.upstream] + lag / rates[t.upstream] \
                + latency[t.upstream] + HOP_OVERHEAD
        ends.append(start[i] + t.nbytes / rates[i] + latency[i])
    return ends


__all__ = ["HOP_OVERHEAD", "MAX_CHUNK", "MIN_CHUNK", "choose_chunk", "finish_times",
           "path_latency", "predict", "share_rates"]
