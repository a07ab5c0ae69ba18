"""Stores whose buffers are collective allocations (the NVSHMEM symmetric heap).

On CPU the collective is played by `RecordingRuntime`: it hands out host tensors
and records every allocation, free and progress reset, so these tests check the
store's side of the contract (allocate every buffer in ``attach``, never allocate
or free in between, free in ``close`` in allocation order, reset flags per
exposure), with a real hub and peers reading over TCP. The one-sided reads
themselves run only on a GPU (tests/fabric/gpu/test_gpu_nvshmem.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import weightfabric as wf
from weightfabric.fabric.errors import FabricError, ManifestMismatchError
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.store import ModelStore
from weightfabric.fabric.transports import (
    ShmTransport,
    SourceAddress,
    TcpTransport,
    choose_transport,
    local_host_id,
)

CHUNK = 32 * 1024


@dataclass
class HostRegion:
    name: str
    data: torch.Tensor
    chunk_size: int


class _Registry:
    closed = False


class RecordingRuntime:
    """Stands in for `NvshmemRuntime` on CPU: host memory, a log of collective calls."""

    def __init__(self, session: str, rank: int) -> None:
        self.session, self.rank = session, rank
        self.registry = _Registry()
        self.regions: dict[str, HostRegion] = {}
        self.log: list[str] = []

    def allocate_region(self, name: str, nbytes: int, chunk_size: int) -> HostRegion:
        self.log.append(f"alloc {name} {nbytes}")
        self.regions[name] = HostRegion(name, torch.zeros(nbytes, dtype=torch.uint8), chunk_size)
        return self.regions[name]

    def free_region(self, name: str) -> None:
        self.log.append(f"free {name}")
        del self.regions[name]

    def progress(self, region: HostRegion, *, complete: bool = False) -> ChunkProgress:
        self.log.append(f"flags {region.name} {int(complete)}")
        return ChunkProgress(-(-region.data.numel() // region.chunk_size), complete=complete)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 200), nn.Linear(200, 5))


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


class Opener:
    """Opens symmetric stores of one PE's worker (on CPU `Worker.model` refuses them)."""

    def __init__(self, worker: wf.Worker, runtime: RecordingRuntime, stores: list[ModelStore],
                 *, buffers: int, chunk_size: int) -> None:
        self.worker, self.runtime, self.stores = worker, runtime, stores
        self.buffers, self.chunk_size = buffers, chunk_size

    def __call__(self, model: str = "m", **kwargs) -> ModelStore:
        options = {"chunk_size": self.chunk_size, "buffers": self.buffers, **kwargs}
        self.stores.append(ModelStore(model, hub=self.worker.hub, server=self.worker.server,
                                      transports=self.worker.transports,
                                      nvshmem=self.runtime, **options))
        return self.stores[-1]


@pytest.fixture
def pes(workers):
    """(worker, runtime, store opener) per PE, on the shared ``hub``.

    Closes the stores, then (the ``workers`` fixture) the workers, then the hub.
    """
    made: list[tuple[wf.Worker, list[ModelStore]]] = []

    def pe(name: str, *, buffers: int = 2, chunk_size: int = CHUNK):
        worker = workers.join(name, timeout=5)
        runtime = RecordingRuntime("job-1", rank=len(made))
        stores: list[ModelStore] = []
        made.append((worker, stores))
        return Opener(worker, runtime, stores, buffers=buffers, chunk_size=chunk_size), runtime

    yield pe
    for _, stores in made:
        for store in stores:
            store.close()


def test_buffers_are_allocated_together_in_attach_and_freed_together_in_close(pes):
    open_t, rt_t = pes("trainer")
    open_r, rt_r = pes("rollout")
    t, r = open_t(), open_r()
    source, model = net(1), net(2)
    with pytest.raises(FabricError, match="attach the model on every PE first"):
        t.publish(source)
    with pytest.raises(FabricError, match="attach the model on every PE first"):
        r.fetch("latest")
    assert rt_t.log == rt_r.log == []  # nothing allocated outside attach

    t.attach(source)
    r.attach(model)
    nbytes = t.layout.nbytes
    assert rt_t.log == rt_r.log == [f"alloc m/0 {nbytes}", f"alloc m/1 {nbytes}"]

    for step in range(3):  # the trainer snapshots into its spare; the reader alternates
        with torch.no_grad():
            source[0].weight.add_(1.0)
        v = t.publish()
        stats = r.fetch(v)
        assert stats.version == v and same(model, source), step
        assert set(stats.transports) == {"tcp"}  # a peer outside the job: no one-sided reads
    t.release(v)  # the reader holds v too; the buffer stays: frees are collective
    assert [e for e in rt_t.log + rt_r.log if not e.startswith("flags")] == \
        [f"alloc m/0 {nbytes}", f"alloc m/1 {nbytes}"] * 2

    # Each exposure reset the flags first: complete for a publish, empty for a fetch.
    assert [e for e in rt_t.log if e.startswith("flags")] == ["flags m/1 1"] * 3
    assert [e for e in rt_r.log if e.startswith("flags")] == \
        ["flags m/1 0", "flags m/0 0", "flags m/1 0"]

    t.close()
    r.close()
    assert rt_t.log[-2:] == rt_r.log[-2:] == ["free m/0", "free m/1"]


def published(pes, **reader: int) -> tuple[ModelStore, ModelStore, RecordingRuntime, int]:
    """A trainer and a reader (opened with ``reader``'s options), both attached.

    The trainer has published one version. Returns (trainer, reader, reader's runtime, v).
    """
    t, r, rt_r, v, _ = published_by(pes, **reader)
    return t, r, rt_r, v


def published_by(pes, **reader: int) -> tuple[ModelStore, ModelStore, RecordingRuntime, int,
                                               Opener]:
    """`published`, and the reader's `Opener`."""
    open_t, _ = pes("trainer")
    open_r, rt_r = pes("rollout", **reader)
    t, r = open_t(), open_r()
    t.attach(net(1))
    r.attach(net(2))
    return t, r, rt_r, t.publish(), open_r


def test_a_store_never_allocates_beyond_its_buffers(pes):
    t, r, rt_r, v, open_r = published_by(pes, buffers=1)
    with pytest.raises(FabricError, match="all 1 symmetric buffers hold versions"):
        r.fetch(v)
    assert [e for e in rt_r.log if e.startswith("alloc")] == [f"alloc m/0 {t.layout.nbytes}"]
    with pytest.raises(ValueError, match="buffers must be"):
        open_r("x", buffers=0)


def test_chunk_size_must_match_the_publishers(pes):
    _, r, _, v = published(pes, chunk_size=2 * CHUNK)
    with pytest.raises(ManifestMismatchError, match="progress flags count chunks"):
        r.fetch(v)


def test_worker_model_symmetric_needs_a_job_and_a_gpu(pes):
    open_store, runtime = pes("w")
    worker = open_store.worker
    with pytest.raises(ValueError, match="needs a worker in an NVSHMEM job"):
        worker.model("n", symmetric=True)
    worker.nvshmem = runtime
    with pytest.raises(ValueError, match="pass a CUDA device"):
        worker.model("n", device="cpu", symmetric=True)


def test_choose_transport_reads_symmetric_memory_one_sidedly_on_any_host():
    shm, tcp, nvshmem = ShmTransport(), TcpTransport(), object()
    here = SourceAddress("127.0.0.1", 1, host_id=local_host_id())
    there = SourceAddress("10.0.0.2", 1, host_id="another-host")
    desc = {"kind": "nvshmem", "job": "job-1", "pe": 0, "region": "m/0"}
    try:
        for source in (here, there):
            assert choose_transport(source, shm=shm, tcp=tcp, gpu=desc, nvshmem=nvshmem) is nvshmem
        assert choose_transport(there, shm=shm, tcp=tcp, gpu=desc) is tcp
        assert choose_transport(here, shm=shm, tcp=tcp, gpu=desc) is tcp  # not a PE of the job
    finally:
        shm.close()
        tcp.close()


def test_a_worker_picks_nvshmem_only_for_its_own_job(pes):
    open_store, runtime = pes("w")
    transports = open_store.worker.transports
    transports.nvshmem = runtime
    other_job = {"kind": "nvshmem", "job": "job-2", "pe": 1, "region": "m/0"}
    assert transports._nvshmem_for(other_job) is None
    assert transports._nvshmem_for({"kind": "cuda_ipc"}) is None
    assert transports._nvshmem_for(None) is None
