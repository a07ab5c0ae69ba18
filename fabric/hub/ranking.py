"""Rank a reader's candidate sources by the bandwidth the cluster graph gives them.

`topology_ranker(cluster)` returns a `fabric.locality.RankSources` function for
``fabric.serve(..., rank_sources=...)``: candidates are ordered by the widest-path
(maximum-bottleneck) bandwidth from the candidate's device to the reader's device on
the cluster graph (`topology.graph`), then by load, then by the locality tie-breaks
of `rank_by_locality` (tier, complete first, worker id).

Mapping a `Location` to a graph vertex
--------------------------------------
- ``device`` that is already a vertex name (``node-3/gpu5``, ``node-3/host``) is used
  as is (``node`` may then be empty).
- Otherwise ``node`` must be a node of the cluster, and ``device`` names one of its
  devices: ``gpu5``, ``cuda:5`` or ``5`` -> ``{node}/gpu5``; ``host``, ``cpu`` or
  ``''`` -> ``{node}/host`` (a CPU worker, or a GPU worker that did not say which GPU).
- A non-empty ``datacenter`` must be the node's datacenter.

Anything else (unknown node, GPU index out of range, wrong datacenter) is *unknown*:
an unknown reader gets plain `rank_by_locality`; unknown candidates are ranked after
every mapped one, among themselves by locality. Nothing here raises on a location.

Widest paths are computed on demand (a max-bottleneck Dijkstra from the candidate,
stopping at the reader: O(E log V)) and cached per (reader vertex, source vertex).
"""

from __future__ import annotations

import heapq
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import networkx as nx

from weightfabric.fabric.locality import (
    Location,
    RankSources,
    SourceCandidate,
    locality_tier,
    rank_by_locality,
)

_GPU = re.compile(r"^(?:gpu|cuda:)?(\d+)$")
_HOST = {"", "host", "cpu"}
MAX_CACHE = 1 << 20  # (reader, source) pairs kept before the cache is cleared


def cluster_graph(cluster: object) -> nx.DiGraph:
    """The graph of a Cluster, a cluster YAML path, a Layout or a graph (as given).

    Raises:
        TypeError: `cluster` is none of those.
        topology.ClusterConfigError: the YAML file cannot be read or is invalid.
    """
    from weightfabric.topology import load_cluster
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.schema import Cluster

    if isinstance(cluster, (str, Path)):
        cluster = load_cluster(Path(cluster))
    if isinstance(cluster, Cluster):
        return cluster.graph()
    if isinstance(cluster, Layout):
        return cluster.graph
    if isinstance(cluster, nx.DiGraph):
        return cluster
    raise TypeError(f"expected a Cluster, a cluster YAML path, a Layout or a graph, "
                    f"got {type(cluster).__name__}")


class TopologyRanker:
    """A `RankSources` function over one cluster graph (see the module docstring)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self._cache: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[str, int]] = {}  # node -> (datacenter, GPU count)
        for _, data in graph.nodes(data=True):
            if data.get("kind") == "host":
                self._nodes[data["node"]] = (data.get("datacenter", ""), 0)
        for _, data in graph.nodes(data=True):
            if data.get("kind") == "gpu":
                dc, n = self._nodes[data["node"]]
                self._nodes[data["node"]] = (dc, max(n, data["index"] + 1))

    def vertex(self, location: Location) -> str | None:
        """The graph vertex of `location`, or None when it is unknown."""
        g = self.graph
        device = location.device.strip()
        if device in g and g.nodes[device].get("kind") in ("gpu", "host"):
            node = g.nodes[device].get("node", "")
            if location.node and location.node != node:
                return None
            return device if self._same_dc(location, node) else None
        if location.node not in self._nodes or not self._same_dc(location, location.node):
            return None
        if device.lower() in _HOST:
            return f"{location.node}/host"
        match = _GPU.match(device.lower())
        if match is None or int(match.group(1)) >= self._nodes[location.node][1]:
            return None
        return f"{location.node}/gpu{int(match.group(1))}"

    def _same_dc(self, location: Location, node: str) -> bool:
        return not location.datacenter or location.datacenter == self._nodes[node][0]

    def bandwidth(self, source: str, reader: str) -> float:
        """Widest-path bandwidth (bytes/s) from vertex `source` to vertex `reader`.

        Widest-path bandwidth (bytes/s) from vertex `source` to vertex `reader` (infinite
        for the same vertex, 0 when there is no path); cached.
        """
        key = (reader, source)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        width = _widest(self.graph, source, reader)
        with self._lock:
            if len(self._cache) >= MAX_CACHE:
                self._cache.clear()
            self._cache[key] = width
        return width

    def __call__(self, reader: Location, candidates: Sequence[SourceCandidate]
                 ) -> list[SourceCandidate]:
        """`candidates` best first for `reader` (see `topology_ranker`)."""
        target = self.vertex(reader)
        if target is None:
            return rank_by_locality(reader, candidates)

        def key(c: SourceCandidate) -> tuple:
            src = self.vertex(c.location)
            tier = locality_tier(reader, c.location)
            if src is None:  # after every mapped one (-width <= 0), as rank_by_locality
                return (1.0, tier, c.load, not c.complete, c.worker)
            return (-self.bandwidth(src, target), c.load, tier, not c.complete, c.worker)

        return sorted(candidates, key=key)


def _widest(g: nx.DiGraph, source: str, target: str) -> float:
    if source == target:
        return float("inf")
    best = {source: float("inf")}
    heap = [(-float("inf"), source)]
    adj = g.adj
    while heap:
        neg, u = heapq.heappop(heap)
        width = -neg
        if u == target:
            return width
        if width < best.get(u, 0.0):
            continue
        for v, data in adj[u].items():
            w = min(width, data.get("bandwidth", 0.0))
            if w > best.get(v, 0.0):
                best[v] = w
                heapq.heappush(heap, (-w, v))
    return 0.0


def topology_ranker(cluster: object) -> RankSources:
    """A source ranking for the hub that prefers the widest path to the reader.

    Args:
        cluster (Cluster, str or Path, Layout or networkx.DiGraph): The cluster (a loaded
            `topology.schema.Cluster`, the path of its YAML file), a `topology.layout.Layout` of
            it, or its graph from `Cluster.graph()`.

    Returns:
        RankSources: ``rank(reader_location, candidates) -> candidates best first``, ordered by
            (widest-path bandwidth from the candidate to the reader, descending; load; locality
            tier; complete first; worker id).

    Raises:
        TypeError: `cluster` is none of the accepted kinds.
        topology.ClusterConfigError: The YAML file cannot be read or is invalid.

    Notes:
        Locations map to graph vertices as described in the module docstring; unknown
        readers fall back to `rank_by_locality`, unknown candidates go last. Each
        (reader, source) pair costs one widest-path search, O(E log V), then a cache
        look-up. Safe to call from several threads.

    Examples:
        >>> from topology import reference_cluster
        >>> from fabric.locality import Location, SourceCandidate
        >>> rank = topology_ranker(reference_cluster("two-datacenters"))
        >>> far = SourceCandidate("t", Location("dc-a", "trainer", "gpu0"), True, 0)
        >>> near = SourceCandidate("b", Location("dc-b", "b-1", "gpu0"), True, 3)
        >>> [c.worker for c in rank(Location("dc-b", "b-0", "gpu0"), [far, near])]
        ['b', 't']
    """
    return TopologyRanker(cluster_graph(cluster))


__all__ = ["TopologyRanker", "cluster_graph", "topology_ranker"]
