"""NVSHMEM arenas: ordered collective frees and attach on CPU; one PE on a GPU."""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.gpu.nvshmem_arena import AllocationRegistry, attach_views
from weightfabric.fabric.gpu.probe import probe
from weightfabric.kernels import plan_layout

MISSING_NVSHMEM = probe().missing("cuda", "nvshmem")


def fake_registry(log: list[str]) -> AllocationRegistry:
    def allocate(n: int) -> torch.Tensor:
        log.append(f"alloc {n}")
        return torch.empty(n, dtype=torch.uint8)

    def free(t: torch.Tensor) -> None:
        log.append(f"free {t.numel()}")

    return AllocationRegistry(allocate, free)


def test_registry_frees_newest_first_on_close_and_pes_in_step_agree():
    logs: list[list[str]] = [[], []]
    pes = [fake_registry(log) for log in logs]
    for reg in pes:
        reg.allocate("a", 10)
        reg.allocate("b", 20)
        reg.allocate("c", 30)
        reg.free("b")
    assert pes[0].fingerprint() == pes[1].fingerprint()
    assert pes[0].names() == ["a", "c"]
    for reg in pes:
        reg.close()
        reg.close()  # idempotent
    assert logs[0] == logs[1] == ["alloc 10", "alloc 20", "alloc 30", "free 20", "free 30", "free 10"]


def test_registry_refuses_duplicates_unknown_frees_and_use_after_close():
    reg = fake_registry([])
    reg.allocate("a", 8)
    other = fake_registry([])
    other.allocate("b", 8)
    assert reg.fingerprint() != other.fingerprint()  # PEs out of step are detectable
    with pytest.raises(ValueError, match="exists"):
        reg.allocate("a", 8)
    with pytest.raises(ValueError, match="positive"):
        reg.allocate("z", 0)
    with pytest.raises(KeyError, match="no live"):
        reg.free("nope")
    reg.close()
    with pytest.raises(RuntimeError, match="after the registry was closed"):
        reg.allocate("b", 8)


def test_registry_never_frees_from_the_garbage_collector():
    log: list[str] = []
    reg = fake_registry(log)
    reg.allocate("a", 8)
    del reg
    import gc

    gc.collect()
    assert log == ["alloc 8"]


def test_attach_moves_parameters_into_buffer_views_keeping_values_and_objects():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5))
    params = list(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params}
    layout = plan_layout({n: p for n, p in params})
    buffer = torch.zeros(layout.nbytes + 64, dtype=torch.uint8)
    views = attach_views(buffer, params, layout)
    base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, p in model.named_parameters():
        assert base <= p.data_ptr() < end and p.data_ptr() == views[name].data_ptr()
        assert torch.equal(p.detach(), before[name])
    slot = layout["0.bias"]
    buffer[slot.offset:slot.offset + 4] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)  # 1.0f
    assert model[0].bias[0].item() == 1.0  # the model sees bytes written into the buffer
    with pytest.raises(ValueError, match="layout needs"):
        attach_views(torch.zeros(8, dtype=torch.uint8), params, layout)
    with pytest.raises(ValueError, match="differ from the layout"):
        attach_views(buffer, params[:1], layout)


def _fake_pe(url: str, session: str, rank: int, pes: int, hang: bool, out) -> None:
    """A PE without NVSHMEM: reports what it inherited; PE 0 may hang in its teardown."""
    import os
    import time

    if rank > 0:
        out.put({"rank": rank, "env": [os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                                       os.environ.get("NVSHMEM_SYMMETRIC_SIZE")]})
    if hang and rank == 0:
        time.sleep(600)


def test_pe_processes_get_the_mps_share_and_heap_and_a_hung_teardown_is_an_error(monkeypatch):
    from weightfabric.tools.bench import gpu_paths

    for name in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "NVSHMEM_SYMMETRIC_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # a PE that has not finished starting (spawn imports torch: seconds on a loaded
    # machine) is no hung teardown: the clean run gets a long teardown, the hung one 5 s
    monkeypatch.setattr(gpu_paths, "TEARDOWN_S", 60.0)
    ok, errors = gpu_paths._run_pes(_fake_pe, (False,), pes=2, readers=1, heap=1 << 30, timeout=60)
    assert errors == [] and ok == [{"rank": 1, "env": ["50", str((1 << 30) + (256 << 20))]}]
    monkeypatch.setattr(gpu_paths, "TEARDOWN_S", 5.0)
    ok, errors = gpu_paths._run_pes(_fake_pe, (True,), pes=2, readers=1, heap=1 << 30, timeout=60)
    assert len(ok) == 1 and errors == [{"rank": 0, "error": "PE 0 exited with code -9 (killed at "
                                                            "the deadline)"}]


# --- on a GPU with NVSHMEM ----------------------------------------------------------------


@pytest.mark.skipif(MISSING_NVSHMEM is not None, reason=str(MISSING_NVSHMEM))
def test_single_pe_allocate_attach_get_from_self_and_signals():
    import nvshmem.core as nvshmem

    from weightfabric.fabric.gpu import MemoryRendezvous, NvshmemRuntime, SymmetricProgress
    from weightfabric.fabric.transports import ReadServer
    from weightfabric.fabric.transports.nvshmem import NvshmemTransport, nvshmem_descriptor

    rt = NvshmemRuntime.start(MemoryRendezvous(), session="single-pe", rank=0, nranks=1,
                              local_rank=0)
    server = ReadServer()
    transport = None
    try:
        model = torch.nn.Linear(300, 200, device="cuda")
        params = list(model.named_parameters())
        layout = plan_layout({n: p for n, p in params})
        chunk = 4096
        src = rt.allocate_region("v1", layout.nbytes, chunk)
        dst = rt.allocate_region("v1-copy", layout.nbytes, chunk)
        weights = {n: p.detach().clone() for n, p in params}
        attach_views(src.data, params, layout)
        assert all(src.data.data_ptr() <= p.data_ptr() < src.data.data_ptr() + layout.nbytes
                   for _, p in params)
        progress = SymmetricProgress(src)
        server.expose("v1", src.data, chunk_size=chunk, progress=progress,
                      gpu=nvshmem_descriptor(rt, src))
        transport = NvshmemTransport(rt)
        assert transport.progress(server.address, "v1", timeout=5) == bytes(src.num_chunks)
        from weightfabric.fabric.errors import ReadRefusedError

        with pytest.raises(ReadRefusedError, match="NOT_READY"):
            transport.read(server.address, "v1", 0, dst.data[:chunk], timeout=0.05)
        for c in range(src.num_chunks):
            progress.mark(c)
        stream = torch.cuda.current_stream()
        nvshmem.signal_wait(src.flag_buffer(src.num_chunks - 1), 1,
                            nvshmem.ComparisonType.CMP_EQ, stream=nvshmem.NvshmemStream(stream))
        assert transport.progress(server.address, "v1", timeout=5) == bytes([1] * src.num_chunks)
        for lo in range(0, layout.nbytes, chunk):
            hi = min(lo + chunk, layout.nbytes)
            transport.read(server.address, "v1", lo, dst.data[lo:hi], timeout=5)
        assert torch.equal(dst.data[:layout.nbytes], src.data[:layout.nbytes])
        for name, p in params:
            assert torch.equal(p.detach(), weights[name])
        # this PE's own copy is the data itself (no extra reference that would make
        # the collective free skip the real free)
        assert src.peer_data(0).data_ptr() == src.data.data_ptr()
        assert server.retract("v1", timeout=5)
        rt.free_region("v1-copy")
        assert "v1-copy" not in rt.regions
    finally:
        if transport is not None:
            transport.close()
        server.close()
        rt.close()


MISSING_TWO_PES = probe().missing("cuda", "nvshmem", "mps")


@pytest.mark.skipif(MISSING_TWO_PES is not None, reason=str(MISSING_TWO_PES))
def test_two_pes_on_one_gpu_under_mps_read_each_other_bit_exact():
    from weightfabric.tools.bench.gpu_paths import nvshmem_reads

    result = nvshmem_reads(pes=2, size=256 << 20, chunk_size=16 << 20, timeout=120)
    assert result["verified"], result["errors"]
    assert len(result["per_reader_gbps"]) == 1


@pytest.mark.skipif(MISSING_TWO_PES is not None, reason=str(MISSING_TWO_PES))
def test_two_pes_fetch_between_symmetric_stores_one_sidedly():
    from weightfabric.tools.bench.gpu_paths import nvshmem_store_fetch

    result = nvshmem_store_fetch(pes=2, size=96 << 20, chunk_size=16 << 20, timeout=120)
    assert not result["errors"], result["errors"]
    assert result["transports"] == [{"nvshmem": 96 << 20}]
    assert result["verified"]
