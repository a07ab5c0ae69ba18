"""CUDA IPC: handle serialisation and GPU descriptors on CPU; the 4 GB fetch on a GPU."""

from __future__ import annotations

import multiprocessing as mp
import time

import msgpack
import pytest
import torch

from weightfabric.fabric.errors import ReadRefusedError
from weightfabric.fabric.gpu import region
from weightfabric.fabric.gpu.probe import probe
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer, TcpTransport, client, cuda_ipc
from weightfabric.fabric.transports.cuda_ipc import HANDLE_NBYTES, CudaIpcTransport, IpcHandle
from weightfabric.fabric.transports.wire import Op

UUID = "GPU-58a5f2a4-1c2b-3d4e-5f60-718293a4b5c6"
MISSING_CUDA = probe().missing("cuda")


def handle() -> IpcHandle:
    return IpcHandle(bytes(range(HANDLE_NBYTES)), 4096, 1 << 32, UUID)


def test_ipc_handle_round_trips_through_msgpack_with_a_normalised_uuid():
    h = handle()
    back = IpcHandle.unpack(h.pack())
    assert back == h and back.device_uuid == "58a5f2a41c2b3d4e5f60718293a4b5c6"
    assert len(h.pack()) < 200


def test_malformed_ipc_handles_are_errors():
    with pytest.raises(ValueError, match="64 bytes"):
        IpcHandle(b"x" * 63, 0, 1, UUID)
    with pytest.raises(ValueError, match="bad IPC range"):
        IpcHandle(bytes(64), -1, 1, UUID)
    with pytest.raises(ValueError, match="not a CUDA IPC descriptor"):
        IpcHandle.from_dict({"kind": "nvshmem", "pe": 0})
    with pytest.raises(ValueError, match="malformed"):
        IpcHandle.unpack(msgpack.packb({"kind": "cuda_ipc", "offset": 0}))
    with pytest.raises(ValueError, match="not msgpack"):
        IpcHandle.unpack(b"\xc1")


@pytest.mark.parametrize("var,value,expected", [
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments: true", True),
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
    ("PYTORCH_CUDA_ALLOC_CONF", "", False),
])
def test_expandable_segments_is_read_from_torchs_allocator_settings(monkeypatch, var, value,
                                                                    expected):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, value)
    assert region.expandable_segments() is expected


def test_device_region_memory_comes_from_cudamalloc_only_under_expandable_segments(monkeypatch):
    calls = []

    def fake_allocate(nbytes, device):
        calls.append((nbytes, device))
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(cuda_ipc, "allocate", fake_allocate)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert region._allocate(8, "cpu").numel() == 8 and calls == []  # torch's allocator
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert region._allocate(8, "cpu").numel() == 8 and calls == [(8, "cpu")]

    def without_cuda_python(nbytes, device):
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(cuda_ipc, "allocate", without_cuda_python)
    assert region._allocate(8, "cpu").numel() == 8  # torch's again (and no IPC: TCP)


def test_gpu_descriptor_travels_in_describe_and_lease_and_tcp_still_reads():
    data = torch.arange(4000, dtype=torch.int64).to(torch.uint8)
    progress = ChunkProgress(4)
    with ReadServer() as server:
        server.expose("w", data, chunk_size=1000, progress=progress, gpu=handle().to_dict())
        server.expose("plain", data, chunk_size=1000)
        ipc, tcp = CudaIpcTransport(), TcpTransport()  # describe and leases need no GPU
        pool = client.ConnectionPool()
        try:
            info = ipc.describe(server.address, "w", timeout=5)
            assert IpcHandle.from_dict(info.gpu) == handle()
            assert (info.nbytes, info.num_chunks, info.present) == (4000, 4, 0)
            assert ipc.describe(server.address, "plain", timeout=5).gpu is None
            with pool.connection(server.address) as conn, pytest.raises(ReadRefusedError,
                                                                        match="NOT_READY"):
                client.lease(conn, server.address, "w", offset=0, nbytes=10, timeout=0.05)
            progress.mark(0)
            with pool.connection(server.address) as conn:  # a lease blocks retract until END
                where = client.lease(conn, server.address, "w", offset=0, nbytes=10, timeout=5)
                assert IpcHandle.from_dict(where.gpu) == handle() and where.shm_path is None
                assert server.retract("w", timeout=0.1) is False
                client.request(conn, server.address, Op.END, "w", timeout=5)
            out = torch.empty(1000, dtype=torch.uint8)
            with pytest.raises(ReadRefusedError, match="not exported over CUDA IPC"):
                ipc.read(server.address, "plain", 0, out, timeout=5)
            tcp.read(server.address, "plain", 1000, out, timeout=5)  # any region reads over TCP
            assert torch.equal(out, data[1000:2000])
            assert server.retract("w", timeout=5) is True
            with pytest.raises(ReadRefusedError, match="NOT_FOUND"):
                ipc.describe(server.address, "w", timeout=5)
        finally:
            pool.close()
            ipc.close()
            tcp.close()
        with pytest.raises(TypeError):
            server.expose("bad", data, chunk_size=1, gpu={"x": object()})


# --- on a GPU ---------------------------------------------------------------------------

NBYTES = 4 << 30
CHUNK = 256 << 20


def pattern(nbytes: int, device: str) -> torch.Tensor:
    """Deterministic bytes every process can regenerate."""
    i = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    return (i * 0x5851F42D4C957F2D + 12345).view(torch.uint8)


def _holder(conn) -> None:
    from weightfabric.fabric.transports.cuda_ipc import export_tensor

    data = pattern(NBYTES, "cuda:0")
    torch.cuda.synchronize()
    with ReadServer() as server:
        server.expose("w", data, chunk_size=CHUNK, gpu=export_tensor(data).to_dict())
        conn.send(server.address.to_dict())
        if conn.recv() == "retract":  # the reader is done (else it failed)
            conn.send(server.retract("w", timeout=30))
            conn.recv()  # the reader unmapped it


@pytest.mark.skipif(MISSING_CUDA is not None, reason=str(MISSING_CUDA))
def test_two_processes_fetch_4gb_over_cuda_ipc_bit_exact():
    from weightfabric.fabric.transports.base import SourceAddress

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child,))
    proc.start()
    transport = CudaIpcTransport()
    try:
        assert parent.poll(120), "holder did not start"
        source = SourceAddress.from_dict(parent.recv())
        out = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
        for lo in range(0, NBYTES, CHUNK):
            transport.read(source, "w", lo, out[lo:lo + CHUNK], timeout=30)
        assert torch.equal(out, pattern(NBYTES, "cuda:0"))
        assert len(transport._mappings) == 1  # one allocation, mapped once
        parent.send("retract")
        assert parent.poll(60) and parent.recv() is True
        deadline = time.monotonic() + 5  # the holder's notice unmaps it
        while len(transport._mappings) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(transport._mappings) == 0
    finally:
        transport.close()
        parent.send("done")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
