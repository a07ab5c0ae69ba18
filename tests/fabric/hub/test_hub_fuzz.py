"""Bad frames: random bytes, truncated and oversized messages, raw TCP garbage.

The hub must answer with a typed error or drop the connection, and keep serving
everyone else.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

import msgpack
import pytest
import zmq
from hub_helpers import small_manifest

import weightfabric as wf
from weightfabric.fabric.auth import load_credential
from weightfabric.fabric.errors import BadRequestError, HubError, ProtocolError
from weightfabric.fabric.protocol import (
    ERROR,
    PROTOCOL_VERSION,
    REQUEST,
    decode,
    decode_body,
    encode,
)
from weightfabric.fabric.zmq_util import make_socket

ITERATIONS = 300
MAX_MSG = 64 * 1024


@pytest.fixture
def hub():
    server = wf.serve("tcp://127.0.0.1:0", max_message_size=MAX_MSG)
    yield server
    server.stop()


def raw_dealer(url: str) -> zmq.Socket:
    sock = make_socket(zmq.DEALER, max_message_size=10 * MAX_MSG)
    sock.connect(url)
    return sock


def ask(sock: zmq.Socket, frames: list[bytes], timeout_ms: int = 2000):
    sock.send_multipart(frames)
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return decode(sock.recv_multipart()[0])


def signed(payload: bytes) -> list[bytes]:
    """``payload`` and its auth frame, signed with the suite's secret."""
    return [payload, load_credential().sign(payload)[0]]


def test_codec_rejects_garbage_and_oversize() -> None:
    rng = random.Random(1)
    good = encode(REQUEST, 7, "s", "ping", {})
    for _ in range(ITERATIONS):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        with contextlib.suppress(ProtocolError):
            decode(blob)
    for cut in range(len(good)):
        with pytest.raises(ProtocolError):
            decode(good[:cut])
    with pytest.raises(ProtocolError, match="over the"):
        decode(b"\x00" * 101, max_size=100)
    with pytest.raises(ProtocolError, match="over the"):
        encode(REQUEST, 1, "s", "x", {"b": b"\x00" * 200}, max_size=100)
    with pytest.raises(ProtocolError, match="protocol version"):
        decode(msgpack.packb([PROTOCOL_VERSION + 1, REQUEST, 1, "s", "ping", {}]))


def test_random_and_truncated_frames_get_typed_errors_and_hub_keeps_serving(hub) -> None:
    rng = random.Random(5)
    good = encode(REQUEST, 9, "fuzzer", "ping", {})
    worker = wf.connect(hub.url, worker="honest", heartbeat=False, timeout=5)
    v = worker.begin_publish("policy", small_manifest())
    worker.commit("policy", v)
    sock = raw_dealer(hub.url)
    try:
        for i in range(ITERATIONS):
            kind = i % 3
            if kind == 0:
                frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))]
            elif kind == 1:
                frames = [good[:rng.randrange(len(good))]]
            else:
                frames = [*signed(good), b"extra frame"]
            reply = ask(sock, frames)
            assert reply is not None and reply.kind == ERROR
            assert reply.name in ("protocol", "bad_request")
            if i % 50 == 0:
                assert worker.latest("policy") == v
        # Well-formed but wrong: typed errors, not crashes.
        bad_args = encode(REQUEST, 11, "fuzzer", "begin_fetch", {"model": ["x"]})
        reply = ask(sock, signed(bad_args))
        assert reply.kind == ERROR and reply.name == "bad_request"
        reply = ask(sock, [bad_args])     # unsigned: refused before its arguments are read
        assert reply.kind == ERROR and reply.name == "unauthenticated"
        with pytest.raises(BadRequestError):
            worker.call("commit", {"worker": "honest", "model": "policy", "version": "1"})
        assert decode_body(ask(sock, signed(good)), dict) == {"pong": True}
    finally:
        sock.close(0)
        worker.close()


def test_oversized_frame_is_dropped_and_others_unaffected(hub) -> None:
    client = wf.connect(hub.url, timeout=5)
    sock = raw_dealer(hub.url)
    try:
        big = encode(REQUEST, 1, "big", "ping", {"pad": b"\x00" * (2 * MAX_MSG)},
                     max_size=10 * MAX_MSG)
        assert ask(sock, [big], timeout_ms=500) is None      # zmq drops it
        assert client.call("ping", {}) == {"pong": True}
    finally:
        sock.close(0)
        client.close()


def test_raw_tcp_garbage_does_not_stop_the_hub(hub) -> None:
    host, port = hub.url[len("tcp://"):].rsplit(":", 1)
    rng = random.Random(9)
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=2) as s, \
                contextlib.suppress(OSError):
            s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 512))))
    with wf.connect(hub.url, timeout=5) as client:
        assert client.call("ping", {}) == {"pong": True}


def _holding(**fields) -> dict:
    good = {"model": "m", "version": 1, "shard": 0, "num_shards": 1,
            "manifest": small_manifest().to_wire(), "state": "committed", "complete": True,
            "chunks": [], "fetch_id": None, "publisher": False}
    return {**good, **fields}


@pytest.mark.parametrize("bad", [
    {"model": b"m"}, {"model": 5}, {"version": "1"}, {"version": 0}, {"shard": None},
    {"num_shards": 2.0}, {"fetch_id": ["x"]}, {"chunks": [0, 99]}, {"chunks": ["0"]},
    {"state": "retired"}, {"complete": "yes"}, {"publisher": 1}, {"manifest": None},
])
def test_malformed_restore_is_refused_before_any_change_and_hub_serves_on(
        tmp_path: Path, bad: dict) -> None:
    server = wf.serve("tcp://127.0.0.1:0", state_dir=tmp_path)
    try:
        with wf.connect(server.url, worker="evil", heartbeat=False, timeout=5) as c:
            before = c.status()["models"]
            holdings = [_holding(model="ok"), _holding(**bad)]
            with pytest.raises(BadRequestError, match="holding|argument"):
                c.call("restore", {"worker": "evil", "holdings": holdings})
            assert c.status()["models"] == before          # the good holding did not land
            v = c.begin_publish("policy", small_manifest())  # the hub (and its saves) go on
            assert c.commit("policy", v) == "committed"
            assert c.latest("policy") == v
    finally:
        server.stop()


def test_failing_state_save_answers_an_error_and_the_hub_serves_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from weightfabric.fabric.hub import record_store
    real_save = record_store.save_state
    calls = []

    def save_once_broken(*args) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk full")
        real_save(*args)
    monkeypatch.setattr(record_store, "save_state", save_once_broken)
    server = wf.serve("tcp://127.0.0.1:0", state_dir=tmp_path)
    try:
        with wf.connect(server.url, worker="w", heartbeat=False, timeout=5) as c:
            with pytest.raises(HubError, match="could not save the hub state"):
                c.begin_publish("policy", small_manifest())
            v = c.begin_publish("policy", small_manifest())
            assert c.commit("policy", v) == "committed"
            assert c.call("ping", {}) == {"pong": True}
        assert server._thread.is_alive()
    finally:
        server.stop()
