"""Typed hub messages: the registry, typed validation at the hub, the protocol version."""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from hub_helpers import small_manifest

import weightfabric as wf
from weightfabric.fabric import client as client_module
from weightfabric.fabric.errors import BadRequestError, ProtocolError
from weightfabric.fabric.hub.ops import OPS, READ_ONLY
from weightfabric.fabric.hub_messages import (
    OPERATIONS,
    BeginPublishReply,
    CommitRequest,
    Holding,
    ManifestWire,
    PlanReply,
    Reply,
    Request,
)
from weightfabric.fabric.protocol import (
    ERROR,
    PROTOCOL_VERSION,
    REQUEST,
    decode,
    decode_body,
    encode,
)
from weightfabric.fabric.zmq_util import make_socket


@pytest.fixture
def hub() -> Iterator[wf.HubServer]:
    server = wf.serve("tcp://127.0.0.1:0")
    yield server
    server.stop()


# ------------------------------------------------------------------- registry
def test_every_op_has_a_request_type_a_reply_type_and_a_handler() -> None:
    assert set(OPS) == set(OPERATIONS)
    for name, op in OPS.items():
        request, reply = OPERATIONS[name]
        assert op.request is request and request.op == name
        assert issubclass(request, Request) and callable(op.handler)
        assert reply is dict or issubclass(reply, Reply)
        assert request.__struct_config__.frozen
        assert request.__struct_config__.forbid_unknown_fields
    assert set(OPS) >= READ_ONLY


def test_every_op_has_a_client_stub() -> None:
    source = inspect.getsource(client_module.HubClient)
    missing = [name for name, (request, _) in OPERATIONS.items()
               if f"{request.__name__}(" not in source]
    assert missing == []


def test_requests_and_replies_round_trip_and_leave_defaults_off_the_wire() -> None:
    req = CommitRequest(worker="w", model="m", version=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=CommitRequest) == req
    manifest = small_manifest()
    assert ManifestWire.of(manifest).manifest() == manifest
    holding = Holding(model="m", version=1, shard=0, manifest=ManifestWire.of(manifest))
    assert set(msgspec.to_builtins(holding)) == {"model", "version", "shard", "manifest"}
    reply = BeginPublishReply(version=4)
    assert reply.version == 4 and msgspec.to_builtins(reply) == {"version": 4}


# ---------------------------------------------------------- typed validation
@pytest.mark.parametrize(("op", "args", "field"), [
    ("commit", {"worker": "w", "model": "m", "version": "1"}, "version"),      # wrong type
    ("commit", {"worker": "w", "model": "m", "version": True}, "version"),     # bool: no int
    ("commit", {"worker": "w", "model": "m"}, "version"),                      # missing
    ("commit", {"worker": "w", "model": "m", "version": 1, "force": 1}, "force"),  # unknown
    ("begin_fetch", {"worker": "w", "model": ["x"], "fetch_id": "f"}, "model"),
    ("plan", {"worker": "w", "fetch_id": "f", "chunks": [0, "1"]}, "chunks[1]"),
    ("heartbeat", {"worker": "w", "publishing": [["m"]]}, "publishing[0]"),
    ("restore", {"worker": "w", "holdings": [{"model": "m"}]}, "holdings[0]"),
    ("kv_put", {"key": "k", "value": "not bytes"}, "value"),
    ("wait_version", {"model": "m", "timeout": "soon"}, "timeout"),
    ("register", {"worker": "w", "location": {"node": 5}}, "location[...]"),
])
def test_a_bad_field_is_refused_naming_the_op_and_the_field(hub, op: str, args: dict[str, Any],
                                                             field: str) -> None:
    with wf.connect(hub.url, timeout=5) as c:
        with pytest.raises(BadRequestError) as err:
            c.call(op, args)
        assert op in str(err.value) and f"`{field}`" in str(err.value).replace("'", "`")
        assert c.call("ping", {}) == {"pong": True}        # the hub serves on


def test_semantic_checks_stay(hub) -> None:
    with wf.connect(hub.url, worker="w", heartbeat=False, timeout=5) as c:
        with pytest.raises(BadRequestError, match="finite"):
            c.call("wait_version", {"model": "m", "timeout": float("nan")})
        bad = ManifestWire.of(small_manifest())
        bad = msgspec.structs.replace(bad, checksums=[1])      # 1 checksum for 4 chunks
        with pytest.raises(BadRequestError, match="bad manifest"):
            c.call("begin_publish", {"worker": "w", "model": "m", "manifest": bad})
        with pytest.raises(BadRequestError, match="unknown operation"):
            c.call("no_such_op", {})


def test_random_typed_bodies_get_typed_errors_never_internal_ones(hub) -> None:
    rng = random.Random(3)
    values: list[Any] = [None, True, 0, -1, 2**63, 1.5, float("inf"), "", "m", b"\x00", [],
                         [1, "x"], {}, {"a": 1}, [["m", 1]]]
    with wf.connect(hub.url, worker="fuzz", heartbeat=False, timeout=5) as c:
        for _ in range(400):
            name, (request, _) = rng.choice(sorted(OPERATIONS.items()))
            fields = list(request.__struct_fields__) + ["extra"]
            args = {f: rng.choice(values) for f in rng.sample(fields, rng.randrange(len(fields)))}
            try:
                c.call(name, args, timeout=5)
            except wf.HubError as exc:
                assert exc.code != "hub_error", (name, args, exc)   # no internal error
        assert c.call("ping", {}) == {"pong": True}


def test_typed_replies_reach_the_client(hub) -> None:
    with wf.connect(hub.url, worker="t", heartbeat=False, timeout=5) as t, \
            wf.connect(hub.url, worker="r", heartbeat=False, timeout=5) as r:
        v = t.begin_publish("policy", small_manifest())
        assert t.commit("policy", v) == "committed"
        plan = r.request(wf.fabric.hub_messages.BeginFetchRequest(
            worker="r", model="policy", fetch_id="f1"), PlanReply)
        assert isinstance(plan, PlanReply) and plan.version == v
        assert plan.manifest is not None and plan.manifest.manifest() == small_manifest()
        assert r.complete_fetch("f1").complete
        where = r.locate("policy")                        # plain data, as before
        assert set(where["shards"][0]["holders"]) == {"t", "r"}
        assert wf.Manifest.from_wire(where["shards"][0]["manifest"]) == small_manifest()


# ------------------------------------------------------------ protocol version
def test_a_client_of_the_old_version_gets_a_clear_version_error(hub) -> None:
    old = PROTOCOL_VERSION - 1
    sock = make_socket(zmq.DEALER, max_message_size=1 << 20)
    sock.connect(hub.url)
    try:
        sock.send(msgpack.packb([old, REQUEST, 7, "old-client", "ping", {}]))
        assert sock.poll(5000, zmq.POLLIN)
        raw = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
    # what the old client reads: an error in its own version, with the code and a message
    version, kind, req_id, _epoch, code, body = raw
    assert (version, kind, req_id, code) == (old, ERROR, 7, "protocol")
    assert f"protocol version {old} is not supported" in body["message"]
    assert f"speaks {PROTOCOL_VERSION}" in body["message"]


def test_this_side_refuses_another_version_with_a_clear_error() -> None:
    for other in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1):
        with pytest.raises(ProtocolError, match=f"protocol version {other} is not supported"):
            decode(msgpack.packb([other, REQUEST, 1, "s", "ping", {}]))
    msg = decode(encode(REQUEST, 1, "s", "commit", CommitRequest(worker="w", model="m",
                                                                 version=2)))
    assert decode_body(msg, CommitRequest).version == 2
    with pytest.raises(ProtocolError, match="malformed"):
        decode(msgpack.packb([PROTOCOL_VERSION, REQUEST, 1, "s", "ping", [1, 2]]))
