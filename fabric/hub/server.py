"""The hub process: a zmq ROUTER serving `HubState` operations.

One thread owns the socket and the state (no locks): it receives a request,
decodes it (`fabric.protocol`; its body into the operation's request type from
`fabric.hub_messages`, once: a bad field is a `BadRequestError` naming the op and
the field), runs the operation (`fabric.hub.ops`), persists
new version counters when a state dir is set, and replies. Long-polls are parked
and answered when the state changes or their deadline passes; a timer tick
expires leases even when no request arrives. Bad frames get a typed error reply
(or are dropped when not even the sender can be told) and never stop the loop.

Authentication (`fabric.auth`), on unless ``insecure``: each request carries a
third frame signed with the caller's credential; the hub checks it, checks the
caller's rights for the operation (`fabric.hub.rights`), binds the client session to
that credential, signs its reply with the caller's key, and adds read capabilities
to plans and locate answers (minted with each holder's serving key, recorded when
the holder registered). An unauthenticated request gets an unsigned error.

Use `serve` for a hub on a background thread, `HubServer.serve_forever` for the
`fabric hub serve` command.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from weightfabric.fabric.auth import (
    ADMIN,
    CAP_TTL_S,
    Authority,
    CapabilityBody,
    MacKey,
    Principal,
    Verified,
    ensure_secret,
    reply_mac,
    scope_of,
    serving_key,
)
from weightfabric.fabric.errors import (
    AuthenticationError,
    BadRequestError,
    HubError,
    NotLeaderError,
    ProtocolError,
    StoreUnavailableError,
)
from weightfabric.fabric.hub.ops import OPS, READ_ONLY, Answer, Park, latest_of
from weightfabric.fabric.hub.persist import DurableState
from weightfabric.fabric.hub.planned import PlanRouter
from weightfabric.fabric.hub.record_store import DirRecords, MemoryRecords, RecordStore
from weightfabric.fabric.hub.rights import Rights
from weightfabric.fabric.hub.state import (
    DEFAULT_LEASE_S,
    HEARTBEAT_RATE,
    REPORT_BUDGET,
    HubState,
)
from weightfabric.fabric.hub_messages import (
    BATCHABLE,
    NO_MANIFEST,
    BatchReply,
    BatchRequest,
    BeginFetchesReply,
    BeginFetchesRequest,
    BeginFetchRequest,
    DeriveReply,
    ErrorBody,
    KvPutRequest,
    LocateReply,
    ManifestWire,
    PlanReply,
    RegisterRequest,
    Request,
    RestoreReply,
    StatusRequest,
)
from weightfabric.fabric.locality import RankSources, rank_by_locality
from weightfabric.fabric.protocol import (
    ERROR,
    MAX_MESSAGE_SIZE,
    PROTOCOL_VERSION,
    REPLY,
    REQUEST,
    Message,
    decode,
    decode_body,
    encode,
    peek_req_id,
    peek_version,
)
from weightfabric.fabric.serving import Served
from weightfabric.fabric.zmq_util import encrypted, endpoint, make_socket, url_of

if TYPE_CHECKING:
    from weightfabric.fabric.hub.service import HubService
    from weightfabric.fabric.metrics import HubMetrics

log = logging.getLogger(__name__)

Sourced = TypeVar("Sourced", PlanReply, LocateReply)
R = TypeVar("R", bound=Request)

TICK_S = 0.05
STALL_MIN_S = 0.5  # the shortest gap between the loop's looks at its leases that is a stall
REPLY_CACHE_SIZE = 65_536            # replies kept for retries: at most this many
REPLY_CACHE_BYTES = 256 * 1024 ** 2  # and at most this many bytes, oldest out first
MAX_SESSIONS = 1 << 20               # session -> credential bindings kept, oldest out first
MAX_CAP_KEYS = 4096                  # serving keys kept ready to sign capabilities (`MacKey`)
MANIFESTS_KEPT = 8                   # plans' manifests kept encoded (`_plan_body`)
BATCH = 1024                         # requests read per pass of the loop, then timers and polls
FLUSH_EVERY = 64                     # replies queued at most before they are sent
MAX_BATCH = 4096                     # requests in one relay batch at most (`_batch`)
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)  # no enums
_SEND_MORE = _NOBLOCK | _SNDMORE
# Replies and requests that `HubServer._after` completes; the others pass through untouched.
_COMPLETED_REPLIES = (PlanReply, LocateReply, DeriveReply, RestoreReply, dict)
_NOTED_REQUESTS = (RegisterRequest, StatusRequest, KvPutRequest)


@dataclass
class _Parked:
    ident: bytes
    req_id: int
    session: str
    park: Park
    deadline: float
    cache: bool
    caller: Verified | None
    after: Callable[[Answer], Answer]
    """What authentication adds to the reply (`HubServer._after`)."""


class HubServer(Served):
    """A hub bound to ``url``; `start` runs it on a daemon thread (`Served`).

    Args:
        url: ``tcp://HOST:PORT`` (port 0 lets the OS pick), ``curve://HOST:PORT`` (the
            channel encrypted, `fabric.auth`) or ``memory://NAME``.
        state_dir: where version counters and retention policies survive restarts.
        store: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: keep the records in etcd and
            serve as one of the hubs sharing them (`fabric.hub.service`): the elected one
            leads, the others answer `NotLeaderError` until they win. Not with ``state_dir``.
        lease_s: worker lease; heartbeats every ``lease_s / 3`` keep it.
        clock: monotonic time source (tests inject one).
        rank_sources: source ranking for plans (default: locality; with ``plan_routing``, its
            topology ranker).
        plan_routing: plan each version's broadcast over a cluster and route its planned
            readers along it (`fabric.hub.planned.plan_router`).
        max_message_size: bytes; larger frames are dropped by zmq and refused by the codec.
        secret_file: the deployment secret (default `fabric.auth.default_secret_path`),
            created (mode 0600) if missing.
        insecure: serve anyone, unauthenticated (logged loudly, shown by `fabric hub
            status`); no secret file is read.
        cap_ttl_s: seconds the read capabilities in plans stay valid.
        metrics_port: serve Prometheus metrics on this HTTP port (0: the OS picks) from
            `start` or `serve_forever` until `stop` (`fabric.metrics`; the ``metrics``
            extra); read ``metrics_url``. None (default): none.
        metrics_host: the address the metrics are served on.
        report_budget: progress reports one shard's fetches in flight are asked for in all
            (`fabric.hub.state.REPORT_BUDGET` by default; None: as many as readers send).
        heartbeat_rate: heartbeats per second the leases ask for at most: with more than
            ``heartbeat_rate * lease_s / 3`` workers the lease grows
            (`fabric.hub.state.HEARTBEAT_RATE` by default; None: never).

    Raises:
        ValueError: the state file is corrupt, the state dir cannot be created or
            written (checked here, not at the first version), ``lease_s <= 0``, a bad
            ``store`` URL, or an etcd key space some other program wrote.
        StoreUnavailableError: the etcd of ``store`` does not answer.
        AuthenticationError: the secret file is unsafe or not a secret.
        ImportError: ``metrics_port`` without ``prometheus-client`` installed.
    """

    def __init__(self, url: str = "tcp://127.0.0.1:0", *, state_dir: str | Path | None = None,
                 store: str | None = None,
                 lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic,
                 rank_sources: RankSources | None = None,
                 plan_routing: PlanRouter | None = None,
                 max_message_size: int = MAX_MESSAGE_SIZE,
                 secret_file: str | Path | None = None, insecure: bool = False,
                 cap_ttl_s: float = CAP_TTL_S, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1",
                 report_budget: int | None = REPORT_BUDGET,
                 heartbeat_rate: float | None = HEARTBEAT_RATE) -> None:
        if metrics_port is not None:
            from weightfabric.fabric.metrics import require

            require()
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics: HubMetrics | None = None
        """The Prometheus exporter while serving with a ``metrics_port``."""
        self.requested_url = url
        self.authority: Authority | None = None
        self.secret_created = False
        if not insecure:
            path, self.secret_created = ensure_secret(secret_file)
            self.authority = Authority(path)
        self.cap_ttl_s = cap_ttl_s
        self.rights = Rights()
        # worker -> the key its read server checks capabilities with, ready to sign with
        self._serve_keys: dict[str, MacKey] = {}
        self._cap_keys: dict[bytes, MacKey] = {}  # serving key -> its MacKey (shared)
        self._no_key = MacKey(b"")                # a worker that registered unauthenticated
        # manifests of plans, encoded once: id(wire) -> (wire, its msgpack)
        self._manifests: dict[int, tuple[ManifestWire, msgspec.Raw]] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> credential name
        self.state_dir = Path(state_dir) if state_dir is not None else None
        if store is not None and state_dir is not None:
            raise ValueError("a hub keeps its records in a state dir or in etcd, not both")
        self.service: HubService | None = None
        self.records: RecordStore
        if store is not None:
            # etcd's modules only when asked for
            from weightfabric.fabric.hub.service import HubService
            self.service = HubService(store)
            self.records = self.service.records
        else:
            self.records = (DirRecords(self.state_dir) if self.state_dir is not None
                            else MemoryRecords())
        if rank_sources is None:
            rank_sources = plan_routing.ranker if plan_routing is not None else rank_by_locality
        self._new_state = functools.partial(
            HubState, clock=clock, lease_s=lease_s, rank_sources=rank_sources,
            stall_after=max(lease_s / 3, STALL_MIN_S), plan_routing=plan_routing,
            report_budget=report_budget, heartbeat_rate=heartbeat_rate)
        # A hub of a service starts as a standby: it loads the records when it wins.
        self.state = self._new_state(durable=self.records.load() if self.service is None
                                     else DurableState())
        self.clock = clock
        self.max_message_size = max_message_size
        self.epoch = secrets.token_hex(8)
        self.url = ""
        self.num_requests = 0
        self.num_bad_frames = 0
        self.num_refused = 0       # requests refused as unauthenticated
        self._saved_generation = self.state.durable_generation
        self._failed_generation = -1
        self._replies: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._replies_size = 0    # bytes in self._replies
        self._parked: dict[tuple[str, int], _Parked] = {}
        # The parked polls indexed (`_wake_parked` costs what it wakes, not what is parked):
        # deadlines in a heap; version waits per model in a heap on ``after``; the others,
        # checked at each state change.
        self._deadlines: list[tuple[float, int, tuple[str, int]]] = []
        self._version_waits: dict[str, list[tuple[int, int, tuple[str, int]]]] = {}
        self._checked: dict[tuple[str, int], _Parked] = {}
        self._park_seq = itertools.count()
        self._seen_generation = -1
        self._init_serving()
        self._sock: zmq.Socket | None = None
        self._outbox: list[tuple[bytes, bytes, bytes]] = []   # replies to send (`_flush`)
        self._batch_out: list[tuple[bytes, bytes]] | None = None   # a batch's answers
        self.num_batches = 0
        self._leading = self.service is None

    # ------------------------------------------------------------- lifecycle
    thread_name = "fabric-hub"

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ loop
    def _run(self, on_ready: Callable[[str], None] | None = None) -> None:
        sock = None
        try:
            sock = make_socket(zmq.ROUTER, max_message_size=self.max_message_size)
            if encrypted(self.requested_url):
                if self.authority is None:
                    raise AuthenticationError("a curve:// hub needs authentication on: its "
                                              "keys come from the deployment secret")
                sock.curve_server = True
                sock.curve_secretkey = self.authority.curve_secret
            sock.bind(endpoint(self.requested_url, bind=True))
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.url = url_of(bound, self.requested_url)
            if self.metrics_port is not None:
                from weightfabric.fabric.metrics import HubMetrics

                self.metrics = HubMetrics(self, self.metrics_port, self.metrics_host)
        except BaseException as exc:
            if sock is not None:
                sock.close(0)
            self._error = exc
            self._ready.set()
            return
        self._sock = sock
        log.info("hub serving url=%s epoch=%s records=%s", self.url, self.epoch,
                 self.records.describe)
        if self.metrics is not None:
            log.info("hub metrics at %s", self.metrics.url)
        if self.service is not None:
            self.service.start(self.url)
            log.info("hub %s stands by until it wins the lead", self.url)
        if self.authority is None:
            log.warning("AUTHENTICATION IS OFF (--insecure): anyone who reaches %s can publish "
                        "weights every reader loads, and read every holder's", self.url)
        else:
            log.info("authentication on: secret file %s%s", self.authority.path,
                     " (created)" if self.secret_created else "")
        self._ready.set()
        if on_ready is not None:
            on_ready(self.url)
        try:
            tick_ms = int(TICK_S * 1000)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if poller.poll(tick_ms):
                    self._drain(sock)
                self._guarded(self._tick)
                self._guarded(self._flush)
        finally:
            # zmq frees an address when its reaper thread gets to the closed socket;
            # unbinding first frees it now, so a hub restarted at once can bind it.
            with contextlib.suppress(zmq.ZMQError):
                sock.unbind(bound)
            sock.close(0)
            if self.service is not None:
                self.service.stop()
            if self.metrics is not None:
                self.metrics.close()
            log.info("hub stopped url=%s", self.url)

    def _drain(self, sock: zmq.Socket) -> None:
        """Handle the requests that are ready, at most `BATCH` (then timers get their turn).

        A pass that leaves requests waiting stops the lease clock until a pass finds none
        (`HubState.backlogged`): heartbeats may be waiting behind a burst of plans.
        """
        recv, more = sock.recv, sock.get
        for _ in range(BATCH):
            try:
                frames = [recv(_NOBLOCK)]
                while more(_RCVMORE):
                    frames.append(recv(_NOBLOCK))
            except zmq.Again:
                self.state.backlogged(False)
                return
            self._guarded(self._handle, frames)
        self.state.backlogged(True)

    def _tick(self) -> None:
        self._check_role()
        self.state.expire()
        self._wake_parked()
        with contextlib.suppress(HubError):   # the hub stood down (`_persist`)
            self._persist()

    # ------------------------------------------------------------- service
    @property
    def leading(self) -> bool:
        """Whether this hub serves operations (always, unless it is a standby of a service)."""
        return self._leading

    def _check_role(self) -> None:
        """Take the lead (load the records) or stand down, as the election says."""
        if self.service is None or self.service.is_leader == self._leading:
            return
        if not self._leading:
            try:
                durable = self.records.load()
            except (HubError, ValueError) as exc:
                log.warning("hub %s won the lead but cannot load the records (%s); "
                            "standing down", self.url, exc)
                self.service.step_down()
                return
            self._change_role(self._new_state(durable=durable), leading=True)
            log.warning("hub %s leads now (term %d): %d models loaded from %s", self.url,
                        self.service.terms, len(self.state.models), self.records.describe)
        else:
            self._stand_down("it lost the lead in etcd")

    def _stand_down(self, why: str) -> None:
        """Stop serving: forget the state (the records are in etcd) and campaign again."""
        log.warning("hub %s stands down: %s", self.url, why)
        assert self.service is not None
        self.service.step_down()
        self._change_role(self._new_state(durable=DurableState()), leading=False)

    def _change_role(self, state: HubState, *, leading: bool) -> None:
        """Swap the state; a new epoch tells every client to register again."""
        self.state, self._leading = state, leading
        self.epoch = secrets.token_hex(8)
        self._saved_generation = state.durable_generation
        self._failed_generation = -1
        self._replies.clear()
        self._replies_size = 0
        parked, self._parked = self._parked, {}
        self._deadlines, self._version_waits, self._checked = [], {}, {}
        for p in parked.values():
            self._send(p.ident, self._error_bytes(p.req_id, self._not_leader()), p.caller)

    def _not_leader(self) -> HubError:
        """Why a standby refuses: another hub leads, or etcd has no quorum (no hub can)."""
        view = self.service.view if self.service is not None else {}
        members = view.get("etcd") or []
        healthy = sum(1 for m in members if m.get("healthy"))
        if members and 2 * healthy <= len(members):
            return StoreUnavailableError(
                f"hub {self.url}: etcd has no quorum ({healthy} of {len(members)} members "
                "answer), so no hub may change the records; retry once the members are back")
        leader = view.get("leader")
        there = (f"the leader is {leader}" if leader and leader != self.url
                 else "no hub leads yet (an election is under way)")
        return NotLeaderError(f"hub {self.url} is a standby; {there}")

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one step of the loop; a bug in it is logged, never ends the loop."""
        try:
            fn(*args)
        except Exception:
            log.exception("hub loop step %s failed; serving on", fn.__name__)

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics`` while serving with a ``metrics_port``, else ``""``."""
        return self.metrics.url if self.metrics is not None else ""

    def _timed(self, op: str | None) -> contextlib.AbstractContextManager[Any]:
        """Time the block as operation ``op`` (None: saving the records) when exporting."""
        return self.metrics.timed(op) if self.metrics is not None else contextlib.nullcontext()

    @property
    def auth_mode(self) -> str:
        """What `fabric hub status` shows about authentication."""
        if self.authority is None:
            return "OFF (--insecure): anyone who reaches the hub may publish and read"
        channel = ", channel encrypted (CURVE)" if encrypted(self.requested_url) else ""
        return f"on (secret file {self.authority.path}{channel})"

    def _handle(self, frames: list[bytes]) -> None:
        self.num_requests += 1
        if len(frames) not in (2, 3):
            self.num_bad_frames += 1
            if len(frames) >= 2:
                self._send_error(frames[0], 0, ProtocolError(
                    f"expected a message and an auth frame, got {len(frames) - 1} frames"))
            return
        self._serve(frames[0], frames[1], frames[2] if len(frames) == 3 else None)

    def _serve(self, ident: bytes, payload: bytes, auth: bytes | None, *,
               batched: bool = False, envelope: Verified | None = None) -> None:
        """Answer one request to ``ident`` (``batched``: one of a batch's, answered into it).

        A batch's request without an auth frame is vouched for by whoever signed the batch
        (``envelope``: a relay holding the same credential as its worker, `fabric.relay`):
        it runs as them, and its answer goes back unsigned for the relay to sign.
        """
        try:
            msg = decode(payload, max_size=self.max_message_size)
            if msg.kind != REQUEST:
                raise ProtocolError("the hub only accepts requests")
        except ProtocolError as exc:
            self.num_bad_frames += 1
            log.warning("bad frame from %s: %s", ident.hex() or "a batch", exc)
            # in the sender's version: an older client can read the error and say why
            self._send(ident, self._error_bytes(peek_req_id(payload), exc,
                                                version=peek_version(payload)))
            return
        name = msg.name
        caller: Verified | None
        reply_to: Verified | None
        try:
            if batched and not auth and envelope is not None:
                caller, reply_to = self._vouched(msg.tag, envelope), None
            else:
                caller = reply_to = self._authenticate(msg.tag, payload, auth)
        except AuthenticationError as exc:
            self.num_refused += 1
            log.warning("refused %s from %s: %s", name, ident.hex() or "a batch", exc)
            self._send(ident, self._error_bytes(msg.req_id, exc))
            return
        if name == "batch" and not batched:
            self._batch(ident, msg, caller)
            return
        if name == "begin_fetches":
            self._begin_fetches(ident, msg, caller, vouched=reply_to is None and batched)
            return
        key = (msg.tag, msg.req_id)
        kept = self._replies.get(key)
        if kept is not None:
            self._send(ident, kept, reply_to)
            return
        parked = self._parked.get(key)
        if parked is not None and not batched:
            parked.ident, parked.caller = ident, caller
            return
        op = OPS.get(name)
        cache = name not in READ_ONLY
        try:
            if batched and (name not in BATCHABLE or parked is not None):
                raise BadRequestError(f"{name!r} may not ride in a batch; send it alone")
            if op is None:
                raise BadRequestError(f"unknown operation {name!r}; is the client newer "
                                      "than the hub?")
            if not self._leading and name != "status":
                raise self._not_leader()
            who = caller.principal if caller is not None else ADMIN
            if self.metrics is None:
                req, refused = self.rights.check(self.state, who, name, _request(msg, op.request))
                result = op.handler(self.state, msg.tag, req)
            else:
                with self.metrics.timed(name):   # a name of OPS: bounded
                    req, refused = self.rights.check(self.state, who, name,
                                                     _request(msg, op.request))
                    result = op.handler(self.state, msg.tag, req)
            if isinstance(result, Park):
                if batched:   # a fetch group's completion waits: it came without a timeout
                    raise BadRequestError(f"{name!r} would wait for others: send it alone, "
                                          "not in a batch")
                self._park(key, _Parked(
                    ident, msg.req_id, msg.tag, result, self.clock() + result.timeout, cache,
                    caller, functools.partial(self._after, req, who, caller, refused=refused)))
                return
            if isinstance(result, _COMPLETED_REPLIES) or isinstance(req, _NOTED_REQUESTS):
                result = self._after(req, who, caller, result, refused=refused)
        except HubError as exc:
            self._finish(ident, key, self._error_bytes(msg.req_id, exc), reply_to, cache=cache)
            return
        except (ValueError, TypeError, KeyError) as exc:
            self._finish(ident, key, self._error_bytes(msg.req_id, BadRequestError(
                f"{name}: {exc}")), reply_to, cache=cache)
            return
        except Exception as exc:  # a bug must not take the hub down for everyone
            log.exception("operation %s failed", name)
            self._finish(ident, key, self._error_bytes(msg.req_id, HubError(
                f"internal hub error in {name}: {exc!r}")), reply_to, cache=cache)
            return
        self._finish(ident, key, self._reply_bytes(msg.req_id, result), reply_to, cache=cache)

    def _batch(self, ident: bytes, msg: Message, caller: Verified | None) -> None:
        """Answer a node relay's batch (`fabric.relay`): each request as if it came alone.

        Each request is checked with its own signature and answered with its own (the
        relay, whoever signed the batch, can neither forge nor read more than it carries),
        or, sent without one, runs as the batch's signer, who vouches for it, and is
        answered unsigned (`_vouched`); the answers go back in one reply, in order. Fresh fetches of a node's readers are
        planned together (`HubState.answering_batch`). The batch's reply is not kept for
        retries: its requests' are, each.
        """
        try:
            if not self._leading:
                raise self._not_leader()
            batch = _request(msg, BatchRequest)
            if len(batch.items) > MAX_BATCH:
                raise BadRequestError(f"a batch of {len(batch.items)} requests; at most "
                                      f"{MAX_BATCH}")
        except HubError as exc:
            self._send(ident, self._error_bytes(msg.req_id, exc), caller)
            return
        self.num_batches += 1
        answers: list[tuple[bytes, bytes]] = []
        self._batch_out = answers
        try:
            with self.state.answering_batch():
                for payload, auth in batch.items:
                    self.num_requests += 1
                    self._serve(b"", payload, auth or None, batched=True, envelope=caller)
        finally:
            self._batch_out = None
        self._send(ident, self._reply_bytes(msg.req_id, BatchReply(items=answers)), caller)

    def _begin_fetches(self, ident: bytes, msg: Message, caller: Verified | None, *,
                       vouched: bool) -> None:
        """Begin the fetches of a node's readers its relay joined (`fabric.node_begins`).

        Each reader's fetch begins as its ``begin_fetch`` alone would (its session bound to
        the batch's signer, who vouched for it); the answers go back in one
        `BeginFetchesReply`, the manifest once, for the relay to answer each reader. No
        reply is kept for retries: a retried ``begin_fetch`` resumes its fetch. A reader
        whose begin would wait (a planned reader's upstreams not begun) is left for its
        request to come alone.
        """
        try:
            if not vouched:
                raise BadRequestError("begin_fetches rides only in a batch, vouched for by "
                                      "the batch's signer")
            if not self._leading:
                raise self._not_leader()
            req = _request(msg, BeginFetchesRequest)
        except HubError as exc:
            self._send(ident, self._error_bytes(msg.req_id, exc))
            return
        who = caller.principal if caller is not None else ADMIN
        begin = OPS["begin_fetch"].handler
        plans: list[PlanReply | None] = []
        errors: list[tuple[str, str] | None] = []
        manifest: ManifestWire | None = None
        self.num_requests += len(req.readers) - 1     # the batch counted one request
        for r in req.readers:
            plan: PlanReply | None = None
            error: HubError | None = None
            try:
                with self._timed("begin_fetch"):
                    if caller is not None:
                        self._bind(r.session, who.name)
                    one, refused = self.rights.check(self.state, who, "begin_fetch",
                                                     BeginFetchRequest(
                        worker=r.worker, model=req.model, fetch_id=r.fetch_id,
                        version=req.version, shard=req.shard, fingerprint=req.fingerprint))
                    result = begin(self.state, r.session, one)
                    if not isinstance(result, Park):
                        result = self._after(one, who, caller, result, refused=refused)
                        assert isinstance(result, PlanReply)
                        manifest = result.manifest or manifest
                        plan = msgspec.structs.replace(result, manifest=None)
            except HubError as exc:
                error = exc
            except (ValueError, TypeError, KeyError) as exc:
                error = BadRequestError(f"begin_fetch: {exc}")
            except Exception as exc:  # a bug must not take the hub down for everyone
                log.exception("operation begin_fetch failed")
                error = HubError(f"internal hub error in begin_fetch: {exc!r}")
            plans.append(plan)
            errors.append(None if error is None else (error.code, str(error)[:4096]))
        try:
            self._persist()
        except HubError as exc:
            self._send(ident, self._error_bytes(msg.req_id, exc))
            return
        raw = NO_MANIFEST if manifest is None else self._manifest_raw(manifest)
        self._send(ident, self._reply_bytes(msg.req_id, BeginFetchesReply(
            manifest=raw, plans=plans, errors=errors)))

    def _authenticate(self, session: str, payload: bytes, auth: bytes | None) -> Verified | None:
        """Who signed the request (None when authentication is off); binds ``session`` to them.

        Raises:
            AuthenticationError: unsigned, badly signed, replayed, or a session another
                credential opened.
        """
        if self.authority is None:
            return None
        if not auth:
            raise AuthenticationError(
                "this hub requires authentication: give the client the hub's secret file "
                "(or a token from `fabric hub token`) as secret_file= or in "
                "WEIGHTFABRIC_SECRET_FILE")
        caller = self.authority.verify(payload, auth)
        self._bind(session, caller.principal.name)
        return caller

    def _vouched(self, session: str, envelope: Verified) -> Verified:
        """The caller of a batch's request its signer vouched for: the signer, in ``session``.

        Raises:
            AuthenticationError: the session belongs to another credential.
        """
        self._bind(session, envelope.principal.name)
        return Verified(envelope.principal, envelope.key, b"")

    def _bind(self, session: str, name: str) -> None:
        """Bind ``session`` to credential ``name`` (the first to use it keeps it)."""
        sessions = self._sessions
        owner = sessions.get(session)
        if owner is None:
            sessions[session] = name
            while len(sessions) > MAX_SESSIONS:
                sessions.popitem(last=False)
        elif owner != name:
            raise AuthenticationError(f"session {session} belongs to another credential")
        else:
            sessions.move_to_end(session)

    def _after(self, req: Request, who: Principal, caller: Verified | None, result: Answer, *,
               refused: list[tuple[str, int, int, str]]) -> Answer:
        """An operation's reply completed with what authentication adds.

        Records a registering worker's serving key and a kv key's owner, adds read
        capabilities to plans and locate answers, the restore holdings `Rights` refused, and
        the authentication mode to ``status``.
        """
        self.rights.wrote(self.state, who, req)
        if isinstance(req, RegisterRequest) and caller is not None:
            self._serve_keys[req.worker] = self._signer(serving_key(caller.key))
        if isinstance(result, RestoreReply) and refused:
            return msgspec.structs.replace(result, rejected=[*result.rejected, *refused])
        if isinstance(req, StatusRequest) and isinstance(result, dict):
            service = (self.service.status() if self.service is not None
                       else {"role": "single", "url": self.url, "store": self.records.describe})
            return {**result, "auth": self.auth_mode, "service": service}
        reader = getattr(req, "worker", None) or who.name
        if isinstance(result, PlanReply) and caller is not None:
            return self._with_caps(result, reader)
        if isinstance(result, LocateReply) and caller is not None:
            return self._with_caps(result, reader)
        if isinstance(result, DeriveReply) and result.base is not None and caller is not None:
            return msgspec.structs.replace(result, base=self._with_caps(result.base, reader))
        return result

    def _with_caps(self, result: Sourced, reader: str) -> Sourced:
        """``result`` (a plan or locate answer) with a read capability for each source.

        The capabilities say the same (this reader, this version, one expiry): their body is
        encoded once (`CapabilityBody`), and each is signed with its holder's serving key,
        kept ready to sign with (`MacKey`).
        """
        body = CapabilityBody(scope_of(result.model, result.version), reader,
                              time.time() + self.cap_ttl_s)
        keys, none = self._serve_keys, self._no_key
        replace = msgspec.structs.replace
        workers = {w: replace(src, cap=body.sign(keys.get(w, none)))
                   for w, src in result.workers.items()}
        return replace(result, workers=workers)

    def _signer(self, key: bytes) -> MacKey:
        """``key`` ready to sign with; one per key (workers of one credential share one)."""
        signer = self._cap_keys.get(key)
        if signer is None:
            if len(self._cap_keys) >= MAX_CAP_KEYS:
                self._cap_keys.clear()
            signer = self._cap_keys[key] = MacKey(key)
        return signer

    def _finish(self, ident: bytes, key: tuple[str, int], data: bytes,
                caller: Verified | None, *, cache: bool) -> None:
        """Persist, send the reply, and keep it for retries unless ``cache`` is false."""
        try:
            self._persist()
        except HubError as exc:
            data = self._error_bytes(key[1], exc)
        except Exception as exc:  # answer anyway: the caller must not wait for nothing
            log.exception("saving the hub state failed")
            data = self._error_bytes(key[1], HubError(
                f"internal hub error: could not save the hub state ({exc!r}); the operation "
                "may have taken effect in memory only; check the hub's log and state dir"))
        if cache:
            self._remember(key, data)
        self._send(ident, data, caller)

    def _remember(self, key: tuple[str, int], data: bytes) -> None:
        """Keep a reply for retries of its request.

        The oldest go first beyond `REPLY_CACHE_SIZE` replies or `REPLY_CACHE_BYTES` bytes.
        """
        self._replies[key] = data
        self._replies_size += len(data)
        while (len(self._replies) > REPLY_CACHE_SIZE
               or self._replies_size > REPLY_CACHE_BYTES):
            self._replies_size -= len(self._replies.popitem(last=False)[1])

    def _park(self, key: tuple[str, int], p: _Parked) -> None:
        """Hold a long poll until its answer is ready or its deadline passes."""
        self._parked[key] = p
        seq = next(self._park_seq)
        heapq.heappush(self._deadlines, (p.deadline, seq, key))
        if p.park.model is not None:     # a version wait: woken by its model's latest only
            heapq.heappush(self._version_waits.setdefault(p.park.model, []),
                           (p.park.after, seq, key))
        else:
            self._checked[key] = p

    def _unpark(self, key: tuple[str, int]) -> _Parked:
        """Take a parked poll out (its heap entries go when they come up)."""
        p = self._parked.pop(key)
        self._checked.pop(key, None)
        return p

    def _wake_parked(self) -> None:
        """Answer the parked polls whose answer is ready, or whose deadline passed.

        Costs what it answers: a state change checks the version waits of each model
        against its latest version once (a heap on ``after``), and the other polls each;
        deadlines come off a heap.
        """
        if not self._parked:
            return
        if self.state.generation != self._seen_generation:
            self._seen_generation = self.state.generation
            for model, waits in list(self._version_waits.items()):
                latest = latest_of(self.state, model)
                later = []
                while waits and latest is not None and waits[0][0] < latest:
                    entry = heapq.heappop(waits)
                    p = self._parked.get(entry[2])
                    if (p is not None and p.park.model == model and p.park.after == entry[0]
                            and not self._answer(entry[2], p, p.park.check)):
                        later.append(entry)
                for entry in later:
                    heapq.heappush(waits, entry)
                if not waits:
                    del self._version_waits[model]
            for key, p in list(self._checked.items()):
                self._answer(key, p, p.park.check)
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, key = heapq.heappop(self._deadlines)
            p = self._parked.get(key)
            if p is not None and p.deadline == deadline:
                self._answer(key, p, p.park.on_timeout)
        self._compact_parked()

    def _compact_parked(self) -> None:
        """Rebuild the heaps when answered polls' entries outnumber the live ones.

        Entries of polls answered otherwise stay in a heap until they come up, so a poll
        asked again and again (a wait that times out and is renewed while no version
        comes) would grow it without bound.
        """
        live = len(self._parked)
        entries = len(self._deadlines) + sum(len(w) for w in self._version_waits.values())
        if entries <= 4 * live + 64:
            return
        self._deadlines = []
        self._version_waits = {}
        for key, p in self._parked.items():
            seq = next(self._park_seq)
            self._deadlines.append((p.deadline, seq, key))
            if p.park.model is not None:
                self._version_waits.setdefault(p.park.model, []).append((p.park.after, seq, key))
        heapq.heapify(self._deadlines)
        for waits in self._version_waits.values():
            heapq.heapify(waits)

    def _answer(self, key: tuple[str, int], p: _Parked, ask: Callable[[], Answer | None]
                ) -> bool:
        """Answer parked poll ``p`` with what ``ask`` says, if anything; whether it did."""
        try:
            body = ask()
            if body is None:
                return False
            body = p.after(body)
        except HubError as exc:   # e.g. the parked fetch ended meanwhile
            self._unpark(key)
            self._finish(p.ident, key, self._error_bytes(p.req_id, exc), p.caller,
                         cache=p.cache)
            return True
        self._unpark(key)
        self._finish(p.ident, key, self._reply_bytes(p.req_id, body), p.caller, cache=p.cache)
        return True

    def _persist(self) -> None:
        """Save the durable state if it changed.

        A hub of a service that cannot save stands down at once (its state in memory
        holds what etcd does not) and raises the typed error for the reply.

        Raises:
            NotLeaderError, StoreUnavailableError: see `RecordStore.save`.
            Exception: whatever else saving raised (once per state generation: the timer
                tick does not retry a failed generation, the next change does).
        """
        generation = self.state.durable_generation
        if generation in (self._saved_generation, self._failed_generation):
            return
        try:
            with self._timed(None):
                self.records.save(self.state.durable())
        except (NotLeaderError, StoreUnavailableError) as exc:
            if self.service is None:
                raise
            self._stand_down(f"its records could not be saved: {exc}")
            raise type(exc)(f"{exc}; nothing of this operation was kept (this hub stood "
                            "down; retry: the leader, once there is one, answers)") from exc
        except Exception:
            self._failed_generation = generation
            raise
        self._saved_generation = generation

    # --------------------------------------------------------------- replies
    def _reply_bytes(self, req_id: int, body: Answer) -> bytes:
        try:
            if type(body) is PlanReply and body.manifest is not None:
                body = self._plan_body(body)
            return encode(REPLY, req_id, self.epoch, "", body, max_size=self.max_message_size)
        except ProtocolError as exc:
            return self._error_bytes(req_id, exc)

    def _plan_body(self, plan: PlanReply) -> PlanReply:
        """``plan`` with its manifest already encoded, the same bytes.

        Every reader of a version is sent the same manifest object (one checksum per chunk,
        `fabric.hub.state_fetch`): its msgpack is made once and spliced into each plan
        (`msgspec.Raw`): 1,024 checksums cost about 10 µs to encode, most of the reply's.
        """
        assert plan.manifest is not None
        return msgspec.structs.replace(plan, manifest=self._manifest_raw(plan.manifest))

    def _manifest_raw(self, wire: ManifestWire) -> msgspec.Raw:
        """The msgpack of a manifest planned, made once per manifest object."""
        kept = self._manifests.get(id(wire))
        if kept is None or kept[0] is not wire:
            if len(self._manifests) >= MANIFESTS_KEPT:
                self._manifests.pop(next(iter(self._manifests)))
            kept = self._manifests[id(wire)] = (wire, msgspec.Raw(msgspec.msgpack.encode(wire)))
        return kept[1]

    def _error_bytes(self, req_id: int, exc: HubError, *,
                     version: int = PROTOCOL_VERSION) -> bytes:
        return encode(ERROR, req_id, self.epoch, exc.code, ErrorBody(message=str(exc)[:4096]),
                      version=version)

    def _send_error(self, ident: bytes, req_id: int, exc: HubError) -> None:
        self._send(ident, self._error_bytes(req_id, exc))

    def _send(self, ident: bytes, data: bytes, caller: Verified | None = None) -> None:
        """Queue a reply, signed for ``caller`` (unsigned without one: refusals, insecure hubs).

        Replies leave in bursts (`_flush`, at most `FLUSH_EVERY` queued): zmq's I/O thread,
        woken once for a burst rather than once per reply, writes them all.
        """
        auth = reply_mac(caller.key, caller.mac, data) if caller is not None else b""
        if not ident:                 # an answer to one of a batch's requests (`_batch`)
            assert self._batch_out is not None
            self._batch_out.append((data, auth))
            return
        self._outbox.append((ident, data, auth))
        if len(self._outbox) >= FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        """Send the queued replies."""
        if not self._outbox:
            return
        assert self._sock is not None
        send = self._sock.send
        out, self._outbox = self._outbox, []
        for ident, data, auth in out:
            try:
                send(ident, _SEND_MORE)
                send(data, _SEND_MORE)
                send(auth, _NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: it will retry
                log.warning("reply to %s dropped: %s", ident.hex(), exc)


_AT = re.compile(r"^(?P<what>.*) - at `\$\.?(?P<path>[^`]*)`$", re.DOTALL)


def _request(msg: Message, request: type[R]) -> R:
    """``msg``'s body as the operation's request type.

    Raises:
        BadRequestError: a missing, unknown or mistyped field (the message names the
            operation and the field).
        ProtocolError: a body that is not msgpack (`decode` already let it pass).
    """
    try:
        return decode_body(msg, request)
    except msgspec.ValidationError as exc:
        m = _AT.match(str(exc))
        where = f"argument {m['path']!r}: {m['what']}" if m else str(exc)
        raise BadRequestError(f"{msg.name}: {where}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{msg.name}: undecodable arguments: {exc}") from exc


def serve(url: str = "tcp://127.0.0.1:0", *, state_dir: str | Path | None = None,
          lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic,
          rank_sources: RankSources | None = None, plan_routing: PlanRouter | None = None,
          max_message_size: int = MAX_MESSAGE_SIZE, secret_file: str | Path | None = None,
          insecure: bool = False, cap_ttl_s: float = CAP_TTL_S,
          metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
          report_budget: int | None = REPORT_BUDGET,
          heartbeat_rate: float | None = HEARTBEAT_RATE) -> HubServer:
    """Start a hub on a background thread.

    Args:
        url: ``tcp://HOST:PORT`` (port 0: the OS picks; read ``server.url``) or
            ``memory://NAME`` (same process only).
        state_dir: directory keeping version counters monotonic across restarts.
        lease_s: seconds a worker stays alive without a heartbeat.
        clock, rank_sources, plan_routing, max_message_size: see `HubServer`.
        secret_file, insecure, cap_ttl_s: authentication (`HubServer`, `fabric.auth`): by
            default requests must be signed with the secret at
            `fabric.auth.default_secret_path` (created if missing).
        metrics_port, metrics_host: serve Prometheus metrics over HTTP (`HubServer`;
            port 0: the OS picks, read ``server.metrics_url``).
        report_budget, heartbeat_rate: see `HubServer`.

    Returns:
        The running `HubServer`; call ``stop()`` (or use it as a context manager).

    Example:
        >>> hub = serve("memory://doc")
        >>> hub.url
        'memory://doc'
        >>> hub.stop()
    """
    return HubServer(url, state_dir=state_dir, lease_s=lease_s, clock=clock,
                     rank_sources=rank_sources, plan_routing=plan_routing,
                     max_message_size=max_message_size,
                     secret_file=secret_file, insecure=insecure, cap_ttl_s=cap_ttl_s,
                     metrics_port=metrics_port, metrics_host=metrics_host,
                     report_budget=report_budget, heartbeat_rate=heartbeat_rate).start()


__all__ = ["HubServer", "serve"]
