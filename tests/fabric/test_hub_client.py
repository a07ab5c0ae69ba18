"""The hub over its real protocol, in one process (memory:// and loopback TCP)."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Any, TypeVar

import pytest
import zmq
from hub_helpers import FakeClock, OffsetClock, small_manifest
from hypothesis import given
from hypothesis import strategies as st

import weightfabric as wf
from weightfabric.fabric.errors import (
    DuplicateWorkerError,
    GroupAbortedError,
    HubTimeoutError,
    HubUnavailableError,
    ManifestMismatchError,
    NoSourceError,
    RetentionError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    WaitTimeoutError,
)
from weightfabric.fabric.hub import ops as hub_ops
from weightfabric.fabric.hub import server as hub_server
from weightfabric.fabric.hub.state import MAX_CHUNKS, HubState
from weightfabric.fabric.hub_messages import (
    CompleteReply,
    DropReply,
    PingReply,
    PingRequest,
    Request,
    RestoreRequest,
)
from weightfabric.fabric.manifest import Manifest, TensorSpec
from weightfabric.fabric.zmq_util import endpoint, make_socket

_names = itertools.count()
T = TypeVar("T")


@pytest.fixture
def clock() -> OffsetClock:
    return OffsetClock()


@pytest.fixture
def hub(clock):
    server = wf.serve(f"memory://test-{next(_names)}", lease_s=10.0, clock=clock)
    yield server
    server.stop()


@pytest.fixture
def clients(hub):
    made: list[wf.HubClient] = []

    def make(worker: str | None, **kw) -> wf.HubClient:
        c = wf.connect(hub.url, worker=worker, heartbeat=False, timeout=5.0, **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def publish(client: wf.HubClient, model: str = "policy", **kw) -> int:
    v = client.begin_publish(model, small_manifest(**kw))
    assert client.commit(model, v) == "committed"
    return v


def test_publish_fetch_complete_makes_reader_a_source(clients) -> None:
    t = clients("trainer", location={"datacenter": "dc1", "node": "n1"})
    r1 = clients("r1", location={"datacenter": "dc1", "node": "n2"})
    r2 = clients("r2", location={"datacenter": "dc1", "node": "n2"})
    v = publish(t)
    assert r1.latest("policy") == v
    plan = r1.begin_fetch("policy", "latest", fingerprint=small_manifest().fingerprint)
    assert plan.version == v and plan.chunks() == [0, 1, 2, 3]
    assert plan.ranges[0].sources == ("trainer",)
    assert plan.workers["trainer"].location.node == "n1"
    r1.report_progress(plan.fetch_id, [0, 1])
    plan2 = r2.begin_fetch("policy", v)
    # r1 shares r2's node: it is ranked first for the chunks it has, waited for the others.
    assert plan2.ranges[0].start == 0 and plan2.ranges[0].sources[0] == "r1"
    assert plan2.ranges[-1].sources == ("trainer",) and plan2.ranges[-1].wait == ("r1",)
    assert r1.complete_fetch(plan.fetch_id) == CompleteReply(complete=True, group=None)
    assert r2.replan(plan2.fetch_id).ranges[0].sources[0] == "r1"


def test_versions_are_monotonic_and_latest_needs_commit(clients) -> None:
    t = clients("trainer")
    v1 = publish(t)
    v2 = t.begin_publish("policy", small_manifest())
    assert v2 > v1 and t.latest("policy") == v1
    with pytest.raises(UnknownVersionError):
        clients("r").begin_fetch("policy", v2)
    t.commit("policy", v2)
    assert t.latest("policy") == v2


def test_bad_input_gets_typed_errors(clients) -> None:
    t = clients("trainer")
    with pytest.raises(DuplicateWorkerError):
        clients("trainer")
    v = publish(t)
    r = clients("r")
    with pytest.raises(UnknownModelError):
        r.begin_fetch("nope")
    with pytest.raises(UnknownVersionError):
        r.begin_fetch("policy", 99)
    with pytest.raises(ManifestMismatchError):
        r.begin_fetch("policy", v, fingerprint="0" * 32)
    with pytest.raises(wf.BadRequestError):
        r.call("begin_fetch", {"worker": "r", "model": 5, "fetch_id": "x"})
    with pytest.raises(wf.BadRequestError):
        r.call("no_such_op", {})


def test_retract_waits_for_reads_in_flight(clients) -> None:
    t, r1, r2 = clients("trainer"), clients("r1"), clients("r2")
    v = publish(t)
    done = r1.begin_fetch("policy", v)
    r1.complete_fetch(done.fetch_id)          # two complete replicas: retention allows it
    plan = r2.begin_fetch("policy", v)
    assert "trainer" in plan.workers
    assert t.retract("policy", v, wait=0) == "retracting"
    assert "trainer" not in r2.replan(plan.fetch_id).workers   # no new reads routed
    assert t.retract_status("policy", v) == "retracting"        # r2's old plan may still read
    r2.report_progress(plan.fetch_id, [0, 1, 2, 3], sources=["r1"])
    assert t.retract_status("policy", v) == "done"


def test_retract_long_poll_returns_when_reader_finishes(clients) -> None:
    t, r1, r2 = clients("trainer"), clients("r1"), clients("r2")
    v = publish(t)
    r1.complete_fetch(r1.begin_fetch("policy", v).fetch_id)
    plan = r2.begin_fetch("policy", v)
    finisher = threading.Timer(0.2, lambda: r2.complete_fetch(plan.fetch_id))
    finisher.start()
    try:
        t0 = time.monotonic()
        assert t.retract("policy", v, wait=5) == "done"
        assert time.monotonic() - t0 < 4
    finally:
        finisher.join()


def test_retention_refuses_or_delays_retract_below_min_replicas(clients) -> None:
    t, r = clients("trainer"), clients("r")
    v = publish(t)
    with pytest.raises(RetentionError):
        t.retract("policy", v, wait=0)
    assert t.retract("policy", v, wait=0, delay=True) == "delayed"
    assert r.begin_fetch("policy", v).ranges[0].sources == ("trainer",)  # still routed
    plan = r.replan(r.status()["fetches"][0]["fetch_id"])
    r.complete_fetch(plan.fetch_id)
    assert t.retract_status("policy", v) == "done"
    r.set_retention("policy", min_replicas=0)
    assert r.retract("policy", v, wait=0) == "done"


def test_keep_last_retires_old_versions_and_pin_keeps_them(clients) -> None:
    t = clients("trainer")
    t.set_retention("policy", keep_last=1)
    v1 = publish(t)
    t.pin("policy", v1)
    v2 = publish(t)
    v3 = publish(t)
    models = t.status()["models"]["policy"]["versions"]
    states = {x["version"]: x["state"] for x in models}
    assert states == {v1: "committed", v2: "retired", v3: "committed"}
    t.unpin("policy", v1)
    assert {x["version"]: x["state"] for x in t.status()["models"]["policy"]["versions"]}[v1] \
        == "retired"


def test_wait_version_long_polls_until_commit(clients) -> None:
    t, r = clients("trainer"), clients("r")
    v1 = publish(t)
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="newer than v"):
        r.wait_version("policy", after=v1, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    committer = threading.Timer(0.2, lambda: publish(t))
    committer.start()
    try:
        assert r.wait_version("policy", after=v1, timeout=5) == v1 + 1
    finally:
        committer.join()


def test_group_publish_commits_when_every_shard_commits(clients) -> None:
    a, b, r = clients("tp0"), clients("tp1"), clients("r")
    va = a.begin_publish("policy", small_manifest(tag="s0"), shard=0, num_shards=2, group="s1")
    vb = b.begin_publish("policy", small_manifest(tag="s1"), shard=1, num_shards=2, group="s1")
    assert va == vb
    assert a.commit("policy", va) == "publishing" and r.latest("policy") is None
    assert b.commit("policy", vb) == "committed" and r.latest("policy") == va


@pytest.mark.parametrize("bad", [{"have": [99]}, {"group": "g", "group_size": 0}])
def test_refused_begin_fetch_leaves_no_partial_replica(hub, clients, bad) -> None:
    t, r, r2 = clients("trainer"), clients("r"), clients("r2")
    v = publish(t)
    with pytest.raises(wf.BadRequestError):
        r.begin_fetch("policy", v, **bad)
    assert ("r", 0) not in hub.state.models["policy"].versions[v].replicas
    plan = r2.begin_fetch("policy", v)             # nobody is told to wait on "r"
    assert set(plan.workers) == {"trainer"} and all(not rg.wait for rg in plan.ranges)


def test_manifest_over_the_chunk_limit_is_refused_naming_the_limit(clients) -> None:
    n = MAX_CHUNKS + 1           # one byte per chunk: a tiny message, too many chunks
    huge = Manifest((TensorSpec("w", (n,), "uint8", n, 0),), 1, (), n)
    t = clients("trainer")
    with pytest.raises(wf.BadRequestError, match=f"limit of {MAX_CHUNKS}.*chunk_size"):
        t.begin_publish("policy", huge)
    holding = {"model": "policy", "version": 1, "shard": 0, "num_shards": 1,
               "manifest": huge.to_wire(), "state": "committed", "complete": True}
    with pytest.raises(wf.BadRequestError, match=f"limit of {MAX_CHUNKS}"):
        t.call("restore", {"worker": "trainer", "holdings": [holding]})
    assert "policy" not in t.status()["models"]


def test_group_fetch_is_all_or_nothing(clients) -> None:
    t = clients("trainer")
    t.set_retention("policy", min_replicas=0)
    v = publish(t)
    r0, r1 = clients("r0"), clients("r1")
    p0 = r0.begin_fetch("policy", group="g", group_size=2)
    p1 = r1.begin_fetch("policy", group="g", group_size=2)
    assert p0.version == p1.version == v
    assert r0.complete_fetch(p0.fetch_id) == CompleteReply(complete=False, group="open")
    assert t.status()["models"]["policy"]["versions"][0]["full"] == 1   # not yet
    assert r1.complete_fetch(p1.fetch_id).group == "committed"
    assert t.status()["models"]["policy"]["versions"][0]["full"] == 3
    a0, a1 = clients("a0"), clients("a1")
    f0 = a0.begin_fetch("policy", group="g3", group_size=2)
    f1 = a1.begin_fetch("policy", group="g3", group_size=2)
    a0.complete_fetch(f0.fetch_id)
    a1.release(f1.fetch_id)
    assert a0.group_status("policy", "g3").state == "aborted"
    assert t.status()["models"]["policy"]["versions"][0]["full"] == 3
    with pytest.raises(GroupAbortedError):
        clients("a2").begin_fetch("policy", group="g3", group_size=2)


def test_group_member_retracting_after_completing_aborts_the_group(hub, clients) -> None:
    t = clients("trainer")
    v = t.begin_publish("policy", small_manifest(tag="s0"), shard=0, num_shards=2, group="p")
    t.begin_publish("policy", small_manifest(tag="s1"), shard=1, num_shards=2, group="p")
    assert t.commit("policy", v) == "committed"
    r0, r1 = clients("r0"), clients("r1")
    f0 = r0.begin_fetch("policy", v, shard=0, group="g", group_size=2)
    f1 = r1.begin_fetch("policy", v, shard=1, group="g", group_size=2)
    assert r0.complete_fetch(f0.fetch_id).group == "open"
    assert r0.retract("policy", v, wait=1) == "done"         # gives up before the others
    g = r1.group_status("policy", "g")
    assert g.state == "aborted" and "retracted" in g.reason
    with pytest.raises(UnknownFetchError):
        r1.complete_fetch(f1.fetch_id)
    assert t.status()["models"]["policy"]["versions"][0]["full"] == 2   # the publisher's
    again = r1.begin_fetch("policy", v, shard=1)                # r1 may start over alone
    assert r1.complete_fetch(again.fetch_id).complete


def test_a_reader_forgets_the_news_of_fetches_it_completed_or_released(hub, clock,
                                                                      clients) -> None:
    t, r1, r2, r3 = (clients(w) for w in ("trainer", "r1", "r2", "r3"))
    v = publish(t)
    r1.complete_fetch(r1.begin_fetch("policy", v).fetch_id)
    done, dropped = r2.begin_fetch("policy", v), r3.begin_fetch("policy", v)
    clock.advance(6)
    for c in (t, r2, r3):
        c.heartbeat()
    clock.advance(6)                        # r1's lease is over: both fetches hear it
    r2.heartbeat()
    r3.heartbeat()
    assert r2.lost == {done.fetch_id: {"r1"}} and r3.lost == {dropped.fetch_id: {"r1"}}
    assert r2.complete_fetch(done.fetch_id).complete and r2.lost == {}
    r3.release(dropped.fetch_id)
    assert r3.lost == {}


def test_expired_worker_leaves_plans_and_readers_learn(hub, clock, clients) -> None:
    t, r1, r2 = clients("trainer"), clients("r1"), clients("r2")
    v = publish(t)
    r1.complete_fetch(r1.begin_fetch("policy", v).fetch_id)
    plan = r2.begin_fetch("policy", v)
    assert set(plan.workers) == {"trainer", "r1"}
    clock.advance(6)
    t.heartbeat()
    r2.heartbeat()
    clock.advance(6)                        # r1 missed its heartbeat: lease over
    news = r2.heartbeat()
    assert news.lost == {plan.fetch_id: ["r1"]} and r2.lost == {plan.fetch_id: {"r1"}}
    assert set(r2.replan(plan.fetch_id).workers) == {"trainer"}
    clock.advance(11)                       # everyone gone except r2, which holds no chunk
    r2.heartbeat()
    with pytest.raises(NoSourceError):
        r2.replan(plan.fetch_id)
    assert r2.latest("policy") is None


def test_a_released_fetch_a_peer_still_names_can_be_begun_again(hub, clients) -> None:
    # The released partial replica stays retracting while r2's fetch names r1; a new
    # fetch of the version by r1 starts a new partial replica instead of failing
    # (found by tests/fabric/test_chaos.py).
    t, r1, r2 = clients("trainer"), clients("r1"), clients("r2")
    v = publish(t)
    first = r1.begin_fetch("policy", v)
    r1.report_progress(first.fetch_id, [0])
    assert "r1" in r2.begin_fetch("policy", v).workers
    r1.release(first.fetch_id)
    again = r1.begin_fetch("policy", v)
    assert again.fetch_id != first.fetch_id
    r1.report_progress(again.fetch_id, again.chunks())
    assert r1.complete_fetch(again.fetch_id).complete


def test_a_worker_whose_lease_ran_out_registers_again_at_its_next_call(hub, clock,
                                                                     clients) -> None:
    # A process paused longer than its lease (SIGSTOP, a long GC, a VM hiccup) loses
    # it; its next call must not fail for that (found by tests/fabric/test_chaos.py: a fetch
    # right after SIGCONT raised UnknownWorkerError before the heartbeat thread had
    # registered the worker again).
    t, r = clients("trainer"), clients("r")
    v = publish(t)
    clock.advance(11)                       # both leases ran out
    t.heartbeat()                           # the trainer comes back with its replica
    plan = r.begin_fetch("policy", v)       # r's first call after the pause
    assert set(plan.workers) == {"trainer"}
    clock.advance(11)                       # again, mid-fetch
    t.heartbeat()
    r.report_progress(plan.fetch_id, plan.chunks())   # the fetch was restored with r
    assert r.complete_fetch(plan.fetch_id).complete
    assert {w["worker"] for w in r.status()["workers"]} >= {"trainer", "r"}


@pytest.mark.parametrize("then_expire", [False, True], ids=["between-looks", "inside-an-op"])
def test_a_hub_that_stalls_longer_than_a_lease_drops_nobody(monkeypatch, caplog,
                                                            then_expire) -> None:
    # Heartbeats sent while the hub's loop is stuck wait unread in its queue; the time
    # it did not read must not count against leases or publish claims, also where
    # the stall ends inside an operation, just before it expires leases.
    hub = wf.serve(f"memory://stall-{next(_names)}", lease_s=1.5)
    stall = threading.Event()

    def ping_that_stalls(state: HubState, session: str, args: PingRequest) -> PingReply:
        if stall.is_set():                  # once: the client retries a slow call
            stall.clear()
            time.sleep(2.5)                 # the whole loop waits: no heartbeat is read
            if then_expire:
                state.expire()              # as every operation does first
        return PingReply()

    monkeypatch.setitem(hub_ops.OPS, "ping", hub_ops.Op(PingRequest, ping_that_stalls))
    try:
        with wf.connect(hub.url, worker="t", timeout=10) as t, \
                wf.connect(hub.url, timeout=10) as other:
            v = t.begin_publish("policy", small_manifest())
            stall.set()
            other.call("ping", {})
            time.sleep(0.6)                 # heartbeats after the stall are read
            assert t.commit("policy", v) == "committed"
    finally:
        hub.stop()
    assert "hub stalled for" in caplog.text
    assert "worker dropped" not in caplog.text and "orphaned" not in caplog.text


def test_a_hub_with_a_lease_shorter_than_its_stall_threshold_still_expires_leases() -> None:
    hub = wf.serve(f"memory://short-{next(_names)}", lease_s=0.12)  # ticks are 50 ms
    try:
        with wf.connect(hub.url, worker="w", heartbeat=False, timeout=5), \
                wf.connect(hub.url, timeout=5) as obs:
            time.sleep(1.0)
            assert obs.status()["workers"] == []
    finally:
        hub.stop()


def test_a_call_racing_the_heartbeats_registration_waits_for_its_restore(hub, clock,
                                                                         clients) -> None:
    # The heartbeat thread registers the worker again after its lease ran out; a fetch's
    # call landing between that register and the restore of the fetch heard "no fetch"
    # (UnknownFetchError); it must wait for the restore and retry (found by
    # tests/fabric/test_chaos.py, a reader SIGSTOPped for longer than its lease).
    t, r = clients("trainer"), clients("r")
    plan = r.begin_fetch("policy", publish(t))
    clock.advance(11)                       # both leases ran out
    t.heartbeat()
    request, restoring = r.request, threading.Event()

    def slow_restore(req: Request, reply: type[T], **kw: Any) -> T:
        if isinstance(req, RestoreRequest):
            restoring.set()
            time.sleep(0.5)                 # the fetch's call arrives meanwhile
        return request(req, reply, **kw)

    r.request = slow_restore
    heartbeat = threading.Thread(target=r.heartbeat, kwargs={"channel": "heartbeat"})
    heartbeat.start()
    try:
        assert restoring.wait(5)            # registered again, its fetch not restored yet
        out = r.report_progress(plan.fetch_id, plan.chunks())
        assert out.have == out.num_chunks
    finally:
        heartbeat.join(10)


def test_unreachable_hub_fails_fast_with_clear_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(HubUnavailableError, match="no hub answered"):
        wf.connect("tcp://127.0.0.1:9", timeout=0.5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(HubUnavailableError, match="bad hub URL"):
        wf.connect("http://example", timeout=0.5)


def test_call_to_stopped_hub_times_out(clock) -> None:
    server = wf.serve("tcp://127.0.0.1:0", clock=clock)
    client = wf.connect(server.url, worker="w", heartbeat=False, timeout=0.5)
    try:
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(HubTimeoutError, match="did not answer"):
            client.latest("policy")
        assert time.monotonic() - t0 < 3
    finally:
        client.close()


def test_drop_lets_go_of_one_model_at_once_ignoring_retention() -> None:
    hub = wf.HubState(clock=FakeClock(), lease_s=10.0)
    for w in ("w", "x", "r"):
        hub.register(w, session=w)
    v1 = hub.begin_publish("m", "w", small_manifest(), session="w").version
    hub.commit("m", v1, "w", session="w")             # only replica of the latest: retained
    v2 = hub.begin_publish("m", "w", small_manifest(), session="w").version  # publishing
    v3 = hub.begin_publish("m", "x", small_manifest(), session="x").version
    hub.commit("m", v3, "x", session="x")
    hub.begin_fetch("m", v3, "w", session="w", fetch_id="fw")      # w's fetch in flight
    hub.begin_fetch("m", v1, "r", session="r", fetch_id="fr")      # r reads from w
    keep = hub.begin_publish("other", "w", small_manifest(), session="w").version
    hub.commit("other", keep, "w", session="w")
    assert hub.drop("m", "w", session="w") == DropReply(dropped=[v1, v2, v3])
    hub._check_indexes()
    versions = hub.models["m"].versions
    assert not any(w == "w" for v in versions.values() for w, _ in v.replicas)
    assert "fw" not in hub.fetches and v2 not in versions      # retired, nobody holds it
    assert hub.heartbeat("r", session="r").lost == {"fr": ["w"]}
    assert hub.latest("m") == v3 and hub.latest("other") == keep


def test_dropped_model_is_not_restored_after_a_hub_restart(clock) -> None:
    url = f"memory://drop-{next(_names)}"
    hub = wf.serve(url, lease_s=10.0, clock=clock)
    try:
        with wf.connect(url, worker="w", heartbeat=False, timeout=5) as w, \
                wf.connect(url, timeout=5) as obs:
            vp, vc = publish(w, "policy"), publish(w, "critic")
            assert w.drop("policy") == [vp]
            assert obs.latest("policy") is None and obs.latest("critic") == vc
            assert w.drop("policy") == []
            hub.stop()
            hub = wf.serve(url, lease_s=10.0, clock=clock)
            w.heartbeat()                       # new epoch: re-registers what it holds
            assert obs.latest("critic") == vc
            assert "policy" not in obs.status()["models"]
    finally:
        hub.stop()


def test_reply_cache_stays_under_its_byte_budget(hub, clients, monkeypatch) -> None:
    budget = 64 * 1024
    monkeypatch.setattr(hub_server, "REPLY_CACHE_BYTES", budget)
    t, r = clients("trainer"), clients("r")
    v = publish(t, num_chunks=4096)
    plan = r.begin_fetch("policy", v)
    for _ in range(40):         # plans that carry the manifest (~12 KiB each)
        assert "manifest" in r.call("plan", {"worker": "r", "fetch_id": plan.fetch_id})
    held = sum(map(len, hub._replies.values()))
    assert 0 < held <= budget and hub._replies_size == held


def test_replan_reuses_the_manifest_from_begin_fetch(hub, clients) -> None:
    t, r = clients("trainer"), clients("r")
    v = publish(t, num_chunks=4096)
    plan = r.begin_fetch("policy", v)
    before = set(hub._replies)
    again = r.replan(plan.fetch_id)
    assert again.manifest == plan.manifest and again.ranges == plan.ranges
    [reply] = [data for key, data in hub._replies.items() if key not in before]
    assert len(reply) < 1024                   # the manifest alone is ~12 KiB


def test_replies_of_read_only_operations_are_not_cached(hub, clients) -> None:
    t, r = clients("trainer"), clients("r")
    v = publish(t)
    r.kv_put("k", b"v")
    r.call("complete_fetch", {"worker": "r", "fetch_id": r.begin_fetch("policy", v).fetch_id})
    cached = len(hub._replies)
    assert r.latest("policy") == v and r.locate("policy")["version"] == v
    assert r.wait_version("policy", timeout=0) == v and r.kv_get("k", timeout=0) == b"v"
    assert t.retract_status("policy", v) == "live" and r.status()["models"]
    assert r.call("ping", {}) == {"pong": True}
    with pytest.raises(UnknownFetchError):
        r.group_status("policy", "nope")
    assert len(hub._replies) == cached


def test_a_hub_restarted_at_once_binds_the_same_address() -> None:
    url = f"memory://rebind-{next(_names)}"
    peer = make_socket(zmq.DEALER, max_message_size=1 << 20)
    try:
        for _ in range(100):  # zmq frees a closed socket's address later unless unbound
            hub = wf.serve(url)
            peer.connect(endpoint(url, bind=False))  # a connected peer delays it more
            hub.stop()
    finally:
        peer.close(0)


def test_a_worker_that_unregistered_is_not_registered_again_by_its_heartbeats():
    with wf.serve("tcp://127.0.0.1:0", lease_s=0.6) as hub:
        worker = wf.join(hub.url, worker="engine-rank0")
        try:
            worker.hub.unregister()  # e.g. a vLLM engine re-initialised for another model
            time.sleep(1.0)  # several heartbeat intervals (lease / 3)
            with wf.join(hub.url, worker="engine-rank0") as again:  # the id is free
                assert again.name == "engine-rank0"
        finally:
            worker.close()


def test_a_client_of_several_hubs_moves_on_from_a_silent_one_and_from_standbys():
    """Hubs of a service: a silent one and standbys (`NotLeaderError`) are skipped.

    When the lead moves, the worker registers again with what it holds.
    """
    with socket.socket() as s, wf.serve("tcp://127.0.0.1:0") as a, \
            wf.serve("tcp://127.0.0.1:0") as b:
        s.bind(("127.0.0.1", 0))
        silent = f"tcp://127.0.0.1:{s.getsockname()[1]}"   # bound, never listening
        a._leading = False            # a standby (as a hub of a service before it wins)
        start = time.monotonic()
        with wf.connect(f"{silent},{a.url},{b.url}", worker="w", timeout=6) as c:
            assert c.url == b.url
            assert time.monotonic() - start < 6
            v = c.begin_publish("m", small_manifest(2))
            c.commit("m", v)
            # The lead moves to a: the records go with it, not who holds what.
            a.state, a._leading = HubState(durable=b.state.durable()), True
            b._leading = False
            a.epoch = "new-term"
            assert c.latest("m") == v      # asked at a once b refused; needs the restore
            assert c.url == a.url
            assert [r["worker"] for r in c.status()["workers"]] == ["w"]
        with pytest.raises(wf.NotLeaderError, match="standby"), \
                wf.connect(b.url, timeout=2):
            pass


def test_a_client_takes_a_slow_hubs_answer_to_an_earlier_try() -> None:
    """A hub behind its requests answers a try later than the try waits: it is taken.

    The client resends on the same connection (waiting twice as long each time) and takes
    the answer to any of its tries. Here the hub answers only the first try, once the
    second has come: a client that dropped its connection at each try never got it.
    """
    import msgpack

    from weightfabric.fabric.auth import load_credential, reply_mac
    from weightfabric.fabric.protocol import REPLY, decode, encode

    key = load_credential().key
    router = make_socket(zmq.ROUTER, max_message_size=1 << 20)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tries: list[list[bytes]] = []

    def answer(frames: list[bytes], body: dict[str, Any]) -> None:
        ident, payload, auth = frames
        reply = encode(REPLY, decode(payload).req_id, "epoch-1", "", body)
        router.send_multipart([ident, reply, reply_mac(key, msgpack.unpackb(auth)[2], reply)])

    def hub() -> None:
        while len(tries) < 2 and router.poll(15_000):
            frames = router.recv_multipart()
            if decode(frames[1]).name == "ping":       # `connect` asks first
                answer(frames, {})
            else:
                tries.append(frames)
        if len(tries) == 2:
            answer(tries[0], {"version": None})

    answering = threading.Thread(target=hub, daemon=True)
    answering.start()
    try:
        with wf.connect(f"tcp://127.0.0.1:{port}", timeout=8) as c:
            start = time.monotonic()
            assert c.latest("m") is None
            took = time.monotonic() - start
        answering.join(5)
        assert len(tries) == 2 and tries[0][0] == tries[1][0], "a new connection per try"
        assert 2.0 <= took < 3.0, took
    finally:
        router.close(0)


def test_a_workers_requests_renew_its_lease_as_heartbeats_do(hub, clock, clients) -> None:
    # A reader busy fetching sends no heartbeat of its own (`heartbeat_due`): its plans,
    # reports and completion keep it alive; a worker that sends nothing still expires.
    t, r = clients("trainer"), clients("r")
    clients("idle")
    v = publish(t)
    plan = r.begin_fetch("policy", v)
    clock.advance(6)
    t.heartbeat()
    r.report_progress(plan.fetch_id, [0])
    clock.advance(6)                        # 12 s since r's begin_fetch and idle's last call
    t.heartbeat()                           # the hub expires leases: idle's, not r's
    assert {w["worker"] for w in t.status()["workers"]} == {"trainer", "r"}
    clock.advance(6)
    t.heartbeat()
    assert r.complete_fetch(plan.fetch_id).complete
    clock.advance(6)
    t.heartbeat()
    assert {w["worker"] for w in t.status()["workers"]} == {"trainer", "r"}


def test_the_client_counts_only_answered_renewing_requests_as_heartbeats(hub, clients) -> None:
    t, r = clients("trainer"), clients("r")
    v = publish(t)
    before = r._renewed
    assert r.latest("policy") == v and r._renewed == before        # a query renews nothing
    with pytest.raises(UnknownModelError):
        r.begin_fetch("nothing", 1)                                 # refused: not counted
    assert r._renewed == before
    plan = r.begin_fetch("policy", v)
    assert r._renewed > before
    noted = r._renewed
    r.report_progress(plan.fetch_id, [0])
    assert r._renewed > noted


@pytest.mark.parametrize(("last_beat", "renewed", "publishing", "due"), [
    (100.0, -1.0, False, 103.0),       # nothing else renewed: every interval
    (100.0, 102.0, False, 105.0),      # a request renewed it since: pushed back
    (100.0, 105.5, False, 106.0),      # busy all along: still every 2 intervals, for news
    (100.0, 102.0, True, 103.0),       # publishing: every interval (beats claim versions)
])
def test_heartbeat_due(last_beat, renewed, publishing, due) -> None:
    from weightfabric.fabric.client import heartbeat_due

    assert heartbeat_due(last_beat, renewed, 3.0, publishing=publishing) == due


@given(st.floats(0, 1, exclude_max=True), st.floats(-50, 50), st.floats(1, 100),
       st.lists(st.floats(0, 20), min_size=1, max_size=6), st.booleans())
def test_a_nodes_heartbeats_fall_on_its_beat_within_half_an_interval_of_due(
        phase, offset, start, renewals, publishing) -> None:
    from weightfabric.fabric.client import heartbeat_due

    interval, last = 3.0, start
    for r in renewals:            # beats one after the other, renewing requests between
        renewed = last + r
        due = heartbeat_due(last, renewed, interval, publishing=publishing)
        beat = heartbeat_due(last, renewed, interval, publishing=publishing, phase=phase,
                             wall_offset=offset)
        assert abs(beat - due) <= interval / 2 + 1e-9 and beat >= last + interval / 2 - 1e-9
        at = ((beat + offset) / interval - phase) % 1.0        # on the node's beat
        assert min(at, 1 - at) < 1e-6
        last = beat


def test_the_workers_of_a_node_share_a_phase_and_nodes_spread() -> None:
    from weightfabric.fabric.client import NODE_BEATS, heartbeat_due, node_phase
    from weightfabric.fabric.locality import Location

    a, b = node_phase(Location("dc0", "n1", "gpu0")), node_phase(Location("dc0", "n1", "gpu7"))
    assert a is not None and a == b and node_phase(Location("dc0", "")) is None
    phases = [node_phase(Location("dc0", f"n{k}")) for k in range(1000)]
    assert {p * NODE_BEATS for p in phases} == set(range(NODE_BEATS))   # on the beats, all
    assert max(phases.count(p) for p in set(phases)) < 3 * 1000 / NODE_BEATS   # spread
    # two workers of a node that started out of step heartbeat together from their 2nd beat
    beats = []
    for last in (100.0, 101.7):
        for _ in range(2):
            last = heartbeat_due(last, -1, 3.0, publishing=False, phase=a)
        beats.append(last)
    apart = abs(beats[0] - beats[1]) % 3.0
    assert min(apart, 3.0 - apart) < 1e-9
