"""Timing of a plan: its predicted completion times, and the planner's quick estimates.

`predict` gives `Plan.predicted`: the fluid model of `topology.fluid` (the flow-level
simulator's max-min sharing, pipelining added per hop), or `topology.simulator` itself
where pipelining and latency make more than `PIPELINE_SHARE` of the predicted time.

The equal-share estimate (`share_rates`, `finish_times`) is what the planner uses while
it builds a plan (the chunk size, the re-cut of a one-machine broadcast's planes, the
hub's read windows): every arc is shared equally by the transfers on it, a relay
forwards no faster than it receives, and chunks pipeline down a tree with a fixed cost
per hop. It is quick, but ignores that flows finishing early leave their share to the
others: a third to a half too long where WAN trees share a link, up to 5x on random
WANs (docs/planner.md, "Predicted times").
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import networkx as nx

from weightfabric.topology.fluid import fluid_times
from weightfabric.topology.plan import Plan, Transfer
from weightfabric.topology.simulator import simulate

HOP_OVERHEAD = 10e-6   # seconds of fixed cost per chunk and hop (request, completion)
MIN_CHUNK = 1 << 20
MAX_CHUNK = 256 << 20
PIPELINE_SHARE = 0.1
"""Above this share of the predicted time in pipelining and latency, `predict` simulates."""
FLUID, SIMULATOR = "fluid", "simulator"


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


@dataclass(frozen=True)
class Prediction:
    """Predicted completion time of each reader, and the model that gave it."""

    completion: dict[str, float]  # reader -> seconds after the plan starts
    method: str                   # FLUID or SIMULATOR
    pipeline_share: float         # the fluid model's `FluidTimes.pipeline_share`


def predict(graph: nx.DiGraph, transfers: list[Transfer], *, chunk: int, size: int
            ) -> Prediction:
    """Each reader's completion time, as `topology.simulator.simulate` would give it.

    The fluid model (`topology.fluid`) where pipelining and latency make at most
    `PIPELINE_SHARE` of its makespan (within a few per cent of the simulator there);
    else one simulation of the transfers (exact, and slower: docs/planner.md).

    Args:
        graph (networkx.DiGraph): The cluster graph.
        transfers (list of Transfer): The plan's transfers, upstream first.
        chunk (int): The plan's pipelining unit in bytes.
        size (int): Bytes of the version.

    Returns:
        Prediction
    """
    fluid = fluid_times(graph, transfers, chunk)
    if fluid.pipeline_share <= PIPELINE_SHARE:
        return Prediction(fluid.completion(transfers), FLUID, fluid.pipeline_share)
    sim = simulate(graph, transfers, chunk=chunk, size=size)
    return Prediction(sim.completion, SIMULATOR, fluid.pipeline_share)


def finish_times(graph: nx.DiGraph, transfers: list[Transfer], chunk: int,
          rates: list[float] | None = None) -> list[float]:
    """When each transfer's last byte lands under the equal-share estimate."""
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


__all__ = ["FLUID", "HOP_OVERHEAD", "MAX_CHUNK", "MIN_CHUNK", "PIPELINE_SHARE", "SIMULATOR",
           "Prediction", "choose_chunk", "finish_times", "path_latency", "predict", "share_rates"]
