"""Plans for a node's readers that come through its relay: the first routed, the rest on it.

A node relay (`fabric.relay`) forwards the requests of a node's workers in batches; when
its readers begin fetching a shard of a version, the hub routes the node's first reader
as any reader (`fabric.hub.routing`, or the ranking's sample beyond a few dozen readers)
and plans the node's later ones, in that batch or a later one, as waits on it: the same
ranges and sources, each range waiting on the first reader alone. Ranking would put it
first too (a partial replica on the reader's own node, begun earlier, ranks above every
other source); the plan is made once per node instead of a routing pass per reader,
names fewer workers (fewer capabilities to sign), and the node's chunks cross the
network once, to the first reader, then move on the node. A node's readers that start at
different moments (each as its rollouts finish) are planned so too.

Only fresh fetches are planned so (no chunks held, none excluded, no broadcast plan of
`fabric.hub.planned`, not a derived version being made): a re-plan, a resumed fetch or a
reader without a node name is routed as always. Once the first reader holds the whole
shard, has gone, or a source it was given has, the node's next reader is routed again
(and becomes the one the others wait on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weightfabric.fabric.hub.records import LIVE, VersionRecord, WorkerRecord
from weightfabric.fabric.hub_messages import PlanRangeWire

NodeKey = tuple[str, int, int, str, str]
"""``(model, version, shard, datacenter, node)``."""

MAX_NODES = 1 << 16
"""Node plans kept at most (the oldest half goes beyond): a version's plans are only looked
up while its readers begin, and version numbers are never reused."""


@dataclass
class NodeFirst:
    """The first reader of a node planned, and the plan of the others."""

    worker: str
    ranges: list[PlanRangeWire]
    """Its node's other readers' ranges: its own, waiting on it."""
    named: set[str]
    """The workers they name: its sources and itself."""


class NodePlans:
    """The first reader's plan of each (version, shard, node), kept while it fetches."""

    def __init__(self) -> None:
        self._firsts: dict[NodeKey, NodeFirst] = {}

    def first(self, key: NodeKey, v: VersionRecord, workers: Mapping[str, WorkerRecord]
              ) -> NodeFirst | None:
        """The node's first reader of that shard, while its plan may be given to another.

        None when there is none, or it holds the whole shard, or it or a source it named
        is gone: the next reader is routed.
        """
        first = self._firsts.get(key)
        if first is None:
            return None
        shard = key[2]
        rep = v.replicas.get((first.worker, shard))
        if rep is None or rep.complete or rep.status != LIVE or not all(
                (w, shard) in v.replicas and w in workers for w in first.named):
            del self._firsts[key]
            return None
        return first

    def planned(self, key: NodeKey, worker: str, ranges: list[PlanRangeWire]) -> None:
        """``worker``, the node's first reader, was routed along ``ranges``.

        Its node's other readers read the same ranges from the same sources and wait on it
        alone: what the ranking's other partial replicas would add is the first reader's
        to wait on, and a plan naming fewer workers carries fewer capabilities.
        """
        on_it = [PlanRangeWire(start=r.start, stop=r.stop, sources=r.sources, wait=[worker],
                               window=r.window) for r in ranges]
        named = {worker, *(w for r in ranges for w in r.sources)}
        self._firsts[key] = NodeFirst(worker, on_it, named)
        if len(self._firsts) > MAX_NODES:
            for old in list(self._firsts)[:MAX_NODES // 2]:
                del self._firsts[old]


__all__ = ["MAX_NODES", "NodeFirst", "NodeKey", "NodePlans"]
