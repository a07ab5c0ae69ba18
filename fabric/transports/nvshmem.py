"""`NvshmemTransport`: one-sided reads from a peer PE's symmetric region.

Holder and reader are PEs of one NVSHMEM job and allocated the region together
(`NvshmemRuntime.allocate_region` is collective), so the same local address names
the bytes on every PE. The holder exposes the region's data on its `ReadServer`
with the descriptor of `nvshmem_descriptor` (``kind``, ``job``, holder ``pe``,
symmetric ``region`` name) and a `SymmetricProgress`, whose flags it sets in
symmetric memory as chunks land. A read:

1. takes a lease: the holder's server answers once the chunks are present (its
   host-side progress is marked after the symmetric flag, after the bytes) and
   holds the read in flight, so a retract waits for it; the answer carries the
   descriptor, so a holder that moved the version to another buffer is followed;
2. ``get_nbi`` of ``[offset, offset + n)`` from the holder PE into ``out`` on the
   transport's stream, then ``quiet`` on that stream and a stream synchronise,
   so the bytes are complete before the caller reports progress;
3. ends the lease.

Readers that load peer memory in kernels instead (`SymmetricRegion.peer_data`)
wait on the flags one-sidedly with `SymmetricRegion.wait_peer_chunks`; `progress`
reads them the same way.

``out`` should lie in this PE's own symmetric memory (a `SymmetricBuffer` of a
store, or a region), which every transport NVSHMEM uses can write; across nodes,
other memory would need registering first.
"""

from __future__ import annotations

from typing import Any

import torch

from weightfabric.fabric.errors import ReadRefusedError, SourceLostError
from weightfabric.fabric.gpu.nvshmem_arena import RMA_LOCK, NvshmemRuntime, SymmetricRegion, _buffer
from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import ReadAbort, SourceAddress


def nvshmem_descriptor(runtime: NvshmemRuntime, region: SymmetricRegion) -> dict[str, Any]:
    """The ``gpu`` descriptor to expose ``region`` under (`ReadServer.expose`)."""
    return {"kind": "nvshmem", "job": runtime.session, "pe": runtime.rank, "region": region.name}


class NvshmemTransport(client.ServerTransport):
    """Reader side over NVSHMEM host-initiated RMA.

    Args:
        runtime: this process's started `NvshmemRuntime` (owns the regions).
    """

    name = "nvshmem"
    leases_per_read = 1

    def __init__(self, runtime: NvshmemRuntime) -> None:
        self.runtime = runtime
        super().__init__()
        self._stream = torch.cuda.Stream(runtime.device)  # one RMA sequence at a time (RMA_LOCK)

    def _local(self, gpu: dict[str, Any] | None, source: SourceAddress,
               region: str) -> tuple[int, SymmetricRegion]:
        """The holder PE and this PE's copy of the symmetric region a descriptor names."""
        gpu = gpu or {}
        if gpu.get("kind") != "nvshmem" or gpu.get("job") != self.runtime.session:
            raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is not in "
                                   f"the symmetric memory of NVSHMEM job {self.runtime.session!r}")
        local = self.runtime.regions.get(gpu["region"])
        if local is None:
            raise ReadRefusedError(f"symmetric region {gpu['region']!r} is not allocated on this "
                                   "PE (allocation is collective: every PE allocates it)")
        return int(gpu["pe"]), local

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None) -> int:
        """Copy bytes from a PE's symmetric buffer into `out` (see `Transport.read`)."""
        import nvshmem.core as nvshmem

        if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cuda":
            raise ValueError("read into a contiguous uint8 CUDA tensor")
        with (self._pool.connection(source, abort) as conn,
              client.under_lease(conn, source, region, offset=offset, nbytes=out.numel(),
                                 timeout=timeout, prefix=prefix) as where):
            n = where.nbytes
            pe, local = self._local(where.gpu, source, region)
            if offset < 0 or offset + n > local.data.numel():
                raise ReadRefusedError(f"read [{offset}, {offset + n}) outside symmetric "
                                       f"region {local.name!r} of {local.data.numel()} bytes")
            with RMA_LOCK, torch.cuda.device(self.runtime.device):
                stream = nvshmem.NvshmemStream(self._stream)
                self._stream.wait_stream(torch.cuda.current_stream(out.device))
                try:
                    nvshmem.get_nbi(_buffer(out.data_ptr(), n),
                                    _buffer(local.data.data_ptr() + offset, n),
                                    remote_pe=pe, stream=stream)
                    nvshmem.quiet(stream=stream)
                    self._stream.synchronize()
                except Exception as exc:  # nvshmem4py and CUDA raise their own types
                    raise SourceLostError(f"NVSHMEM get of {region!r} from PE {pe} failed: "
                                          f"{type(exc).__name__}: {exc}") from exc
        return n

    def progress(self, source: SourceAddress, region: str, *, timeout: float) -> bytes:
        """The holder's chunk flags, read one-sidedly from its symmetric memory."""
        pe, local = self._local(self.describe(source, region, timeout=timeout).gpu, source, region)
        return bytes((local.peer_flags(pe, self._stream) != 0).to(torch.uint8).tolist())
