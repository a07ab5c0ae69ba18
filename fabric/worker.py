"""`Worker`: one process taking part in the fabric with data.

A worker is a registered hub client plus the data plane: a `ReadServer` that
serves its exposed replicas, a `TransportSelector` with the transports to read
from peers, and its model stores, each given those three collaborators (a store
never reaches back into its worker). Create one with `fabric.join`; get a model's
store with `Worker.model`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weightfabric.fabric.arena import remove_stale_regions
from weightfabric.fabric.auth import CapabilityCheck
from weightfabric.fabric.buffer_pool import PREPARED_BUFFERS
from weightfabric.fabric.checks import check_model_name
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.errors import FabricError
from weightfabric.fabric.fetch import Source
from weightfabric.fabric.locality import Location
from weightfabric.fabric.store import ModelStore, resolve_device
from weightfabric.fabric.tensorset import DEFAULT_CHUNK_SIZE
from weightfabric.fabric.transports import ReadServer, Transport, TransportSelector
from weightfabric.fabric.transports.nixl import NIXL_KV_PREFIX, NixlEngine, nixl_missing
from weightfabric.fabric.transports.server import STALL_TIMEOUT
from weightfabric.fabric.transports.tls import TlsConfig, use_for_reads

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime
    from weightfabric.fabric.metrics import WorkerMetrics
    from weightfabric.fabric.relayout.replica import LayoutStore
    from weightfabric.fabric.relayout.rules import EngineLayout

log = logging.getLogger(__name__)


class Worker:
    """A process that publishes and/or fetches versions. See `fabric.join`."""

    def __init__(self, url: str, *, worker: str,
                 location: Location | dict[str, str] | None = None, host: str = "127.0.0.1",
                 timeout: float = 10.0, heartbeat: bool = True,
                 nvshmem: NvshmemRuntime | None = None,
                 stall_timeout: float = STALL_TIMEOUT, secret: str | None = None,
                 secret_file: str | Path | None = None, insecure: bool = False,
                 tls: TlsConfig | None = None, nixl: bool | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> None:
        if metrics_port is not None:  # before anything starts: a missing package says so
            from weightfabric.fabric.metrics import require

            require()
        removed = remove_stale_regions()
        if removed:
            log.info("removed %d arena files of dead workers", len(removed))
        self.nixl = self._nixl_engine(worker, nixl if tls is None or nixl else False)
        """This worker's NIXL agent (`fabric.transports.nixl`), or None."""
        self.server = ReadServer(host=host, stall_timeout=stall_timeout, tls=tls,
                                 nixl=self.nixl)
        if tls is not None:
            use_for_reads(tls)
        try:
            self.hub = HubClient(url, worker=worker, location=location,
                                 endpoints={"read": self.server.address.to_dict()},
                                 timeout=timeout, heartbeat=heartbeat, secret=secret,
                                 secret_file=secret_file, insecure=insecure).open()
        except BaseException:
            self.server.close()
            raise
        if self.hub.credential is not None:  # set before any store exposes a region here
            self.server.capabilities = CapabilityCheck(self.hub.credential.serve_key)
        self.name = worker
        self.location = self.hub.location
        self.nvshmem = nvshmem
        """The NVSHMEM job this worker's process is a PE of, or None."""
        self.transports = TransportSelector(timeout=timeout, nvshmem=nvshmem, nixl=self.nixl)
        """Picks the transport for each source this worker's stores read."""
        self._stores: dict[str, ModelStore] = {}
        self.hub.on_quarantine = self._quarantine
        self._lock = threading.Lock()
        self._closed = False
        self.metrics: WorkerMetrics | None = None
        """The Prometheus exporter, with a ``metrics_port`` (`fabric.metrics`)."""
        if metrics_port is not None:
            from weightfabric.fabric.metrics import WorkerMetrics

            try:
                self.metrics = WorkerMetrics(self, metrics_port, metrics_host)
            except BaseException:
                self.close()
                raise

    def _nixl_engine(self, worker: str, wanted: bool | None) -> NixlEngine | None:
        """The worker's NIXL engine: by default when the ``rdma`` extra is installed.

        ``wanted`` False: none; True: one, or `FabricError` saying why not.
        """
        missing = ("turned off (join(..., nixl=False))" if wanted is False
                   else nixl_missing(wanted))
        if missing is not None:
            if wanted:
                raise FabricError(f"worker {worker!r}: no NIXL: {missing}")
            log.debug("worker %s reads across hosts over tcp: no NIXL: %s", worker, missing)
            return None
        return NixlEngine(worker, publish=lambda agent, meta: self.hub.kv_put(
            f"{NIXL_KV_PREFIX}{agent}", meta), lookup=lambda agent: self.hub.kv_get(
            f"{NIXL_KV_PREFIX}{agent}", timeout=0))

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
            BadRequestError: a name no read server can expose (empty, too long, not
                UTF-8): refused before the hub is asked anything.
            ValueError: bad arguments, ``symmetric`` without an NVSHMEM job or a GPU, or
                the model is already open with other arguments.
        """
        check_model_name(name, shard)
        if symmetric and self.nvshmem is None:
            raise ValueError(f"model {name!r}: symmetric=True needs a worker in an NVSHMEM job "
                             "(fabric.join(..., nvshmem=NvshmemRuntime.start(...)))")
        if symmetric and resolve_device(device).type != "cuda":
            raise ValueError(f"model {name!r}: symmetric memory is GPU memory; pass a CUDA device")
        with self._lock:
            store = self._stores.get(name)
            if store is None or store.closed:
                store = self._stores[name] = ModelStore(
                    name, hub=self.hub, server=self.server, transports=self.transports,
                    chunk_size=chunk_size, device=device, shard=shard,
                    num_shards=num_shards, prepare_spare=prepare_spare,
                    nvshmem=self.nvshmem if symmetric else None, buffers=buffers)
                if self.metrics is not None:
                    store.on_fetched = self.metrics.fetched
            elif (store.chunk_size, store.device, store.shard, store.num_shards,
                  store.nvshmem is not None) != (chunk_size, resolve_device(device), shard,
                                                 num_shards, symmetric):
                raise ValueError(f"model {name!r} is already open with chunk_size "
                                 f"{store.chunk_size} on {store.device} as shard {store.shard} "
                                 f"of {store.num_shards} (symmetric={store.nvshmem is not None}), "
                                 f"not {chunk_size} on {device} as shard {shard} of {num_shards} "
                                 f"(symmetric={symmetric})")
            return store

    def layout_model(self, name: str, layout: EngineLayout, *, rank: int,
                     device: torch.device | str = "cpu", **options: Any) -> LayoutStore:
        """Model ``name`` in an inference engine's layout, for engine rank ``rank``.

        The reader's versions are derived from the published ones by ``layout`` (fused,
        split over the engine's ranks, cast or quantised), and kept as replicas that
        later readers of the same layout and rank copy (`fabric.relayout.replica`)::

            layout = vllm_layout(config, tp=2)
            store = worker.layout_model("policy", layout, rank=tp_rank, device="cuda")
            store.sync(timeout=600)            # the newest version, in the engine's layout
            engine_params = store.tensors

        Args:
            options: more `LayoutStore` arguments (``budget``, ``derive_wait``, ...).

        Raises:
            LayoutError: ``rank`` is not a rank of the layout.
        """
        from weightfabric.fabric.relayout.replica import LayoutStore

        return LayoutStore(self, name, layout, rank=rank, device=device, **options)

    def transport_for(self, source: Source, *, symmetric: bool = False,
                      timeout: float | None = None) -> Transport:
        """The transport for a source's region.

        `TransportSelector.transport_for` of this worker's `transports`.
        """
        return self.transports.transport_for(source, symmetric=symmetric, timeout=timeout)

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics`` with a ``metrics_port``, else ``""``."""
        return self.metrics.url if self.metrics is not None else ""

    @property
    def bytes_served(self) -> int:
        """Bytes this worker has served to readers (its egress)."""
        return self.server.bytes_served

    def _quarantine(self, model: str, version: int, shard: int) -> None:
        """A reader found this worker's replica of ``model`` v``version`` corrupt."""
        store = self._stores.get(model)
        if store is not None and not store.closed and store.shard == shard:
            store.quarantine(version)

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
        self.transports.close()
        if self.nixl is not None:
            self.nixl.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join(url: str, *, worker: str, location: Location | dict[str, str] | None = None,
         host: str = "127.0.0.1", timeout: float = 10.0,
         nvshmem: NvshmemRuntime | None = None,
         stall_timeout: float = STALL_TIMEOUT, secret: str | None = None,
         secret_file: str | Path | None = None, insecure: bool = False,
         tls: TlsConfig | None = None, nixl: bool | None = None,
         metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> Worker:
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
        secret, secret_file, insecure: the credential this worker signs its hub requests
            with (`fabric.connect`); its read server then serves only readers holding a
            capability the hub issued (``insecure``: anyone).
        tls: serve over mutual TLS with this certificate, and read from TLS holders with
            it (`TlsConfig`: cert, key and the cluster CA's certificate, PEM). For links
            that cross untrusted networks; it costs throughput (docs/security.md).
        nixl: read from holders on other hosts with NIXL READs (`fabric.transports.nixl`).
            None (default): when the ``rdma`` extra is installed, the host has an RDMA
            device (or ``WEIGHTFABRIC_NIXL=1``), ``WEIGHTFABRIC_NIXL`` is not 0 and there
            is no ``tls`` (NIXL's transfers are not encrypted); False: never (this
            worker's memory is not registered either: peers read it over TCP); True:
            whenever it is installed, or `FabricError` saying why it cannot.
        metrics_port: serve this worker's Prometheus metrics on this HTTP port (0: the OS
            picks; read ``worker.metrics_url``) until `Worker.close` (`fabric.metrics`; the
            ``metrics`` extra). None (default): none.
        metrics_host: the address the metrics are served on (default loopback).

    Raises:
        HubUnavailableError: no hub answers at `url`.
        DuplicateWorkerError: another live worker uses this id.
        AuthenticationError: no usable credential, or the hub refused it.
        ImportError: ``metrics_port`` without ``prometheus-client`` installed.
        OSError: ``metrics_port`` is taken.

    Example:
        >>> worker = fabric.join(url, worker="rollout-3")    # doctest: +SKIP
        >>> store = worker.model("policy")                   # doctest: +SKIP
        >>> store.attach(model); store.fetch("latest")       # doctest: +SKIP
    """
    return Worker(url, worker=worker, location=location, host=host, timeout=timeout,
                  nvshmem=nvshmem, stall_timeout=stall_timeout, secret=secret,
                  secret_file=secret_file, insecure=insecure, tls=tls, nixl=nixl,
                  metrics_port=metrics_port, metrics_host=metrics_host)
