"""A planned range with a window keeps its bandwidth-delay product in flight.

A read is a request and a reply: with one read in flight, a link idles a round trip
between two. The hub gives each planned range across a link with a latency the bytes
that fill it (`PlanRangeWire.window`, `fabric.hub.planned.window_bytes`); the engine
keeps that many bytes of reads in flight along the range, plus one read.
"""

import threading
import zlib

import pytest
import torch
from timeouts import hard_timeout

from weightfabric.fabric.fetch import (
    Assignment,
    FetchOptions,
    Source,
    _depth,
    _schedule,
    fetch_chunks,
)
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer, TcpTransport

CHUNK = 64 << 10
CHUNKS = 32
NBYTES = CHUNK * CHUNKS
SPAN = 4 * CHUNK  # the most one read asks for here


def data() -> torch.Tensor:
    return (torch.arange(NBYTES, dtype=torch.int64) * 31 % 241).to(torch.uint8)


def crcs(first: int, piece: torch.Tensor) -> list[int]:
    return [zlib.crc32(piece[i * CHUNK:(i + 1) * CHUNK].numpy().tobytes(), first + i)
            for i in range(-(-piece.numel() // CHUNK))]


class PlannedOnce:
    """A broadcast plan's one range from `source`, with `window` bytes to keep in flight."""

    planned = True

    def __init__(self, source: Source, window: int) -> None:
        self.source, self.window = source, window

    def plan(self, missing, failed):
        return [Assignment(tuple(missing), (self.source,), 1, window=self.window)]

    def report(self, chunks):
        pass


class Gate:
    """Holds each read until `width` reads are in flight at once (or fails the read)."""

    def __init__(self, inner: TcpTransport, width: int) -> None:
        self.inner, self.name = inner, inner.name
        self.barrier = threading.Barrier(width, timeout=10)
        self.met = 0

    def read(self, source, region, offset, out, *, timeout, prefix=False, abort=None):
        if self.met < 1:  # the first `width` reads meet; the rest go on their own
            self.barrier.wait()
            self.met = 1
        return self.inner.read(source, region, offset, out, timeout=timeout, prefix=prefix,
                               abort=abort)


@pytest.mark.parametrize(("window", "streams"), [(0, 1), (SPAN, 2), (3 * SPAN - 1, 4)])
def test_a_window_of_w_bytes_keeps_w_over_a_read_plus_one_reads_in_flight(window, streams):
    server = ReadServer()
    server.expose("v1", data(), chunk_size=CHUNK)
    tcp = TcpTransport()
    gate = Gate(tcp, streams)
    try:
        with hard_timeout(60):
            dest = torch.zeros(NBYTES, dtype=torch.uint8)
            stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(CHUNKS),
                                 planner=PlannedOnce(Source("up", server.address, "v1"), window),
                                 choose=lambda _: gate, checksums=crcs(0, data()),
                                 checksum_fn=crcs,
                                 options=FetchOptions(max_inflight=1, read_bytes=SPAN,
                                                      read_timeout=20, deadline=30))
        assert torch.equal(dest, data())
        assert stats.streams == streams  # as many met at the gate, and never more
    finally:
        tcp.close()
        server.close()


def test_the_reads_of_a_windowed_range_take_their_turns_together():
    a, b = Source("a", None, "v1"), Source("b", None, "v1")  # type: ignore[arg-type]
    reads = _schedule([Assignment(tuple(range(8)), (a,), 1, window=2 * CHUNK),
                       Assignment(tuple(range(8, 12)), (b,), 1)], list(range(12)), {},
                      chunks_per_read=2, inflight=2, chunk_size=CHUNK)
    # spans of 2 chunks; a's window takes one more read in flight than its own: 2 per turn
    assert [(span[0], s.worker) for span, s in reads] == [
        (0, "a"), (2, "a"), (8, "b"), (4, "a"), (6, "a"), (10, "b")]
    assert _depth(Assignment((), (a,), window=0), SPAN) == 1
    assert _depth(Assignment((), (a,), window=SPAN + 1), SPAN) == 3
