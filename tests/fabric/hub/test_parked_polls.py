"""The hub server's parked long polls: indexed, woken by what they wait for, and only then.

The server is driven by hand (no thread, no socket): requests go to `HubServer._handle`,
the loop's steps are called one by one, and the replies it would send are collected.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hub_helpers import FakeClock, capture_replies, small_manifest

from weightfabric.fabric.hub.server import HubServer
from weightfabric.fabric.hub_messages import ManifestWire
from weightfabric.fabric.protocol import REPLY, REQUEST, encode

_ids = itertools.count(1)


class _Hub:
    """A `HubServer` stepped by hand; ``replies`` holds what it sent, by request id."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.server = HubServer(f"memory://parked-{next(_ids)}", insecure=True, clock=self.clock,
                                lease_s=3600)
        self.replies: dict[int, Any] = {}
        sent = self.replies

        def keep(msg: Any, raw: bytes) -> None:
            body = msgspec.msgpack.decode(msg.body)
            sent[msg.req_id] = body if msg.kind == REPLY else ("error", msg.name, body)

        capture_replies(self.server, keep)

    def ask(self, session: str, op: str, args: dict[str, Any], req_id: int | None = None) -> int:
        """Send a request; returns its id (its reply, if any, is in ``replies`` after `step`)."""
        rid = next(_ids) if req_id is None else req_id
        self.server._handle([session.encode(), encode(REQUEST, rid, session, op, args)])
        self.server._flush()
        return rid

    def step(self) -> None:
        """One pass of the loop's timers: parked polls woken or timed out, replies sent."""
        self.server._tick()
        self.server._flush()

    def publish(self, model: str, worker: str = "trainer") -> int:
        manifest = msgspec.to_builtins(ManifestWire.of(small_manifest(2, tag=model)))
        rid = self.ask(worker, "begin_publish", {"worker": worker, "model": model,
                                                 "manifest": manifest})
        version = self.replies[rid]["version"]
        self.ask(worker, "commit", {"worker": worker, "model": model, "version": version})
        return int(version)


@pytest.fixture
def hub() -> _Hub:
    h = _Hub()
    h.ask("trainer", "register", {"worker": "trainer"})
    return h


def _wait(hub: _Hub, model: str, after: int, timeout: float = 60.0, session: str = "r") -> int:
    return hub.ask(session, "wait_version", {"model": model, "after": after, "timeout": timeout})


def test_a_commit_wakes_the_waits_it_answers_and_no_others(hub: _Hub) -> None:
    v1 = hub.publish("a")
    before = [_wait(hub, "a", v1) for _ in range(5)]        # parked: nothing newer yet
    ahead = [_wait(hub, "a", v1 + 1) for _ in range(3)]     # parked past the next version
    other = [_wait(hub, "b", 0) for _ in range(4)]          # another model
    hub.step()
    assert not hub.replies.keys() & {*before, *ahead, *other}
    assert len(hub.server._parked) == 12

    v2 = hub.publish("a")
    hub.step()
    assert all(hub.replies[r] == {"version": v2} for r in before)
    assert not hub.replies.keys() & {*ahead, *other}
    assert len(hub.server._parked) == 7

    hub.publish("b")
    hub.step()
    assert all(hub.replies[r] == {"version": 1} for r in other)
    assert not hub.replies.keys() & set(ahead)


def test_a_wait_already_answered_is_not_parked(hub: _Hub) -> None:
    v = hub.publish("a")
    rid = _wait(hub, "a", 0)
    assert hub.replies[rid] == {"version": v} and not hub.server._parked


def test_waits_time_out_at_their_deadline_in_order(hub: _Hub) -> None:
    late = _wait(hub, "a", 0, timeout=20)
    soon = _wait(hub, "a", 0, timeout=5)
    hub.clock.advance(4.9)
    hub.step()
    assert soon not in hub.replies and late not in hub.replies
    hub.clock.advance(0.2)
    hub.step()
    assert hub.replies[soon] == {"version": None} and late not in hub.replies
    hub.clock.advance(15)
    hub.step()
    assert hub.replies[late] == {"version": None}
    assert not hub.server._parked


def test_a_retried_parked_wait_is_answered_once_with_its_latest_sender(hub: _Hub) -> None:
    rid = _wait(hub, "a", 0)
    hub.ask("r", "wait_version", {"model": "a", "after": 0, "timeout": 60}, req_id=rid)
    assert len(hub.server._parked) == 1
    v = hub.publish("a")
    hub.step()
    assert hub.replies[rid] == {"version": v} and not hub.server._parked


def test_other_polls_are_still_checked_at_each_change(hub: _Hub) -> None:
    rid = hub.ask("r", "kv_get", {"key": "k", "timeout": 60})
    hub.step()
    assert rid not in hub.replies
    hub.ask("w", "kv_put", {"key": "k", "value": b"v"})
    hub.step()
    assert hub.replies[rid] == {"value": b"v"}


def test_answered_polls_do_not_pile_up_in_the_heaps(hub: _Hub) -> None:
    """Waits that time out again and again while no version comes leave bounded heaps."""
    for _ in range(50):
        for _ in range(20):
            _wait(hub, "a", 0, timeout=1)
        hub.clock.advance(2)
        hub.step()
    server = hub.server
    assert not server._parked
    entries = len(server._deadlines) + sum(len(w) for w in server._version_waits.values())
    assert entries <= 64 + 20
    v = hub.publish("a")
    parked = [_wait(hub, "a", 0 if i % 2 else v) for i in range(10)]
    hub.step()
    assert sum(r in hub.replies for r in parked) == 5


def test_a_parked_wait_of_an_ended_hub_role_gets_an_error(hub: _Hub) -> None:
    rid = _wait(hub, "a", 0)
    hub.server._change_role(hub.server._new_state(
        durable=hub.server.records.load()), leading=True)
    hub.server._flush()
    assert hub.replies[rid][0] == "error"
    assert not hub.server._parked and not hub.server._deadlines
    assert not hub.server._version_waits
