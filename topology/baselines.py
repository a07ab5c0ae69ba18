"""What people use today, as transfers for `topology.simulator`.

- `star`: every reader pulls the whole version from a trainer device (readers are
  spread round-robin over the trainer's devices, the most generous star).
- `chain`: a static NCCL-style chain in rank order: the ranks are a seeded random
  permutation of the readers (the launcher's order, oblivious of the topology),
  pipelined chunk by chunk from the trainer.
- `storage`: push-then-pull: the trainer writes the version to a storage service of
  a given bandwidth next to its datacenter's spine, then every reader reads it
  from there (simulate with ``chunk=size`` so pulls start after the push).

Each function also has a ``*_replanner`` giving the same strategy for the bytes
left after an event.
"""

from __future__ import annotations

import random

import networkx as nx

from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import Interval, Transfer, UnreachableReaderError

STORAGE = "storage"


def _route(layout: Layout, src: str, dst: str) -> tuple[str, ...]:
    path = layout.route(src, dst)
    if path is None:
        raise UnreachableReaderError(f"no route from {src!r} to {dst!r}")
    return path


def star(layout: Layout, trainer: list[str], needs: dict[str, list[Interval]]
         ) -> list[Transfer]:
    """Every reader reads what it needs straight from a trainer device."""
    out: list[Transfer] = []
    for i, (reader, ranges) in enumerate(needs.items()):
        src = trainer[i % len(trainer)]
        path = _route(layout, src, reader)
        out.extend(Transfer(reader=reader, source=src, start=a, end=b, stripe=0, path=path)
                   for a, b in ranges)
    return out


def chain(layout: Layout, trainer: list[str], needs: dict[str, list[Interval]], *,
          seed: int = 0) -> list[Transfer]:
    """A pipelined chain through the readers in a random (rank) order."""
    order = list(needs)
    random.Random(seed).shuffle(order)
    out: list[Transfer] = []
    prev, prev_idx = trainer[0], None
    for reader in order:
        path = _route(layout, prev, reader)
        first = len(out)
        for a, b in needs[reader]:
            out.append(Transfer(reader=reader, source=prev, start=a, end=b, stripe=0,
                                path=path, upstream=prev_idx))
        prev, prev_idx = reader, (len(out) - 1 if len(out) > first else prev_idx)
    return out


def storage_graph(layout: Layout, dc: str, bandwidth: float, latency: float = 1e-3
                  ) -> nx.DiGraph:
    """The cluster graph plus a storage service on datacenter `dc`'s spine."""
    g = layout.graph.copy()
    spine = f"{dc}/spine"
    g.add_edge(spine, STORAGE, bandwidth=bandwidth, latency=latency, tier="storage")
    g.add_edge(STORAGE, spine, bandwidth=bandwidth, latency=latency, tier="storage")
    return g


def storage(layout: Layout, trainer: list[str], needs: dict[str, list[Interval]],
            size: int) -> list[Transfer]:
    """The trainer pushes the version to storage, then every reader pulls from it."""
    dc = layout.datacenter(trainer[0])
    push = layout.via_spine(trainer[0], None, dc, STORAGE)
    if push is None:
        raise UnreachableReaderError(f"trainer {trainer[0]!r} cannot reach storage")
    out = [Transfer(reader=STORAGE, source=trainer[0], start=0, end=size, stripe=0, path=push)]
    out.extend(_pulls(layout, dc, needs, upstream=0))
    return out


def _pulls(layout: Layout, dc: str, needs: dict[str, list[Interval]],
           upstream: int | None) -> list[Transfer]:
    out: list[Transfer] = []
    for reader, ranges in needs.items():
        path = layout.via_spine(None, reader, dc, STORAGE)
        if path is None:
            raise UnreachableReaderError(f"reader {reader!r} cannot reach storage")
        out.extend(Transfer(reader=reader, source=STORAGE, start=a, end=b, stripe=0, path=path,
                            upstream=upstream) for a, b in ranges)
    return out


def star_replanner(layout: Layout, trainer: list[str]):
    """A replanner for `star`: re-plan from the surviving trainer devices."""
    def replan(holders: dict[str, list[Interval]], missing: dict[str, list[Interval]]):
        alive = [d for d in trainer if d in holders] or list(holders)
        return star(layout, alive, missing)
    return replan


def chain_replanner(layout: Layout, trainer: list[str]):
    """A replanner for `chain`: re-plan from the surviving trainer devices."""
    def replan(holders: dict[str, list[Interval]], missing: dict[str, list[Interval]]):
        alive = [d for d in trainer if d in holders] or list(holders)
        return chain(layout, alive, missing)
    return replan


def storage_replanner(layout: Layout, trainer: list[str]):
    """A replanner that pulls the missing bytes from the trainer datacenter's storage."""
    dc = layout.datacenter(trainer[0])

    def replan(holders: dict[str, list[Interval]], missing: dict[str, list[Interval]]):
        return _pulls(layout, dc, missing, upstream=None)
    return replan
