"""Transports: how bytes of an exposed region move from a holder to a reader.

`ReadServer` serves a worker's exposed regions; `ShmTransport`, `TcpTransport` (and,
on GPUs, CUDA IPC and NVSHMEM) read them; `TransportSelector` owns a worker's
transports and picks one per source region (`choose_transport`).
"""

from __future__ import annotations

from weightfabric.fabric.errors import ReadRefusedError, SourceLostError, TransportError
from weightfabric.fabric.transports.base import (
    ReadAbort,
    RegionInfo,
    SourceAddress,
    Transport,
    local_host_id,
)
from weightfabric.fabric.transports.selector import TransportSelector, choose_transport
from weightfabric.fabric.transports.server import ReadServer
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.fabric.transports.tcp import TcpTransport

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
    "TransportSelector",
    "choose_transport",
    "local_host_id",
]
