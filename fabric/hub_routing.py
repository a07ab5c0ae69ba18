"""Which workers a reader reads each chunk from: the body of a hub plan.

Pure functions of one version's replicas, the live workers and their load:
`fabric.hub_state.HubState.plan` checks the fetch, calls `route` and records
the sources it names; `HubState.locate` calls `holders`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from fabric.hub_records import LIVE, Replica, VersionRecord, WorkerRecord
from fabric.locality import Location, RankSources, SourceCandidate


def route(v: VersionRecord, shard: int, reader: str, need: list[tuple[int, int]], *,
          banned: set[str], workers: dict[str, WorkerRecord], load: Counter[str],
          rank_sources: RankSources, max_sources: int
          ) -> tuple[list[dict[str, Any]], set[str], list[int]]:
    """Ranked sources for each chunk the reader needs and can read now.

    ``need`` is sorted, disjoint ``(start, stop)`` runs of chunks (`runs`,
    `missing_runs`). Costs O(runs) rather than O(chunks x replicas): the sources and
    waits of a chunk (`_pick`) change only where ``need`` or the ``have`` of a partial
    replica that can matter does, so they are picked once per stretch between such
    changes.

    Returns:
        ``(ranges, named, missing)``: ``ranges`` as in `HubState.plan`, every worker
        they name, and the chunks no live source holds.
    """
    ranked = ranked_replicas(v, shard, workers[reader].location, workers=workers, load=load,
                             rank_sources=rank_sources,
                             keep=lambda r: r.worker != reader and r.worker not in banned)
    reps = _reach(ranked, max_sources)
    # A reader waits only on partial replicas that began fetching before it did:
    # waits then follow start order, so two readers never wait on each other.
    order = {key: i for i, key in enumerate(v.replicas)}
    mine = order[(reader, shard)]
    earlier = {r.worker for r in reps if order[(r.worker, shard)] < mine}
    ranges: list[dict[str, Any]] = []
    missing: list[int] = []
    named: set[str] = set()
    if not need:
        return ranges, named, missing
    lo, hi = need[0][0], need[-1][1]
    cuts = sorted({i for r in reps if not r.complete for i in _edges(r.have, lo, hi)})
    for start, stop in need:
        inner = cuts[bisect_right(cuts, start):bisect_left(cuts, stop)]
        for a, b in zip([start, *inner], [*inner, stop], strict=True):
            srcs, wait = _pick(reps, a, earlier, max_sources)
            if not srcs:
                missing.extend(range(a, b))
                continue
            last = ranges[-1] if ranges else None
            if (last is not None and last["stop"] == a and last["sources"] == srcs
                    and last["wait"] == wait):
                last["stop"] = b
            else:
                ranges.append({"start": a, "stop": b, "sources": srcs, "wait": wait})
            named.update(srcs)
            named.update(wait)
    return ranges, named, missing


def _pick(reps: list[Replica], c: int, earlier: set[str], max_sources: int
          ) -> tuple[list[str], list[str]]:
    """Chunk ``c``'s sources (the first ``max_sources`` of ``reps``, best first, that
    have it) and waits (up to 2 ``earlier`` partial replicas ranked above every source)."""
    srcs: list[str] = []
    wait: list[str] = []
    for r in reps:
        if r.complete or r.have[c]:
            srcs.append(r.worker)
            if len(srcs) >= max_sources:
                break
        elif not srcs and len(wait) < 2 and r.worker in earlier:
            wait.append(r.worker)
    return srcs, wait


def _reach(reps: list[Replica], max_sources: int) -> list[Replica]:
    """The prefix of ranked ``reps`` that `_pick` can reach: it stops by the
    ``max_sources``-th complete replica (by the first when ``max_sources`` <= 1)."""
    complete = 0
    for i, r in enumerate(reps):
        complete += r.complete
        if complete >= max(max_sources, 1):
            return reps[:i + 1]
    return reps


def runs(chunks: list[int]) -> list[tuple[int, int]]:
    """``sorted(set(chunks))`` as ``(start, stop)`` runs of consecutive chunks."""
    if not chunks:
        return []
    a = np.fromiter(chunks, np.int64, len(chunks))
    if not (a[1:] > a[:-1]).all():
        a.sort()
        a = a[np.r_[True, a[1:] != a[:-1]]]
    cut = np.flatnonzero(a[1:] != a[:-1] + 1) + 1
    starts = a[np.r_[0, cut]].tolist()
    stops = (a[np.r_[cut - 1, len(a) - 1]] + 1).tolist()
    return list(zip(starts, stops, strict=True))


def missing_runs(have: bytearray) -> list[tuple[int, int]]:
    """The ``(start, stop)`` runs of chunks where ``have`` (bytes 0 or 1) is 0."""
    step = np.diff(np.frombuffer(have, np.uint8).astype(np.int8), prepend=1, append=1)
    return list(zip(np.flatnonzero(step == -1).tolist(), np.flatnonzero(step == 1).tolist(),
                    strict=True))


def _edges(have: bytearray, start: int, stop: int) -> list[int]:
    """The chunks in ``start+1..stop-1`` where ``have`` (bytes 0 or 1) changes value."""
    edges: list[int] = []
    i = start
    while (i := have.find(1 - have[i], i, stop)) >= 0:
        edges.append(i)
    return edges


def holders(v: VersionRecord, shard: int, reader: Location, *, workers: dict[str, WorkerRecord],
            load: Counter[str], rank_sources: RankSources) -> list[str]:
    """Workers with a complete live replica of ``shard``, best first for ``reader``."""
    return [r.worker for r in ranked_replicas(v, shard, reader, workers=workers, load=load,
                                              rank_sources=rank_sources,
                                              keep=lambda r: r.complete)]


def ranked_replicas(v: VersionRecord, shard: int, reader: Location, *,
                    workers: dict[str, WorkerRecord], load: Counter[str],
                    rank_sources: RankSources, keep: Callable[[Replica], bool]) -> list[Replica]:
    """The live replicas of ``shard`` on registered workers that ``keep`` accepts,
    best first for ``reader`` (those ``rank_sources`` leaves out are dropped)."""
    cands = [SourceCandidate(r.worker, workers[r.worker].location, r.complete, load[r.worker])
             for r in v.replicas.values()
             if r.shard == shard and r.status == LIVE and r.worker in workers and keep(r)]
    allowed = {c.worker for c in cands}
    return [v.replicas[(c.worker, shard)] for c in rank_sources(reader, cands)
            if c.worker in allowed]


__all__ = ["holders", "missing_runs", "ranked_replicas", "route", "runs"]
