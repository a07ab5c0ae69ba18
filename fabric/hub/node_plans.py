"""Plans for the readers of one node that ask together: the first routed, the others on it.

A node relay (`fabric.relay`) forwards the requests of a node's workers in one batch;
when several of them begin fetching the same shard of a version in it, the hub routes
the first as any reader (`fabric.hub.routing`, or the ranking's sample beyond a few dozen
readers) and plans the others of that node as waits on it: the same ranges and sources,
with the first reader named first in each range's ``wait``. That is the plan ranking
would give them (a partial replica on the reader's own node, begun earlier, ranks above
every other source), made in a few µs instead of a routing pass per reader, and the
node's chunks cross the network once, to the first reader, then move on the node.

Only fresh fetches are planned so (no chunks held, none excluded, no broadcast plan of
`fabric.hub.planned`, not a derived version being made): a re-plan, a resumed fetch or a
reader without a node name is routed as always.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightfabric.fabric.hub_messages import PlanRangeWire

NodeKey = tuple[str, int, int, str, str]
"""``(model, version, shard, datacenter, node)``."""


@dataclass(frozen=True)
class NodeFirst:
    """The first reader of a node planned in a batch, and its plan."""

    worker: str
    ranges: list[PlanRangeWire]
    named: frozenset[str]


class NodePlans:
    """The first reader's plan of each (version, shard, node), for one batch."""

    def __init__(self) -> None:
        self._firsts: dict[NodeKey, NodeFirst] = {}

    def first(self, key: NodeKey) -> NodeFirst | None:
        """The node's first reader of that shard in this batch, if one was planned."""
        return self._firsts.get(key)

    def planned(self, key: NodeKey, worker: str, ranges: list[PlanRangeWire],
                named: set[str]) -> None:
        """``worker``, the node's first reader, was routed: ``ranges`` naming ``named``."""
        self._firsts.setdefault(key, NodeFirst(worker, ranges, frozenset(named)))


def on_first(first: NodeFirst, reader: str) -> tuple[list[PlanRangeWire], set[str]]:
    """``reader``'s plan (ranges, workers named) as a wait on its node's first reader."""
    ranges = [PlanRangeWire(start=r.start, stop=r.stop, sources=r.sources,
                            wait=[first.worker, *(w for w in r.wait if w != reader)],
                            window=r.window)
              for r in first.ranges]
    return ranges, {*first.named, first.worker}


__all__ = ["NodeFirst", "NodeKey", "NodePlans", "on_first"]
