"""Transports: how bytes of an exposed region move from a holder to a reader.

Preference order for a source: ``shm`` when it runs on this host (same host id),
else ``tcp``. GPU transports (``cuda_ipc``, ``nvshmem``) join this list with the
GPU data plane.
"""

from __future__ import annotations

import logging

from fabric.errors import ReadRefusedError, SourceLostError, TransportError
from fabric.transports.base import RegionInfo, SourceAddress, Transport, local_host_id
from fabric.transports.server import ReadServer
from fabric.transports.shm import ShmTransport
from fabric.transports.tcp import TcpTransport

log = logging.getLogger(__name__)

__all__ = [
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


def choose_transport(source: SourceAddress, *, shm: ShmTransport, tcp: TcpTransport) -> Transport:
    """The transport to read from `source`: shared memory on the same host, else TCP."""
    return shm if source.host_id == local_host_id() else tcp
