"""`ModelStore`: publish and fetch the versions of one model.

A store owns a few arena buffers, each the size of the model's tensor set. One is
*active*: the tensors the engine uses are views of it (after `attach`). A fetch
writes the next version into a spare buffer while the engine keeps using the
active one, exposing the spare as a partial replica so peers can read it as it
fills, then switches. A buffer that holds an older version is reused only after
the hub agrees to its retract (no reader in flight, retention respected).

Fresh shared memory is slow to write (each page is allocated, zeroed and mapped
by a fault: about 0.6-1 s of CPU per GB, against 0.06 s for the copy), so a new host buffer
populates its pages in a background thread (`Region.populate`); a fetch that
overtakes it populates each chunk's pages just before writing it, a publish
finishes the populate first (a trainer's `reserve` at start-up starts it before the
first publish). With ``prepare_spare`` (the default) the store
also creates the second buffer of its double buffer as soon as it holds one
(after `attach`, the first snapshot `publish` or the first `fetch`), so the next
version lands in memory that is already there. That spare costs the model's size
in /dev/shm from then on, instead of from the second version on; an in-place
publisher never needs it and frees it at its first ``publish(snapshot=False)``.
GPU stores prepare their spare the same way (no populate: GPU memory takes no page
faults), so no version allocates GPU memory or exports an IPC handle for it on its
critical path: a trainer's `reserve`, or a rollout's `attach`, makes the first buffers
(and the CUDA context) before the first version.

A store in NVSHMEM symmetric memory (``worker.model(name, device=..., symmetric=True)``
on a worker of an NVSHMEM job) allocates a fixed number of buffers in `attach`, a
collective: every PE of the job attaches a model of the same size, in the same
order of stores, and closes them in the same order. It never allocates or frees a
buffer in between; peers of the job read its versions one-sidedly.

A store is given its collaborators (`Worker.model` builds it): the worker's hub
client, its read server and its transport selector; it never reaches back into the
worker. Its buffers and their reuse rules are a `BufferPool`.

The class is composed of parts that each read on their own: `store_buffers` (the
buffers, spares, exposures and the versions held: `retract`, `release`), `store_publish`
(`publish`, `reserve`, `produce`, `wait_replicated`), `store_fetch` (`fetch`, `sync`,
`FetchFuture`), over the state they share (`store_state`); this module keeps the
constructor, the state, `attach` and `close`.

Trainer::

    store = worker.model("policy")
    v = store.publish(model)                  # snapshot: copy, expose, commit
    # or, with the weights already in the arena (store.attach(model) once):
    v = store.publish(snapshot=False, hold=True)  # expose in place; wait for a peer
    store.wait_replicated(v, replicas=1)      # before exiting: the last version lives on

Rollout::

    store.attach(model)                       # parameters move into the arena, once
    stats = store.sync(timeout=60)            # wait for a newer version, fetch it, switch
    future = store.fetch_async("latest")      # keep generating with the old version...
    stats = future.result()                   # ...switch when it suits you
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from weightfabric.fabric.buffer_pool import MAX_BUFFERS, PREPARED_BUFFERS, BufferPool
from weightfabric.fabric.checks import check_model_name
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.deltas import DeltaPolicy
from weightfabric.fabric.dtensors import is_dtensor
from weightfabric.fabric.errors import FabricError, ManifestMismatchError, TensorSetError
from weightfabric.fabric.manifest import ShardedTensor
from weightfabric.fabric.store_buffers import FAILED_DRAIN_S, StoreRegion
from weightfabric.fabric.store_buffers import IN_PLACE_DRAIN_S as IN_PLACE_DRAIN_S
from weightfabric.fabric.store_fetch import FetchFuture, StoreFetching
from weightfabric.fabric.store_fetch import fetch_newer as fetch_newer
from weightfabric.fabric.store_publish import Production as Production
from weightfabric.fabric.store_publish import StorePublishing
from weightfabric.fabric.store_state import log
from weightfabric.fabric.tensorset import check_chunk_size, prepare, views
from weightfabric.fabric.transports.selector import TransportSelector
from weightfabric.fabric.transports.server import ReadServer
from weightfabric.kernels import PackLayout

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime

__all__ = ["FAILED_DRAIN_S", "MAX_BUFFERS", "PREPARED_BUFFERS", "FetchFuture", "ModelStore",
           "StoreRegion", "resolve_device"]


class ModelStore(StorePublishing, StoreFetching):
    """Versions of one model as seen by one worker. Get it with `Worker.model`.

    Args:
        model: the model's name (checked up front: see `check_model_name`).
        hub: the worker's registered hub client.
        server: the worker's read server, which serves the versions exposed here.
        transports: the worker's transport selector, which picks how to read each source.
        chunk_size: bytes per chunk of the versions this store publishes.
        device: ``"cpu"`` or a CUDA device (see `resolve_device`).
        shard, num_shards: this store's shard of a model published by ``num_shards`` ranks.
        prepare_spare: keep a spare buffer ready (populated in host memory; module docstring).
        nvshmem: the NVSHMEM job whose symmetric heap holds the buffers, or None.
        buffers: with ``nvshmem``, the number of buffers `attach` allocates.

    Raises:
        BadRequestError: a model name no read server can expose.
        ValueError: a shard outside ``0..num_shards - 1``, or bad ``buffers``.
    """

    def __init__(self, model: str, *, hub: HubClient, server: ReadServer,
                 transports: TransportSelector, chunk_size: int,
                 device: torch.device | str = "cpu", shard: int = 0, num_shards: int = 1,
                 prepare_spare: bool = True, nvshmem: NvshmemRuntime | None = None,
                 buffers: int = PREPARED_BUFFERS) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"model {model!r}: shard {shard} outside 0..{num_shards - 1}")
        if nvshmem is not None and not 1 <= buffers <= MAX_BUFFERS:
            raise ValueError(f"model {model!r}: buffers must be 1..{MAX_BUFFERS}, got {buffers}")
        self.model = check_model_name(model, shard)
        self.hub = hub
        self.server = server
        self.transports = transports
        self.shard, self.num_shards = shard, num_shards
        self.chunk_size = check_chunk_size(chunk_size)
        self.device = resolve_device(device)
        self.nvshmem = nvshmem
        """The NVSHMEM job whose symmetric heap holds the buffers, or None."""
        self.buffers = buffers
        """With `nvshmem`: the number of buffers `attach` allocates, never more."""
        self.prepare_spare = prepare_spare and nvshmem is None
        """Keep a spare buffer ready for the next version, populated in host memory (see the
        module docstring); False allocates buffers only when a version needs one. A
        symmetric store never does: it allocates all of its buffers in `attach`."""
        self.layout: PackLayout | None = None
        self.aliases: dict[str, str] = {}
        """Alias -> published name: tensors of this store's versions that share a published
        tensor's bytes (tied weights), laid out once; `tensors` includes them."""
        self.sharding: tuple[ShardedTensor, ...] = ()
        """The tensors of this shard that are slices of larger logical ones (a DTensor
        publisher's `Shard(d)` tensors; a reader's last fetched manifest's)."""
        self.pool = BufferPool(model)
        """The store's buffers (read it; the store changes it under its lock)."""
        self._published: int | None = None  # the last version this store published
        self._attached: dict[str, torch.Tensor] | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"wf-fetch-{model}")
        self._cancel = threading.Event()  # set by `close`: the running fetch stops
        self._early_chunk_size = self.chunk_size
        """Chunks of the exposure made before `begin_fetch`: the last fetched version's."""
        self.delta_policy = DeltaPolicy()
        """When this store's fetches ask for deltas; it learns from their reads."""

    # --- state ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after `close`; `Worker.model` then opens a new store for the name."""
        return self._closed

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of the active version.

        name -> tensor of the active version (views of arena memory: read only while the
        version is exposed).
        """
        active = self.pool.active
        if active is None or self.layout is None:
            raise FabricError(f"model {self.model!r} holds no version yet: attach or fetch first")
        return views(self.layout, active.region.tensor, self.aliases)

    # --- attach / close ---------------------------------------------------------------

    def attach(self, obj: nn.Module | Mapping[str, torch.Tensor], *,
               normalize_names: bool = True) -> None:
        """Move a model's parameters and persistent buffers into arena memory, once.

        Afterwards the module's tensors are views of the active buffer: `fetch`
        switches them to each new version without a staging copy, and a trainer can
        `publish(snapshot=False)` them in place. Tied tensors (sharing storage) are laid
        out once and stay tied: both names view the same bytes.

        If the store already holds a version (fetched before attaching), the module
        takes that version's values.

        Args:
            obj: a module or name -> tensor.
            normalize_names: strip wrapper components from the names, as `publish` does
                (`tensorset.normalize_name`), so a wrapped and a plain module match.

        Raises:
            FabricError: already attached.
            ManifestMismatchError: the tensors do not fit the version the store holds.
            TensorSetError: not a module or a mapping of tensors on the store's device
                (or empty, an empty name, a meta tensor, two names equal once
                normalized, a DTensor).
        """
        tensors = self._named(obj, normalize_names)
        for name, t in tensors.items():
            if is_dtensor(t):
                raise TensorSetError(
                    f"tensor {name!r} is a DTensor: attach moves plain tensors into the arena; "
                    "publish a DTensor (FSDP2) model as a snapshot with publish(model), or "
                    "attach a module of plain tensors")
        prepared = prepare(self._on_device(tensors))
        with self._lock:
            if self._attached is not None:
                raise FabricError(f"model {self.model!r} is already attached to this worker")
            if self.layout is not None and (prepared.layout, dict(prepared.aliases)) != (
                    self.layout, self.aliases):
                raise ManifestMismatchError(
                    f"model {self.model!r}: the tensors to attach are laid out differently from "
                    f"v{self.version}, which this store holds (names, shapes, dtypes or tied "
                    "tensors differ)")
            self.layout, self.aliases = prepared.layout, dict(prepared.aliases)
            buffer = self.pool.active
            if buffer is None:  # keep the module's values; else it takes the version held
                buffer = self._allocate_symmetric() if self.nvshmem else self._ready(self._new_buffer())
                self._pack(prepared, buffer)
            self._attached = tensors
            self._activate(buffer)

    def close(self, *, tell_hub: bool = True) -> None:
        """Stop serving every version of this model and free the buffers.

        Stop serving every version of this model and free the buffers (stopping any
        background populate first).

        The hub is told first that this worker holds nothing of the model any more
        (`HubClient.drop`, retention not consulted: the memory is going away), so it
        sends readers elsewhere and ``latest`` names only versions someone still
        serves; `Worker.close`, which unregisters the whole worker, passes
        ``tell_hub=False``. A hub that does not answer is logged, not raised. Symmetric
        buffers are freed collectively: every PE closes its stores in the same order.
        A fetch already running is cancelled: one reading stops within a fraction of a
        second (`fabric.fetch.WAIT_SLICE`, plus `FAILED_DRAIN_S` for peers reading its
        partial replica) and its `result` raises `FetchError`; one still setting up
        (a hub call, or up to 5 s for a buffer a peer is still reading) ends that step
        first. Queued ones are cancelled too, and their futures' `result` (like that
        of any fetch not switched to yet) raises `FabricError`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True  # under the lock: no fetch_async submits after this
        self._cancel.set()
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if tell_hub and any(b.version is not None or b.exposed for b in self.pool.buffers):
                try:
                    self.hub.drop(self.model)
                except Exception as exc:  # the hub may be gone; the lease then runs out
                    log.warning("%s: could not tell the hub this worker drops it: %s",
                                self.model, exc)
            for buffer in self.pool.clear():
                if buffer.exposed:
                    self.server.retract(buffer.exposed, timeout=5.0)
                self._forget(buffer)
                buffer.region.close()


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a store keeps it: ``cpu`` or ``cuda:N`` (``cuda`` is the current GPU).

    Raises:
        ValueError: another device type, or CUDA asked for where it is not usable.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from weightfabric.fabric.gpu.probe import probe

        raise ValueError(f"a store on {device} needs a GPU: {probe().missing('cuda')}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"model stores live on cpu or cuda, not {device}")
    return device
