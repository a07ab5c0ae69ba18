"""A node relay between a node's workers and the hub: real hub, relay, stores and reads.

Readers connect to the relay as to the hub; their fetches are bit-exact, their requests
ride in batches (a node's readers planned together), long polls go through alone, and a
hub that refuses batches still answers every request, one by one.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest
import torch
from hub_helpers import small_manifest

import weightfabric as wf
from weightfabric.fabric.errors import BadRequestError, HubUnavailableError, WaitTimeoutError
from weightfabric.fabric.hub.server import HubServer
from weightfabric.fabric.relay import NodeRelay

CHUNK = 16 * 1024
NODE = {"datacenter": "dc0", "node": "n0"}


@pytest.fixture
def relay(hub: HubServer) -> Iterator[NodeRelay]:
    with NodeRelay(hub.url) as r:
        yield r


def _fetch_all(trainer_url: str, relay_url: str, readers: int) -> list[bool]:
    """A trainer publishes (straight to the hub), ``readers`` fetch it through the relay."""
    workers = []
    try:
        trainer = wf.join(trainer_url, worker="trainer", timeout=10,
                          location={"datacenter": "dc0", "node": "trainer"})
        workers.append(trainer)
        weights = {"w": torch.randn(200, 64, generator=torch.Generator().manual_seed(1)),
                   "b": torch.arange(64, dtype=torch.float32)}
        version = trainer.model("m", chunk_size=CHUNK).publish(weights)
        stores = []
        for i in range(readers):
            w = wf.join(relay_url, worker=f"r{i}", timeout=10, location=NODE)
            workers.append(w)
            store = w.model("m", chunk_size=CHUNK)
            store.attach({k: torch.zeros_like(v) for k, v in weights.items()})
            stores.append(store)
        with concurrent.futures.ThreadPoolExecutor(readers) as pool:
            got = list(pool.map(lambda s: s.fetch(version).version, stores))
        assert got == [version] * readers
        return [all(torch.equal(s.tensors[k], v) for k, v in weights.items()) for s in stores]
    finally:
        for w in workers[::-1]:
            w.close()


def test_readers_behind_a_relay_fetch_bit_exact_in_batches(hub: HubServer,
                                                          relay: NodeRelay) -> None:
    assert _fetch_all(hub.url, relay.url, readers=4) == [True] * 4
    assert relay.stats.batches > 0 and relay.stats.batched >= 4 * 3  # register, begin, complete
    assert hub.num_batches == relay.stats.batches
    assert relay.stats.refused_batches == 0 and relay.stats.dropped == 0


def test_a_nodes_readers_begin_in_one_joined_request_and_fetch_bit_exact(
        hub: HubServer) -> None:
    # a window long enough for the 4 readers' begins to meet in one batch
    with NodeRelay(hub.url, window_s=0.3) as relay:
        assert _fetch_all(hub.url, relay.url, readers=4) == [True] * 4
        assert relay.stats.joined >= 2 and relay.stats.joined <= relay.stats.vouched
    assert relay.stats.alone == 0


def test_long_polls_go_through_the_relay_alone(hub: HubServer, relay: NodeRelay) -> None:
    with wf.connect(hub.url, worker="t", timeout=10) as t, \
            wf.connect(relay.url, worker="r", timeout=10, location=NODE) as r:
        before = relay.stats.alone
        with pytest.raises(WaitTimeoutError):       # parked at the hub, answered at its end
            r.wait_version("m", after=0, timeout=0.2)
        v = t.begin_publish("m", small_manifest())
        t.commit("m", v)
        assert r.wait_version("m", after=0, timeout=5) == v
        assert relay.stats.alone == before + 2
        assert r.latest("m") == v and relay.stats.batched >= 1


def test_a_hub_that_refuses_batches_answers_each_request_alone(
        hub: HubServer, relay: NodeRelay, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(ident, msg, caller):   # as a hub without batches answers one
        hub._send(ident, hub._error_bytes(msg.req_id, BadRequestError(
            "unknown operation 'batch'")), caller)

    monkeypatch.setattr(hub, "_batch", refuse)
    assert _fetch_all(hub.url, relay.url, readers=2) == [True] * 2
    assert relay.stats.refused_batches > 0 and relay.stats.alone >= relay.stats.batched


def test_a_hub_that_does_not_know_joined_begins_answers_each_alone(
        hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(ident, msg, caller, *, vouched):   # as an older hub answers it
        hub._send(ident, hub._error_bytes(msg.req_id, BadRequestError(
            "unknown operation 'begin_fetches'; is the client newer than the hub?")))

    monkeypatch.setattr(hub, "_begin_fetches", unknown)
    with NodeRelay(hub.url, window_s=0.3) as relay:
        assert _fetch_all(hub.url, relay.url, readers=4) == [True] * 4
        assert relay.stats.joined >= 2 and relay.stats.alone >= relay.stats.joined


def test_bad_relay_settings_are_refused_before_it_serves(hub: HubServer) -> None:
    with pytest.raises(ValueError, match="loopback"):
        NodeRelay(hub.url, "memory://relay")
    with pytest.raises(ValueError, match="window_s"):
        NodeRelay(hub.url, window_s=-1)
    with pytest.raises(HubUnavailableError, match="bad hub URL"):
        NodeRelay("http://hub:1")


def test_a_relay_given_a_services_hubs_moves_to_the_one_that_leads(hub: HubServer) -> None:
    standby = wf.serve("tcp://127.0.0.1:0")
    standby._leading = False            # answers NotLeaderError, as a standby of a service
    silent = "tcp://127.0.0.1:9"        # nobody answers there
    try:
        for i, urls in enumerate(([standby.url, hub.url], [silent, hub.url])):
            with NodeRelay(",".join(urls)) as relay:
                with wf.connect(relay.url, worker=f"w{i}", timeout=10, location=NODE) as w:
                    assert w.latest("m") is None            # batched: carried to the leader
                    with pytest.raises(WaitTimeoutError):   # alone
                        w.wait_version("m", after=0, timeout=0.2)
                assert relay.hub_url == hub.url and relay.stats.hub_changes == 1
    finally:
        standby.stop()


def test_a_relay_vouches_for_its_own_credentials_requests_only(hub: HubServer,
                                                               relay: NodeRelay) -> None:
    from weightfabric.fabric.auth import Authority, default_secret_path

    token = Authority(default_secret_path()).issue_token("reader", ["read"])
    with wf.connect(relay.url, worker="same", timeout=10, location=NODE) as same:
        same.call("ping", {})
        assert relay.stats.vouched >= 2           # register and ping: checked and vouched
    before = relay.stats.vouched
    with wf.connect(relay.url, worker="other", timeout=10, location=NODE,
                    secret=token) as other:       # another credential: signed end to end
        other.call("ping", {})
        assert other.latest("m") is None
    assert relay.stats.vouched == before and relay.stats.batched >= before + 3


def test_a_relay_holds_its_next_batch_until_the_hub_answers_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch on its way at a time (a busy hub gets fewer, larger ones), `AWAIT_S` at most."""
    import zmq

    from weightfabric.fabric import relay as relay_module
    from weightfabric.fabric.hub_messages import BatchReply, BatchRequest
    from weightfabric.fabric.protocol import REPLY, REQUEST, decode, decode_body, encode
    from weightfabric.fabric.zmq_util import hub_socket, make_socket

    monkeypatch.setattr(relay_module, "AWAIT_S", 0.6)
    hub = make_socket(zmq.ROUTER, max_message_size=1 << 24)     # a hub played by the test
    socks: list[zmq.Socket] = []
    try:
        port = hub.bind_to_random_port("tcp://127.0.0.1")
        with NodeRelay(f"tcp://127.0.0.1:{port}", insecure=True, window_s=0.001) as relay:
            socks += [hub_socket(relay.url, max_message_size=1 << 24, hub_key=None)
                      for _ in range(3)]

            def ask(k: int, rid: int) -> None:
                socks[k].send(encode(REQUEST, rid, f"s{k}", "ping", {"worker": f"w{k}"}))

            def batch(wait_ms: int) -> tuple[bytes, int, list[bytes]]:
                assert hub.poll(wait_ms), "no batch came"
                ident, data = hub.recv_multipart()
                msg = decode(data)
                assert msg.name == "batch"
                return ident, msg.req_id, [p for p, _ in decode_body(msg, BatchRequest).items]

            def answer(ident: bytes, rid: int, items: list[bytes]) -> None:
                replies = [(encode(REPLY, decode(p).req_id, "e", "", {}), b"") for p in items]
                hub.send_multipart([ident, encode(REPLY, rid, "e", "", BatchReply(items=replies))])

            ask(0, 1)
            first = batch(5000)
            assert len(first[2]) == 1
            ask(1, 1)
            ask(2, 1)
            assert not hub.poll(300)           # held: the first is on its way
            answer(*first)
            second = batch(2000)                 # sent once the first is answered
            assert sorted(decode(p).tag for p in second[2]) == ["s1", "s2"]
            answer(*second)
            for k in range(3):
                assert socks[k].poll(2000) and decode(socks[k].recv_multipart()[0]).req_id == 1
            ask(0, 2)
            batch(2000)                          # left unanswered: the next waits AWAIT_S
            ask(1, 2)
            assert not hub.poll(300)
            assert len(batch(3000)[2]) == 1 and relay.stats.batches == 4
    finally:
        for s in socks:
            s.close(0)
        hub.close(0)
