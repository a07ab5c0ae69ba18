"""Plan-driven routing: the hub runs the broadcast planner's forest.

With a cluster (``fabric hub serve --cluster FILE``) the hub plans each version's
broadcast with `topology.planner.plan_broadcast` and names, in every planned
reader's fetch plan, the upstreams and byte ranges (stripes) of that forest, so the
running transfer is the planned one.

Who is planned
--------------
A version's plan is made at its first ``begin_fetch`` of a shard, over

- sources: the workers holding the shard whole (its publishers), and
- readers: the *members* of the model's shard, the live workers that began a fetch
  of an earlier version of it (a worker's first fetch of a model is routed by
  ranking), that do not hold this version.

Workers map to cluster vertices as the ranker maps them (`fabric.hub.ranking`,
``location`` -> ``node/gpuN`` or ``node/host``); a worker that maps to no vertex, or
to a vertex another worker of the plan took first, is not planned.

What a planned reader is told
-----------------------------
For each chunk range of its planned reads (the plan's byte ranges rounded to whole
chunks), its planned upstream: as a source when the upstream holds the shard whole,
else as a partial replica to wait on (its read server holds a read until the chunks
arrive). An upstream the reader cannot use (it failed the reader, left, retracted,
or has not begun its fetch) is routed around along the plan: the chunks go to that
upstream's own upstream, up to the sources; chunks no planned holder can give fall
back to the ranked routing (`fabric.hub.routing.route`). Readers not in the plan get
the ranked routing. A planned reader whose upstreams have not begun their fetches
waits for them in ``begin_fetch`` for at most `PlanRouter.start_bound_s` (the
server parks the answer; the others go on); after that it is routed around them.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightfabric.fabric.hub.index import ReplicaPool
from weightfabric.fabric.hub.ranking import TopologyRanker, cluster_graph
from weightfabric.fabric.hub.records import LIVE, VersionRecord, WorkerRecord
from weightfabric.fabric.hub.routing import route
from weightfabric.fabric.hub_messages import PlanRangeWire
from weightfabric.fabric.locality import RankSources
from weightfabric.fabric.manifest import Manifest

if TYPE_CHECKING:
    import networkx as nx

    from weightfabric.topology.plan import Plan, Transfer

log = logging.getLogger(__name__)

MAX_PLANS = 64
"""Version plans kept (the newest); an older version's readers are routed by ranking."""
MAX_HOPS = 64
"""Upstreams walked up when routing around unusable ones (a forest is far shallower)."""
DEFAULT_START_BOUND_S = 2.0


@dataclass
class VersionPlan:
    """One shard of one version's planned broadcast, in chunks and workers."""

    reads: dict[str, list[tuple[int, int, str, int]]]
    """Per planned reader, its planned reads ``(first chunk, stop chunk, upstream, window)``,
    sorted; ``window``: the bytes in flight that fill the read's path (`window_bytes`)."""
    sources: dict[str, str]
    """Worker -> cluster vertex of the sources the plan starts from."""
    readers: dict[str, str]
    """Worker -> cluster vertex of the planned readers."""
    plan: Plan | None = field(default=None, repr=False)
    """The planner's plan (its transfers and chunk), kept to predict the times when asked."""
    predicted: dict[str, float] | None = None
    """Per planned reader, its predicted finish (s after the plan's start); None until
    `PlanRouter.summary` predicted it (`topology.estimate.predict` can simulate the plan,
    a tenth of a second or more: never on a fetch's way)."""
    began: dict[str, float] = field(default_factory=dict)
    """When each planned reader began its fetch (the hub's clock)."""
    routed_around: set[str] = field(default_factory=set)
    """Planned readers told to read some chunks elsewhere than from their planned upstream
    (one that failed them or left, or had not begun its fetch within the bound)."""

    def upstreams(self, reader: str) -> set[str]:
        """The workers ``reader`` reads from in the plan."""
        return {up for _, _, up, _ in self.reads.get(reader, ())}


class PlanRouter:
    """Plans versions over a cluster and routes planned readers along them.

    Args:
        ranker: the hub's topology ranker (its graph, and how it maps locations).
        start_bound_s: how long a planned reader waits for its upstreams to begin their
            fetches before it is routed around them.
    """

    def __init__(self, ranker: TopologyRanker, *, start_bound_s: float = DEFAULT_START_BOUND_S
                 ) -> None:
        from weightfabric.topology.layout import Layout

        if start_bound_s < 0:
            raise ValueError(f"start_bound_s must be >= 0, got {start_bound_s}")
        self.ranker = ranker
        self.layout = Layout(ranker.graph)
        self.start_bound_s = float(start_bound_s)
        self.members: dict[tuple[str, int], dict[str, None]] = {}
        self.plans: OrderedDict[tuple[str, int, int], VersionPlan | None] = OrderedDict()

    # ------------------------------------------------------------------ plans
    def begin(self, v: VersionRecord, shard: int, reader: str, *,
              workers: dict[str, WorkerRecord], now: float) -> VersionPlan | None:
        """Note ``reader``'s fetch of ``v``; the version's plan (made at its first fetch)."""
        key = (v.model, v.number, shard)
        if key not in self.plans:
            self.plans[key] = self._make(v, shard, workers)
            while len(self.plans) > MAX_PLANS:
                self.plans.popitem(last=False)
        self.members.setdefault((v.model, shard), {})[reader] = None
        vp = self.plans[key]
        if vp is not None:
            vp.began.setdefault(reader, now)
        return vp

    def plan_of(self, model: str, version: int, shard: int) -> VersionPlan | None:
        """The plan of a version's shard, if one was made."""
        return self.plans.get((model, version, shard))

    def _make(self, v: VersionRecord, shard: int, workers: dict[str, WorkerRecord]
              ) -> VersionPlan | None:
        from weightfabric.topology.plan import PlanError
        from weightfabric.topology.planner import plan_broadcast

        manifest = v.manifests.get(shard)
        if manifest is None or "@" in v.model or manifest.num_chunks == 0:
            return None   # derived versions are copied as their deriver makes them
        sources: dict[str, str] = {}   # vertex -> worker
        for rep in v.replicas.values():
            if rep.shard == shard and rep.complete and rep.status == LIVE \
                    and rep.worker in workers:
                self._claim(sources, rep.worker, workers)
        members = self.members.get((v.model, shard), {})
        for gone in [w for w in members if w not in workers]:
            del members[gone]
        readers: dict[str, str] = {}
        for w in members:
            held = v.replicas.get((w, shard))
            if (held is None or not held.complete) and self._vertex(w, workers) not in sources:
                self._claim(readers, w, workers)
        if not sources or not readers:
            return None
        size = manifest.num_chunks * manifest.chunk_size
        try:
            plan = plan_broadcast(self.layout, size, sources=list(sources),
                                  readers=list(readers), chunk=manifest.chunk_size,
                                  predict_times=False)
        except (PlanError, ValueError) as exc:
            log.warning("no broadcast plan for %s v%d shard %d (ranked routing instead): %s",
                        v.model, v.number, shard, exc)
            return None
        workers_at = {**sources, **readers}
        reads: dict[str, list[tuple[int, int, str, int]]] = {}
        for t, window in zip(plan.transfers, window_bytes(self.layout.graph, plan.transfers),
                             strict=True):
            lo, hi = _chunk(t.start, manifest, size), _chunk(t.end, manifest, size)
            reader, upstream = workers_at.get(t.reader), workers_at.get(t.source)
            if lo < hi and reader is not None and upstream is not None:
                reads.setdefault(reader, []).append((lo, hi, upstream, window))
        for out in reads.values():
            out.sort()
        log.info("planned %s v%d shard %d: %d sources, %d readers, %d stripes in %.3f s",
                 v.model, v.number, shard, len(sources), len(readers), len(plan.stripes),
                 plan.plan_seconds)
        return VersionPlan(reads=reads, sources={w: x for x, w in sources.items()},
                           readers={w: x for x, w in readers.items()}, plan=plan)

    def _vertex(self, worker: str, workers: dict[str, WorkerRecord]) -> str | None:
        return self.ranker.vertex(workers[worker].location)

    def _claim(self, taken: dict[str, str], worker: str, workers: dict[str, WorkerRecord]
               ) -> None:
        vertex = self._vertex(worker, workers)
        if vertex is not None and vertex not in taken:
            taken[vertex] = worker

    # ---------------------------------------------------------------- routing
    def waits_for(self, vp: VersionPlan, v: VersionRecord, shard: int, reader: str,
                  workers: dict[str, WorkerRecord]) -> list[str]:
        """``reader``'s planned upstreams that are live but have not begun their fetch."""
        return sorted(up for up in vp.upstreams(reader)
                      if up in workers and (up, shard) not in v.replicas)

    def route(self, vp: VersionPlan, v: VersionRecord, shard: int, reader: str,
              need: list[tuple[int, int]], *, banned: set[str],
              workers: dict[str, WorkerRecord], load: Counter[str], rank_sources: RankSources,
              max_sources: int, now: float, pool: ReplicaPool | None = None
              ) -> tuple[list[PlanRangeWire], set[str], list[int]]:
        """As `fabric.hub.routing.route`, along the plan (see the module docstring)."""
        planned: list[PlanRangeWire] = []
        rest: list[tuple[int, int]] = []
        around: set[str] = set()
        for a, b in need:
            self._follow(vp, v, shard, reader, reader, a, b, banned, workers, planned, rest,
                         around)
        # an upstream that has not begun counts once the reader no longer waits for it
        waiting = now - vp.began.get(reader, now) < self.start_bound_s
        if any(up not in workers or (up, shard) in v.replicas or not waiting for up in around):
            vp.routed_around.add(reader)
        named = {w for r in planned for w in (*r.sources, *r.wait)}
        missing: list[int] = []
        if rest:
            ranked, more, missing = route(v, shard, reader, _merge(rest), banned=banned,
                                          workers=workers, load=load, rank_sources=rank_sources,
                                          max_sources=max_sources, pool=pool)
            planned += ranked
            named |= more
        planned.sort(key=lambda r: r.start)
        return planned, named, missing

    def _follow(self, vp: VersionPlan, v: VersionRecord, shard: int, reader: str, at: str,
                a: int, b: int, banned: set[str], workers: dict[str, WorkerRecord],
                out: list[PlanRangeWire], rest: list[tuple[int, int]], around: set[str],
                hops: int = 0) -> None:
        """Route chunks ``a..b-1`` along ``at``'s planned reads.

        ``at`` is the reader, or an upstream it routes around; chunks with no planned
        upstream go to ``rest``.
        """
        for lo, hi, up, window in _overlaps(vp.reads.get(at, []), a, b, rest):
            rep = v.replicas.get((up, shard))
            usable = (up != reader and up not in banned and up in workers and rep is not None
                      and rep.status == LIVE)
            if usable and rep is not None:
                out.append(PlanRangeWire(start=lo, stop=hi, sources=[up] if rep.complete else [],
                                         wait=[] if rep.complete else [up],
                                         window=window if at == reader else 0))
            elif up in vp.sources or hops >= MAX_HOPS:
                around.add(up)
                rest.append((lo, hi))
            else:
                around.add(up)
                self._follow(vp, v, shard, reader, up, lo, hi, banned, workers, out, rest,
                             around, hops + 1)

    def summary(self) -> list[dict[str, object]]:
        """The plans kept, for ``fabric hub status`` (their times predicted once, now)."""
        return [{"model": m, "version": n, "shard": s, "readers": len(vp.readers),
                 "sources": sorted(vp.sources), "routed_around": sorted(vp.routed_around),
                 "predicted_s": max(self.predicted(vp).values(), default=0.0)}
                for (m, n, s), vp in self.plans.items() if vp is not None]

    def predicted(self, vp: VersionPlan) -> dict[str, float]:
        """Each planned reader's predicted finish (`VersionPlan.predicted`).

        Predicted now if it was not yet.
        """
        if vp.predicted is None:
            from weightfabric.topology.estimate import predict

            vp.predicted = {}
            if vp.plan is not None:
                at = {x: w for w, x in vp.readers.items()}
                times = predict(self.layout.graph, vp.plan.transfers, chunk=vp.plan.chunk,
                                size=vp.plan.size).completion
                vp.predicted = {at[x]: t for x, t in times.items() if x in at}
        return vp.predicted


def plan_router(cluster: object, *, start_bound_s: float = DEFAULT_START_BOUND_S) -> PlanRouter:
    """Plan-driven routing over a cluster, for ``fabric.serve(plan_routing=...)``.

    Args:
        cluster (Cluster, str or Path, Layout or networkx.DiGraph): as `topology_ranker`.
        start_bound_s: how long a planned reader waits for its upstreams to begin their
            fetches before it is routed around them (0: never waits).

    Returns:
        PlanRouter: its ``ranker`` ranks the readers the plans leave out.

    Raises:
        TypeError, topology.ClusterConfigError: as `topology_ranker`.
        ValueError: ``start_bound_s`` is negative.

    Examples:
        >>> from topology import reference_cluster
        >>> router = plan_router(reference_cluster("two-datacenters"))
        >>> router.start_bound_s
        2.0
    """
    return PlanRouter(TopologyRanker(cluster_graph(cluster)), start_bound_s=start_bound_s)


def window_bytes(graph: nx.DiGraph, transfers: list[Transfer]) -> list[int]:
    """Bytes each transfer must keep in flight to run at its planned rate.

    Its bandwidth-delay product: the planned (equal-share) rate times the round trip of
    its path (twice the sum of the links' latencies), rounded up; 0 where the path has
    no latency. A read is a request and a reply, so a reader that keeps one read in
    flight idles its link for a round trip between two: across a WAN of 20 ms at
    100 Gb/s that is 500 MB, more than most reads.
    """
    from weightfabric.topology.estimate import path_latency, share_rates

    rates = share_rates(graph, transfers)
    return [math.ceil(rate * 2 * latency) if math.isfinite(rate) and latency > 0 else 0
            for rate, latency in zip(rates, (path_latency(graph, t.path) for t in transfers),
                                     strict=True)]


def _chunk(offset: int, manifest: Manifest, size: int) -> int:
    """The chunk boundary nearest byte ``offset`` (the last one at the end)."""
    if offset >= size:
        return manifest.num_chunks
    return min(manifest.num_chunks, (offset + manifest.chunk_size // 2) // manifest.chunk_size)


def _overlaps(reads: list[tuple[int, int, str, int]], a: int, b: int,
              gaps: list[tuple[int, int]]) -> Iterable[tuple[int, int, str, int]]:
    """The parts of ``reads`` within ``a..b-1``; the chunks they leave out go to ``gaps``."""
    at = a
    for lo, hi, up, window in reads[max(0, bisect_right(reads, (a, 1 << 62, "", 0)) - 1):]:
        if lo >= b:
            break
        lo, hi = max(lo, a), min(hi, b)
        if lo >= hi:
            continue
        if lo > at:
            gaps.append((at, lo))
        yield lo, hi, up, window
        at = hi
    if at < b:
        gaps.append((at, b))


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


__all__ = ["DEFAULT_START_BOUND_S", "PlanRouter", "VersionPlan", "plan_router", "window_bytes"]
