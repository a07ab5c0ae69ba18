"""`route` against a per-chunk oracle (with its cap on partial replicas), on random versions and readers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from weightfabric.fabric.hub import routing
from weightfabric.fabric.hub.records import LIVE, RETRACTING, Replica, VersionRecord, WorkerRecord
from weightfabric.fabric.hub.routing import missing_runs, ranked_replicas, route, runs
from weightfabric.fabric.locality import Location, RankSources, SourceCandidate, rank_by_locality

READER = "reader"


def reference_route(v: VersionRecord, shard: int, reader: str, need: list[int], *,
                    banned: set[str], workers: dict[str, WorkerRecord], load: Counter[str],
                    rank_sources: RankSources, max_sources: int,
                    partial_limit: int = routing.PARTIAL_LIMIT
                    ) -> tuple[list[dict[str, Any]], set[str], list[int]]:
    """The oracle: `route` one chunk and one ranked replica at a time.

    The replicas are ranked as `route` ranks them; only the ``partial_limit`` best-ranked
    partial replicas are candidates (and the complete ones), unless some needed chunk then
    has no source: then all are.
    """
    reps = ranked_replicas(v, shard, workers[reader].location, workers=workers, load=load,
                           rank_sources=rank_sources,
                           keep=lambda r: r.worker != reader and r.worker not in banned)
    partials = [r for r in reps if not r.complete][:partial_limit]
    capped = [r for r in reps if r.complete or r in partials]
    out = _reference_over(v, shard, reader, need, capped, max_sources)
    if out[2] and len(capped) < len(reps):
        out = _reference_over(v, shard, reader, need, reps, max_sources)
    return out


def _reference_over(v: VersionRecord, shard: int, reader: str, need: list[int],
                    reps: list[Replica], max_sources: int
                    ) -> tuple[list[dict[str, Any]], set[str], list[int]]:
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


def bitmaps(n: int) -> st.SearchStrategy[bytearray]:
    """Empty, full, a prefix, runs of random lengths, full but for a few holes, or scattered bits."""
    runs = st.tuples(st.booleans(), st.lists(st.integers(1, 12), max_size=n)).map(
        lambda t: bytearray(b"".join(bytes([(i + t[0]) % 2]) * k for i, k in enumerate(t[1]))
                            .ljust(n, b"\x00")[:n]))
    holes = st.sets(st.integers(0, n - 1), max_size=3).map(
        lambda h: bytearray(int(i not in h) for i in range(n)))
    return st.one_of(st.just(bytearray(n)), st.just(bytearray(b"\x01" * n)),
                     st.integers(0, n).map(lambda k: bytearray(b"\x01" * k + b"\x00" * (n - k))),
                     runs, holes,
                     st.binary(min_size=n, max_size=n).map(lambda b: bytearray(x & 1 for x in b)))


def shuffled_ranking(keys: dict[str, int], dropped: set[str]) -> RankSources:
    """A topology planner's ranking: a fixed random order, leaving ``dropped`` out."""
    def rank(reader: Location, cands: Sequence[SourceCandidate]) -> list[SourceCandidate]:
        return sorted((c for c in cands if c.worker not in dropped), key=lambda c: keys[c.worker])
    return rank


@st.composite
def scenarios(draw):
    """A version's replicas of shard 0 (and 1) and a route call's arguments.

    A version's replicas of shard 0 (and of shard 1), the reader's among them, and a route
    call's arguments.
    """
    n = draw(st.one_of(st.integers(1, 8), st.integers(1, 300)))
    names = [f"w{i}" for i in range(draw(st.sampled_from([*range(3, 9), 2, 1, 0])))]
    place = st.builds(Location, st.sampled_from(["a", "b", ""]), st.sampled_from(["n0", "n1", ""]))
    workers = {READER: WorkerRecord(READER, "s", draw(place), {}, 0.0)}
    entries: list[Replica] = []
    for w in names:
        if draw(st.sampled_from([True, True, True, False])):          # mostly registered
            workers[w] = WorkerRecord(w, "s", draw(place), {}, 0.0)
        for shard in draw(st.sampled_from([[0], [0], [0], [1], [0, 1]])):
            entries.append(Replica(w, shard, draw(bitmaps(n if shard == 0 else 3)),
                                   complete=draw(st.sampled_from([False, False, True])),
                                   status=draw(st.sampled_from([LIVE, LIVE, LIVE, RETRACTING]))))
    entries = draw(st.permutations(entries))
    late = len(entries) - draw(st.integers(0, len(entries)))   # the reader, often after most
    entries.insert(late, Replica(READER, 0, draw(bitmaps(n))))
    v = VersionRecord("m", 1, 2)
    v.replicas = {(r.worker, r.shard): r for r in entries}
    load = Counter({w: draw(st.integers(0, 2)) for w in names})
    if draw(st.booleans()):
        rank_sources = rank_by_locality
    else:
        keys = {w: draw(st.integers(0, 100)) for w in names}
        rank_sources = shuffled_ranking(keys, draw(st.sets(st.sampled_from(names or [READER]))))
    need = draw(st.one_of(
        st.integers(0, n - 1).map(lambda k: list(range(k, n))),                # one run
        st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n),          # any order, repeats
        st.sets(st.integers(0, n - 1), min_size=1).map(sorted),               # gaps
        st.just([])))
    banned = draw(st.sets(st.sampled_from(names or [READER]), max_size=2))
    return v, need, dict(banned=banned, workers=workers, load=load, rank_sources=rank_sources,
                         max_sources=draw(st.sampled_from([2, 4, 1, 3])))


def plain(wire: list) -> list[dict]:
    """Ranked ranges as the reference's dicts (they carry no window: one read at a time)."""
    assert all(r.window == 0 for r in wire)
    return [{k: x for k, x in msgspec.structs.asdict(r).items() if k != "window"} for r in wire]


@settings(max_examples=600, deadline=None)
@given(scenarios(), st.sampled_from([16, 1, 2]))
def test_route_matches_the_per_chunk_algorithm(case, partial_limit):
    v, need, kwargs = case
    expected = reference_route(v, 0, READER, list(need), partial_limit=partial_limit, **kwargs)
    saved, routing.PARTIAL_LIMIT = routing.PARTIAL_LIMIT, partial_limit
    try:
        wire, named, missing = route(v, 0, READER, runs(need), **kwargs)
    finally:
        routing.PARTIAL_LIMIT = saved
    ranges = plain(wire)
    assert (ranges, named, missing) == expected
    assert all(type(c) is int for c in missing)                   # plain ints for the wire
    assert all(type(r.start) is int and type(r.stop) is int for r in wire)


def test_route_large_shard_names_one_range_per_change():
    """Replica r's edge at 700 changes no pick (p and q are the two sources there): one range."""
    n = 1 << 16
    workers = {w: WorkerRecord(w, "s", Location("dc", w), {}, 0.0) for w in "tpqr"}
    workers[READER] = WorkerRecord(READER, "s", Location("dc", READER), {}, 0.0)
    v = VersionRecord("m", 1, 1)
    v.replicas[("t", 0)] = Replica("t", 0, bytearray(b"\x01" * n), n, complete=True)
    for w, (a, b) in {"p": (0, 1000), "q": (500, 1500), "r": (0, 700)}.items():
        v.replicas[(w, 0)] = Replica(w, 0, bytearray(n))
        v.replicas[(w, 0)].have[a:b] = b"\x01" * (b - a)
    v.replicas[(READER, 0)] = Replica(READER, 0, bytearray(n))
    need = [c for c in range(n) if c != 5000]
    kwargs = dict(banned=set(), workers=workers, load=Counter(t=1),   # t ranks after p, q, r
                  rank_sources=rank_by_locality, max_sources=2)
    wire, named, missing = route(v, 0, READER, runs(need), **kwargs)
    ranges = plain(wire)
    assert ranges == [{"start": 0, "stop": 500, "sources": ["p", "r"], "wait": []},
                      {"start": 500, "stop": 1000, "sources": ["p", "q"], "wait": []},
                      {"start": 1000, "stop": 1500, "sources": ["q", "t"], "wait": ["p"]},
                      {"start": 1500, "stop": 5000, "sources": ["t"], "wait": ["p", "q"]},
                      {"start": 5001, "stop": n, "sources": ["t"], "wait": ["p", "q"]}]
    assert (ranges, named, missing) == reference_route(v, 0, READER, need, **kwargs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=300),
       st.lists(st.booleans(), max_size=64))
def test_runs_and_missing_runs_cover_exactly_their_chunks(chunks, bits):
    assert [c for a, b in runs(chunks) for c in range(a, b)] == sorted(set(chunks))
    have = bytearray(bits)
    spans = missing_runs(have)
    assert [c for a, b in spans for c in range(a, b)] == [i for i, h in enumerate(bits) if not h]
    assert all(b < c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))  # never adjacent
    assert all(type(x) is int for span in spans for x in span)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_the_default_ranking_orders_replicas_as_rank_by_locality_does(case):
    """`rank_by_locality` is ranked without `SourceCandidate`s: the same replicas, same order."""
    v, _, kwargs = case
    reader = kwargs["workers"][READER].location
    banned = kwargs["banned"]

    def keep(r: Replica) -> bool:
        return r.worker != READER and r.worker not in banned

    def wrapped(loc: Location, cands: Sequence[SourceCandidate]) -> list[SourceCandidate]:
        return rank_by_locality(loc, cands)

    for shard in (0, 1):
        args = dict(workers=kwargs["workers"], load=kwargs["load"], keep=keep)
        fast = ranked_replicas(v, shard, reader, rank_sources=rank_by_locality, **args)
        plain = ranked_replicas(v, shard, reader, rank_sources=wrapped, **args)
        assert [r.worker for r in fast] == [r.worker for r in plain]
        assert all(a is b for a, b in zip(fast, plain, strict=True))


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(
    st.lists(bitmaps(n), max_size=6), st.lists(st.booleans(), min_size=6, max_size=6),
    st.sets(st.integers(0, n - 1), min_size=1).map(sorted))))
def test_few_stretches_cut_the_runs_as_stretches_does(case):
    """The stretches found in Python, when there are few, are numpy's (`_stretches`)."""
    maps, complete, chunks = case
    reps = [Replica(f"w{i}", 0, have, complete=done)
            for i, (have, done) in enumerate(zip(maps, complete, strict=False))]
    need = runs(chunks)
    starts, stops = routing._stretches(reps, need)
    few = routing._few_stretches(reps, need)
    lo, hi = need[0][0], need[-1][1]
    edges = {c for r in reps if not r.complete for c in range(lo + 1, hi)
             if r.have[c] != r.have[c - 1]}
    if few is None:     # only where there may be many: many runs, or many edges
        assert len(need) > routing.FEW_STRETCHES or len(edges) > routing.FEW_STRETCHES
    else:
        assert few == (starts.tolist(), stops.tolist())
        assert all(type(x) is int for x in (*few[0], *few[1]))
