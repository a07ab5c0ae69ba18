"""Transports: how bytes of an exposed region move from a holder to a reader.

`choose_transport` picks ``nvshmem`` when the region is in the symmetric memory of
the reader's NVSHMEM job (on any host; `fabric.transports.nvshmem`); otherwise, for
a source on this host (same host id), ``cuda_ipc`` when the region is GPU memory
exported over CUDA IPC on a GPU this process sees, ``shm`` when it is host memory,
else ``tcp`` (the holder copies GPU bytes to the host); for a source on another
host, ``tcp``.
"""

from __future__ import annotations

import logging
from typing import Any

from weightfabric.fabric.errors import ReadRefusedError, SourceLostError, TransportError
from weightfabric.fabric.transports.base import (
    ReadAbort,
    RegionInfo,
    SourceAddress,
    Transport,
    local_host_id,
)
from weightfabric.fabric.transports.server import ReadServer
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.fabric.transports.tcp import TcpTransport

log = logging.getLogger(__name__)

__all__ = [
    "ReadAbort",
    "ReadRefusedError",
    "ReadServer",
    "RegionInfo",
    "ShmTransport",
    "SourceAddress",
    "SourceLostError",
    "TcpTransport",
    "Transport",
    "TransportError",
    "choose_transport",
    "local_host_id",
]


def choose_transport(source: SourceAddress, *, shm: Transport, tcp: Transport,
                     gpu: dict[str, Any] | None = None, ipc: Transport | None = None,
                     nvshmem: Transport | None = None) -> Transport:
    """The transport to read a region of `source` with.

    Args:
        source: where the holder's read server runs.
        shm, tcp: the reader's transports.
        gpu: the region's ``gpu`` descriptor (`RegionInfo.gpu`); None for host memory.
        ipc: a `CudaIpcTransport` when this process can map the descriptor's GPU.
        nvshmem: an `NvshmemTransport` when the descriptor names symmetric memory of
            this process's NVSHMEM job and the destination is symmetric too.
    """
    if gpu is not None and gpu.get("kind") == "nvshmem" and nvshmem is not None:
        return nvshmem
    if source.host_id != local_host_id():
        return tcp
    if gpu is None:
        return shm
    return ipc if gpu.get("kind") == "cuda_ipc" and ipc is not None else tcp
