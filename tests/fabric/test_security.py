"""The attacks of docs/security.md, each tried and refused.

An attacker reaches the hub and the holders' read servers but holds neither the
deployment secret nor a token; a rollout holds a ``read`` token only.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace

import msgpack
import pytest
import torch
import zmq
from hub_helpers import reader_address
from torch import nn

import weightfabric as wf
from weightfabric.fabric.auth import (
    Authority,
    CapabilityCheck,
    ReplayGuard,
    capability,
    default_secret_path,
    ensure_secret,
    load_credential,
)
from weightfabric.fabric.errors import (
    AuthenticationError,
    ForbiddenError,
    ReadForbiddenError,
)
from weightfabric.fabric.hub_messages import LocateRequest, Request, StatusRequest
from weightfabric.fabric.protocol import ERROR, REQUEST, decode, decode_body, encode
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.transports import ReadServer, TcpTransport, client, tls
from weightfabric.fabric.transports.wire import Op

CHUNK = 4096


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def raw_call(url: str, req: Request, sign=None, session: str = "raw",
             req_id: int = 1) -> tuple[str, dict]:
    """Send ``req`` on a bare socket; the reply's kind name and body.

    ``sign(payload)`` gives the auth frame (None: none is sent).
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        payload = encode(REQUEST, req_id, session, req.op, req)
        sock.send_multipart([payload] if sign is None else [payload, sign(payload)])
        assert sock.poll(5000), "the hub did not answer"
        msg = decode(sock.recv_multipart()[0])
        body = decode_body(msg, dict)
        return ("error:" + msg.name if msg.kind == ERROR else "ok"), body
    finally:
        sock.close()


def token_file(tmp_path, name: str, roles: list[str], models: list[str] | None = None,
               ttl: float | None = None) -> str:
    path = tmp_path / f"{name}.token"
    path.write_text(Authority().issue_token(name, roles, models, ttl))
    path.chmod(0o600)
    return str(path)


def published(hub) -> tuple[wf.Worker, int]:
    trainer = wf.join(hub.url, worker="trainer")
    return trainer, trainer.model("policy", chunk_size=CHUNK).publish(net(1))


# ----------------------------------------------------------------- the hub channel

def test_an_unsigned_request_is_refused_before_it_runs(hub):
    trainer, version = published(hub)
    try:
        for req in (LocateRequest(model="policy", version=version), StatusRequest()):
            kind, body = raw_call(hub.url, req)
            assert kind == "error:unauthenticated", body
            assert "requires authentication" in body["message"]
        assert hub.num_refused == 2
        # meanwhile the hub and the holder serve legitimate workers as before
        rollout = wf.join(hub.url, worker="rollout")
        try:
            store = rollout.model("policy", chunk_size=CHUNK)
            store.attach(net(2))
            assert store.fetch(version).version == version
        finally:
            rollout.close()
    finally:
        trainer.close()


def test_a_client_with_another_secret_is_refused_and_told_why(hub, tmp_path):
    other = tmp_path / "other"
    ensure_secret(other)
    with pytest.raises(AuthenticationError, match="signature does not match"):
        wf.connect(hub.url, secret_file=other)
    with pytest.raises(AuthenticationError, match="signature does not match"):
        wf.join(hub.url, worker="intruder", secret_file=other)


def test_a_replayed_or_stale_request_is_refused(hub):
    cred = load_credential()
    req = StatusRequest()
    payload = encode(REQUEST, 1, "replay", req.op, req)
    auth, _ = cred.sign(payload)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(hub.url)
        sock.send_multipart([payload, auth])
        assert sock.poll(5000)
        assert decode(sock.recv_multipart()[0]).kind != ERROR
        sock.send_multipart([payload, auth])      # the same frame again
        assert sock.poll(5000)
        msg = decode(sock.recv_multipart()[0])
        assert msg.name == "unauthenticated" and "seen before" in decode_body(msg, dict)["message"]
    finally:
        sock.close()
    kind, body = raw_call(hub.url, req, session="stale",
                          sign=lambda p: cred.sign(p, now=time.time() - 3600)[0])
    assert kind == "error:unauthenticated" and "off the hub's clock" in body["message"]


def test_the_replay_guard_forgets_only_what_its_window_or_capacity_let_go():
    guard = ReplayGuard(window=10, capacity=2)
    assert guard.check(100.0, b"a", now=100.0) is None
    assert "seen before" in guard.check(100.0, b"a", now=101.0)
    assert guard.check(101.0, b"b", now=101.0) is None
    assert guard.check(102.0, b"c", now=102.0) is None      # capacity: "a" goes
    assert "older than" in guard.check(100.0, b"d", now=102.0)
    assert "clock" in guard.check(80.0, b"e", now=102.0)


def test_a_session_cannot_be_taken_over_by_another_credential(hub, tmp_path):
    reader = wf.connect(hub.url, secret_file=token_file(tmp_path, "rollouts", ["read"]))
    try:
        other = Authority().issue_token("observer", ["read"])
        thief = wf.connect(hub.url, secret=other)
        thief.session = reader.session
        with pytest.raises(AuthenticationError, match="belongs to another credential"):
            thief.status()
        thief.close()
    finally:
        reader.close()


def test_a_secure_client_refuses_an_insecure_hub_and_an_insecure_client_is_told_to_sign():
    with wf.serve("tcp://127.0.0.1:0", insecure=True) as fake:
        with pytest.raises(AuthenticationError, match="--insecure"):
            wf.connect(fake.url)
        with wf.connect(fake.url, insecure=True) as c:    # an operator who chose it
            assert c.status()["auth"].startswith("OFF")
    with wf.serve("tcp://127.0.0.1:0") as hub, \
            pytest.raises(AuthenticationError, match="requires authentication"):
        wf.connect(hub.url, insecure=True)


# -------------------------------------------------------------------------- roles

def test_a_read_token_fetches_and_serves_but_cannot_publish_or_administer(hub, tmp_path):
    trainer, version = published(hub)
    rollout = wf.join(hub.url, worker="rollout",
                      secret_file=token_file(tmp_path, "rollouts", ["read"]))
    try:
        store = rollout.model("policy", chunk_size=CHUNK)
        model = net(2)
        store.attach(model)
        assert store.fetch(version).version == version
        with pytest.raises(ForbiddenError, match="right to publish 'policy'"):
            store.publish(net(3))
        assert rollout.hub.latest("policy") == version      # its weights never became latest
        with pytest.raises(ForbiddenError, match="admin"):
            rollout.hub.set_retention("policy", keep_last=1)
        with pytest.raises(ForbiddenError, match="admin"):
            rollout.hub.pin("policy", version)
        # and the third rollout reads from it, with the capability the hub gave
        third = wf.join(hub.url, worker="third",
                        secret_file=token_file(tmp_path, "rollouts", ["read"]))
        try:
            s3 = third.model("policy", chunk_size=CHUNK)
            s3.attach(net(4))
            stats = s3.fetch(version)
            assert stats.version == version
        finally:
            third.close()
    finally:
        rollout.close()
        trainer.close()


def test_a_publish_token_covers_only_its_models(hub, tmp_path):
    trainer = wf.join(hub.url, worker="trainer",
                      secret_file=token_file(tmp_path, "trainer", ["publish"], ["policy*"]))
    try:
        assert trainer.model("policy-7b", chunk_size=CHUNK).publish(net(1)) >= 1
        with pytest.raises(ForbiddenError, match="right to publish 'reward'"):
            trainer.model("reward", chunk_size=CHUNK).publish(net(1))
    finally:
        trainer.close()


def test_kv_keys_belong_to_their_first_writer(hub, tmp_path):
    a = wf.connect(hub.url, secret_file=token_file(tmp_path, "job-a", ["read"]))
    b = wf.connect(hub.url, secret_file=token_file(tmp_path, "job-b", ["read"]))
    admin = wf.connect(hub.url)
    try:
        a.kv_put("job-a/nvshmem-uid", b"uid-a")
        a.kv_put("job-a/nvshmem-uid", b"uid-a2")          # its own key: fine
        with pytest.raises(ForbiddenError, match="belongs to 'job-a'"):
            b.kv_put("job-a/nvshmem-uid", b"evil")
        assert b.kv_get("job-a/nvshmem-uid") == b"uid-a2"
        admin.kv_put("job-a/nvshmem-uid", b"reset")
        assert a.kv_get("job-a/nvshmem-uid") == b"reset"
    finally:
        for c in (a, b, admin):
            c.close()


def test_an_expired_token_is_refused(hub, tmp_path):
    path = token_file(tmp_path, "brief", ["read"], ttl=0.2)
    time.sleep(0.3)
    with pytest.raises(AuthenticationError, match="expired"):
        wf.connect(hub.url, secret_file=path)


def serve_again(url: str, within: float = 10.0) -> wf.HubServer:
    """A hub on the ``url`` a stopped one used: its socket may take a moment to let go."""
    end = time.monotonic() + within
    while True:
        try:
            return wf.serve(url)
        except zmq.error.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_a_reader_cannot_recreate_an_unknown_version_after_a_hub_restart(tmp_path):
    url = "tcp://127.0.0.1:0"
    with wf.serve(url) as hub:
        trainer, version = published(hub)
        rollout = wf.join(hub.url, worker="rollout", timeout=5,
                          secret_file=token_file(tmp_path, "rollouts", ["read"]))
        store = rollout.model("policy", chunk_size=CHUNK)
        store.attach(net(2))
        store.fetch(version)
        trainer.close()
        holdings = [h.to_wire() for h in rollout.hub._holdings.values()]
        reply = rollout.hub.call("restore", {"worker": "rollout", "holdings": [
            msgpack.unpackb(msgpack.packb(_builtins(h))) for h in holdings]})
        assert reply.get("rejected", []) == []        # a version the hub knows: restored
        rollout.close()
    with serve_again(url.replace(":0", f":{hub.url.rsplit(':', 1)[1]}")) as fresh:
        rollout = wf.connect(fresh.url, worker="rollout-again",
                             secret_file=token_file(tmp_path, "rollouts", ["read"]))
        try:
            fake = _builtins(holdings[0])
            reply = rollout.call("restore", {"worker": "rollout-again", "holdings": [fake]})
            assert reply["restored"] == 0
            assert "may not re-create" in reply["rejected"][0][3]
            assert rollout.latest("policy") is None
        finally:
            rollout.close()


def _builtins(struct) -> dict:
    import msgspec

    return msgspec.to_builtins(struct)


# ------------------------------------------------------------- the read servers

def test_a_raw_read_without_a_valid_capability_is_refused_before_any_work(hub):
    trainer, version = published(hub)
    tcp = TcpTransport()
    region = region_name("policy", version)
    plain = trainer.server.address
    out = torch.empty(CHUNK, dtype=torch.uint8)
    key = load_credential().serve_key
    try:
        forged = capability(os.urandom(32), f"policy/v{version}/s", "attacker")
        other_version = capability(key, f"policy/v{version + 1}/s", "attacker")
        expired = capability(key, f"policy/v{version}/s", "attacker", ttl=-1)
        for cap, why in ((b"", "no read capability"), (forged, "did not get from its hub"),
                         (other_version, "covers"), (expired, "expired"),
                         (b"\x93garbage", "malformed")):
            with pytest.raises(ReadForbiddenError, match=why):
                tcp.read(replace(plain, cap=cap), region, 0, out, timeout=2)
        for op in (Op.LEASE, Op.DESCRIBE, Op.BITMAP, Op.PIN):
            with socket.create_connection((plain.host, plain.port), timeout=5) as conn, \
                    pytest.raises(ReadForbiddenError):
                client.request(conn, plain, op, region, nbytes=CHUNK, timeout=2)
        assert trainer.server.bytes_served == 0
        assert tcp.read(reader_address(trainer, region), region, 0, out, timeout=2) == CHUNK
    finally:
        tcp.close()
        trainer.close()


def test_a_reader_holds_a_bounded_number_of_leases():
    key = os.urandom(32)
    with ReadServer(capabilities=CapabilityCheck(key), max_leases_per_reader=2) as server:
        server.expose("m/v1/s0", torch.zeros(4 * CHUNK, dtype=torch.uint8), chunk_size=CHUNK)
        mine = replace(server.address, cap=capability(key, "m/v1/s", "greedy"))
        other = replace(server.address, cap=capability(key, "m/v1/s", "polite"))
        conns = [socket.create_connection((server.address.host, server.address.port))
                 for _ in range(4)]
        try:
            for conn in conns[:2]:
                client.lease(conn, mine, "m/v1/s0", offset=0, nbytes=CHUNK, timeout=2)
            with pytest.raises(ReadForbiddenError, match="holds 2 leases"):
                client.lease(conns[2], mine, "m/v1/s0", offset=0, nbytes=CHUNK, timeout=2)
            client.lease(conns[3], other, "m/v1/s0", offset=0, nbytes=CHUNK, timeout=2)
            client.request(conns[0], mine, Op.END, "m/v1/s0", timeout=2)   # one given back
            with socket.create_connection((server.address.host, server.address.port)) as c:
                client.lease(c, mine, "m/v1/s0", offset=0, nbytes=CHUNK, timeout=2)
        finally:
            for conn in conns:
                conn.close()
        assert server.retract("m/v1/s0", timeout=5)


# ---------------------------------------------------------------- the secret file

def test_the_secret_file_is_private_and_refused_when_it_is_not(tmp_path, monkeypatch):
    path = tmp_path / "cfg" / "secret"
    assert ensure_secret(path) == (path, True)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert ensure_secret(path) == (path, False)
    path.chmod(0o644)
    with pytest.raises(AuthenticationError, match="chmod 600"):
        load_credential(secret_file=path)
    monkeypatch.setenv("WEIGHTFABRIC_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(AuthenticationError, match="fabric hub serve"):
        load_credential()
    monkeypatch.delenv("WEIGHTFABRIC_SECRET_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_secret_path() == tmp_path / "xdg" / "weightfabric" / "secret"


def test_the_cli_issues_tokens_and_status_shows_the_mode(hub, tmp_path):
    fabric = [sys.executable, "-m", "weightfabric.tools"]
    out = subprocess.run([*fabric, "hub", "token", "--role", "read", "--name", "ro"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    path = tmp_path / "ro.token"
    path.write_text(out)
    path.chmod(0o600)
    status = subprocess.run([*fabric, "hub", "status", hub.url, "--secret-file", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "authentication: on" in " ".join(status.stdout.split())
    bad = subprocess.run([*fabric, "hub", "token", "--role", "root", "--name", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2


# ---------------------------------------------------------------------------- TLS

@pytest.fixture
def certs(tmp_path):
    from weightfabric.tools.bench.tls import make_certs

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test CA")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    return wf.TlsConfig(*make_certs(ours)), wf.TlsConfig(*make_certs(theirs))


def test_a_tls_holder_serves_only_readers_with_a_certificate_of_its_ca(hub, certs):
    ours, theirs = certs
    trainer = wf.join(hub.url, worker="trainer", tls=ours)
    try:
        assert trainer.server.address.tls
        version = trainer.model("policy", chunk_size=CHUNK).publish(net(1))
        rollout = wf.join(hub.url, worker="rollout", tls=ours)
        try:
            store = rollout.model("policy", chunk_size=CHUNK)
            model = net(2)
            store.attach(model)
            stats = store.fetch(version, verify=True)
            assert stats.version == version and "trainer" in stats.sources
            assert torch.equal(model[0].weight, net(1)[0].weight)
        finally:
            rollout.close()
        region = region_name("policy", version)
        address = reader_address(trainer, region)
        tcp = TcpTransport()
        out = torch.empty(CHUNK, dtype=torch.uint8)
        try:
            tls.use_for_reads(None)           # no certificate: told to get one
            with pytest.raises(wf.TransportError, match="TLS only"):
                tcp.read(address, region, 0, out, timeout=2)
            tls.use_for_reads(theirs)         # another CA's: the handshake fails
            with pytest.raises(wf.SourceLostError, match="TLS handshake"):
                tcp.read(address, region, 0, out, timeout=2)
            tls.use_for_reads(ours)
            assert tcp.read(address, region, 0, out, timeout=2) == CHUNK
        finally:
            tls.use_for_reads(None)
            tcp.close()
    finally:
        trainer.close()


def test_a_curve_hub_encrypts_its_channel_for_the_secret_and_tokens(tmp_path):
    with wf.serve("curve://127.0.0.1:0") as hub:
        assert hub.url.startswith("curve://")
        trainer = wf.join(hub.url, worker="trainer")
        rollout = wf.join(hub.url, worker="rollout",
                          secret_file=token_file(tmp_path, "rollouts", ["read"]))
        try:
            version = trainer.model("policy", chunk_size=CHUNK).publish(net(1))
            store = rollout.model("policy", chunk_size=CHUNK)
            store.attach(net(2))
            assert store.fetch(version).version == version
            assert "encrypted" in rollout.hub.status()["auth"]
        finally:
            rollout.close()
            trainer.close()
        # a plain-text peer gets nothing from it: the CURVE handshake never completes
        with pytest.raises(wf.HubUnavailableError):
            wf.connect(hub.url.replace("curve://", "tcp://"), timeout=1)
        with pytest.raises(AuthenticationError, match="encrypted"):
            wf.connect(hub.url, insecure=True)
