"""Orphaned publishing versions, and what a state dir keeps across a hub restart."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hub_helpers import OffsetClock, small_manifest
from hypothesis import given
from hypothesis import strategies as st

import weightfabric as wf
from weightfabric.fabric.errors import GroupAbortedError, UnknownFetchError
from weightfabric.fabric.hub.persist import STATE_FILE, load_state, save_state
from weightfabric.fabric.hub.records import VersionRanges
from weightfabric.fabric.hub_messages import Holding, HoldingState, ManifestWire, RestoreReply

LEASE = 10.0


def versions(client: wf.HubClient, model: str = "policy") -> dict[int, dict]:
    return {v["version"]: v for v in client.status()["models"][model]["versions"]}


def test_publish_whose_reply_was_lost_is_retired_after_a_lease() -> None:
    clock = OffsetClock()
    hub = wf.serve("memory://orphan", lease_s=LEASE, clock=clock)
    try:
        with wf.connect(hub.url, worker="trainer", heartbeat=False, timeout=5) as t:
            known = t.begin_publish("policy", small_manifest())
            # The hub runs this begin_publish, but the client never learns the number
            # (as when a reply is lost around a hub restart): nobody will ever commit it.
            lost = t.call("begin_publish", {"worker": "trainer", "model": "policy",
                                            "manifest": small_manifest().to_wire()})["version"]
            for _ in range(3):                  # the worker stays alive all along
                clock.advance(LEASE / 2)
                news = t.heartbeat()
            states = versions(t)
            assert states[known]["state"] == "publishing"        # claimed by heartbeats
            assert states[lost]["state"] == "retired"
            assert "orphaned" in states[lost]["reason"]
            assert ("policy", lost) in news.retired          # the holder may retract it
            assert t.commit("policy", known) == "committed"
            with pytest.raises(GroupAbortedError, match="orphaned"):
                t.commit("policy", lost)
    finally:
        hub.stop()


def test_old_style_heartbeat_still_claims_every_version_it_publishes() -> None:
    state = wf.HubState(lease_s=LEASE, clock=(clock := OffsetClock()))
    state.register("w", session="s")
    v = state.begin_publish("m", "w", small_manifest(), session="s").version
    for _ in range(3):
        clock.advance(LEASE / 2)
        state.heartbeat("w", session="s")                     # no `publishing` list
    assert state.models["m"].versions[v].state == "publishing"


def test_version_retired_before_a_restart_stays_retired(tmp_path: Path) -> None:
    clock = OffsetClock()
    url = "memory://restart-retired"
    hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
    try:
        t = wf.connect(url, worker="trainer", heartbeat=False, timeout=5)
        obs = wf.connect(url, timeout=5)
        v1 = t.begin_publish("policy", small_manifest())
        t.commit("policy", v1)
        v2 = t.begin_publish("policy", small_manifest())     # never committed in time...
        clock.advance(LEASE + 1)                              # ...the trainer paused too long
        assert v2 not in versions(obs)                        # retired, nobody holds it
        assert obs.status()["models"]["policy"]["retired"][0]["version"] == v2
        saved = json.loads((tmp_path / STATE_FILE).read_text())
        assert str(v2) in saved["retired"]["policy"] and str(v2) not in saved["versions"]["policy"]
        hub.stop()
        hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
        # The trainer comes back and re-registers v1 and v2 (it still believes v2 is
        # publishing): v1 is served again, v2 stays retired and cannot be committed.
        with pytest.raises(GroupAbortedError, match="publisher trainer lost"):
            t.commit("policy", v2)
        got = versions(obs)
        assert got[v1]["state"] == "committed" and obs.latest("policy") == v1
        assert got[v2]["state"] == "retired" and "lost" in got[v2]["reason"]
        assert ("policy", v2) in t.heartbeat().retired
        assert t.retract("policy", v2, wait=1) == "done"
        assert {"version": v2, "reason": got[v2]["reason"]} in \
            obs.status()["models"]["policy"]["retired"]
        assert t.begin_publish("policy", small_manifest()) == v2 + 1
        t.close()
        obs.close()
    finally:
        hub.stop()


def test_unclaimed_publishing_version_is_retired_after_restart(tmp_path: Path) -> None:
    clock = OffsetClock()
    hub = wf.serve("memory://restart-orphan", state_dir=tmp_path, lease_s=LEASE, clock=clock)
    try:
        with wf.connect(hub.url, worker="trainer", heartbeat=False, timeout=5) as t:
            v = t.begin_publish("policy", small_manifest())
        hub.stop()                               # the trainer never comes back
        hub = wf.serve("memory://restart-orphan", state_dir=tmp_path, lease_s=LEASE,
                           clock=clock)
        with wf.connect(hub.url, timeout=5) as obs:
            assert versions(obs)[v]["state"] == "publishing"
            clock.advance(LEASE + 1)
            assert v not in versions(obs)
            retired = obs.status()["models"]["policy"]["retired"]
            assert retired[0]["version"] == v and "orphaned" in retired[0]["reason"]
    finally:
        hub.stop()


def test_unregister_drops_replicas_and_publishes_now() -> None:
    hub = wf.serve("memory://unregister", lease_s=LEASE)
    try:
        with wf.connect(hub.url, worker="trainer", heartbeat=False, timeout=5) as t, \
                wf.connect(hub.url, timeout=5) as obs:
            v1 = t.begin_publish("policy", small_manifest())
            t.commit("policy", v1)
            v2 = t.begin_publish("policy", small_manifest())
            assert obs.latest("policy") == v1
            t.unregister()
            assert obs.latest("policy") is None
            assert obs.status()["workers"] == []
            got = {v["version"]: v for v in obs.status()["models"]["policy"]["versions"]}
            assert got[v1]["full"] == 0
            assert v2 not in got and any(
                r["version"] == v2 and "unregistered" in r["reason"]
                for r in obs.status()["models"]["policy"]["retired"])
            # The id is free again right away (no lease to wait out).
            with wf.connect(hub.url, worker="trainer", heartbeat=False, timeout=5):
                pass
    finally:
        hub.stop()


@pytest.mark.parametrize("last_to_restore", ["p0", "p1"])
def test_shard_commit_before_a_restart_still_counts(tmp_path: Path, last_to_restore: str
                                                    ) -> None:
    clock = OffsetClock()
    url = f"memory://restart-shard-commit-{last_to_restore}"
    hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
    try:
        p0 = wf.connect(url, worker="p0", heartbeat=False, timeout=5)
        p1 = wf.connect(url, worker="p1", heartbeat=False, timeout=5)
        v = p0.begin_publish("policy", small_manifest(tag="s0"), shard=0, num_shards=2, group="g")
        p1.begin_publish("policy", small_manifest(tag="s1"), shard=1, num_shards=2, group="g")
        assert p0.commit("policy", v) == "publishing"          # waits for shard 1
        hub.stop()
        hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
        first, last = (p1, p0) if last_to_restore == "p0" else (p0, p1)
        first.heartbeat()                                      # re-registers and restores
        last.heartbeat()
        assert p1.commit("policy", v) == "committed"
        assert p0.latest("policy") == v
        p0.close()
        p1.close()
    finally:
        hub.stop()


def test_fetch_group_is_not_resumed_after_a_restart(tmp_path: Path) -> None:
    clock = OffsetClock()
    url = "memory://restart-fetch-group"
    hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
    try:
        p = wf.connect(url, worker="pub", heartbeat=False, timeout=5)
        r0 = wf.connect(url, worker="r0", heartbeat=False, timeout=5)
        r1 = wf.connect(url, worker="r1", heartbeat=False, timeout=5)
        v = p.begin_publish("policy", small_manifest(tag="a"), shard=0, num_shards=2, group="p")
        p.begin_publish("policy", small_manifest(tag="b"), shard=1, num_shards=2, group="p")
        assert p.commit("policy", v) == "committed"
        f0 = r0.begin_fetch("policy", v, shard=0, group="g", group_size=2)
        r1.begin_fetch("policy", v, shard=1, group="g", group_size=2)
        hub.stop()
        hub = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
        p.heartbeat()
        r1.heartbeat()
        with pytest.raises(UnknownFetchError):      # re-registers, restores, retries once
            r0.complete_fetch(f0.fetch_id)          # its group's fetch was not resumed
        full = {x["version"]: x["full"] for x in p.status()["models"]["policy"]["versions"]}
        assert full[v] == 2                         # only the publisher's two shards
        n0 = r0.begin_fetch("policy", v, shard=0, group="g2", group_size=2)
        n1 = r1.begin_fetch("policy", v, shard=1, group="g2", group_size=2)
        assert r0.complete_fetch(n0.fetch_id).group == "open"
        assert r1.complete_fetch(n1.fetch_id).group == "committed"
        for c in (p, r0, r1):
            c.close()
    finally:
        hub.stop()


def _holding(version: int, state: HoldingState, **extra: bool) -> Holding:
    return Holding(model="policy", version=version, shard=0, num_shards=1,
                   manifest=ManifestWire.of(small_manifest()), state=state, **extra)


def test_version_restored_then_retired_is_not_revived_without_a_state_dir() -> None:
    # A hub restarted without a state dir hears of v5 from its publisher, which then
    # pauses past its lease (v5 is retired as orphaned); when it comes back and restores
    # v5 again, v5 must stay retired.
    clock = OffsetClock()
    state = wf.HubState(lease_s=LEASE, clock=clock)
    state.register("a", session="s1")
    v5 = _holding(5, "publishing", publisher=True)
    assert state.restore("a", session="s1", holdings=[v5]) == RestoreReply(restored=1,
                                                                          rejected=[])
    clock.advance(LEASE + 1)
    state.expire()
    assert state.models["policy"].versions.get(5) is None     # retired and forgotten
    state.register("a", session="s2")
    state.restore("a", session="s2", holdings=[v5])
    assert state.models["policy"].versions[5].state == "retired"
    assert ("policy", 5) in state.heartbeat("a", session="s2").retired
    # a number the hub never saw is still restored as the holder says: v3, held by a
    # worker slower to come back, is not mistaken for a retired version
    state.restore("a", session="s2", holdings=[_holding(3, "committed", complete=True)])
    assert state.models["policy"].versions[3].state == "committed"


def test_seen_ranges_survive_a_restart_and_old_state_files_still_load(tmp_path: Path) -> None:
    state = wf.HubState(lease_s=LEASE)
    state.register("a", session="s")
    state.restore("a", session="s", holdings=[_holding(n, "committed", complete=True)
                                              for n in (3, 4, 9)])
    save_state(tmp_path, state.durable())
    assert json.loads((tmp_path / STATE_FILE).read_text())["seen"] == {"policy": [[3, 5], [9, 10]]}
    back = wf.HubState(lease_s=LEASE, durable=load_state(tmp_path))
    assert [n in back.seen["policy"] for n in (2, 3, 4, 5, 9, 10)] == \
        [False, True, True, False, True, False]
    (tmp_path / STATE_FILE).write_text(json.dumps(
        {"next_versions": {"policy": 7}, "versions": {}, "known_below": {"policy": 7}}))
    old = wf.HubState(lease_s=LEASE, durable=load_state(tmp_path))
    assert old.seen["policy"].to_wire() == [[1, 7]]


@given(st.lists(st.integers(0, 40), max_size=60), st.lists(st.tuples(st.integers(0, 40),
                                                                      st.integers(0, 40))))
def test_version_ranges_hold_exactly_the_numbers_added(numbers: list[int],
                                                       ranges: list[tuple[int, int]]) -> None:
    got = VersionRanges(ranges)
    want = {n for lo, hi in ranges for n in range(lo, hi)}
    for n in numbers:
        got.add(n)
        want.add(n)
    assert [n for n in range(-1, 42) if n in got] == sorted(want)
    wire = got.to_wire()
    assert all(lo < hi for lo, hi in wire)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(wire))   # disjoint, apart


def test_a_holder_restoring_another_manifest_than_the_recorded_one_is_refused(tmp_path) -> None:
    """The records keep each shard's manifest fingerprint.

    After a restart (or a failover) a holder cannot announce other bytes under a version
    the hub knows.
    """
    from hub_helpers import FakeClock

    from weightfabric.fabric.hub.record_store import DirRecords
    from weightfabric.fabric.hub.state import HubState

    store = DirRecords(tmp_path)
    hub = HubState(clock=FakeClock(), lease_s=LEASE, durable=store.load())
    hub.register("trainer", session="t")
    good = small_manifest(4)
    v = hub.begin_publish("policy", "trainer", good, session="t").version
    hub.commit("policy", v, "trainer", session="t")
    store.save(hub.durable())
    assert json.loads((tmp_path / STATE_FILE).read_text())["versions"]["policy"][str(v)][2] == {
        "0": good.fingerprint}

    back = HubState(clock=FakeClock(), lease_s=LEASE, durable=store.load())
    bad = small_manifest(4, tag="evil")
    for who, manifest in (("mallory", bad), ("trainer", good)):
        back.register(who, session=who)
        reply = back.restore(who, session=who, holdings=[Holding(
            model="policy", version=v, shard=0, manifest=ManifestWire.of(manifest),
            state="committed", complete=True)])
        assert [r[0:3] for r in reply.rejected] == ([("policy", v, 0)] if who == "mallory"
                                                   else [])
    assert back.latest("policy") == v
    assert back.locate("policy", v, worker="reader").shards[0].holders == ["trainer"]
