"""A hub behind its requests stops its lease clock: nobody is dropped for its backlog.

The server is driven by hand: its socket is a queue of requests read in passes of
`BATCH`, as `HubServer._drain` reads them, with a fake clock moved between passes.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import zmq
from hub_helpers import FakeClock

from weightfabric.fabric.hub import server as server_module
from weightfabric.fabric.hub.server import HubServer
from weightfabric.fabric.protocol import REQUEST, encode

LEASE = 10.0
_ids = itertools.count(1)


class _Queue:
    """A socket with requests waiting: ``recv`` takes their frames in order, then zmq.Again."""

    def __init__(self) -> None:
        self.waiting: list[list[bytes]] = []
        self._frames: list[bytes] = []

    def put(self, session: str, op: str, args: dict[str, Any]) -> None:
        self.waiting.append([session.encode(), encode(REQUEST, next(_ids), session, op, args)])

    def recv(self, flags: int = 0) -> bytes:
        if not self._frames:
            if not self.waiting:
                raise zmq.Again()
            self._frames = self.waiting.pop(0)
        return self._frames.pop(0)

    def get(self, option: int) -> int:
        return int(bool(self._frames))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server_module, "BATCH", 3)
    clock = FakeClock()
    server = HubServer("memory://backlog", insecure=True, clock=clock, lease_s=LEASE)
    server._send = lambda *a, **k: None          # replies are not looked at here
    return server, clock


def _register(server: HubServer, worker: str) -> None:
    server.state.register(worker, session=worker)


def test_a_heartbeat_waiting_behind_a_burst_keeps_its_worker(hub) -> None:
    server, clock = hub
    _register(server, "a")
    _register(server, "b")
    sock = _Queue()
    for _ in range(5):                            # a burst ahead of a's heartbeat
        sock.put("b", "heartbeat", {"worker": "b"})
    sock.put("a", "heartbeat", {"worker": "a"})
    clock.advance(8)
    server._drain(sock)                           # 3 read, 3 waiting: behind
    clock.advance(5)                              # a's lease (10 s) ran out meanwhile
    server._tick()
    assert "a" in server.state.workers, "dropped while its heartbeat waited in the queue"
    server._drain(sock)                           # a's heartbeat is read (the pass is full)
    server._drain(sock)                           # nothing waits: caught up
    assert sock.waiting == []
    server._tick()
    assert {"a", "b"} <= set(server.state.workers)
    # The clock goes on from where it stopped: a's heartbeat counts from then.
    clock.advance(LEASE - 0.1)
    server._tick()
    assert "a" in server.state.workers
    clock.advance(0.2)
    server._tick()
    assert "a" not in server.state.workers


def test_a_hub_that_keeps_up_expires_leases_on_time(hub) -> None:
    server, clock = hub
    _register(server, "a")
    sock = _Queue()
    sock.put("b", "ping", {})
    clock.advance(8)
    server._drain(sock)                           # one request, then nothing: caught up
    clock.advance(2.1)
    server._tick()
    assert "a" not in server.state.workers
