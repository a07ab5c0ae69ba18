"""Held reads that copy on a device stream: every piece launched, then waited for by event.

`CudaIpcTransport.stream_copy` launches a read's pieces (the copy with its checksums fused)
on its stream and returns `Pending`s; `HeldLease.read` launches them all before waiting
for the first, trusts each only if the lease held when it finished, and never returns
while one still writes. These tests run that path on CPU through a stand-in whose
"stream" is one worker thread (the GPU run is `tests/fabric/gpu/test_gpu_held_reads.py`).
"""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from holder_process import pattern
from test_held_leases import CHUNK, CHUNKS, R, shm_holder
from timeouts import hard_timeout

from weightfabric.fabric import fetch as fetch_module
from weightfabric.fabric.errors import SourceLostError
from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import server as server_module
from weightfabric.fabric.transports.base import Landing
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.kernels import chunk_checksums, copy_with_checksums


class _Queued:
    """A stand-in copy's `Pending`: final once its future is."""

    def __init__(self, future: Future, then) -> None:
        self.future, self.then = future, then

    def wait(self) -> None:
        sums = self.future.result()
        if self.then is not None and sums is not None:
            self.then(sums.tolist())


class StreamStandIn(ShmTransport):
    """`ShmTransport` whose held reads copy as `CudaIpcTransport.stream_copy` does.

    Each piece is queued on one worker thread (the "stream") and returned at once; ``gate``
    holds the stream until set, ``delay`` slows every copy.
    """

    def __init__(self, gate: threading.Event | None = None, delay: float = 0.0, *,
                 fuses: bool = True) -> None:
        super().__init__()
        self.stream = ThreadPoolExecutor(1, thread_name_prefix="stand-in-stream")
        self.gate, self.delay, self.fuses = gate, delay, fuses
        self.launches = 0
        self.finished: list[float] = []

    def stream_copy(self, kernel, then):
        def copy(dst, src):
            self.launches += 1

            def run():
                if self.gate is not None:
                    self.gate.wait(10)
                time.sleep(self.delay)
                sums = None
                if kernel is None or not self.fuses:  # as CUDA IPC across two GPUs
                    dst.copy_(src)
                else:
                    sums = kernel(dst, src)
                self.finished.append(time.monotonic())
                return sums

            return _Queued(self.stream.submit(run), then)

        return copy

    def close(self) -> None:
        super().close()
        self.stream.shutdown(wait=True)


@pytest.fixture
def stand_in():
    transport = StreamStandIn(gate=threading.Event())
    yield transport
    transport.gate.set()
    transport.close()


def fused(dst, src, first):
    return copy_with_checksums(dst, src, CHUNK, first_chunk=first)


def test_every_piece_is_launched_before_the_first_is_waited_for(stand_in):
    with hard_timeout(30), shm_holder() as (server, data):
        lease = stand_in.hold(server.address, R, data.numel(), timeout=5)
        out = torch.zeros_like(data)
        sums: list[int] = []
        landed: list[int] = []
        step = 4 * CHUNK
        copy = stand_in.stream_copy(lambda dst, src: fused(dst, src, (
            dst.data_ptr() - out.data_ptr()) // CHUNK), sums.extend)
        reader = threading.Thread(target=lambda: lease.read(
            0, out, timeout=5, copy=copy, landing=Landing(step, landed.append)))
        reader.start()
        deadline = time.monotonic() + 10
        while stand_in.launches < CHUNKS // 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stand_in.launches == CHUNKS // 4 and landed == []  # all out, none waited
        stand_in.gate.set()
        reader.join(10)
        assert landed == [step * (k + 1) for k in range(CHUNKS // 4)]  # told in order
        assert torch.equal(out, data)
        assert sums == chunk_checksums(data, CHUNK).tolist()  # the fused sums, in order
        assert lease.close() and server.bytes_served == data.numel()


def test_a_copy_that_finishes_after_the_lease_ran_out_is_not_trusted(monkeypatch):
    monkeypatch.setattr(server_module, "LEASE_HOLD", 0.8)  # trusted for 0.6 s
    slow = StreamStandIn(delay=0.35)
    try:
        with hard_timeout(30), shm_holder() as (server, data):
            lease = slow.hold(server.address, R, data.numel(), timeout=5)
            out = torch.zeros_like(data)
            landed: list[int] = []
            with pytest.raises(SourceLostError, match="held past its time"):
                lease.read(0, out, timeout=5, copy=slow.stream_copy(None, None),
                           landing=Landing(8 * CHUNK, landed.append))
            assert landed == [8 * CHUNK]  # the first piece finished in time, the second not
            assert slow.launches == 4 and len(slow.finished) == 4  # none still writes
            written = out.clone()
            time.sleep(0.5)
            assert torch.equal(out, written)
    finally:
        slow.close()


class _FirstThenSecond:
    """Plans every chunk on the first source, and what is missing after that on the second."""

    def __init__(self, first: Source, second: Source) -> None:
        self.sources = [first, second]

    def plan(self, missing, failed):
        source = self.sources[0] if len(self.sources) == 2 else self.sources[-1]
        if len(self.sources) == 2:
            self.sources.pop(0)
        return [Assignment(tuple(missing), (source,))]

    def report(self, chunks):
        pass


@pytest.mark.parametrize("fuses", [True, False], ids=["fused", "copy-then-checksum"])
def test_a_fetch_verifies_with_the_sums_its_stream_copies_made(monkeypatch, fuses):
    """The engine's path for CUDA IPC holders, on the stand-in.

    A read's pieces are launched at once and checked by the checksums fused into the copy
    (or, where the copy could not fuse them, by the fetch's own pass over what landed);
    a corrupt chunk is caught and read again elsewhere.
    """
    monkeypatch.setattr(fetch_module, "DEVICE_LAND_BYTES", 4 * CHUNK)  # 2 launches a read
    transport = StreamStandIn(fuses=fuses)
    separate: list[int] = []

    def checksum_fn(first, piece):
        separate.append(first)
        return chunk_checksums(piece, CHUNK, first_chunk=first).tolist()

    try:
        with hard_timeout(60), shm_holder() as (bad_server, bad), \
                shm_holder() as (good_server, data):
            bad[5 * CHUNK + 7] ^= 0xFF  # chunk 5 differs at the holder read first
            planner = _FirstThenSecond(Source("bad", bad_server.address, R),
                                       Source("good", good_server.address, R))
            dest = torch.zeros_like(data)
            stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(CHUNKS),
                                 planner=planner, choose=lambda _: transport,
                                 checksums=chunk_checksums(data, CHUNK).tolist(),
                                 checksum_fn=checksum_fn, copy_checksums=fused,
                                 options=FetchOptions(read_bytes=8 * CHUNK, max_inflight=2))
            assert torch.equal(dest, data) and torch.equal(dest, pattern(dest.numel()))
            assert stats.corrupted_chunks == 1
            if fuses:
                assert separate == []  # checked by the copies' sums
            else:  # each piece checked after its copy, chunk 5 twice
                assert sorted(separate) == sorted([*range(0, CHUNKS, 4), 5])
            assert transport.launches == CHUNKS // 4 + 1  # 4 chunks a launch; chunk 5 again
            assert stats.leases == 2  # one per holder
    finally:
        transport.close()
