"""A relay's batch at the hub: each request answered as if alone, a node's readers planned together.

`HubState.answering_batch` is driven by hand (the node plans), then the server is sent
batches on a real socket: answers in order, each signed for its own worker; what may
not ride in a batch, a forged request, an unsigned batch, too many requests: refused
with a typed error while the others are answered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hub_helpers import hub_with_version, send_batch, small_manifest

import weightfabric as wf
from weightfabric.fabric.hub import server as server_module
from weightfabric.fabric.hub.state import HubState
from weightfabric.fabric.hub_messages import BatchReply
from weightfabric.fabric.locality import Location
from weightfabric.fabric.protocol import ERROR, REPLY, REQUEST, decode, decode_body, encode

NODE = {"datacenter": "dc0", "node": "n0"}


# ------------------------------------------------------------------ node plans
@pytest.fixture
def state() -> HubState:
    s = HubState()
    s.register("t", session="t", location=Location("dc0", "trainer"))
    for w, node in (("a", "n0"), ("b", "n0"), ("c", "n0"), ("x", "n1")):
        s.register(w, session=w, location=Location("dc0", node))
    v = s.begin_publish("m", "t", small_manifest(8), session="t").version
    s.commit("m", v, "t", session="t")
    return s


def _begin(s: HubState, worker: str, **kw: Any):
    return s.begin_fetch("m", 1, worker, session=worker, fetch_id=f"{worker}/f", **kw)


def test_a_nodes_readers_asking_together_wait_on_its_first(state: HubState) -> None:
    with state.answering_batch():
        first, b, c, x = (_begin(state, w) for w in "abcx")
    assert [(r.start, r.stop, r.sources, r.wait) for r in first.ranges] == [(0, 8, ["t"], [])]
    for plan in (b, c):          # the same sources; the first reader waited on first
        assert [(r.start, r.stop, r.sources) for r in plan.ranges] == [(0, 8, ["t"])]
        assert all(r.wait[0] == "a" for r in plan.ranges)
        assert set(plan.workers) == {"t", "a"}
    assert "a" not in {w for r in x.ranges for w in r.wait}   # another node: routed
    assert state.fetches["b/f"].sources == {"t", "a"}          # the hub's accounting
    # outside a batch, or a re-plan, is routed as always
    replan = state.plan("c/f", "c", session="c")
    assert {w for r in replan.ranges for w in r.wait} <= {"a", "b"}


def test_only_fresh_fetches_are_planned_together(state: HubState) -> None:
    with state.answering_batch():
        _begin(state, "a")
        resumed = _begin(state, "b", have=[0, 1])     # holds chunks: routed
    assert resumed.ranges[0].start == 2
    assert all(r.wait != ["a"] or r.sources for r in resumed.ranges)


def test_a_first_reader_gone_in_the_batch_is_not_waited_on(state: HubState) -> None:
    with state.answering_batch():
        _begin(state, "a")
        state.release("a/f", "a", session="a")
        b = _begin(state, "b")
    assert all("a" not in r.wait for r in b.ranges) and "a" not in b.workers


def test_outside_a_batch_readers_are_routed(state: HubState) -> None:
    with state.answering_batch():
        _begin(state, "a")
    assert not state._together
    b = _begin(state, "b")           # routed: it may wait on a (ranked), never on a memo
    assert set(b.workers) <= {"t", "a"}


def test_a_nodes_later_batches_wait_on_its_first_until_it_holds_the_shard(
        state: HubState) -> None:
    with state.answering_batch():
        _begin(state, "a")
    with state.answering_batch():    # a reader of the node that starts later
        b = _begin(state, "b")
    assert all(r.wait == ["a"] for r in b.ranges) and set(b.workers) == {"t", "a"}
    state.report_progress("a/f", "a", session="a", chunks=list(range(8)))
    state.complete_fetch("a/f", "a", session="a")
    with state.answering_batch():    # a holds it all now: c is routed (read a first)
        c = _begin(state, "c")
    assert all(r.sources[0] == "a" and "a" not in r.wait for r in c.ranges)


def test_a_first_reader_that_left_is_replaced_by_the_next(state: HubState) -> None:
    with state.answering_batch():
        _begin(state, "a")
    state.release("a/f", "a", session="a")
    with state.answering_batch():
        b = _begin(state, "b")        # routed, and the node's first now
        c = _begin(state, "c")
    assert "a" not in b.workers and all(r.wait == ["b"] for r in c.ranges)


# ------------------------------------------------------------- the server's side
_ids = itertools.count(1)


@pytest.fixture
def served() -> Iterator[tuple[wf.HubServer, zmq.Socket, Any]]:
    with hub_with_version() as hub:
        yield hub


def _item(cred: Any, worker: str, op: str, args: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    payload = encode(REQUEST, next(_ids), f"s-{worker}", op, args)
    auth, mac = cred.sign(payload)
    return payload, auth, mac


def test_a_batch_is_answered_in_order_each_answer_signed_for_its_request(served) -> None:
    server, sock, cred = served
    reg = [_item(cred, w, "register", {"worker": w, "location": NODE}) for w in ("a", "b")]
    msg = send_batch(sock, cred, [(p, a) for p, a, _ in reg])
    assert msg.kind == REPLY
    answers = decode_body(msg, BatchReply).items
    assert len(answers) == 2
    for (_, _, mac), (data, sig) in zip(reg, answers, strict=True):
        assert decode(data).kind == REPLY and cred.check_reply(sig, mac, data)
    begins = [_item(cred, w, "begin_fetch", {"worker": w, "model": "m", "fetch_id": f"{w}/f"})
              for w in ("a", "b")]
    answers = decode_body(send_batch(sock, cred, [(p, a) for p, a, _ in begins]), BatchReply).items
    plans = [msgspec.msgpack.decode(decode(data).body) for data, _ in answers]
    assert plans[0]["ranges"][0]["wait"] == [] and plans[1]["ranges"][0]["wait"] == ["a"]
    assert all(plan["workers"]["t"]["cap"] for plan in plans)      # capabilities each
    # a retry of an answered request (signed again, as clients do), in a later batch: the
    # same answer, from the cache; the very same signature again is a replay
    retry = (begins[1][0], cred.sign(begins[1][0])[0])
    again = decode_body(send_batch(sock, cred, [retry, begins[1][:2]]), BatchReply).items
    assert again[0][0] == answers[1][0]
    assert (decode(again[1][0]).kind, decode(again[1][0]).name) == (ERROR, "unauthenticated")
    assert server.num_batches == 3


def test_what_may_not_ride_in_a_batch_is_refused_and_the_rest_answered(served) -> None:
    _, sock, cred = served
    ping = _item(cred, "a", "ping", {})
    wait = _item(cred, "a", "wait_version", {"model": "m", "after": 5, "timeout": 1.0})
    nested = _item(cred, "a", "batch", {"items": []})
    forged = (ping[0].replace(b"ping", b"pong"), ping[1])
    items = [wait[:2], nested[:2], forged, ping[:2], (b"\x00garbage", b"")]
    answers = decode_body(send_batch(sock, cred, items), BatchReply).items
    kinds = [(decode(data).kind, decode(data).name) for data, _ in answers]
    assert kinds[0] == (ERROR, "bad_request") and kinds[1] == (ERROR, "bad_request")
    assert kinds[2] == (ERROR, "unauthenticated")
    assert kinds[3][0] == REPLY
    assert kinds[4][0] == ERROR


def test_an_unsigned_or_oversized_batch_is_refused(served, monkeypatch) -> None:
    server, sock, cred = served
    ping = _item(cred, "a", "ping", {})
    msg = send_batch(sock, cred, [ping[:2]], signed=False)
    assert (msg.kind, msg.name) == (ERROR, "unauthenticated")
    monkeypatch.setattr(server_module, "MAX_BATCH", 2)
    msg = send_batch(sock, cred, [ping[:2]] * 3)
    assert (msg.kind, msg.name) == (ERROR, "bad_request")
    assert b"at most 2" in bytes(msg.body)
    assert server.num_batches == 0


def test_a_request_vouched_for_by_the_batch_runs_as_its_signer_and_goes_back_unsigned(
        served) -> None:
    server, sock, cred = served
    reg = _item(cred, "v", "register", {"worker": "v", "location": NODE})
    vouched = (reg[0], b"")                     # no auth frame: the batch's signer vouches
    msg = send_batch(sock, cred, [vouched])
    (data, sig), = decode_body(msg, BatchReply).items
    assert decode(data).kind == REPLY and sig == b""     # the relay signs it
    assert "v" in server.state.workers and server._sessions["s-v"] == cred.principal.name
    assert "v" in server._serve_keys                    # its serving key: the signer's
    # a session another credential holds cannot be vouched into
    server._sessions["s-x"] = "someone-else"
    other = _item(cred, "x", "ping", {})
    (data, _), = decode_body(send_batch(sock, cred, [(other[0], b"")]), BatchReply).items
    assert (decode(data).kind, decode(data).name) == (ERROR, "unauthenticated")
