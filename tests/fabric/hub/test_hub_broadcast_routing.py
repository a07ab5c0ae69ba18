"""Plans for a version with hundreds of readers: a sample of the replicas is ranked.

Beyond `routing.FULL_RANK_LIMIT` replicas of a shard a plan ranks the reader's node, a
few of its datacenter and of all, and a few complete replicas (`routing._sampled`), so its
cost does not grow with the readers. Checked here without timing: the plans keep the
invariants (sources hold the chunks, waits began earlier, never the reader), readers
chain to their node's earlier peers, the ranking sees a bounded number of candidates,
the sample widens to every replica when it leaves a chunk without a source, and the
index's pools equal a full scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hub_helpers import small_manifest

from weightfabric.fabric.errors import NoSourceError
from weightfabric.fabric.hub import routing
from weightfabric.fabric.hub.state import HubState
from weightfabric.fabric.locality import Location, SourceCandidate, rank_by_locality

READERS = 300
GPUS = 8


def where(i: int) -> Location:
    return Location(f"dc{i // 160}", f"n{i // GPUS}", f"gpu{i % GPUS}")


class Counting:
    """`rank_by_locality`, recording how many candidates each ranking was given."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, reader: Location, cands: Sequence[SourceCandidate]
                 ) -> list[SourceCandidate]:
        self.sizes.append(len(cands))
        return rank_by_locality(reader, cands)


def broadcast(state: HubState, readers: int = READERS, chunks: int = 16) -> int:
    state.register("trainer", session="t", location=Location("dc0", "trainer"))
    v = state.begin_publish("m", "trainer", small_manifest(chunks), session="t").version
    state.commit("m", v, "trainer", session="t")
    for i in range(readers):
        state.register(f"r{i}", session=f"r{i}", location=where(i))
    return v


def check_plan(state: HubState, v: int, reader: str, plan) -> None:
    rec = state.models["m"].versions[v]
    order = list(rec.replicas)
    for r in plan.ranges:
        assert reader not in r.sources and reader not in r.wait
        for w in r.sources:
            rep = rec.replicas[(w, 0)]
            assert rep.complete or all(rep.have[c] for c in range(r.start, r.stop))
        for w in r.wait:        # earlier, partial, lacking the chunks: no wait cycle
            assert order.index((w, 0)) < order.index((reader, 0))
            assert not rec.replicas[(w, 0)].complete


def test_plans_of_hundreds_of_readers_rank_a_bounded_sample_and_chain_on_the_node():
    ranking = Counting()
    state = HubState(lease_s=3600, rank_sources=ranking)
    v = broadcast(state)
    cap = (routing.NODE_SAMPLE + routing.NEAR_SAMPLE + routing.FAR_SAMPLE
           + state.max_sources)
    for i in range(READERS):
        w = f"r{i}"
        plan = state.begin_fetch("m", v, w, session=w, fetch_id=w)
        check_plan(state, v, w, plan)
        if i > routing.FULL_RANK_LIMIT:
            assert ranking.sizes[-1] <= cap, (i, ranking.sizes[-1])
        if i % GPUS:     # its node's earlier readers are nearest: it waits on them
            assert any(where(int(x[1:])).node == where(i).node
                       for r in plan.ranges for x in r.wait), (i, plan.ranges)
        if i % 50 == 0:
            state._check_indexes()
    assert max(ranking.sizes) <= max(routing.FULL_RANK_LIMIT + 1, cap)
    state._check_indexes()


def test_reports_complete_and_release_keep_the_pools_equal_to_a_scan():
    state = HubState(lease_s=3600)
    v = broadcast(state, readers=120)
    for i in range(120):
        state.begin_fetch("m", v, f"r{i}", session=f"r{i}", fetch_id=f"r{i}")
    for i in range(0, 120, 3):
        state.report_progress(f"r{i}", f"r{i}", session=f"r{i}", chunks=list(range(8)))
    for i in range(0, 120, 5):
        state.complete_fetch(f"r{i}", f"r{i}", session=f"r{i}")
    released = [i for i in range(1, 120, 7) if i % 5]
    for i in released:
        state.release(f"r{i}", f"r{i}", session=f"r{i}")
    state._check_indexes()
    for i in released:   # a released reader begins again: after everyone
        plan = state.begin_fetch("m", v, f"r{i}", session=f"r{i}", fetch_id=f"r{i}-again")
        check_plan(state, v, f"r{i}", plan)
    state._check_indexes()


def test_a_sample_without_a_source_for_some_chunk_widens_to_every_replica():
    """Only one partial replica has chunk 15 once the trainer is gone: the plan finds it."""
    state = HubState(lease_s=3600)
    v = broadcast(state, readers=200)
    for i in range(200):
        w = f"r{i}"
        state.begin_fetch("m", v, w, session=w, fetch_id=w)
        state.report_progress(w, w, session=w, chunks=list(range(15 if i != 3 else 16)))
    state.unregister("trainer", session="t")
    state.register("late", session="late", location=Location("dc9", "far"))
    plan = state.begin_fetch("m", v, "late", session="late", fetch_id="late")
    check_plan(state, v, "late", plan)
    assert [r.sources for r in plan.ranges if r.start <= 15 < r.stop] == [["r3"]]
    state.unregister("r3", session="r3")
    with pytest.raises(NoSourceError):
        state.plan("late", "late", session="late")


class Plain:
    """`rank_by_locality` under another name: the ranking through `SourceCandidate`s."""

    def __call__(self, reader: Location, cands: Sequence[SourceCandidate]
                 ) -> list[SourceCandidate]:
        return rank_by_locality(reader, cands)


def test_the_default_ranking_plans_what_ranking_candidates_plans():
    """The default ranking (one key per replica, no `SourceCandidate`s) names the same sources.

    Two hubs see the same operations, one ranking with `rank_by_locality` itself (the
    fast path), one through a `RankSources` wrapper of it: every plan is the same while
    readers begin, report, complete, release, leave and a replica is quarantined.
    """
    states = [HubState(lease_s=3600), HubState(lease_s=3600, rank_sources=Plain())]
    readers = 200

    def both(op: str, *args, **kwargs):
        out = [getattr(s, op)(*args, **kwargs) for s in states]
        if op in ("begin_fetch", "plan"):
            assert out[0] == out[1], (op, args)
        return out[0]

    for s in states:
        v = broadcast(s, readers=readers)
    for i in range(readers):
        w = f"r{i}"
        plan = both("begin_fetch", "m", v, w, session=w, fetch_id=w)
        check_plan(states[0], v, w, plan)
        if i >= 40 and i != 122:  # earlier readers report half, then complete (not r82)
            j = f"r{i - 40}"
            both("report_progress", j, j, session=j, chunks=list(range(8)))
        if i >= 80 and i % 3 and i != 162:
            j = f"r{i - 80}"
            both("complete_fetch", j, j, session=j)
        if i == 120:     # a holder leaves, a complete one is quarantined, one releases its fetch
            both("unregister", "r5", session="r5")
            assert both("report_corrupt", "m", v, 0, "r2", "r3", session="r3",
                        chunks=[0]).quarantined
            both("release", "r82", "r82", session="r82")
        if i > 120:     # no plan names them again
            assert not {"r2", "r5", "r82"} & {x for r in plan.ranges
                                               for x in (*r.sources, *r.wait)}
    for i in (150, 151, 199):    # re-plans, excluding a source
        w = f"r{i}"
        both("plan", w, w, session=w, exclude=["trainer"])
    for s in states:
        s._check_indexes()


def test_plans_share_a_budget_of_progress_reports_among_the_fetches_in_flight():
    """Each plan asks for ``report_budget`` over the shard's fetches in flight, itself in."""
    state = HubState(lease_s=3600, report_budget=12)
    v = broadcast(state, readers=20)
    asked = [state.begin_fetch("m", v, f"r{i}", session=f"r{i}", fetch_id=f"r{i}").max_reports
             for i in range(20)]
    assert asked == [12 // n for n in range(1, 21)]
    assert sum(min(2, k or 0) for k in asked) <= 2 * 12   # what engines of K=2 send at most
    for i in range(15):          # completed replicas are not fetching: the share grows
        state.complete_fetch(f"r{i}", f"r{i}", session=f"r{i}")
    state.register("late", session="late", location=where(0))
    assert state.begin_fetch("m", v, "late", session="late", fetch_id="late").max_reports == 2
    assert state.plan("late", "late", session="late").max_reports == 2   # a re-plan too
    unlimited = HubState(lease_s=3600, report_budget=None)
    v = broadcast(unlimited, readers=1)
    assert unlimited.begin_fetch("m", v, "r0", session="r0", fetch_id="r0").max_reports is None
    with pytest.raises(ValueError, match="report_budget"):
        HubState(report_budget=-1)
