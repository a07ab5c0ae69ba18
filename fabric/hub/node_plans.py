"""Plans for the readers of one node that ask together: the first routed, the others on it.

A node relay (`fabric.relay`) forwards the requests of a node's workers in one batch;
when several of them begin fetching the same shard of a version in it, the hub routes
the first as any reader (`fabric.hub.routing`, or the ranking's sample beyond a few dozen
readers) and plans the others of that node as waits on it: the same ranges and sources,
each range waiting on the first reader alone. Ranking would put it first too (a partial
replica on the reader's own node, begun earlier, ranks above every other source); the
plan is made once per node instead of a routing pass per reader, names fewer workers
(fewer capabilities to sign), and the node's chunks cross the network once, to the first
reader, then move on the node.

Only fresh fetches are planned so (no chunks held, none excluded, no broadcast plan of
`fabric.hub.planned`, not a derived version being made): a re-plan, a resumed fetch or a
reader without a node name is routed as always.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightfabric.fabric.hub_messages import PlanRangeWire

NodeKey = tuple[str, int, int, str, str]
"""``(model, version, shard, datacenter, node)``."""


@dataclass
class NodeFirst:
    """The first reader of a node planned in a batch, and the plan of the others."""

    worker: str
    ranges: list[PlanRangeWire]
    """Its node's other readers' ranges: its own, waiting on it."""
    named: set[str]
    """The workers they name: its sources and itself."""


class NodePlans:
    """The first reader's plan of each (version, shard, node), for one batch."""

    def __init__(self) -> None:
        self._firsts: dict[NodeKey, NodeFirst] = {}

    def first(self, key: NodeKey) -> NodeFirst | None:
        """The node's first reader of that shard in this batch, if one was planned."""
        return self._firsts.get(key)

    def planned(self, key: NodeKey, worker: str, ranges: list[PlanRangeWire]) -> None:
        """``worker``, the node's first reader, was routed along ``ranges``.

        Its node's other readers read the same ranges from the same sources and wait on it
        alone: what the ranking's other partial replicas would add is the first reader's
        to wait on, and a plan naming fewer workers carries fewer capabilities.
        """
        if key in self._firsts:
            return
        on_it = [PlanRangeWire(start=r.start, stop=r.stop, sources=r.sources, wait=[worker],
                               window=r.window) for r in ranges]
        named = {worker, *(w for r in ranges for w in r.sources)}
        self._firsts[key] = NodeFirst(worker, on_it, named)


__all__ = ["NodeFirst", "NodeKey", "NodePlans"]
