"""`HeldLease`: one lease on a holder's region for all of a fetch's reads from it.

A reader on the holder's host (shared memory, CUDA IPC) used to pay a round trip
before and after every read (``LEASE``, ``END``). Under a held lease it pays one
``HOLD`` per holder and version, then copies without asking: a complete region's
bytes are all there; for a partial one (a peer still fetching) it asks ``WAIT``
only for chunks it has not seen present yet, and remembers what it learnt. At
the end one ``END`` carries the bytes it copied, which the holder counts as served.

A copy is trusted only if the lease still held when it finished. The holder ends
a held lease on its own only by cutting the connection after ``hold`` seconds
without a request (`server.LEASE_HOLD`) or when it closes; so a copy counts if it
finished within ``hold`` less `MARGIN_S` of the last reply, and the connection
shows no sign of a close (it is not readable while no request is out: the holder
sends nothing unasked). A lease about to run out is renewed by a ``WAIT`` before
the next copy. A lease that failed stays failed: the fetch takes a new one.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

from weightfabric.fabric.errors import SourceLostError, TransportError
from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import CopyFn, Landing, Pending, ReadAbort, SourceAddress

MARGIN_S = 5.0
"""Seconds before the holder's ``hold`` runs out from which a copy is no longer
trusted (more than any reply takes to cross one host); a quarter of a shorter hold."""

SourceBytes = Callable[[int, int], torch.Tensor]
"""(lo, hi) -> the holder's bytes ``[lo, hi)`` of the region, readable here."""


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class HeldLease:
    """A held lease on ``[0, nbytes)`` of one holder's region (`client.hold`).

    Made by a transport's ``hold``; thread-safe: reads of several threads copy at once,
    and their ``WAIT`` requests take turns on the lease's connection.

    Args:
        conn: the connection the lease was granted on (it carries the lease).
        release: closes the connection and what was mapped for the lease (``close``'s
            last step).
        grant: the ``HOLD`` reply.
        source, region: where the bytes are.
        source_bytes: the holder's bytes of a range, as mapped here.
        copy: how bytes are copied from the holder (default ``dst.copy_(src)``).
        granted: when the ``HOLD`` reply arrived (`time.monotonic`; default: now).
    """

    def __init__(self, conn: socket.socket, release: ExitStack, grant: client.HoldGrant,
                 source: SourceAddress, region: str, source_bytes: SourceBytes, *,
                 copy: CopyFn = _copy, granted: float | None = None) -> None:
        self.conn, self.grant, self.source, self.region = conn, grant, source, region
        self._release, self._bytes, self._default_copy = release, source_bytes, copy
        self._present: list[tuple[int, int]] = [(0, grant.nbytes)] if grant.complete else []
        self._conn_lock = threading.Lock()   # one request at a time on the connection
        self._lock = threading.Lock()        # the fields below
        self._asking = 0                     # requests out on the connection
        self._margin = min(MARGIN_S, grant.hold / 4)
        since = time.monotonic() if granted is None else granted
        self._valid_until = since + grant.hold - self._margin
        self._failed: str | None = None
        self.copied = 0
        """Bytes copied under the lease (told to the holder by `close`)."""
        self.waits = 0
        """``WAIT`` round trips taken (chunks not yet present, or renewals)."""

    @property
    def failed(self) -> bool:
        """The lease ended early (its reads fail; take another one)."""
        return self._failed is not None

    @property
    def lapsed(self) -> bool:
        """No request renewed it in time: the holder may have ended it (take another one).

        Not a failure of the holder: a fetch busy with other sources for ``hold`` seconds
        lets its lease on this one lapse.
        """
        with self._lock:
            return time.monotonic() >= self._valid_until

    def read(self, offset: int, out: torch.Tensor, *, timeout: float, prefix: bool = False,
             abort: ReadAbort | None = None, copy: CopyFn | None = None,
             landing: Landing | None = None) -> int:
        """Copy the holder's bytes at `offset` into `out` (as `Transport.read`).

        With `landing`, a `Landing.step` at a time, each piece told once the lease is
        known to have held through its copy. A `copy` that starts device work (returns a
        `Pending`) has every piece launched before the first is waited for, in order.

        Returns:
            The bytes copied: ``out.numel()`` unless `prefix` (then the present run).

        Raises:
            SourceLostError: the lease ended (the copy is not to be trusted), the holder
                is gone, or `abort` cut the wait short.
            ReadRefusedError: the holder refused a ``WAIT`` (e.g. not present in time).
        """
        nbytes = out.numel()
        if offset < 0 or offset + nbytes > self.grant.nbytes or nbytes <= 0:
            raise ValueError(f"read [{offset}, {offset + nbytes}) outside the held "
                             f"[0, {self.grant.nbytes})")
        self._check(peek=False)
        got = self._known(offset, nbytes, prefix)
        if got is None or self._renew_due():
            got = self._wait(offset, nbytes, timeout, prefix, abort)
        copy = copy or self._default_copy
        started: list[tuple[int, Pending | None]] = []  # pieces copying on a device
        try:
            for lo, hi in landing.pieces(got) if landing is not None else [(0, got)]:
                pending = copy(out[lo:hi], self._bytes(offset + lo, offset + hi))
                if pending is None and not started:
                    self._landed(hi, landing)
                else:
                    started.append((hi, pending))
            while started:
                hi, pending = started[0]
                if pending is not None:
                    pending.wait()
                del started[0]
                self._landed(hi, landing)
        finally:
            for _, pending in started:  # failed: nothing writes into `out` once this returns
                if pending is not None:
                    with contextlib.suppress(Exception):
                        pending.wait()
        with self._lock:
            self.copied += got
        return got

    def _landed(self, end: int, landing: Landing | None) -> None:
        """The bytes up to `end` are copied: trusted if the lease held (else raise), told."""
        self._check()
        if landing is not None:
            landing.call(end)

    def close(self, timeout: float = 5.0) -> bool:
        """END the lease, telling the holder the bytes copied; False if not acknowledged.

        The copies were checked as they finished, so an END that fails costs nothing
        already marked; the connection and the mapping are released either way.
        """
        try:
            if self._failed is not None:
                return False
            with self._conn_lock:
                client.end(self.conn, self.source, self.region, copied=self.copied,
                           timeout=timeout)
            return True
        except (TransportError, ValueError):
            return False
        finally:
            self._failed = self._failed or "closed"
            self._release.close()

    def fail(self, why: str) -> None:
        """End the lease here (its connection is shut down; the holder ends it too)."""
        with self._lock:
            self._failed = self._failed or why
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)

    # --- the parts --------------------------------------------------------------------------

    def _known(self, offset: int, nbytes: int, prefix: bool) -> int | None:
        """The bytes from `offset` known present (what to copy), or None: ask the holder."""
        with self._lock:
            for lo, hi in self._present:
                if lo <= offset < hi:
                    run = min(hi, offset + nbytes) - offset
                    return run if run == nbytes or prefix else None
        return None

    def _renew_due(self) -> bool:
        """Whether half the hold has passed since the last reply: renew before copying."""
        with self._lock:
            return self._valid_until - time.monotonic() < self.grant.hold / 2 - self._margin

    def _wait(self, offset: int, nbytes: int, timeout: float, prefix: bool,
              abort: ReadAbort | None) -> int:
        """``WAIT`` for the bytes at `offset`; records them present and renews the hold."""
        with self._conn_lock:
            self._check(peek=False)
            if abort is not None and not abort.watch(self.conn):
                raise SourceLostError(f"read of {self.region!r} aborted")
            with self._lock:
                self._asking += 1
            try:
                got = client.wait_present(self.conn, self.source, self.region, offset=offset,
                                          nbytes=nbytes, timeout=timeout, prefix=prefix)
                replied = time.monotonic()
            except SourceLostError as exc:
                self.fail(str(exc))
                raise
            finally:
                with self._lock:
                    self._asking -= 1
                if abort is not None and abort.unwatch(self.conn):
                    self.fail("aborted")
        with self._lock:
            self.waits += 1
            self._valid_until = max(self._valid_until, replied + self.grant.hold - self._margin)
            self._present = _merged(self._present, (offset, offset + got))
        return got

    def _check(self, *, peek: bool = True) -> None:
        """Raise `SourceLostError` unless the lease is known to hold now.

        Without ``peek`` the connection is not looked at (before a copy: the check after
        it is the one that counts).
        """
        with self._lock:
            why = self._failed
            if why is None and time.monotonic() >= self._valid_until:
                why = "held past its time without a request"
            if why is None and peek and not self._asking and _readable(self.conn):
                why = "the holder closed the connection"
            if why is not None:
                self._failed = why
        if why is not None:
            raise SourceLostError(f"lease on {self.region!r} at {self.source.host}:"
                                  f"{self.source.port} ended: {why}")


def _readable(conn: socket.socket) -> bool:
    """Whether ``conn`` has something to read: with no request out, only a close."""
    poller = select.poll()
    try:
        poller.register(conn, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _merged(spans: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    """``spans`` (sorted, disjoint) with ``new`` added, touching spans joined."""
    out: list[tuple[int, int]] = []
    lo, hi = new
    for a, b in spans:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    return sorted(out)


def take(source: SourceAddress, region: str, nbytes: int, *, timeout: float,
         abort: ReadAbort | None,
         source_bytes: Callable[[client.HoldGrant, ExitStack], SourceBytes],
         copy: CopyFn = _copy) -> HeldLease:
    """``HOLD`` ``[0, nbytes)`` of `region` at `source`, on a connection of its own.

    ``source_bytes(grant, stack)`` maps the holder's memory (what it opens, it leaves on
    ``stack``, closed with the lease) and returns how to reach a range of it. `abort`
    cuts the ``HOLD`` short; the lease does not outlive `HeldLease.close`.

    Raises:
        as `client.hold`; ReadRefusedError: the region is not where the transport reads.
    """
    conn = client.connect(source, abort)
    stack = ExitStack()
    stack.callback(conn.close)
    try:
        grant = client.hold(conn, source, region, offset=0, nbytes=nbytes, timeout=timeout)
        granted = time.monotonic()
        if abort is not None and abort.unwatch(conn):
            raise SourceLostError(f"hold of {region!r} at {source.host}:{source.port} aborted")
        reach = source_bytes(grant, stack)
    except BaseException:
        if abort is not None:
            abort.unwatch(conn)
        stack.close()
        raise
    return HeldLease(conn, stack, grant, source, region, reach, copy=copy, granted=granted)


__all__ = ["MARGIN_S", "HeldLease", "SourceBytes", "take"]
