"""`Worker`: one process taking part in the fabric with data.

A worker is a registered hub client plus the data plane: a `ReadServer` that
serves its exposed replicas, shared-memory and TCP transports to read from
peers, and the arena regions its model stores allocate. Create one with
`fabric.join`; get a model's store with `Worker.model`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from weightfabric.fabric.arena import remove_stale_regions
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.fetch import Source
from weightfabric.fabric.gpu.probe import normalise_uuid
from weightfabric.fabric.locality import Location
from weightfabric.fabric.store import PREPARED_BUFFERS, ModelStore, resolve_device
from weightfabric.fabric.tensorset import DEFAULT_CHUNK_SIZE
from weightfabric.fabric.transports import (
    ReadServer,
    ShmTransport,
    TcpTransport,
    Transport,
    choose_transport,
    local_host_id,
)
from weightfabric.fabric.transports.server import STALL_TIMEOUT

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime

log = logging.getLogger(__name__)

MAX_DESCRIPTORS = 1024  # regions whose kind (host or GPU memory) a worker remembers


class Worker:
    """A process that publishes and/or fetches versions. See `fabric.join`."""

    def __init__(self, url: str, *, worker: str,
                 location: Location | dict[str, str] | None = None, host: str = "127.0.0.1",
                 timeout: float = 10.0, heartbeat: bool = True,
                 nvshmem: NvshmemRuntime | None = None,
                 stall_timeout: float = STALL_TIMEOUT) -> None:
        removed = remove_stale_regions()
        if removed:
            log.info("removed %d arena files of dead workers", len(removed))
        self.server = ReadServer(host=host, stall_timeout=stall_timeout)
        try:
            self.hub = HubClient(url, worker=worker, location=location,
                                 endpoints={"read": self.server.address.to_dict()},
                                 timeout=timeout, heartbeat=heartbeat).open()
        except BaseException:
            self.server.close()
            raise
        self.name = worker
        self.location = self.hub.location
        self._shm = ShmTransport()
        self._tcp = TcpTransport()
        self._ipc: Transport | None = None
        self.nvshmem = nvshmem
        """The NVSHMEM job this worker's process is a PE of, or None."""
        self._nvshmem: Transport | None = None
        self._timeout = timeout
        self._gpu_descriptors: OrderedDict[tuple[str, int, str], dict[str, Any] | None] = OrderedDict()
        self._stores: dict[str, ModelStore] = {}
        self._lock = threading.Lock()
        self._closed = False

    def model(self, name: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
              device: torch.device | str = "cpu", shard: int = 0,
              num_shards: int = 1, prepare_spare: bool = True, symmetric: bool = False,
              buffers: int = PREPARED_BUFFERS) -> ModelStore:
        """The store of model `name` (created once per worker, and again after its `close`).

        Args:
            chunk_size: bytes per chunk of the versions this worker publishes.
            device: where the store keeps the weights: ``"cpu"`` (shared-memory
                arenas) or a CUDA device (GPU buffers; peers on this node copy them
                over CUDA IPC, others read over TCP).
            shard, num_shards: this worker's shard of a model published by
                ``num_shards`` model-parallel ranks (each publishes and fetches its own;
                readers with another layout use `fabric.relayout.reader`).
            prepare_spare: keep a populated spare buffer ready for the next version
                (`ModelStore.prepare_spare`; costs the model's size in /dev/shm).
            symmetric: keep the buffers in the NVSHMEM symmetric heap of this worker's
                job (``fabric.join(..., nvshmem=runtime)``, a CUDA ``device``), so PEs of
                the job read them one-sidedly. `ModelStore.attach` then allocates
                ``buffers`` buffers collectively: every PE opens the same symmetric
                stores and attaches same-sized models in the same order.
            buffers: with ``symmetric``, how many buffers attach allocates (the
                active version plus spares; a fetch needs one not held for readers).

        Raises:
            ValueError: bad arguments, ``symmetric`` without an NVSHMEM job or a GPU, or
                the model is already open with other arguments.
        """
        if symmetric and self.nvshmem is None:
            raise ValueError(f"model {name!r}: symmetric=True needs a worker in an NVSHMEM job "
                             "(fabric.join(..., nvshmem=NvshmemRuntime.start(...)))")
        if symmetric and resolve_device(device).type != "cuda":
            raise ValueError(f"model {name!r}: symmetric memory is GPU memory; pass a CUDA device")
        with self._lock:
            store = self._stores.get(name)
            if store is None or store.closed:
                store = self._stores[name] = ModelStore(
                    self, name, chunk_size=chunk_size, device=device, shard=shard,
                    num_shards=num_shards, prepare_spare=prepare_spare,
                    nvshmem=self.nvshmem if symmetric else None, buffers=buffers)
            elif (store.chunk_size, store.device, store.shard, store.num_shards,
                  store.nvshmem is not None) != (chunk_size, resolve_device(device), shard,
                                                 num_shards, symmetric):
                raise ValueError(f"model {name!r} is already open with chunk_size "
                                 f"{store.chunk_size} on {store.device} as shard {store.shard} "
                                 f"of {store.num_shards} (symmetric={store.nvshmem is not None}), "
                                 f"not {chunk_size} on {device} as shard {shard} of {num_shards} "
                                 f"(symmetric={symmetric})")
            return store

    def transport_for(self, source: Source, *, symmetric: bool = False,
                      timeout: float | None = None) -> Transport:
        """The transport for a source's region (see `choose_transport`): on this host it
        asks the source once whether the region is in GPU memory.

        Args:
            symmetric: the destination is this PE's symmetric memory, so a region in
                the symmetric memory of this worker's NVSHMEM job is read one-sidedly,
                on any host (the source is then asked on every host).
            timeout: seconds to wait for the source's answer (a fetch passes its read
                timeout); default: the hub call timeout given to `join`.

        Raises:
            TransportError: the source could not be asked.
        """
        gpu = None
        symmetric = symmetric and self.nvshmem is not None
        if symmetric or source.address.host_id == local_host_id():
            key = (source.address.host, source.address.port, source.region)
            with self._lock:
                known = key in self._gpu_descriptors
                gpu = self._gpu_descriptors.get(key)
            if not known:
                gpu = self._shm.describe(source.address, source.region,
                                         timeout=self._timeout if timeout is None else timeout).gpu
                with self._lock:
                    self._gpu_descriptors[key] = gpu
                    while len(self._gpu_descriptors) > MAX_DESCRIPTORS:
                        self._gpu_descriptors.popitem(last=False)
        return choose_transport(source.address, shm=self._shm, tcp=self._tcp, gpu=gpu,
                                ipc=self._ipc_for(gpu),
                                nvshmem=self._nvshmem_for(gpu) if symmetric else None)

    def _nvshmem_for(self, gpu: dict[str, Any] | None) -> Transport | None:
        """An `NvshmemTransport` when ``gpu`` names symmetric memory of this worker's job."""
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

    @property
    def bytes_served(self) -> int:
        """Bytes this worker has served to readers (its egress)."""
        return self.server.bytes_served

    def close(self) -> None:
        """Leave the fabric: stop serving, unregister, free arena memory."""
        if self._closed:
            return
        self._closed = True
        try:  # first, so the hub stops routing readers here
            self.hub.unregister()
        except Exception as exc:  # the hub may be gone; our lease then simply runs out
            log.warning("worker %s could not unregister: %s", self.name, exc)
        for store in list(self._stores.values()):
            store.close(tell_hub=False)  # waits for reads already in flight
        self.hub.close()
        self.server.close()
        self._shm.close()
        self._tcp.close()
        for transport in (self._ipc, self._nvshmem):
            if transport is not None:
                transport.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join(url: str, *, worker: str, location: Location | dict[str, str] | None = None,
         host: str = "127.0.0.1", timeout: float = 10.0,
         nvshmem: NvshmemRuntime | None = None,
         stall_timeout: float = STALL_TIMEOUT) -> Worker:
    """Join the fabric at hub `url` as `worker`, ready to publish and fetch.

    Args:
        url: the hub, e.g. ``tcp://10.0.0.1:7470`` (see `fabric hub serve`).
        worker: a unique id, e.g. ``"rollout-3"``.
        location: ``{"datacenter", "node", "device"}`` used to rank sources.
        host: the address this worker's read server listens on (peers on other
            hosts must reach it).
        timeout: per hub call.
        nvshmem: this process's started `fabric.gpu.NvshmemRuntime`, when it is a PE
            of an NVSHMEM job: its symmetric stores (``model(..., symmetric=True)``)
            are read one-sidedly by the job's other PEs.
        stall_timeout: seconds a partial replica here may receive no chunk before
            peers waiting on it are told it stalled (they read elsewhere instead of
            waiting out their ``read_timeout``). Raise it when this worker's own
            reads are slower than that per ``FetchOptions.read_bytes``;
            ``float("inf")`` turns it off.

    Raises:
        HubUnavailableError: no hub answers at `url`.
        DuplicateWorkerError: another live worker uses this id.

    Example:
        >>> worker = fabric.join(url, worker="rollout-3")    # doctest: +SKIP
        >>> store = worker.model("policy")                   # doctest: +SKIP
        >>> store.attach(model); store.fetch("latest")       # doctest: +SKIP
    """
    return Worker(url, worker=worker, location=location, host=host, timeout=timeout,
                  nvshmem=nvshmem, stall_timeout=stall_timeout)
