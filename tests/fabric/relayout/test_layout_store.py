"""`LayoutStore`: readers in an engine layout derive a version once, then copy each other."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weightfabric.fabric.errors import LayoutMismatchError
from weightfabric.fabric.relayout.rules import (
    EngineLayout,
    Rule,
    Split,
    Term,
    derive_reference,
)

CHUNK = 4096
FP8 = torch.float8_e4m3fn


def _layout(tp: int = 2, fp8: bool = False) -> EngineLayout:
    block = 16 if fp8 else None
    return EngineLayout(f"test-tp{tp}{'-fp8' if fp8 else ''}", (
        Rule("qkv_proj.weight", ((Term("q_proj.weight"), Term("k_proj.weight"),
                                  Term("v_proj.weight")),),
             split=Split(0, tp, unit=16, replicate=True), dtype=torch.bfloat16,
             fp8_block=block),
        Rule("o_proj.weight", ((Term("o_proj.weight"),),), split=Split(1, tp),
             dtype=torch.bfloat16, fp8_block=block),
        Rule("embed.weight", ((Term("embed.weight"),),), split=Split(0, tp, pad_to=64),
             dtype=torch.bfloat16),
        Rule("norm.weight", ((Term("norm.weight"),),)),
    ), tp=tp)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj.weight": (64, 64), "k_proj.weight": (16, 64), "v_proj.weight": (16, 64),
              "o_proj.weight": (64, 64), "embed.weight": (100, 64), "norm.weight": (64,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _published(workers, seed):
    """A trainer worker that published `_weights` (seed); returns it, the weights, the version."""
    trainer = workers.join("trainer")
    weights = _weights(seed)
    return trainer, weights, trainer.model("policy", chunk_size=CHUNK).publish(weights)


def _check(store, layout, weights, rank):
    want = derive_reference(layout, weights, rank)
    got = store.tensors
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        assert torch.equal(_bits(got[name]), _bits(w)), name


@pytest.mark.parametrize("fp8", [False, True])
def test_first_reader_derives_and_the_next_copies_from_it(workers, fp8):
    _, weights, v = _published(workers, 1)
    layout = _layout(fp8=fp8)
    a = workers.join("a").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    first = a.fetch()
    assert (first.version, first.derived) == (v, True)
    assert set(first.sources) == {"trainer"}
    _check(a, layout, weights, 0)

    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    second = b.fetch(v)
    assert not second.derived
    assert set(second.sources) == {"a"}, second.sources
    _check(b, layout, weights, 0)

    c = workers.join("c").layout_model("policy", layout, rank=1, chunk_size=CHUNK)
    assert c.fetch(v).derived                 # another rank: its own derived replicas
    _check(c, layout, weights, 1)

    again = a.fetch(v)                        # held: nothing moves
    assert again.bytes == 0 and again.version == v


def test_next_version_double_buffers_and_switches_at_result(workers):
    trainer = workers.join("trainer")
    store = trainer.model("policy", chunk_size=CHUNK)
    layout = _layout()
    reader = workers.join("r").layout_model("policy", layout, rank=1, chunk_size=CHUNK)
    w1, w2 = _weights(1), _weights(2)
    store.publish(w1)
    reader.fetch()
    v2 = store.publish(w2)
    future = reader.fetch_async(v2)
    stats = future.result()
    assert stats.version == v2 == reader.version
    _check(reader, layout, w2, 1)


def test_a_layout_that_does_not_fit_fails_before_any_read(workers):
    trainer = workers.join("trainer")
    weights = _weights(1)
    weights["k_proj.weight"] = weights["k_proj.weight"][:8]      # not whole heads
    trainer.model("policy", chunk_size=CHUNK).publish(weights)
    reader = workers.join("r").layout_model("policy", _layout(), rank=0, chunk_size=CHUNK)
    with pytest.raises(LayoutMismatchError, match="k_proj.weight"):
        reader.fetch()
    assert reader.version is None


def test_a_reader_derives_again_when_the_derived_replicas_are_gone(workers):
    _, weights, v = _published(workers, 3)
    layout = _layout()
    first = workers.join("a")
    assert first.layout_model("policy", layout, rank=0, chunk_size=CHUNK).fetch(v).derived
    first.close()
    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    stats = b.fetch(v)
    assert stats.derived and set(stats.sources) == {"trainer"}
    _check(b, layout, weights, 0)


def test_a_trainer_publishes_straight_into_a_layout_and_readers_copy_it(workers):
    """The trainer derives its own version for a layout rank; readers never read its plain bytes."""
    trainer, weights, v = _published(workers, 4)
    layout = _layout()
    own = trainer.layout_model("policy", layout, rank=1, chunk_size=CHUNK)
    assert own.fetch(v).derived                       # derived in the trainer's process
    reader = workers.join("r").layout_model("policy", layout, rank=1, chunk_size=CHUNK)
    stats = reader.fetch(v)
    assert not stats.derived and set(stats.sources) == {"trainer"}
    _check(reader, layout, weights, 1)


def test_a_listed_holder_that_cannot_be_read_makes_the_reader_derive_privately(workers):
    """A's read server is gone while the hub still lists A: B derives and keeps it private."""
    _, weights, v = _published(workers, 5)
    layout = _layout()
    a_worker = workers.join("a")
    a = a_worker.layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    assert a.fetch(v).derived
    a_worker.server.close()                        # registered, heartbeating, unreadable
    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    stats = b.fetch(v)
    assert stats.derived and set(stats.sources) == {"trainer"}
    _check(b, layout, weights, 0)
    with workers.connect() as client:
        holders = client.locate(a.name, v)["shards"][0]["holders"]
    assert holders == ["a"]                        # B's private copy is not registered
    assert b.store.pool.active is not None and b.store.pool.active.exposed is None


def test_sync_follows_the_newest_version_when_the_one_it_waited_for_was_retired(workers,
                                                                               monkeypatch):
    """As `ModelStore.sync`: a fast trainer commits v2 and v3 between the wait and the fetch."""
    trainer = workers.join("trainer")
    store = trainer.model("policy", chunk_size=CHUNK)
    store.publish(_weights(1))
    layout = _layout()
    reader_worker = workers.join("r")
    reader = reader_worker.layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    wait = reader_worker.hub.wait_version

    def racing_wait(*args, **kwargs):
        v = wait(*args, **kwargs)
        if v == 1:
            store.publish(_weights(2))
            store.publish(_weights(3))
        return v

    monkeypatch.setattr(reader_worker.hub, "wait_version", racing_wait)
    assert reader.sync(timeout=10).version == 3
    _check(reader, layout, _weights(3), 0)


def _gate_first_target(monkeypatch, *, fail: bool = False):
    """Make the next derivation stop after its first target until ``gate`` is set.

    Returns (first_done, gate): events. With ``fail``, the derivation raises at the gate.
    """
    from weightfabric.fabric.relayout import replica

    real, first_done, gate = replica.derive, threading.Event(), threading.Event()

    def gated_derive(*args, done, **kwargs):
        def gated(names):
            done(names)
            if not first_done.is_set():
                first_done.set()
                assert gate.wait(20), "the test never opened the gate"
                if fail:
                    raise RuntimeError("deriver failed on purpose")
        return real(*args, done=gated, **kwargs)

    monkeypatch.setattr(replica, "derive", gated_derive)
    return first_done, gate


def _copied_chunks(client, worker: str) -> int:
    """Chunks the hub says ``worker``'s fetch in flight holds (0 when none is in flight)."""
    return sum(f["have"] for f in client.status()["fetches"] if f["worker"] == worker)


def test_a_copier_follows_the_deriver_chunk_by_chunk(workers, monkeypatch):
    """B copies what A derived so far while A is still deriving; it switches only at A's commit."""
    _, weights, v = _published(workers, 6)
    layout = _layout()
    first_done, gate = _gate_first_target(monkeypatch)
    a = workers.join("a").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    deriving = a.fetch_async(v)
    assert first_done.wait(10)
    copying = b.fetch_async(v)
    with workers.connect() as client:
        deadline = time.monotonic() + 10
        while _copied_chunks(client, "b") == 0:      # chunks of A's first target, copied
            assert time.monotonic() < deadline, "B copied nothing while A was deriving"
            time.sleep(0.02)
        state = next(x["state"] for x in client.status()["models"][a.name]["versions"]
                     if x["version"] == v)
    assert state == "publishing" and not copying.done()
    gate.set()
    assert deriving.result(timeout=20).derived
    stats = copying.result(timeout=20)
    assert not stats.derived and set(stats.sources) == {"a"}
    _check(b, layout, weights, 0)


def test_a_copier_derives_itself_when_the_deriver_fails_midway(workers, monkeypatch):
    _, weights, v = _published(workers, 7)
    layout = _layout()
    first_done, gate = _gate_first_target(monkeypatch, fail=True)
    a = workers.join("a").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    deriving = a.fetch_async(v)
    assert first_done.wait(10)
    copying = b.fetch_async(v)
    time.sleep(0.2)                                  # B is copying from A by now
    gate.set()
    with pytest.raises(RuntimeError, match="on purpose"):
        deriving.result(timeout=20)
    stats = copying.result(timeout=30)
    assert stats.derived and set(stats.sources) == {"trainer"}
    _check(b, layout, weights, 0)


def test_a_deriver_copies_each_batch_of_a_shard_under_one_lease(workers, monkeypatch):
    """No lease per block: the trainer counts as served exactly what the deriver copied."""
    from weightfabric.fabric.transports.shm import ShmTransport

    calls = {"read": 0, "mapped": 0}
    read, mapped = ShmTransport.read, ShmTransport.mapped

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(ShmTransport, "read", counted("read", read))
    monkeypatch.setattr(ShmTransport, "mapped", counted("mapped", mapped))
    trainer, weights, v = _published(workers, 8)
    served = trainer.bytes_served
    a = workers.join("a").layout_model("policy", _layout(), rank=1, chunk_size=CHUNK)
    stats = a.fetch(v)
    assert stats.derived and calls == {"read": 0, "mapped": 1}    # one batch, one shard
    assert trainer.bytes_served - served == stats.bytes == stats.sources["trainer"]
    _check(a, _layout(), weights, 1)


def test_a_lease_lost_while_copying_fails_the_derivation_and_the_next_fetch_derives(
        workers, monkeypatch):
    """Copies made under a lease the holder dropped may be torn: nothing of them is kept."""
    from contextlib import contextmanager

    from weightfabric.fabric.errors import FetchError, SourceLostError
    from weightfabric.fabric.transports.shm import ShmTransport

    real = ShmTransport.mapped

    @contextmanager
    def lost(self, *args, **kwargs):
        with real(self, *args, **kwargs) as src:
            yield src
        raise SourceLostError("END not acknowledged (test)")

    monkeypatch.setattr(ShmTransport, "mapped", lost)
    _, weights, v = _published(workers, 9)
    layout = _layout(fp8=True)
    a = workers.join("a").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    with pytest.raises(FetchError, match="lease on bytes .* was lost"):
        a.fetch(v)
    assert a.version is None
    monkeypatch.setattr(ShmTransport, "mapped", real)
    assert a.fetch(v).derived                      # the hub retired the failed derivation
    _check(a, layout, weights, 0)
