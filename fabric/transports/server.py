"""`ReadServer`: the holder side of every transport.

One per worker. It serves reads of the regions the worker exposes over TCP (one
thread per connection; CPU payloads sent straight from the region's memory, GPU
regions copied to the host first) and grants leases to readers that copy the
bytes themselves: from the holder's `/dev/shm` file, or from its GPU memory
through the ``gpu`` descriptor (a CUDA IPC handle, an NVSHMEM PE and region). It
counts the bytes it serves, which is the worker's egress. Given a `CapabilityCheck`
(a worker's always is, unless it joined ``insecure``), it serves only requests that
carry a capability the hub minted for this holder (`fabric.auth`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from weightfabric.fabric.auth import MAX_CAP_BYTES, CapabilityCheck
from weightfabric.fabric.errors import TransportError
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports.base import SourceAddress, local_host_id
from weightfabric.fabric.transports.client import MIN_RATE
from weightfabric.fabric.transports.delta_cache import DEFAULT_CACHE_BYTES, DeltaCache, encode_chunk
from weightfabric.fabric.transports.nixl import NixlEngine
from weightfabric.fabric.transports.tls import HANDSHAKE_S, TlsConfig
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
)

log = logging.getLogger(__name__)

UNPIN_WAIT = 5.0  # how long `close` waits for readers to unmap pinned regions
STALL_TIMEOUT = 10.0
"""Seconds without a new chunk after which a partial region calls itself stalled."""
IDLE_TIMEOUT = 120.0
"""Seconds a connection may wait between requests before the server closes it
(readers' pools drop connections idle far sooner, `client.POOL_IDLE_S`)."""
LEASE_HOLD = 30.0
"""Seconds a reader may hold a lease before sending END (a HOLD: without sending any
request); then the connection is cut and the lease ends (the reader's END then fails,
so it discards what it copied)."""
MAX_CONNECTIONS = 4096
"""Connections served at once. A new one past that closes the connection idle longest
(waiting for a request for `MIN_IDLE_TO_CLOSE` s or more, no lease held); with none
idle it is answered BAD_REQUEST."""
MIN_IDLE_TO_CLOSE = 2.0
"""Readers reuse a pooled connection only within `client.POOL_IDLE_S` (0.5 s) of its
last reply, so one idle this long gets no more requests: closing it races none."""
SEND_GRACE, MIN_SEND_RATE = 30.0, MIN_RATE  # the reader cuts first (client.MIN_RATE)
"""A reply must be taken by the reader within SEND_GRACE s + its bytes / MIN_SEND_RATE
(bytes/s), else the connection is cut: a reader that stops reading cannot keep a
region in flight."""
ACCEPT_RETRY_S = 0.05  # after a failed accept (out of file descriptors, say)
_LEASES = (Op.LEASE, Op.HOLD)
MAX_LEASES_PER_READER = 64
"""Leases one reader (as its capabilities name it) may hold here at once; a connection
holds one at most."""


@dataclass(eq=False)
class Exposure:
    """One exposure of a region, as `ReadServer.expose` returns it (`retract` takes it)."""

    name: str
    tensor: torch.Tensor
    data: memoryview | None  # the CPU bytes (None for GPU memory)
    chunk_size: int
    progress: ChunkProgress
    shm_path: str | None
    gpu: dict[str, Any] | None
    nixl: dict[str, Any] | None = None  # its NIXL descriptor, when the server has an engine
    inflight: int = 0
    retracting: bool = False
    first_served: float | None = None  # wall clock of the first bytes granted to a reader
    drained: threading.Condition = field(default_factory=threading.Condition)


class ReadServer:
    """Serves one-sided reads of exposed regions.

    Every wait on a peer is bounded, so a peer that misbehaves (connects and
    never asks, stops reading a reply, holds a lease) costs a thread for a while,
    never the server: see `IDLE_TIMEOUT`, `LEASE_HOLD`, `SEND_GRACE`,
    `MAX_CONNECTIONS`. Out of connections or file descriptors, it closes the
    connection idle longest to make room.

    Args:
        host: address to listen on (loopback by default).
        port: TCP port; 0 lets the OS choose (see `address`).
        stall_timeout: a read waiting for chunks of a partial region is answered
            ``NOT_READY`` early, as stalled, once no chunk of the region has arrived
            for this many seconds: the fetch filling it is stuck, and the reader
            does better elsewhere than waiting out its own timeout.
        idle_timeout: seconds a connection may wait between requests.
        max_connections: connections served at once (see `MAX_CONNECTIONS`).
        capabilities: checks the capability every request carries (refused without a
            valid one, before any work); None serves anyone (a worker joined insecure,
            and tests of the transports themselves).
        max_leases_per_reader: leases one reader may hold at once (`MAX_LEASES_PER_READER`).
        tls: serve over mutual TLS only (`fabric.transports.tls`; the address says so).
        delta_cache_bytes: bytes of encoded delta chunks kept for readers that ask for the
            same ones (`DeltaCache`).
        nixl: the worker's NIXL engine: regions are registered with it when exposed, and
            leases name their NIXL descriptor (`fabric.transports.nixl`); None: no NIXL.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 stall_timeout: float = STALL_TIMEOUT, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS,
                 capabilities: CapabilityCheck | None = None,
                 max_leases_per_reader: int = MAX_LEASES_PER_READER,
                 tls: TlsConfig | None = None,
                 delta_cache_bytes: int = DEFAULT_CACHE_BYTES,
                 nixl: NixlEngine | None = None) -> None:
        if not stall_timeout > 0 or not idle_timeout > 0:
            raise ValueError(f"stall_timeout and idle_timeout must be positive, got "
                             f"{stall_timeout} and {idle_timeout}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.stall_timeout, self.idle_timeout = stall_timeout, idle_timeout
        self.max_connections = max_connections
        self.capabilities = capabilities
        self.max_leases_per_reader = max_leases_per_reader
        self._leases: dict[str, int] = {}  # reader -> leases it holds here
        self.num_forbidden = 0
        self.num_stalled = 0
        """Reads answered early because this partial replica's own fetch stalled."""
        self._tls = tls.server_context() if tls is not None else None
        self._listener = socket.create_server((host, port), backlog=128)
        self.address = SourceAddress(host=host, port=self._listener.getsockname()[1],
                                     host_id=local_host_id(), tls=tls is not None,
                                     nixl=nixl.name if nixl is not None else "")
        self._regions: dict[str, Exposure] = {}
        self._superseded: list[Exposure] = []  # retracting, replaced under their name, still read
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._idle: dict[socket.socket, float] = {}  # waiting for a request since, oldest first
        self._pins: dict[socket.socket, list[Exposure]] = {}  # pin connection -> what it keeps
        self._unpinned = threading.Condition(self._lock)
        self._notice_lock = threading.Lock()  # one writer on pin connections at a time
        self._told: set[socket.socket] = set()  # pin connections sent their one notice
        self.bytes_served = 0
        """Bytes sent to readers (deltas as encoded): the worker's egress."""
        self.bytes_delivered = 0
        """What those bytes stand for once decoded (a delta counts as the chunks it encodes)."""
        self.deltas = DeltaCache(delta_cache_bytes)
        self.nixl = nixl
        self._thread = threading.Thread(target=self._accept_loop, name="wf-read-server",
                                        daemon=True)
        self._thread.start()

    # --- holder API -------------------------------------------------------------------

    def expose(self, name: str, tensor: torch.Tensor, *, chunk_size: int,
               progress: ChunkProgress | None = None, shm_path: str | None = None,
               gpu: dict[str, Any] | None = None) -> Exposure:
        """Serve `tensor` (flat contiguous ``uint8``, CPU or CUDA) as region `name`.

        Without `progress` the region is complete. `shm_path` lets same-host readers
        map a CPU region instead of reading over TCP; `gpu` (msgpack-able, e.g.
        ``IpcHandle.to_dict()``) tells readers how to reach a GPU region without the
        server. Any region can also be read over TCP. A name whose last exposure is
        being retracted (reads of it still in flight) can be exposed again: new reads
        go to the new exposure, and retracting the old `Exposure` still waits for its
        reads.

        Returns:
            the exposure, for `retract` (which also takes the name).

        Raises:
            ValueError: bad tensor, chunk size or progress, or `name` already exposed.
        """
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"region {name!r}: expected a flat contiguous uint8 tensor")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"region {name!r}: tensors on {tensor.device} cannot be served")
        if chunk_size <= 0:
            raise ValueError(f"region {name!r}: chunk_size must be positive, got {chunk_size}")
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"region name longer than {MAX_NAME} bytes")
        num_chunks = -(-tensor.numel() // chunk_size)
        if progress is None:
            progress = ChunkProgress(num_chunks, complete=True)
        elif progress.num_chunks != num_chunks:
            raise ValueError(f"region {name!r}: progress has {progress.num_chunks} chunks, "
                             f"the region {num_chunks}")
        if gpu is not None:
            msgpack.packb(gpu)  # fail here, not in a reader's DESCRIBE
        data: memoryview | None = None
        if tensor.device.type == "cpu":
            # numpy's stubs declare ndarray.__buffer__ only for Python 3.12+.
            data = memoryview(tensor.numpy())  # type: ignore[arg-type]
        exposure = Exposure(name, tensor, data, chunk_size, progress, shm_path,
                            dict(gpu) if gpu is not None else None,
                            self._nixl_descriptor(name, tensor))
        with self._lock:
            old = self._regions.get(name)
            if old is not None and not old.retracting:
                raise ValueError(f"region {name!r} is already exposed; retract it first")
            if old is not None:
                self._superseded.append(old)
            self._superseded = [e for e in self._superseded if e.inflight]
            self._regions[name] = exposure
        return exposure

    def _nixl_descriptor(self, name: str, tensor: torch.Tensor) -> dict[str, Any] | None:
        """``tensor`` registered with the NIXL engine (once per buffer); None without one.

        A registration that fails leaves the region to the other transports (logged).
        """
        if self.nixl is None:
            return None
        try:
            return self.nixl.register(tensor)
        except TransportError as exc:
            log.warning("region %r is not readable over NIXL: %s", name, exc)
            return None

    def retract(self, which: str | Exposure, *, timeout: float = 30.0) -> bool:
        """Stop serving `which`; wait up to `timeout` s for its reads in flight.

        Stop serving `which` (a name: its current exposure; or an `Exposure`, one exposed
        again since included); wait up to `timeout` s for its reads in flight.

        New reads are refused at once, reads waiting for chunks of it are answered
        `NOT_FOUND` at once, and readers that pinned it are told to unmap it. Returns
        True when no read was left in flight (the memory may be reused; readers'
        pins may still keep it allocated for a moment), False if the wait timed out.
        """
        with self._lock:
            region = self._regions.get(which) if isinstance(which, str) else which
            if region is None:
                return True
            region.retracting = True
        region.progress.wake()
        self._notify_pins(lambda pinned: region in pinned)
        with region.drained:
            done = region.drained.wait_for(lambda: region.inflight == 0, timeout)
        if done:
            with self._lock:
                if self._regions.get(region.name) is region:
                    del self._regions[region.name]
                self._superseded = [e for e in self._superseded if e is not region]
        self.deltas.drop(region.name)
        return done

    def first_served(self, name: str) -> float | None:
        """When (wall clock) region `name` first had bytes granted to a reader.

        For a relay: when it forwarded its first chunk of the replica it was filling. None
        if never, or if the region is not exposed.
        """
        with self._lock:
            region = self._regions.get(name)
        return None if region is None else region.first_served

    def regions(self) -> list[str]:
        """Names of the regions being served (not those retracting)."""
        with self._lock:
            return [n for n, r in self._regions.items() if not r.retracting]

    def close(self) -> None:
        """Stop accepting, unpin readers (waiting a while), then drop every connection.

        Stop accepting, tell readers with pins to unmap and wait for them up to `UNPIN_WAIT`
        s, then drop every connection.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._notify_pins(lambda pinned: True)
        with self._lock:
            if not self._unpinned.wait_for(lambda: not self._pins, UNPIN_WAIT):
                log.warning("%d reader(s) did not unmap pinned regions within %g s; closing "
                            "their connections", len(self._pins), UNPIN_WAIT)
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> ReadServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- serving ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept until `close`.

        A failed accept (no file descriptor left, say) is retried: only `close` ends the
        loop.
        """
        warned = False
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._close_longest_idle()  # its descriptor is free once its thread ends
                if not warned:
                    log.warning("read server %s: accept failed (%s); retrying", self.address, exc)
                warned = True
                time.sleep(ACCEPT_RETRY_S)
                continue
            warned = False
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own, or refuse it when full.

        Serve ``conn`` on a thread of its own, or refuse it when the server is full and no
        connection is idle.
        """
        full = len(self._connections) >= self.max_connections and not self._close_longest_idle()
        if self._tls is not None:
            if full:  # no thread to shake hands on: the reader sees the connection close
                conn.close()
                return
            try:   # the handshake itself happens on the connection's thread (`_serve`)
                conn = self._tls.wrap_socket(conn, server_side=True,
                                             do_handshake_on_connect=False)
            except OSError:
                conn.close()
                return
        if not full:
            with self._lock:
                self._connections.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if full:
                conn.settimeout(1.0)
                self._reply(conn, Status.BAD_REQUEST, f"the holder serves {self.max_connections} "
                            "connections already, none of them idle; try another source or "
                            "later")
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), name="wf-read-conn",
                             daemon=True).start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            log.warning("read server %s: dropped a connection: %s", self.address, exc)
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _close_longest_idle(self) -> bool:
        """Make room: end the connection that has waited longest for a request.

        Make room: end the connection that has waited longest for a request, if it has
        waited `MIN_IDLE_TO_CLOSE` s (its reader no longer reuses it); False if none has.
        """
        with self._lock:
            conn = next(iter(self._idle), None)
            if conn is None or time.monotonic() - self._idle[conn] < MIN_IDLE_TO_CLOSE:
                return False
            del self._idle[conn]
            self._connections.discard(conn)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
        return True

    def _next_request(self, conn: socket.socket, lease: Exposure | None) -> bytes:
        """The next request header; while no lease is held, the wait is idle time."""
        conn.settimeout(LEASE_HOLD if lease is not None else self.idle_timeout)
        if lease is not None:
            return recv_exact(conn, REQUEST.size)
        with self._lock:
            self._idle[conn] = time.monotonic()
        try:
            return recv_exact(conn, REQUEST.size)
        finally:
            with self._lock:
                self._idle.pop(conn, None)

    def _serve(self, conn: socket.socket) -> None:
        lease: Exposure | None = None
        held: tuple[int, int] | None = None  # the span of a HOLD's lease, else None
        reader = ""  # who holds ``lease``
        try:
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(HANDSHAKE_S)
                conn.do_handshake()   # a failure (ssl.SSLError) is an OSError: dropped
            while True:
                magic, op, flags, name_len, offset, nbytes, timeout, cap_len = REQUEST.unpack(
                    self._next_request(conn, lease))
                if magic != MAGIC or name_len > MAX_NAME or cap_len > MAX_CAP_BYTES:
                    self._reply(conn, Status.BAD_REQUEST, _bad_header(magic, name_len, cap_len))
                    return
                name = recv_exact(conn, name_len).decode(errors="replace")
                cap = recv_exact(conn, cap_len)
                ranges: list[tuple[int, int]] | None = None
                delta: tuple[int, list[str]] | None = None
                if op == Op.DELTA:
                    asked = _read_delta_ask(conn)
                    if isinstance(asked, str):
                        self._reply(conn, Status.BAD_REQUEST, asked)
                        return
                    delta = asked
                if flags & Flag.RANGES:
                    declared = _read_ranges(conn, op, flags, offset, nbytes)
                    if isinstance(declared, str):
                        self._reply(conn, Status.BAD_REQUEST, declared)
                        return
                    ranges = declared
                if op == Op.END:
                    if lease is None:
                        self._reply(conn, Status.BAD_REQUEST, "END without a lease")
                        return
                    if held is not None:  # the bytes the reader copied under it
                        self._count(min(nbytes, held[1] - held[0]))
                    self._end_lease(lease, reader)
                    lease, held = None, None
                    self._reply(conn, Status.OK)  # the lease held until now
                    continue
                if op == Op.WAIT:
                    if lease is None or held is None or name != lease.name:
                        self._reply(conn, Status.BAD_REQUEST, "WAIT outside a HOLD of "
                                    f"region {name!r} on this connection")
                        return
                    self._wait_held(conn, lease, held, offset, nbytes, timeout,
                                    prefix=bool(flags & Flag.PREFIX))
                    continue
                if lease is not None:  # a reader that moved on without END
                    self._end_lease(lease, reader)
                    lease, held = None, None
                who = self._admitted(conn, op, name, cap)
                if who is None:
                    return
                if op == Op.PIN:
                    self._pin(conn, name)
                    return
                if not math.isfinite(timeout) or timeout < 0:
                    self._reply(conn, Status.BAD_REQUEST, f"timeout {timeout} is not a "
                                "finite number of seconds >= 0")
                    return
                try:
                    lease = self._handle(conn, op, name, offset, nbytes, timeout,
                                         prefix=bool(flags & Flag.PREFIX), ranges=ranges,
                                         delta=delta)
                finally:
                    if op in _LEASES and lease is None:  # not granted: its count goes back
                        self._release_lease_count(who)
                reader = who
                held = (offset, offset + nbytes) if lease is not None and op == Op.HOLD else None
        except (ConnectionError, OSError):
            pass
        finally:
            if lease is not None:
                self._end_lease(lease, reader)
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _admitted(self, conn: socket.socket, op: int, name: str, cap: bytes) -> str | None:
        """The reader a request's capability names ("" unchecked); None once refused.

        A LEASE is refused too when its reader holds `max_leases_per_reader` already; the
        count is taken here, and given back by `_end_lease` (or at once if no lease follows).
        """
        if self.capabilities is None:
            who = ""
        else:
            try:
                who = self.capabilities.reader(cap, name)
            except PermissionError as exc:
                with self._lock:
                    self.num_forbidden += 1
                self._reply(conn, Status.FORBIDDEN, f"{name!r}: {exc}")
                return None
        if op in _LEASES:
            with self._lock:
                held = self._leases.get(who, 0)
                if held >= self.max_leases_per_reader:
                    self.num_forbidden += 1
                    full = True
                else:
                    self._leases[who] = held + 1
                    full = False
            if full:
                self._reply(conn, Status.FORBIDDEN, f"reader {who!r} holds {held} leases here "
                            "already, the most one reader may")
                return None
        return who

    def _end_lease(self, region: Exposure, reader: str) -> None:
        self._end(region)
        self._release_lease_count(reader)

    def _release_lease_count(self, reader: str) -> None:
        with self._lock:
            left = self._leases.get(reader, 0) - 1
            if left > 0:
                self._leases[reader] = left
            else:
                self._leases.pop(reader, None)

    def _handle(self, conn: socket.socket, op: int, name: str, offset: int, nbytes: int,
                timeout: float, *, prefix: bool = False,
                ranges: list[tuple[int, int]] | None = None,
                delta: tuple[int, list[str]] | None = None) -> Exposure | None:
        """Answer one request; return the region when a lease (LEASE, HOLD) was granted.

        ``ranges`` (a ``LEASE`` with `Flag.RANGES`, checked inside the span): the bytes
        counted as served instead of the whole span. ``delta`` (a ``DELTA``): the word
        width and the reader's bases.
        """
        region = self._begin(name)
        if region is None:
            self._reply(conn, Status.NOT_FOUND, f"no region {name!r} is exposed here "
                                                "(never exposed, or retracted)")
            return None
        keep = False
        try:
            size = region.tensor.numel()
            if op == Op.DESCRIBE:
                info = {"nbytes": size, "chunk_size": region.chunk_size,
                        "num_chunks": region.progress.num_chunks,
                        "present": region.progress.count, "shm_path": region.shm_path,
                        "gpu": region.gpu}
                self._reply(conn, Status.OK, payload=msgpack.packb(info))
            elif op == Op.BITMAP:
                self._reply(conn, Status.OK, payload=region.progress.bitmap())
            elif op == Op.HOLD:
                if not self._in_range(conn, region, offset, nbytes):
                    return None
                where = {"shm_path": region.shm_path, "gpu": region.gpu, "nbytes": nbytes,
                         "nixl": region.nixl, "complete": region.progress.complete,
                         "hold": LEASE_HOLD}
                self._reply(conn, Status.OK, payload=msgpack.packb(where))
                region.first_served = region.first_served or time.time()
                keep = True
                return region
            elif op in (Op.READ, Op.LEASE, Op.DELTA):
                if not self._in_range(conn, region, offset, nbytes):
                    return None
                if op == Op.DELTA and offset % region.chunk_size:
                    self._reply(conn, Status.BAD_REQUEST, f"a delta read starts at a chunk "
                                f"boundary, not at byte {offset}")
                    return None
                granted = self._await_chunks(conn, region, offset, nbytes, timeout, prefix)
                if granted is None:
                    return None
                nbytes = granted
                region.first_served = region.first_served or time.time()
                if op == Op.DELTA:
                    assert delta is not None
                    self._send_delta(conn, region, offset, nbytes, *delta)
                    return None
                self._count(nbytes if ranges is None else sum(n for _, n in ranges))
                if op == Op.LEASE:
                    where = {"shm_path": region.shm_path, "gpu": region.gpu, "nbytes": nbytes,
                             "nixl": region.nixl}
                    self._reply(conn, Status.OK, payload=msgpack.packb(where))
                    keep = True
                    return region
                self._reply(conn, Status.OK, payload=_host_bytes(region, offset, nbytes))
            else:
                self._reply(conn, Status.BAD_REQUEST, f"unknown op {op}")
            return None
        finally:
            if not keep:
                self._end(region)

    def _in_range(self, conn: socket.socket, region: Exposure, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` is a non-empty span of ``region``.

        Answers ``OUT_OF_RANGE`` when it is not.
        """
        size = region.tensor.numel()
        if offset + nbytes > size or nbytes <= 0:
            self._reply(conn, Status.OUT_OF_RANGE, f"read [{offset}, {offset + nbytes}) of "
                        f"region {region.name!r} ({size} bytes)")
            return False
        return True

    def _await_chunks(self, conn: socket.socket, region: Exposure, offset: int, nbytes: int,
                      timeout: float, prefix: bool) -> int | None:
        """Wait until the chunks of ``[offset, offset + nbytes)`` are present.

        With ``prefix`` only the first, and the bytes granted are the present run from
        ``offset`` (cut to the request). Returns the bytes granted, or None once it has
        answered why not (retracted meanwhile, not present in time, stalled).
        """
        chunk = region.chunk_size
        first, last = offset // chunk, (offset + nbytes - 1) // chunk
        needed = first if prefix else last
        if not region.progress.wait(first, needed, timeout, abort=lambda: region.retracting,
                                    stall=self.stall_timeout):
            if region.retracting:
                self._reply(conn, Status.NOT_FOUND, f"region {region.name!r} was retracted "
                            "while this read waited for its chunks")
                return None
            idle = region.progress.idle()
            self.num_stalled += idle >= self.stall_timeout
            why = (f"stalled, no chunk arrived here for {idle:.1f} s"
                   if idle >= self.stall_timeout else f"not present after {timeout:g} s")
            self._reply(conn, Status.NOT_READY, f"chunks {first}..{needed} of "
                        f"{region.name!r}: {why}")
            return None
        if prefix:  # the present run from `first`, cut to the request
            end = (region.progress.present_through(first, last) + 1) * chunk
            nbytes = min(offset + nbytes, end) - offset
        return nbytes

    def _wait_held(self, conn: socket.socket, region: Exposure, held: tuple[int, int],
                   offset: int, nbytes: int, timeout: float, *, prefix: bool) -> None:
        """Answer a ``WAIT`` under a ``HOLD`` of ``held`` (its span): the bytes present.

        A wait outside the span, or with a bad timeout, is answered ``OUT_OF_RANGE`` or
        ``BAD_REQUEST``; the lease holds on either way.
        """
        if not (held[0] <= offset and offset + nbytes <= held[1] and nbytes > 0):
            self._reply(conn, Status.OUT_OF_RANGE, f"wait for [{offset}, {offset + nbytes}) "
                        f"outside the held span [{held[0]}, {held[1]}) of {region.name!r}")
            return
        if not math.isfinite(timeout) or timeout < 0:
            self._reply(conn, Status.BAD_REQUEST, f"timeout {timeout} is not a finite number "
                        "of seconds >= 0")
            return
        granted = self._await_chunks(conn, region, offset, nbytes, timeout, prefix)
        if granted is not None:
            self._reply(conn, Status.OK, payload=msgpack.packb({"nbytes": granted}))

    def _count(self, nbytes: int) -> None:
        """Count ``nbytes`` read whole by a reader as served (and delivered)."""
        with self._lock:
            self.bytes_served += nbytes
            self.bytes_delivered += nbytes

    def _send_delta(self, conn: socket.socket, region: Exposure, offset: int, nbytes: int,
                    width: int, bases: list[str]) -> None:
        """Answer a ``DELTA`` for the chunks of ``[offset, offset + nbytes)`` (all present).

        Encoded against the first of ``bases`` exposed here whole, with the region's size;
        ``NO_BASE`` when none is.
        """
        found = self._base(region, bases)
        if found is None:
            self._reply(conn, Status.NO_BASE, f"none of {bases} is held here whole")
            return
        index, held = found
        try:
            chunk = region.chunk_size
            blobs = []
            for lo in range(offset, offset + nbytes, chunk):
                hi = min(lo + chunk, offset + nbytes)
                encode = functools.partial(encode_chunk, held.tensor[lo:hi],
                                           region.tensor[lo:hi], width)
                blobs.append(self.deltas.get(region.name, held.name, lo // chunk, width, encode))
        finally:
            self._end(held)
        head = DELTA_HEAD.pack(index, len(blobs)) + b"".join(BLOB_LEN.pack(len(b)) for b in blobs)
        payload = head + b"".join(blobs)
        with self._lock:
            self.bytes_served += len(payload)
            self.bytes_delivered += nbytes
        self._reply(conn, Status.OK, payload=payload)

    def _base(self, region: Exposure, bases: list[str]) -> tuple[int, Exposure] | None:
        """The first of ``bases`` exposed here whole, like ``region``: (its index, it, begun).

        Begun: it is not retracted until `_end`, so its bytes stay while they are encoded
        against.
        """
        for index, name in enumerate(bases):
            held = self._begin(name)
            if held is None:
                continue
            if (held.tensor.numel() == region.tensor.numel() and held.progress.complete
                    and held.tensor.device == region.tensor.device):
                return index, held
            self._end(held)
        return None

    def _pin(self, conn: socket.socket, name: str) -> None:
        """Keep region `name`'s memory referenced until the reader closes `conn`.

        A retracting region can still be pinned: a reader holding a lease on it may
        have mapped it; such a pin is told at once to unmap. So can a superseded
        exposure with reads in flight (the reader's lease may be one of them).
        """
        try:
            with self._notice_lock:  # the OK goes out before any notice on this connection
                with self._lock:
                    current = self._regions.get(name)
                    pinned = [e for e in [current, *self._superseded]
                              if e is not None and e.name == name and (e is current or e.inflight)]
                    if pinned:
                        self._pins[conn] = pinned
                if not pinned:
                    self._reply(conn, Status.NOT_FOUND, f"no region {name!r} to pin here")
                    return
                self._reply(conn, Status.OK)
                if any(e.retracting for e in pinned) or self._closed.is_set():
                    self._tell(conn)
            conn.settimeout(None)  # a pin lasts as long as the reader maps the region
            while conn.recv(64):  # nothing more is expected: wait for the reader to close
                pass
        except OSError:
            pass
        finally:  # also when the OK could not be sent: the pin must not outlive conn
            with self._notice_lock:
                self._told.discard(conn)
            with self._lock:
                if self._pins.pop(conn, None) is not None:
                    self._unpinned.notify_all()

    def _notify_pins(self, which: Callable[[list[Exposure]], bool]) -> None:
        """Tell the readers pinning regions `which` selects to unmap them."""
        with self._notice_lock:
            with self._lock:
                conns = [conn for conn, pinned in self._pins.items() if which(pinned)]
            for conn in conns:
                self._tell(conn)

    def _tell(self, conn: socket.socket) -> None:
        """Send `conn` its unmap notice, once (under `_notice_lock`).

        A region retracted and then its server closed, or a pin answered while `close`
        began, would otherwise tell the same reader twice.
        """
        if conn not in self._told:
            self._told.add(conn)
            _send_notice(conn)

    def _begin(self, name: str) -> Exposure | None:
        with self._lock:
            region = self._regions.get(name)
            if region is None or region.retracting:
                return None
            with region.drained:
                region.inflight += 1
            return region

    @staticmethod
    def _end(region: Exposure) -> None:
        with region.drained:
            region.inflight -= 1
            region.drained.notify_all()

    @staticmethod
    def _reply(conn: socket.socket, status: Status, message: str = "",
               payload: bytes | memoryview = b"") -> None:
        """Send a reply within a deadline that grows with its size.

        Send a reply within `SEND_GRACE` + its bytes / `MIN_SEND_RATE` seconds
        (``socket.timeout``, an OSError, past that: the caller drops the connection).
        """
        conn.settimeout(SEND_GRACE + len(payload) / MIN_SEND_RATE)
        conn.sendall(_header(status, message, len(payload)))
        if len(payload):
            conn.sendall(payload)


def _header(status: Status, message: str, payload_len: int = 0) -> bytes:
    """A reply's header and message (its payload follows)."""
    msg = message.encode()
    return REPLY.pack(status, len(msg), payload_len) + msg


def _bad_header(magic: bytes, name_len: int, cap_len: int) -> str:
    """Why a request header was refused."""
    if magic == MAGIC and name_len > MAX_NAME:
        return f"region name of {name_len} bytes (at most {MAX_NAME})"
    if magic == MAGIC:
        return f"capability of {cap_len} bytes (at most {MAX_CAP_BYTES})"
    if magic[:3] == MAGIC[:3]:
        return (f"read protocol {magic.decode(errors='replace')}, this holder speaks "
                f"{MAGIC.decode()}: run the same weightfabric version on both sides")
    return "not a weightfabric read request"


def _send_notice(conn: socket.socket) -> None:
    """The one message a pin connection carries after its OK: unmap this region.

    Never blocks (it is sent under the server's notice lock): a reader whose
    connection cannot take these few bytes at once is not reading it, and is cut off.
    """
    notice = _header(Status.NOT_FOUND, "retracted: unmap it")
    if isinstance(conn, ssl.SSLSocket):  # no non-blocking send on TLS: closing says the same
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        return
    try:
        if conn.send(notice, socket.MSG_DONTWAIT) == len(notice):
            return
    except OSError:
        pass  # a reader gone already has nothing mapped
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _host_bytes(region: Exposure, offset: int, nbytes: int) -> memoryview:
    """Bytes ``[offset, offset + nbytes)`` of a region in host memory (GPU: copied)."""
    if region.data is not None:
        return region.data[offset:offset + nbytes]
    # numpy's stubs declare ndarray.__buffer__ only for Python 3.12+.
    return memoryview(region.tensor[offset:offset + nbytes].cpu().numpy())  # type: ignore[arg-type]


def _read_delta_ask(conn: socket.socket) -> tuple[int, list[str]] | str:
    """The word width and base names a ``DELTA`` names, or why they are refused."""
    width, count = DELTA_ASK.unpack(recv_exact(conn, DELTA_ASK.size))
    if width not in (1, 2, 4, 8):
        return f"a delta's word width is 1, 2, 4 or 8 bytes, not {width}"
    if not 0 < count <= MAX_BASES:
        return f"a delta read names 1 to {MAX_BASES} bases, not {count}"
    bases = []
    for _ in range(count):
        (length,) = BASE_NAME.unpack(recv_exact(conn, BASE_NAME.size))
        if length > MAX_NAME:
            return f"a base name of {length} bytes (at most {MAX_NAME})"
        bases.append(recv_exact(conn, length).decode(errors="replace"))
    return width, bases


def _read_ranges(conn: socket.socket, op: int, flags: int, offset: int, nbytes: int
                 ) -> list[tuple[int, int]] | str:
    """The ranges a ``LEASE`` declares (`Flag.RANGES`), or why they are refused.

    Each must lie inside the request's span ``[offset, offset + nbytes)``.
    """
    (count,) = RANGE_COUNT.unpack(recv_exact(conn, RANGE_COUNT.size))
    if op != Op.LEASE or flags & Flag.PREFIX:
        return "ranges are declared only by a LEASE without PREFIX"
    if not 0 < count <= MAX_RANGES:
        return f"a lease declares 1 to {MAX_RANGES} ranges, not {count}"
    raw = recv_exact(conn, count * RANGE.size)
    ranges = [RANGE.unpack_from(raw, i * RANGE.size) for i in range(count)]
    for o, n in ranges:
        if n <= 0 or o < offset or o + n > offset + nbytes:
            return (f"range [{o}, {o + n}) is empty or outside the leased span "
                    f"[{offset}, {offset + nbytes})")
    return ranges
