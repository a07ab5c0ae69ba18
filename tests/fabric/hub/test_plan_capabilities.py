"""A plan's read capabilities and manifest, made once where they can be, mean what they did.

The hub encodes a plan's capability body once and signs it per holder with a kept key
(`fabric.auth.CapabilityBody`, `fabric.auth.MacKey`), and splices the manifest's msgpack,
made once per manifest, into each plan (`HubServer._plan_body`). Checked here: the bytes are
those of `capability` and of a plain encoding; each capability opens only its holder's
read server, for this reader and version, until its expiry; a holder that registers again
under another credential gets capabilities signed with its new key. The server is driven
by hand, as in test_parked_polls: requests go to `HubServer._handle`, signed.
"""

from __future__ import annotations

import hmac
import itertools
import os
import time
from typing import Any

import msgpack
import msgspec
import pytest
from hub_helpers import capture_replies, small_manifest

from weightfabric.fabric.auth import (
    Authority,
    CapabilityBody,
    CapabilityCheck,
    Credential,
    MacKey,
    capability,
    load_credential,
    serving_key,
)
from weightfabric.fabric.hub.server import HubServer
from weightfabric.fabric.hub_messages import ManifestWire, PlanReply
from weightfabric.fabric.protocol import REPLY, REQUEST, encode

_ids = itertools.count(1)
TTL = 600.0


@pytest.mark.parametrize("size", [0, 1, 31, 32, 64, 65, 200])
def test_a_mac_key_is_hmac_sha256(size):
    key = os.urandom(size)
    for data in (b"", b"wf-cap" + os.urandom(40), os.urandom(10_000)):
        assert MacKey(key).mac(data) == hmac.digest(key, data, "sha256")


@pytest.mark.parametrize("scope", ["m/v1/s", "a-model-with-a-long-name/" * 12 + "v7/s",
                                   "m" * 70_000 + "/v1/s"])    # body as bin 8, 16 and 32
def test_a_capability_body_signs_the_bytes_capability_makes(scope):
    key, now = os.urandom(32), 1_000_000.0
    cap = CapabilityBody(scope, "reader-1", now + 30).sign(MacKey(key))
    body = msgpack.packb([scope, "reader-1", now + 30])
    assert cap == msgpack.packb([body, hmac.digest(key, b"wf-cap" + body, "sha256")])
    assert cap == capability(key, scope, "reader-1", ttl=30, now=now)
    check = CapabilityCheck(key)
    assert check.reader(cap, scope + "0", now=now + 30) == "reader-1"    # valid to its expiry
    with pytest.raises(PermissionError, match="expired"):
        check.reader(cap, scope + "0", now=now + 30.001)
    with pytest.raises(PermissionError, match="did not get from its hub"):
        CapabilityCheck(os.urandom(32)).reader(cap, scope + "0", now=now)


class _Hub:
    """A `HubServer` with authentication on, stepped by hand; replies by request id."""

    def __init__(self) -> None:
        self.server = HubServer(f"memory://caps-{next(_ids)}", lease_s=3600, cap_ttl_s=TTL)
        self.replies: dict[int, Any] = {}
        sent = self.replies

        def keep(msg: Any, raw: bytes) -> None:
            sent[msg.req_id] = (msg.kind, raw, msgspec.msgpack.decode(msg.body))

        capture_replies(self.server, keep)

    def ask(self, cred: Credential, session: str, op: str, args: dict[str, Any]) -> dict:
        rid = next(_ids)
        payload = encode(REQUEST, rid, session, op, args)
        frame, _ = cred.sign(payload)
        self.server._handle([session.encode(), payload, frame])
        self.server._flush()
        kind, _raw, body = self.replies[rid]
        assert kind == REPLY, body
        return body

    def register(self, cred: Credential, worker: str, session: str | None = None) -> None:
        self.ask(cred, session or worker, "register",
                 {"worker": worker, "location": {"datacenter": "dc", "node": worker},
                  "endpoints": {"read": {"host": "127.0.0.1", "port": 1}}})


def _read_token(name: str) -> Credential:
    return load_credential(secret=Authority().issue_token(name, ["read"]))


def test_each_capability_of_a_plan_opens_only_its_holder_for_this_reader_and_version():
    hub, secret = _Hub(), load_credential()
    rollouts, others = _read_token("rollouts"), _read_token("others")
    hub.register(secret, "trainer")
    manifest = msgspec.to_builtins(ManifestWire.of(small_manifest(4)))
    v = hub.ask(secret, "trainer", "begin_publish",
                {"worker": "trainer", "model": "m", "manifest": manifest})["version"]
    hub.ask(secret, "trainer", "commit", {"worker": "trainer", "model": "m", "version": v})
    holders = {"h-rollouts": rollouts, "h-others": others}
    for w, cred in holders.items():     # two holders of other credentials, complete
        hub.register(cred, w)
        hub.ask(cred, w, "begin_fetch", {"model": "m", "version": v, "worker": w,
                                         "fetch_id": w})
        hub.ask(cred, w, "complete_fetch", {"fetch_id": w, "worker": w})
    hub.register(rollouts, "reader")
    before = time.time()
    plan = hub.ask(rollouts, "reader", "begin_fetch",
                   {"model": "m", "version": v, "worker": "reader", "fetch_id": "f"})
    after = time.time()
    assert set(plan["workers"]) == {"trainer", *holders}
    keys = {"trainer": secret.serve_key, **{w: c.serve_key for w, c in holders.items()}}
    for w, src in plan["workers"].items():
        body, _ = msgpack.unpackb(src["cap"])
        scope, reader, expires = msgpack.unpackb(body)
        assert (scope, reader) == (f"m/v{v}/s", "reader")
        assert before + TTL <= expires <= after + TTL
        assert CapabilityCheck(keys[w]).reader(src["cap"], f"m/v{v}/s0", now=expires) == "reader"
        with pytest.raises(PermissionError, match="expired"):
            CapabilityCheck(keys[w]).reader(src["cap"], f"m/v{v}/s0", now=expires + 1)
        with pytest.raises(PermissionError, match="covers"):
            CapabilityCheck(keys[w]).reader(src["cap"], f"m/v{v + 1}/s0", now=before)
        for other, key in keys.items():   # another holder's read server refuses it
            if other != w:
                with pytest.raises(PermissionError, match="did not get from its hub"):
                    CapabilityCheck(key).reader(src["cap"], f"m/v{v}/s0", now=before)
    # a re-plan gets fresh capabilities, for the same reader
    again = hub.ask(rollouts, "reader", "plan", {"fetch_id": "f", "worker": "reader"})
    assert all(CapabilityCheck(keys[w]).reader(src["cap"], f"m/v{v}/s0") == "reader"
               for w, src in again["workers"].items())
    # a holder that registers again under another credential: signed with its new key
    hub.ask(others, "h-others", "unregister", {"worker": "h-others"})
    hub.register(rollouts, "h-others", session="h-others-2")
    hub.ask(rollouts, "h-others-2", "begin_fetch",
            {"model": "m", "version": v, "worker": "h-others", "fetch_id": "h2"})
    hub.ask(rollouts, "h-others-2", "complete_fetch", {"fetch_id": "h2", "worker": "h-others"})
    hub.register(rollouts, "reader-2")
    plan = hub.ask(rollouts, "reader-2", "begin_fetch",
                   {"model": "m", "version": v, "worker": "reader-2", "fetch_id": "f2"})
    cap = plan["workers"]["h-others"]["cap"]
    assert CapabilityCheck(rollouts.serve_key).reader(cap, f"m/v{v}/s0") == "reader-2"
    with pytest.raises(PermissionError, match="did not get from its hub"):
        CapabilityCheck(others.serve_key).reader(cap, f"m/v{v}/s0")
    assert serving_key(rollouts.key) == rollouts.serve_key


def test_a_plan_s_manifest_encoded_once_is_the_same_bytes_for_each_version():
    hub, secret = _Hub(), load_credential()
    hub.register(secret, "trainer")
    wires = {}
    for chunks in (4, 6):
        manifest = msgspec.to_builtins(ManifestWire.of(small_manifest(chunks, tag=f"t{chunks}")))
        v = hub.ask(secret, "trainer", "begin_publish",
                    {"worker": "trainer", "model": "m", "manifest": manifest})["version"]
        hub.ask(secret, "trainer", "commit", {"worker": "trainer", "model": "m", "version": v})
        wires[v] = manifest
    for v, manifest in wires.items():
        for i in range(2):     # the second plan of a version splices the kept encoding
            w = f"r{v}-{i}"
            hub.register(secret, w)
            plan = hub.ask(secret, w, "begin_fetch",
                           {"model": "m", "version": v, "worker": w, "fetch_id": w})
            assert plan["manifest"] == msgspec.msgpack.decode(msgspec.msgpack.encode(manifest))
    state = hub.server.state
    for v in wires:       # as the plain encoding of the reply, byte for byte
        reply = state.plan(f"r{v}-0", f"r{v}-0", session=f"r{v}-0")
        assert isinstance(reply, PlanReply) and reply.manifest is not None
        assert hub.server._reply_bytes(7, reply) == encode(REPLY, 7, hub.server.epoch, "", reply)
