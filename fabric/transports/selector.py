"""`TransportSelector`: which transport reads a source's region, for one worker.

`choose_transport` picks, in this order of preference:

1. ``nvshmem`` when the region is in the symmetric memory of the reader's NVSHMEM
   job (on any host; `fabric.transports.nvshmem`);
2. for a source on this host (same host id): ``cuda_ipc`` when the region is GPU
   memory exported over CUDA IPC on a GPU this process sees, ``shm`` when it is host
   memory, else ``tcp`` (the holder copies GPU bytes to the host);
3. for a source on another host: ``nixl`` when both sides run a NIXL agent
   (`fabric.transports.nixl`: the ``rdma`` extra, not turned off with
   ``WEIGHTFABRIC_NIXL=0`` or ``join(..., nixl=False)`` on either side), else ``tcp``.

`TransportSelector` owns a worker's transports, remembers per region what its holder
said the region is (the descriptor cache), and logs the transport it picks for each
source the first time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from weightfabric.fabric.gpu.probe import normalise_uuid
from weightfabric.fabric.transports.base import SourceAddress, Transport, local_host_id
from weightfabric.fabric.transports.nixl import NixlEngine, NixlTransport
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.fabric.transports.tcp import TcpTransport

if TYPE_CHECKING:
    from weightfabric.fabric.fetch import Source
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime

log = logging.getLogger(__name__)

MAX_DESCRIPTORS = 1024
"""Regions whose kind (host or GPU memory) a selector remembers, newest first."""


def choose_transport(source: SourceAddress, *, shm: Transport, tcp: Transport,
                     gpu: dict[str, Any] | None = None, ipc: Transport | None = None,
                     nvshmem: Transport | None = None, nixl: Transport | None = None
                     ) -> Transport:
    """The transport to read a region of `source` with.

    Args:
        source: where the holder's read server runs.
        shm, tcp: the reader's transports.
        gpu: the region's ``gpu`` descriptor (`RegionInfo.gpu`); None for host memory.
        ipc: a `CudaIpcTransport` when this process can map the descriptor's GPU.
        nvshmem: an `NvshmemTransport` when the descriptor names symmetric memory of
            this process's NVSHMEM job and the destination is symmetric too.
        nixl: a `NixlTransport` when this process runs a NIXL agent.
    """
    if gpu is not None and gpu.get("kind") == "nvshmem" and nvshmem is not None:
        return nvshmem
    if source.host_id != local_host_id():
        return nixl if nixl is not None and source.nixl else tcp
    if gpu is None:
        return shm
    return ipc if gpu.get("kind") == "cuda_ipc" and ipc is not None else tcp


class TransportSelector:
    """A worker's transports, and the choice among them per source region.

    Args:
        timeout: seconds to wait for a holder's answer to "is this region in GPU
            memory?" when a call gives none.
        nvshmem: the NVSHMEM job this process is a PE of, or None.
    """

    def __init__(self, *, timeout: float = 10.0, nvshmem: NvshmemRuntime | None = None,
                 nixl: NixlEngine | None = None) -> None:
        self.timeout = timeout
        self.nvshmem = nvshmem
        self.shm = ShmTransport()
        self.tcp = TcpTransport()
        self.nixl = NixlTransport(nixl) if nixl is not None else None
        """Reads over NIXL, when this worker runs an agent."""
        self._told: set[tuple[str, int, str]] = set()  # (host, port, transport) logged
        self._ipc: Transport | None = None
        self._nvshmem: Transport | None = None
        self._descriptors: OrderedDict[tuple[str, int, str], dict[str, Any] | None] = OrderedDict()
        self._lock = threading.Lock()

    def transport_for(self, source: Source, *, symmetric: bool = False,
                      timeout: float | None = None) -> Transport:
        """The transport for a source's region (see `choose_transport`).

        On this host it asks the source once whether the region is in GPU memory, and
        remembers.

        Args:
            symmetric: the destination is this PE's symmetric memory, so a region in
                the symmetric memory of this process's NVSHMEM job is read one-sidedly,
                on any host (the source is then asked on every host).
            timeout: seconds to wait for the source's answer (a fetch passes its read
                timeout); default: `timeout`.

        Raises:
            TransportError: the source could not be asked.
        """
        gpu = None
        symmetric = symmetric and self.nvshmem is not None
        if symmetric or source.address.host_id == local_host_id():
            gpu = self._descriptor(source, self.timeout if timeout is None else timeout)
        chosen = choose_transport(source.address, shm=self.shm, tcp=self.tcp, gpu=gpu,
                                  ipc=self._ipc_for(gpu),
                                  nvshmem=self._nvshmem_for(gpu) if symmetric else None,
                                  nixl=self.nixl)
        why = None
        if chosen is self.nixl and (why := self.nixl.reachable(source.address)) is not None:
            chosen = self.tcp  # its agent is unknown here (no metadata at the hub): tcp
        said = (source.address.host, source.address.port, chosen.name)
        if said not in self._told:
            self._told.add(said)
            log.info("reading from %s (%s:%d) over %s%s", source.worker, *said,
                     f" ({why})" if why else "")
        return chosen

    def _descriptor(self, source: Source, timeout: float) -> dict[str, Any] | None:
        """The region's ``gpu`` descriptor, asked of its holder once (None: host memory)."""
        key = (source.address.host, source.address.port, source.region)
        with self._lock:
            if key in self._descriptors:
                return self._descriptors[key]
        gpu = self.shm.describe(source.address, source.region, timeout=timeout).gpu
        with self._lock:
            self._descriptors[key] = gpu
            while len(self._descriptors) > MAX_DESCRIPTORS:
                self._descriptors.popitem(last=False)
        return gpu

    def _nvshmem_for(self, gpu: dict[str, Any] | None) -> Transport | None:
        """An `NvshmemTransport` when ``gpu`` names symmetric memory of this process's job."""
        if (gpu is None or gpu.get("kind") != "nvshmem" or self.nvshmem is None
                or gpu.get("job") != self.nvshmem.session):
            return None
        from weightfabric.fabric.transports.nvshmem import NvshmemTransport

        with self._lock:
            if self._nvshmem is None:
                self._nvshmem = NvshmemTransport(self.nvshmem)
            return self._nvshmem

    def _ipc_for(self, gpu: dict[str, Any] | None) -> Transport | None:
        """A `CudaIpcTransport` when ``gpu`` is an IPC handle of a GPU this process sees."""
        if (gpu is None or gpu.get("kind") != "cuda_ipc" or gpu.get("pid") == os.getpid()
                or not torch.cuda.is_available()):
            return None  # (CUDA opens no handle in the process that exported it)
        from weightfabric.fabric.transports.cuda_ipc import CudaIpcTransport, visible_devices

        try:
            if normalise_uuid(gpu.get("device_uuid", "")) not in visible_devices():
                return None
        except ValueError:  # a malformed descriptor: read over TCP
            return None
        with self._lock:
            if self._ipc is None:
                self._ipc = CudaIpcTransport()
            return self._ipc

    def close(self) -> None:
        """Close every transport (connections, mappings)."""
        self.shm.close()
        self.tcp.close()
        for transport in (self._ipc, self._nvshmem, self.nixl):
            if transport is not None:
                transport.close()


__all__ = ["MAX_DESCRIPTORS", "TransportSelector", "choose_transport"]
