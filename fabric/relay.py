"""A node relay: one process per node that forwards its workers' hub requests in batches.

A hub answers every worker itself: at 10,000 rollout GPUs that is 10,000 plans, 10,000
completions and thousands of heartbeats per version, each a message with its own system
calls and its own pass through the hub's loop. A relay on each node takes its workers'
requests (they connect to it as to the hub: ``connect(relay.url)``), sends those that
answer at once (`fabric.hub_messages.BATCHABLE`: heartbeats, plans, reports, completions)
to the hub as one ``batch`` message per few milliseconds, and hands each answer back. The
hub answers a batch's requests as if each came alone and plans the node's readers of a
version together: the first routed, the others waiting on it (`fabric.hub.node_plans`), so
a node's chunks cross the network once.

The relay is trusted with nothing: every request keeps its worker's signature and every
answer the hub's signature for that worker, checked by the hub and the worker as without a
relay; the relay signs only the envelope (with any credential of the deployment: a read
token is enough). Requests that wait at the hub (``wait_version``, ``wait_commit``, a fetch
group's ``complete_fetch``), publishes and everything else go through unbatched, each
worker on a connection of its own. A batch the hub refuses (an older hub, one that does
not lead) is sent again request by request, so each worker gets the hub's own answer. A
relay that stops loses nothing: its workers' requests are retried by their clients, and a
retried request the hub already answered is answered from its reply cache.

Run one with ``fabric hub relay --hub URL`` (docs/hub.md, "Node relays").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from weightfabric.fabric.auth import Credential, load_credential
from weightfabric.fabric.errors import ProtocolError
from weightfabric.fabric.hub_messages import BATCHABLE, BatchReply, BatchRequest
from weightfabric.fabric.protocol import (
    ERROR,
    MAX_MESSAGE_SIZE,
    REPLY,
    REQUEST,
    decode,
    decode_body,
    encode,
)
from weightfabric.fabric.zmq_util import endpoint, hub_socket, make_socket, url_of

log = logging.getLogger(__name__)

WINDOW_S = 0.005
"""How long a relay holds the first request of a batch for others to join it."""
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


@dataclass
class _Sent:
    """A batch on its way: to whom each answer goes, and the requests (to send alone)."""

    mac: bytes
    idents: list[bytes]
    items: list[tuple[bytes, bytes]]
    at: float = field(default_factory=time.monotonic)


@dataclass
class RelayStats:
    """What a relay forwarded (``NodeRelay.stats``)."""

    batches: int = 0
    batched: int = 0
    """Requests sent in batches."""
    alone: int = 0
    """Requests sent unbatched (they wait at the hub, or the hub refused their batch)."""
    refused_batches: int = 0
    dropped: int = 0
    """Answers that found no worker (a batch forgotten, a reply not signed for it)."""


class NodeRelay:
    """Forwards the hub requests of one node's workers; `start` runs it on a thread.

    Args:
        hub_url: the hub (``tcp://`` or ``curve://``).
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
        endpoint(hub_url, bind=False)
        endpoint(url, bind=True)
        if url.startswith(("curve://", "memory://")):
            raise ValueError(f"a relay listens on tcp://HOST:PORT (its node's loopback), "
                             f"not {url!r}")
        if not 0 <= window_s < 60:
            raise ValueError(f"window_s must be >= 0 s and under a minute, got {window_s}")
        self.hub_url, self.requested_url = hub_url, url
        self.credential: Credential | None = (
            None if insecure else load_credential(secret=secret, secret_file=secret_file))
        self.window_s = window_s
        self.max_message_size = max_message_size
        self.url = ""
        self.stats = RelayStats()
        self._session = f"relay-{time.time_ns():x}"
        self._ids = 0
        self._sent: dict[int, _Sent] = {}
        self._pending: list[tuple[bytes, bytes, bytes]] = []   # (ident, payload, auth)
        self._pending_bytes = 0
        self._first_at = 0.0
        self._alone: dict[bytes, tuple[zmq.Socket, float]] = {}   # worker -> its connection
        self._by_sock: dict[zmq.Socket, bytes] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> NodeRelay:
        """Serve on a daemon thread; returns once listening (``url`` set).

        Raises:
            OSError, zmq.ZMQError: the address cannot be bound.
            TimeoutError: not listening within ``timeout`` s.
        """
        self._thread = threading.Thread(target=self._run, name="wf-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the relay did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve on this thread until `stop` (from another thread or a signal handler)."""
        self._run(on_ready)
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; requests in flight are retried by their workers' clients."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> NodeRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------- the loop
    def _run(self, on_ready: Callable[[str], None] | None = None) -> None:
        front = back = None
        try:
            front = make_socket(zmq.ROUTER, max_message_size=self.max_message_size)
            front.bind(endpoint(self.requested_url, bind=True))
            self.url = url_of(front.getsockopt_string(zmq.LAST_ENDPOINT), self.requested_url)
            back = self._hub_socket()
        except BaseException as exc:
            for s in (front, back):
                if s is not None:
                    s.close(0)
            self._error = exc
            self._ready.set()
            return
        log.info("relay serving url=%s hub=%s window=%.1f ms", self.url, self.hub_url,
                 self.window_s * 1e3)
        self._ready.set()
        if on_ready is not None:
            on_ready(self.url)
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = _TICK_MS
                if self._pending:
                    left = self._first_at + self.window_s - time.monotonic()
                    wait = max(0, min(wait, int(left * 1000) + 1))
                for sock, _ in poller.poll(wait):
                    if sock is front:
                        self._from_workers(front, poller)
                    elif sock is back:
                        self._from_hub(front, back, poller)
                    else:
                        self._from_alone(front, sock)
                if self._pending and (time.monotonic() >= self._first_at + self.window_s):
                    self._send_batch(back)
                now = time.monotonic()
                if now - last_sweep > 1.0:
                    self._sweep(poller, now)
                    last_sweep = now
        finally:
            front.close(0)
            back.close(0)
            for sock, _ in self._alone.values():
                sock.close(0)
            self._alone.clear()
            self._by_sock.clear()
            log.info("relay stopped url=%s %s", self.url, self.stats)

    def _hub_socket(self) -> zmq.Socket:
        key = self.credential.hub_key if self.credential is not None else None
        return hub_socket(self.hub_url, max_message_size=self.max_message_size, hub_key=key)

    def _from_workers(self, front: zmq.Socket, poller: zmq.Poller) -> None:
        """Take the workers' requests that are ready: into the batch, or sent alone."""
        while True:
            try:
                frames = front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) not in (2, 3):
                continue      # not a client's request: nothing to answer it with
            ident, payload = frames[0], frames[1]
            auth = frames[2] if len(frames) == 3 else b""
            if not batchable(payload):
                self._send_alone(ident, payload, auth, poller)
                continue
            if not self._pending:
                self._first_at = time.monotonic()
            self._pending.append((ident, payload, auth))
            self._pending_bytes += len(payload) + len(auth)
            if len(self._pending) >= MAX_ITEMS or self._pending_bytes >= MAX_BATCH_BYTES:
                self._first_at = -float("inf")    # send it now

    def _send_batch(self, back: zmq.Socket) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        self._ids += 1
        items = [(payload, auth) for _, payload, auth in pending]
        data = encode(REQUEST, self._ids, self._session, "batch", BatchRequest(items=items),
                      max_size=self.max_message_size)
        frames = [data]
        mac = b""
        if self.credential is not None:
            auth, mac = self.credential.sign(data)
            frames.append(auth)
        try:
            back.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:     # the hub's queue is full: the workers retry
            log.warning("relay: the hub's queue is full; %d requests dropped", len(items))
            return
        self._sent[self._ids] = _Sent(mac, [ident for ident, _, _ in pending], items)
        self.stats.batches += 1
        self.stats.batched += len(items)

    def _from_hub(self, front: zmq.Socket, back: zmq.Socket, poller: zmq.Poller) -> None:
        """Hand each answer of the batches the hub answered to its worker."""
        while True:
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
                self.stats.dropped += len(sent.idents)
                continue
            if msg.kind == REPLY:
                answers = decode_body(msg, BatchReply).items
                if len(answers) == len(sent.idents):
                    for ident, (data, sig) in zip(sent.idents, answers, strict=True):
                        _send(front, [ident, data, sig])
                    continue
                log.warning("relay: %d answers to a batch of %d", len(answers),
                            len(sent.idents))
            else:
                log.info("relay: the hub refused a batch (%s); its %d requests go alone",
                         msg.name, len(sent.items))
            self.stats.refused_batches += 1
            for ident, (payload, item_auth) in zip(sent.idents, sent.items, strict=True):
                self._send_alone(ident, payload, item_auth, poller)

    def _send_alone(self, ident: bytes, payload: bytes, auth: bytes,
                    poller: zmq.Poller) -> None:
        """Send one worker's request on that worker's own connection to the hub."""
        held = self._alone.get(ident)
        if held is None:
            sock = self._hub_socket()
            poller.register(sock, zmq.POLLIN)
            self._by_sock[sock] = ident
        else:
            sock = held[0]
        self._alone[ident] = (sock, time.monotonic())
        with contextlib.suppress(zmq.Again):     # the worker retries
            sock.send_multipart([payload, auth] if auth else [payload], zmq.NOBLOCK)
        self.stats.alone += 1

    def _from_alone(self, front: zmq.Socket, sock: zmq.Socket) -> None:
        ident = self._by_sock.get(sock)
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if ident is not None:
                _send(front, [ident, *frames])
                self._alone[ident] = (sock, time.monotonic())

    def _sweep(self, poller: zmq.Poller, now: float) -> None:
        """Forget batches never answered; close workers' connections long idle."""
        for rid in [r for r, s in self._sent.items() if now - s.at > FORGET_S]:
            self.stats.dropped += len(self._sent.pop(rid).idents)
        for ident in [i for i, (_, t) in self._alone.items() if now - t > FORGET_S]:
            sock = self._alone.pop(ident)[0]
            poller.unregister(sock)
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


def _send(front: zmq.Socket, frames: list[bytes]) -> None:
    with contextlib.suppress(zmq.ZMQError):   # the worker is gone: it retries or left
        front.send_multipart(frames, zmq.NOBLOCK)


__all__ = ["MAX_ITEMS", "WINDOW_S", "NodeRelay", "RelayStats", "batchable"]
