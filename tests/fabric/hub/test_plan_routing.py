"""Plan-driven routing: the hub names each planned reader's upstreams from the planner's forest."""

from __future__ import annotations

import threading

import pytest
from hub_helpers import FakeClock, small_manifest

from weightfabric.fabric.client import FetchPlan
from weightfabric.fabric.hub.ops import Park, op_begin_fetch
from weightfabric.fabric.hub.planned import PlanRouter, plan_router
from weightfabric.fabric.hub.state import HubState
from weightfabric.fabric.hub_messages import BeginFetchRequest
from weightfabric.fabric.locality import Location
from weightfabric.topology import reference_cluster

MODEL = "policy"
CHUNKS = 64
NODES = {"trainer": "dc-a", "a-0": "dc-a", "a-1": "dc-a", "a-2": "dc-a",
         "b-0": "dc-b", "b-1": "dc-b", "b-2": "dc-b"}
READERS = [n for n in NODES if n != "trainer"]


def _hub(start_bound_s: float = 2.0) -> tuple[HubState, PlanRouter, FakeClock]:
    clock = FakeClock()
    router = plan_router(reference_cluster("two-datacenters"), start_bound_s=start_bound_s)
    hub = HubState(clock=clock, lease_s=60.0, rank_sources=router.ranker, plan_routing=router)
    for node, dc in NODES.items():     # host-memory workers: one per node, on its host vertex
        hub.register(node, session=node, location=Location(dc, node, "host"),
                     endpoints={"read": {"host": "127.0.0.1", "port": 1}})
    return hub, router, clock


def _publish(hub: HubState) -> int:
    version = hub.begin_publish(MODEL, "trainer", small_manifest(CHUNKS), session="trainer").version
    hub.commit(MODEL, version, "trainer", session="trainer")
    return version


def _fetch_whole(hub: HubState, reader: str, version: int) -> None:
    plan = hub.begin_fetch(MODEL, version, reader, session=reader, fetch_id=f"{reader}-{version}")
    hub.report_progress(plan.fetch_id, reader, session=reader, chunks=list(range(CHUNKS)))
    hub.complete_fetch(plan.fetch_id, reader, session=reader)


def _members(hub: HubState) -> int:
    """Every reader fetches a first version (ranked: none is a member yet); a second one."""
    first = _publish(hub)
    for r in READERS:
        _fetch_whole(hub, r, first)
    return _publish(hub)


def _read_from(plan) -> dict[int, str]:
    """Chunk -> the one worker a planned reader is told to read it from."""
    out = {}
    for r in plan.ranges:
        named = [*r.wait, *r.sources]
        assert len(named) == 1, r
        out.update({c: named[0] for c in range(r.start, r.stop)})
    return out


def _planned_upstream(router: PlanRouter, version: int, reader: str) -> dict[int, str]:
    vp = router.plan_of(MODEL, version, 0)
    assert vp is not None
    return {c: up for lo, hi, up, _ in vp.reads[reader] for c in range(lo, hi)}


def test_readers_plans_follow_the_forests_parents():
    hub, router, _ = _hub()
    version = _members(hub)
    for r in READERS:      # in this order, some begin before their upstreams: plan again
        hub.begin_fetch(MODEL, version, r, session=r, fetch_id=f"{r}-f")
    plans = {r: hub.plan(f"{r}-f", r, session=r) for r in READERS}
    vp = router.plan_of(MODEL, version, 0)
    assert vp is not None and set(vp.readers) == set(READERS)
    assert vp.sources == {"trainer": "trainer/host"}
    crossing = set()
    for r in READERS:
        expected = _planned_upstream(router, version, r)
        assert set(expected) == set(range(CHUNKS))           # every chunk planned once
        assert _read_from(plans[r]) == expected               # the running plan is the forest
        crossing |= {c for c, up in expected.items()
                     if NODES[r] == "dc-b" and NODES[up] == "dc-a"}
        for rng in plans[r].ranges:    # a partial upstream is waited on, the trainer read
            assert (rng.sources == ["trainer"]) == (rng.wait == [])
    assert crossing == set(range(CHUNKS))       # every chunk crosses the WAN ...
    wan_reads = sum(1 for r in READERS if NODES[r] == "dc-b"
                    for c, up in _planned_upstream(router, version, r).items()
                    if NODES[up] == "dc-a")
    assert wan_reads == CHUNKS                  # ... exactly once
    assert not vp.routed_around
    assert all(p.planned for p in plans.values())    # the engine keeps a read per tree
    # ... and the reader's side of the reply says so (it did not, 2026-11-26 to 11-29)
    assert all(FetchPlan.from_reply(p, small_manifest(CHUNKS)).planned for p in plans.values())
    assert vp.predicted is None  # never predicted on a fetch's way (it may simulate)
    shown = hub.snapshot()["plans"][0]
    assert shown["readers"] == len(READERS)
    assert vp.predicted is not None and set(vp.predicted) == set(READERS)
    assert shown["predicted_s"] == max(vp.predicted.values()) > 0


def test_ranges_across_the_wan_keep_its_bandwidth_delay_product_in_flight():
    hub, router, _ = _hub()
    version = _members(hub)
    for r in READERS:
        hub.begin_fetch(MODEL, version, r, session=r, fetch_id=f"{r}-f")
    wan, lan = {}, {}
    for r in READERS:
        for rng in hub.plan(f"{r}-f", r, session=r).ranges:
            up = [*rng.wait, *rng.sources][0]
            (wan if NODES[r] != NODES[up] else lan)[(r, rng.start)] = rng.window
    vp = router.plan_of(MODEL, version, 0)
    assert vp is not None and wan and lan
    # a range per planned read: those over the 100 Gb/s, 20 ms link keep rate x round trip
    # in flight, together the link's (about 500 MB: the round trip is 40 ms plus a few
    # microseconds inside each datacenter)
    assert sum(wan.values()) == pytest.approx(100e9 / 8 * 0.040, rel=0.01)
    assert 0 < max(lan.values()) < 4 << 20  # microseconds of latency: a few MB at most


def test_a_planned_upstream_that_never_starts_is_routed_around_within_the_bound():
    hub, router, clock = _hub(start_bound_s=2.0)
    version = _members(hub)
    # the first reader to fetch builds the plan; pick a reader whose planned upstream is a
    # rollout, and let that upstream never begin its fetch
    hub.begin_fetch(MODEL, version, "a-0", session="a-0", fetch_id="a-0-f")
    vp = router.plan_of(MODEL, version, 0)
    assert vp is not None
    reader, absent = next((r, up) for r in READERS for up in sorted(vp.upstreams(r))
                          if up not in ("trainer", "a-0") and r != "a-0")
    for r in READERS:
        if r not in (reader, absent, "a-0"):
            hub.begin_fetch(MODEL, version, r, session=r, fetch_id=f"{r}-f")
    started = [r for r in READERS if r != absent]
    req = BeginFetchRequest(model=MODEL, version=version, worker=reader, fetch_id=f"{reader}-f")
    answer = op_begin_fetch(hub, reader, req)
    assert isinstance(answer, Park)                     # waits for its upstream to begin
    assert answer.timeout == pytest.approx(2.0)
    assert answer.check() is None
    clock.advance(2.0)
    plan = answer.on_timeout()                          # the bound passed: routed around
    named = _read_from(plan)
    assert absent not in named.values()
    assert set(named) == set(range(CHUNKS))
    # the chunks the absent worker would have relayed come from its own planned upstream
    # (or, up the forest, from a started ancestor)
    for c, up in _planned_upstream(router, version, reader).items():
        if up == absent:
            assert named[c] in (*started, "trainer")
    assert reader in vp.routed_around
    # an upstream that begins within the bound releases the parked reader with the plan
    hub2, router2, _ = _hub(start_bound_s=2.0)
    version2 = _members(hub2)
    hub2.begin_fetch(MODEL, version2, "a-0", session="a-0", fetch_id="a-0-f")
    answer = op_begin_fetch(hub2, reader, req.__class__(model=MODEL, version=version2,
                                                        worker=reader, fetch_id=f"{reader}-f"))
    ups = router2.plan_of(MODEL, version2, 0).upstreams(reader) - {"trainer", "a-0"}
    if isinstance(answer, Park):
        for up in ups:
            hub2.begin_fetch(MODEL, version2, up, session=up, fetch_id=f"{up}-f")
        plan = answer.check()
        assert plan is not None
        assert _read_from(plan) == _planned_upstream(router2, version2, reader)


def test_a_failed_upstream_is_routed_around_on_replan():
    hub, router, _ = _hub()
    version = _members(hub)
    for r in READERS:
        hub.begin_fetch(MODEL, version, r, session=r, fetch_id=f"{r}-f")
    vp = router.plan_of(MODEL, version, 0)
    reader, bad = next((r, up) for r in READERS for up in sorted(vp.upstreams(r))
                       if up != "trainer")
    plan = hub.plan(f"{reader}-f", reader, session=reader, exclude=[bad])
    named = _read_from(plan)
    assert bad not in named.values() and set(named) == set(range(CHUNKS))


def test_a_reader_not_in_the_plan_gets_a_ranked_plan():
    hub, router, _ = _hub()
    version = _members(hub)
    hub.register("b-late", session="b-late", location=Location("dc-b", "b-5", "host"),
                 endpoints={"read": {"host": "127.0.0.1", "port": 1}})
    for r in READERS:
        hub.begin_fetch(MODEL, version, r, session=r, fetch_id=f"{r}-f")
    late = hub.begin_fetch(MODEL, version, "b-late", session="b-late", fetch_id="late")
    vp = router.plan_of(MODEL, version, 0)
    assert "b-late" not in vp.readers and not late.planned
    # ranked: partial replicas in its own datacenter to wait on, striped, not one upstream
    # per range of the forest
    assert late.ranges and all(r.wait or r.sources for r in late.ranges)
    assert any(len(r.wait) + len(r.sources) > 1 for r in late.ranges)
    # and it is a member of the next version's plan
    nxt = _publish(hub)
    hub.begin_fetch(MODEL, nxt, "b-late", session="b-late", fetch_id="late-2")
    assert "b-late" in router.plan_of(MODEL, nxt, 0).readers


def test_without_members_or_a_mapped_location_nothing_is_planned():
    hub, router, _ = _hub()
    first = _publish(hub)
    plan = hub.begin_fetch(MODEL, first, "a-0", session="a-0", fetch_id="first")
    assert router.plan_of(MODEL, first, 0) is None      # nobody fetched the model before
    assert plan.ranges[0].sources == ["trainer"]
    hub.register("ghost", session="ghost", location=Location("dc-z", "nowhere", "host"),
                 endpoints={"read": {"host": "127.0.0.1", "port": 1}})
    _fetch_whole(hub, "ghost", first)
    version = _publish(hub)
    hub.begin_fetch(MODEL, version, "ghost", session="ghost", fetch_id="ghost-2")
    vp = router.plan_of(MODEL, version, 0)
    assert vp is None or "ghost" not in vp.readers


def test_a_parked_begin_fetch_is_answered_through_the_server():
    """Over a memory hub: the parked plan arrives once the upstream begins, with read caps."""
    import weightfabric as wf

    router = plan_router(reference_cluster("two-datacenters"), start_bound_s=30.0)
    server = wf.serve("memory://plan-routing", plan_routing=router, lease_s=60.0)
    clients = {}
    try:
        for node, dc in NODES.items():
            clients[node] = wf.connect(server.url, worker=node, heartbeat=False, timeout=20.0,
                                       location={"datacenter": dc, "node": node,
                                                 "device": "host"},
                                       endpoints={"read": {"host": "127.0.0.1", "port": 1}})
        trainer = clients["trainer"]
        v = trainer.begin_publish(MODEL, small_manifest(CHUNKS))
        trainer.commit(MODEL, v)
        for r in READERS:
            p = clients[r].begin_fetch(MODEL, v)
            clients[r].report_progress(p.fetch_id, list(range(CHUNKS)))
            clients[r].complete_fetch(p.fetch_id)
        v = trainer.begin_publish(MODEL, small_manifest(CHUNKS))
        trainer.commit(MODEL, v)
        got: dict[str, object] = {}

        def begin(r: str) -> threading.Thread:
            t = threading.Thread(target=lambda: got.update({r: clients[r].begin_fetch(MODEL, v)}))
            t.start()
            return t
        threads = {"a-0": begin("a-0")}             # the first fetch makes the plan
        while router.plan_of(MODEL, v, 0) is None and threads["a-0"].is_alive():
            threads["a-0"].join(0.01)
        vp = router.plan_of(MODEL, v, 0)
        reader, up = next((r, u) for r in READERS for u in sorted(vp.upstreams(r))
                          if u not in ("trainer", "a-0") and r != "a-0")
        threads |= {r: begin(r) for r in READERS if r not in threads and r != up}
        threads[reader].join(0.5)
        assert threads[reader].is_alive()            # parked: its upstream has not begun
        threads[up] = begin(up)
        for t in threads.values():
            t.join(10)
        assert not any(t.is_alive() for t in threads.values())
        plan = got[reader]
        assert up in {w for r in plan.ranges for w in (*r.wait, *r.sources)}
        assert all(src.cap for src in plan.workers.values())   # read capabilities added
    finally:
        for c in clients.values():
            c.close()
        server.stop()
