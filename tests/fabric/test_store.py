"""ModelStore in one process.

Switching versions, in-place publish, bad input, and buffers populated ahead of writes.
"""

import contextlib
import errno
import os
import socket
import threading
import time

import pytest
import torch
from hub_helpers import reader_address
from shm_pages import is_resident, populate_threads
from test_arena import slow_populate
from timeouts import hard_timeout
from torch import nn

import weightfabric as wf
from weightfabric.fabric import arena
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.errors import (
    ArenaError,
    BadRequestError,
    FabricError,
    FetchError,
    HubUnavailableError,
    ManifestMismatchError,
    NoSourceError,
    RetentionError,
    UnknownModelError,
    UnknownVersionError,
)
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.transports import SourceAddress, TcpTransport, client, local_host_id
from weightfabric.fabric.transports.wire import Op

CHUNK = 64 * 1024


def net(width: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 300), nn.LayerNorm(300), nn.Linear(300, 7))


@pytest.fixture
def hub():
    server = wf.serve("tcp://127.0.0.1:0", lease_s=5.0)
    workers = []

    def join(name, location=None, **kwargs):
        workers.append(wf.join(server.url, worker=name, timeout=5, location=location,
                                   **kwargs))
        return workers[-1]

    yield join
    for w in workers:
        w.close()
    server.stop()


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_fetch_async_keeps_the_old_version_until_result(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    source, model = net(seed=1), net(seed=2)
    t_store = trainer.model("m", chunk_size=CHUNK)
    v1 = t_store.publish(source)
    r_store = rollout.model("m", chunk_size=CHUNK)
    r_store.attach(model)
    assert r_store.fetch(v1).version == v1 and same(model, source) and r_store.version == v1
    old = net(seed=1)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(2)
    v2 = t_store.publish(source)
    future = r_store.fetch_async("latest")
    while not future.done():
        time.sleep(0.01)
    assert same(model, old) and r_store.version == v1  # not switched yet
    assert future.result().version == v2
    assert same(model, source) and r_store.version == v2
    assert r_store.fetch("latest").bytes == 0  # already there: nothing moves


def wait_done(future, timeout: float = 30.0) -> None:
    """Until the background fetch has its bytes in (without switching to them)."""
    end = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < end, f"fetch not done after {timeout:g} s"
        time.sleep(0.01)


def test_a_fetched_buffer_stays_reserved_until_result_or_a_newer_version(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK)
    sources = {k: net(seed=k) for k in (1, 2, 3, 4)}
    r_store = rollout.model("m", chunk_size=CHUNK)
    model = net(seed=9)
    r_store.attach(model)
    r_store.fetch(t_store.publish(sources[1]))
    v2 = t_store.publish(sources[2])
    f2 = r_store.fetch_async(v2)
    wait_done(f2)
    v3 = t_store.publish(sources[3])
    f3 = r_store.fetch_async(v3)  # must not reuse v2's buffer, which f2 has not switched to
    wait_done(f3)
    with pytest.raises(FabricError, match="result\\(\\) was not called"):
        r_store.release(v2)
    assert f2.result().version == v2 and r_store.version == v2 and same(model, sources[2])
    v4 = t_store.publish(sources[4])
    assert r_store.fetch(v4).version == v4 and same(model, sources[4])
    with pytest.raises(FabricError, match="no longer reserved"):  # superseded: no switch back to v3
        f3.result()
    assert r_store.version == v4 and same(model, sources[4])


def test_a_fetch_during_release_does_not_take_the_buffer_being_freed(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK)
    r_store = rollout.model("m", chunk_size=CHUNK)
    model = net(seed=9)
    r_store.attach(model)
    v1 = t_store.publish(net(seed=1))
    r_store.fetch(v1)
    r_store.fetch(t_store.publish(net(seed=2)))
    source = net(seed=3)
    v3 = t_store.publish(source)
    released = next(b for b in r_store.pool.buffers if b.version == v1)
    hub_retract, during = rollout.hub.retract, []

    def retract(model_name, version, **kw):  # release has dropped the lock for this call
        state = hub_retract(model_name, version, **kw)
        if version == v1 and not during:
            during.append(r_store.fetch_async(v3))
            wait_done(during[0])
        return state

    rollout.hub.retract = retract
    try:
        r_store.release(v1)
    finally:
        rollout.hub.retract = hub_retract
    assert during[0].result().version == v3 and same(model, source)
    assert r_store.pool.active is not released and not r_store.pool.active.region.closed
    assert released not in r_store.pool.buffers and released.region.closed


def test_fetching_a_version_the_store_still_holds_switches_back_to_it(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK)
    r_store = rollout.model("m", chunk_size=CHUNK)
    model, baseline = net(seed=9), net(seed=1)
    r_store.attach(model)
    v1 = t_store.publish(baseline)
    rollout.hub.pin("m", v1)  # a baseline to roll back to: retention keeps a replica
    r_store.fetch(v1)
    r_store.fetch(t_store.publish(net(seed=2)))
    t_store.publish(net(seed=3))  # the trainer reuses v1's buffer: ours is its last copy
    buffers = r_store.pool.buffers
    stats = r_store.fetch(v1)
    assert stats.version == v1 and stats.bytes == 0  # nothing read again
    assert r_store.version == v1 and same(model, baseline) and r_store.pool.buffers == buffers


def read_in_flight(worker, name: str, peer_timeout: float) -> threading.Thread:
    """A peer's read on `worker`'s server, waiting for a chunk that never comes.

    A peer's read of `name` on `worker`'s server, waiting there (at most `peer_timeout` s)
    for a chunk that never comes; returns once it is in flight.
    """
    peer = TcpTransport()

    def read() -> None:
        with contextlib.suppress(FabricError):
            peer.read(reader_address(worker, name), name, 0, torch.empty(CHUNK, dtype=torch.uint8),
                      timeout=peer_timeout, prefix=True)
        peer.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while getattr(worker.server._regions.get(name), "inflight", 0) == 0:
        assert time.monotonic() < end, "the peer's read never reached the server"
        time.sleep(0.01)
    return thread


@pytest.mark.parametrize("read_timeout", [30.0, 0.5])
def test_a_store_in_other_chunks_than_the_publisher_reexposes_with_peers_waiting_on_it(
        hub, read_timeout):
    # Its early exposure (in its own chunks) must be withdrawn before it exposes in the
    # publisher's: a peer waiting there for a chunk is answered at once (NOT_FOUND) by
    # the retract, so neither the peer's 11 s wait nor a short read_timeout matter.
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK)
    source = net(seed=1)
    v1 = t_store.publish(source)
    r_store = rollout.model("m", chunk_size=2 * CHUNK)  # exposes early in its own chunks
    model = net(seed=9)
    r_store.attach(model)
    begin_fetch, peers = rollout.hub.begin_fetch, []

    def begin_fetch_with_a_waiting_peer(*args, **kw):  # the hub lists us: a peer waits on us
        plan = begin_fetch(*args, **kw)
        peers.append(read_in_flight(rollout, region_name("m", plan.version), peer_timeout=11))
        return plan

    rollout.hub.begin_fetch = begin_fetch_with_a_waiting_peer
    try:
        start = time.monotonic()
        assert r_store.fetch(v1, options=FetchOptions(read_timeout=read_timeout)).version == v1
        assert time.monotonic() - start < 5
        assert same(model, source)
    finally:
        rollout.hub.begin_fetch = begin_fetch
        peers[0].join(15)
    v2 = t_store.publish(net(seed=2))  # later fetches expose early in the publisher's chunks
    assert r_store._early_chunk_size == CHUNK and r_store.fetch(v2).version == v2


def publish_in_place(worker) -> tuple[nn.Module, wf.ModelStore, int]:
    """A model attached to `worker`'s store of "m" and published in place."""
    model = net(seed=3)
    store = worker.model("m", chunk_size=CHUNK)
    store.attach(model)
    return model, store, store.publish(snapshot=False)


def test_in_place_publish_and_hold(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    model, t_store, version = publish_in_place(trainer)
    with pytest.raises(FabricError, match="still exposed"):
        t_store.publish(snapshot=False)
    replica = net(seed=4)
    r_store = rollout.model("m", chunk_size=CHUNK)
    r_store.attach(replica)
    r_store.fetch(version)
    assert t_store.retract(version, delay=True, wait=10) == "done"
    assert same(replica, model)
    with torch.no_grad():  # safe now: nobody may read these bytes any more
        model[0].weight.add_(1)
    v2 = t_store.publish(snapshot=False, hold=False)
    assert v2 == version + 1


def test_retract_is_not_done_while_a_read_the_hub_does_not_track_is_in_flight(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    _, t_store, version = publish_in_place(trainer)
    rollout.model("m", chunk_size=CHUNK).fetch(version)  # a second replica: the hub allows it
    source = reader_address(trainer, region_name("m", version))
    with socket.create_connection((source.host, source.port), timeout=10) as conn:
        # a resharding reader's lease: the hub knows nothing of it
        client.lease(conn, source, region_name("m", version), offset=0, nbytes=CHUNK, timeout=10)
        assert t_store.retract(version, wait=0.3) == "retracting"
        with pytest.raises(FabricError, match="still exposed"):
            t_store.publish(snapshot=False)  # the optimizer may not write yet
        client.request(conn, source, Op.END, region_name("m", version), timeout=10)
    assert t_store.retract(version, wait=10) == "done"
    assert t_store.publish(snapshot=False, hold=False) == version + 1


def test_mismatched_tensors_are_refused_naming_the_tensor(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    trainer.model("m", chunk_size=CHUNK).publish(net(width=64))
    store = rollout.model("m", chunk_size=CHUNK)
    store.attach(net(width=65))
    with pytest.raises(ManifestMismatchError, match=r"'0\.weight'.*float32\[300, 64\] there"):
        store.fetch("latest")
    assert store.version is None  # nothing half-switched


def test_unknown_model_and_version(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    trainer.model("m", chunk_size=CHUNK).publish(net())
    with pytest.raises(UnknownModelError):
        rollout.model("other", chunk_size=CHUNK).fetch("latest")
    with pytest.raises(UnknownVersionError):
        rollout.model("m", chunk_size=CHUNK).fetch(42)


def test_unreachable_hub_fails_fast():
    start = time.monotonic()
    with pytest.raises(HubUnavailableError, match="fabric hub serve"):
        wf.join("tcp://127.0.0.1:9", worker="w", timeout=1.0)
    assert time.monotonic() - start < 10


def test_misuse_is_refused_with_a_reason(hub):
    worker = hub("w")
    store = worker.model("m", chunk_size=CHUNK)
    with pytest.raises(FabricError, match="attach them first"):
        store.publish(snapshot=False)
    model = net()
    store.attach(model)
    with pytest.raises(FabricError, match="already attached"):
        store.attach(model)
    version = store.publish()
    with pytest.raises(RetentionError, match="min_replicas"):  # the only copy of v1
        store.release(version)
    reader = hub("reader").model("m", chunk_size=CHUNK)
    reader.fetch(version)
    with pytest.raises(FabricError, match="active version"):
        reader.release(version)
    store.release(version)  # now another replica exists
    with pytest.raises(ValueError, match="multiple of 256"):
        worker.model("n", chunk_size=1000)
    with pytest.raises(TypeError, match="nn.Module or a mapping"):
        store.attach([1, 2])


BAD_VERSIONS = [None, 0, -1, "1", 1.0, True, "", "Latest"]


@pytest.mark.parametrize("holding", [False, True], ids=["fresh", "holding-v1"])
def test_a_fetch_of_anything_but_a_positive_int_or_latest_changes_nothing(hub, holding):
    """Only ``int > 0`` or ``"latest"``.

    Anything else is a `BadRequestError` from `fetch` and `fetch_async` themselves, before
    the store changes (``fetch(None)`` used to switch a store holding v1 to its empty spare,
    leaving ``version`` None).
    """
    trainer, rollout = hub("trainer"), hub("rollout")
    source = net(seed=1)
    v1 = trainer.model("m", chunk_size=CHUNK).publish(source)
    store = rollout.model("m", chunk_size=CHUNK)
    model = net(seed=2)
    if holding:
        store.attach(model)
        store.fetch(v1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    buffers = [(b, b.version) for b in store.pool.buffers]
    for bad in BAD_VERSIONS:
        with pytest.raises(BadRequestError, match="a version is an int > 0 or 'latest'"):
            store.fetch(bad)
        with pytest.raises(BadRequestError, match="a version is an int > 0 or 'latest'"):
            store.fetch_async(bad)
        assert store.version == (v1 if holding else None), f"fetch({bad!r}) switched"
        assert [(b, b.version) for b in store.pool.buffers] == buffers
        assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    if holding:
        assert same(model, source)
    assert store.fetch("latest").version == v1  # the store still works


def test_a_closed_store_refuses_fetches_and_switches_to_nothing(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    v1 = trainer.model("m", chunk_size=CHUNK).publish(net(seed=1))
    store = rollout.model("m", chunk_size=CHUNK)
    store.attach(net(seed=2))
    done = store.fetch_async(v1)
    queued = store.fetch_async(v1)  # behind `done` on the store's one fetch thread
    store.close()  # lets `done` finish, cancels `queued` if it had not started
    for future in (done, queued):
        with pytest.raises(FabricError, match="the store is closed"):
            future.result(timeout=30)
    assert store.pool.active is None and store.version is None
    with pytest.raises(FabricError, match="the store is closed"):
        store.fetch(v1)
    with pytest.raises(FabricError, match="the store is closed"):
        store.fetch_async(v1)
    reopened = rollout.model("m", chunk_size=CHUNK)
    assert reopened is not store and reopened.fetch(v1).version == v1


def test_closing_a_store_tells_the_hub_its_replicas_are_gone(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    publisher = trainer.model("m", chunk_size=CHUNK)
    v1 = publisher.publish(net(seed=1))
    mirror = rollout.model("m", chunk_size=CHUNK)
    mirror.fetch(v1)
    publisher.close()  # the trainer's worker stays (it may serve other models)
    assert rollout.hub.locate("m", v1)["shards"][0]["holders"] == ["rollout"]
    mirror.close()
    assert rollout.hub.latest("m") is None  # no version is served by anyone now
    with pytest.raises(NoSourceError, match="no live replica"):
        hub("late").model("m", chunk_size=CHUNK).fetch(v1)


def test_a_fetch_whose_only_holder_is_unreachable_fails_with_fetch_error(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    v1 = trainer.model("m", chunk_size=CHUNK).publish(net(seed=1))
    trainer.server.close()  # its data plane is down; its hub lease lives on
    store = rollout.model("m", chunk_size=CHUNK)
    with pytest.raises(FetchError, match=r"no source left .*trainer: SourceLostError"):
        store.fetch(v1, options=FetchOptions(deadline=20, read_timeout=2))


# --- fetches that wait on a partial replica ------------------------------------------------

NEAR, FAR = {"datacenter": "a", "node": "n1"}, {"datacenter": "b", "node": "o"}


def begin_stalled_fetch(worker, version: int) -> None:
    """`worker` exposes a partial replica of `version` that never gets a chunk.

    `worker` (alive) begins fetching `version` of "m" and exposes its partial replica, which
    never gets a chunk; the hub tells later readers near it to wait on it.
    """
    manifest = worker.hub.begin_fetch("m", version).manifest
    memory = arena.Region.create("stalled", manifest.total_bytes)  # readers here map it
    _STALLED.append(memory)
    worker.server.expose(region_name("m", version), memory.tensor,
                         chunk_size=manifest.chunk_size, shm_path=str(memory.path),
                         progress=ChunkProgress(manifest.num_chunks))


_STALLED: list[arena.Region] = []  # the stalled replicas' memory, freed at exit


def origin_and_reader(hub) -> tuple[nn.Module, int, wf.ModelStore]:
    """A version published far from the reader, and the reader's store of it."""
    source = net(seed=1)
    version = hub("origin", FAR).model("m", chunk_size=CHUNK).publish(source)
    return source, version, hub("reader", NEAR).model("m", chunk_size=CHUNK)


def test_a_fetch_falls_back_to_the_origin_when_the_partial_replica_it_waits_on_stalls(hub):
    source, version, store = origin_and_reader(hub)
    begin_stalled_fetch(hub("partial", NEAR), version)
    model = net(seed=9)
    store.attach(model)
    with hard_timeout(30):
        stats = store.fetch(version, options=FetchOptions(read_timeout=0.5, deadline=5))
    assert stats.failed_sources == ["partial"] and list(stats.sources) == ["origin"]
    assert same(model, source)


def test_a_partial_replica_that_stalls_is_left_after_its_stall_timeout_not_the_read_timeout(
        hub, caplog):
    source, version, store = origin_and_reader(hub)
    begin_stalled_fetch(hub("partial", NEAR, stall_timeout=0.5), version)
    model = net(seed=9)
    store.attach(model)
    with hard_timeout(30):
        start = time.monotonic()
        stats = store.fetch(version, options=FetchOptions(read_timeout=20, deadline=25))
    assert time.monotonic() - start < 5
    assert stats.failed_sources == ["partial"] and list(stats.sources) == ["origin"]
    assert "stalled" in caplog.text
    assert same(model, source)


def test_a_fetch_asks_a_frozen_holder_on_its_host_only_within_its_read_timeout(hub):
    """A partial replica on this host whose read server accepts but never answers.

    The reader's question (is the region in GPU memory?) gives up after the fetch's read
    timeout, not the hub call timeout, and the fetch reads from the origin.
    """
    _, version, store = origin_and_reader(hub)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    address = SourceAddress("127.0.0.1", silent.getsockname()[1], local_host_id())
    frozen = HubClient(store.hub.url, worker="frozen", location=NEAR,
                       endpoints={"read": address.to_dict()}).open()
    try:
        frozen.begin_fetch("m", version)
        with hard_timeout(30):
            start = time.monotonic()
            stats = store.fetch(version, options=FetchOptions(read_timeout=0.3, deadline=10))
        assert time.monotonic() - start < 4  # the hub call timeout alone is 5 s
        assert stats.failed_sources == ["frozen"] and list(stats.sources) == ["origin"]
    finally:
        frozen.close()
        silent.close()


def test_closing_a_store_cancels_its_running_fetch(hub):
    _, version, store = origin_and_reader(hub)
    begin_stalled_fetch(hub("partial", NEAR), version)
    with hard_timeout(30):
        future = store.fetch_async(version, options=FetchOptions(read_timeout=5, deadline=8))
        time.sleep(0.3)
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 1.5
        with pytest.raises(FetchError, match="the store is closed"):
            future.result(timeout=5)


def test_a_failed_fetch_leaves_a_peer_copying_from_it_and_the_version_is_fetched_again(hub):
    """A failed fetch raises after `FAILED_DRAIN_S` while a peer still copies.

    A peer still copies a chunk of the reader's partial replica (a lease it keeps) when the
    fetch fails: the fetch raises after `FAILED_DRAIN_S`, not when the peer is done, and
    fetching the version again exposes it anew while the peer finishes.
    """
    source, version, store = origin_and_reader(hub)
    model = net(seed=9)
    store.attach(model)
    address = reader_address(store, region_name("m", version))
    leases: list[socket.socket] = []  # a peer's connection, its lease never ended

    def a_peer_leases_chunk_0_then_the_fetch_fails(done: int, total: int) -> None:
        if not leases:
            leases.append(socket.create_connection((address.host, address.port)))
            client.lease(leases[0], address, region_name("m", version), offset=0,
                         nbytes=CHUNK, timeout=5)
            raise RuntimeError("injected failure")

    with hard_timeout(40):
        try:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="injected failure"):
                store.fetch(version, on_chunk=a_peer_leases_chunk_0_then_the_fetch_fails,
                            options=FetchOptions(max_inflight=1, read_bytes=CHUNK))
            assert time.monotonic() - start < 2  # FAILED_DRAIN_S, not the peer's lease
            assert store.fetch(version).version == version  # the lease is still held
            assert same(model, source)
        finally:
            for conn in leases:
                conn.close()


def test_a_failed_fetch_that_a_peer_planned_to_read_from_is_fetched_again(hub):
    """A peer's fetch names the reader among its sources when the reader's fetch fails.

    The hub keeps the abandoned partial replica (retracting) until that peer's fetch ends,
    and fetching the version again must not wait for that (found by
    tests/fabric/test_chaos.py: it raised InvalidStateError "already holds ...
    (retracting)").
    """
    source, version, store = origin_and_reader(hub)
    model = net(seed=9)
    store.attach(model)
    peer = hub("peer", NEAR)

    def a_peer_plans_then_the_fetch_fails(done: int, total: int) -> None:
        if done == 1:
            plan = peer.hub.begin_fetch("m", version)  # began later: it may read the reader
            assert "reader" in plan.workers
            raise RuntimeError("injected failure")

    with hard_timeout(40):
        with pytest.raises(RuntimeError, match="injected failure"):
            store.fetch(version, on_chunk=a_peer_plans_then_the_fetch_fails,
                        options=FetchOptions(max_inflight=1, read_bytes=CHUNK))
        assert store.fetch(version).version == version  # the peer's fetch is still open
        assert same(model, source)


def test_devices_are_checked_before_any_memory_is_taken(hub):
    worker = hub("w")
    with pytest.raises(ValueError, match="cpu or cuda, not meta"):
        worker.model("m", device="meta")
    assert worker.model("m", chunk_size=CHUNK).device == torch.device("cpu")
    if not torch.cuda.is_available():  # the GPU side is in test_gpu_store.py
        with pytest.raises(ValueError, match="needs a GPU: cuda: torch.cuda.is_available"):
            worker.model("g", device="cuda")


# --- buffers populated ahead of writes ---------------------------------------------------

def big(seed: int = 0, mb: int = 24) -> dict[str, torch.Tensor]:
    """About `mb` MB in a few tensors (several populate steps)."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(mb * (1 << 20) // 16, generator=g) for i in range(4)}


def paths(store) -> set:
    return {b.region.path for b in store.pool.buffers}


def spares(store) -> list:
    return [b for b in store.pool.buffers if b is not store.pool.active and b.version is None]


def test_attach_prepares_a_populated_spare_that_the_first_fetch_fills(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    v1 = trainer.model("m", chunk_size=CHUNK).publish(big(1))
    store = rollout.model("m", chunk_size=CHUNK)
    model = big(2)
    store.attach(model)
    [spare] = spares(store)
    assert spare.region.wait_populated(timeout=60)
    assert is_resident(spare.region.path, spare.region.nbytes)
    before = paths(store)
    store.fetch(v1)
    assert store.pool.active is spare and paths(store) == before  # no buffer allocated
    assert all(torch.equal(model[n], t) for n, t in big(1).items())


def test_first_fetch_prepares_the_buffer_of_the_second(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    source = big(3)
    t_store = trainer.model("m", chunk_size=CHUNK)
    store = rollout.model("m", chunk_size=CHUNK)
    store.fetch(t_store.publish(source))
    [spare] = spares(store)  # nobody attached: it came with the first version
    assert spare.region.wait_populated(timeout=60)
    before = paths(store)
    for _ in range(2):
        for t in source.values():
            t.add_(1)
        store.fetch(t_store.publish(source))
        assert paths(store) == before  # v2 fills the spare, v3 the buffer of v1
        assert all(torch.equal(store.tensors[n], t) for n, t in source.items())
    assert len(t_store.pool.buffers) == 2  # the trainer's snapshots alternate in two as well


def test_without_prepare_spare_buffers_come_only_with_versions(hub):
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK, prepare_spare=False)
    v1 = t_store.publish(big(1, mb=4))
    store = rollout.model("m", chunk_size=CHUNK, prepare_spare=False)
    store.fetch(v1)
    assert len(store.pool.buffers) == len(t_store.pool.buffers) == 1
    attached = rollout.model("n", chunk_size=CHUNK, prepare_spare=False)
    attached.attach(big(2, mb=4))
    assert len(attached.pool.buffers) == 1


def test_an_in_place_publisher_frees_its_spare(hub):
    store = hub("trainer").model("m", chunk_size=CHUNK)
    model = net(seed=5)
    store.attach(model)
    [spare] = spares(store)
    store.publish(snapshot=False)
    assert len(store.pool.buffers) == 1 and not spare.region.path.exists()
    assert not store.prepare_spare


def test_fetch_overtaking_a_background_populate_is_exact(hub, monkeypatch):
    trainer, rollout = hub("trainer"), hub("rollout")
    source = big(4)
    v1 = trainer.model("m", chunk_size=CHUNK).publish(source)
    slow_populate(monkeypatch, 0.2)  # 0.2 s per 4 MiB step: the fetch overtakes it
    store = rollout.model("m", chunk_size=CHUNK)
    store.fetch(v1)
    files = paths(store)
    region = store.pool.active.region
    assert region.populated_bytes < region.nbytes  # the background is still at it...
    assert is_resident(region.path, region.nbytes)  # ...the fetch populated the rest
    assert all(torch.equal(store.tensors[n], t) for n, t in source.items())
    store.close()
    assert not populate_threads(files) and not any(p.exists() for p in files)


def test_back_to_back_snapshots_reuse_the_populated_buffer_while_the_spare_populates(
        hub, monkeypatch):
    """The README's trainer publishing its second version before its spare is there.

    With a reader holding v1, v2 goes into v1's (populated) buffer, not the spare still
    faulting in; with nobody else holding v1, the trainer keeps it and fills the spare.
    """
    slow_populate(monkeypatch, 0.2)  # spares stay cold through the test
    trainer, rollout = hub("trainer"), hub("rollout")
    alone = trainer.model("m", chunk_size=CHUNK)
    v1 = alone.publish(big(1))
    first, [spare] = alone.pool.active, spares(alone)
    alone.publish(big(2))  # nobody else holds v1: it stays, and v2 fills the spare in line
    assert alone.pool.active is spare and first.version == v1

    store = trainer.model("n", chunk_size=CHUNK)
    v1 = store.publish(big(1))
    first, [spare] = store.pool.active, spares(store)
    reader = rollout.model("n", chunk_size=CHUNK)
    reader.fetch(v1)
    v2 = store.publish(big(2))  # the reader holds v1: v2 takes its populated buffer
    assert store.pool.active is first and first.version == v2 and spare.version is None
    assert spare.region.populated_bytes < spare.region.nbytes
    reader.fetch(v2)
    assert all(torch.equal(reader.tensors[n], t) for n, t in big(2).items())


def test_close_while_spares_populate_leaves_no_thread_or_file(hub, monkeypatch):
    slow_populate(monkeypatch, 0.05)
    store = hub("rollout").model("m", chunk_size=CHUNK)
    store.attach(big(5))
    [spare] = spares(store)
    files = paths(store)
    assert populate_threads(files) and spare.region.populated_bytes < spare.region.nbytes
    store.close()
    assert not populate_threads(files)
    assert not any(p.exists() for p in files)


def test_no_room_for_a_buffer_fails_the_fetch_with_arena_error(hub, monkeypatch):
    trainer, rollout = hub("trainer"), hub("rollout")
    v1 = trainer.model("m", chunk_size=CHUNK).publish(big(6, mb=4))
    store = rollout.model("m", chunk_size=CHUNK)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(arena, "_madvise", lambda *args: errno.EFAULT)
    with pytest.raises(ArenaError, match="shared memory"):
        store.fetch(v1)
    assert store.version is None
    monkeypatch.undo()
    assert store.fetch(v1).version == v1  # room again: the broken buffer was dropped
    assert len(store.pool.buffers) == 2


def test_an_in_place_fetch_keeps_one_buffer_and_the_attached_tensors(hub):
    """The version lands in the active buffer: no spare, the module's tensors are its views.

    Its held version is retracted first (the trainer still serves it), and a second reader
    fetching in place reads the new version from the first (a peer) while it can.
    """
    trainer, first, second = hub("trainer"), hub("first"), hub("second")
    source = net(seed=1)
    t_store = trainer.model("m", chunk_size=CHUNK)
    v1 = t_store.publish(source)
    models, stores = [], []
    for w in (first, second):
        model = net(seed=2)
        store = w.model("m", chunk_size=CHUNK)
        store.attach(model)
        store.fetch(v1)
        models.append(model)
        stores.append(store)
    buffer = stores[0].pool.active
    pointer = models[0][0].weight.data_ptr()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1)
    v2 = t_store.publish(source)
    assert stores[0].fetch(v2, in_place=True).version == v2
    assert stores[0].pool.active is buffer and len(stores[0].pool) == 1
    assert models[0][0].weight.data_ptr() == pointer and same(models[0], source)
    assert stores[0].prepare_spare is False
    assert stores[1].fetch("latest", in_place=True, verify=True).version == v2
    assert same(models[1], source) and len(stores[1].pool) == 1
    assert stores[0].fetch(v2, in_place=True).bytes == 0   # held: nothing moves


def test_an_in_place_fetch_that_cannot_start_changes_nothing_and_one_that_fails_no_version(
        hub, monkeypatch):
    from weightfabric.fabric import store_fetch

    trainer, other, reader = hub("trainer"), hub("other"), hub("reader")
    t_store = trainer.model("m", chunk_size=CHUNK)
    v1 = t_store.publish(net(seed=1))
    model = net(seed=2)
    r_store = reader.model("m", chunk_size=CHUNK)
    r_store.attach(model)
    r_store.fetch(v1)
    other.model("m", chunk_size=CHUNK).fetch(v1)  # v1 lives on elsewhere
    v2 = t_store.publish(net(seed=3))
    trainer.close()  # v2's only source is gone
    with pytest.raises(NoSourceError):
        r_store.fetch(v2, in_place=True, options=FetchOptions(deadline=3, read_timeout=1))
    assert r_store.version == v1 and same(model, net(seed=1))

    def scribble_and_fail(dest, **kwargs):
        dest.fill_(7)
        raise FetchError("the source died mid-read")

    t_store = hub("trainer-2").model("m", chunk_size=CHUNK)
    v3 = t_store.publish(net(seed=4))
    monkeypatch.setattr(store_fetch, "fetch_chunks", scribble_and_fail)
    with pytest.raises(FetchError, match="mid-read"):
        r_store.fetch(v3, in_place=True)
    assert r_store.version is None  # the tensors hold a mix: nothing to claim
    monkeypatch.undo()
    assert r_store.fetch(v3, in_place=True).version == v3 and same(model, net(seed=4))


def test_a_holder_that_served_corrupt_chunks_is_quarantined_until_it_fetches_again(hub):
    """A reader re-reads corrupt chunks elsewhere and reports their holder.

    The hub stops listing that replica; the holder, told in its heartbeat, stops serving
    the version and fetches it again.
    """
    trainer, bad, reader = hub("trainer"), hub("bad"), hub("reader")
    source = net(width=256, seed=1)  # several chunks: the reader stripes over both holders
    t_store = trainer.model("m", chunk_size=CHUNK)
    version = t_store.publish(source)
    b_store = bad.model("m", chunk_size=CHUNK)
    b_store.attach(net(width=256, seed=2))
    b_store.fetch(version)
    b_store.pool.active.region.tensor[:b_store.layout.nbytes].add_(1)  # its memory went bad
    model = net(width=256, seed=3)
    r_store = reader.model("m", chunk_size=CHUNK)
    r_store.attach(model)
    stats = r_store.fetch(version)  # default settings: same-host reads are verified too
    assert same(model, source) and stats.corrupted_chunks >= 1
    holders = set(trainer.hub.locate_reply("m", version).shards[0].holders)
    assert "bad" not in holders and {"trainer", "reader"} <= holders
    bad.hub.heartbeat()  # the news: stop serving it
    assert b_store.version is None and not any(b.exposed for b in b_store.pool.buffers)
    assert ("m", version, 0) in bad.hub.quarantined
    assert b_store.fetch(version).version == version  # and it is a holder again
    assert "bad" in trainer.hub.locate_reply("m", version).shards[0].holders


def test_corruption_reports_are_checked(hub):
    trainer, reader = hub("trainer"), hub("reader")
    version = trainer.model("m", chunk_size=CHUNK).publish(net(seed=1))
    with pytest.raises(BadRequestError, match="its own replica"):
        trainer.hub.report_corrupt("m", version, "trainer", [0])
    with pytest.raises(UnknownVersionError):
        reader.hub.report_corrupt("m", version + 5, "trainer", [0])
    assert reader.hub.report_corrupt("m", version, "nobody", [0]) is False
    assert reader.hub.report_corrupt("m", version, "trainer", [0]) is False  # the last replica
    assert trainer.hub.latest("m") == version  # nothing changed


def test_sync_follows_the_newest_version_when_the_one_it_waited_for_was_retired(hub, monkeypatch):
    """A version retired between a rollout's wait and its fetch is followed by the newest.

    A fast trainer commits v2 and v3 between the wait and the fetch of v1 (retention
    drops v1): sync fetches v3, it does not fail.
    """
    trainer, rollout = hub("trainer"), hub("rollout")
    t_store = trainer.model("m", chunk_size=CHUNK)
    source = net(seed=1)
    t_store.publish(source)
    r_store = rollout.model("m", chunk_size=CHUNK)
    model = net(seed=2)
    r_store.attach(model)
    wait = rollout.hub.wait_version

    def racing_wait(*args, **kwargs):
        v = wait(*args, **kwargs)
        if v == 1:  # the trainer overtakes this rollout now
            with torch.no_grad():
                for _ in range(2):
                    for p in source.parameters():
                        p.add_(1)
                    t_store.publish(source)
        return v

    monkeypatch.setattr(rollout.hub, "wait_version", racing_wait)
    stats = r_store.sync(timeout=10)
    assert stats.version == 3 and same(model, source)
