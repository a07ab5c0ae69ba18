"""The reader side against a hostile or broken source.

Every bad reply ends the read with a `TransportError` naming the source and op, within a
bounded time and without allocating what the reply claims; bad arguments raise `ValueError`
before anything is sent; a source that trickles its bytes is failed over.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import msgpack
import pytest
import torch
from timeouts import hard_timeout

from weightfabric.fabric.errors import SourceLostError, TransportError
from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import (
    ReadServer,
    ShmTransport,
    SourceAddress,
    TcpTransport,
    client,
)
from weightfabric.fabric.transports.wire import MAX_NAME, REPLY, REQUEST, Op, Status, recv_exact

Answer = Callable[[socket.socket, Op, int], None]
"""How the hostile source answers one request: ``answer(conn, op, nbytes)``."""


def reply(payload: bytes = b"", *, status: int = Status.OK, message: bytes = b"",
          msg_len: int | None = None, payload_len: int | None = None) -> bytes:
    """A reply header (with lengths that may lie) followed by `message` and `payload`."""
    return REPLY.pack(status, len(message) if msg_len is None else msg_len,
                      len(payload) if payload_len is None else payload_len) + message + payload


def packed(obj: object) -> bytes:
    return reply(msgpack.packb(obj))


def sends(data: bytes) -> Answer:
    return lambda conn, op, nbytes: conn.sendall(data)


def trickle(head: Callable[[int], bytes], every: float) -> Answer:
    """Send the reply ``head(nbytes)`` one byte every `every` seconds."""
    def answer(conn: socket.socket, op: Op, nbytes: int) -> None:
        for byte in head(nbytes):
            time.sleep(every)
            conn.sendall(bytes([byte]))
    return answer


class Hostile(socketserver.ThreadingTCPServer):
    """A fake read server on loopback answering every request but END with `answer`."""

    block_on_close = True  # `close` joins the connections' threads

    def __init__(self, answer: Answer) -> None:
        super().__init__(("127.0.0.1", 0), _Connection)
        self.answer = answer
        self.conns: list[socket.socket] = []
        self.source = SourceAddress("127.0.0.1", self.server_address[1], "hostile")
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        for conn in self.conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # a blocked recv or a trickle ends
        self.server_close()


class _Connection(socketserver.BaseRequestHandler):
    server: Hostile

    def handle(self) -> None:
        conn = self.request
        self.server.conns.append(conn)
        try:
            while True:
                _, op, _, name_len, _, nbytes, _, cap_len = REQUEST.unpack(
                    recv_exact(conn, REQUEST.size))
                recv_exact(conn, name_len + cap_len)
                if op != Op.END:
                    self.server.answer(conn, Op(op), nbytes)
        except OSError:
            pass


@contextmanager
def hostile(answer: Answer, seconds: int = 20) -> Iterator[Hostile]:
    """A `Hostile` server, closed on exit; the test fails after `seconds`."""
    with hard_timeout(seconds):
        server = Hostile(answer)
        try:
            yield server
        finally:
            server.close()


def call(kind: str, source: SourceAddress, nbytes: int = 4096) -> object:
    """One reader call of `kind` against `source` (timeout 1 s)."""
    transport = ShmTransport() if kind == "shm" else TcpTransport()
    try:
        if kind in ("tcp", "shm"):
            return transport.read(source, "v1", 0, torch.zeros(nbytes, dtype=torch.uint8),
                                  timeout=1.0)
        if kind == "describe":
            return transport.describe(source, "v1", timeout=1.0)
        return transport.progress(source, "v1", timeout=1.0)
    finally:
        transport.close()


OPS = {"tcp": "READ", "shm": "LEASE", "describe": "DESCRIBE", "progress": "BITMAP"}


@pytest.mark.parametrize("kind, answer, words", [
    ("tcp", reply(status=Status.BAD_REQUEST, msg_len=0xFFFFFFFF, message=b"x" * 10),
     "message of 4294967295 bytes .* limit of 65536"),
    ("describe", reply(payload_len=1 << 62), f"payload of {1 << 62} bytes .* limit of 1048576"),
    ("shm", reply(payload_len=(1 << 20) + 1), "payload of 1048577 bytes .* limit of 1048576"),
    ("progress", reply(payload_len=3 << 30), "payload of 3221225472 bytes .* limit of 67108864"),
], ids=["message-4GiB", "describe-2^62", "lease-1MiB+1", "bitmap-3GiB"])
def test_reply_over_its_size_limit_is_refused_unread(kind: str, answer: bytes, words: str) -> None:
    """Before: 4 GiB and 3 GiB allocated for the claimed sizes, a MemoryError for 2^62."""
    with hostile(sends(answer)) as server:
        start = time.monotonic()
        with pytest.raises(TransportError, match=f"{OPS[kind]} .*{words}"):
            call(kind, server.source)
        assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("kind, answer, words", [
    ("tcp", reply(status=9, message=b"???"), "unknown reply status 9"),
    ("describe", reply(status=200), "unknown reply status 200"),
    ("describe", reply(b"\xc1"), "malformed reply"),
    ("describe", packed(5), "malformed reply: int, not a map"),
    ("describe", packed({}), "missing or mistyped nbytes, chunk_size, num_chunks, present"),
    ("describe", packed({"nbytes": "1", "chunk_size": 1, "num_chunks": 1, "present": 1,
                         "shm_path": None, "gpu": 7}), "mistyped nbytes, gpu$"),
    ("shm", reply(b"\xc1"), "malformed reply"),
    ("shm", packed([1, 2]), "list, not a map"),
    ("shm", packed({"nbytes": "lots", "shm_path": "/x"}), "mistyped nbytes$"),
    ("shm", packed({"nbytes": 4096, "shm_path": 3}), "mistyped shm_path$"),
], ids=["read-status", "describe-status", "describe-garbage", "describe-int", "describe-empty",
        "describe-types", "lease-garbage", "lease-list", "lease-nbytes-str", "lease-path-int"])
def test_malformed_reply_is_a_transport_error(kind: str, answer: bytes, words: str) -> None:
    """Before: ValueError, FormatError, KeyError, TypeError, AttributeError."""
    with hostile(sends(answer)) as server:
        where = f"{OPS[kind]} of 'v1' at source 127.0.0.1:{server.source.port}"
        with pytest.raises(TransportError, match=f"^{where}: .*{words}"):
            call(kind, server.source)


def test_lease_of_a_file_shorter_than_the_grant_loses_the_source(tmp_path: Path) -> None:
    """Before: a RuntimeError from copying 100 bytes into 4096."""
    short = tmp_path / "region"
    short.write_bytes(b"\x05" * 100)

    def answer(conn: socket.socket, op: Op, nbytes: int) -> None:
        conn.sendall(packed({"nbytes": nbytes, "shm_path": str(short), "gpu": None}))
        conn.close()  # whatever END gets: the lease is over

    with hostile(answer) as server, pytest.raises(SourceLostError, match="100 bytes"):
        call("shm", server.source)


@pytest.mark.parametrize("phase, every", [("payload", 1.25), ("header", 2.0)])
def test_trickling_source_is_lost_by_the_read_deadline(phase: str, every: float) -> None:
    """A byte every 1.25 s (2 s) never trips the socket's per-recv timeout (3 s).

    Before, the read took 10 s (48 s) and succeeded.
    """
    def answer(conn: socket.socket, op: Op, nbytes: int) -> None:
        if phase == "payload":
            conn.sendall(reply(payload_len=nbytes))
            trickle(lambda n: b"\x07" * n, every)(conn, op, nbytes)
        else:
            trickle(lambda n: reply(b"\x07" * n), every)(conn, op, nbytes)

    with hostile(answer) as server:
        start = time.monotonic()
        with pytest.raises(SourceLostError, match=r"^READ of 'v1' .* 1 of (8|16) bytes"):
            call("tcp", server.source, nbytes=8)
        assert time.monotonic() - start < 1.0 + client.REPLY_SLACK + 0.5


@pytest.mark.parametrize("answer", [
    trickle(lambda nbytes: reply(b"\x07" * nbytes), 1.5),
    sends(reply(status=9)),
], ids=["trickle", "bad-status"])
def test_fetch_fails_over_from_a_hostile_source(answer: Answer) -> None:
    """Before: the trickle held the fetch to its deadline; a bad status ended it."""
    chunk, num = 4096, 4
    data = (torch.arange(num * chunk) % 251).to(torch.uint8)

    class Planner:
        def plan(self, missing: list[int], failed: set[str]) -> list[Assignment]:
            order = [s for s in (bad, good) if s.worker not in failed]
            return [Assignment(tuple(missing), tuple(order))]

        def report(self, chunks: list[int]) -> None:
            pass

    with hostile(answer) as server, ReadServer() as honest:
        honest.expose("v1", data, chunk_size=chunk)
        bad, good = Source("bad", server.source, "v1"), Source("good", honest.address, "v1")
        tcp = TcpTransport()
        dest = torch.zeros_like(data)
        start = time.monotonic()
        try:
            stats = fetch_chunks(dest, chunk_size=chunk, progress=ChunkProgress(num),
                                 planner=Planner(), choose=lambda s: tcp,
                                 options=FetchOptions(read_timeout=1.0, deadline=15.0))
        finally:
            tcp.close()
        assert stats.failed_sources == ["bad"] and torch.equal(dest, data)
        assert time.monotonic() - start < 1.0 + 2 * client.REPLY_SLACK + 1.0


@pytest.mark.parametrize("args, words", [
    ({"offset": -1}, r"offset must be an integer in \[0, 2\*\*64\), got -1"),
    ({"offset": 2**64}, "offset must be"),
    ({"nbytes": -5}, "nbytes must be"),
    ({"nbytes": 2**64}, "nbytes must be"),
    ({"region": "é" * (MAX_NAME // 2 + 1)}, f"region name of {MAX_NAME + 2} bytes .* {MAX_NAME}"),
    ({"region": "x" * 70000}, "region name of 70000 bytes"),
    ({"timeout": float("nan")}, "timeout must be"),
    ({"timeout": float("inf")}, "timeout must be"),
    ({"timeout": 1e39}, "timeout must be"),
    ({"timeout": -1.0}, "timeout must be"),
    ({"ranges": []}, "1 to 4096 ranges, not 0"),
    ({"ranges": [(0, 1)] * 4097}, "1 to 4096 ranges, not 4097"),
], ids=["offset-neg", "offset-2^64", "nbytes-neg", "nbytes-2^64", "name-1026", "name-70000",
        "timeout-nan", "timeout-inf", "timeout-1e39", "timeout-neg", "ranges-0", "ranges-4097"])
def test_bad_request_arguments_are_refused_before_sending(args: dict, words: str) -> None:
    """Before: struct.error, OverflowError, a NOT_FOUND from the server, or a read."""
    kwargs = {"region": "v1", "offset": 0, "nbytes": 8, "timeout": 1.0, **args}
    reader, server = socket.socketpair()
    with reader, server:
        with pytest.raises(ValueError, match=words):
            client.request(reader, SourceAddress("127.0.0.1", 1, "x"), Op.READ,
                           kwargs.pop("region"), **kwargs)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.recv(1)  # nothing was sent


def test_request_arguments_at_their_limits_are_sent() -> None:
    with hostile(sends(reply(b"\x07" * 8))) as server, \
            socket.create_connection(("127.0.0.1", server.source.port)) as conn:
        n = client.request(conn, server.source, Op.READ, "x" * MAX_NAME, offset=2**64 - 1,
                           nbytes=8, timeout=client.MAX_TIMEOUT)
        assert n == 8
