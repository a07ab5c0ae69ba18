"""The rollout loop's guard rails.

`sync` fetches each new version once, a trainer's ending call keeps its last version alive,
a publish that fails after the hub assigned a number aborts it, and bad versions, names and
tensor sets are typed errors.
"""

from __future__ import annotations

import time

import pytest
import torch
from procs import running_cluster
from torch import nn

import weightfabric as wf
from weightfabric.fabric.errors import (
    BadRequestError,
    FabricError,
    ReplicationTimeoutError,
    TensorSetError,
    WaitTimeoutError,
)
from weightfabric.fabric.relayout.reader import ReshardReader, fetch_resharded

CHUNK = 64 * 1024
LEASE_S = 1.0


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 100), nn.Linear(100, 4))


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


@pytest.fixture
def cluster():
    """(hub server, join) with short leases; everything closed after."""
    server = wf.serve("tcp://127.0.0.1:0", lease_s=LEASE_S)
    workers: list[wf.Worker] = []

    def join(name: str) -> wf.Worker:
        workers.append(wf.join(server.url, worker=name, timeout=5))
        return workers[-1]

    yield server, join
    for w in workers:
        w.close()
    server.stop()


def test_sync_fetches_each_new_version_exactly_once(cluster):
    _, join = cluster
    t_store = join("trainer").model("m", chunk_size=CHUNK)
    rollout = join("rollout")
    store = rollout.model("m", chunk_size=CHUNK)
    model = net(0)
    store.attach(model)
    fetched: list[int] = []
    begin_fetch = rollout.hub.begin_fetch

    def counting(model_name, version, **kw):
        plan = begin_fetch(model_name, version, **kw)
        fetched.append(plan.version)
        return plan

    rollout.hub.begin_fetch = counting  # type: ignore[method-assign]
    with pytest.raises(WaitTimeoutError):
        store.sync(timeout=0.2)  # nothing published yet
    v1 = t_store.publish(net(1))
    assert store.sync(timeout=10).version == v1 and same(model, net(1))
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=f"newer than v{v1}"):
        store.sync(timeout=0.3)  # v1 is held: nothing newer
    assert time.monotonic() - start < 5 and store.version == v1 and same(model, net(1))
    v2 = t_store.publish(net(2))
    assert store.sync(timeout=10).version == v2 and same(model, net(2))
    assert fetched == [v1, v2]


def test_a_publish_the_read_server_refuses_is_aborted_at_the_hub(cluster, monkeypatch):
    """The hub assigned v1, then the read server refused the region.

    Version 1 retires at once (not when the still-live publisher's lease runs out), and the store
    publishes on.
    """
    server, join = cluster
    worker = join("trainer")
    store = worker.model("m", chunk_size=CHUNK)

    def refuse(name, *args, **kwargs):
        raise ValueError(f"region {name!r} is already exposed; retract it first")

    monkeypatch.setattr(worker.server, "expose", refuse)
    with pytest.raises(ValueError, match="already exposed"):
        store.publish(net(1))
    retired = server.state.models["m"].retired_log
    assert 1 in retired and "aborted" in retired[1] and "already exposed" in retired[1]
    assert worker.hub.latest("m") is None
    monkeypatch.undo()
    time.sleep(LEASE_S)  # heartbeats since do not claim v1 back
    assert server.state.models["m"].versions[1].state == "retired"
    v2 = store.publish(net(2))
    reader = join("reader").model("m", chunk_size=CHUNK)
    assert reader.fetch("latest").version == v2


@pytest.mark.parametrize("holding", [False, True], ids=["fresh", "holding-v1"])
def test_a_resharding_fetch_of_a_bad_version_is_refused_before_the_hub(cluster, holding):
    _, join = cluster
    worker = join("reader")
    if holding:
        join("trainer").model("m", chunk_size=CHUNK).publish(net(1))
    asked: list[str] = []
    call = worker.hub.call
    worker.hub.call = lambda op, *a, **kw: asked.append(op) or call(op, *a, **kw)  # type: ignore[method-assign]
    reader = ReshardReader(worker, "m", {}, rank=0)
    for bad in (None, 0, -1, "1", 1.0, True):
        with pytest.raises(BadRequestError, match="int > 0 or 'latest'"):
            reader.fetch({}, bad)  # type: ignore[arg-type]
        with pytest.raises(BadRequestError, match="int > 0 or 'latest'"):
            fetch_resharded(worker, "m", {}, {}, rank=0, version=bad)  # type: ignore[arg-type]
    assert asked == []


@pytest.mark.parametrize("bad, match", [
    ({}, "empty tensor set"),
    (nn.Sequential(), "empty tensor set"),
    ({"": torch.zeros(3)}, "non-empty strings"),
    ({7: torch.zeros(3)}, "non-empty strings"),
    ({"w": [1.0, 2.0]}, "'w' is a list"),
    ({"w": torch.zeros(3, device="meta")}, "meta device"),
    ([torch.zeros(3)], "nn.Module or a mapping"),
], ids=["empty", "empty-module", "empty-name", "int-name", "not-a-tensor", "meta", "a-list"])
def test_bad_tensor_sets_are_fabric_errors_and_change_nothing(cluster, bad, match):
    _, join = cluster
    worker = join("w")
    store = worker.model("m", chunk_size=CHUNK)
    for call in (store.publish, store.attach):
        with pytest.raises(TensorSetError, match=match) as raised:
            call(bad)
        assert isinstance(raised.value, FabricError)
    assert store.version is None and not store.pool.buffers and store.layout is None
    assert worker.hub.latest("m") is None


def test_wait_replicated_refuses_bad_arguments_and_times_out_with_the_holders(cluster):
    _, join = cluster
    store = join("trainer").model("m", chunk_size=CHUNK)
    with pytest.raises(BadRequestError, match="published nothing"):
        store.wait_replicated()
    version = store.publish(net(1))
    for bad in ({"version": 0}, {"version": "latest"}, {"replicas": 0}, {"replicas": True}):
        with pytest.raises(BadRequestError):
            store.wait_replicated(**bad)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(ReplicationTimeoutError, match="0 of 1 other replicas") as raised:
        store.wait_replicated(timeout=0.3)
    assert isinstance(raised.value, WaitTimeoutError) and time.monotonic() - start < 3
    reader = join("reader").model("m", chunk_size=CHUNK)
    reader.fetch(version)
    assert store.wait_replicated(version, replicas=1, timeout=10) == ["reader"]


def test_a_trainer_that_ends_with_wait_replicated_leaves_its_last_version_fetchable():
    """A reader that joins after the trainer exits still gets the version.

    The trainer publishes, asks to wait for one other replica, a rollout fetches, the
    trainer's wait returns and it exits: a reader that joins later still gets the version.
    """
    with running_cluster(lease_s=LEASE_S, limit=120) as (_, spawn):
        trainer, rollout = spawn("trainer", fork=True), spawn("rollout", fork=True)
        version = trainer.ask("publish", seed=3, mb=2)["version"]
        trainer.send("wait_replicated", version=version, replicas=1, timeout=60)
        with pytest.raises(AssertionError, match="did not answer"):
            trainer.next_reply(timeout=0.5)  # still waiting: nobody else holds it
        rollout.ask("expect", seed=3, mb=2)
        assert rollout.ask("fetch", version=version)["exact"]
        assert trainer.reply(timeout=30) == {"holders": ["rollout"]}
        assert trainer.close(timeout=30), "the trainer did not exit cleanly"
        time.sleep(2 * LEASE_S)  # the trainer's lease would have run out by now
        late = spawn("late", fork=True)
        late.ask("expect", seed=3, mb=2)
        got = late.ask("fetch", version="latest")
        assert got["version"] == version and got["exact"] and list(got["sources"]) == ["rollout"]
