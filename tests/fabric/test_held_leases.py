"""Held leases: one lease per reader, holder and version instead of one per read.

`fabric.transports.held`: a reader on the holder's host takes one ``HOLD`` for the
whole fetch, copies without further round trips, asks ``WAIT`` only for chunks not
known present, and ends it once with the bytes it copied (the holder's accounting).
"""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from holder_process import pattern
from timeouts import hard_timeout

from weightfabric.fabric.arena import Region
from weightfabric.fabric.auth import CapabilityCheck, capability, scope_of
from weightfabric.fabric.errors import ReadForbiddenError
from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.transports import ReadRefusedError, ReadServer, SourceLostError, client
from weightfabric.fabric.transports import server as server_module
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.fabric.transports.wire import Op

CHUNK = 64 << 10
CHUNKS = 32
R = region_name("m", 1, 0)


@contextmanager
def shm_holder(nbytes: int = CHUNKS * CHUNK, *, progress: ChunkProgress | None = None,
               **server_options) -> Iterator[tuple[ReadServer, torch.Tensor]]:
    """A read server exposing region `R` (m v1): ``nbytes`` of a pattern in /dev/shm."""
    region = Region.create("held-test", nbytes)
    region.tensor.copy_(pattern(nbytes))
    try:
        with ReadServer(**server_options) as server:
            server.expose(R, region.tensor, chunk_size=CHUNK, progress=progress,
                          shm_path=str(region.path))
            yield server, region.tensor
    finally:
        region.close()


@pytest.fixture
def shm():
    transport = ShmTransport()
    yield transport
    transport.close()


def test_one_hold_covers_every_read_and_end_counts_the_bytes_copied(shm):
    with hard_timeout(30), shm_holder() as (server, data):
        lease = shm.hold(server.address, R, data.numel(), timeout=5)
        out = torch.zeros_like(data)
        for i in range(CHUNKS):  # 32 reads, not one round trip among them
            lo = i * CHUNK
            assert lease.read(lo, out[lo:lo + CHUNK], timeout=5) == CHUNK
        assert torch.equal(out, data) and lease.waits == 0
        assert server.bytes_served == 0  # counted when the lease ends
        assert not server.retract(R, timeout=0.2)  # the lease holds the region
        assert lease.close() is True
        assert server.bytes_served == data.numel()
        assert server.retract(R, timeout=5)


def test_a_partial_region_is_waited_for_once_per_span_not_per_read(shm):
    progress = ChunkProgress(CHUNKS)
    with hard_timeout(30), shm_holder(progress=progress) as (server, data):
        lease = shm.hold(server.address, R, data.numel(), timeout=5)
        out = torch.zeros_like(data)
        got = []
        reader = threading.Thread(target=lambda: got.append(
            lease.read(0, out[:4 * CHUNK], timeout=10, prefix=True)))
        reader.start()
        time.sleep(0.2)
        assert got == []  # chunk 0 is not there yet
        for c in range(4):
            progress.mark(c)
        reader.join(5)
        assert got == [4 * CHUNK] and lease.waits == 1
        assert lease.read(CHUNK, out[CHUNK:2 * CHUNK], timeout=5) == CHUNK
        assert lease.waits == 1  # known present: no round trip
        assert torch.equal(out[:4 * CHUNK], data[:4 * CHUNK])
        with pytest.raises(ReadRefusedError, match="NOT_READY"):
            lease.read(8 * CHUNK, out[:CHUNK], timeout=0.2)
        assert not lease.failed  # a refusal keeps the lease
        lease.close()
        assert server.bytes_served == 5 * CHUNK


def test_a_hold_renews_itself_and_a_lapsed_one_fails_its_reads(shm, monkeypatch):
    monkeypatch.setattr(server_module, "LEASE_HOLD", 0.8)
    with hard_timeout(30), shm_holder() as (server, data):
        lease = shm.hold(server.address, R, data.numel(), timeout=5)
        out = torch.zeros(CHUNK, dtype=torch.uint8)
        time.sleep(0.5)  # over half the hold: the next read renews it first
        assert lease.read(0, out, timeout=5) == CHUNK and lease.waits == 1
        assert not lease.lapsed
        time.sleep(1.2)  # the holder cut it: a fetch takes a new lease, the holder is fine
        assert lease.lapsed and not lease.failed
        with pytest.raises(SourceLostError, match="ended"):
            lease.read(0, out, timeout=5)
        assert lease.failed and lease.close() is False
        assert server.retract(R, timeout=5)


def test_a_closed_holder_fails_the_reads_under_its_lease(shm):
    with hard_timeout(30), shm_holder() as (server, data):
        lease = shm.hold(server.address, R, data.numel(), timeout=5)
        server.close()
        time.sleep(0.1)
        with pytest.raises(SourceLostError, match="closed the connection"):
            lease.read(0, torch.zeros(CHUNK, dtype=torch.uint8), timeout=5)


def test_hostile_holds_waits_and_ends_are_refused_or_capped(shm):
    key = b"k" * 32
    with hard_timeout(30), shm_holder(capabilities=CapabilityCheck(key)) as (server, data):
        mine = replace(server.address, cap=capability(key, scope_of("m", 1), "reader"))
        with pytest.raises(ReadRefusedError, match="OUT_OF_RANGE"):  # past the region
            shm.hold(mine, R, data.numel() + 1, timeout=5)
        with pytest.raises(ReadForbiddenError):  # a capability for another version
            shm.hold(replace(server.address, cap=capability(key, scope_of("m", 2), "reader")), R,
                     data.numel(), timeout=5)
        with pytest.raises(ReadForbiddenError):  # no capability
            shm.hold(server.address, R, data.numel(), timeout=5)
        conn = client.connect(mine)
        try:
            with pytest.raises(ReadRefusedError, match="WAIT outside a HOLD"):
                client.wait_present(conn, mine, R, offset=0, nbytes=CHUNK, timeout=1,
                                    prefix=False)
        finally:
            conn.close()
        conn = client.connect(mine)
        try:  # a hold of the first half: waits beyond it are refused, the lease kept
            client.hold(conn, mine, R, offset=0, nbytes=data.numel() // 2, timeout=5)
            with pytest.raises(ReadRefusedError, match="outside the held span"):
                client.wait_present(conn, mine, R, offset=data.numel() // 2, nbytes=CHUNK,
                                    timeout=1, prefix=False)
            client.end(conn, mine, R, copied=10 * data.numel(), timeout=5)  # claims more
        finally:
            conn.close()
        assert server.bytes_served == data.numel() // 2  # capped at the span


def test_a_fetch_takes_one_lease_per_holder_and_the_holder_counts_what_it_served(workers):
    trainer, reader = workers.join("trainer"), workers.join("reader")
    tensors = {f"w{i}": torch.randn(16_384) for i in range(8)}  # 512 KiB: 32 chunks of 16 KiB
    published = trainer.model("m", chunk_size=16 << 10)
    version = published.publish(tensors)
    store = reader.model("m")
    stats = store.fetch(version, options=FetchOptions(read_bytes=16 << 10))  # 32 reads
    assert stats.chunks == 32 and stats.transports == {"shm": stats.bytes}
    assert stats.leases == 1
    assert trainer.bytes_served == stats.bytes
    assert all(torch.equal(store.tensors[n], t) for n, t in tensors.items())
    assert published.retract(version) == "done"  # the lease ended with the fetch


def test_the_per_read_path_counts_one_lease_per_read(workers):
    trainer, reader = workers.join("trainer"), workers.join("reader")
    version = trainer.model("m", chunk_size=16 << 10).publish({"w": torch.randn(16_384)})
    hold = ShmTransport.hold
    try:
        del ShmTransport.hold  # a transport that takes a lease per read
        stats = reader.model("m").fetch(version, options=FetchOptions(read_bytes=16 << 10))
    finally:
        ShmTransport.hold = hold  # type: ignore[method-assign]
    assert stats.chunks == 4 and stats.leases == 4
    assert trainer.bytes_served == stats.bytes
    assert Op.HOLD != Op.LEASE


def test_a_holder_that_reuses_or_frees_its_buffers_is_never_read_stale(workers):
    trainer, reader = workers.join("trainer"), workers.join("reader")
    published = trainer.model("m", chunk_size=16 << 10, prepare_spare=False)
    store = reader.model("m")
    paths, versions = [], []
    for step in range(4):
        if step == 3:  # v2's buffer is freed: v4 takes a new one, the reader maps it anew
            published.release(versions[1])
        tensors = {"w": torch.full((65_536,), float(step)), "b": torch.randn(1000)}
        versions.append(published.publish(tensors))
        paths.append(str(published.pool.find(versions[-1]).region.path))
        stats = store.fetch(versions[-1])
        assert stats.leases == 1
        assert all(torch.equal(store.tensors[n], t) for n, t in tensors.items()), step
    # v3 reused v1's buffer (same file, retracted first); v4 a new one after the release
    assert paths[2] == paths[0] and paths[3] not in paths[:3]


def test_a_lease_that_lapses_between_reads_is_taken_again_not_counted_a_failure(
        shm, monkeypatch):
    monkeypatch.setattr(server_module, "LEASE_HOLD", 0.8)
    with hard_timeout(30), shm_holder(4 * CHUNK) as (server, data):
        source = Source("holder", server.address, R)

        class Planner:
            def plan(self, missing, failed):
                return [] if "holder" in failed else [Assignment(tuple(missing), (source,))]

            def report(self, chunks):
                pass

        dest = torch.zeros_like(data)
        stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(4),
                             planner=Planner(), choose=lambda _: shm,
                             before_write=lambda lo, hi: time.sleep(0.7 if lo else 0),
                             options=FetchOptions(max_inflight=1, read_bytes=CHUNK))
        assert torch.equal(dest, data) and stats.failed_sources == []
        assert stats.leases >= 2  # the pauses outlasted the hold: leases taken again


def test_a_fetch_waiting_on_a_partial_source_ends_its_lease_on_a_done_one(shm):
    progress = ChunkProgress(4)
    with hard_timeout(30), shm_holder(4 * CHUNK) as (done_server, data), \
            shm_holder(4 * CHUNK, progress=progress) as (partial_server, _):
        done = Source("done", done_server.address, R)
        partial = Source("partial", partial_server.address, R)

        class Planner:  # chunks 0-1 from the complete holder, 2-3 from the partial one
            def plan(self, missing, failed):
                return [Assignment(tuple(c for c in missing if c < 2), (done,)),
                        Assignment(tuple(c for c in missing if c >= 2), (partial,))]

            def report(self, chunks):
                pass

        dest = torch.zeros_like(data)
        result = []
        fetch = threading.Thread(target=lambda: result.append(fetch_chunks(
            dest, chunk_size=CHUNK, progress=ChunkProgress(4), planner=Planner(),
            choose=lambda _: shm, options=FetchOptions(read_bytes=CHUNK))))
        fetch.start()
        time.sleep(0.5)  # chunks 0-1 are in; 2-3 wait at the partial holder
        assert not result and dest[:2 * CHUNK].equal(data[:2 * CHUNK])
        assert done_server.retract(R, timeout=1)  # no lease left on it
        progress.mark(2)
        progress.mark(3)
        fetch.join(10)
        assert result and torch.equal(dest, data) and result[0].failed_sources == []
