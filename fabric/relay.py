"""A node relay: one process per node that forwards its workers' hub requests in batches.

A hub answers every worker itself: at 10,000 rollout GPUs that is 10,000 plans, 10,000
completions and thousands of heartbeats per version, each a message with its own system
calls and its own pass through the hub's loop. A relay on each node takes its workers'
requests (they connect to it as to the hub: ``connect(relay.url)``), sends those that
answer at once (`fabric.hub_messages.BATCHABLE`: heartbeats, plans, reports, completions)
to the hub as one ``batch`` message per few milliseconds, and hands each answer back. The
hub answers a batch's requests as if each came alone and plans the node's readers of a
version together: the first routed, the others waiting on it (`fabric.hub.node_plans`), so
a node's chunks cross the network once. The fresh begins of one shard in a batch go as one
request, answered with the manifest once (`fabric.node_begins`).

The relay is trusted with no more than the credential it holds. A request signed with
another credential keeps its worker's signature, and its answer the hub's signature for
that worker, checked by the hub and the worker as without a relay; the relay signs only
the envelope (any credential of the deployment will do: a read token is enough). A
request signed with the relay's own credential (the usual case: a node's workers and its
relay share the node's secret file or token) is checked by the relay, which could have
signed it itself, and goes without its signature, vouched for by the batch's; the relay
signs its answer as the hub would have, for that request. That spares the hub two HMACs
and a replay check per request, about a third of what a request in a batch costs it.
A relay keeps one batch on its way at a time: what its workers send while the hub has
not answered waits for that answer (or `AWAIT_S`), then goes in the next batch. A busy
hub so gets fewer, larger batches, each node's requests of its last round trip in one,
instead of more messages the busier it is (the relay's requests are spread in time when
its readers start at different moments; held together they still cost the hub one
message per round trip).
Requests that wait at the hub (``wait_version``, ``wait_commit``, a fetch
group's ``complete_fetch``), publishes and everything else go through unbatched, each
worker on a connection of its own. A batch the hub refuses (an older hub, one that does
not lead) is sent again request by request, so each worker gets the hub's own answer. A
relay that stops loses nothing: its workers' requests are retried by their clients, and a
retried request the hub already answered is answered from its reply cache. Given the
hubs of a service (``--hub URL,URL``: hubs over etcd, docs/operations.md), a relay
forwards to one and moves to the next when it answers `NotLeaderError` or leaves a
batch unanswered for `fabric.client.SERVICE_TRY_S`, as clients of several hubs do; the
requests it was carrying go to the next hub.

Run one with ``fabric hub relay --hub URL`` (docs/hub.md, "Node relays").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import msgspec
import zmq

from weightfabric.fabric.auth import Credential, ReplayGuard, load_credential, reply_mac
from weightfabric.fabric.client import SERVICE_TRY_S
from weightfabric.fabric.errors import NotLeaderError, ProtocolError
from weightfabric.fabric.hub_messages import BATCHABLE, BatchReply, BatchRequest
from weightfabric.fabric.node_begins import Item, join, split
from weightfabric.fabric.protocol import (
    ERROR,
    MAX_MESSAGE_SIZE,
    REPLY,
    REQUEST,
    decode,
    decode_body,
    encode,
)
from weightfabric.fabric.serving import Served
from weightfabric.fabric.zmq_util import endpoint, hub_socket, make_socket, url_of

log = logging.getLogger(__name__)

WINDOW_S = 0.005
"""How long a relay holds the first request of a batch for others to join it."""
AWAIT_S = 1.0
"""How long a batch on its way holds the next one back: after that (a hub that lost it, or
is this slow), the next goes anyway."""
MAX_ITEMS = 512
"""Requests in one batch at most (the hub takes up to `fabric.hub.server.MAX_BATCH`)."""
MAX_BATCH_BYTES = 4 << 20
"""Request bytes in one batch at most: its answers (plans carry manifests) must fit a
message too."""
FORGET_S = 60.0
"""A batch not answered by then is forgotten (its workers have retried), and a worker's
unbatched connection idle that long is closed."""
_TICK_MS = 50
_complete_timeout = msgspec.msgpack.Decoder(dict[str, object])


class _Held(NamedTuple):
    """A worker's request held for a batch.

    ``vouched``: its MAC when the relay checked it was signed with the relay's own
    credential (it then goes without its auth frame, and the relay signs the answer).
    """

    ident: bytes
    payload: bytes
    auth: bytes
    vouched: bytes


@dataclass
class _Sent:
    """A batch on its way: its MAC, its requests and its items, in order.

    The requests to answer, or send alone; the items as sent (`fabric.node_begins.join`:
    a node's fresh begins joined).
    """

    mac: bytes
    held: list[_Held]
    items: list[Item]
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Alone:
    """A worker's own connection to the hub, and the last request it carried."""

    sock: zmq.Socket
    at: float
    payload: bytes
    auth: bytes


@dataclass
class RelayStats:
    """What a relay forwarded (``NodeRelay.stats``)."""

    batches: int = 0
    batched: int = 0
    """Requests sent in batches."""
    vouched: int = 0
    """Of those, requests signed with the relay's own credential, sent without their
    signature (the relay checked it, and signs their answers)."""
    joined: int = 0
    """Of those, fresh ``begin_fetch`` requests joined with others of the same shard into
    one (`fabric.node_begins`)."""
    alone: int = 0
    """Requests sent unbatched (they wait at the hub, or the hub refused their batch)."""
    refused_batches: int = 0
    hub_changes: int = 0
    """Moves to the next hub of a service (the one it used did not lead, or went silent)."""
    dropped: int = 0
    """Answers that found no worker (a batch forgotten, a reply not signed for it)."""


class NodeRelay(Served):
    """Forwards the hub requests of one node's workers; `start` runs it on a thread (`Served`).

    Args:
        hub_url: the hub (``tcp://`` or ``curve://``), or the hubs of a service,
            comma-separated.
        url: where workers connect (``tcp://127.0.0.1:0``: a port the OS picks, on the
            node's loopback; read ``url`` once started).
        secret_file, secret: the credential the relay signs its batches with (a token of
            any role, or the deployment secret; default: `fabric.auth.default_secret_path`).
        insecure: a hub run with ``--insecure``: batches unsigned.
        window_s: how long the first request of a batch waits for others.

    Raises:
        AuthenticationError: no usable credential (and not ``insecure``).
        HubUnavailableError: a bad URL.
    """

    def __init__(self, hub_url: str, url: str = "tcp://127.0.0.1:0", *,
                 secret_file: str | Path | None = None, secret: str | None = None,
                 insecure: bool = False, window_s: float = WINDOW_S,
                 max_message_size: int = MAX_MESSAGE_SIZE) -> None:
        self.hub_urls = [u.strip() for u in hub_url.split(",") if u.strip()]
        if not self.hub_urls:
            raise ValueError("a relay needs the URL of a hub")
        for u in self.hub_urls:
            endpoint(u, bind=False)
        endpoint(url, bind=True)
        if url.startswith(("curve://", "memory://")):
            raise ValueError(f"a relay listens on tcp://HOST:PORT (its node's loopback), "
                             f"not {url!r}")
        if not 0 <= window_s < 60:
            raise ValueError(f"window_s must be >= 0 s and under a minute, got {window_s}")
        self._hub = 0                     # which of hub_urls it forwards to
        self.requested_url = url
        self.credential: Credential | None = (
            None if insecure else load_credential(secret=secret, secret_file=secret_file))
        self.window_s = window_s
        self.max_message_size = max_message_size
        self.url = ""
        self.stats = RelayStats()
        self._session = f"relay-{time.time_ns():x}"
        self._ids = 0
        self._sent: dict[int, _Sent] = {}
        self._pending: list[_Held] = []
        self._replays = ReplayGuard()     # for the requests it vouches for
        self._pending_bytes = 0
        self._first_at = 0.0
        self._full = False                # the pending batch is as big as one may be
        self._alone: dict[bytes, _Alone] = {}    # a worker's connection, its last request
        self._by_sock: dict[zmq.Socket, bytes] = {}
        self._front: zmq.Socket | None = None      # the workers'
        self._back: zmq.Socket | None = None       # the hub's (batches)
        self._poller = zmq.Poller()
        self._init_serving()

    # ------------------------------------------------------------------ lifecycle
    thread_name = "fabric-relay"

    @property
    def hub_url(self) -> str:
        """The hub the relay forwards to now."""
        return self.hub_urls[self._hub]

    def __enter__(self) -> NodeRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------- the loop
    def _run(self, on_ready: Callable[[str], None] | None = None) -> None:
        try:
            self._front = make_socket(zmq.ROUTER, max_message_size=self.max_message_size)
            self._front.bind(endpoint(self.requested_url, bind=True))
            self.url = url_of(self._front.getsockopt_string(zmq.LAST_ENDPOINT),
                              self.requested_url)
            self._back = self._hub_socket()
        except BaseException as exc:
            self._close()
            self._error = exc
            self._ready.set()
            return
        log.info("relay serving url=%s hub=%s window=%.1f ms", self.url, ",".join(self.hub_urls),
                 self.window_s * 1e3)
        self._ready.set()
        if on_ready is not None:
            on_ready(self.url)
        self._poller.register(self._front, zmq.POLLIN)
        self._poller.register(self._back, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    last_sweep = self._turn(last_sweep)
                except Exception:  # a bug must not leave the node's workers without a hub
                    log.exception("relay: a turn of its loop failed")
                    self._stop.wait(0.05)      # and must not spin
        finally:
            self._close()
            log.info("relay stopped url=%s %s", self.url, self.stats)

    def _turn(self, last_sweep: float) -> float:
        """One turn of the loop: what is ready, the batch if due, the sweep if due."""
        wait = _TICK_MS
        if self._pending:
            left = self._due() - time.monotonic()
            wait = max(0, min(wait, int(left * 1000) + 1))
        for sock, _ in self._poller.poll(wait):
            if sock is self._front:
                self._from_workers()
            elif sock is self._back:
                self._from_hub()
            elif sock in self._by_sock:
                self._from_alone(sock)
        if self._pending and time.monotonic() >= self._due():
            self._send_batch()
        now = time.monotonic()
        if now - last_sweep > 0.25:
            self._sweep(now)
            return now
        return last_sweep

    def _close(self) -> None:
        for sock in (self._front, self._back, *self._by_sock):
            if sock is not None:
                sock.close(0)
        self._alone.clear()
        self._by_sock.clear()

    def _hub_socket(self) -> zmq.Socket:
        key = self.credential.hub_key if self.credential is not None else None
        return hub_socket(self.hub_url, max_message_size=self.max_message_size, hub_key=key)

    def _from_workers(self) -> None:
        """Take the workers' requests that are ready: into the batch, or sent alone."""
        assert self._front is not None
        while True:
            try:
                frames = self._front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) not in (2, 3):
                continue      # not a client's request: nothing to answer it with
            ident, payload = frames[0], frames[1]
            auth = frames[2] if len(frames) == 3 else b""
            if batchable(payload):
                self._hold(_Held(ident, payload, auth, self._vouch(payload, auth)))
            else:
                self._send_alone(ident, payload, auth)

    def _vouch(self, payload: bytes, auth: bytes) -> bytes:
        """The MAC of a request signed with the relay's own credential, fresh; else b"".

        The relay holds that credential, so it may as well have signed the request itself:
        it goes to the hub without its auth frame (the batch's signature covers it) and
        the relay signs the answer, as the hub would have, sparing the hub two HMACs and
        its replay check per request. Requests of other credentials go signed.
        """
        if self.credential is None or not auth:
            return b""
        signed = self.credential.signed_by_me(payload, auth)
        if signed is None or self._replays.check(signed[0], signed[1], time.time()):
            return b""      # the hub checks it and says what is wrong
        return signed[1]

    def _hold(self, held: _Held) -> None:
        """Keep a request for the next batch (sent at once when that batch is full)."""
        if not self._pending:
            self._first_at = time.monotonic()
        self._pending.append(held)
        self._pending_bytes += len(held.payload) + len(held.auth)
        if len(self._pending) >= MAX_ITEMS or self._pending_bytes >= MAX_BATCH_BYTES:
            self._full = True

    def _due(self) -> float:
        """When the pending batch goes (`time.monotonic`).

        At once when full; else once its first request has waited `window_s` and no batch
        younger than `AWAIT_S` is on its way.
        """
        if self._full:
            return 0.0
        due = self._first_at + self.window_s
        for sent in self._sent.values():
            due = max(due, sent.at + AWAIT_S)
        return due

    def _send_batch(self) -> None:
        assert self._back is not None
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        self._full = False
        self._ids += 1
        insecure = self.credential is None
        joined = join([h.payload for h in pending], [insecure or bool(h.vouched)
                                                     for h in pending],
                      self._session, max_size=self.max_message_size)
        items = [(it.payload, b"" if it.req_ids or pending[it.members[0]].vouched
                  else pending[it.members[0]].auth) for it in joined]
        data = encode(REQUEST, self._ids, self._session, "batch", BatchRequest(items=items),
                      max_size=self.max_message_size)
        frames = [data]
        mac = b""
        if self.credential is not None:
            auth, mac = self.credential.sign(data)
            frames.append(auth)
        try:
            self._back.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:     # the hub's queue is full: the workers retry
            log.warning("relay: the hub's queue is full; %d requests dropped", len(items))
            return
        self._sent[self._ids] = _Sent(mac, pending, joined)
        self.stats.batches += 1
        self.stats.batched += len(pending)
        self.stats.vouched += sum(1 for h in pending if h.vouched)
        self.stats.joined += sum(len(it.members) for it in joined if it.req_ids)

    def _from_hub(self) -> None:
        """Hand each answer of the batches the hub answered to its worker."""
        assert self._back is not None and self._front is not None
        back = self._back
        while back is self._back:        # (until a move to another hub closes it)
            try:
                frames = back.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames[0], max_size=self.max_message_size)
            except ProtocolError as exc:
                log.warning("relay: a bad answer from the hub: %s", exc)
                continue
            sent = self._sent.pop(msg.req_id, None)
            if sent is None:
                continue
            auth = frames[1] if len(frames) > 1 else b""
            signed = self.credential is None or bool(
                auth and self.credential.check_reply(auth, sent.mac, frames[0]))
            if not signed and msg.kind != ERROR:     # a refusal may come unsigned
                log.warning("relay: an answer not signed for its batch was dropped")
                self.stats.dropped += len(sent.held)
                continue
            if msg.kind == REPLY:
                answers = decode_body(msg, BatchReply).items
                if len(answers) == len(sent.items):
                    for item, (data, sig) in zip(sent.items, answers, strict=True):
                        if item.req_ids:
                            self._answer_joined(sent, item, data)
                            continue
                        h = sent.held[item.members[0]]
                        if h.vouched and self.credential is not None:
                            sig = reply_mac(self.credential.key, h.vouched, data)
                        _send(self._front, [h.ident, data, sig])
                    continue
                log.warning("relay: %d answers to a batch of %d", len(answers),
                            len(sent.items))
            elif msg.name == NotLeaderError.code and len(self.hub_urls) > 1:
                self._sent[msg.req_id] = sent      # carried to the next hub with the others
                self._next_hub("it does not lead")
                return
            else:
                log.info("relay: the hub refused a batch (%s); its %d requests go alone",
                         msg.name, len(sent.held))
            self.stats.refused_batches += 1
            for h in sent.held:
                self._send_alone(h.ident, h.payload, h.auth)

    def _answer_joined(self, sent: _Sent, item: Item, data: bytes) -> None:
        """Answer each reader of joined begins (`fabric.node_begins.split`), or send it alone."""
        assert self._front is not None
        answers = split(data, item.req_ids, max_size=self.max_message_size)
        for m, answer in zip(item.members, answers, strict=True):
            h = sent.held[m]
            if answer is None:
                self._send_alone(h.ident, h.payload, h.auth)
                continue
            sig = (reply_mac(self.credential.key, h.vouched, answer)
                   if self.credential is not None else b"")
            _send(self._front, [h.ident, answer, sig])

    def _send_alone(self, ident: bytes, payload: bytes, auth: bytes) -> None:
        """Send one worker's request on that worker's own connection to the hub."""
        held = self._alone.get(ident)
        if held is None:
            sock = self._hub_socket()
            self._poller.register(sock, zmq.POLLIN)
            self._by_sock[sock] = ident
        else:
            sock = held.sock
        self._alone[ident] = _Alone(sock, time.monotonic(), payload, auth)
        with contextlib.suppress(zmq.Again):     # the worker retries
            sock.send_multipart([payload, auth] if auth else [payload], zmq.NOBLOCK)
        self.stats.alone += 1

    def _from_alone(self, sock: zmq.Socket) -> None:
        assert self._front is not None
        ident = self._by_sock[sock]
        while sock in self._by_sock:     # (until a move to another hub closes it)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            last = self._alone[ident]
            if len(self.hub_urls) > 1 and _not_leader(frames[0]):
                self._next_hub("it does not lead")
                self._send_alone(ident, last.payload, last.auth)
                return
            _send(self._front, [ident, *frames])
            last.at = time.monotonic()

    def _next_hub(self, why: str) -> None:
        """Forward to the next hub of the service from now on.

        The batches on their way go to it too; requests sent alone are retried by their
        workers.
        """
        assert self._back is not None
        was = self.hub_url
        self._hub = (self._hub + 1) % len(self.hub_urls)
        self.stats.hub_changes += 1
        log.warning("relay: moving from hub %s (%s) to %s", was, why, self.hub_url)
        self._poller.unregister(self._back)
        self._back.close(0)
        self._back = self._hub_socket()
        self._poller.register(self._back, zmq.POLLIN)
        for sock in self._by_sock:
            self._poller.unregister(sock)
            sock.close(0)
        self._by_sock.clear()
        self._alone.clear()
        carried, self._sent = self._sent, {}
        for sent in carried.values():
            for h in sent.held:
                self._hold(h)
        self._first_at = 0.0        # they waited already: the next turn sends them

    def _sweep(self, now: float) -> None:
        """Move on from a silent hub of a service; forget old batches and idle connections."""
        if len(self.hub_urls) > 1 and any(now - s.at > SERVICE_TRY_S
                                          for s in self._sent.values()):
            self._next_hub(f"no answer within {SERVICE_TRY_S:g} s")
        for rid in [r for r, s in self._sent.items() if now - s.at > FORGET_S]:
            self.stats.dropped += len(self._sent.pop(rid).held)
        for ident in [i for i, a in self._alone.items() if now - a.at > FORGET_S]:
            sock = self._alone.pop(ident).sock
            self._poller.unregister(sock)
            self._by_sock.pop(sock, None)
            sock.close(0)


def batchable(payload: bytes) -> bool:
    """Whether a worker's request may ride in a batch (`BATCHABLE`, answered at once)."""
    try:
        msg = decode(payload)
    except ProtocolError:
        return False          # alone: the hub says what is wrong with it
    if msg.kind != REQUEST or msg.name not in BATCHABLE:
        return False
    if msg.name == "complete_fetch":       # a group's member waits for the others
        try:
            timeout = _complete_timeout.decode(msg.body).get("timeout", 0)
        except msgspec.DecodeError:
            return False
        return not timeout
    return True


def _not_leader(data: bytes) -> bool:
    """Whether a hub's answer is `NotLeaderError`."""
    try:
        msg = decode(data)
    except ProtocolError:
        return False
    return msg.kind == ERROR and msg.name == NotLeaderError.code


def _send(front: zmq.Socket, frames: list[bytes]) -> None:
    with contextlib.suppress(zmq.ZMQError):   # the worker is gone: it retries or left
        front.send_multipart(frames, zmq.NOBLOCK)


__all__ = ["AWAIT_S", "MAX_ITEMS", "WINDOW_S", "NodeRelay", "RelayStats", "batchable"]
