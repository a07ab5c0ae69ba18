"""The CPU data plane end to end: a hub, a trainer and readers in separate processes.

Every test bounds its time (each command's reply has a timeout, the whole test
an alarm) and kills its processes in `finally`; the processes' /dev/shm files
are removed on their exit, and by `remove_stale_regions` after a SIGKILL.
"""

from __future__ import annotations

import time

import pytest
from procs import running_cluster

import weightfabric as wf

MB = 256


@pytest.fixture
def cluster():
    """A hub (short leases) and a factory of worker processes, all torn down after."""
    with running_cluster(lease_s=2.0, limit=300) as (hub, spawn):
        yield hub, spawn


def fetch_progress(url: str, worker: str) -> int:
    with wf.connect(url, timeout=5) as observer:
        return sum(f["have"] for f in observer.status()["fetches"] if f["worker"] == worker)


def test_four_readers_bit_exact_and_pipelined(cluster):
    hub, spawn = cluster
    trainer = spawn("trainer")
    readers = [spawn(f"reader-{i}") for i in range(4)]
    version = trainer.ask("publish", seed=1, mb=MB)["version"]
    for r in readers:
        r.ask("expect", seed=1, mb=MB)
    for r in readers:  # all at once: they pipeline through each other
        r.send("fetch", version=version)
    stats = [r.reply() for r in readers]
    assert all(s["exact"] for s in stats), stats
    size = stats[0]["bytes"]
    served = trainer.ask("served")["bytes"]
    assert served < 2 * size, f"trainer served {served / size:.2f}x the model: no pipelining"
    assert sum(len(s["sources"]) for s in stats) > 4  # readers read from each other


def striping_over_two_holders(hub, spawn, env=lambda name: None):
    """(holder-a, reader, version), once a slowed reader has 4 chunks of the version.

    A 64 MB version only holder-a and holder-d hold (the trainer retracted it): the
    reader stripes over both. ``env(name)``: each process's extra environment.
    """
    trainer = spawn("trainer", env=env("trainer"))
    a, d = spawn("holder-a", env=env("holder-a")), spawn("holder-d", env=env("holder-d"))
    version = trainer.ask("publish", seed=2, mb=64)["version"]
    for h in (a, d):
        h.ask("expect", seed=2, mb=64)
        assert h.ask("fetch", version=version)["exact"]
    assert trainer.ask("retract", version=version)["state"] == "done"
    reader = spawn("reader", read_delay=0.1, env=env("reader"))  # 64 chunks, 4 in flight
    reader.ask("expect", seed=2, mb=64)
    reader.send("fetch", version=version)
    deadline = time.monotonic() + 60
    while fetch_progress(hub.url, "reader") < 4:
        assert time.monotonic() < deadline, "the reader made no progress"
        time.sleep(0.05)
    return a, reader, version


def test_source_killed_mid_fetch_survivors_complete_rereading_only_missing(cluster):
    a, reader, _ = striping_over_two_holders(*cluster)
    a.kill()
    stats = reader.reply()
    assert stats["exact"]
    assert stats["failed_sources"] == ["holder-a"], stats
    assert set(stats["sources"]) == {"holder-a", "holder-d"}
    assert stats["chunks_reread"] <= 4  # at most the reads in flight when a died
    assert stats["bytes"] == sum(stats["sources"].values())
    assert stats["leases"] == 2  # one held lease per holder, not one per read


def test_elastic_join_stripes_over_holders_trainer_serves_nothing(cluster):
    hub, spawn = cluster
    trainer = spawn("trainer")
    holders = [spawn(f"holder-{i}") for i in range(3)]
    version = trainer.ask("publish", seed=3, mb=64)["version"]
    for h in holders:
        h.ask("expect", seed=3, mb=64)
        assert h.ask("fetch", version=version)["exact"]
    served_before = trainer.ask("served")["bytes"]
    assert trainer.ask("retract", version=version)["state"] == "done"
    joiners = [spawn(f"joiner-{i}") for i in range(2)]
    # One after the other: a joiner that plans while another is fetching may be told
    # to follow it (a partial replica, less loaded than the holders it reads from),
    # which is pipelining (test_four_readers_bit_exact_and_pipelined), not striping.
    for j in joiners:
        j.ask("expect", seed=3, mb=64)
        stats = j.ask("fetch", version=version)
        assert stats["exact"]
        assert len(set(stats["sources"]) - {"joiner-0", "joiner-1"}) >= 2, stats["sources"]
    assert trainer.ask("served")["bytes"] == served_before


def test_retract_while_read_and_corrupted_chunks_are_reread(cluster):
    hub, spawn = cluster
    trainer = spawn("trainer")
    bad, good = spawn("bad"), spawn("good")
    version = trainer.ask("publish", seed=4, mb=32)["version"]
    for h in (bad, good):
        h.ask("expect", seed=4, mb=32)
        assert h.ask("fetch", version=version)["exact"]
    bad.ask("corrupt")
    reader = spawn("reader", read_delay=0.02)
    reader.ask("expect", seed=4, mb=32)
    reader.send("fetch", version=version, verify=True)
    # the trainer retracts while the reader may be reading from it: it must wait for
    # those reads, and the reader must finish from the others
    assert trainer.ask("retract", version=version, wait=60)["state"] == "done"
    stats = reader.reply()
    assert stats["exact"]
    assert stats["corrupted_chunks"] >= 1  # "bad" is in every plan, so it got chunks
    assert stats["chunks_reread"] >= stats["corrupted_chunks"]


def test_corrupted_replica_is_caught_by_checksums(cluster):
    hub, spawn = cluster
    trainer = spawn("trainer")
    bad = spawn("bad")
    version = trainer.ask("publish", seed=5, mb=16)["version"]
    bad.ask("expect", seed=5, mb=16)
    assert bad.ask("fetch", version=version)["exact"]
    bad.ask("corrupt")
    assert trainer.ask("retract", version=version)["state"] == "done"
    # the only source left serves wrong bytes: the fetch must fail, never return them
    reader = spawn("reader")
    reader.ask("expect", seed=5, mb=16)
    reader.send("fetch", version=version, verify=True)
    reply = reader.next_reply(120)
    assert reply.get("error") == "FetchError", reply
