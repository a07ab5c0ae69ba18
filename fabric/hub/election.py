"""Leader election on etcd: etcd's ``concurrency`` recipe over `fabric.hub.etcd.EtcdClient`.

Each candidate holds a lease, kept alive by a daemon thread, and one key
``{prefix}/{lease id in hex}`` holding its value (a hub's URL), attached to the lease.
The key with the lowest create_revision under ``{prefix}/`` leads; the others wait in
line (`Election.campaign` polls the prefix). A candidate whose process dies stops
renewing, etcd deletes its key when the lease runs out (``ttl`` seconds), and the next
one in line leads.

Safety: a leader counts itself leader (`Election.is_leader`) only while its last
successful keep-alive was sent less than two thirds of ``ttl`` ago, so one cut off from
etcd steps down before etcd can have expired its lease and let another win; and writes
that must come from the leader carry `Election.guard` (the leader key's create_revision
still the same) as a transaction compare, which fails in etcd once leadership moved on,
whatever the writer believes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from weightfabric.fabric.hub.etcd import (
    Compare,
    EtcdClient,
    EtcdError,
    EtcdUnavailableError,
    KeyValue,
    Op,
)

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a waiting candidate reads the line of candidates."""


def _candidates(client: EtcdClient, prefix: str,
                timeout: float | None = None) -> list[KeyValue]:
    return sorted(client.get_prefix(prefix.rstrip("/") + "/", timeout=timeout),
                  key=lambda kv: kv.create_revision)


def leader_of(client: EtcdClient, prefix: str) -> tuple[bytes, int] | None:
    """(value, create_revision) of the leader key under ``prefix``; None when nobody campaigns.

    Raises:
        EtcdError: etcd did not answer.
    """
    line = _candidates(client, prefix)
    return (line[0].value, line[0].create_revision) if line else None


class Election:
    """One candidate in the election under ``prefix`` (see the module docstring).

    Args:
        client: the etcd cluster.
        prefix: the election's key prefix (without a trailing slash), e.g.
            ``/weightfabric/leader``.
        value: what the candidate's key holds (what `leader` tells the others).
        ttl: the lease in seconds (etcd rounds it up to whole seconds): how long a
            leader that died goes on blocking the others. Keep-alives go every ``ttl/3``.
        on_lost: called once, from the keep-alive thread, when a candidate that had
            won can no longer keep its lease (a keep-alive failed past the lease's end,
            or etcd said the lease is gone). Not called by `resign`.
    """

    def __init__(self, client: EtcdClient, prefix: str, value: bytes, *, ttl: float = 2.0,
                 on_lost: Callable[[], None] | None = None) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.client = client
        self.prefix = prefix.rstrip("/")
        self.value = bytes(value)
        self.ttl = float(ttl)
        self.on_lost = on_lost
        self.lease = 0
        self.key = b""
        self.revision = 0
        """The create_revision of this candidate's key (0: no key)."""
        self._lock = threading.Lock()
        self._won = False
        self._lost = False
        self._last_ok = 0.0        # monotonic send time of the last keep-alive etcd took
        self._expires = 0.0        # when etcd may have expired the lease (a bound)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        role = "leader" if self.is_leader else "candidate" if self.revision else "idle"
        return f"Election({self.prefix!r}, {self.value!r}, {role})"

    # --- campaigning ---

    def campaign(self, *, timeout: float | None = None,
                 stop: threading.Event | None = None) -> bool:
        """Become leader: True once this candidate's key is the oldest under the prefix.

        Creates the lease and the key first (once; a later call after a False goes on
        waiting in the same place in line). Polls every `POLL_S` seconds.

        Returns:
            True once leader; False when ``timeout`` seconds passed or ``stop`` was set
            first (the candidate stays in line: `resign` to leave it).

        While waiting, polls that etcd cannot answer (an etcd election, no quorum) are
        retried: the lease decides whether this candidate stays in line.

        Raises:
            EtcdError: etcd did not take the lease or the key, or the lease was lost (or
                the key deleted) while waiting; the candidate has then left the line
                (lease revoked, keep-alive stopped), as after `resign`, and may campaign
                again.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if not self._session_alive():
                self._open_session()
            while True:
                if self._lost:
                    raise EtcdUnavailableError(
                        f"lost the etcd lease of election {self.prefix!r} while waiting "
                        "to lead")
                if self._first_in_line(deadline):
                    return True
                wait = POLL_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    wait = min(wait, left)
                if stop is not None:
                    if stop.wait(wait):
                        return False
                else:
                    time.sleep(wait)
        except EtcdError:
            self._close_session()
            raise

    def _first_in_line(self, deadline: float | None) -> bool:
        """Whether this candidate's key is the oldest now (and so it has won)."""
        timeout = None if deadline is None else max(0.05, deadline - time.monotonic())
        try:
            line = _candidates(self.client, self.prefix, timeout)
        except EtcdUnavailableError as exc:
            # etcd is electing or out of quorum: the lease decides, so keep waiting
            log.debug("election %s: reading the line failed: %s", self.prefix, exc)
            return False
        if not any(kv.key == self.key for kv in line):
            raise EtcdUnavailableError(f"this candidate's key {self.key!r} vanished from etcd "
                                       "(its lease expired, or someone deleted it)")
        if line[0].key != self.key:
            return False
        with self._lock:
            self._won = not self._lost
        if self._won:
            log.debug("election %s: %r leads (revision %d)", self.prefix, self.value,
                      self.revision)
        return self._won

    @property
    def is_leader(self) -> bool:
        """Won, and the last keep-alive etcd took was sent less than ``ttl*2/3`` ago."""
        with self._lock:
            return (self._won and not self._lost
                    and time.monotonic() - self._last_ok < self.ttl * 2 / 3)

    def guard(self) -> Compare:
        """The compare that holds in etcd while this candidate's key leads it.

        ``Compare.create_revision(key, "==", revision)``: put it in a transaction so it
        applies only while this candidate still leads (a key recreated by someone else
        has another create_revision; a deleted one has 0).

        Raises:
            RuntimeError: no campaign yet (no key).
        """
        if not self.key:
            raise RuntimeError(f"guard() of a candidate that never campaigned in "
                               f"{self.prefix!r}")
        return Compare.create_revision(self.key, "==", self.revision)

    def leader(self) -> tuple[bytes, int] | None:
        """(value, create_revision) of the current leader's key; None when nobody campaigns.

        Raises:
            EtcdError: etcd did not answer.
        """
        return leader_of(self.client, self.prefix)

    def resign(self) -> None:
        """Leave: stop the keep-alive, delete the key, revoke the lease (next in line leads).

        Not leader from the moment it is called, also when etcd does not answer (the
        lease then runs out by itself).

        Raises:
            EtcdError: etcd did not take the delete or the revoke.
        """
        key, lease, revision = self.key, self.lease, self.revision
        self._close_session(revoke=False)
        error: EtcdError | None = None
        if key:
            try:
                self.client.txn([Compare.create_revision(key, "==", revision)],
                                [Op.delete(key)])
            except EtcdError as exc:
                error = exc
        if lease:
            try:
                self.client.lease_revoke(lease)
            except EtcdError as exc:
                error = error or exc
        if error is not None:
            raise error

    leader_of = staticmethod(leader_of)

    # --- the session: lease, key, keep-alive thread ---

    def _session_alive(self) -> bool:
        return bool(self.lease) and not self._lost and self._thread is not None

    def _open_session(self) -> None:
        self._close_session()
        sent = time.monotonic()
        lease = self.client.lease_grant(self.ttl)
        key = f"{self.prefix}/{lease:x}".encode()
        try:
            result = self.client.txn([Compare.create_revision(key, "==", 0)],
                                     [Op.put(key, self.value, lease=lease)])
            if not result.succeeded:     # lease ids are unique: someone wrote it by hand
                raise EtcdError(f"election key {key!r} exists already in etcd")
            revision = result.revision
        except BaseException:
            with contextlib.suppress(EtcdError):
                self.client.lease_revoke(lease)
            raise
        with self._lock:
            self.lease, self.key, self.revision = lease, key, revision
            self._won = self._lost = False
            self._last_ok = sent
            self._expires = sent + self.ttl      # etcd rounds the TTL up, never down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, args=(self._stop, lease),
                                        daemon=True, name=f"etcd-election-{lease:x}")
        self._thread.start()

    def _close_session(self, revoke: bool = True) -> None:
        """Stop the keep-alive and forget the lease and key (revoking it unless told not)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.client.timeout + 1)
        with self._lock:
            lease, self._won = self.lease, False
            self.lease = 0
            self.key = b""
            self.revision = 0
        if revoke and lease:
            with contextlib.suppress(EtcdError):
                self.client.lease_revoke(lease)

    def _keepalive(self, stop: threading.Event, lease: int) -> None:
        interval = self.ttl / 3
        next_at = time.monotonic() + interval
        while not stop.wait(max(0.0, next_at - time.monotonic())):
            sent = time.monotonic()
            left = self._expires - sent
            try:
                ttl_left = self.client.lease_keepalive(
                    lease, timeout=max(0.05, min(self.client.timeout, interval, left)))
            except EtcdError as exc:
                if stop.is_set():
                    return
                if time.monotonic() >= self._expires:
                    self._lose(f"no keep-alive reached etcd before the lease ran out ({exc})")
                    return
                log.debug("election %s: keep-alive failed (%s); retrying", self.prefix, exc)
                next_at = time.monotonic() + min(0.1, interval)
                continue
            if ttl_left <= 0:
                self._lose("etcd says the lease is gone")
                return
            with self._lock:
                if stop.is_set():
                    return
                self._last_ok = sent
                self._expires = sent + min(self.ttl, ttl_left)
            next_at = sent + interval

    def _lose(self, why: str) -> None:
        with self._lock:
            was_leader = self._won and not self._lost
            self._lost = True
            self._won = False
        log.warning("election %s: %r lost its lease: %s", self.prefix, self.value, why)
        if was_leader and self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("election %s: on_lost callback failed", self.prefix)


__all__ = ["POLL_S", "Election", "leader_of"]
