"""NVSHMEM symmetric-heap arenas: bootstrap, ordered allocation, attach, progress flags.

Every PE of a job runs the same sequence (allocation is a collective)::

    rt = NvshmemRuntime.start(rendezvous, session="job-7", rank=r, nranks=n, local_rank=lr)
    region = rt.allocate_region("v12", nbytes, chunk_size)   # data + progress flags, collective
    attach_views(region.data, model.named_parameters(), layout)  # weights now live in it
    ...
    rt.close()        # frees every region in reverse allocation order, then finalize

Frees are collectives too, so `AllocationRegistry` frees explicitly, in one
deterministic order on every PE, never from ``__del__`` (a garbage-collector free
on one PE only deadlocks or raises). Its ``fingerprint`` lets PEs compare their
allocation histories through the rendezvous before they diverge silently.

Progress: each region has one 64-bit flag (int64) per chunk in symmetric memory. The
holder sets a flag (``signal_op`` SET on its own PE, on the stream that wrote the
chunk, so the flag follows the bytes), then marks the chunk on the host, where
its read server's leases wait. A kernel reading a peer's copy in place waits on
the flags one-sidedly (`SymmetricRegion.wait_peer_chunks`).

Model stores use this through `fabric.gpu.region.SymmetricBuffer`
(``worker.model(name, device=..., symmetric=True)``).
Only `AllocationRegistry` and `attach_views` run without a GPU.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from weightfabric.fabric.gpu.uid import Rendezvous, exchange_unique_id, uid_from_bytes, uid_to_bytes
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.kernels import PackLayout


class AllocationRegistry:
    """Named collective allocations, freed explicitly in one order on every PE.

    Args:
        allocate: ``allocate(nbytes) -> tensor`` (collective on NVSHMEM).
        free: ``free(tensor)`` (collective on NVSHMEM).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor],
                 free: Callable[[torch.Tensor], None]) -> None:
        self._allocate, self._free = allocate, free
        self._live: dict[str, torch.Tensor] = {}
        self._history = hashlib.sha256()
        self.closed = False

    def allocate(self, name: str, nbytes: int) -> torch.Tensor:
        """Allocate ``nbytes`` under ``name``. Every PE must make the same calls in order."""
        if self.closed:
            raise RuntimeError(f"allocation of {name!r} after the registry was closed")
        if name in self._live:
            raise ValueError(f"symmetric allocation {name!r} exists; free it first")
        if nbytes <= 0:
            raise ValueError(f"symmetric allocation {name!r}: nbytes must be positive, got {nbytes}")
        tensor = self._allocate(nbytes)
        self._live[name] = tensor
        self._history.update(f"+{name}:{nbytes};".encode())
        return tensor

    def free(self, name: str) -> None:
        """Free ``name`` now (a collective: every PE frees the same name at the same point)."""
        tensor = self._live.pop(name, None)
        if tensor is None:
            raise KeyError(f"no live symmetric allocation {name!r}")
        self._history.update(f"-{name};".encode())
        self._free(tensor)

    def names(self) -> list[str]:
        """Live allocations, oldest first."""
        return list(self._live)

    def fingerprint(self) -> str:
        """Digest of every allocate/free so far; equal on PEs that stayed in step."""
        return self._history.hexdigest()[:16]

    def close(self) -> None:
        """Free every live allocation, newest first. Safe to call twice."""
        while self._live:
            self.free(next(reversed(self._live)))
        self.closed = True


def attach_views(buffer: torch.Tensor, params: Iterable[tuple[str, torch.Tensor]],
                 layout: PackLayout) -> dict[str, torch.Tensor]:
    """Move parameters into ``buffer`` (flat uint8) at ``layout``'s offsets, as views.

    Each tensor's values are copied into its slot and its ``.data`` rebound to the
    view, so the engine keeps using the same Parameter objects and later fetches
    write straight into the weights.

    Returns:
        name -> the view now backing that parameter.

    Raises:
        ValueError: buffer too small, not flat uint8, names or shapes differ from the layout.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("attach: the buffer must be a flat contiguous uint8 tensor")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"attach: buffer of {buffer.numel()} bytes, layout needs {layout.nbytes}")
    params = list(params)
    if sorted(n for n, _ in params) != sorted(layout.names):
        raise ValueError(f"attach: tensors {sorted(n for n, _ in params)} differ from the layout's "
                         f"{sorted(layout.names)}")
    views: dict[str, torch.Tensor] = {}
    for name, tensor in params:
        slot = layout[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"attach: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the layout "
                             f"has {slot.shape} {slot.dtype}")
        view = buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        with torch.no_grad():
            view.copy_(tensor)
        tensor.data = view
        views[name] = view
    return views


RMA_LOCK = threading.RLock()
"""Held around every one-sided NVSHMEM call (get, signal, peer pointer). The host
library is ``THREAD_SERIALIZED`` (``nvshmem.core.query_thread()``), and the fetch
engine calls it from several threads: transport reads in its pool, progress flags
in its loop. Collectives (allocate, free, barrier) block on the other PEs and are
made from the thread that attaches and closes stores, without this lock."""


def _buffer(ptr: int, nbytes: int) -> Any:
    """A cuda.core Buffer over a byte range (nvshmem4py takes exact allocations or Buffers)."""
    from cuda.core import Buffer

    return Buffer.from_handle(ptr, nbytes)


@dataclass
class SymmetricRegion:
    """A region in the symmetric heap: data bytes, per-chunk flags, a scratch for peers' flags."""

    name: str
    data: torch.Tensor
    flags: torch.Tensor
    peer_scratch: torch.Tensor
    chunk_size: int

    @property
    def num_chunks(self) -> int:
        """Chunks of the buffer (one flag each)."""
        return self.flags.numel()

    def flag_buffer(self, chunk: int) -> Any:
        """Chunk `chunk`'s 8-byte flag, as a buffer the NVSHMEM calls take."""
        return _buffer(self.flags.data_ptr() + 8 * chunk, 8)

    def peer_data(self, pe: int) -> torch.Tensor:
        """PE ``pe``'s copy of the data as a tensor this process can load from.

        PE ``pe``'s copy of the data as a tensor this process can load from directly (same
        node, NVLink or PCIe peer access): ``nvshmem.core.get_peer_tensor``. Kernels may
        read it (e.g. `fabric.relayout.direct.run_direct`) once the peer's flags say the
        chunks are present. This PE's own copy is `data` itself.
        """
        import nvshmem.core as nvshmem

        with RMA_LOCK, torch.cuda.device(self.data.device):
            if pe == nvshmem.my_pe():
                # nvshmem4py would hand back the allocation itself with one more
                # reference, and this PE's collective free would then skip the real free
                return self.data
            return nvshmem.get_peer_tensor(self.data, pe)

    def peer_flags(self, pe: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """PE ``pe``'s chunk flags of this region, read one-sidedly (blocking)."""
        import nvshmem.core as nvshmem

        n = 8 * self.num_chunks
        # the lock also keeps the scratch to one reader at a time; NVSHMEM calls run in
        # the current CUDA context, which on another thread may be another device's
        with RMA_LOCK, torch.cuda.device(self.flags.device):
            nvshmem.get(_buffer(self.peer_scratch.data_ptr(), n), _buffer(self.flags.data_ptr(), n),
                        remote_pe=pe, stream=nvshmem.NvshmemStream(stream))
            stream.synchronize()
            return self.peer_scratch.cpu()

    def wait_peer_chunks(self, pe: int, first: int, last: int, stream: torch.cuda.Stream, *,
                         timeout: float, poll_interval: float = 2e-4) -> bool:
        """Wait until PE ``pe`` has flagged chunks ``first..last``; False on timeout.

        Wait until PE ``pe`` has flagged chunks ``first..last``, polling its flags
        one-sidedly (`peer_flags`); False on timeout. For readers that load the peer's bytes
        in kernels (`peer_data`) without a read server's lease.
        """
        deadline = time.monotonic() + timeout
        while not bool((self.peer_flags(pe, stream)[first:last + 1] != 0).all()):
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_interval)
        return True


class SymmetricProgress(ChunkProgress):
    """`ChunkProgress` that also sets the region's symmetric flag of each marked chunk.

    Creating one resets the region's flags (all set when ``complete``), so a region
    reused for another version never shows the previous version's flags; create it
    only after the previous exposure was retracted (no reader in flight).
    """

    def __init__(self, region: SymmetricRegion, *, complete: bool = False) -> None:
        super().__init__(region.num_chunks, complete=complete)
        self.region = region
        stream = torch.cuda.current_stream(region.flags.device)
        region.flags.fill_(1 if complete else 0)
        stream.synchronize()

    def mark(self, chunk: int, stream: torch.cuda.Stream | None = None) -> None:
        """Set the flag on ``stream`` (after the chunk's writes on it), then mark on the host."""
        import nvshmem.core as nvshmem

        stream = stream or torch.cuda.current_stream(self.region.flags.device)
        with RMA_LOCK, torch.cuda.device(self.region.flags.device):
            nvshmem.signal_op(self.region.flag_buffer(chunk), 1, nvshmem.SignalOp.SIGNAL_SET,
                              remote_pe=nvshmem.my_pe(), stream=nvshmem.NvshmemStream(stream))
        stream.synchronize()
        super().mark(chunk)


class NvshmemRuntime:
    """NVSHMEM for this process: device binding, uid bootstrap, the allocation registry."""

    def __init__(self, rank: int, nranks: int, device: int, session: str) -> None:
        import nvshmem.core as nvshmem

        self.rank, self.nranks, self.device, self.session = rank, nranks, device, session
        self.registry = AllocationRegistry(
            lambda n: nvshmem.tensor((n,), dtype=torch.uint8), nvshmem.free_tensor)
        self.regions: dict[str, SymmetricRegion] = {}

    @classmethod
    def start(cls, rendezvous: Rendezvous, *, session: str, rank: int, nranks: int,
              local_rank: int, timeout: float = 60.0) -> NvshmemRuntime:
        """Bind GPU ``local_rank`` (before init), share the uid, ``init`` with method "uid"."""
        import nvshmem.core as nvshmem
        from cuda.core import Device

        dev = Device(local_rank)
        dev.set_current()
        torch.cuda.set_device(local_rank)
        raw = exchange_unique_id(rendezvous, session=session, rank=rank, nranks=nranks,
                                 create=lambda: uid_to_bytes(nvshmem.get_unique_id()),
                                 timeout=timeout)
        nvshmem.init(device=dev, uid=uid_from_bytes(raw), rank=rank, nranks=nranks,
                     initializer_method="uid")
        return cls(rank, nranks, local_rank, session)

    def allocate_region(self, name: str, nbytes: int, chunk_size: int) -> SymmetricRegion:
        """Collective: data, flags (zeroed) and peer scratch of region ``name``."""
        import nvshmem.core as nvshmem

        num_chunks = -(-nbytes // chunk_size)
        # NVSHMEM calls run in the current CUDA context, which on another thread than
        # the one that called `start` may be another device's
        with torch.cuda.device(self.device):
            data = self.registry.allocate(f"{name}/data", nbytes)
            flags = self.registry.allocate(f"{name}/flags", 8 * num_chunks).view(torch.int64)
            scratch = self.registry.allocate(f"{name}/scratch", 8 * num_chunks).view(torch.int64)
            stream = torch.cuda.current_stream(self.device)
            flags.zero_()
            stream.synchronize()
            nvshmem.barrier_all(stream=nvshmem.NvshmemStream(stream))
            stream.synchronize()
        region = SymmetricRegion(name, data, flags, scratch, chunk_size)
        self.regions[name] = region
        return region

    def progress(self, region: SymmetricRegion, *, complete: bool = False) -> SymmetricProgress:
        """A fresh `SymmetricProgress` of ``region`` (resets its flags)."""
        return SymmetricProgress(region, complete=complete)

    def free_region(self, name: str) -> None:
        """Collective: free region ``name`` (same point on every PE)."""
        self.regions.pop(name)
        with torch.cuda.device(self.device):
            for part in ("scratch", "flags", "data"):
                self.registry.free(f"{name}/{part}")

    def close(self) -> None:
        """Free everything in reverse allocation order, then ``finalize``."""
        import nvshmem.core as nvshmem

        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            self.regions.clear()
            self.registry.close()
            nvshmem.finalize()
