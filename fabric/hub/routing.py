"""Which workers a reader reads each chunk from: the body of a hub plan.

Pure functions of one version's replicas, the live workers and their load:
`fabric.hub.state.HubState.plan` checks the fetch, calls `route` and records
the sources it names; `HubState.locate` calls `holders`.

A plan ranks every replica of the shard while there are at most `FULL_RANK_LIMIT`;
beyond that (thousands of readers fetching one version together) it ranks a sample, so
that a plan costs the same with 10,000 replicas as with 64: the replicas on the reader's
node, a few of its datacenter and of all (in turn), and a few complete ones (`_sampled`).
A sample that leaves some chunk without a source is widened to every replica.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from weightfabric.fabric.hub.index import ReplicaPool
from weightfabric.fabric.hub.records import LIVE, Replica, VersionRecord, WorkerRecord
from weightfabric.fabric.hub_messages import PlanRangeWire
from weightfabric.fabric.locality import (
    Location,
    RankSources,
    SourceCandidate,
    rank_by_locality,
)


def route(v: VersionRecord, shard: int, reader: str, need: list[tuple[int, int]], *,
          banned: set[str], workers: dict[str, WorkerRecord], load: Counter[str],
          rank_sources: RankSources, max_sources: int, wait_only: bool = False,
          pool: ReplicaPool | None = None
          ) -> tuple[list[PlanRangeWire], set[str], list[int]]:
    """Ranked sources for each chunk the reader needs and can read now.

    With ``wait_only`` (a derived version its deriver is still making), a chunk no replica
    holds yet is planned too when some earlier partial replica will have it: its range
    has no ``sources``, only ``wait``.

    ``need`` is sorted, disjoint ``(start, stop)`` runs of chunks (`runs`,
    `missing_runs`). The sources and waits of a chunk depend only on which
    replicas hold it, which changes only at their bitmaps' edges: the chunks are
    cut into stretches there and the picks are made for all stretches at once
    (`_picks`, numpy); what is left in Python is one step per range of the reply.

    With ``pool`` (the shard's `ReplicaPool`, which `fabric.hub.index.HubIndex` keeps)
    holding more than `FULL_RANK_LIMIT` replicas, only a sample of them is ranked
    (`_sampled`).

    Returns:
        ``(ranges, named, missing)``: ``ranges`` as in `HubState.plan`, every worker
        they name, and the chunks no live source holds.
    """
    if pool is not None and len(pool) > FULL_RANK_LIMIT and need:
        out = _sampled(v, shard, reader, need, banned=banned, workers=workers, load=load,
                       rank_sources=rank_sources, max_sources=max_sources,
                       wait_only=wait_only, pool=pool)
        if not out[2]:
            return out
    ranked = ranked_replicas(v, shard, workers[reader].location, workers=workers, load=load,
                             rank_sources=rank_sources,
                             keep=lambda r: r.worker != reader and r.worker not in banned)
    if not need:
        return [], set(), []
    # The best-ranked partial replicas are enough for a plan; all of them only when some
    # chunk has no source among those (hundreds of readers fetching one version would
    # otherwise make every plan cost hundreds of numpy steps).
    reps = _reach(ranked, max_sources, partial_limit=PARTIAL_LIMIT)
    out = _route(v, shard, reader, need, reps, max_sources, wait_only)
    if out[2] and len(reps) < len(_reach(ranked, max_sources)):
        out = _route(v, shard, reader, need, _reach(ranked, max_sources), max_sources,
                     wait_only)
    return out


PARTIAL_LIMIT = 16
"""Partial replicas a plan considers first (the best-ranked), beside the complete ones."""
FULL_RANK_LIMIT = 64
"""Replicas of a shard up to which a plan ranks them all (beyond: a sample, `_sampled`)."""
NODE_SAMPLE = 32
"""Replicas on the reader's node a sampled plan ranks, at most (all, on a usual node)."""
NEAR_SAMPLE = 8
"""Replicas of the reader's datacenter a sampled plan ranks, drawn at random."""
FAR_SAMPLE = 4
"""Replicas from anywhere a sampled plan ranks, drawn at random."""


def _sampled(v: VersionRecord, shard: int, reader: str, need: list[tuple[int, int]], *,
             banned: set[str], workers: dict[str, WorkerRecord], load: Counter[str],
             rank_sources: RankSources, max_sources: int, wait_only: bool,
             pool: ReplicaPool) -> tuple[list[PlanRangeWire], set[str], list[int]]:
    """`route` over a sample of the shard's replicas, ranked as `route` ranks them all.

    The sample: the replicas on the reader's node (`NODE_SAMPLE` at most), `NEAR_SAMPLE`
    of its datacenter and `FAR_SAMPLE` of all, each plan the next ones in turn (the
    ranking then takes the least loaded of them: readers spread over their peers), and
    ``max_sources`` complete ones. Waits follow the pool's start order, as in `route`.
    """
    here = workers[reader].location

    def where(w: str) -> tuple[str, str] | None:
        rec = workers.get(w)
        return None if rec is None else (rec.location.datacenter, rec.location.node)

    pool.group(where)
    names = dict.fromkeys(itertools.chain(
        pool.sample(NODE_SAMPLE, (here.datacenter, here.node)) if here.node else (),
        pool.sample(NEAR_SAMPLE, (here.datacenter,)),
        pool.sample(FAR_SAMPLE),
        itertools.islice(v.complete_live.get(shard, ()), max(max_sources, 1))))
    held = pool.replicas          # the shard's replicas by worker, as v.replicas holds them
    ranked = ranked_replicas(v, shard, here, workers=workers, load=load,
                             rank_sources=rank_sources,
                             keep=lambda r: r.worker != reader and r.worker not in banned,
                             among=[held[w] for w in names if w in held])
    reps = _reach(ranked, max_sources, partial_limit=PARTIAL_LIMIT)
    return _route(v, shard, reader, need, reps, max_sources, wait_only, order=pool.order)


def _route(v: VersionRecord, shard: int, reader: str, need: list[tuple[int, int]],
           reps: list[Replica], max_sources: int, wait_only: bool,
           order: Mapping[str, int] | None = None
           ) -> tuple[list[PlanRangeWire], set[str], list[int]]:
    """`route` over the candidate replicas ``reps`` (ranked).

    ``order``: worker -> when its replica of the shard began (default: as `v.replicas`
    orders them).
    """
    # A reader waits only on partial replicas that began fetching before it did:
    # waits then follow start order, so two readers never wait on each other.
    if order is None:
        order = {w: i for i, (w, s) in enumerate(v.replicas) if s == shard}
    mine = order[reader]
    earlier = [order[r.worker] < mine for r in reps]
    sources = max(max_sources, 1)
    few = _few_stretches(reps, need)
    if few is not None and len(few[0]) <= FEW_STRETCHES:
        return _route_few(reps, few[0], few[1], earlier, sources, wait_only)
    starts, stops = _stretches(reps, need)
    if len(starts) <= FEW_STRETCHES:
        return _route_few(reps, starts.tolist(), stops.tolist(), earlier, sources, wait_only)
    picks = _picks(reps, starts, earlier, sources)
    # Neighbouring stretches with the same pick form one range.
    cut = np.flatnonzero((picks[1:] != picks[:-1]).any(axis=1)
                         | (starts[1:] != stops[:-1])) + 1
    firsts, lasts = np.r_[0, cut], np.r_[cut - 1, len(starts) - 1]
    kind_rows, kind_of = _distinct_rows(picks[firsts])
    names = [r.worker for r in reps]
    kinds = [([names[i] for i in row[:sources] if i >= 0],
              [names[i] for i in row[sources:] if i >= 0]) for row in kind_rows.tolist()]
    readable = [bool(srcs) or (wait_only and bool(wait)) for srcs, wait in kinds]
    read = np.asarray(readable, bool)[kind_of]
    # The ranges share their kind's lists (the reply is serialised, not changed).
    ranges = [PlanRangeWire(start=a, stop=b, sources=kinds[k][0], wait=kinds[k][1])
              for a, b, k in zip(starts[firsts[read]].tolist(), stops[lasts[read]].tolist(),
                                 kind_of[read].tolist(), strict=True)]
    missing = [c for a, b in zip(starts[firsts[~read]].tolist(), stops[lasts[~read]].tolist(),
                                 strict=True) for c in range(a, b)]
    named = {w for ok, (srcs, wait) in zip(readable, kinds, strict=True) if ok
             for w in (*srcs, *wait)}
    return ranges, named, missing


FEW_STRETCHES = 24
"""Stretches up to which `_route` picks in Python (numpy's per-call cost is higher there)."""


def _route_few(reps: list[Replica], starts: list[int], stops: list[int], earlier: list[bool],
               sources: int, wait_only: bool
               ) -> tuple[list[PlanRangeWire], set[str], list[int]]:
    """`_route`'s picks and ranges for a few stretches, one stretch at a time.

    The same as `_picks` and the ranges `_route` makes of them: per stretch, the first
    ``sources`` replicas that hold it, and up to 2 ``earlier`` ones ranked above every
    source that lack it; neighbouring stretches with the same picks form one range.
    """
    ranges: list[PlanRangeWire] = []
    missing: list[int] = []
    named: set[str] = set()
    last: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for a, b in zip(starts, stops, strict=True):
        srcs: list[int] = []
        wait: list[int] = []
        for i, r in enumerate(reps):
            if r.complete or r.have[a]:
                srcs.append(i)
                if len(srcs) >= sources:
                    break
            elif earlier[i] and not srcs and len(wait) < 2:
                wait.append(i)
        kind = (tuple(srcs), tuple(wait))
        if not srcs and not (wait_only and wait):
            missing.extend(range(a, b))
            last = None
            continue
        if last == kind and ranges and ranges[-1].stop == a:
            ranges[-1] = PlanRangeWire(start=ranges[-1].start, stop=b,
                                       sources=ranges[-1].sources, wait=ranges[-1].wait)
            continue
        last = kind
        names = ([reps[i].worker for i in srcs], [reps[i].worker for i in wait])
        named.update(*names)
        ranges.append(PlanRangeWire(start=a, stop=b, sources=names[0], wait=names[1]))
    return ranges, named, missing


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)``, by a lexicographic sort.

    ``np.unique(rows, axis=0, return_inverse=True)``, by a lexicographic sort (numpy's
    compares rows as opaque bytes, several times slower here).
    """
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    first = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    inverse = np.empty(len(rows), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def _picks(reps: list[Replica], starts: np.ndarray, earlier: list[bool], sources: int
           ) -> np.ndarray:
    """Per stretch, the indices in ``reps`` of its sources, then of its waits.

    Per stretch (its first chunk in ``starts``), the indices in ``reps`` of its sources, the
    first ``sources`` replicas that hold it, best first, then of its waits: up to 2
    ``earlier`` replicas ranked above every source that lack it. -1 where there are fewer.
    Replicas are visited in rank order, each only for the stretches still short of sources.
    """
    picks = np.full((len(starts), sources + 2), -1, np.int32)
    found = np.zeros(len(starts), np.int32)     # sources so far
    waits = np.zeros(len(starts), np.int32)
    open_ = np.arange(len(starts))              # stretches short of sources
    for i, r in enumerate(reps):
        if not open_.size:
            break
        has = (np.ones(open_.size, bool) if r.complete
               else np.frombuffer(r.have, np.uint8)[starts[open_]] != 0)
        got = open_[has]
        picks[got, found[got]] = i
        found[got] += 1
        if earlier[i]:
            lack = open_[~has]
            lack = lack[(found[lack] == 0) & (waits[lack] < 2)]
            picks[lack, sources + waits[lack]] = i
            waits[lack] += 1
        open_ = open_[found[open_] < sources]
    return picks


def _stretches(reps: list[Replica], need: list[tuple[int, int]]
               ) -> tuple[np.ndarray, np.ndarray]:
    """``need`` cut at every edge of the partial replicas' bitmaps.

    The stretches' starts and stops (within a stretch every replica holds all chunks or
    none).
    """
    lo, hi = need[0][0], need[-1][1]
    edged = [r for r in reps if not r.complete and _edged(r.have, lo, hi)]
    if not edged:     # e.g. peers that hold nothing yet, or all of it: the runs themselves
        return (np.fromiter((a for a, _ in need), np.int64, len(need)),
                np.fromiter((b for _, b in need), np.int64, len(need)))
    run_starts = np.fromiter((a for a, _ in need), np.int64, len(need))
    run_stops = np.fromiter((b for _, b in need), np.int64, len(need))
    edges = [np.flatnonzero(np.diff(np.frombuffer(r.have, np.uint8)[lo:hi])) + lo + 1
             for r in edged]
    cuts = np.concatenate([np.zeros(0, np.int64), *edges])
    run = np.searchsorted(run_starts, cuts, side="right") - 1     # the run a cut falls in
    inside = (run >= 0) & (cuts < run_stops[np.maximum(run, 0)])
    starts = _sorted_unique(np.concatenate([run_starts, cuts[inside]]))
    run = np.searchsorted(run_starts, starts, side="right") - 1
    stops = np.minimum(np.r_[starts[1:], hi], run_stops[run])
    return starts, stops


def _few_stretches(reps: list[Replica], need: list[tuple[int, int]]
                   ) -> tuple[list[int], list[int]] | None:
    """`_stretches` as lists, found in Python; None where there may be many.

    The usual plan of a broadcast cuts a run or two at the one or two edges of a few
    prefix-shaped bitmaps: each edge is one ``bytearray.find`` (in C) here, where numpy
    costs tens of calls whatever the edges. None (use `_stretches`) beyond `FEW_STRETCHES`
    runs or cuts.
    """
    lo, hi = need[0][0], need[-1][1]
    if len(need) > FEW_STRETCHES or lo >= hi:
        return None
    cuts: set[int] = set()
    for r in reps:
        if r.complete:
            continue
        have = r.have
        at, i = have[lo], lo
        while True:
            i = have.find(at ^ 1, i, hi)     # the next chunk unlike the one before it
            if i < 0:
                break
            cuts.add(i)
            if len(cuts) > FEW_STRETCHES:
                return None
            at ^= 1
    starts: list[int] = []
    stops: list[int] = []
    ordered = sorted(cuts)
    k, n = 0, len(ordered)
    for a, b in need:
        while k < n and ordered[k] <= a:
            k += 1
        while k < n and ordered[k] < b:
            starts.append(a)
            stops.append(ordered[k])
            a = ordered[k]
            k += 1
        starts.append(a)
        stops.append(b)
    return starts, stops


def _edged(have: bytearray, lo: int, hi: int) -> bool:
    """Whether ``have[lo:hi]`` holds both 0s and 1s (a bitmap of one value has no edge)."""
    return have.find(1, lo, hi) >= 0 and have.find(0, lo, hi) >= 0


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)``, by sorting (faster here than numpy's hashing)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if a.size else a


def _reach(reps: list[Replica], max_sources: int, *, partial_limit: int | None = None
           ) -> list[Replica]:
    """The ranked ``reps`` that `_picks` can reach, in order.

    They stop by the ``max_sources``-th complete replica (by the first when ``max_sources``
    <= 1); with ``partial_limit``, only that many partial replicas (the best-ranked) are
    kept among them.
    """
    out: list[Replica] = []
    complete = partial = 0
    enough = max(max_sources, 1)
    for r in reps:
        if r.complete:
            complete += 1
        elif partial_limit is not None and partial >= partial_limit:
            continue
        else:
            partial += 1
        out.append(r)
        if complete >= enough:
            break
    return out


def runs(chunks: list[int]) -> list[tuple[int, int]]:
    """``sorted(set(chunks))`` as ``(start, stop)`` runs of consecutive chunks."""
    if not chunks:
        return []
    a = np.fromiter(chunks, np.int64, len(chunks))
    if not (a[1:] > a[:-1]).all():
        a = _sorted_unique(a)
    cut = np.flatnonzero(a[1:] != a[:-1] + 1) + 1
    starts = a[np.concatenate(([0], cut))].tolist()       # (np.r_ costs more than this)
    stops = (a[np.concatenate((cut - 1, [len(a) - 1]))] + 1).tolist()
    return list(zip(starts, stops, strict=True))


def missing_runs(have: bytearray) -> list[tuple[int, int]]:
    """The ``(start, stop)`` runs of chunks where ``have`` (bytes 0 or 1) is 0."""
    if have.find(1) < 0:
        return [(0, len(have))] if have else []
    if have.find(0) < 0:
        return []
    step = np.diff(np.frombuffer(have, np.uint8).astype(np.int8), prepend=1, append=1)
    return list(zip(np.flatnonzero(step == -1).tolist(), np.flatnonzero(step == 1).tolist(),
                    strict=True))


def holders(v: VersionRecord, shard: int, reader: Location, *, workers: dict[str, WorkerRecord],
            load: Counter[str], rank_sources: RankSources) -> list[str]:
    """Workers with a complete live replica of ``shard``, best first for ``reader``."""
    return [r.worker for r in ranked_replicas(v, shard, reader, workers=workers, load=load,
                                              rank_sources=rank_sources,
                                              keep=lambda r: r.complete)]


def ranked_replicas(v: VersionRecord, shard: int, reader: Location, *,
                    workers: dict[str, WorkerRecord], load: Counter[str],
                    rank_sources: RankSources, keep: Callable[[Replica], bool],
                    among: Iterable[Replica] | None = None) -> list[Replica]:
    """The live replicas of ``shard`` that ``keep`` accepts, best first.

    The live replicas of ``shard`` (all of ``v``'s, or those ``among``) on registered
    workers that ``keep`` accepts, best first for ``reader`` (those ``rank_sources``
    leaves out are dropped).
    """
    reps = v.replicas.values() if among is None else among
    if rank_sources is rank_by_locality:
        return _by_locality(reps, shard, reader, workers=workers, load=load, keep=keep)
    cands = [SourceCandidate(r.worker, workers[r.worker].location, r.complete, load[r.worker])
             for r in reps
             if r.shard == shard and r.status == LIVE and r.worker in workers and keep(r)]
    allowed = {c.worker for c in cands}
    return [v.replicas[(c.worker, shard)] for c in rank_sources(reader, cands)
            if c.worker in allowed]


def _by_locality(reps: Iterable[Replica], shard: int, reader: Location, *,
                 workers: dict[str, WorkerRecord], load: Counter[str],
                 keep: Callable[[Replica], bool]) -> list[Replica]:
    """`ranked_replicas` with `rank_by_locality`, without a `SourceCandidate` per replica.

    The same order (``locality_tier``, load, complete first, worker id), from one key tuple
    per replica: a plan ranks a few dozen replicas, and building a frozen dataclass for each
    cost more than the rest of the ranking.
    """
    dc, node = reader.datacenter, reader.node
    keyed = []
    for r in reps:
        w = r.worker
        rec = workers.get(w)
        if r.shard != shard or r.status != LIVE or rec is None or not keep(r):
            continue
        at = rec.location
        same_dc = bool(dc) and dc == at.datacenter     # as `locality_tier`
        tier = 0 if node and node == at.node and (same_dc or not dc) else 1 if same_dc else 2
        keyed.append((tier, load.get(w, 0), not r.complete, w, r))
    keyed.sort()      # worker ids differ: the replicas themselves are never compared
    return [k[4] for k in keyed]


__all__ = ["holders", "missing_runs", "ranked_replicas", "route", "runs"]
