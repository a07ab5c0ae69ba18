"""GPU buffers of model stores: `DeviceRegion` (CUDA IPC) and `SymmetricBuffer` (NVSHMEM).

The GPU counterpart of `fabric.arena.Region`: a flat ``uint8`` CUDA tensor,
exported over CUDA IPC (`fabric.transports.cuda_ipc`) so readers on the same node
copy from it directly. It comes from torch's allocator, unless torch is set to use
``expandable_segments`` (VMM memory, which legacy IPC handles do not cover): then
from ``cudaMalloc`` (`cuda_ipc.allocate`). Without cuda-python, or when the
allocation cannot be exported anyway, the region has no ``gpu`` descriptor and
readers fall back to TCP, which the holder serves by copying to the host; a
warning says so once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime
    from weightfabric.fabric.progress import ChunkProgress

log = logging.getLogger(__name__)
_warned = False


def ipc_descriptor(tensor: torch.Tensor) -> dict[str, Any] | None:
    """The CUDA IPC descriptor of a CUDA tensor, or None if it cannot be exported.

    The CUDA IPC descriptor of a CUDA tensor, or None (with one warning) when it cannot be
    exported. It names the exporting process (``pid``): CUDA does not open a handle in the
    process that exported it, so readers there use TCP.
    """
    global _warned
    try:
        from weightfabric.fabric.transports.cuda_ipc import export_tensor

        return export_tensor(tensor).to_dict() | {"pid": os.getpid()}
    except (ImportError, RuntimeError) as exc:
        if not _warned:
            _warned = True
            hint = " Install the gpu extra (cuda-python)." if isinstance(exc, ImportError) else ""
            log.warning("GPU buffers are not exported over CUDA IPC (%s: %s); readers on this "
                        "node will read them over TCP through host memory.%s",
                        type(exc).__name__, exc, hint)
        return None


def expandable_segments() -> bool:
    """Whether torch's CUDA allocator is set to ``expandable_segments``.

    Whether the environment sets torch's CUDA allocator to ``expandable_segments``
    (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``; a setting changed at run time is
    not seen).
    """
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in os.environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def _allocate(nbytes: int, device: torch.device | str) -> torch.Tensor:
    if expandable_segments():
        from weightfabric.fabric.transports.cuda_ipc import allocate

        with contextlib.suppress(ImportError):  # without cuda-python, no IPC: ipc_descriptor warns
            return allocate(nbytes, device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class DeviceRegion:
    """``nbytes`` of GPU memory on ``device`` as a flat ``uint8`` tensor.

    Attributes:
        tensor: the bytes (views of it keep the memory alive).
        gpu: the ``gpu`` descriptor readers use (`IpcHandle.to_dict()`), or None.
        path: always None (no shared-memory file).
    """

    path = None

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if nbytes <= 0:
            raise ValueError(f"a region needs a positive size, got {nbytes} bytes")
        self.nbytes = nbytes
        self.tensor = _allocate(nbytes, device)
        self.gpu = ipc_descriptor(self.tensor)

    def close(self) -> None:
        """Drop this region's reference to the memory (attached views keep theirs)."""
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.tensor.device)

    def __repr__(self) -> str:
        return f"DeviceRegion({self.nbytes} bytes on {self.tensor.device})"


class SymmetricBuffer:
    """A model store's buffer in the NVSHMEM symmetric heap of ``runtime``'s job.

    Allocation and free are collectives: every PE creates the same buffers (same
    ``name`` and size) in the same order, and closes them in the same order.
    Readers that are PEs of the same job read it one-sidedly
    (`fabric.transports.nvshmem.NvshmemTransport`); others over TCP.

    Attributes:
        tensor: the bytes (the region's data in this PE's symmetric heap).
        gpu: the ``nvshmem`` descriptor readers use.
        path: always None (no shared-memory file).
    """

    path = None

    def __init__(self, runtime: NvshmemRuntime, name: str, nbytes: int, chunk_size: int) -> None:
        from weightfabric.fabric.transports.nvshmem import nvshmem_descriptor

        self.runtime, self.name, self.nbytes = runtime, name, nbytes
        self.region = runtime.allocate_region(name, nbytes, chunk_size)
        self.tensor = self.region.data
        self.gpu = nvshmem_descriptor(runtime, self.region)
        self._closed = False

    def progress(self, *, complete: bool = False) -> ChunkProgress:
        """Fresh progress for a new exposure (resets the symmetric flags)."""
        return self.runtime.progress(self.region, complete=complete)

    def close(self) -> None:
        """Free the buffer (a collective). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if not self.runtime.registry.closed:  # else the runtime's close freed it already
            self.runtime.free_region(self.name)

    def __repr__(self) -> str:
        return f"SymmetricBuffer({self.name!r}, {self.nbytes} bytes, PE {self.runtime.rank})"
