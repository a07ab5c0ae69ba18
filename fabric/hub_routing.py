"""Which workers a reader reads each chunk from: the body of a hub plan.

Pure functions of one version's replicas, the live workers and their load:
`fabric.hub_state.HubState.plan` checks the fetch, calls `route` and records
the sources it names; `HubState.locate` calls `holders`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fabric.hub_records import LIVE, VersionRecord, WorkerRecord
from fabric.locality import Location, RankSources, SourceCandidate


def route(v: VersionRecord, shard: int, reader: str, need: list[int], *, banned: set[str],
          workers: dict[str, WorkerRecord], load: Counter[str], rank_sources: RankSources,
          max_sources: int) -> tuple[list[dict[str, Any]], set[str], list[int]]:
    """Ranked sources for each chunk of ``need`` the reader can read now.

    Returns:
        ``(ranges, named, missing)``: ``ranges`` as in `HubState.plan`, every worker
        they name, and the chunks no live source holds.
    """
    reader_loc = workers[reader].location
    cands = [SourceCandidate(r.worker, workers[r.worker].location, r.complete, load[r.worker])
             for r in v.replicas.values()
             if r.shard == shard and r.worker != reader and r.status == LIVE
             and r.worker in workers and r.worker not in banned]
    allowed = {c.worker for c in cands}
    ranked = [c for c in rank_sources(reader_loc, cands) if c.worker in allowed]
    reps = [v.replicas[(c.worker, shard)] for c in ranked]
    # A reader waits only on partial replicas that began fetching before it did:
    # waits then follow start order, so two readers never wait on each other.
    order = {key: i for i, key in enumerate(v.replicas)}
    mine = order[(reader, shard)]
    ranges: list[dict[str, Any]] = []
    missing: list[int] = []
    named: set[str] = set()
    for c in sorted(set(need)):
        srcs: list[str] = []
        wait: list[str] = []
        for r in reps:
            if r.complete or r.have[c]:
                srcs.append(r.worker)
                if len(srcs) >= max_sources:
                    break
            elif not srcs and len(wait) < 2 and order[(r.worker, r.shard)] < mine:
                wait.append(r.worker)
        if not srcs:
            missing.append(c)
            continue
        last = ranges[-1] if ranges else None
        if (last is not None and last["stop"] == c and last["sources"] == srcs
                and last["wait"] == wait):
            last["stop"] = c + 1
        else:
            ranges.append({"start": c, "stop": c + 1, "sources": srcs, "wait": wait})
        named.update(srcs)
        named.update(wait)
    return ranges, named, missing


__all__ = ["route"]


def holders(v: VersionRecord, shard: int, reader: Location, *, workers: dict[str, WorkerRecord],
            load: Counter[str], rank_sources: RankSources) -> list[str]:
    """Workers with a complete live replica of ``shard``, best first for ``reader``."""
    cands = [SourceCandidate(r.worker, workers[r.worker].location, True, load[r.worker])
             for r in v.replicas.values()
             if r.shard == shard and r.complete and r.status == LIVE and r.worker in workers]
    allowed = {c.worker for c in cands}
    return [c.worker for c in rank_sources(reader, cands) if c.worker in allowed]
