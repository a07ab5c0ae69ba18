"""The hub client: one DEALER socket, bounded waits, retries, transparent re-registration.

Every call has a deadline (``timeout``); no call can hang. A call that gets no
answer reconnects with exponential backoff and resends the *same* request id, so
the hub runs it at most once (it answers repeats from its reply cache). When a
reply carries a new hub epoch (the hub restarted), the client re-registers the
worker and everything it holds (`HubState.restore`) and retries the call once if
it failed for lack of that state; so it does when the hub no longer knows the
worker because its lease ran out (the process was paused longer than a lease),
whichever of its calls hears it first. A daemon thread heartbeats every
``lease_s / 3`` on a socket of its own, so a caller's long poll never delays
it; the caller's threads share the main DEALER socket under a lock.

Given the hubs of a service (several URLs: hubs over etcd, `docs/operations.md`), the
client sends to one at a time and moves on when it does not answer within a short try
or answers `NotLeaderError` (a standby); a hub that went silent is skipped for a while,
so the client waits at the standby until it leads instead of trying the dead hub again.
The new leader has a new epoch: the client re-registers there as after a restart.

Every request is signed with the client's credential (`fabric.auth`: the deployment
secret or a token, from ``secret=``, ``secret_file=``, ``WEIGHTFABRIC_SECRET_FILE`` or
the default path), and only replies the hub signed for that request are taken.
``insecure=True`` does neither (for a hub run with ``--insecure``).

Each operation's stub builds its request struct (`fabric.hub_messages`) and gets
the reply struct back (`HubClient.request`); `HubClient.call` is the untyped form.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq

from weightfabric.fabric.auth import Credential, load_credential
from weightfabric.fabric.errors import (
    AuthenticationError,
    HubTimeoutError,
    HubUnavailableError,
    NotLeaderError,
    ProtocolError,
    UnknownFetchError,
    UnknownVersionError,
    UnknownWorkerError,
    ValueTooLargeError,
    WaitTimeoutError,
    hub_error_from_wire,
)
from weightfabric.fabric.hub_messages import (
    RENEWS_LEASE,
    AbortPublishRequest,
    BeginDeriveRequest,
    BeginFetchRequest,
    BeginPublishReply,
    BeginPublishRequest,
    CommitRequest,
    CommitWaitReply,
    CompleteFetchRequest,
    CompleteReply,
    DeriveReply,
    DropReply,
    DropRequest,
    EmptyReply,
    Endpoints,
    ErrorBody,
    GroupStatusReply,
    GroupStatusRequest,
    HeartbeatReply,
    HeartbeatRequest,
    Holding,
    KvGetReply,
    KvGetRequest,
    KvPutReply,
    KvPutRequest,
    LatestRequest,
    LocateReply,
    LocateRequest,
    ManifestWire,
    PingReply,
    PingRequest,
    PinRequest,
    PlanReply,
    PlanRequest,
    PolicyReply,
    ProgressReply,
    PublishStateReply,
    RegisterReply,
    RegisterRequest,
    ReleaseRequest,
    ReportCorruptReply,
    ReportCorruptRequest,
    ReportProgressRequest,
    Request,
    RestoreReply,
    RestoreRequest,
    RetractReply,
    RetractRequest,
    RetractStatusRequest,
    SetRetentionRequest,
    StatusReply,
    StatusRequest,
    UnregisterRequest,
    VersionReply,
    WaitCommitRequest,
    WaitVersionRequest,
)
from weightfabric.fabric.locality import Location
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.protocol import (
    ERROR,
    MAX_MESSAGE_SIZE,
    REQUEST,
    Body,
    Message,
    decode,
    decode_body,
    encode,
)
from weightfabric.fabric.zmq_util import encrypted, endpoint, hub_socket, reconnects

log = logging.getLogger(__name__)
T = TypeVar("T")

_RESTORE_CODES = (UnknownWorkerError.code, UnknownFetchError.code)
_NO_REREGISTER = ("register", "restore", "unregister")
SILENT_SKIP_S = 3.0
"""How long a hub of a service that left a try unanswered is passed over for the others:
a little longer than a dead leader's etcd lease (2 s), so that the client waits at a
standby until it leads, and not so long that a leader that was only slow loses its
clients for long."""
_QUERIES = frozenset({"group_status", "kv_get", "latest", "locate", "retract_status", "status",
                      "wait_commit", "wait_version"})
"""Operations that change nothing at the hub (its ``READ_ONLY`` but ``ping``)."""
MAX_KV_VALUE = 64 * 1024      # the hub's limit (fabric.hub.state.MAX_KV_VALUE), checked early
FIRST_TRY_S = 2.0
"""How long a client of one hub waits for an answer before it sends the request again (on
the same connection, each try waiting twice as long as the one before)."""
SERVICE_TRY_S = 1.0
"""How long a client of several hubs waits at one before it asks the next."""
NODE_BEATS = 32
"""Instants per heartbeat interval that nodes heartbeat at (`node_phase`): with 1,250
nodes of 8 workers, 39 nodes a beat, a beat every 0.3 s at a 10 s interval."""
HEARTBEAT_NEWS_EVERY = 2
"""A worker whose other requests keep its lease still heartbeats at least once per this many
heartbeat intervals (``lease_s / 3``): heartbeats carry its news (retired and quarantined
replicas, sources lost under a fetch that sends no report)."""


def heartbeat_due(last_beat: float, renewed: float, interval: float, *,
                  publishing: bool, phase: float | None = None,
                  wall_offset: float = 0.0) -> float:
    """When a worker's next heartbeat is due (`time.monotonic` seconds).

    Any request of the worker the hub answered renews its lease there
    (`hub_messages.RENEWS_LEASE`), so a heartbeat is due ``interval`` after the later of
    the last heartbeat (``last_beat``: tried, answered or not) and the last renewing
    request (``renewed``: when it was sent), and at least every `HEARTBEAT_NEWS_EVERY`
    intervals for its news. The lease (3 intervals) then always has 2 intervals of slack,
    as with a heartbeat every interval. A worker publishing a version heartbeats every
    interval (its heartbeats claim the version).

    With a ``phase`` (`node_phase`: the same for every worker of a node) the heartbeat
    moves to the node's beat nearest that time: the instants whose wall-clock time
    (monotonic + ``wall_offset``) is ``phase`` of an interval past a multiple of the
    interval. Half an interval early or late at most: the lease keeps 1.5 intervals of
    slack, and as many heartbeats go as without a phase. A node's workers then heartbeat
    together and its relay (`fabric.relay`) sends their heartbeats in one batch; nodes
    keep their own phases, spread over the interval.
    """
    if publishing:
        due = last_beat + interval
    else:
        due = min(max(last_beat, renewed) + interval,
                  last_beat + HEARTBEAT_NEWS_EVERY * interval)
    if phase is None:
        return due
    return (round((due + wall_offset) / interval - phase) + phase) * interval - wall_offset


def node_phase(location: Location) -> float | None:
    """The phase of a node's heartbeats in their interval, in [0, 1) (None: no node named).

    One of `NODE_BEATS` beats, by a hash of the datacenter and node names: the same for
    every worker of the node, nodes spread over the interval's beats (`heartbeat_due`).
    The nodes of a beat heartbeat at the same instant: the hub takes their batches in one
    wake-up, warm, instead of one wake-up each (half the CPU idle workers cost it, 10,000
    of them behind relays: docs/benchmarks.md).
    """
    if not location.node:
        return None
    beat = zlib.crc32(f"{location.datacenter}/{location.node}".encode()) % NODE_BEATS
    return beat / NODE_BEATS


@dataclass(frozen=True)
class SourceInfo:
    """A worker a plan names: where it is and how to reach it (endpoints: data plane's)."""

    worker: str
    location: Location
    endpoints: Endpoints
    complete: bool
    cap: bytes = b""
    """This reader's capability to read the plan's version from the worker (`fabric.auth`)."""


@dataclass(frozen=True)
class PlanRange:
    """Chunks ``start..stop-1``.

    Read from ``sources`` (best first; each has them), or wait on the progress of ``wait``
    (partial replicas ranked better, not there yet).
    """

    start: int
    stop: int
    sources: tuple[str, ...]
    wait: tuple[str, ...]
    window: int = 0
    """Bytes to keep in flight along the range (`PlanRangeWire.window`)."""


def locate_data(reply: LocateReply) -> dict[str, Any]:
    """A `LocateReply` as the plain data `HubClient.locate` returns (capabilities as bytes)."""
    out: dict[str, Any] = msgspec.to_builtins(reply, builtin_types=(bytes,))
    return out


@dataclass(frozen=True)
class FetchPlan:
    """What `HubClient.begin_fetch` / `replan` return."""

    fetch_id: str
    model: str
    version: int
    shard: int
    num_shards: int
    manifest: Manifest
    ranges: tuple[PlanRange, ...]
    workers: dict[str, SourceInfo]
    planned: bool = False
    """The ranges follow the version's broadcast plan (`PlanReply.planned`)."""
    max_reports: int | None = None
    """Milestone progress reports the hub asks of this fetch at most (`PlanReply.max_reports`)."""

    @classmethod
    def from_reply(cls, reply: PlanReply, manifest: Manifest | None = None) -> FetchPlan:
        """Build from the hub's reply to ``begin_fetch`` or ``plan``.

        Build from the hub's reply to ``begin_fetch`` or ``plan`` (``manifest``: the one the
        reader kept, for a reply without it).

        Raises:
            ProtocolError: a reply without a manifest and none kept.
            ValueError: the reply's manifest is not a valid layout.
        """
        if manifest is None:
            if reply.manifest is None:
                raise ProtocolError(f"the hub's plan for fetch {reply.fetch_id!r} has no "
                                    "manifest")
            manifest = reply.manifest.manifest()
        return cls(reply.fetch_id, reply.model, reply.version, reply.shard, reply.num_shards,
                   manifest,
                   tuple(PlanRange(r.start, r.stop, tuple(r.sources), tuple(r.wait), r.window)
                         for r in reply.ranges),
                   {w: SourceInfo(w, Location.from_wire(i.location), i.endpoints, i.complete,
                                  i.cap)
                    for w, i in reply.workers.items()}, planned=reply.planned,
                   max_reports=reply.max_reports)

    def chunks(self) -> list[int]:
        """Every chunk index this plan covers."""
        return [c for r in self.ranges for c in range(r.start, r.stop)]


@dataclass
class _Holding:
    model: str
    version: int
    shard: int
    num_shards: int
    manifest: Manifest
    state: str
    complete: bool = False
    publisher: bool = False
    fetch_id: str | None = None
    chunks: set[int] = field(default_factory=set)
    group: str | None = None      # fetch group: the hub does not resume it after a restart

    def to_wire(self) -> Holding:
        return Holding(model=self.model, version=self.version, shard=self.shard,
                       num_shards=self.num_shards, manifest=ManifestWire.of(self.manifest),
                       state="committed" if self.state == "committed" else "publishing",
                       complete=self.complete, publisher=self.publisher,
                       fetch_id=self.fetch_id, chunks=sorted(self.chunks), group=self.group)


class HubClient:
    """A connection to a hub, optionally as a registered worker. Use `fabric.connect`."""

    def __init__(self, url: str | list[str], *, worker: str | None = None,
                 location: Location | dict[str, str] | None = None,
                 endpoints: Endpoints | None = None, timeout: float = 10.0,
                 heartbeat: bool = True, max_message_size: int = MAX_MESSAGE_SIZE,
                 secret: str | None = None, secret_file: str | Path | None = None,
                 insecure: bool = False) -> None:
        self.urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url)
                     if u.strip()]
        """The hubs of the service, in the order tried (one URL: a single hub)."""
        if not self.urls:
            raise ValueError("connect needs a hub URL")
        self._hub = 0        # index in `urls` of the hub the next request goes to
        self._silent: dict[str, float] = {}   # hub -> when a try there last went unanswered
        self.credential: Credential | None = (
            None if insecure else load_credential(secret=secret, secret_file=secret_file))
        """What this client signs its requests with (None: ``insecure``)."""
        self.worker = worker
        self.location = Location.from_wire(location)
        self._phase = node_phase(self.location)   # the node's heartbeats go together
        self.endpoints = dict(endpoints or {})
        self.timeout = float(timeout)
        self.max_message_size = max_message_size
        self.session = secrets.token_hex(8)
        self.lease_s: float | None = None
        self.epoch: str | None = None
        self.lost: dict[str, set[str]] = {}  # fetch -> sources the hub dropped, until it ends
        self.retired: set[tuple[str, int]] = set()
        self.quarantined: set[tuple[str, int, int]] = set()
        """``(model, version, shard)`` replicas of this worker the hub quarantined (heartbeat
        news), each also handed to `on_quarantine`."""
        self.on_quarantine: Callable[[str, int, int], None] | None = None
        """Called (on the heartbeat thread) for each replica the hub quarantined: the worker
        sets it to stop serving that version (`ModelStore.quarantine`)."""
        for u in self.urls:
            endpoint(u, bind=False)   # a bad URL fails here, not at the first call
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._chan_locks = {"main": threading.RLock(), "heartbeat": threading.RLock()}
        self._holdings: dict[tuple[str, int, int], _Holding] = {}
        self._socks: dict[str, tuple[zmq.Socket, str]] = {}   # channel -> socket, its hub
        self._closed = False
        self._registrations = 0  # registrations done, restore included (`_registered_since`)
        self._register_lock = threading.RLock()  # held by a registration and its restore
        self._restoring = threading.Event()  # a new epoch's registration is under way
        self._hb_stop = threading.Event()
        self._left = False  # `unregister` was called: no registering again by itself
        self._hb_thread: threading.Thread | None = None
        self._want_heartbeat = heartbeat
        self._renewed = -math.inf   # when the last request that renewed the lease was sent

    @property
    def url(self) -> str:
        """The hub requests go to now (of a service: the one that answered last)."""
        return self.urls[self._hub]

    def _next_hub(self, tried: str, why: str, *, silent: bool = False) -> None:
        """Move on from hub ``tried`` to the service's next (every channel follows).

        Hubs that went silent less than `SILENT_SKIP_S` ago are skipped (a standby that
        refused stays the one asked, until it leads), unless every other one did.
        Nothing changes when another channel already moved on from ``tried``: two channels
        that both found a hub silent move one step, not two.
        """
        now = time.monotonic()
        with self._lock:
            if silent:
                self._silent[tried] = now
            if self.url != tried:
                return
            n = len(self.urls)
            order = [(self._hub + i) % n for i in range(1, n + 1)]   # `tried` comes last
            self._hub = next((i for i in order
                              if now - self._silent.get(self.urls[i], -math.inf)
                              >= SILENT_SKIP_S), order[0])
        if self.url != tried:
            log.info("hub %s %s; trying %s", tried, why, self.url)

    # ------------------------------------------------------------- lifecycle
    def open(self) -> HubClient:
        """Connect (and register the worker, starting heartbeats).

        Raises:
            HubUnavailableError: no hub answers at the URL within ``timeout``.
            DuplicateWorkerError: the worker id is taken by another live client.
        """
        try:
            self.request(PingRequest(), PingReply)
        except HubTimeoutError as exc:
            self.close()
            raise HubUnavailableError(f"no hub answered at {','.join(self.urls)} within "
                                      f"{self.timeout:g} s; is `fabric hub serve` running "
                                      "there?") from exc
        if self.worker is not None:
            self._register()
            if self._want_heartbeat:
                self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                   name=f"fabric-heartbeat-{self.worker}")
                self._hb_thread.start()
        return self

    def close(self) -> None:
        """Stop heartbeats and close the socket (the lease then runs out at the hub)."""
        self._stop_heartbeats()
        for name, lock in self._chan_locks.items():
            with lock:
                self._closed = True
                held = self._socks.pop(name, None)
                if held is not None:
                    held[0].close(0)

    def _stop_heartbeats(self) -> None:
        """Stop the heartbeat thread and wait for it (a heartbeat in flight ends first)."""
        self._hb_stop.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(5)

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- transport
    def request(self, req: Request, reply: type[T], *, timeout: float | None = None,
                wait_s: float = 0.0, channel: str = "main") -> T:
        """Send one typed request; returns its reply as ``reply`` (raises the hub's typed error).

        Arguments as for `call`.

        Raises:
            ProtocolError: the reply does not fit ``reply`` (a hub of another build).
            HubTimeoutError, HubUnavailableError, HubError subclasses: see `call`.
        """
        msg = self._call_once(req.op, req, timeout, wait_s, channel)
        try:
            return decode_body(msg, reply)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"the hub's reply to {req.op!r} is malformed: {exc}") from exc

    def call(self, op: str, args: Body, *, timeout: float | None = None,
             wait_s: float = 0.0, channel: str = "main") -> dict[str, Any]:
        """Send one request and return the reply body as plain data (raises the hub's typed error).

        The untyped form of `request`, for tools and tests.

        Args:
            timeout: overall deadline in seconds (default: the client's ``timeout``).
            wait_s: how long the hub may hold the request (long-poll); added to the deadline.
            channel: ``"main"`` or ``"heartbeat"`` (each has its own socket).

        Raises:
            HubTimeoutError: no answer before the deadline (after retries).
            HubUnavailableError: the client is closed.
            HubError subclasses: the hub's answer.
        """
        out: dict[str, Any] = decode_body(self._call_once(op, args, timeout, wait_s, channel),
                                          dict)
        return out  # `decode` let only a map through

    def _call_once(self, op: str, args: Body, timeout: float | None,
                   wait_s: float, channel: str, retried: bool = False) -> Message:
        if op not in ("register", "restore") and self._restoring.is_set():
            with self._register_lock:  # another thread registers this worker again: after it
                pass
        limit = (self.timeout if timeout is None else timeout) + wait_s
        sent = time.monotonic()
        deadline = sent + limit
        with self._chan_locks[channel]:
            if self._closed:
                raise HubUnavailableError("this hub client is closed; connect again")
            with self._lock:
                req_id = next(self._ids)
                registrations = self._registrations
            data = encode(REQUEST, req_id, self.session, op, args,
                          max_size=self.max_message_size)
            for tries in itertools.count():
                msg = self._exchange(channel, op, req_id, data,
                                     max(deadline - time.monotonic(), 0.0), wait_s)
                # A standby of a service: on to the next hub until the leader answers.
                if (msg.kind != ERROR or msg.name != NotLeaderError.code
                        or len(self.urls) == 1 or time.monotonic() + 0.05 >= deadline):
                    break
                asked = self._socks[channel][1]
                self._next_hub(asked, "stands by")
                if self.url == asked or tries % len(self.urls) == len(self.urls) - 1:
                    # every hub asked, or the others silent: no leader yet; ask again soon
                    time.sleep(min(0.05 * 2 ** min(tries // len(self.urls), 3), 0.5,
                                   max(0.0, deadline - time.monotonic())))
        with self._lock:
            epoch_changed = self.epoch is not None and msg.tag != self.epoch
            self.epoch = msg.tag
            register = (epoch_changed and self.worker is not None
                        and op not in ("register", "restore"))
            if register:  # calls of other threads wait for it (they see no epoch change)
                self._restoring.set()
        restore_retry = msg.kind == ERROR and not retried and msg.name in _RESTORE_CODES
        if register:
            log.warning("new hub epoch (a restart, or another hub leads); re-registering "
                        "worker=%s", self.worker)
            try:
                with self._register_lock:
                    self._register(channel)
            finally:
                self._restoring.clear()
            # A query the new hub answered before it knew what this worker holds is asked
            # again (queries change nothing, so asking twice is safe).
            if (restore_retry or op in _QUERIES) and not retried:
                return self._call_once(op, args, timeout, wait_s, channel, retried=True)
        elif (restore_retry and self.worker is not None and op not in _NO_REREGISTER
              and self._registered_since(channel, registrations,
                                         register=msg.name == UnknownWorkerError.code)):
            return self._call_once(op, args, timeout, wait_s, channel, retried=True)
        if msg.kind == ERROR:
            try:
                message = decode_body(msg, ErrorBody).message
            except msgspec.MsgspecError:
                message = "(an error reply without a readable message)"
            raise hub_error_from_wire(msg.name, message)
        if op in RENEWS_LEASE and not epoch_changed:
            with self._lock:    # the hub renewed the lease when it took the request
                self._renewed = max(self._renewed, sent)
        return msg

    def _exchange(self, channel: str, op: str, req_id: int, data: bytes, limit: float,
                  wait_s: float) -> Message:
        deadline = time.monotonic() + limit
        attempt = 0
        macs: list[bytes] = []     # each try's: the answer to any of them is taken
        # One hub that zmq reconnects to on its own (a restarted one too): every try goes
        # on the same connection.
        single = len(self.urls) == 1 and reconnects(self.url)
        while True:
            sock = self._socket(channel)
            frames = [data]
            if self.credential is not None:   # signed again at each try: a fresh timestamp
                auth, mac = self.credential.sign(data)
                frames.append(auth)
                macs.append(mac)
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(frames, zmq.NOBLOCK)
            # A hub answers in milliseconds: a silent one is given 2 s, then twice as long at
            # each try on the same connection (a hub behind a burst of requests answers them
            # in turn; resending sooner only queues more work behind them), or 1 s when
            # another hub of the service may lead instead (a failover then costs one short try).
            first = SERVICE_TRY_S if len(self.urls) > 1 else FIRST_TRY_S
            per_try = max(wait_s + min(first, self.timeout / 3), 0.5)
            if single:
                per_try *= 2 ** attempt
            try_end = min(deadline, time.monotonic() + per_try)
            while True:
                left = try_end - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    break
                try:
                    raw, *rest = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    msg = decode(raw, max_size=self.max_message_size)
                except Exception as exc:
                    log.warning("undecodable reply dropped: %s", exc)
                    continue
                if msg.req_id == req_id and self._authentic(msg, raw, rest, macs):
                    return msg
            if time.monotonic() >= deadline:
                # Drop the queued request so it cannot reach a hub that comes back later
                # (it would run there with nobody waiting for the answer).
                self._reset_socket(channel)
                raise HubTimeoutError(f"hub at {','.join(self.urls)} did not answer {op!r} within "
                                      f"{limit:g} s ({attempt + 1} attempts); it may be down "
                                      "or overloaded")
            attempt += 1
            if single:   # the same connection: the hub may be slow, not gone
                continue
            tried = self._socks[channel][1]
            self._reset_socket(channel)
            backoff = 0.05 * 2 ** attempt
            if len(self.urls) > 1:   # on to the next hub of the service, soon
                self._next_hub(tried, "did not answer", silent=True)
                backoff = min(backoff, 0.2)
            time.sleep(min(backoff, 1.0, max(0.0, deadline - time.monotonic())))

    def _authentic(self, msg: Message, raw: bytes, rest: list[bytes], macs: list[bytes]
                   ) -> bool:
        """Whether to take reply ``msg``: signed for one of this request's tries (``macs``).

        Without a credential (insecure) every reply is taken. An unsigned refusal
        (``unauthenticated``) is taken: the caller raises it.

        Raises:
            AuthenticationError: the hub answered unsigned: it runs without authentication.
        """
        if self.credential is None:
            return True
        auth = rest[0] if rest else b""
        if not auth:
            if msg.kind == ERROR and msg.name == AuthenticationError.code:
                return True
            raise AuthenticationError(
                f"the hub at {self.url} answered without signing its reply: it runs with "
                "--insecure (or is not the hub); connect with insecure=True to trust it")
        if any(self.credential.check_reply(auth, mac, raw) for mac in macs):
            return True
        log.warning("a reply from %s not signed for this request was dropped", self.url)
        return False

    def _socket(self, channel: str) -> zmq.Socket:
        held = self._socks.get(channel)
        if held is not None and held[1] == self.url:
            return held[0]
        self._reset_socket(channel)   # a socket to a hub the client has moved away from
        url = self.url
        if encrypted(url) and (self.credential is None or not self.credential.hub_key):
            raise AuthenticationError(f"{url} is encrypted: connect with the "
                                      "hub's secret or a token it issued")
        sock = hub_socket(url, max_message_size=self.max_message_size,
                          hub_key=self.credential.hub_key if self.credential else None)
        self._socks[channel] = (sock, url)
        return sock

    def _reset_socket(self, channel: str) -> None:
        held = self._socks.pop(channel, None)
        if held is not None:
            held[0].close(0)

    # ------------------------------------------------------------- liveness
    def _register(self, channel: str = "main") -> None:
        out = self.request(RegisterRequest(worker=self._me(), location=self.location.to_wire(),
                                           endpoints=self.endpoints),
                           RegisterReply, channel=channel)
        self.lease_s = out.lease_s
        with self._lock:
            holdings = [h.to_wire() for h in self._holdings.values()]
        if holdings:
            res = self.request(RestoreRequest(worker=self._me(), holdings=holdings),
                               RestoreReply, channel=channel)
            for model, version, shard, why in res.rejected:
                log.warning("hub refused restored replica model=%s version=%s shard=%s: %s",
                            model, version, shard, why)
        with self._lock:
            self._registrations += 1  # complete: what it holds is restored too

    def _registered_since(self, channel: str, registrations: int, *, register: bool) -> bool:
        """Whether the worker was registered again since a refused call was sent.

        Whether the worker was registered again, with what it holds, since a call that the
        hub refused for lack of that state was sent (`registrations` was the count then): by
        another thread (its restore is waited for), or now, when `register` (the hub no
        longer knows the worker: its lease ran out, e.g. a long pause).
        """
        with self._register_lock:
            if self._registrations != registrations:
                return True
            if register and self._left:
                return False  # it left on purpose (`unregister`): never back by itself
            if register:
                log.warning("lease of worker=%s had expired; registering again", self.worker)
                self._register(channel)
            return register

    def heartbeat(self, *, channel: str = "main") -> HeartbeatReply:
        """Renew the lease now, and claim the versions this client is publishing.

        Renew the lease now, and claim the versions this client is publishing (a publishing
        version nobody claims for a lease is retired as orphaned).

        Returns:
            The hub's news (see `HubState.heartbeat`): ``lost`` sources per fetch,
            ``retired`` versions this worker holds.
        """
        with self._lock:       # the versions we know we publish keep their publish claim
            publishing = sorted({(h.model, h.version) for h in self._holdings.values()
                                 if h.publisher and h.state == "publishing"})
        out = self.request(HeartbeatRequest(worker=self._me(), publishing=publishing),
                           HeartbeatReply, channel=channel)  # registers again if need be
        self.lease_s = out.lease_s     # a hub with many workers lengthens it (heartbeat_rate)
        for fid, workers in out.lost.items():  # a new set: fetches read it unlocked
            self.lost[fid] = self.lost.get(fid, set()) | set(workers)
        self.retired.update(out.retired)
        for model, version, shard in out.quarantined:
            self._forget(model, version)  # not restored after a hub restart
            if self.on_quarantine is not None:
                try:
                    self.on_quarantine(model, version, shard)
                except Exception:  # the news is kept in `quarantined` for stores to act on
                    log.exception("quarantine of %s v%d here failed", model, version)
        self.quarantined.update(out.quarantined)
        return out

    def _heartbeat_loop(self) -> None:
        """Heartbeat every ``lease_s / 3``, less while other requests renew the lease.

        See `heartbeat_due`: a worker fetching (its plans, reports and completions renew
        the lease) sends a heartbeat only every `HEARTBEAT_NEWS_EVERY` intervals.
        """
        last = time.monotonic()
        while True:
            interval = (self.lease_s or 3.0) / 3
            with self._lock:
                renewed = self._renewed
                publishing = any(h.publisher and h.state == "publishing"
                                 for h in self._holdings.values())
            left = heartbeat_due(last, renewed, interval, publishing=publishing,
                                 phase=self._phase,
                                 wall_offset=time.time() - time.monotonic()) - time.monotonic()
            if left > 0:
                if self._hb_stop.wait(min(left, interval)):
                    return
                continue    # due again: a renewing request may have pushed it back
            if self._hb_stop.is_set():
                return
            last = time.monotonic()
            try:
                self.heartbeat(channel="heartbeat")
            except Exception as exc:  # keep trying: the hub may come back
                log.warning("heartbeat of worker=%s failed: %s", self.worker, exc)

    # ------------------------------------------------------------ operations
    def _me(self) -> str:
        """This client's worker id.

        Raises:
            ValueError: an observer (no worker id).
        """
        if self.worker is None:
            raise ValueError("this operation needs a worker id: connect(url, worker=...)")
        return self.worker

    def begin_publish(self, model: str, manifest: Manifest, *, shard: int = 0,
                      num_shards: int = 1, group: str | None = None) -> int:
        """Start publishing this worker's shard of a new version; returns its number.

        Raises:
            ManifestMismatchError, InvalidStateError: see `HubState.begin_publish`.
        """
        v = self.request(BeginPublishRequest(worker=self._me(), model=model,
                                             manifest=ManifestWire.of(manifest), shard=shard,
                                             num_shards=num_shards, group=group),
                         BeginPublishReply).version
        with self._lock:
            self._holdings[(model, v, shard)] = _Holding(model, v, shard, num_shards, manifest,
                                                         "publishing", publisher=True)
        return v

    def begin_derive(self, model: str, version: int, manifest: Manifest, *,
                     with_base: bool = False) -> DeriveReply:
        """Derive ``version`` of ``model`` (``base@layout``) from the base's, or learn who does.

        On ``"derive"`` this worker publishes the derived bytes as version ``version``
        (heartbeats claim it): fill its region, then `commit` with the checksums (or
        `abort_publish`). On ``"wait"`` ``by`` derives it: ask again later (a deriver that
        dies or aborts leaves it to the next caller). On ``"fetch"``: `begin_fetch` it.

        Args:
            manifest: the derived bytes' layout, normally without checksums.
            with_base: a ``"derive"`` answer also carries where the base version can be
                read (``base``: `locate_reply`'s answer), saving the deriver that call.

        Raises:
            BadRequestError, UnknownModelError, UnknownVersionError, ManifestMismatchError:
                see `HubState.begin_derive`.
        """
        out = self.request(BeginDeriveRequest(worker=self._me(), model=model, version=version,
                                              manifest=ManifestWire.of(manifest),
                                              with_base=with_base), DeriveReply)
        if out.action == "derive":
            with self._lock:
                self._holdings[(model, version, 0)] = _Holding(model, version, 0, 1, manifest,
                                                               "publishing", publisher=True)
        return out

    def commit(self, model: str, version: int, checksums: list[int] | None = None) -> str:
        """Commit this worker's shards.

        Args:
            checksums: a derived version's (`begin_derive` without them): one per chunk.

        Returns ``"committed"`` or ``"publishing"`` (group still waiting for other shards).

        Raises:
            BadRequestError: ``checksums`` for a version that is not derived, or not one
                per chunk.
        """
        state = self.request(CommitRequest(worker=self._me(), model=model, version=version,
                                           checksums=checksums), PublishStateReply).state
        with self._lock:
            for h in self._holdings.values():
                if h.model == model and h.version == version and h.publisher:
                    h.complete, h.state = True, state
                    if checksums is not None:     # what a restore must send from now on
                        h.manifest = replace(h.manifest, checksums=tuple(checksums))
        return state

    def abort_publish(self, model: str, version: int, *, reason: str = "") -> None:
        """Abandon this worker's publish of ``version`` (still publishing): it retires.

        Raises:
            InvalidStateError: see `HubState.abort_publish`.
        """
        self.request(AbortPublishRequest(worker=self._me(), model=model, version=version,
                                         reason=reason), PublishStateReply)
        self._forget(model, version)

    def begin_fetch(self, model: str, version: int | str = "latest", *, shard: int = 0,
                    fingerprint: str | None = None, group: str | None = None,
                    group_size: int = 1, have: list[int] | None = None,
                    fetch_id: str | None = None) -> FetchPlan:
        """Start fetching a shard of a version; this worker becomes a partial replica.

        Returns:
            The `FetchPlan`: per chunk range the ranked sources (and partial replicas worth
            waiting for), the manifest, and each named worker's location and endpoints.

        Raises:
            UnknownModelError, UnknownVersionError, ManifestMismatchError, NoSourceError,
            InvalidStateError, GroupAbortedError: see `HubState.begin_fetch`.
        """
        fetch_id = fetch_id or f"{self._me()}/{secrets.token_hex(6)}"
        reply = self.request(BeginFetchRequest(worker=self._me(), model=model, version=version,
                                               shard=shard, fingerprint=fingerprint,
                                               group=group, group_size=group_size, have=have,
                                               fetch_id=fetch_id), PlanReply)
        plan = FetchPlan.from_reply(reply)
        with self._lock:
            self._holdings[(model, plan.version, shard)] = _Holding(
                model, plan.version, shard, plan.num_shards, plan.manifest, "committed",
                fetch_id=fetch_id, chunks=set(have or ()), group=group)
        return plan

    def locate(self, model: str, version: int | str = "latest") -> dict[str, Any]:
        """Where each shard of a committed version can be read whole.

        Where each shard of a committed version can be read whole, without becoming a
        replica (see `HubState.locate`); holders ranked for this worker's location.

        Returns:
            The `LocateReply` as plain data (``where["shards"][k]["manifest"]`` is what
            `Manifest.from_wire` reads; ``where["workers"][w]["cap"]`` the capability to
            read from ``w``); `locate_reply` gives the struct.

        Raises:
            UnknownModelError, UnknownVersionError, NoSourceError.
        """
        return locate_data(self.locate_reply(model, version))

    def locate_reply(self, model: str, version: int | str = "latest", *,
                     manifests_only: bool = False) -> LocateReply:
        """`locate`, as the typed `LocateReply`.

        ``manifests_only``: shards with no live holder come back with no holders rather
        than as a `NoSourceError` (for what only needs the version's manifests).
        """
        return self.request(LocateRequest(model=model, version=version, worker=self.worker,
                                          manifests_only=manifests_only), LocateReply)

    def replan(self, fetch_id: str, *, chunks: list[int] | None = None,
               exclude: list[str] | None = None) -> FetchPlan:
        """New sources for the chunks still missing (or ``chunks``), avoiding ``exclude``."""
        with self._lock:      # kept from begin_fetch: the hub need not send it again
            kept = next((h.manifest for h in self._holdings.values()
                         if h.fetch_id == fetch_id), None)
        reply = self.request(PlanRequest(worker=self._me(), fetch_id=fetch_id, chunks=chunks,
                                         exclude=exclude, with_manifest=kept is None),
                             PlanReply)
        return FetchPlan.from_reply(reply, kept)

    def report_progress(self, fetch_id: str, chunks: list[int], *,
                        sources: list[str] | None = None) -> ProgressReply:
        """Tell the hub these chunks are held and verified.

        Returns ``have``, ``num_chunks`` and ``lost`` (sources that died: replan the chunks
        you miss).
        """
        out = self.request(ReportProgressRequest(worker=self._me(), fetch_id=fetch_id,
                                                 chunks=list(chunks), sources=sources),
                           ProgressReply)
        with self._lock:
            for h in self._holdings.values():
                if h.fetch_id == fetch_id:
                    h.chunks.update(chunks)
        return out

    def complete_fetch(self, fetch_id: str, *, wait: float = 0.0,
                       traffic: dict[str, list[int]] | None = None) -> CompleteReply:
        """Become a complete replica.

        In a group, ``wait`` seconds for the other members; returns ``complete`` (bool) and
        ``group`` (None, ``"open"``, ``"committed"`` or ``"aborted"``). ``traffic``: source
        worker -> [bytes delivered, bytes on the wire], for `fabric hub status`.
        """
        out = self.request(CompleteFetchRequest(worker=self._me(), fetch_id=fetch_id,
                                                timeout=wait, traffic=traffic),
                           CompleteReply, wait_s=wait)
        with self._lock:
            for h in self._holdings.values():
                if h.fetch_id == fetch_id:
                    h.chunks = set(range(h.manifest.num_chunks))
                    if out.complete:
                        h.complete, h.fetch_id = True, None
        if out.complete:
            self.lost.pop(fetch_id, None)
        return out

    def group_status(self, model: str, group: str) -> GroupStatusReply:
        """State of a fetch group: ``state, version, size, done, reason``."""
        return self.request(GroupStatusRequest(model=model, group=group), GroupStatusReply)

    def release(self, fetch_id: str) -> None:
        """Abandon a fetch (its partial replica is retracted; a group aborts)."""
        self.request(ReleaseRequest(worker=self._me(), fetch_id=fetch_id), EmptyReply)
        self.lost.pop(fetch_id, None)
        with self._lock:
            for key, h in list(self._holdings.items()):
                if h.fetch_id == fetch_id:
                    del self._holdings[key]

    def retract(self, model: str, version: int, *, wait: float = 30.0,
                delay: bool = False) -> str:
        """Stop serving this worker's replicas of a version.

        Args:
            wait: seconds to wait until no read may be in flight (0: return at once).
            delay: if retention forbids it now, keep serving until another replica exists
                instead of raising.

        Returns:
            ``"done"`` (safe to overwrite), or ``"retracting"`` / ``"delayed"`` when
            ``wait`` ran out first (not safe yet; poll `retract_status`).

        Raises:
            RetentionError: it would break ``min_replicas`` and ``delay`` is false.
        """
        state = self.request(RetractRequest(worker=self._me(), model=model, version=version,
                                            delay=delay, timeout=wait),
                             RetractReply, wait_s=wait).state
        if state == "done":
            self._forget(model, version)
        return state

    def retract_status(self, model: str, version: int) -> str:
        """``"done"``, ``"retracting"``, ``"delayed"`` or ``"live"``."""
        state = self.request(RetractStatusRequest(worker=self._me(), model=model,
                                                  version=version), RetractReply).state
        if state == "done":
            self._forget(model, version)
        return state

    def drop(self, model: str) -> list[int]:
        """Let go of everything this worker holds of ``model`` (its memory is going away).

        The hub drops its replicas and fetches of that model at once, as if the worker were
        lost (no retention check), and this client forgets them, so no heartbeat or restore
        after a hub restart registers them again.

        Returns:
            The versions whose replica the hub dropped.

        Raises:
            HubError: the hub refused or did not answer (the local holdings are
                forgotten anyway).
        """
        with self._lock:          # first: a restore during the call must not bring them back
            for key in [k for k in self._holdings if k[0] == model]:
                h = self._holdings.pop(key)
                if h.fetch_id is not None:
                    self.lost.pop(h.fetch_id, None)
            self.retired = {(m, n) for m, n in self.retired if m != model}
        return self.request(DropRequest(worker=self._me(), model=model), DropReply).dropped

    def _forget(self, model: str, version: int) -> None:
        with self._lock:
            for key in [k for k in self._holdings if k[0] == model and k[1] == version]:
                del self._holdings[key]

    def report_corrupt(self, model: str, version: int, holder: str, chunks: list[int], *,
                       shard: int = 0) -> bool:
        """Tell the hub ``holder`` served ``chunks`` that failed their checksum here.

        The hub quarantines that replica (`HubState.report_corrupt`). Returns whether it did.
        """
        return self.request(ReportCorruptRequest(worker=self._me(), model=model, version=version,
                                                 shard=shard, holder=holder, chunks=chunks),
                            ReportCorruptReply).quarantined

    def set_retention(self, model: str, *, keep_last: int | None = None,
                      min_replicas: int | None = None) -> PolicyReply:
        """Set the retention policy; returns it (``keep_last, min_replicas, pinned``)."""
        return self.request(SetRetentionRequest(model=model, keep_last=keep_last,
                                                min_replicas=min_replicas), PolicyReply)

    def pin(self, model: str, version: int) -> PolicyReply:
        """Retain a version regardless of ``keep_last``; returns the policy."""
        return self.request(PinRequest(model=model, version=version, pinned=True), PolicyReply)

    def unpin(self, model: str, version: int) -> PolicyReply:
        """Undo `pin`; returns the policy."""
        return self.request(PinRequest(model=model, version=version, pinned=False),
                            PolicyReply)

    def latest(self, model: str) -> int | None:
        """The newest committed version with a live complete replica, or None."""
        return self.request(LatestRequest(model=model), VersionReply).version

    def wait_version(self, model: str, *, after: int = 0, timeout: float = 30.0) -> int:
        """Block until `latest` is newer than ``after``; returns it.

        The hub holds the request (long-poll, no busy loop), in slices of at most 10 s
        so other threads of this client get the main socket between them.

        Raises:
            WaitTimeoutError: none newer within ``timeout`` seconds (never a None that a
                fetch could take for a version).
        """
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            piece = max(0.0, min(left, 10.0))
            v = self.request(WaitVersionRequest(model=model, after=after, timeout=piece),
                             VersionReply, wait_s=piece).version
            if v is not None:
                return v
            if left <= piece:
                raise WaitTimeoutError(f"no version of {model!r} newer than v{after} was "
                                       f"committed within {timeout:g} s")

    def wait_commit(self, model: str, version: int, *, shard: int = 0,
                    timeout: float = 30.0) -> list[int]:
        """Block until ``version`` of ``model`` is committed; returns ``shard``'s checksums.

        For a reader copying a derived version while its deriver makes it (`begin_fetch`
        plans it before the commit): the checksums the deriver committed, one per chunk.
        The hub holds the request (long-poll), in slices of at most 10 s.

        Raises:
            UnknownVersionError: the version was retired instead (its deriver failed or
                left); the message says why.
            WaitTimeoutError: still not committed after ``timeout`` seconds.
        """
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            piece = max(0.0, min(left, 10.0))
            out = self.request(WaitCommitRequest(model=model, version=version, shard=shard,
                                                 timeout=piece), CommitWaitReply, wait_s=piece)
            if out.state == "committed":
                with self._lock:   # a copy begun before the commit: what a restore sends
                    h = self._holdings.get((model, version, shard))
                    if h is not None and not h.manifest.checksums:
                        h.manifest = replace(h.manifest, checksums=tuple(out.checksums))
                return out.checksums
            if out.state != "publishing":
                raise UnknownVersionError(f"{model!r} v{version} is {out.state}"
                                          f"{': ' + out.reason if out.reason else ''}")
            if left <= piece:
                raise WaitTimeoutError(f"{model!r} v{version} was not committed within "
                                       f"{timeout:g} s")

    def kv_put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        """Publish a small value under ``key`` for others to `kv_get` (rendezvous).

        For bootstrapping handshakes (an NVSHMEM unique id, an address). Keys share one
        namespace per hub (prefix them, e.g. ``"job-7/nvshmem-uid"``); a put overwrites.
        Kept in the hub's records with their owner: a hub with a state dir, or hubs over
        etcd, keep them across restarts and failovers (a hub without either loses them).

        Args:
            key: non-empty, at most 256 bytes of UTF-8.
            value: at most 64 KiB.
            ttl: seconds until the key vanishes (None: as long as the records are kept).

        Raises:
            ValueTooLargeError: ``value`` or ``key`` over the limit (or the hub is full).
            BadRequestError: empty key, or a ``ttl`` that is not a finite number > 0.
            TypeError: ``value`` is not bytes.
            HubTimeoutError: the hub did not answer.

        Example::

            client.kv_put("job-7/nvshmem-uid", uid_bytes, ttl=600)   # rank 0
            uid = client.kv_get("job-7/nvshmem-uid", timeout=60)     # every other rank
        """
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        value = bytes(value)
        if len(value) > MAX_KV_VALUE:
            raise ValueTooLargeError(f"value for key {key!r} is {len(value)} bytes, over the "
                                     f"{MAX_KV_VALUE}-byte limit of the rendezvous store")
        self.request(KvPutRequest(key=key, value=value,
                                  ttl=None if ttl is None else float(ttl)), KvPutReply)

    def kv_get(self, key: str, *, timeout: float = 30.0) -> bytes:
        """The value under ``key``, waiting (hub-side long poll) until someone puts it.

        Args:
            key: the key a peer passed to `kv_put`.
            timeout: seconds to wait for the key to appear (0: answer at once).

        Returns:
            The value's bytes.

        Raises:
            HubTimeoutError: the key did not appear within ``timeout`` (or the hub did
                not answer).
            BadRequestError: empty key.
        """
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            piece = max(0.0, min(left, 10.0))
            value = self.request(KvGetRequest(key=key, timeout=piece), KvGetReply,
                                 wait_s=piece).value
            if value is not None:
                return value
            if left <= piece:
                raise HubTimeoutError(f"rendezvous key {key!r} did not appear on {self.url} "
                                      f"within {timeout:g} s; did the peer kv_put it (to this "
                                      "hub, before it restarted)?")

    def status(self) -> StatusReply:
        """The hub's snapshot (what `fabric hub status` shows), as plain data."""
        return self.request(StatusRequest(), StatusReply)

    def unregister(self) -> None:
        """Leave now: the hub drops this worker's replicas and fetches.

        Heartbeats stop first, and no later call registers the worker again by itself, so
        its id is free at once for a new client (a heartbeat after the unregister would
        have registered it again, and held the id for a lease).
        """
        self._stop_heartbeats()
        self._left = True
        self.request(UnregisterRequest(worker=self._me()), EmptyReply)
        with self._lock:
            self._holdings.clear()


def connect(url: str | list[str], *, worker: str | None = None,
            location: Location | dict[str, str] | None = None,
            endpoints: Endpoints | None = None, timeout: float = 10.0,
            heartbeat: bool = True, secret: str | None = None,
            secret_file: str | Path | None = None, insecure: bool = False) -> HubClient:
    """Connect to a hub; with ``worker``, register it and keep its lease by heartbeat.

    Args:
        url: ``tcp://HOST:PORT`` or ``memory://NAME``; the hubs of a service (hubs over one
            etcd, ``fabric hub serve --store etcd://...``) as a list or comma-separated:
            the client finds the leader and moves on by itself when it changes.
        worker: unique worker id (None: an observer that can only query).
        location: datacenter/node/device, used to rank sources.
        endpoints: how peers reach this worker's data plane (opaque to the hub).
        timeout: seconds any single call may take (long polls add their wait).
        heartbeat: run the heartbeat thread (tests turn it off to simulate a hang).
        secret, secret_file: the credential to sign requests with: a deployment secret or
            a token, as text or in a file (default: ``WEIGHTFABRIC_SECRET_FILE``, else
            `fabric.auth.default_secret_path`, the file `fabric hub serve` creates).
        insecure: sign nothing and trust unsigned replies (a hub run with ``--insecure``).

    Returns:
        An open `HubClient`; ``close()`` it (or use ``with``).

    Raises:
        HubUnavailableError: nothing answers at ``url`` within ``timeout``.
        DuplicateWorkerError: ``worker`` is already registered by a live client.
        AuthenticationError: no usable credential, or the hub refused it.
        ForbiddenError: the credential may not register a worker.
    """
    return HubClient(url, worker=worker, location=location, endpoints=endpoints,
                     timeout=timeout, heartbeat=heartbeat, secret=secret,
                     secret_file=secret_file, insecure=insecure).open()


__all__ = ["FetchPlan", "HubClient", "PlanRange", "SourceInfo", "connect", "locate_data"]
