"""Connections from readers to `ReadServer`s, pooled per source."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import msgpack

from weightfabric.fabric.auth import MAX_CAP_BYTES
from weightfabric.fabric.errors import (
    NoBaseError,
    ReadForbiddenError,
    ReadRefusedError,
    SourceLostError,
    TransportError,
)
from weightfabric.fabric.transports.base import (
    Landing,
    ReadAbort,
    RegionInfo,
    SourceAddress,
    Transport,
)
from weightfabric.fabric.transports.tls import client_context as tls_client_context
from weightfabric.fabric.transports.wire import (
    BASE_NAME,
    BLOB_LEN,
    DELTA_ASK,
    DELTA_HEAD,
    MAGIC,
    MAX_BASES,
    MAX_NAME,
    MAX_RANGES,
    RANGE,
    RANGE_COUNT,
    REPLY,
    REQUEST,
    Flag,
    Op,
    Status,
    recv_exact,
    recv_into_exact,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
# Slack on top of the server-side wait so the server's NOT_READY answer arrives
# before the client gives up on the socket. Small: a holder that does not answer
# within it (frozen, or its host gone) costs a reader this much beyond its timeout.
# A payload gets it again, on top of its size at MIN_RATE.
REPLY_SLACK = 2.0
POOL_IDLE_S = 0.5
"""A pooled connection idle for longer is closed rather than reused. Reads of one
fetch follow each other closely; a new fetch (the next version) connects again,
which costs one TCP handshake per connection. Well under the idle time after which
a holder may close a connection to make room (`server.MIN_IDLE_TO_CLOSE`), so a
request never races that close."""
# The slowest average rate (bytes/s) a payload may arrive at: past REPLY_SLACK +
# size / MIN_RATE from its reply header the read fails (`SourceLostError`), so a
# source that trickles its bytes is failed over instead of holding the read until
# the fetch's deadline (the socket timeout alone only bounds each receive). Low on
# purpose, so that honest slow links are not cut: a holder fanning a version out
# shares its link among all its readers' reads (100 reads over 1 Gbit/s get about
# 1.2 MB/s each), and a cut read's bytes are read again elsewhere. A 64 MiB read
# (`FetchOptions.read_bytes`) may take 66 s. $WEIGHTFABRIC_MIN_READ_RATE (bytes/s)
# replaces it, for a network emulated at a small fraction of real links' bandwidth
# (`fabric bench cluster` scales it with the links).
MIN_RATE_ENV = "WEIGHTFABRIC_MIN_READ_RATE"


def _min_rate() -> float:
    text = os.environ.get(MIN_RATE_ENV, "").strip()
    try:
        value = float(text) if text else float(1 << 20)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        log.warning("$%s=%r is not a positive number of bytes per second; using 1 MiB/s",
                    MIN_RATE_ENV, text)
        value = float(1 << 20)
    return value


MIN_RATE = _min_rate()
# The longest wait a request may ask for: longer is a caller's mistake (and would
# overflow socket timeouts).
MAX_TIMEOUT = 7 * 24 * 3600.0
# Size limits of what a reply may make the reader allocate (`TransportError` over them).
MAX_MESSAGE = 64 << 10       # an error status's message
MAX_PAYLOAD = {
    Op.DESCRIBE: 1 << 20,    # msgpack map (the ``gpu`` descriptor is its largest part)
    Op.LEASE: 1 << 20,       # msgpack map
    Op.HOLD: 1 << 20,        # msgpack map
    Op.WAIT: 1 << 10,        # msgpack map
    Op.BITMAP: 64 << 20,     # one byte per chunk: 64 Mi chunks
}


class ConnectionPool:
    """Idle connections per source; each borrowed by one thread at a time."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def connection(self, source: SourceAddress,
                   abort: ReadAbort | None = None) -> Iterator[socket.socket]:
        """A connection to `source`, lent to the caller.

        With `abort`, watched by it while lent (`ReadAbort`).

        Raises:
            SourceLostError: the source is unreachable, or `abort` was aborted.
        """
        key = (source.host, source.port)
        conn = self._take(key)
        if conn is None:
            conn = _connect(key, abort, tls=source.tls)
        else:
            _watch(conn, abort, key)
        try:
            yield conn
        except BaseException:
            conn.close()  # state unknown after a failure: never reuse it
            raise
        finally:
            aborted = abort is not None and abort.unwatch(conn)
        if aborted:
            conn.close()  # it may have been shut down
            return
        with self._lock:
            self._idle.setdefault(key, []).append((conn, time.monotonic()))

    def _take(self, key: tuple[str, int]) -> socket.socket | None:
        """The idle connection to ``key`` used last, if any.

        Connections to any source idle longer than `POOL_IDLE_S` are closed on the way.
        """
        with self._lock:
            now, stale, conn = time.monotonic(), [], None
            for k, idle in list(self._idle.items()):
                stale += [c for c, since in idle if now - since > POOL_IDLE_S]
                fresh = [(c, since) for c, since in idle if now - since <= POOL_IDLE_S]
                if k == key and fresh:
                    conn = fresh.pop()[0]
                if fresh:
                    self._idle[k] = fresh
                else:
                    del self._idle[k]
        for old in stale:
            old.close()
        return conn

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            conns = [c for idle in self._idle.values() for c, _ in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()


def connect(source: SourceAddress, abort: ReadAbort | None = None) -> socket.socket:
    """A new connection to `source` (TLS if it serves TLS), watched by `abort` if given.

    Raises:
        SourceLostError: unreachable, the TLS handshake failed, or `abort` was aborted.
        TransportError: the holder needs TLS and this process has no TLS identity.
    """
    return _connect((source.host, source.port), abort, tls=source.tls)


def _connect(key: tuple[str, int], abort: ReadAbort | None, *, tls: bool = False
             ) -> socket.socket:
    """`socket.create_connection`, with each socket watched by `abort`.

    `socket.create_connection`, with each socket watched by `abort` before it connects (so
    an abort also ends a connect that hangs); the one returned stays watched. With ``tls``
    it is wrapped with the process's TLS identity (`tls.use_for_reads`) once connected.

    Raises:
        SourceLostError: no address of `key` could be reached, the TLS handshake failed,
            or `abort` was aborted.
        TransportError: the holder needs TLS and this process has no TLS identity.
    """
    error: OSError = OSError("no address")
    try:
        addresses = socket.getaddrinfo(*key, type=socket.SOCK_STREAM)
    except OSError as exc:
        addresses, error = [], exc
    for family, kind, proto, _, address in addresses:
        conn = socket.socket(family, kind, proto)
        _watch(conn, abort, key)
        try:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(address)
        except OSError as exc:
            if abort is not None:
                abort.unwatch(conn)
            conn.close()
            error = exc
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _wrap(conn, key, abort) if tls else conn
    raise SourceLostError(f"cannot reach source {key[0]}:{key[1]}: {error}") from error


def _wrap(conn: socket.socket, key: tuple[str, int], abort: ReadAbort | None) -> socket.socket:
    """``conn`` (connected, watched by ``abort``) after a TLS handshake, watched instead."""
    try:
        ctx = tls_client_context()
        if abort is not None:
            abort.unwatch(conn)
        wrapped = ctx.wrap_socket(conn)   # takes over conn's descriptor
    except BaseException as exc:
        conn.close()
        if isinstance(exc, OSError):
            raise SourceLostError(f"TLS handshake with source {key[0]}:{key[1]} failed: "
                                  f"{exc}") from exc
        raise
    _watch(wrapped, abort, key)
    return wrapped


def _watch(conn: socket.socket, abort: ReadAbort | None, key: tuple[str, int]) -> None:
    """Have `abort` watch `conn`; closes it and raises `SourceLostError` if already aborted."""
    if abort is not None and not abort.watch(conn):
        conn.close()
        raise SourceLostError(f"read from source {key[0]}:{key[1]} aborted")


def request(conn: socket.socket, source: SourceAddress, op: Op, region: str, *, offset: int = 0,
            nbytes: int = 0, timeout: float, prefix: bool = False,
            ranges: list[tuple[int, int]] | None = None,
            delta: tuple[int, list[str]] | None = None) -> int:
    """Send one request and read the reply header; return the payload length.

    ``prefix`` asks for the present prefix of the range (`Flag.PREFIX`); ``ranges``
    declares the parts of it a lease's reader copies (`Flag.RANGES`); ``delta`` is a
    ``DELTA``'s word width and base names. The reply header must arrive within
    ``timeout + REPLY_SLACK``.

    Raises:
        ValueError: an argument is out of range (nothing was sent).
        SourceLostError: the connection failed or the reply did not come in time.
        ReadRefusedError: the server answered with an error status (`ReadForbiddenError`:
            no valid capability).
        TransportError: the reply is malformed (unknown status, message too long).
    """
    name = _checked_name(region, offset, nbytes, timeout)
    cap = source.cap
    if len(cap) > MAX_CAP_BYTES:
        raise ValueError(f"a capability of {len(cap)} bytes is over the limit of {MAX_CAP_BYTES}")
    extra = b""
    if ranges is not None:
        if not 0 < len(ranges) <= MAX_RANGES:
            raise ValueError(f"a lease declares 1 to {MAX_RANGES} ranges, not {len(ranges)}")
        extra = RANGE_COUNT.pack(len(ranges)) + b"".join(RANGE.pack(o, n) for o, n in ranges)
    if delta is not None:
        extra = _delta_ask(*delta)
    about = _about(source, op, region)
    conn.settimeout(timeout + REPLY_SLACK)
    with _lost_on_error(about):
        flags = (Flag.PREFIX if prefix else 0) | (Flag.RANGES if ranges is not None else 0)
        deadline = time.monotonic() + timeout + REPLY_SLACK
        conn.sendall(REQUEST.pack(MAGIC, op, flags, len(name), offset, nbytes, timeout,
                                  len(cap)) + name + cap + extra)
        status, msg_len, payload_len = REPLY.unpack(recv_exact(conn, REPLY.size, deadline))
        _check_size(about, "message", msg_len, MAX_MESSAGE)
        message = recv_exact(conn, msg_len, deadline).decode(errors="replace") if msg_len else ""
    try:
        code = Status(status)
    except ValueError:
        raise TransportError(f"{about}: unknown reply status {status}") from None
    if code == Status.NO_BASE:
        raise NoBaseError(f"{about} refused: {code.name}: {message}")
    if code == Status.FORBIDDEN:
        raise ReadForbiddenError(f"{about} refused: {code.name}: {message}")
    if code != Status.OK:
        raise ReadRefusedError(f"{about} refused: {code.name}: {message}")
    return payload_len


def _delta_ask(width: int, bases: list[str]) -> bytes:
    """A ``DELTA``'s trailer: word width and base names.

    Raises:
        ValueError: a width, count or name out of range.
    """
    names = [b.encode() for b in bases]
    if width not in (1, 2, 4, 8) or not 0 < len(names) <= MAX_BASES:
        raise ValueError(f"a delta read has a word width of 1, 2, 4 or 8 bytes and 1 to "
                         f"{MAX_BASES} bases, not {width} and {len(names)}")
    if any(len(n) > MAX_NAME for n in names):
        raise ValueError(f"base name over the limit of {MAX_NAME} bytes")
    return DELTA_ASK.pack(width, len(names)) + b"".join(BASE_NAME.pack(len(n)) + n
                                                       for n in names)


def _checked_name(region: str, offset: int, nbytes: int, timeout: float) -> bytes:
    """`region` encoded for a request, once the request's fields are in range.

    Raises:
        ValueError: one is not (the message says which).
    """
    name = region.encode()
    if len(name) > MAX_NAME:
        raise ValueError(f"region name of {len(name)} bytes is over the limit of {MAX_NAME}")
    for field, value in (("offset", offset), ("nbytes", nbytes)):
        if not (isinstance(value, Integral) and 0 <= value < 2**64):
            raise ValueError(f"{field} must be an integer in [0, 2**64), got {value!r}")
    if not 0 <= timeout <= MAX_TIMEOUT:  # NaN is not either
        raise ValueError(f"timeout must be in [0, {MAX_TIMEOUT:g}] seconds, got {timeout!r}")
    return name


def _about(source: SourceAddress, op: Op, region: str) -> str:
    """Names a request in error messages."""
    return f"{op.name} of {region!r} at source {source.host}:{source.port}"


@contextmanager
def _lost_on_error(about: str) -> Iterator[None]:
    """Turns a failed or timed-out socket call into `SourceLostError`."""
    start = time.monotonic()
    try:
        yield
    except OSError as exc:
        raise SourceLostError(f"{about} failed after {time.monotonic() - start:.1f} s: "
                              f"{exc}") from exc


def _check_size(about: str, what: str, nbytes: int, limit: int) -> None:
    if nbytes > limit:
        raise TransportError(f"{about}: the reply's {what} of {nbytes} bytes is over the "
                             f"limit of {limit}")


def receive_into(conn: socket.socket, source: SourceAddress, op: Op, region: str,
                 view: memoryview, landing: Landing | None = None) -> None:
    """Fill `view` with the reply's payload, within ``REPLY_SLACK + len(view) / MIN_RATE``.

    With `landing`, the payload is received a `Landing.step` at a time and each piece is
    told to it as it lands (its bytes are final: the server sends only present chunks).

    Raises:
        SourceLostError: the source closed the connection, failed or was too slow.
    """
    about = _about(source, op, region)
    deadline = time.monotonic() + REPLY_SLACK + len(view) / MIN_RATE
    with _lost_on_error(about):
        if landing is None:
            recv_into_exact(conn, view, deadline)
            return
        for lo, hi in landing.pieces(len(view)):
            recv_into_exact(conn, view[lo:hi], deadline)
            landing.call(hi)


def receive_payload(conn: socket.socket, source: SourceAddress, op: Op, region: str,
                    nbytes: int) -> bytes:
    """The reply's payload of `nbytes` (at most the op's `MAX_PAYLOAD`), as `receive_into`.

    Raises:
        TransportError: `nbytes` is over the limit (nothing is received).
    """
    _check_size(_about(source, op, region), "payload", nbytes, MAX_PAYLOAD[op])
    buf = bytearray(nbytes)
    receive_into(conn, source, op, region, memoryview(buf))
    return bytes(buf)


def _receive_map(conn: socket.socket, source: SourceAddress, op: Op, region: str, nbytes: int,
                 fields: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The `fields` of the reply's payload, a msgpack map, type-checked.

    The `fields` of the reply's payload, a msgpack map of `nbytes`, each of its type (a
    field that may be None may be missing); as `receive_payload`.

    Raises:
        TransportError: the payload is not such a map.
    """
    def malformed(why: str) -> TransportError:
        return TransportError(f"{_about(source, op, region)}: malformed reply: {why}")

    try:
        data = msgpack.unpackb(receive_payload(conn, source, op, region, nbytes))
    except (ValueError, msgpack.UnpackException) as exc:
        raise malformed(f"not msgpack: {exc!r}") from None
    if not isinstance(data, dict):
        raise malformed(f"{type(data).__name__}, not a map")
    wrong = [key for key, kind in fields.items() if not isinstance(data.get(key), kind)]
    if wrong:
        raise malformed(f"missing or mistyped {', '.join(wrong)}")
    return {key: data.get(key) for key in fields}


_FieldTypes = Mapping[str, type | tuple[type, ...]]
_OPTIONAL_PATH = (str, type(None))
_OPTIONAL_GPU = (dict, type(None))
_LEASE_FIELDS: _FieldTypes = {"nbytes": int, "shm_path": _OPTIONAL_PATH, "gpu": _OPTIONAL_GPU,
                              "nixl": _OPTIONAL_GPU}
_DESCRIBE_FIELDS: _FieldTypes = {"nbytes": int, "chunk_size": int, "num_chunks": int,
                                  "present": int, "shm_path": _OPTIONAL_PATH,
                                  "gpu": _OPTIONAL_GPU}


@dataclass(frozen=True)
class Lease:
    """Where a leased region's bytes can be copied from, and how many.

    Where a leased region's bytes can be copied from by the reader itself, and how many
    bytes from the requested offset the lease covers.
    """

    shm_path: str | None
    gpu: dict[str, Any] | None
    nbytes: int
    nixl: dict[str, Any] | None = None
    """The region's NIXL descriptor (`fabric.transports.nixl`), when its holder has one."""


def lease(conn: socket.socket, source: SourceAddress, region: str, *, offset: int, nbytes: int,
          timeout: float, prefix: bool = False,
          ranges: list[tuple[int, int]] | None = None) -> Lease:
    """LEASE: wait until the bytes are present and hold them as a read in flight.

    LEASE: wait until the bytes are present (with ``prefix``: the first chunk, and the lease
    covers the present prefix) and hold them as a read in flight until ``END``; returns
    where the reader may copy them from.

    Raises:
        ValueError, SourceLostError, ReadRefusedError: as `request`.
        TransportError: the reply is malformed, or the grant is empty or longer than
            asked for.
    """
    n = request(conn, source, Op.LEASE, region, offset=offset, nbytes=nbytes, timeout=timeout,
                prefix=prefix, ranges=ranges)
    where = _receive_map(conn, source, Op.LEASE, region, n, _LEASE_FIELDS)
    granted = check_grant(where["nbytes"], nbytes, prefix)
    return Lease(shm_path=where["shm_path"] or None, gpu=where["gpu"], nbytes=granted,
                 nixl=where["nixl"])


@contextmanager
def under_lease(conn: socket.socket, source: SourceAddress, region: str, *, offset: int,
                nbytes: int, timeout: float, prefix: bool = False,
                ranges: list[tuple[int, int]] | None = None) -> Iterator[Lease]:
    """`lease`, then ``END`` when the block ends.

    The block's bytes are whole only if the block returns: an ``END`` that is not
    acknowledged (the holder dropped the lease, e.g. after `server.LEASE_HOLD`, and may have
    reused the memory) raises `SourceLostError`; when the block raises, its error is kept.

    Raises:
        as `lease`; SourceLostError: the lease was not held to the end.
    """
    granted = lease(conn, source, region, offset=offset, nbytes=nbytes, timeout=timeout,
                    prefix=prefix, ranges=ranges)
    try:
        yield granted
    except BaseException:
        with contextlib.suppress(TransportError):
            request(conn, source, Op.END, region, timeout=timeout)
        raise
    request(conn, source, Op.END, region, timeout=timeout)


_HOLD_FIELDS: _FieldTypes = {**_LEASE_FIELDS, "complete": bool, "hold": (int, float)}


@dataclass(frozen=True)
class HoldGrant(Lease):
    """A ``HOLD``'s answer: a `Lease` of a whole span, present or not.

    ``complete``: every chunk of the region was present when it was granted (reads
    need no ``WAIT``); ``hold``: seconds the holder keeps it without a request.
    """

    complete: bool = False
    hold: float = 0.0


def hold(conn: socket.socket, source: SourceAddress, region: str, *, offset: int, nbytes: int,
         timeout: float) -> HoldGrant:
    """HOLD: lease ``[offset, offset + nbytes)`` of `region` for a whole fetch (`Op.HOLD`).

    Raises:
        ValueError, SourceLostError, ReadRefusedError: as `request`.
        TransportError: the reply is malformed or grants another span.
    """
    n = request(conn, source, Op.HOLD, region, offset=offset, nbytes=nbytes, timeout=timeout)
    where = _receive_map(conn, source, Op.HOLD, region, n, _HOLD_FIELDS)
    if where["nbytes"] != nbytes or not 0 < where["hold"] <= MAX_TIMEOUT:
        raise TransportError(f"{_about(source, Op.HOLD, region)}: granted {where['nbytes']} "
                             f"bytes for {where['hold']} s, asked for {nbytes}")
    return HoldGrant(shm_path=where["shm_path"] or None, gpu=where["gpu"], nbytes=nbytes,
                     nixl=where["nixl"], complete=where["complete"], hold=float(where["hold"]))


def wait_present(conn: socket.socket, source: SourceAddress, region: str, *, offset: int,
                 nbytes: int, timeout: float, prefix: bool) -> int:
    """WAIT under a HOLD: the bytes present from `offset` once there (see `lease`'s prefix).

    Raises:
        as `request`; TransportError: a grant that is empty or longer than asked for.
    """
    n = request(conn, source, Op.WAIT, region, offset=offset, nbytes=nbytes, timeout=timeout,
                prefix=prefix)
    got = _receive_map(conn, source, Op.WAIT, region, n, {"nbytes": int})["nbytes"]
    return check_grant(got, nbytes, prefix)


def end(conn: socket.socket, source: SourceAddress, region: str, *, copied: int = 0,
        timeout: float) -> None:
    """END the connection's lease; ``copied``: the bytes copied under a HOLD.

    Raises:
        SourceLostError: the lease was not held to the end (no acknowledgement).
    """
    request(conn, source, Op.END, region, nbytes=copied, timeout=timeout)


def pin(source: SourceAddress, region: str, *, timeout: float) -> socket.socket:
    """PIN `region` at `source` on a new connection; returns it.

    PIN `region` at `source` on a new connection, which keeps the region's memory referenced
    by the holder until it is closed (see `Op.PIN`); returns it.

    Raises:
        SourceLostError: the source is unreachable or did not answer in time.
        ReadRefusedError: the region is not exposed there.
    """
    conn = _connect((source.host, source.port), None, tls=source.tls)
    try:
        request(conn, source, Op.PIN, region, timeout=timeout)
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return conn


def check_grant(granted: int, asked: int, prefix: bool) -> int:
    """``granted``, if a server may answer a request for ``asked`` bytes with it."""
    if granted > asked or granted <= 0 or (not prefix and granted != asked):
        raise TransportError(f"source granted {granted} bytes for a read of {asked}")
    return granted


def describe(pool: ConnectionPool, source: SourceAddress, region: str, timeout: float) -> RegionInfo:
    """DESCRIBE: what the holder says about `region`."""
    with pool.connection(source) as conn:
        n = request(conn, source, Op.DESCRIBE, region, timeout=timeout)
        return RegionInfo(**_receive_map(conn, source, Op.DESCRIBE, region, n, _DESCRIBE_FIELDS))


def bitmap(pool: ConnectionPool, source: SourceAddress, region: str, timeout: float) -> bytes:
    """BITMAP: the holder's chunk bitmap of `region`, one byte per chunk."""
    with pool.connection(source) as conn:
        n = request(conn, source, Op.BITMAP, region, timeout=timeout)
        return receive_payload(conn, source, Op.BITMAP, region, n)


@dataclass(frozen=True)
class DeltaReply:
    """A holder's answer to a delta read: the base it used and one blob per chunk."""

    base: str
    blobs: list[memoryview]
    wire_bytes: int

    @classmethod
    def parse(cls, payload: bytearray, bases: list[str], most: int, region: str) -> DeltaReply:
        """Split a ``DELTA`` payload; `TransportError` if it is malformed."""
        def bad(why: str) -> TransportError:
            return TransportError(f"DELTA of {region!r}: malformed reply: {why}")

        if len(payload) < DELTA_HEAD.size:
            raise bad("shorter than its header")
        index, count = DELTA_HEAD.unpack_from(payload)
        if index >= len(bases) or not 0 < count <= most:
            raise bad(f"base {index} of {len(bases)}, {count} chunks of at most {most}")
        at = DELTA_HEAD.size + count * BLOB_LEN.size
        if len(payload) < at:
            raise bad("shorter than its blob lengths")
        view = memoryview(payload)
        blobs = []
        for i in range(count):
            (length,) = BLOB_LEN.unpack_from(payload, DELTA_HEAD.size + i * BLOB_LEN.size)
            blobs.append(view[at:at + length])
            at += length
        if at != len(payload):
            raise bad(f"blob lengths add up to {at} bytes, the payload has {len(payload)}")
        return cls(bases[index], blobs, len(payload))


class ServerTransport(Transport):
    """Base of the transports whose sources run a `ReadServer`.

    It holds the pooled connections and answers `describe` and `progress` through them.
    Subclasses implement `read` (and extend `close` when they hold more); every one can
    ask for deltas (`read_delta`, over the read server's connection).
    """

    def __init__(self) -> None:
        self._pool = ConnectionPool()

    def describe(self, source: SourceAddress, region: str, *, timeout: float) -> RegionInfo:
        """What the holder says about `region` (DESCRIBE)."""
        return describe(self._pool, source, region, timeout)

    def progress(self, source: SourceAddress, region: str, *, timeout: float) -> bytes:
        """The holder's chunk bitmap of `region` (BITMAP)."""
        return bitmap(self._pool, source, region, timeout)

    def read_delta(self, source: SourceAddress, region: str, offset: int, nbytes: int, *,
                   chunk_size: int, width: int, bases: list[str], timeout: float,
                   prefix: bool = False, abort: ReadAbort | None = None) -> DeltaReply:
        """The chunks of ``[offset, offset + nbytes)`` encoded against one of ``bases``.

        ``offset`` is a chunk boundary; the span's chunks (with `prefix`, the run the
        holder has from the first) come back as one blob each (`kernels.delta`).

        Raises:
            NoBaseError: the holder holds none of ``bases`` whole.
            SourceLostError, ReadRefusedError: as `read`.
            TransportError: the reply is malformed (not whole chunks, sizes that do not add up).
        """
        chunks = -(-nbytes // chunk_size)
        with self._pool.connection(source, abort) as conn:
            n = request(conn, source, Op.DELTA, region, offset=offset, nbytes=nbytes,
                               timeout=timeout, prefix=prefix, delta=(width, bases))
            # no blob is larger than its chunk whole, plus a header
            if n > DELTA_HEAD.size + chunks * (BLOB_LEN.size + 64) + nbytes:
                raise TransportError(f"DELTA of {region!r}: a reply of {n} bytes for "
                                     f"{nbytes} bytes of chunks")
            payload = bytearray(n)
            receive_into(conn, source, Op.DELTA, region, memoryview(payload))
        return DeltaReply.parse(payload, bases, chunks, region)

    def close(self) -> None:
        """Close the pooled connections."""
        self._pool.close()
