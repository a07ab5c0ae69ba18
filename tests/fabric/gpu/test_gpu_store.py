"""Model stores on a GPU.

Publish and fetch GPU buffers through the fabric (skipped without CUDA, with the probe's
reason).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import weightfabric as wf
from weightfabric.fabric.gpu.probe import probe

MISSING_CUDA = probe().missing("cuda")
pytestmark = pytest.mark.skipif(MISSING_CUDA is not None, reason=str(MISSING_CUDA))

CHUNK = 4 << 20


def tensors(seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(1024, 1536, generator=g).to(torch.bfloat16)
           for i in range(6)}
    out["norm"] = torch.randn(1536, generator=g)
    out["step"] = torch.tensor([seed])
    return {n: t.to(device) for n, t in out.items()}


def _gpu_trainer(url: str, conn) -> None:
    with wf.join(url, worker="trainer") as worker:
        store = worker.model("m", chunk_size=CHUNK, device="cuda:0")
        conn.send(store.publish(tensors(1, "cuda:0")))
        conn.recv()  # readers done


@pytest.fixture
def hub():
    with wf.serve("tcp://127.0.0.1:0", lease_s=10.0) as server:
        yield server


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"],
                         ids=["torch-allocator", "expandable-segments"])
def test_gpu_reader_copies_a_gpu_holder_over_cuda_ipc_bit_exact(hub, monkeypatch, alloc_conf):
    # The spawned trainer starts with this allocator setting; with expandable segments
    # its buffers come from cudaMalloc (torch's would be VMM memory, not exportable).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_trainer, args=(hub.url, child))
    proc.start()
    try:
        assert parent.poll(120), "trainer did not publish"
        version = parent.recv()
        want = tensors(1, "cuda:0")
        with wf.join(hub.url, worker="gpu-reader") as r1, \
                wf.join(hub.url, worker="cpu-reader") as r2:
            stats = r1.model("m", chunk_size=CHUNK, device="cuda:0").fetch(version)
            assert set(stats.transports) == {"cuda_ipc"} and stats.transports["cuda_ipc"] == stats.bytes
            got = r1.model("m", chunk_size=CHUNK, device="cuda:0").tensors
            assert all(torch.equal(got[n], want[n]) for n in want)
            cpu = r2.model("m", chunk_size=CHUNK)  # a CPU store reads the GPU holder too
            cpu.fetch(version)
            assert all(torch.equal(cpu.tensors[n], want[n].cpu()) for n in want)
    finally:
        parent.send("done")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_gpu_reader_fetches_a_cpu_holder_through_shared_memory(hub):
    with wf.join(hub.url, worker="cpu-trainer") as holder, \
            wf.join(hub.url, worker="gpu-reader") as reader:
        version = holder.model("m", chunk_size=CHUNK).publish(tensors(2, "cpu"))
        store = reader.model("m", chunk_size=CHUNK, device="cuda:0")
        model = {n: torch.zeros_like(t) for n, t in tensors(0, "cuda:0").items()}
        store.attach(model)
        stats = store.fetch(version)
        assert set(stats.transports) == {"shm"}
        want = tensors(2, "cuda:0")
        assert all(torch.equal(model[n], want[n]) for n in want)  # attached tensors switched


def test_gpu_stores_refuse_tensors_on_another_device(hub):
    with wf.join(hub.url, worker="w") as worker:
        store = worker.model("m", chunk_size=CHUNK, device="cuda")
        assert store.device == torch.device("cuda", torch.cuda.current_device())
        with pytest.raises(TypeError, match="lives on cuda:0; tensor 'layers.0.w' is on cpu"):
            store.publish(tensors(0, "cpu"))
        with pytest.raises(ValueError, match="already open .* on cuda:0"):
            worker.model("m", chunk_size=CHUNK)


def test_a_gpu_holder_in_the_same_process_is_read_over_tcp(hub):
    with wf.join(hub.url, worker="holder") as holder, \
            wf.join(hub.url, worker="reader") as reader:
        version = holder.model("m", chunk_size=CHUNK, device="cuda:0").publish(tensors(3, "cuda:0"))
        store = reader.model("m", chunk_size=CHUNK, device="cuda:0")
        stats = store.fetch(version)
        assert set(stats.transports) == {"tcp"}  # CUDA opens no IPC handle in its exporter
        want = tensors(3, "cuda:0")
        assert all(torch.equal(store.tensors[n], want[n]) for n in want)


def test_gpu_stores_allocate_and_export_their_buffers_before_the_versions_need_them(
        hub, monkeypatch):
    from weightfabric.fabric import store_buffers
    from weightfabric.fabric.gpu.region import DeviceRegion

    made: list[DeviceRegion] = []

    class Counted(DeviceRegion):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(store_buffers, "DeviceRegion", Counted)
    with wf.join(hub.url, worker="trainer") as worker:
        store = worker.model("m", chunk_size=CHUNK, device="cuda:0")
        store.reserve(tensors(1, "cuda:0"))
        assert len(made) == 1 and made[0].gpu is not None  # the first version's, exported
        store.publish(tensors(1, "cuda:0"))
        assert len(made) == 2  # and its spare, made after the publish, not during the next
        store.publish(tensors(2, "cuda:0"))
        assert len(made) == 2
