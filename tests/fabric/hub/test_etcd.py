"""The etcd client, the election and the loopback etcd cluster, against real etcd processes.

One 3-member cluster for the module (`tools.etcd_cluster`); tests that take members
down bring them back before they end. Every test has a hard time limit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from paths import child_env
from timeouts import hard_timeout

from weightfabric.fabric.hub.election import Election, leader_of
from weightfabric.fabric.hub.etcd import (
    DEFAULT_PREFIX,
    Compare,
    EtcdClient,
    EtcdError,
    EtcdUnavailableError,
    Op,
    parse_url,
    prefix_range_end,
)
from weightfabric.tools.etcd_cluster import EtcdCluster, etcd_binary

LIMIT_S = 30
TTL = 2.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    c = EtcdCluster(3, fsync=False)
    try:
        with hard_timeout(60):
            c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster: EtcdCluster) -> Iterator[EtcdClient]:
    with hard_timeout(LIMIT_S), EtcdClient(cluster.endpoints, timeout=2.0) as c:
        yield c
        with_all_members(cluster)


@pytest.fixture
def prefix() -> str:
    return f"/test/{uuid.uuid4().hex[:8]}"


def with_all_members(cluster: EtcdCluster) -> None:
    """Bring back every member a test took down, and wait until each serves."""
    for i in range(cluster.n):
        if not cluster.alive(i):
            cluster.restart(i)
    for i in range(cluster.n):
        cluster.wait_serving(i, timeout=15)


def leader_index(cluster: EtcdCluster, client: EtcdClient) -> int:
    statuses = [client.status(e) for e in cluster.endpoints]
    ids = {s["member_id"]: i for i, s in enumerate(statuses)}
    leaders = {s["leader"] for s in statuses if s["healthy"]}
    assert len(leaders) == 1, statuses
    return ids[leaders.pop()]


def eventually(check, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except EtcdError:
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(step)


# --- the client ------------------------------------------------------------------------------


def test_put_get_prefix_delete(client: EtcdClient, prefix: str) -> None:
    rev = client.put(f"{prefix}/b", b"2")
    assert rev > 0
    assert client.put(f"{prefix}/a", "1") > rev
    client.put(f"{prefix}x", b"outside the prefix/")
    kv = client.get(f"{prefix}/a")
    assert kv is not None and kv.value == b"1" and kv.key == f"{prefix}/a".encode()
    assert kv.version == 1 and kv.create_revision == kv.mod_revision > rev and kv.lease == 0
    assert client.get(f"{prefix}/missing") is None
    client.put(f"{prefix}/a", b"\x00\xff binary")
    again = client.get(f"{prefix}/a".encode())
    assert again is not None and again.value == b"\x00\xff binary" and again.version == 2
    assert again.create_revision == kv.create_revision < again.mod_revision
    assert [k.key for k in client.get_prefix(f"{prefix}/")] == [
        f"{prefix}/a".encode(), f"{prefix}/b".encode()]
    assert client.put(f"{prefix}/c", b"") > 0
    empty = client.get(f"{prefix}/c")
    assert empty is not None and empty.value == b""
    assert client.delete(f"{prefix}/b") == 1
    assert client.delete(f"{prefix}/b") == 0
    assert client.delete(f"{prefix}/", prefix=True) == 2
    assert client.get_prefix(f"{prefix}/") == []
    assert client.delete(prefix, prefix=True) == 1       # the key outside "/"
    assert prefix_range_end(b"a\xff") == b"b" and prefix_range_end(b"\xff") == b"\0"


def test_txn_success_and_failure(client: EtcdClient, prefix: str) -> None:
    k = f"{prefix}/k"
    created = client.txn([Compare.version(k, "==", 0)], [Op.put(k, b"v1"), Op.get(k)],
                         [Op.get(k)])
    assert created.succeeded and created.revision > 0
    assert created.responses[0] is None
    got = created.responses[1]
    assert isinstance(got, list) and got[0].value == b"v1"
    kv = got[0]
    again = client.txn([Compare.version(k, "==", 0)], [Op.put(k, b"never")], [Op.get(k)])
    assert not again.succeeded
    assert isinstance(again.responses[0], list) and again.responses[0][0].value == b"v1"
    # every compare kind, both branches
    ok = client.txn([Compare.create_revision(k, "==", kv.create_revision),
                     Compare.mod_revision(k, "<", kv.mod_revision + 1),
                     Compare.value(k, "==", b"v1"), Compare.version(k, ">", 0)],
                    [Op.put(f"{prefix}/p1", b"x"), Op.put(f"{prefix}/p2", b"y"),
                     Op.delete(k)])
    assert ok.succeeded and ok.responses == [None, None, 1]
    assert client.get(k) is None
    bad = client.txn([Compare.value(f"{prefix}/p1", "!=", b"x")], [Op.delete(f"{prefix}/p1")],
                     [Op.get(f"{prefix}/p", prefix=True), Op.delete(f"{prefix}/p", prefix=True)])
    assert not bad.succeeded
    listed = bad.responses[0]
    assert isinstance(listed, list) and [x.key for x in listed] == [
        f"{prefix}/p1".encode(), f"{prefix}/p2".encode()]
    assert bad.responses[1] == 2
    with pytest.raises(ValueError):
        Compare.version(k, "<=", 1)  # type: ignore[arg-type]
    with pytest.raises(EtcdError, match="duplicate key"):    # etcd's own message
        client.txn([], [Op.put(k, b"1"), Op.put(k, b"2")])


def test_lease_grant_keepalive_expiry_revoke(client: EtcdClient, prefix: str) -> None:
    lease = client.lease_grant(0.2)                # rounded up to 1 s
    assert lease > 0
    client.put(f"{prefix}/short", b"x", lease=lease)
    kv = client.get(f"{prefix}/short")
    assert kv is not None and kv.lease == lease
    assert client.lease_keepalive(lease) == 1.0
    start = time.monotonic()
    eventually(lambda: client.get(f"{prefix}/short") is None, timeout=4)
    assert 0.5 < time.monotonic() - start < 4
    assert client.lease_keepalive(lease) == 0       # expired: gone
    long = client.lease_grant(30)
    client.put(f"{prefix}/long", b"y", lease=long)
    assert 29 <= client.lease_keepalive(long) <= 30
    client.lease_revoke(long)
    assert client.get(f"{prefix}/long") is None
    assert client.lease_keepalive(long) == 0
    client.lease_revoke(long)                      # an unknown lease: no error
    with pytest.raises(EtcdError, match="lease not found") as err:
        client.put(f"{prefix}/orphan", b"z", lease=long)
    assert not isinstance(err.value, EtcdUnavailableError) and err.value.code == 5


def test_members_and_status(cluster: EtcdCluster, client: EtcdClient) -> None:
    members = client.members()
    assert sorted(m.name for m in members) == ["m0", "m1", "m2"]
    assert sorted(u for m in members for u in m.client_urls) == sorted(cluster.endpoints)
    assert all(m.id > 0 and len(m.peer_urls) == 1 for m in members)
    statuses = [client.status(e) for e in cluster.endpoints]
    ids = {m.id for m in members}
    for s, endpoint in zip(statuses, cluster.endpoints, strict=True):
        assert s["healthy"] and s["error"] is None and s["endpoint"] == endpoint
        assert s["member_id"] in ids and s["leader"] in ids
        assert s["raft_term"] >= 1 and s["db_size"] > 0
    assert len({s["leader"] for s in statuses}) == 1
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = client.status(f"127.0.0.1:{closed.getsockname()[1]}")
    assert not dead["healthy"] and "refused" in dead["error"] and dead["leader"] == 0


def test_from_url_and_endpoints() -> None:
    client, prefix = EtcdClient.from_url("etcd://h1:1234,h2:5678/some/prefix/")
    assert client.endpoints == ["http://h1:1234", "http://h2:5678"] and prefix == "/some/prefix"
    client2, prefix2 = EtcdClient.from_url("etcd://h1", timeout=0.5)
    assert client2.endpoints == ["http://h1:2379"] and prefix2 == DEFAULT_PREFIX == "/weightfabric"
    assert client2.timeout == 0.5
    assert parse_url("etcd://[::1]:2379/") == (["http://[::1]:2379"], DEFAULT_PREFIX)
    assert parse_url("ETCD://a:1,a:1/x")[1] == "/x"
    assert EtcdClient(["a:1", "http://a:1", "b:2"]).endpoints == ["http://a:1", "http://b:2"]
    assert EtcdClient("http://a:1,b").endpoints == ["http://a:1", "http://b:2379"]
    for bad in ["http://h:1/x", "h:1", "etcd://", "etcd:///prefix", "etcd://h:notaport",
                "etcd://h:1,,h:2", "etcd://h:99999", "etcd://user@h:1", "etcd://h:1/a?x=1",
                "etcd://h:1/a//b", ""]:
        with pytest.raises(ValueError):
            EtcdClient.from_url(bad)
    for bad_ep in ["", "ftp://h:1", "http://h:1/path", "http://:1"]:
        with pytest.raises(ValueError):
            EtcdClient([bad_ep])
    with pytest.raises(ValueError):
        EtcdClient([])
    with pytest.raises(ValueError):
        EtcdClient("a:1", timeout=0)


def test_endpoints_that_do_not_answer(cluster: EtcdCluster) -> None:
    with hard_timeout(LIMIT_S), socket.socket() as refused, socket.socket() as silent:
        refused.bind(("127.0.0.1", 0))          # bound, not listening: connection refused
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)                        # accepts (backlog), never answers
        refused_ep = f"127.0.0.1:{refused.getsockname()[1]}"
        silent_ep = f"127.0.0.1:{silent.getsockname()[1]}"
        for endpoints in ([refused_ep], [silent_ep], [refused_ep, silent_ep]):
            with EtcdClient(endpoints, timeout=0.5) as c:
                for call in (lambda: c.get("k"), lambda: c.put("k", "v"),
                             lambda: c.lease_grant(5), c.members):
                    start = time.monotonic()
                    with pytest.raises(EtcdUnavailableError) as err:
                        call()
                    assert time.monotonic() - start < 0.9
                    assert str(err.value).count("127.0.0.1") >= 1
        # a read moves on from a silent member to one that answers, in the same call
        with EtcdClient([silent_ep, *cluster.endpoints], timeout=1.5) as c:
            start = time.monotonic()
            assert c.get("/nothing/here") is None
            assert time.monotonic() - start < 1.5
        # a write sent to a silent member is never sent again: its outcome is unknown...
        with EtcdClient([silent_ep, *cluster.endpoints], timeout=0.5) as c:
            with pytest.raises(EtcdUnavailableError, match="may or may not"):
                c.put("/test/unknown-outcome", b"x")
            assert c.put("/test/unknown-outcome", b"x") > 0   # ...the next call moves on
            c.delete("/test/unknown-outcome")
        with EtcdClient([refused_ep, *cluster.endpoints], timeout=0.5) as c:
            assert c.put("/test/refused-first", b"x") > 0    # refused: surely not sent
            c.delete("/test/refused-first")
            c.close()
            with pytest.raises(EtcdError, match="closed"):
                c.get("k")


def test_threads_share_a_client(client: EtcdClient, prefix: str) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                client.put(f"{prefix}/{t}/{i}", str(i))
                kv = client.get(f"{prefix}/{t}/{i}")
                assert kv is not None and kv.value == str(i).encode()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    assert len(client.get_prefix(prefix + "/")) == 120
    client.delete(prefix + "/", prefix=True)


def test_kill_one_member_calls_go_on(cluster: EtcdCluster, client: EtcdClient,
                                     prefix: str) -> None:
    client.put(f"{prefix}/before", b"1")
    victim = leader_index(cluster, client)
    # a client that talked to the victim last goes on through the others
    with EtcdClient([cluster.endpoints[victim], *cluster.endpoints], timeout=2.0) as c:
        c.get(f"{prefix}/before")
        cluster.kill(victim)
        start = time.monotonic()
        # the first writes may meet etcd's leader election: they fail, saying so
        eventually(lambda: c.put(f"{prefix}/after", b"2"), timeout=5)
        for i in range(5):
            assert c.put(f"{prefix}/after", str(i)) > 0
            kv = c.get(f"{prefix}/after")
            assert kv is not None and kv.value == str(i).encode()
        assert c.txn([Compare.version(f"{prefix}/before", ">", 0)],
                     [Op.delete(f"{prefix}/before")]).succeeded
        assert time.monotonic() - start < 8
        down = c.status(cluster.endpoints[victim])
        assert not down["healthy"] and down["error"]
        assert len(c.members()) == 3


def test_quorum_loss_and_back(cluster: EtcdCluster, client: EtcdClient, prefix: str) -> None:
    client.put(f"{prefix}/k", b"0")
    cluster.stop_member(1)
    cluster.stop_member(2)
    with EtcdClient(cluster.endpoints, timeout=1.0) as c:
        for _ in range(3):
            for call in (lambda: c.put(f"{prefix}/k", b"1"), lambda: c.get(f"{prefix}/k"),
                         lambda: c.txn([], [Op.put(f"{prefix}/k", b"2")])):
                start = time.monotonic()
                with pytest.raises(EtcdUnavailableError):
                    call()
                assert time.monotonic() - start < 1.5
        alone = c.status(cluster.endpoints[0])
        assert not alone["healthy"] and alone["error"]
        cluster.restart(1)
        start = time.monotonic()
        eventually(lambda: c.put(f"{prefix}/k", b"3"), timeout=10)
        assert time.monotonic() - start < 10
        cluster.restart(2)
        cluster.wait_serving(2, timeout=10)
        kv = c.get(f"{prefix}/k")
        assert kv is not None and kv.value == b"3"


# --- the election ----------------------------------------------------------------------------


def test_election_one_leads_other_waits(client: EtcdClient, prefix: str) -> None:
    assert leader_of(client, prefix) is None
    a = Election(client, prefix, b"hub-a", ttl=TTL)
    b = Election(client, prefix, b"hub-b", ttl=TTL)
    try:
        assert a.campaign(timeout=5)
        assert a.is_leader
        start = time.monotonic()
        assert not b.campaign(timeout=0.4)
        assert 0.35 < time.monotonic() - start < 1.5
        assert not b.is_leader
        stop = threading.Event()
        stop.set()
        assert not b.campaign(stop=stop)
        assert a.leader() == b.leader() == Election.leader_of(client, prefix)
        value, rev = leader_of(client, prefix) or (b"", 0)
        assert value == b"hub-a" and rev == a.revision
        keys = client.get_prefix(prefix + "/")
        assert {k.key for k in keys} == {a.key, b.key}
        assert a.key == f"{prefix}/{a.lease:x}".encode()
        time.sleep(TTL * 1.2)           # the keep-alive holds both leases past their TTL
        assert a.is_leader and not b.is_leader and len(client.get_prefix(prefix + "/")) == 2
        assert a.campaign(timeout=0)     # already leading
    finally:
        a.resign()
        b.resign()
    assert not a.is_leader and client.get_prefix(prefix + "/") == []


def test_resign_hands_over(client: EtcdClient, prefix: str) -> None:
    a = Election(client, prefix, b"a", ttl=TTL)
    b = Election(client, prefix, b"b", ttl=TTL)
    try:
        assert a.campaign(timeout=5)
        assert not b.campaign(timeout=0.1)
        won = threading.Event()
        waiter = threading.Thread(target=lambda: b.campaign(timeout=10) and won.set())
        waiter.start()
        time.sleep(0.2)
        a.resign()
        start = time.monotonic()
        assert won.wait(TTL + 1)
        assert time.monotonic() - start < 1.0       # no lease to wait out
        waiter.join(5)
        assert b.is_leader and not a.is_leader
        assert b.leader() == (b"b", b.revision)
        # a campaigns again: a new key, behind b
        assert not a.campaign(timeout=0.2)
        assert a.revision > b.revision
    finally:
        a.resign()
        b.resign()


def test_guard_fails_once_leadership_moved(client: EtcdClient, prefix: str) -> None:
    lost: list[str] = []
    a = Election(client, prefix, b"a", ttl=TTL, on_lost=lambda: lost.append("a"))
    b = Election(client, prefix, b"b", ttl=TTL)
    record = f"{prefix}-records/r"
    try:
        with pytest.raises(RuntimeError):
            a.guard()
        assert a.campaign(timeout=5)
        assert client.txn([a.guard()], [Op.put(record, b"from a")]).succeeded
        # etcd drops a's lease (as when it expires): a learns it at its next keep-alive
        client.lease_revoke(a.lease)
        eventually(lambda: not a.is_leader, timeout=TTL)
        eventually(lambda: lost, timeout=TTL)
        assert b.campaign(timeout=5)
        stale = client.txn([a.guard()], [Op.put(record, b"late a")], [Op.get(record)])
        assert not stale.succeeded
        assert client.txn([b.guard()], [Op.put(record, b"from b")]).succeeded
        kv = client.get(record)
        assert kv is not None and kv.value == b"from b"
        time.sleep(0.2)
        assert lost == ["a"]                          # once
        a.resign()                                    # its key and lease are gone: no error
        assert not a.campaign(timeout=0.1)            # a fresh lease and key, behind b
        assert a.revision > b.revision
    finally:
        a.resign()
        b.resign()
        client.delete(f"{prefix}-records/", prefix=True)


CANDIDATE = """
import sys, time
from weightfabric.fabric.hub.etcd import EtcdClient
from weightfabric.fabric.hub.election import Election
e = Election(EtcdClient(sys.argv[1].split(",")), sys.argv[2], b"child", ttl=float(sys.argv[3]))
assert e.campaign(timeout=20)
print("leader", e.revision, flush=True)
time.sleep(60)
"""


def test_dead_leader_process_is_replaced(cluster: EtcdCluster, client: EtcdClient,
                                         prefix: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CANDIDATE, ",".join(cluster.endpoints), prefix, str(TTL)],
        stdout=subprocess.PIPE, env=child_env())
    b = Election(client, prefix, b"b", ttl=TTL)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().decode()
        assert line.startswith("leader"), line
        assert leader_of(client, prefix) == (b"child", int(line.split()[1]))
        assert not b.campaign(timeout=0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        start = time.monotonic()
        assert b.campaign(timeout=TTL + 3)
        assert time.monotonic() - start < TTL + 1
        assert leader_of(client, prefix) == (b"b", b.revision)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        b.resign()


def test_leader_cut_off_steps_down_before_the_other_wins(cluster: EtcdCluster,
                                                         client: EtcdClient,
                                                         prefix: str) -> None:
    # a reaches etcd through one member only; b through all
    lost_at: list[float] = []
    only = leader_index(cluster, client)
    cut = EtcdClient([cluster.endpoints[only]], timeout=1.0)
    a = Election(cut, prefix, b"a", ttl=TTL, on_lost=lambda: lost_at.append(time.monotonic()))
    b = Election(client, prefix, b"b", ttl=TTL)
    try:
        assert a.campaign(timeout=5)
        assert not b.campaign(timeout=0.1)
        cluster.kill(only)
        killed = time.monotonic()
        stepped_down = None
        while not b.campaign(timeout=0.02):
            if stepped_down is None and not a.is_leader:
                stepped_down = time.monotonic()
            assert time.monotonic() - killed < TTL + 4
        won = time.monotonic()
        # What matters: a stood down before b could win (it steps down two thirds into its
        # lease without a keep-alive; how soon after the kill depends on the machine's load).
        assert stepped_down is not None and stepped_down < won
        assert stepped_down - killed <= TTL
        eventually(lambda: lost_at, timeout=TTL + 1)
        assert lost_at[0] - killed <= TTL + 1
        assert not a.is_leader and b.is_leader
    finally:
        b.resign()
        with pytest.raises(EtcdError):
            a.resign()
        cut.close()


def test_binary_and_cluster_errors(tmp_path, monkeypatch) -> None:
    assert os.access(etcd_binary(), os.X_OK)
    monkeypatch.setenv("WEIGHTFABRIC_ETCD", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="WEIGHTFABRIC_ETCD"):
        etcd_binary()
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'etcd: this one cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("WEIGHTFABRIC_ETCD", str(fake))
    base = tmp_path / "clusters"
    base.mkdir()
    with hard_timeout(LIMIT_S):
        broken = EtcdCluster(1, base_dir=base, start_timeout=5)
        with pytest.raises(RuntimeError, match="cannot start"):
            broken.start()
    assert list(base.iterdir()) == [] and broken.root is None
