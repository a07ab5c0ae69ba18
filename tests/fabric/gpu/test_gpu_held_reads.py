"""A fetch from a CUDA IPC holder on its stream: pieces launched at once, checksums fused.

The GPU run of `tests/fabric/test_stream_copies.py`: `CudaIpcTransport.stream_copy` under
a held lease, verified by the sums `kernels.copy_with_checksums` makes as it copies, a
corrupt chunk in a GPU holder caught and read again from another. Skipped without a GPU.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.gpu.probe import probe
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer
from weightfabric.fabric.transports.base import SourceAddress
from weightfabric.fabric.transports.cuda_ipc import CudaIpcTransport
from weightfabric.kernels import chunk_checksums, copy_with_checksums

MISSING_CUDA = probe().missing("cuda")
NBYTES = 512 << 20
CHUNK = 16 << 20
BAD_AT = 5 * CHUNK + 7

pytestmark = pytest.mark.skipif(MISSING_CUDA is not None, reason=str(MISSING_CUDA))


def pattern(nbytes: int, device: str) -> torch.Tensor:
    i = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    return (i * 0x5851F42D4C957F2D + 12345).view(torch.uint8)


def _holders(conn) -> None:
    """Exposes "good" (the pattern) and "bad" (chunk 5 differs), each its own allocation."""
    from weightfabric.fabric.transports.cuda_ipc import allocate, export_tensor

    with ReadServer() as server:
        for name in ("good", "bad"):
            data = allocate(NBYTES, "cuda:0")
            data.copy_(pattern(NBYTES, "cuda:0"))
            if name == "bad":
                data[BAD_AT] ^= 0xFF
            torch.cuda.synchronize()
            server.expose(name, data, chunk_size=CHUNK, gpu=export_tensor(data).to_dict())
        conn.send(server.address.to_dict())
        conn.recv()


class _BadThenGood:
    def __init__(self, address: SourceAddress) -> None:
        self.sources = [Source("bad", address, "bad"), Source("good", address, "good")]

    def plan(self, missing, failed):
        source = self.sources.pop(0) if len(self.sources) == 2 else self.sources[0]
        return [Assignment(tuple(missing), (source,))]

    def report(self, chunks):
        pass


def test_a_fetch_over_cuda_ipc_copies_on_the_stream_and_verifies_with_fused_sums():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holders, args=(child,))
    proc.start()
    transport = CudaIpcTransport()
    separate: list[int] = []

    def checksum_fn(first, piece):
        separate.append(first)
        return chunk_checksums(piece, CHUNK, first_chunk=first).tolist()

    try:
        assert parent.poll(120), "holder did not start"
        address = SourceAddress.from_dict(parent.recv())
        want = pattern(NBYTES, "cuda:0")
        dest = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:0")
        stats = fetch_chunks(
            dest, chunk_size=CHUNK, progress=ChunkProgress(NBYTES // CHUNK),
            planner=_BadThenGood(address), choose=lambda _: transport,
            checksums=chunk_checksums(want, CHUNK).tolist(), checksum_fn=checksum_fn,
            copy_checksums=lambda d, s, c: copy_with_checksums(d, s, CHUNK, first_chunk=c),
            options=FetchOptions(read_bytes=128 << 20))
        torch.cuda.synchronize()
        assert torch.equal(dest, want)
        assert stats.corrupted_chunks == 1 and separate == []  # the copies' own sums
        assert stats.leases == 2  # one per holder
    finally:
        transport.close()
        parent.send("done")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
