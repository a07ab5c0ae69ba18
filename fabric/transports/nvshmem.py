"""`NvshmemTransport`: one-sided reads from a peer PE's symmetric region.

Holder and reader are PEs of one NVSHMEM job and allocated the region together
(`NvshmemRuntime.allocate_region` is collective), so the same local address names
the bytes on every PE. The holder exposes the region's data on its `ReadServer`
with ``gpu={"kind": "nvshmem", "pe": <holder PE>, "region": <symmetric region name>}``
(see `nvshmem_descriptor`) and a `SymmetricProgress`; the server answers DESCRIBE
and grants leases. A read:

1. waits for the chunks one-sidedly: polls the holder's progress flags with a
   blocking ``get`` of the flag words (bounded by the timeout);
2. takes a lease (so the holder's retract waits for this read);
3. ``get_nbi`` of ``[offset, offset + n)`` from the holder PE into ``out`` on the
   transport's stream, then ``quiet`` on that stream and a stream synchronise,
   so the bytes are complete before the caller reports progress;
4. ends the lease.

``out`` should lie in this PE's own copy of the region (symmetric memory), which
every transport NVSHMEM uses can write; across nodes, other memory would need
registering first.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from fabric.errors import ReadRefusedError
from fabric.gpu.nvshmem_arena import NvshmemRuntime, SymmetricRegion, _buffer
from fabric.transports import client
from fabric.transports.base import SourceAddress
from fabric.transports.wire import Op


def nvshmem_descriptor(runtime: NvshmemRuntime, region: SymmetricRegion) -> dict[str, Any]:
    """The ``gpu`` descriptor to expose ``region`` under (`ReadServer.expose`)."""
    return {"kind": "nvshmem", "pe": runtime.rank, "region": region.name}


class NvshmemTransport(client.ServerTransport):
    """Reader side over NVSHMEM host-initiated RMA.

    Args:
        runtime: this process's started `NvshmemRuntime` (owns the regions).
        poll_interval: seconds between reads of a partial holder's flags.
    """

    name = "nvshmem"

    def __init__(self, runtime: NvshmemRuntime, *, poll_interval: float = 2e-4) -> None:
        self.runtime = runtime
        self.poll_interval = poll_interval
        super().__init__()
        self._targets: dict[tuple[str, int, str], tuple[int, SymmetricRegion]] = {}
        self._stream = torch.cuda.Stream(runtime.device)
        self._lock = threading.Lock()  # one RMA sequence on the stream at a time

    def _target(self, source: SourceAddress, region: str, timeout: float) -> tuple[int, SymmetricRegion]:
        key = (source.host, source.port, region)
        if key in self._targets:
            return self._targets[key]
        info = self.describe(source, region, timeout=timeout)
        gpu = info.gpu or {}
        if gpu.get("kind") != "nvshmem":
            raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is not in "
                                   "NVSHMEM symmetric memory")
        local = self.runtime.regions.get(gpu["region"])
        if local is None or local.data.numel() != info.nbytes:
            raise ReadRefusedError(f"symmetric region {gpu['region']!r} is not allocated on this PE "
                                   "with the holder's size (allocation is collective)")
        self._targets[key] = (int(gpu["pe"]), local)
        return self._targets[key]

    def _wait_chunks(self, pe: int, local: SymmetricRegion, first: int, last: int,
                     timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            flags = local.peer_flags(pe, self._stream)
            if bool((flags[first:last + 1] != 0).all()):
                return
            if time.monotonic() > deadline:
                raise ReadRefusedError(f"NOT_READY: chunks {first}..{last} of {local.name!r} on PE "
                                       f"{pe} not present after {timeout:g} s")
            time.sleep(self.poll_interval)

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float) -> None:
        import nvshmem.core as nvshmem

        if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cuda":
            raise ValueError("read into a contiguous uint8 CUDA tensor")
        n = out.numel()
        with self._lock:
            pe, local = self._target(source, region, timeout)
            if offset < 0 or offset + n > local.data.numel():
                raise ReadRefusedError(f"read [{offset}, {offset + n}) outside region {region!r} "
                                       f"of {local.data.numel()} bytes")
            self._wait_chunks(pe, local, offset // local.chunk_size,
                              (offset + n - 1) // local.chunk_size, timeout)
            with self._pool.connection(source) as conn:
                client.lease(conn, source, region, offset=offset, nbytes=n, timeout=timeout)
                try:
                    stream = nvshmem.NvshmemStream(self._stream)
                    self._stream.wait_stream(torch.cuda.current_stream(out.device))
                    nvshmem.get_nbi(_buffer(out.data_ptr(), n),
                                    _buffer(local.data.data_ptr() + offset, n),
                                    remote_pe=pe, stream=stream)
                    nvshmem.quiet(stream=stream)
                    self._stream.synchronize()
                finally:
                    client.request(conn, source, Op.END, region, timeout=timeout)

    def progress(self, source: SourceAddress, region: str, *, timeout: float) -> bytes:
        """The holder's chunk flags, read one-sidedly from its symmetric memory."""
        with self._lock:
            pe, local = self._target(source, region, timeout)
            return bytes((local.peer_flags(pe, self._stream) != 0).to(torch.uint8).tolist())

    def close(self) -> None:
        super().close()
        self._targets.clear()
