"""CPU transports against a holder in another process.

TCP and shm, partial replicas, retract waiting for reads in flight, a holder killed
mid-read.
"""

import threading
import time
from pathlib import Path

import pytest
import torch
from holder_process import pattern
from hub_helpers import reader_address
from procs import Child
from timeouts import hard_timeout

from weightfabric.fabric.fetch import Source
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import (
    ReadAbort,
    ReadRefusedError,
    ReadServer,
    ShmTransport,
    SourceAddress,
    SourceLostError,
    TcpTransport,
    choose_transport,
    client,
    local_host_id,
)
from weightfabric.fabric.transports.wire import Op

NBYTES = 3 * 1024 * 1024 + 17  # not a multiple of the chunk size
CHUNK = 1024 * 1024


class Holder:
    """A holder process (role ``holder`` of `procs`, tests/holder_process.py).

    `close` kills it and removes its /dev/shm region whatever happened.
    """

    def __init__(self, *, partial: bool = False) -> None:
        self.child = Child("holder", NBYTES, CHUNK, *(["--partial"] if partial else []))
        self.source = SourceAddress("127.0.0.1", self.child.ready["port"], local_host_id())
        self.shm_path = Path(self.child.ready["shm_path"])

    def mark(self, chunk: int) -> None:
        """Chunk `chunk` becomes present (once this returns)."""
        self.child.ask("mark", chunk=chunk, timeout=10)

    def served(self) -> int:
        """Bytes the holder has served."""
        return self.child.ask("served", timeout=10)["bytes"]

    def close(self) -> None:
        self.child.kill()  # and removes the region, which a killed holder cannot


@pytest.fixture(scope="module")
def holder():
    """A complete replica, shared by the tests that only read it."""
    h = Holder()
    yield h
    h.close()


@pytest.fixture
def partial_holder():
    h = Holder(partial=True)
    yield h
    h.close()


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    t = TcpTransport() if request.param == "tcp" else ShmTransport()
    yield t
    t.close()


def test_whole_region_is_bit_exact(holder, transport):
    out = torch.empty(NBYTES, dtype=torch.uint8)
    transport.read(holder.source, "v1", 0, out, timeout=10)
    assert torch.equal(out, pattern(NBYTES))


def test_ranges_across_chunk_boundaries(holder, transport):
    expected = pattern(NBYTES)
    for offset, nbytes in [(CHUNK - 5, 10), (NBYTES - 17, 17), (12345, 2 * CHUNK), (0, 1)]:
        out = torch.empty(nbytes, dtype=torch.uint8)
        transport.read(holder.source, "v1", offset, out, timeout=10)
        assert torch.equal(out, expected[offset:offset + nbytes]), (offset, nbytes)


def await_progress(transport, holder, want: bytes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while transport.progress(holder.source, "v1", timeout=timeout) != want:
        assert time.monotonic() < deadline, f"progress never became {want!r}"
        time.sleep(0.01)


def test_describe_and_progress(partial_holder, transport):
    info = transport.describe(partial_holder.source, "v1", timeout=10)
    assert (info.nbytes, info.chunk_size, info.num_chunks, info.present) == (NBYTES, CHUNK, 4, 0)
    assert info.shm_path == str(partial_holder.shm_path)
    partial_holder.mark(2)
    await_progress(transport, partial_holder, b"\x00\x00\x01\x00")


def test_read_from_partial_replica_waits_for_its_chunks(partial_holder, transport):
    out = torch.empty(CHUNK, dtype=torch.uint8)
    result: list[BaseException | None] = []

    def read():
        try:
            transport.read(partial_holder.source, "v1", CHUNK + 100, out, timeout=30)
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    assert not result, "the read must wait for chunks 1 and 2"
    partial_holder.mark(1)
    time.sleep(0.2)
    assert not result, "chunk 2 is still missing"
    partial_holder.mark(2)
    reader.join(timeout=30)
    assert result == [None]
    assert torch.equal(out, pattern(NBYTES)[CHUNK + 100:2 * CHUNK + 100])


def test_missing_chunks_time_out_with_a_clear_error(partial_holder, transport):
    out = torch.empty(10, dtype=torch.uint8)
    with pytest.raises(ReadRefusedError, match="NOT_READY.*chunks 0..0"):
        transport.read(partial_holder.source, "v1", 0, out, timeout=0.2)


def test_an_aborted_read_ends_at_once_and_later_reads_still_work(partial_holder, transport):
    """A read waiting on a partial replica is cut short by its `ReadAbort`.

    A read waiting on a partial replica is cut short by its `ReadAbort` (how a fetch leaves
    a source); a read with that abort fails at once, and one without it works.
    """
    abort = ReadAbort()
    with hard_timeout(30):
        threading.Timer(0.2, abort.abort).start()
        start = time.monotonic()
        with pytest.raises(SourceLostError):
            transport.read(partial_holder.source, "v1", 0, torch.empty(10, dtype=torch.uint8),
                           timeout=10, abort=abort)
        assert time.monotonic() - start < 2
        with pytest.raises(SourceLostError, match="aborted"):
            transport.read(partial_holder.source, "v1", 0, torch.empty(10, dtype=torch.uint8),
                           timeout=10, abort=abort)
        partial_holder.mark(0)
        out = torch.empty(10, dtype=torch.uint8)
        transport.read(partial_holder.source, "v1", 0, out, timeout=10)
        assert torch.equal(out, pattern(NBYTES)[:10])


@pytest.mark.parametrize(("region", "offset", "nbytes", "words"), [
    ("v2", 0, 10, "NOT_FOUND"),
    ("v1", NBYTES - 5, 10, "OUT_OF_RANGE"),
])
def test_bad_reads_are_refused(holder, transport, region, offset, nbytes, words):
    with pytest.raises(ReadRefusedError, match=words):
        transport.read(holder.source, region, offset, torch.empty(nbytes, dtype=torch.uint8),
                       timeout=5)


def test_unreachable_source_is_lost_not_hung(transport):
    with ReadServer() as server:
        dead = server.address
    start = time.monotonic()
    with pytest.raises(SourceLostError, match="cannot reach"):
        transport.read(dead, "v1", 0, torch.empty(4, dtype=torch.uint8), timeout=5)
    assert time.monotonic() - start < 10


def test_holder_killed_mid_read_raises_source_lost(partial_holder):
    """The holder dies while a reader waits on it: the reader errors, it does not hang."""
    tcp = TcpTransport()
    try:
        errors: list[BaseException] = []

        def read():
            try:
                tcp.read(partial_holder.source, "v1", 0, torch.empty(CHUNK, dtype=torch.uint8),
                         timeout=30)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)
        partial_holder.child.kill()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], SourceLostError)
    finally:
        tcp.close()


def test_retract_refuses_new_reads_and_waits_for_shm_leases():
    """In-process holder, so the test can hold a lease open while retracting."""
    data = pattern(4 * CHUNK)
    with ReadServer() as server:
        server.expose("v1", data, chunk_size=CHUNK)
        tcp = TcpTransport()
        try:
            with tcp._pool.connection(server.address) as conn:
                client.lease(conn, server.address, "v1", offset=0, nbytes=CHUNK, timeout=5)
                assert server.retract("v1", timeout=0.2) is False  # lease still in flight
                with pytest.raises(ReadRefusedError, match="NOT_FOUND"):
                    tcp.read(server.address, "v1", 0, torch.empty(8, dtype=torch.uint8), timeout=5)
                client.request(conn, server.address, Op.END, "v1", timeout=5)
            assert server.retract("v1", timeout=5) is True
            assert server.regions() == []
        finally:
            tcp.close()


def test_a_name_being_retracted_can_be_exposed_again_and_each_exposure_drains_on_its_own():
    old, new = pattern(4 * CHUNK), pattern(4 * CHUNK).flip(0)
    with ReadServer() as server:
        first = server.expose("v1", old, chunk_size=CHUNK)
        tcp, pool = TcpTransport(), client.ConnectionPool()
        try:
            with pool.connection(server.address) as conn:
                client.lease(conn, server.address, "v1", offset=0, nbytes=CHUNK, timeout=5)
                assert server.retract("v1", timeout=0.1) is False  # the lease holds it
                second = server.expose("v1", new, chunk_size=CHUNK)
                out = torch.empty(CHUNK, dtype=torch.uint8)
                tcp.read(server.address, "v1", 0, out, timeout=5)  # new reads: the new bytes
                assert torch.equal(out, new[:CHUNK]) and server.regions() == ["v1"]
                assert server.retract(first, timeout=0.1) is False  # still its lease
                client.request(conn, server.address, Op.END, "v1", timeout=5)
            assert server.retract(first, timeout=5) is True
            assert server.regions() == ["v1"]  # retracting the old one left the new one
            assert server._superseded == []  # nor does the server keep its memory
            assert server.retract(second, timeout=5) is True and server.regions() == []
        finally:
            pool.close()
            tcp.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_retract_answers_reads_waiting_for_chunks_at_once(kind):
    """A read blocked on a missing chunk learns of a retract at once.

    A read blocked on a partial replica's missing chunk learns of a retract at once
    (NOT_FOUND: the reader moves to another source), and retract does not wait for it.
    """
    with ReadServer() as server:
        server.expose("v1", pattern(4 * CHUNK), chunk_size=CHUNK,
                      progress=ChunkProgress(4))
        transport = TcpTransport() if kind == "tcp" else ShmTransport()
        got: list[BaseException] = []

        def read() -> None:
            try:
                transport.read(server.address, "v1", 0, torch.empty(CHUNK, dtype=torch.uint8),
                               timeout=20)
            except Exception as exc:
                got.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        try:
            reader.start()
            end = time.monotonic() + 10  # until it waits for chunk 0 on the server
            while server._regions["v1"].inflight == 0:
                assert time.monotonic() < end, "the read never reached the server"
                time.sleep(0.01)
            start = time.monotonic()
            assert server.retract("v1", timeout=20) is True
            reader.join(20)
            assert time.monotonic() - start < 5
            assert len(got) == 1 and isinstance(got[0], ReadRefusedError)
            assert "NOT_FOUND" in str(got[0]) and "retracted" in str(got[0])
        finally:
            transport.close()


def test_a_read_waiting_on_a_stalled_partial_region_is_answered_before_its_timeout():
    """A partial region that gets no chunk answers NOT_READY after `stall_timeout`.

    A partial region that gets no chunk for the server's ``stall_timeout`` answers reads of
    its missing chunks NOT_READY ("stalled") then, not at the read's own timeout; one that
    keeps getting chunks, even slower than that in total, does not.
    """
    with ReadServer(stall_timeout=0.4) as server:
        tcp = TcpTransport()
        try:
            exposed = time.monotonic()  # the stall clock starts with the progress
            server.expose("stalled", pattern(4 * CHUNK), chunk_size=CHUNK,
                          progress=ChunkProgress(4))
            with pytest.raises(ReadRefusedError, match="NOT_READY.*stalled"):
                tcp.read(server.address, "stalled", 3 * CHUNK,
                         torch.empty(CHUNK, dtype=torch.uint8), timeout=20)
            assert 0.4 <= time.monotonic() - exposed < 5

            filling = ChunkProgress(4)
            server.expose("filling", pattern(4 * CHUNK), chunk_size=CHUNK, progress=filling)

            def fill() -> None:  # a chunk every 0.2 s: 0.8 s in all, never 0.4 s idle
                for chunk in range(4):
                    time.sleep(0.2)
                    filling.mark(chunk)

            filler = threading.Thread(target=fill, daemon=True)
            filler.start()
            out = torch.empty(CHUNK, dtype=torch.uint8)
            tcp.read(server.address, "filling", 3 * CHUNK, out, timeout=20)
            assert torch.equal(out, pattern(4 * CHUNK)[3 * CHUNK:])
            filler.join(5)
        finally:
            tcp.close()


def test_bytes_served_counts_egress(holder):
    before = holder.served()
    tcp = TcpTransport()
    try:
        tcp.read(holder.source, "v1", 0, torch.empty(1000, dtype=torch.uint8), timeout=5)
        tcp.read(holder.source, "v1", 5, torch.empty(24, dtype=torch.uint8), timeout=5)
    finally:
        tcp.close()
    assert holder.served() - before == 1024


def test_transport_choice_by_host_and_memory_kind():
    shm, tcp, ipc = ShmTransport(), TcpTransport(), TcpTransport()
    here = SourceAddress("127.0.0.1", 1, local_host_id())
    there = SourceAddress("10.1.2.3", 1, "other-host:boot")
    handle = {"kind": "cuda_ipc"}
    assert choose_transport(here, shm=shm, tcp=tcp) is shm
    assert choose_transport(there, shm=shm, tcp=tcp) is tcp
    assert choose_transport(here, shm=shm, tcp=tcp, gpu=handle, ipc=ipc) is ipc
    assert choose_transport(there, shm=shm, tcp=tcp, gpu=handle, ipc=ipc) is tcp
    # GPU memory this process cannot map, or an NVSHMEM region: the holder copies to host
    assert choose_transport(here, shm=shm, tcp=tcp, gpu=handle, ipc=None) is tcp
    assert choose_transport(here, shm=shm, tcp=tcp, gpu={"kind": "nvshmem"}, ipc=ipc) is tcp


def test_worker_reads_a_gpu_region_it_cannot_map_over_tcp(workers):
    data = torch.arange(3000, dtype=torch.int64).to(torch.uint8)
    ipc = {"kind": "cuda_ipc", "handle": bytes(64), "offset": 0, "nbytes": 3000,
           "device_uuid": "0" * 32}  # a GPU no process here has
    holder, reader = workers.join("holder"), workers.join("reader")
    holder.server.expose("r/v1/s0", data, chunk_size=1000, gpu=ipc)
    holder.server.expose("h/v1/s0", data, chunk_size=1000, shm_path="/dev/shm/x")
    address = reader_address(holder, "r/v1/s0")
    gpu_source = Source("holder", address, "r/v1/s0")
    assert reader.transport_for(gpu_source) is reader.transports.tcp
    assert reader.transport_for(Source("holder", reader_address(holder, "h/v1/s0"),
                                       "h/v1/s0")) is reader.transports.shm
    out = torch.empty(3000, dtype=torch.uint8)
    reader.transport_for(gpu_source).read(address, "r/v1/s0", 0, out, timeout=5)
    assert torch.equal(out, data)
    with pytest.raises(ReadRefusedError, match="NOT_FOUND"):
        reader.transport_for(Source("holder", address, "r/v1/s1"))


def test_expose_rejects_bad_regions():
    with ReadServer() as server:
        with pytest.raises(ValueError, match="flat contiguous uint8"):
            server.expose("x", torch.zeros(4, dtype=torch.float32), chunk_size=4)
        server.expose("x", torch.zeros(8, dtype=torch.uint8), chunk_size=4)
        with pytest.raises(ValueError, match="already exposed"):
            server.expose("x", torch.zeros(8, dtype=torch.uint8), chunk_size=4)


def test_shm_reader_follows_a_region_moved_to_another_file(tmp_path):
    """A holder that re-exposes a name from another buffer must never be read stale."""
    from weightfabric.fabric.arena import Region

    with Region.create("a", 4096, directory=tmp_path) as first, \
            Region.create("b", 4096, directory=tmp_path) as second, ReadServer() as server:
        first.tensor.fill_(1)
        second.tensor.fill_(2)
        shm = ShmTransport()
        try:
            out = torch.empty(16, dtype=torch.uint8)
            server.expose("v1", first.tensor, chunk_size=1024, shm_path=str(first.path))
            shm.read(server.address, "v1", 100, out, timeout=5)
            assert out.eq(1).all()
            assert server.retract("v1", timeout=5)
            server.expose("v1", second.tensor, chunk_size=1024, shm_path=str(second.path))
            shm.read(server.address, "v1", 100, out, timeout=5)
            assert out.eq(2).all()
        finally:
            shm.close()


def test_prefix_read_gets_the_present_run_of_chunks(partial_holder, transport):
    expected = pattern(NBYTES)
    out = torch.zeros(NBYTES, dtype=torch.uint8)
    for chunk in (0, 1, 3):
        partial_holder.mark(chunk)
    await_progress(transport, partial_holder, b"\x01\x01\x00\x01")
    got = transport.read(partial_holder.source, "v1", 0, out, timeout=10, prefix=True)
    assert got == 2 * CHUNK  # chunk 2 is missing: 3 is not part of the run
    assert torch.equal(out[:got], expected[:got]) and not out[got:].any()
    with pytest.raises(ReadRefusedError, match="NOT_READY.*chunks 2..2"):
        transport.read(partial_holder.source, "v1", 2 * CHUNK, out[2 * CHUNK:], timeout=0.2,
                       prefix=True)
    partial_holder.mark(2)  # the holder marks it in its own time: wait to see it
    await_progress(transport, partial_holder, b"\x01\x01\x01\x01")
    got = transport.read(partial_holder.source, "v1", CHUNK + 7, out[:NBYTES - CHUNK - 7],
                         timeout=10, prefix=True)
    assert got == NBYTES - CHUNK - 7  # the run reaches the end of the region
    assert torch.equal(out[:got], expected[CHUNK + 7:])
