"""Hub records in a real 3-member etcd: read back exactly, guarded writes, bad input."""

from __future__ import annotations

import itertools
import socket
import time

import pytest
from hub_helpers import FakeClock, small_manifest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, rule, run_state_machine_as_test
from test_hub_state_machine import LEASE, HubMachine
from timeouts import hard_timeout

from weightfabric.fabric.errors import NotLeaderError, StoreUnavailableError
from weightfabric.fabric.hub.etcd import Compare, EtcdClient
from weightfabric.fabric.hub.etcd_records import EtcdRecords
from weightfabric.fabric.hub.persist import state_json
from weightfabric.fabric.hub.server import HubServer
from weightfabric.fabric.hub.state import HubState
from weightfabric.tools.etcd_cluster import EtcdCluster

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd():
    with hard_timeout(60), EtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _time_limit():
    with hard_timeout(120):
        yield


def records(cluster: EtcdCluster, prefix: str, guard=None) -> EtcdRecords:
    return EtcdRecords(EtcdClient(cluster.endpoints, timeout=2.0), prefix, guard=guard)


def fresh_prefix() -> str:
    return f"/test-records-{time.monotonic_ns()}-{next(_prefixes)}"


class EtcdHubMachine(HubMachine):
    """The hub's state machine with its records in etcd.

    After every step the hub saves `HubState.durable` (as a leading hub does before it
    replies), and another hub's store reads back exactly that; a restart builds the new
    hub from what that other store read.
    """

    cluster: EtcdCluster

    def _stores(self) -> tuple[EtcdRecords, EtcdRecords]:
        if not hasattr(self, "writer"):
            prefix = fresh_prefix()
            self.writer, self.reader = (records(self.cluster, prefix),
                                        records(self.cluster, prefix))
            self.writer.load()
        return self.writer, self.reader

    @invariant()
    def another_hub_reads_back_exactly_what_was_saved(self) -> None:
        writer, reader = self._stores()
        durable = self.hub.durable()
        writer.save(durable)
        assert state_json(reader.load()) == state_json(durable)

    @rule()
    def restart_hub(self) -> None:
        writer, reader = self._stores()
        writer.save(self.hub.durable())
        loaded = reader.load()
        old = self.hub
        holdings = {w: self._holdings(w, old) for w in old.workers}
        self.before = None
        self.hub = HubState(clock=self.clock, lease_s=LEASE, max_sources=2, durable=loaded)
        for key in self.orphans:
            self.orphans[key] = self.hub.lease_clock()
        for w, rec in old.workers.items():
            self.hub.register(w, session=w, location=rec.location)
            self.hub.restore(w, session=w, holdings=holdings[w])
        self.group_members.clear()

    def teardown(self) -> None:
        for store in (getattr(self, "writer", None), getattr(self, "reader", None)):
            if store is not None:
                store.close()


def test_state_written_by_one_hub_is_read_back_exactly_by_another(etcd) -> None:
    EtcdHubMachine.cluster = etcd
    run_state_machine_as_test(EtcdHubMachine, settings=settings(
        max_examples=15, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_two_hubs_racing_on_one_publish_hand_out_one_number_and_commit_once(etcd) -> None:
    """Hub B led, then lost the lead to A without hearing of it yet; both take a publish.

    Only the leader's records are written: one number, one commit.
    """
    prefix = fresh_prefix()
    client = EtcdClient(etcd.endpoints)
    a_key, b_key = f"{prefix}/leader/a".encode(), f"{prefix}/leader/b".encode()
    client.put(b_key, b"hub-b")
    b_rev = client.get(b_key).create_revision
    b = records(etcd, prefix, guard=lambda: Compare.create_revision(b_key, "==", b_rev))
    b_state = HubState(clock=FakeClock(), lease_s=LEASE, durable=b.load())
    b_state.register("trainer", session="s")
    v1 = b_state.begin_publish("policy", "trainer", small_manifest(2), session="s").version
    b_state.commit("policy", v1, "trainer", session="s")
    b.save(b_state.durable())
    # B loses the lead: its key is gone, A's is the oldest now.
    client.delete(b_key)
    client.put(a_key, b"hub-a")
    a_rev = client.get(a_key).create_revision
    a = records(etcd, prefix, guard=lambda: Compare.create_revision(a_key, "==", a_rev))
    a_state = HubState(clock=FakeClock(), lease_s=LEASE, durable=a.load())
    assert a_state.next_versions["policy"] == v1 + 1
    for state in (a_state, b_state):    # the same publish reaches both
        state.register("trainer2", session="s2")
        v = state.begin_publish("policy", "trainer2", small_manifest(2), session="s2").version
        assert v == v1 + 1
        state.commit("policy", v, "trainer2", session="s2")
    a.save(a_state.durable())
    with pytest.raises(NotLeaderError):
        b.save(b_state.durable())
    back = records(etcd, prefix).load()
    assert back.next_versions["policy"] == v1 + 2
    assert back.versions is not None
    assert sorted(back.versions["policy"]) == [v1, v1 + 1]
    # B's next attempt at a number fails too: numbers are never handed out twice
    v3 = b_state.begin_publish("policy", "trainer2", small_manifest(2), session="s2").version
    with pytest.raises(NotLeaderError):
        b.save(b_state.durable())
    assert records(etcd, prefix).load().next_versions["policy"] == v3
    client.close()


def test_an_etcd_that_does_not_answer_stops_the_hub_from_starting(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]     # bound, never listening: connections are refused
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
            HubServer("tcp://127.0.0.1:0", store=f"etcd://127.0.0.1:{port}",
                      secret_file=tmp_path / "secret")
        assert time.monotonic() - start < 15


def test_a_key_space_written_by_something_else_is_refused(etcd, tmp_path) -> None:
    prefix = fresh_prefix()
    client = EtcdClient(etcd.endpoints)
    client.put(f"{prefix}/config/owner", b"another program")
    with pytest.raises(ValueError, match="keys no weightfabric hub wrote"):
        HubServer("tcp://127.0.0.1:0", store=f"{etcd.url}{prefix}",
                  secret_file=tmp_path / "secret")
    client.put(f"{prefix}2/format", b"something-else/7")
    with pytest.raises(ValueError, match="format"):
        HubServer("tcp://127.0.0.1:0", store=f"{etcd.url}{prefix}2",
                  secret_file=tmp_path / "secret")
    with pytest.raises(ValueError):
        HubServer("tcp://127.0.0.1:0", store="etcd://", secret_file=tmp_path / "secret")
    with pytest.raises(ValueError, match="not both"):
        HubServer("tcp://127.0.0.1:0", store=f"{etcd.url}{prefix}3", state_dir=tmp_path,
                  secret_file=tmp_path / "secret")
    client.close()


def test_rendezvous_keys_survive_with_their_owner_and_ttl(etcd, tmp_path) -> None:
    """A failover keeps the kv store: values, owners (who may overwrite) and deadlines."""
    from weightfabric.fabric.hub.record_store import DirRecords

    clock = FakeClock()
    hub = HubState(clock=clock, lease_s=LEASE)
    hub.kv_put("job/uid", b"\x00uid", ttl=None)
    hub.kv.claim("job/uid", "trainer")
    hub.kv_put("job/addr", b"10.0.0.1:9", ttl=300)
    hub.kv_put("job/gone", b"x", ttl=0.001)
    time.sleep(0.01)                      # its wall-clock deadline passes
    for store in (records(etcd, fresh_prefix()), DirRecords(tmp_path)):
        store.load()
        store.save(hub.durable())
        back = HubState(clock=FakeClock(), lease_s=LEASE, durable=store.load())
        assert back.kv_get("job/uid") == b"\x00uid"
        assert back.kv.owner("job/uid") == "trainer"
        assert back.kv_get("job/addr") == b"10.0.0.1:9"
        assert back.kv.owner("job/addr") is None
        assert back.kv_get("job/gone") is None
        wall = back.kv.records()["job/addr"][1]
        assert wall is not None and 290 < wall - time.time() <= 300
        store.close()
