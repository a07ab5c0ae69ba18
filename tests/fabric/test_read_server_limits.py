"""A `ReadServer` facing peers that misbehave.

Every wait on a peer is bounded, and no peer can stop the server from serving the others
(docs/design.md, liveness).
"""

import errno
import math
import socket
import time

import pytest
import torch
from holder_process import pattern
from timeouts import hard_timeout

from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import (
    ReadRefusedError,
    ReadServer,
    SourceLostError,
    TcpTransport,
    client,
)
from weightfabric.fabric.transports import server as server_module
from weightfabric.fabric.transports.wire import (
    MAGIC,
    RANGE,
    RANGE_COUNT,
    REPLY,
    REQUEST,
    Flag,
    Op,
    Status,
    recv_exact,
)

CHUNK = 1 << 20


def raw(server: ReadServer, op: Op, name: str, *, offset: int = 0, nbytes: int = 0,
        timeout: float = 5.0, magic: bytes = MAGIC) -> socket.socket:
    """A connection that has sent one request and reads nothing back."""
    conn = socket.create_connection((server.address.host, server.address.port), timeout=5)
    conn.sendall(REQUEST.pack(magic, op, 0, len(name), offset, nbytes, timeout, 0)
                 + name.encode())
    return conn


def answer(conn: socket.socket) -> tuple[Status, str]:
    status, msg_len, payload_len = REPLY.unpack(recv_exact(conn, REPLY.size))
    message = recv_exact(conn, msg_len).decode()
    recv_exact(conn, payload_len)
    return Status(status), message


def read_ok(server: ReadServer, name: str = "r") -> bool:
    tcp = TcpTransport()
    try:
        out = torch.empty(CHUNK, dtype=torch.uint8)
        return tcp.read(server.address, name, 0, out, timeout=2) == CHUNK
    finally:
        tcp.close()


def wait_until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_failed_accept_is_retried_not_the_end_of_serving():
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        listener, failures = server._listener, []

        class OutOfDescriptors:  # the next accept fails as when the process has no fd left
            def accept(self):
                if not failures:
                    failures.append(1)
                    raise OSError(errno.EMFILE, "Too many open files")
                return listener.accept()

            def __getattr__(self, name):
                return getattr(listener, name)

        server._listener = OutOfDescriptors()
        assert read_ok(server)  # ends the accept blocked on the real listener
        assert read_ok(server) and failures == [1]  # the failed accept came between


def test_a_connection_whose_thread_cannot_start_is_dropped_and_serving_goes_on(monkeypatch):
    real = server_module.threading.Thread
    refused = []

    class NoThread(real):
        def start(self):
            if self.name == "wf-read-conn" and not refused:
                refused.append(1)
                raise RuntimeError("can't start new thread")
            super().start()

    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        monkeypatch.setattr(server_module.threading, "Thread", NoThread)
        with pytest.raises(SourceLostError):
            read_ok(server)
        assert refused == [1] and read_ok(server)
        assert wait_until(lambda: not server._connections, 5)  # the dropped one is not kept


def connect(server: ReadServer) -> socket.socket:
    return socket.create_connection((server.address.host, server.address.port), timeout=5)


def test_connections_idle_past_idle_timeout_are_closed():
    with hard_timeout(30), ReadServer(idle_timeout=0.3) as server, connect(server) as conn:
        assert conn.recv(1) == b""


def test_a_full_holder_closes_the_connection_idle_longest_to_serve_a_new_one(monkeypatch):
    monkeypatch.setattr(server_module, "MIN_IDLE_TO_CLOSE", 0.2)
    with hard_timeout(30), ReadServer(max_connections=2) as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        first = connect(server)
        assert wait_until(lambda: len(server._idle) == 1, 5)
        second = connect(server)
        try:
            assert wait_until(lambda: len(server._idle) == 2, 5)
            time.sleep(0.3)
            assert read_ok(server)
            assert first.recv(1) == b""                 # made room
            second.settimeout(0.2)
            with pytest.raises(TimeoutError):           # still served
                second.recv(1)
        finally:
            first.close()
            second.close()


def test_a_full_holder_with_no_idle_connection_refuses_a_new_one():
    with hard_timeout(30), ReadServer(max_connections=2) as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        progress = ChunkProgress(2)
        server.expose("p", pattern(2 * CHUNK), chunk_size=CHUNK, progress=progress)
        waiting = [raw(server, Op.READ, "p", nbytes=CHUNK, timeout=10) for _ in range(2)]
        try:  # both wait for a chunk that has not come: busy, not idle
            assert wait_until(lambda: len(server._connections) == 2 and not server._idle, 5)
            with pytest.raises(ReadRefusedError, match="serves 2 connections already, none"):
                read_ok(server)
            progress.mark(0)
            assert [answer(conn)[0] for conn in waiting] == [Status.OK, Status.OK]
        finally:
            for conn in waiting:
                conn.close()
        assert wait_until(lambda: not server._connections, 5)
        assert read_ok(server)


def test_out_of_file_descriptors_the_holder_closes_the_connection_idle_longest(monkeypatch):
    monkeypatch.setattr(server_module, "MIN_IDLE_TO_CLOSE", 0.2)
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        idle = connect(server)
        assert wait_until(lambda: len(server._idle) == 1, 5)
        time.sleep(0.3)
        listener = server._listener

        class OutOfDescriptors:  # accept fails until a descriptor is freed
            def accept(self):
                if server._idle:
                    raise OSError(errno.EMFILE, "Too many open files")
                return listener.accept()

            def __getattr__(self, name):
                return getattr(listener, name)

        server._listener = OutOfDescriptors()
        try:
            assert read_ok(server)  # ends the accept blocked on the real listener
            assert read_ok(server) and idle.recv(1) == b""
        finally:
            idle.close()


def test_a_reader_that_stops_taking_a_reply_is_cut_off_and_the_region_drains(monkeypatch):
    monkeypatch.setattr(server_module, "SEND_GRACE", 0.3)
    monkeypatch.setattr(server_module, "MIN_SEND_RATE", 1e12)
    with hard_timeout(30), ReadServer() as server:
        server.expose("big", torch.zeros(64 * CHUNK, dtype=torch.uint8), chunk_size=CHUNK)
        conn = raw(server, Op.READ, "big", nbytes=64 * CHUNK)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            start = time.monotonic()
            assert server.retract("big", timeout=10) is True
            assert time.monotonic() - start < 5
        finally:
            conn.close()


def test_a_lease_held_past_lease_hold_is_ended_and_its_end_then_fails(monkeypatch):
    monkeypatch.setattr(server_module, "LEASE_HOLD", 0.3)
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        pool = client.ConnectionPool()
        try:
            with pool.connection(server.address) as conn:  # a lease ended in time: OK
                client.lease(conn, server.address, "r", offset=0, nbytes=CHUNK, timeout=5)
                client.request(conn, server.address, Op.END, "r", timeout=5)
            with pytest.raises(SourceLostError, match="END"), \
                    pool.connection(server.address) as conn:
                client.lease(conn, server.address, "r", offset=0, nbytes=CHUNK, timeout=5)
                assert server.retract("r", timeout=5) is True  # the lease ran out
                client.request(conn, server.address, Op.END, "r", timeout=5)
        finally:
            pool.close()


def test_end_without_a_lease_and_an_old_protocol_are_refused_with_the_reason():
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        for magic, op, why in [(MAGIC, Op.END, "END without a lease"),
                               (b"WFR2", Op.READ, "read protocol WFR2, this holder speaks WFR5"),
                               (b"GET ", Op.READ, "not a weightfabric read request")]:
            with raw(server, op, "r", nbytes=CHUNK, magic=magic) as conn:
                status, message = answer(conn)
            assert status == Status.BAD_REQUEST and message.startswith(why)
        with raw(server, Op.READ, "r" * 2000) as conn:
            assert answer(conn) == (Status.BAD_REQUEST, "region name of 2000 bytes (at most 1024)")


def test_a_read_with_a_nan_timeout_is_refused_not_spun_on():
    progress = ChunkProgress(2)
    start = time.monotonic()
    assert progress.wait(0, 1, math.nan) is False and progress.wait(0, 1, 0.1, stall=math.nan) is False
    assert time.monotonic() - start < 1
    with hard_timeout(30), ReadServer() as server:
        server.expose("p", pattern(2 * CHUNK), chunk_size=CHUNK, progress=progress)
        with raw(server, Op.READ, "p", nbytes=CHUNK, timeout=math.nan) as conn:
            status, message = answer(conn)
        assert status == Status.BAD_REQUEST and "timeout nan" in message
        assert server.retract("p", timeout=1) is True


def test_a_pin_whose_ok_cannot_be_sent_is_not_kept(monkeypatch):
    real = ReadServer._reply

    def reset_on_ok(conn, status, message="", payload=b""):
        if status == Status.OK and not payload:
            raise ConnectionResetError("reader reset the connection")
        real(conn, status, message, payload)

    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        monkeypatch.setattr(ReadServer, "_reply", staticmethod(reset_on_ok))
        with raw(server, Op.PIN, "r") as conn:
            assert conn.recv(1) == b""  # dropped
        assert wait_until(lambda: not server._pins and not server._connections, 5)
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < server_module.UNPIN_WAIT  # nobody to wait for


def read_twice(server: ReadServer, between) -> None:
    """One reader reads, ``between()`` runs, the reader reads again: both succeed."""
    tcp, out = TcpTransport(), torch.empty(CHUNK, dtype=torch.uint8)
    try:
        assert tcp.read(server.address, "r", 0, out, timeout=2) == CHUNK
        between()
        assert tcp.read(server.address, "r", 0, out, timeout=2) == CHUNK
    finally:
        tcp.close()


def test_readers_do_not_reuse_pooled_connections_the_holder_has_closed_as_idle(monkeypatch):
    monkeypatch.setattr(client, "POOL_IDLE_S", 0.2)
    with hard_timeout(30), ReadServer(idle_timeout=0.4) as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        read_twice(server, lambda: wait_until(lambda: not server._connections, 5))


def test_readers_never_reuse_a_connection_the_holder_may_close_to_make_room(monkeypatch):
    assert client.POOL_IDLE_S * 2 <= server_module.MIN_IDLE_TO_CLOSE  # margin for pauses
    monkeypatch.setattr(server_module, "MIN_IDLE_TO_CLOSE", 0.1)
    monkeypatch.setattr(client, "POOL_IDLE_S", 0.05)

    def make_room() -> None:
        time.sleep(0.2)
        with connect(server):       # the pooled connection is closed for this one
            assert wait_until(lambda: len(server._idle) == 1, 5)
        assert wait_until(lambda: not server._connections, 5)

    with hard_timeout(30), ReadServer(max_connections=1) as server:
        server.expose("r", pattern(2 * CHUNK), chunk_size=CHUNK)
        read_twice(server, make_room)


def _ranged(server: ReadServer, op: Op, flags: int, ranges: list[tuple[int, int]], *,
            offset: int = 0, nbytes: int = 2 * CHUNK, count: int | None = None
            ) -> socket.socket:
    """A raw request declaring ``ranges`` (`Flag.RANGES`), the count possibly a lie."""
    conn = socket.create_connection((server.address.host, server.address.port), timeout=5)
    conn.sendall(REQUEST.pack(MAGIC, op, flags, 1, offset, nbytes, 5.0, 0) + b"r"
                 + RANGE_COUNT.pack(len(ranges) if count is None else count)
                 + b"".join(RANGE.pack(o, n) for o, n in ranges))
    return conn


def test_a_lease_with_declared_ranges_counts_only_those_as_served():
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(4 * CHUNK), chunk_size=CHUNK)
        with _ranged(server, Op.LEASE, Flag.RANGES, [(0, 100), (CHUNK, 50)]) as conn:
            assert answer(conn)[0] == Status.OK
            assert server.bytes_served == 150
            conn.sendall(REQUEST.pack(MAGIC, Op.END, 0, 1, 0, 0, 5.0, 0) + b"r")
            assert answer(conn) == (Status.OK, "")


@pytest.mark.parametrize(("op", "flags", "ranges", "count", "words"), [
    (Op.LEASE, Flag.RANGES, [(0, 10), (2 * CHUNK - 5, 10)], None, "outside the leased span"),
    (Op.LEASE, Flag.RANGES, [(0, 0)], None, "is empty"),
    (Op.LEASE, Flag.RANGES, [], 0, "1 to 4096 ranges, not 0"),
    (Op.LEASE, Flag.RANGES, [], 1 << 30, "1 to 4096 ranges"),
    (Op.READ, Flag.RANGES, [(0, 10)], None, "only by a LEASE without PREFIX"),
    (Op.LEASE, Flag.RANGES | Flag.PREFIX, [(0, 10)], None, "only by a LEASE without PREFIX"),
])
def test_bad_declared_ranges_are_refused_with_the_reason(op, flags, ranges, count, words):
    with hard_timeout(30), ReadServer() as server:
        server.expose("r", pattern(4 * CHUNK), chunk_size=CHUNK)
        with _ranged(server, op, flags, ranges, count=count) as conn:
            status, message = answer(conn)
        assert status == Status.BAD_REQUEST and words in message, message
        assert server.bytes_served == 0
        assert read_ok(server)                   # the holder serves on
