"""A relay serves each chunk as it lands, inside a multi-chunk read, verified first.

A relay is a reader whose replica other readers read while it is still filling
(its read server exposes the destination with the fetch's `ChunkProgress`). Its
reads ask an upstream for spans of up to 16 chunks; each chunk is verified and
marked as soon as its bytes are in place (`fabric.transports.base.Landing`), so
chunk k goes downstream before the span's last chunk has arrived. The upstream
here is a throttled source that sends one chunk at a time when told to.
"""

import socket
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
import torch
from timeouts import hard_timeout

from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer, SourceAddress, TcpTransport
from weightfabric.fabric.transports.base import Landing
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.fabric.transports.wire import REPLY, REQUEST, Status, recv_exact

CHUNK = 256 << 10  # the fetch looks at what landed every 256 KiB (`LAND_BYTES`)
CHUNKS = 16
NBYTES = CHUNKS * CHUNK
ONE_SPAN = FetchOptions(max_inflight=1, read_bytes=NBYTES, read_timeout=20, deadline=60)


def data() -> torch.Tensor:
    return (torch.arange(NBYTES, dtype=torch.int64) * 13 % 251).to(torch.uint8)


def crcs(first: int, piece: torch.Tensor) -> list[int]:
    return [zlib.crc32(piece[i * CHUNK:(i + 1) * CHUNK].numpy().tobytes(), first + i)
            for i in range(-(-piece.numel() // CHUNK))]


EXPECTED = crcs(0, data())


class Planner:
    """Every missing chunk from the first live source, then the others (no striping)."""

    def __init__(self, *sources: Source) -> None:
        self.sources = sources

    def plan(self, missing, failed):
        live = tuple(s for s in self.sources if s.worker not in failed)
        return [Assignment(tuple(missing), live, 1)] if live else []

    def report(self, chunks):
        pass


class ThrottledSource:
    """An upstream that grants a whole span and sends it one chunk per `release`.

    Chunks listed in `corrupt` go out with a byte flipped. `sent` counts the chunks
    sent so far; a read of a chunk range past what was released waits.
    """

    def __init__(self, worker: str, *, corrupt: tuple[int, ...] = ()) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.source = Source(worker, SourceAddress("127.0.0.1", self.listener.getsockname()[1],
                                                   "elsewhere"), "v1")
        self.corrupt, self.sent = corrupt, 0
        self.allowed = threading.Semaphore(0)
        self.asked = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def release(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            self.allowed.release()

    def _serve(self) -> None:
        with suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                *_, name_len, offset, nbytes, _timeout, cap_len = REQUEST.unpack(
                    recv_exact(conn, REQUEST.size))
                recv_exact(conn, name_len + cap_len)
                conn.sendall(REPLY.pack(Status.OK, 0, nbytes))
                self.asked.set()
                payload = data()
                for chunk in range(offset // CHUNK, (offset + nbytes) // CHUNK):
                    if not self.allowed.acquire(timeout=30):
                        return
                    piece = bytearray(payload[chunk * CHUNK:(chunk + 1) * CHUNK].numpy())
                    if chunk in self.corrupt:
                        piece[7] ^= 0xFF
                    conn.sendall(piece)
                    self.sent += 1

    def close(self) -> None:
        self.release(CHUNKS)
        self.listener.close()
        self.thread.join(10)


@contextmanager
def relay(*sources: Source) -> Iterator[tuple[ChunkProgress, ReadServer, threading.Thread,
                                              dict]]:
    """A relay fetching from `sources` on a thread, its replica served while it fills.

    Yields (its progress, its read server, the fetch thread, {"stats" | "error": ...}).
    """
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    progress = ChunkProgress(CHUNKS)
    out: dict = {}
    transport = TcpTransport()

    def fetch() -> None:
        try:
            out["stats"] = fetch_chunks(dest, chunk_size=CHUNK, progress=progress,
                                        planner=Planner(*sources), choose=lambda _: transport,
                                        checksums=EXPECTED, checksum_fn=crcs, options=ONE_SPAN)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc
        out["dest"] = dest

    with ReadServer() as server:
        server.expose("v1", dest, chunk_size=CHUNK, progress=progress)
        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        try:
            yield progress, server, thread, out
        finally:
            thread.join(30)
            transport.close()


def downstream_read(server: ReadServer, chunk: int, timeout: float) -> torch.Tensor:
    """Chunk `chunk` of the relay's replica, read from its server as another reader would."""
    reader = TcpTransport()
    try:
        out = torch.zeros(CHUNK, dtype=torch.uint8)
        reader.read(server.address, "v1", chunk * CHUNK, out, timeout=timeout)
        return out
    finally:
        reader.close()


def test_a_relay_forwards_chunk_k_before_its_read_of_the_span_completes():
    upstream = ThrottledSource("up")
    try:
        with hard_timeout(60), relay(upstream.source) as (progress, server, thread, out):
            assert upstream.asked.wait(10)  # the relay asked for all 16 chunks in one read
            upstream.release(3)
            assert progress.wait(0, 2, timeout=10)
            got = downstream_read(server, 2, timeout=10)  # served from the relay mid-read
            assert torch.equal(got, data()[2 * CHUNK:3 * CHUNK])
            assert upstream.sent == 3 and thread.is_alive()  # the span's read goes on
            assert not progress.has(3, 3)
            upstream.release(CHUNKS - 3)
            thread.join(20)
            assert "error" not in out, out.get("error")
            assert torch.equal(out["dest"], data())
            assert out["stats"].chunks == CHUNKS and out["stats"].sources == {"up": NBYTES}
    finally:
        upstream.close()


def test_a_corrupt_chunk_inside_a_span_is_not_served_and_is_read_again():
    upstream = ThrottledSource("bad", corrupt=(1,))
    good = ReadServer()
    good.expose("v1", data(), chunk_size=CHUNK)
    try:
        with hard_timeout(60), relay(upstream.source, Source("good", good.address, "v1")) as (
                progress, server, thread, out):
            assert upstream.asked.wait(10)
            upstream.release(3)  # chunk 0, chunk 1 corrupt, chunk 2
            assert progress.wait(2, 2, timeout=10)
            assert progress.has(0, 0) and not progress.has(1, 1)  # verified before marked
            with pytest.raises(Exception, match="NOT_READY"):
                downstream_read(server, 1, timeout=0.3)  # the corrupt bytes are not served
            upstream.release(CHUNKS - 3)
            thread.join(20)
            assert "error" not in out, out.get("error")
            stats = out["stats"]
            assert torch.equal(out["dest"], data())
            assert stats.corrupted_chunks == 1
            assert stats.sources == {"bad": NBYTES - CHUNK, "good": CHUNK}  # re-read elsewhere
            assert torch.equal(downstream_read(server, 1, timeout=5),
                               data()[CHUNK:2 * CHUNK])
    finally:
        upstream.close()
        good.close()


def test_a_held_shared_memory_read_tells_each_piece_once_the_lease_held(tmp_path):
    from weightfabric.fabric.arena import Region

    region = Region.create("landing-test", NBYTES)
    region.tensor.copy_(data())
    shm = ShmTransport()
    try:
        with hard_timeout(30), ReadServer() as server:
            server.expose("v1", region.tensor, chunk_size=CHUNK, shm_path=str(region.path))
            lease = shm.hold(server.address, "v1", NBYTES, timeout=5)
            out = torch.zeros(NBYTES, dtype=torch.uint8)
            told: list[tuple[int, bool]] = []

            def call(n: int) -> None:  # bytes [0, n) must be in place when told
                told.append((n, torch.equal(out[:n], data()[:n])))

            assert lease.read(0, out, timeout=5, landing=Landing(4 * CHUNK, call)) == NBYTES
            assert told == [(k * 4 * CHUNK, True) for k in range(1, 5)]
            lease.close()
    finally:
        shm.close()
        region.close()


def test_a_landing_cuts_a_read_into_its_pieces():
    assert Landing(4, print).pieces(10) == [(0, 4), (4, 8), (8, 10)]
    assert Landing(16, print).pieces(10) == [(0, 10)]
    assert Landing(4, print).pieces(0) == [(0, 0)]
