"""A node's fresh begins joined into one request (`fabric.node_begins`), and the hub's answer.

`join` keeps what may not join as it is; the hub begins each joined reader's fetch as
alone (its session, its rights, its capabilities), answers the manifest once, and `split`
rebuilds each reader's answer as the hub would have sent it alone; what the hub leaves
out, or refuses whole, goes back to be sent alone. Joined or alone, the same begins leave
the hub in the same state and the readers with the same plans (property test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hub_helpers import hub_with_version, send_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightfabric as wf
from weightfabric.fabric.auth import CapabilityCheck, scope_of, serving_key
from weightfabric.fabric.hub_messages import (
    BatchReply,
    BeginFetchesRequest,
    NodeReader,
    PlanReply,
)
from weightfabric.fabric.node_begins import Item, join, split
from weightfabric.fabric.protocol import ERROR, REPLY, REQUEST, decode, decode_body, encode

NODE = {"datacenter": "dc0", "node": "n0"}
_ids = itertools.count(1)


def _begin(worker: str, **args: Any) -> bytes:
    return encode(REQUEST, next(_ids), f"s-{worker}", "begin_fetch",
                  {"worker": worker, "model": "m", "fetch_id": f"{worker}/f", **args})


# ------------------------------------------------------------------------ join
def test_join_takes_the_vouched_fresh_begins_of_one_shard_together_in_order() -> None:
    ping = encode(REQUEST, next(_ids), "s-a", "ping", {})
    a, b, c = _begin("a"), _begin("b"), _begin("c")
    signed = _begin("d")                       # not vouched: it keeps its signature
    grouped = _begin("e", group="g", group_size=2)
    resumed = _begin("f", have=[0])
    other_shard = _begin("g", shard=1)
    payloads = [ping, a, signed, b, grouped, resumed, other_shard, c]
    vouched = [True, True, False, True, True, True, True, True]
    items = join(payloads, vouched, "relay")
    assert [it.members for it in items] == [[0], [1, 3, 7], [2], [4], [5], [6]]
    assert [it.payload for i, it in enumerate(items) if i != 1] == [
        ping, signed, grouped, resumed, other_shard]
    joined = decode(items[1].payload)
    assert (joined.kind, joined.tag, joined.name) == (REQUEST, "relay", "begin_fetches")
    req = decode_body(joined, BeginFetchesRequest)
    assert [r.worker for r in req.readers] == ["a", "b", "c"]
    assert [r.session for r in req.readers] == ["s-a", "s-b", "s-c"]
    assert items[1].req_ids == [decode(p).req_id for p in (a, b, c)]
    alone = join([a, ping], [True, True], "relay")      # one begin alone is not joined
    assert [(it.payload, it.req_ids) for it in alone] == [(a, []), (ping, [])]


def test_split_of_a_refusal_or_garbage_sends_each_alone() -> None:
    refused = encode(ERROR, 0, "epoch", "bad_request", {"message": "unknown operation"})
    assert split(refused, [1, 2]) == [None, None]
    assert split(b"\x00garbage", [1]) == [None]


# ------------------------------------------------------------------ at the hub
@contextlib.contextmanager
def _hub(readers: dict[str, str]) -> Iterator[tuple[wf.HubServer, zmq.Socket, Any]]:
    """A hub with version 1 of "m" committed and ``readers`` (worker -> node) registered."""
    with hub_with_version() as (server, sock, cred):
        _batch(sock, cred, [(encode(REQUEST, next(_ids), f"s-{w}", "register", {
            "worker": w, "location": {"datacenter": "dc0", "node": node}}), b"")
            for w, node in readers.items()])
        yield server, sock, cred


@pytest.fixture
def served() -> Iterator[tuple[wf.HubServer, zmq.Socket, Any]]:
    with _hub({w: "n0" for w in "abcd"}) as hub:
        yield hub


def _batch(sock: zmq.Socket, cred: Any, items: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [data for data, _ in decode_body(send_batch(sock, cred, items), BatchReply).items]


def test_joined_begins_are_answered_as_each_would_be_alone(served) -> None:
    server, sock, cred = served
    payloads = [_begin("a"), _begin("b"), _begin("zz")]     # zz never registered
    item, = join(payloads, [True] * 3, "relay")
    before = server.num_requests
    answer, = _batch(sock, cred, [(item.payload, b"")])
    assert server.num_requests == before + 1 + 3     # the batch and its 3 readers' begins
    a, b, c = split(answer, item.req_ids)
    assert a is not None and b is not None and c is not None
    plans = [decode_body(decode(x), PlanReply) for x in (a, b)]
    assert [decode(x).req_id for x in (a, b, c)] == item.req_ids
    assert [p.fetch_id for p in plans] == ["a/f", "b/f"]
    assert plans[0].ranges[0].wait == [] and plans[1].ranges[0].wait == ["a"]
    assert all(p.manifest is not None and len(p.manifest.checksums) == 8 for p in plans)
    assert (decode(c).kind, decode(c).name) == (ERROR, "unknown_worker")
    # each reader's capabilities name it, signed for the holders it reads
    check = CapabilityCheck(serving_key(cred.key))
    for p, reader in zip(plans, "ab", strict=True):
        for src in p.workers.values():
            assert check.reader(src.cap, scope_of("m", 1) + "0") == reader
    # the hub's records: each a partial replica, its session bound to the signer
    assert {f.worker for f in server.state.fetches.values()} == {"a", "b"}
    assert server._sessions["s-b"] == cred.principal.name
    # a retry of a joined reader's begin, alone: its fetch resumes
    again, = _batch(sock, cred, [(payloads[1], cred.sign(payloads[1])[0])])
    assert decode_body(decode(again), PlanReply).fetch_id == "b/f"
    assert len(server.state.fetches) == 2


def test_joined_begins_come_vouched_in_a_batch_or_not_at_all(served) -> None:
    server, sock, cred = served
    joined = encode(REQUEST, next(_ids), "relay", "begin_fetches", BeginFetchesRequest(
        model="m", readers=[NodeReader("a", "s-a", "a/f"), NodeReader("b", "s-b", "b/f")]))
    signed, = _batch(sock, cred, [(joined, cred.sign(joined)[0])])   # not vouched
    assert (decode(signed).kind, decode(signed).name) == (ERROR, "bad_request")
    assert split(signed, [1, 2]) == [None, None]       # the relay sends each alone
    with (wf.connect(server.url, worker="x", heartbeat=False, timeout=5) as x,
          pytest.raises(wf.HubError)):
        x.call("begin_fetches", {"model": "m", "readers": [["x", "s", "f"]]})
    assert not server.state.fetches


def test_a_reader_left_out_is_sent_alone_by_the_relay(served, monkeypatch) -> None:
    from weightfabric.fabric.hub import ops
    from weightfabric.fabric.hub.ops import Park

    server, sock, cred = served
    begin = ops.OPS["begin_fetch"]
    waits = {"b"}

    def waiting(state: Any, session: str, req: Any) -> Any:   # as a planned reader's wait
        reply = begin.handler(state, session, req)
        return (Park(check=lambda: None, timeout=1.0, on_timeout=lambda: reply)
                if req.worker in waits else reply)

    monkeypatch.setitem(ops.OPS, "begin_fetch", dataclasses.replace(begin, handler=waiting))
    item, = join([_begin("a"), _begin("b")], [True, True], "relay")
    answer, = _batch(sock, cred, [(item.payload, b"")])
    a, b = split(answer, item.req_ids)
    assert a is not None and decode(a).kind == REPLY and b is None
    assert msgspec.msgpack.decode(decode(answer).body)["plans"][1] is None


def _seen(answer: bytes | None) -> tuple[Any, ...]:
    """What a reader learns from an answer, less what two hubs differ in (epoch, expiries)."""
    assert answer is not None
    msg = decode(answer)
    if msg.kind != REPLY:
        return msg.kind, msg.name
    plan = decode_body(msg, PlanReply)
    return (msg.req_id, plan.fetch_id, plan.ranges, sorted(plan.workers), plan.manifest,
            plan.max_reports)


@settings(max_examples=12, deadline=None)
@given(per_node=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       gone=st.sets(st.integers(0, 19), max_size=3), seed=st.integers(0, 2**16))
def test_joined_begins_leave_the_hub_as_the_same_begins_alone(
        per_node: list[int], gone: set[int], seed: int) -> None:
    readers = {f"r{n}.{k}": f"n{n}" for n, count in enumerate(per_node) for k in range(count)}
    order = list(readers)
    random.Random(seed).shuffle(order)
    payloads = [_begin(w) for w in order]
    registered = {w: node for i, (w, node) in enumerate(readers.items()) if i not in gone}
    seen, held = [], []
    for joined in (True, False):
        with _hub(registered) as (server, sock, cred):
            items = (join(payloads, [True] * len(payloads), "relay") if joined
                     else [Item(p, [i], []) for i, p in enumerate(payloads)])
            answers = _batch(sock, cred, [(it.payload, b"") for it in items])
            out: list[bytes | None] = [None] * len(payloads)
            for it, data in zip(items, answers, strict=True):
                got = split(data, it.req_ids) if it.req_ids else [data]
                for m, answer in zip(it.members, got, strict=True):
                    out[m] = answer
            seen.append([_seen(a) for a in out])
            held.append({f.fetch_id: (f.worker, sorted(f.sources))
                         for f in server.state.fetches.values()})
    assert seen[0] == seen[1] and held[0] == held[1]
    assert len(held[0]) == len(registered)
