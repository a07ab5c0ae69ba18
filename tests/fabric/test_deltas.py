"""Delta fetches: a reader holding an older version gets the words that changed, bit-exact.

Readers and holders are in one process; ``WEIGHTFABRIC_HOST_ID`` puts them on different
"hosts" so reads go over TCP, where deltas are asked for.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import weightfabric as wf
from weightfabric.fabric.deltas import DeltaPolicy, delta_mode, word_width
from weightfabric.fabric.errors import NoBaseError, TransportError
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.transports import ReadServer, SourceAddress, TcpTransport
from weightfabric.fabric.transports.client import DeltaReply
from weightfabric.fabric.transports.wire import (
    BLOB_LEN,
    DELTA_HEAD,
    MAGIC,
    REPLY,
    REQUEST,
    Op,
    Status,
)
from weightfabric.kernels.delta import decode_delta

CHUNK = 64 * 1024
WORDS = 256 * 1024  # bf16 words: 512 KiB, 8 chunks
ON = FetchOptions(deltas="on")


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(WORDS, generator=g).to(torch.bfloat16),
            "b": torch.randn(1000, generator=g)}  # fp32, a short tail chunk


def step(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy with ``fraction`` of the bf16 words changed (as an optimizer step would)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in tensors.items()}
    n = out["w"].numel()
    idx = torch.randperm(n, generator=g)[:int(n * fraction)]
    out["w"][idx] = (out["w"][idx].float() + 0.5).to(torch.bfloat16)
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8).flatten(),
                                                    b[k].view(torch.uint8).flatten()) for k in a)


pytestmark = pytest.mark.hub(lease_s=5.0)


def holding_v1(on_hosts):
    """(trainer's store, reader's store, v1): the reader, on another host, holds v1."""
    trainer = on_hosts("trainer", "host-a")
    reader = on_hosts("reader", "host-b")
    t, r = trainer.model("m", chunk_size=CHUNK), reader.model("m", chunk_size=CHUNK)
    v1 = weights()
    t.publish(v1)
    r.fetch("latest", options=ON)
    return t, r, v1


def test_a_reader_holding_the_previous_version_gets_deltas_bit_exact(on_hosts, hub):
    trainer = on_hosts("trainer", "host-a")
    reader = on_hosts("reader", "host-b")
    t = trainer.model("m", chunk_size=CHUNK)
    r = reader.model("m", chunk_size=CHUNK)
    v1 = weights()
    t.publish(v1)
    first = r.fetch("latest", options=ON)
    assert first.delta_chunks == 0 and first.wire_bytes == first.bytes  # no base yet
    v2 = step(v1, 0.02, seed=1)
    version = t.publish(v2)
    stats = r.fetch("latest", options=ON)
    assert stats.version == version and equal(r.tensors, v2)
    assert stats.delta_chunks == stats.chunks > 0
    assert stats.wire_bytes < stats.bytes / 8, stats.to_dict()
    assert stats.wire == {"trainer": stats.wire_bytes}
    assert trainer.server.bytes_served < 2 * stats.bytes  # the first full, then the delta
    recent = hub.state.snapshot()["recent_fetches"][-1]
    assert recent["worker"] == "reader" and recent["version"] == version
    assert recent["sources"]["trainer"] == [stats.bytes, stats.wire_bytes]


def test_deltas_off_and_the_same_host_move_whole_chunks(on_hosts, monkeypatch):
    t, r, v1 = holding_v1(on_hosts)
    t.publish(step(v1, 0.02, seed=1))
    stats = r.fetch("latest", options=FetchOptions(deltas="off"))
    assert stats.delta_chunks == 0 and stats.wire_bytes == stats.bytes
    monkeypatch.setenv("WEIGHTFABRIC_DELTAS", "off")
    t.publish(step(v1, 0.02, seed=2))
    assert r.fetch("latest").delta_chunks == 0
    monkeypatch.delenv("WEIGHTFABRIC_DELTAS")
    local = on_hosts("local", "host-a").model("m", chunk_size=CHUNK)  # the trainer's host
    local.fetch(2)
    t.publish(step(v1, 0.02, seed=3))
    stats = local.fetch("latest")  # auto: shared memory, whole chunks
    assert stats.delta_chunks == 0 and stats.transports.keys() == {"shm"}
    monkeypatch.setenv("WEIGHTFABRIC_DELTAS", "sometimes")
    with pytest.raises(ValueError, match="WEIGHTFABRIC_DELTAS"):
        delta_mode()


def test_a_corrupted_base_is_caught_by_the_checksum_and_read_in_full(on_hosts):
    t, r, v1 = holding_v1(on_hosts)
    r.tensors["w"][:100] += 1  # the reader's base no longer is v1 in chunk 0
    v2 = step(v1, 0.02, seed=1)
    t.publish(v2)
    stats = r.fetch("latest", options=ON)
    assert equal(r.tensors, v2)
    assert stats.corrupted_chunks == 1 and stats.chunks_reread == 1
    assert 0 < stats.delta_chunks < stats.chunks


def test_chunks_from_deltas_are_verified_even_with_verify_off(on_hosts):
    t, r, v1 = holding_v1(on_hosts)
    r.tensors["w"][-100:] += 1  # the last chunk of the base is wrong
    v2 = step(v1, 0.02, seed=1)
    t.publish(v2)
    stats = r.fetch("latest", verify=False, options=ON)
    assert equal(r.tensors, v2) and stats.corrupted_chunks == 1


def test_an_in_place_fetch_decodes_over_its_base(on_hosts):
    t, r, v1 = holding_v1(on_hosts)
    v2 = step(v1, 0.05, seed=3)
    t.publish(v2)
    stats = r.fetch("latest", options=ON, in_place=True)
    assert equal(r.tensors, v2) and stats.delta_chunks == stats.chunks
    assert len(r.pool) == 1


def test_a_holder_without_the_base_is_read_in_full(on_hosts):
    """The reader's base is older than what the trainer keeps (it keeps two versions)."""
    trainer = on_hosts("trainer", "host-a")
    reader = on_hosts("reader", "host-b")
    t, r = trainer.model("m", chunk_size=CHUNK), reader.model("m", chunk_size=CHUNK)
    v = weights()
    t.publish(v)
    r.fetch("latest", options=ON)
    for seed in (1, 2, 3):
        v = step(v, 0.02, seed=seed)
        t.publish(v)
    stats = r.fetch("latest", options=ON)
    assert equal(r.tensors, v)
    assert stats.delta_chunks == 0 and stats.wire_bytes == stats.bytes


def test_a_base_older_than_the_previous_version_is_used_where_it_is_held(on_hosts):
    """A peer that holds v1 and v3 serves v3 as deltas against v1."""
    trainer, peer = on_hosts("trainer", "host-a"), on_hosts("peer", "host-c")
    reader = on_hosts("reader", "host-b")
    t = trainer.model("m", chunk_size=CHUNK)
    p, r = peer.model("m", chunk_size=CHUNK), reader.model("m", chunk_size=CHUNK)
    v = weights()
    t.publish(v)
    p.fetch("latest")
    r.fetch("latest", options=ON)
    for seed in (1, 2):
        v = step(v, 0.02, seed=seed)
        t.publish(v)
    p.fetch("latest")  # its v1 stays exposed beside v3
    assert t.retract(3) == "done"  # the peer is the only holder of v3 left
    stats = r.fetch("latest", options=ON)
    assert equal(r.tensors, v) and stats.delta_chunks == stats.chunks
    assert stats.sources.keys() == {"peer"}


def test_the_holder_of_the_base_dying_mid_fetch_leaves_the_reader_to_another(on_hosts, monkeypatch):
    trainer = on_hosts("trainer", "host-a")
    peers = [on_hosts("peer1", "host-c"), on_hosts("peer2", "host-d")]
    reader = on_hosts("reader", "host-b")
    t = trainer.model("m", chunk_size=CHUNK)
    stores = [w.model("m", chunk_size=CHUNK) for w in peers]
    r = reader.model("m", chunk_size=CHUNK)
    v1 = weights()
    t.publish(v1)
    for s in [*stores, r]:
        s.fetch("latest")
    v2 = step(v1, 0.02, seed=1)
    t.publish(v2)
    for s in stores:
        s.fetch("latest")
    assert t.retract(2) == "done"  # only the peers hold v2, and both hold v1
    died: list[str] = []
    once = threading.Lock()  # both peers may be asked at once: only one dies

    def dying(worker):
        def send_delta(*args, **kwargs):  # the first peer asked goes down mid-read
            if worker.name in died or once.acquire(blocking=False):
                if worker.name not in died:   # and serves nothing after, not even a read
                    died.append(worker.name)  # whose connection it had accepted before
                    worker.server.close()
                raise ConnectionError("killed")
            return type(worker.server)._send_delta(worker.server, *args, **kwargs)
        return send_delta

    for w in peers:
        monkeypatch.setattr(w.server, "_send_delta", dying(w))
    stats = r.fetch("latest", options=FetchOptions(deltas="on", read_timeout=5))
    assert equal(r.tensors, v2) and len(died) == 1
    assert died[0] in stats.failed_sources
    assert stats.delta_chunks == stats.chunks and stats.sources.keys() == {"peer1", "peer2"} - {died[0]}


def test_the_delta_policy_follows_the_measured_link():
    policy = DeltaPolicy(encode_bps=1e9)
    here, far = SourceAddress("h", 1, wf.fabric.transports.local_host_id()), SourceAddress("f", 1, "far")
    assert not policy.use("auto", here) and policy.use("on", here) and not policy.use("off", far)
    assert policy.use("auto", far)  # not measured yet: try deltas
    policy.observe(far, delivered=10**9, wire=10**9, seconds=0.25)  # a 4 GB/s link
    assert not policy.use("auto", far)
    for _ in range(4):  # then a 1 Gbit/s link
        policy.observe(far, delivered=10**9, wire=10**9, seconds=8.0)
    assert policy.use("auto", far)
    policy.observe(far, delivered=10**9, wire=10**9, seconds=10.0, decode_seconds=0.2)
    assert policy.link_bps("far") is not None


def test_word_width_is_the_element_size_holding_most_bytes():
    assert word_width([(torch.bfloat16, 1000), (torch.float32, 400)]) == 2
    assert word_width([(torch.float8_e4m3fn, 1000), (torch.float32, 400)]) == 1
    assert word_width([]) == 1


# --- the holder side ------------------------------------------------------------------------

@pytest.fixture
def holder():
    server = ReadServer()
    base = torch.randint(0, 256, (3 * CHUNK + 100,), dtype=torch.uint8)
    new = base.clone()
    new[::997] += 1
    server.expose("m/v1/s0", base, chunk_size=CHUNK)
    server.expose("m/v2/s0", new, chunk_size=CHUNK)
    yield server, base, new
    server.close()


def test_delta_reads_are_encoded_once_for_many_readers(holder):
    server, base, new = holder
    tcp = TcpTransport()
    try:
        for _ in range(3):
            reply = tcp.read_delta(server.address, "m/v2/s0", 0, new.numel(), chunk_size=CHUNK,
                                   width=2, bases=["m/v0/s0", "m/v1/s0"], timeout=5)
            assert reply.base == "m/v1/s0" and len(reply.blobs) == 4
            out = base.clone()
            for i, blob in enumerate(reply.blobs):
                sl = slice(i * CHUNK, min((i + 1) * CHUNK, new.numel()))
                decode_delta(torch.frombuffer(blob, dtype=torch.uint8), out[sl], out[sl])
            assert torch.equal(out, new)
        assert server.deltas.encoded == 4 and server.deltas.hits == 8
        assert server.bytes_delivered == 3 * new.numel() > server.bytes_served
        with pytest.raises(NoBaseError):
            tcp.read_delta(server.address, "m/v2/s0", 0, CHUNK, chunk_size=CHUNK, width=2,
                           bases=["m/v7/s0"], timeout=5)
        server.retract("m/v1/s0")
        assert server.deltas.bytes == 0  # its encodings went with the base
        with pytest.raises(NoBaseError):
            tcp.read_delta(server.address, "m/v2/s0", 0, CHUNK, chunk_size=CHUNK, width=2,
                           bases=["m/v1/s0"], timeout=5)
    finally:
        tcp.close()


def _raw(server: ReadServer, trailer: bytes, *, offset: int = 0, nbytes: int = CHUNK) -> int:
    name = b"m/v2/s0"
    with socket.create_connection((server.address.host, server.address.port), timeout=5) as s:
        s.sendall(REQUEST.pack(MAGIC, Op.DELTA, 0, len(name), offset, nbytes, 1.0, 0)
                  + name + trailer)
        status, _, _ = REPLY.unpack(s.recv(REPLY.size, socket.MSG_WAITALL))
        return status


@pytest.mark.parametrize("trailer,offset", [
    (bytes([3, 1, 0, 7]) + b"m/v1/s0", 0),     # width 3
    (bytes([2, 0]), 0),                        # no base
    (bytes([2, 9]), 0),                        # too many bases
    (bytes([2, 1, 0xFF, 0xFF]), 0),            # a name over the limit
    (bytes([2, 1, 0, 7]) + b"m/v1/s0", 5),     # not at a chunk boundary
])
def test_hostile_delta_requests_are_refused(holder, trailer, offset):
    server, _, _ = holder
    assert _raw(server, trailer, offset=offset) == Status.BAD_REQUEST
    assert _raw(server, bytes([2, 1, 0, 7]) + b"m/v1/s0") == Status.OK  # still serving


@pytest.mark.parametrize("payload,why", [
    (b"\x00", "shorter than its header"),
    (DELTA_HEAD.pack(1, 1) + BLOB_LEN.pack(0), "base 1 of 1"),
    (DELTA_HEAD.pack(0, 3) + BLOB_LEN.pack(0) * 3, "chunks of at most 2"),
    (DELTA_HEAD.pack(0, 2) + BLOB_LEN.pack(0), "shorter than its blob lengths"),
    (DELTA_HEAD.pack(0, 1) + BLOB_LEN.pack(10) + b"x" * 4, "add up to 20 bytes"),
    (DELTA_HEAD.pack(0, 1) + BLOB_LEN.pack(1) + b"xy", "add up to 11 bytes"),
])
def test_malformed_delta_replies_are_transport_errors(payload, why):
    with pytest.raises(TransportError, match=why):
        DeltaReply.parse(bytearray(payload), ["m/v1/s0"], 2, "m/v2/s0")


def test_a_holder_whose_base_differs_in_size_says_no_base(holder):
    server, _, new = holder
    server.expose("m/v3/s0", new[:CHUNK].clone(), chunk_size=CHUNK)
    assert _raw(server, bytes([2, 1, 0, 7]) + b"m/v3/s0") == Status.NO_BASE



def test_a_partial_replica_serves_deltas_of_the_chunks_it_has_as_they_arrive():
    """Deltas chain like whole chunks: a holder still fetching waits for the chunk, then encodes."""
    from weightfabric.fabric.progress import ChunkProgress

    server = ReadServer()
    tcp = TcpTransport()
    base = torch.randint(0, 256, (2 * CHUNK,), dtype=torch.uint8)
    new = base.clone()
    new[::501] += 1
    progress = ChunkProgress(2)
    server.expose("m/v1/s0", base, chunk_size=CHUNK)
    server.expose("m/v2/s0", new, chunk_size=CHUNK, progress=progress)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(tcp.read_delta(
        server.address, "m/v2/s0", 0, 2 * CHUNK, chunk_size=CHUNK, width=2,
        bases=["m/v1/s0"], timeout=10, prefix=True)))
    try:
        reader.start()
        time.sleep(0.3)
        assert not got  # waiting for chunk 0
        progress.mark(0)
        reader.join(10)
        [reply] = got
        assert len(reply.blobs) == 1  # the run it has: chunk 0
        out = base[:CHUNK].clone()
        decode_delta(torch.frombuffer(reply.blobs[0], dtype=torch.uint8), out, out)
        assert torch.equal(out, new[:CHUNK])
    finally:
        reader.join(10)
        tcp.close()
        server.close()


def test_a_bad_delta_mode_is_refused_before_the_hub_hears_of_the_fetch(on_hosts, monkeypatch):
    t, r, v1 = holding_v1(on_hosts)
    t.publish(step(v1, 0.02, seed=1))

    def never(*args, **kwargs):
        raise AssertionError("begin_fetch was called")

    monkeypatch.setattr(r.hub, "begin_fetch", never)
    with pytest.raises(ValueError, match="deltas must be one of"):
        r.fetch("latest", options=FetchOptions(deltas="sometimes"))
    assert r.version == 1
