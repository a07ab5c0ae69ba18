"""`DeviceRegion`: a model store's buffer in GPU memory.

The GPU counterpart of `fabric.arena.Region`: a flat ``uint8`` CUDA tensor from
torch's allocator, exported over CUDA IPC (`fabric.transports.cuda_ipc`) so
readers on the same node copy from it directly. Without cuda-python, or when the
allocation cannot be exported (PyTorch's ``expandable_segments`` allocator uses
VMM memory, which legacy IPC handles do not cover), the region has no ``gpu``
descriptor and readers fall back to TCP, which the holder serves by copying to
the host; a warning says so once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
_warned = False


def ipc_descriptor(tensor: torch.Tensor) -> dict[str, Any] | None:
    """The CUDA IPC descriptor of a CUDA tensor, or None (with one warning) when it
    cannot be exported."""
    global _warned
    try:
        from fabric.transports.cuda_ipc import export_tensor

        return export_tensor(tensor).to_dict()
    except (ImportError, RuntimeError) as exc:
        if not _warned:
            _warned = True
            log.warning("GPU buffers are not exported over CUDA IPC (%s: %s); readers on this "
                        "node will read them over TCP through host memory. Install the gpu extra "
                        "and leave PYTORCH_CUDA_ALLOC_CONF without expandable_segments.",
                        type(exc).__name__, exc)
        return None


class DeviceRegion:
    """``nbytes`` of GPU memory on ``device`` as a flat ``uint8`` tensor.

    Attributes:
        tensor: the bytes (torch owns the memory; views of it keep it alive).
        gpu: the ``gpu`` descriptor readers use (`IpcHandle.to_dict()`), or None.
        path: always None (no shared-memory file).
    """

    path = None

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if nbytes <= 0:
            raise ValueError(f"a region needs a positive size, got {nbytes} bytes")
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.gpu = ipc_descriptor(self.tensor)

    def close(self) -> None:
        """Drop this region's reference to the memory (attached views keep theirs)."""
        self.tensor = self.tensor[:0]

    def __repr__(self) -> str:
        return f"DeviceRegion({self.nbytes} bytes on {self.tensor.device})"
