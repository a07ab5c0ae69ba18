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
GPU stores neither populate nor prepare (GPU memory takes no page faults).

A store in NVSHMEM symmetric memory (``worker.model(name, device=..., symmetric=True)``
on a worker of an NVSHMEM job) allocates a fixed number of buffers in `attach`, a
collective: every PE of the job attaches a model of the same size, in the same
order of stores, and closes them in the same order. It never allocates or frees a
buffer in between; peers of the job read its versions one-sidedly.

A store is given its collaborators (`Worker.model` builds it): the worker's hub
client, its read server and its transport selector; it never reaches back into the
worker. Its buffers and their reuse rules are a `BufferPool`.

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

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from weightfabric.fabric.arena import Region
from weightfabric.fabric.buffer_pool import MAX_BUFFERS, PREPARED_BUFFERS, Buffer, BufferPool
from weightfabric.fabric.checks import check_model_name, check_version
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.deltas import DeltaBase, DeltaPolicy, delta_mode, word_width
from weightfabric.fabric.dtensors import is_dtensor, local_shards
from weightfabric.fabric.errors import (
    ArenaError,
    BadRequestError,
    FabricError,
    ManifestMismatchError,
    NoSourceError,
    ReplicationTimeoutError,
    RetentionError,
    TensorSetError,
    UnknownVersionError,
)
from weightfabric.fabric.fetch import (
    FetchError,
    FetchOptions,
    FetchStats,
    fetch_chunks,
    verify_rule,
)
from weightfabric.fabric.fetch_planner import HubPlanner
from weightfabric.fabric.gpu.region import DeviceRegion, SymmetricBuffer
from weightfabric.fabric.manifest import Manifest, ShardedTensor
from weightfabric.fabric.progress import ChunkProgress, SlotMarks
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.tensorset import (
    PreparedSet,
    check_chunk_size,
    check_compatible,
    check_has_data,
    layout_from_manifest,
    manifest_of,
    named_tensors,
    normalize_names,
    prepare,
    views,
)
from weightfabric.fabric.transports.selector import TransportSelector
from weightfabric.fabric.transports.server import Exposure, ReadServer
from weightfabric.kernels import (
    PackLayout,
    chunk_checksums,
    copy_with_checksums,
    pack,
    pack_with_checksums,
)
from weightfabric.kernels.checksum import ChunkSums

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime

log = logging.getLogger(__name__)

__all__ = ["FAILED_DRAIN_S", "MAX_BUFFERS", "PREPARED_BUFFERS", "FetchFuture", "ModelStore",
           "StoreRegion", "resolve_device"]

StoreRegion = Region | DeviceRegion | SymmetricBuffer
"""The memory of a store's buffer: a shared-memory file, a GPU allocation, or symmetric memory."""

IN_PLACE_DRAIN_S = 30.0
"""Seconds an in-place fetch waits for peers' reads of the version it overwrites."""
FAILED_DRAIN_S = 0.5
"""Seconds a failed fetch waits for peers' reads of its partial replica before it raises
(and a fetch for its early exposure in other chunks than the publisher's); a buffer
still being read stays exposed, and is not reused, until they end."""


_Stats = TypeVar("_Stats", bound=FetchStats)


def fetch_newer(hub: HubClient, model: str, held: Callable[[], int | None], timeout: float,
                fetch: Callable[[int], _Stats]) -> _Stats:
    """Wait for a version of ``model`` newer than ``held()`` and ``fetch`` it (`sync`'s loop).

    A version retired between the wait and the fetch (newer ones were committed meanwhile
    and retention dropped it) is followed by the newest one instead.

    Raises:
        WaitTimeoutError: none newer within ``timeout``; and what ``fetch`` raises.
    """
    end = time.monotonic() + timeout
    while True:
        newer = hub.wait_version(model, after=held() or 0,
                                 timeout=max(0.0, end - time.monotonic()))
        try:
            return fetch(newer)
        except UnknownVersionError:
            latest = hub.latest(model)
            if latest is None or latest <= newer or time.monotonic() >= end:
                raise


class FetchFuture:
    """A fetch running in the background.

    `result` switches the store to the new version (in the caller's thread, at a moment the
    caller chose).

    Once the bytes are in, the buffer holding them is reserved for this future: later
    fetches do not reuse it and `release` refuses it, until `result` switches to it or
    a newer version becomes active (a superseded future then no longer pins memory,
    and its `result` raises `FabricError` instead of switching back).
    """

    def __init__(self, store: ModelStore,
                 inner: Future[tuple[Buffer | None, FetchStats]]) -> None:
        self._store = store
        self._inner = inner
        self._switched = False

    def done(self) -> bool:
        """True when the bytes are in place (or the fetch failed)."""
        return self._inner.done()

    def result(self, timeout: float | None = None) -> FetchStats:
        """Wait for the bytes, switch the store's tensors to them, return the stats.

        Raises:
            FetchError, HubError, ManifestMismatchError: the fetch failed; the store
                still serves the previous version.
            FabricError: the store was closed (before the fetch started, or since), or
                a newer version became active first, so this one's buffer is no longer
                reserved (fetch it again).
            TimeoutError: `timeout` passed before the fetch ended.
        """
        try:
            buffer, stats = self._inner.result(timeout)
        except CancelledError:
            raise FabricError(f"model {self._store.model!r}: the store is closed; it was "
                              "closed before this fetch started (open another store)") from None
        if not self._switched:
            self._store._switch_to(buffer, stats.version)
            self._switched = True
        return stats


@dataclass(frozen=True)
class Production:
    """What `ModelStore.produce` hands its ``fill``: the tensors to write, and three hooks."""

    tensors: dict[str, torch.Tensor]
    """Name -> view of the buffer, in the store's layout."""
    done: Callable[[list[str]], None]
    """Call with the names of tensors that are final: peers may copy their chunks now."""
    place: Callable[[torch.Tensor, torch.Tensor], None]
    """``place(dst, src)``: copy ``src`` into ``dst`` (uint8, a contiguous run of the
    tensors' bytes), checksumming the bytes on the way where it can (CPU). ``src``: the
    same bytes, 1-D, or as 2-D uint8 rows that land end to end (`ChunkSums.copy`)."""
    written: Callable[[torch.Tensor], None]
    """Call with a contiguous run of the tensors' bytes that is final (finer than
    ``done``; a tensor outside the buffer is ignored)."""


class ModelStore:
    """Versions of one model as seen by one worker. Get it with `Worker.model`.

    Args:
        model: the model's name (checked up front: see `check_model_name`).
        hub: the worker's registered hub client.
        server: the worker's read server, which serves the versions exposed here.
        transports: the worker's transport selector, which picks how to read each source.
        chunk_size: bytes per chunk of the versions this store publishes.
        device: ``"cpu"`` or a CUDA device (see `resolve_device`).
        shard, num_shards: this store's shard of a model published by ``num_shards`` ranks.
        prepare_spare: keep a populated spare host buffer ready (module docstring).
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
        self.prepare_spare = prepare_spare and self.device.type == "cpu" and nvshmem is None
        """Keep a populated spare host buffer ready for the next version (see the module
        docstring); False allocates buffers only when a version needs one. GPU stores
        never prepare one: GPU memory has no page faults to hide."""
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
    def version(self) -> int | None:
        """The version the store's tensors hold now (None before the first one)."""
        active = self.pool.active
        return active.version if active else None

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

    # --- attach ----------------------------------------------------------------------

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

    def reserve(self, obj: nn.Module | Mapping[str, torch.Tensor], *,
                dtype: torch.dtype | None = None, normalize_names: bool = True) -> None:
        """Lay out ``obj`` and start populating the buffer its first snapshot will fill.

        A trainer calls this at start-up, so that its first ``publish(obj)`` copies into
        memory already faulted in (off the critical path, in the background) instead of
        paying for fresh pages then (about 0.5-1 s per GB of /dev/shm). Nothing is
        published or copied. Arguments as for `publish`; a later publish must lay its
        tensors out the same way. A GPU store only fixes the layout.

        Raises:
            FabricError, TensorSetError: as `publish` (another layout, bad tensors).
        """
        with self._lock:
            self._adopt(self._prepare(obj, dtype, normalize_names))
        self._prepare_spare()

    def wait_prepared(self, timeout: float = 60.0) -> bool:
        """Wait until the host buffers populating in the background are done.

        Returns whether they all are within ``timeout`` (True at once for a GPU store or
        one with nothing populating). Nothing needs this call; it tells start-up apart
        from the first version (e.g. in a benchmark), or keeps a first step off a CPU
        that is still faulting pages in.

        Raises:
            ArenaError: a background populate failed (e.g. /dev/shm is full).
        """
        end = time.monotonic() + timeout
        with self._lock:
            regions = [b.region for b in self.pool.buffers if isinstance(b.region, Region)]
        return all(r.wait_populated(timeout=max(0.0, end - time.monotonic())) for r in regions)

    # --- publish ---------------------------------------------------------------------

    def publish(self, obj: nn.Module | Mapping[str, torch.Tensor] | None = None, *,
                snapshot: bool = True, hold: bool = False, group: str | None = None,
                timeout: float = 120.0, dtype: torch.dtype | None = None,
                normalize_names: bool = True) -> int:
        """Publish a new version; returns its number.

        A publish that fails here after the hub assigned the number (the read server
        refused the region, the commit failed) aborts that version at the hub, which
        retires it at once, and raises.

        What is published:

        - names lose wrapper components (``_orig_mod.``, a leading ``module.``,
          ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``; see
          `tensorset.normalize_name`), unless ``normalize_names=False``;
        - tensors sharing storage (tied weights) are published once; the manifest lists
          the others as aliases (`Manifest.aliases`);
        - a DTensor (an FSDP2 module's parameters) on a 1-D mesh is published as this
          rank's local shard, without a copy but the pack: ``Shard(d)`` ones with a
          `ShardedTensor` in the manifest (`Manifest.sharding`), ``Replicate()`` ones
          whole. The store must be ``worker.model(name, shard=rank, num_shards=world)``,
          and every rank passes the same ``group``;
        - with ``dtype``, float32 / bfloat16 / float16 tensors are stored in ``dtype``
          (cast while packing; fp8 and integer tensors keep theirs). The store's layout
          holds the cast dtypes: later publishes must cast the same way.

        Args:
            obj: the tensors (a module or name -> tensor); default: the attached ones.
            snapshot: copy the tensors into a spare buffer, so the caller may change
                them at once. With False, expose the attached tensors in place: they
                must not change until `retract` (or `hold`) returns; the store then
                frees an unused spare and stops preparing one.
            hold: after committing, wait until another worker holds a complete replica
                (the model's ``min_replicas``), then retract this one, so training can
                go on (useful with ``snapshot=False``).
            group: with several shards (model-parallel publishers), a key every shard's
                publisher passes for this version (e.g. ``f"step-{step}"``); they get the
                same version number, committed once every shard is.
            timeout: bound on `hold`.
            dtype: store floating-point tensors in this dtype (float32, bfloat16 or
                float16); only with ``snapshot``.
            normalize_names: strip wrapper components from the names (the default).

        Raises:
            FabricError: in-place publish of tensors that are not attached (or with a
                ``dtype``), `hold` timed out (the version stays exposed), no ``group``
                with several shards, or a layout (names, shapes, dtypes, ties, slices)
                other than the store's.
            TensorSetError: not a module or mapping of tensors (or an empty one, an empty
                name, a meta tensor, a tensor on another device, two names equal once
                normalized), a DTensor that cannot be published or whose mesh does not
                match the store's shards, or a cast packing cannot do.
            HubError: the hub refused (e.g. unreachable).
        """
        if self.num_shards > 1 and group is None:
            raise FabricError(f"model {self.model!r} has {self.num_shards} shards: pass the same "
                              "publish group key from every shard's publisher")
        if dtype is not None and not snapshot:
            raise FabricError("publish(snapshot=False) exposes the attached tensors as they are; "
                              "dtype= casts into a copy: use snapshot=True")
        with self._lock:
            if snapshot:
                prepared = (self._prepare(obj, dtype, normalize_names) if obj is not None
                            else prepare(self._require_attached(), dtype=dtype))
                self._adopt(prepared)
                buffer = self._ready(self._spare_buffer())
                checksums = self._pack(prepared, buffer, self.chunk_size)
            else:
                self._check_in_place(obj, normalize_names)
                self._drop_spares()
                buffer = self._require_active()
                if buffer.exposed is not None:
                    raise FabricError(f"the attached tensors are still exposed as v{buffer.version};"
                                      " retract that version before publishing them again")
                checksums = None
            assert self.layout is not None
            manifest = manifest_of(self.layout, buffer.region.tensor, self.chunk_size,
                                   checksums=checksums, sharding=self.sharding,
                                   aliases=tuple(self.aliases.items()))
            version = self.hub.begin_publish(self.model, manifest, shard=self.shard,
                                             num_shards=self.num_shards, group=group)
            previous = buffer.version
            try:
                buffer.exposed = self._expose(
                    buffer, version, self.chunk_size,
                    self._progress(buffer, self.chunk_size, complete=True))
                buffer.version = version
                self.hub.commit(self.model, version)
            except BaseException as exc:
                self._abort_publish(buffer, version, previous, exc)
                raise
            self._published = version
            if snapshot and self._attached is None:
                self.pool.activate(buffer)
            if snapshot:
                self._prepare_spare()
            log.info("published %s v%d (%d bytes, %d chunks)", self.model, version,
                     manifest.total_bytes, manifest.num_chunks)
        if hold:
            state = self.retract(version, wait=timeout, delay=True)
            if state != "done":
                raise FabricError(f"{self.model!r} v{version}: no other replica within "
                                  f"{timeout:g} s (retract is {state}); it stays exposed")
        return version

    def _abort_publish(self, buffer: Buffer, version: int, previous: int | None,
                       exc: BaseException) -> None:
        """Undo a publish that failed after the hub assigned ``version``.

        Withdraw the exposure, give the buffer back its old state, and abort the version at
        the hub (which retires it), so no version stays ``publishing`` with nobody to commit
        it.
        """
        if buffer.exposed is not None:
            self._drained(buffer, FAILED_DRAIN_S)
        buffer.version = previous
        reason = f"{type(exc).__name__}: {exc}"[:200]
        _quietly(functools.partial(self.hub.abort_publish, reason=reason), self.model, version)

    def wait_replicated(self, version: int | None = None, *, replicas: int = 1,
                        timeout: float = 120.0) -> list[str]:
        """Block until ``replicas`` other live workers hold a complete ``version``.

        Block until ``replicas`` live workers other than this one hold a complete replica of
        ``version``; returns them.

        This is how a trainer ends without losing its last version: a version lives
        only as long as some live worker holds it, and a trainer that exits right after
        `publish` takes the only copy with it. Call it before leaving::

            version = store.publish(model)
            store.wait_replicated(version, replicas=1, timeout=300)
            worker.close()

        It asks the hub (`HubClient.locate`, read-only) every few tens of milliseconds,
        up to every 0.5 s; the replicas it counts are the ones the hub would send
        readers to.

        Args:
            version: the version; default: the last one this store published.
            replicas: how many other workers must hold it (``>= 1``).
            timeout: seconds to wait.

        Raises:
            BadRequestError: ``version`` is not an ``int > 0``, ``replicas`` is not an
                ``int >= 1``, or there is no version to default to.
            ReplicationTimeoutError: fewer holders than ``replicas`` within ``timeout``
                (also a `WaitTimeoutError`); the message names the holders seen.
            HubError: the hub could not be asked.
        """
        if version is None:
            version = self._published
            if version is None:
                raise BadRequestError(f"model {self.model!r}: this store published nothing; "
                                      "pass the version to wait for")
        if check_version(version) == "latest":
            raise BadRequestError("wait_replicated needs a version number, not 'latest'")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise BadRequestError(f"replicas must be an int >= 1, got {replicas!r}")
        end = time.monotonic() + timeout
        pause, seen, why = 0.02, [], "none yet"
        while True:
            try:
                where = self.hub.locate(self.model, version)
                holders = where["shards"][self.shard]["holders"]
                seen = [w for w in holders if w != self.hub.worker]
                why = f"holders: {', '.join(seen) or 'none but this worker'}"
            except (NoSourceError, UnknownVersionError) as exc:  # not committed or held yet
                seen, why = [], str(exc)
            if len(seen) >= replicas:
                return seen
            left = end - time.monotonic()
            if left <= 0:
                raise ReplicationTimeoutError(
                    f"{self.model!r} v{version}: {len(seen)} of {replicas} other replicas "
                    f"within {timeout:g} s ({why}); keep this worker alive until readers "
                    "fetched it, or raise the timeout")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    # --- fetch -----------------------------------------------------------------------

    def fetch(self, version: int | str = "latest", *, verify: bool | None = None,
              options: FetchOptions | None = None,
              on_chunk: Callable[[int, int], None] | None = None,
              in_place: bool = False) -> FetchStats:
        """Fetch a version and switch the store's tensors to it.

        Fetch a version and switch the store's tensors to it (a version the store still
        holds in another buffer, e.g. pinned, is switched to without a read).

        Args:
            version: an ``int > 0`` or ``"latest"``.
            verify: check every chunk's checksum (True or None, the default), or none
                (False: for those who measured and accept the risk).
            options: concurrency and time limits of the fetch engine.
            on_chunk: progress callback (chunks done, chunks total).
            in_place: write the version into the active buffer, the one the attached
                tensors are views of, instead of a spare: the store then holds one copy
                of the weights, not two. The engine must not use the tensors until the
                fetch returns (a paused engine, as in synchronous RL). The held version
                is retracted first, once the new one's fetch is planned (peers read it
                elsewhere: with every holder fetching in place, keep one version,
                ``worker.hub.set_retention(model, keep_last=1)``); if the fetch then
                fails, the tensors hold a mix and the store no version (`version` is
                None): fetch again. The store stops preparing spares and frees unused
                ones. Without an active buffer, as without it.

        Returns:
            FetchStats: bytes, seconds, GB/s, sources used, chunks re-read.

        Raises:
            BadRequestError: ``version`` is neither (nothing changes).
            UnknownModelError, UnknownVersionError: nothing to fetch.
            ManifestMismatchError: the version's tensors do not fit the attached ones.
            FetchError: some chunks could not be read from any source in time, or the
                store was closed meanwhile.
            FabricError: the store is closed, or every buffer holds a version readers
                still need (or, ``in_place``, peers still read the held one after
                `IN_PLACE_DRAIN_S`).
            RetentionError: ``in_place``, and the held version is retained with no
                other replica (nothing changed).
            ArenaError: no room in /dev/shm for a buffer.
        """
        return self.fetch_async(version, verify=verify, options=options,
                                on_chunk=on_chunk, in_place=in_place).result()

    def fetch_async(self, version: int | str = "latest", *, verify: bool | None = None,
                    options: FetchOptions | None = None,
                    on_chunk: Callable[[int, int], None] | None = None,
                    in_place: bool = False) -> FetchFuture:
        """Start `fetch` in the background.

        The store keeps its current version until the returned future's `result` is called
        (with ``in_place``, the tensors change as the bytes arrive: do not use them until
        then). The buffer the fetch fills stays reserved for the future until then, or until
        a newer version is active (see `FetchFuture`).

        Raises:
            BadRequestError: ``version`` is not an ``int > 0`` or ``"latest"``.
            FabricError: the store is closed (the fetch's own errors come from `result`).
        """
        version = check_version(version)
        return self.submit(functools.partial(self._fetch, version, verify,
                                             options or FetchOptions(), on_chunk, in_place))

    def submit(self, job: Callable[[], tuple[Buffer | None, FetchStats]]) -> FetchFuture:
        """Run ``job`` on the store's fetch thread; its future switches to the buffer it returns.

        The building block of `fetch_async` and of readers that make a version in other
        ways (`fabric.relayout.replica.LayoutStore`): ``job`` returns a buffer it reserved
        (``pending``) and filled, or None when the version is active already.

        Raises:
            FabricError: the store is closed.
        """
        with self._lock:
            self._check_open()
            inner = self._fetcher.submit(job)
        return FetchFuture(self, inner)

    def produce(self, version: int, fill: Callable[[Production], object],
                announce: Callable[[Manifest], object] | None, *,
                exposed: tuple[Buffer, ChunkProgress] | None = None) -> Buffer:
        """Make ``version`` here: fill a spare buffer, expose it whole, announce it.

        For versions computed rather than read (a derived layout): the spare buffer is
        exposed as a partial replica while ``fill`` writes its tensors (`Production`:
        views of the buffer in the store's layout; ``done`` tells peers which tensors are
        final, so they copy those chunks while the rest is made), then as complete, and
        ``announce`` gets the
        manifest with the checksums of what was made (to commit it at the hub). With
        ``announce=None`` the version is kept private: not exposed, no checksums. The
        buffer comes back reserved for a `FetchFuture` (see `submit`). If ``fill`` or
        ``announce`` raises, the exposure is withdrawn and the error propagates.
        ``exposed``: a spare buffer `_expose_spare` exposed for ``version`` already
        (before the hub named this worker to peers), to fill instead of a new one.

        Raises:
            FabricError: the store has no layout yet, or is closed.
        """
        if self.layout is None:
            raise FabricError(f"model {self.model!r}: produce needs the store's layout")
        layout = self.layout
        progress: ChunkProgress | None = None
        if announce is not None:
            buffer, progress = exposed or self._expose_spare(version, self.chunk_size)
        else:
            with self._lock:
                buffer = self._spare_buffer()
                buffer.version = version
        try:
            self._ready(buffer)  # the background populate must not write under fill
            marks = None if progress is None else SlotMarks(
                [(t.name, t.offset, t.nbytes) for t in layout.slots], self.chunk_size, progress)
            base = buffer.region.tensor[:layout.nbytes]
            sums = (ChunkSums(layout.nbytes, self.chunk_size)
                    if announce is not None and base.device.type == "cpu"
                    and not layout.nbytes % 4 else None)

            def place(dst: torch.Tensor, src: torch.Tensor) -> None:
                # dst may lie elsewhere (an fp8 target's staging copy): ChunkSums refuses
                # offsets outside the buffer, and those bytes are summed at the end
                if sums is None or not sums.copy(dst.data_ptr() - base.data_ptr(), dst, src):
                    dst.view(src.shape).copy_(src)
            def written(dst: torch.Tensor) -> None:
                offset, nbytes = dst.data_ptr() - base.data_ptr(), dst.numel() * dst.element_size()
                if marks is not None and offset >= 0 and offset + nbytes <= layout.nbytes:
                    marks.written(offset, nbytes)
            fill(Production(views(layout, buffer.region.tensor),
                            marks.done if marks is not None else lambda names: None, place,
                            written))
            with self._lock:
                buffer.pending = True
            if announce is not None and progress is not None:
                manifest = manifest_of(layout, buffer.region.tensor, self.chunk_size,
                                       checksums=None if sums is None
                                       else sums.finish(base).tolist())
                for chunk in range(manifest.num_chunks):
                    progress.mark(chunk)
                announce(manifest)
        except BaseException:
            buffer.pending = False
            self._unexpose(buffer, timeout=FAILED_DRAIN_S)
            raise
        return buffer

    def sync(self, *, timeout: float = 30.0, verify: bool | None = None,
             options: FetchOptions | None = None,
             on_chunk: Callable[[int, int], None] | None = None,
             in_place: bool = False) -> FetchStats:
        """Wait for a version newer than the one held, fetch it and switch to it.

        The rollout loop's one call: each new version is fetched once (a second
        `sync` waits for the next one), and a missing version is an error, never a
        fetch of something else::

            while True:
                stats = store.sync(timeout=600)   # the newest version, once it exists
                generate(...)

        Args:
            timeout: seconds to wait for a newer version.
            verify, options, on_chunk, in_place: as for `fetch`.

        Returns:
            The fetch's `FetchStats` (``stats.version`` is the version now held).

        A version retired between the wait and the fetch (a fast trainer committed newer
        ones, and retention dropped it) is followed by the newest one instead.

        Raises:
            WaitTimeoutError: no newer version within ``timeout`` (nothing changed).
            FabricError: the store is closed; and what `fetch` raises.
        """
        self._check_open()
        return fetch_newer(self.hub, self.model, lambda: self.version, timeout,
                           lambda v: self.fetch(v, verify=verify, options=options,
                                                on_chunk=on_chunk, in_place=in_place))

    def _fetch(self, version: int | str, verify: bool | None, options: FetchOptions,
               on_chunk: Callable[[int, int], None] | None, in_place: bool = False
               ) -> tuple[Buffer | None, FetchStats]:
        if self.nvshmem is not None and not len(self.pool):
            raise self._no_symmetric_buffer()
        delta_mode(options.deltas)  # a bad mode (or $WEIGHTFABRIC_DELTAS) before the hub hears
        hub = self.hub
        if version == "latest":
            version = hub.latest(self.model) or "latest"
        if version == self.version:
            return None, FetchStats(version=self.version)
        if isinstance(version, int):
            held = self._held(version)
            if held is not None:  # still here (e.g. pinned): switch back to it, nothing moves
                return held, FetchStats(version=version)
        # Expose the buffer before the hub lists this worker as a partial replica, so
        # peers told to wait on it find the region at once.
        early_chunk = self._early_chunk_size
        in_place = in_place and self.pool.active is not None and self.nvshmem is None
        held_base = self.pool.active  # a delta base, read before an in-place fetch forgets it
        base = (held_base.region.tensor, held_base.version) if held_base is not None else None
        if in_place:
            self._drop_spares()
        early = (self._expose_spare(version, early_chunk)  # not in place: keep the old one
                 if self.layout is not None and isinstance(version, int) and not in_place
                 else None)
        try:
            plan = hub.begin_fetch(self.model, version, shard=self.shard)
        except BaseException:
            if early is not None:
                self._unexpose(early[0])
            raise
        manifest = plan.manifest
        try:
            with self._lock:
                if self.layout is None:
                    self.layout = layout_from_manifest(manifest)
                    self.aliases = manifest.alias_map()
                else:
                    check_compatible(self.layout, manifest, model=self.model, version=plan.version,
                                     aliases=self.aliases)
                self.sharding = manifest.sharding
                if self.nvshmem is not None and manifest.chunk_size != self.chunk_size:
                    raise ManifestMismatchError(
                        f"model {self.model!r} v{plan.version} was published in chunks of "
                        f"{manifest.chunk_size} bytes; this symmetric store's progress flags count "
                        f"chunks of {self.chunk_size} (open it with the publisher's chunk_size)")
                self._early_chunk_size = manifest.chunk_size  # the publisher's, next time
            if early is not None and manifest.chunk_size != early_chunk:
                # Exposed again below in the publisher's chunks. Peers waiting on the early
                # exposure are answered by its retract; one still copying under a lease
                # finishes there, and the buffer is not reused until it has.
                withdrawn, early = early[0], None
                self._unexpose(withdrawn, timeout=FAILED_DRAIN_S)
            buffer, progress = early or self._expose_spare(plan.version, manifest.chunk_size,
                                                           in_place=in_place)
        except BaseException:
            _quietly(hub.release, plan.fetch_id)
            if early is not None:
                self._unexpose(early[0])
            raise
        region = buffer.region  # a fetch that overtakes the background populate does its part
        populate = (region.populate_range if isinstance(region, Region)
                    and region.populated_bytes < region.nbytes else None)
        choose = functools.partial(self.transports.transport_for, timeout=options.read_timeout,
                                   symmetric=self.nvshmem is not None)
        # A derived version its deriver is still making has no checksums yet: the copy
        # computes them and compares them once the deriver commits.
        deferred: dict[int, int] | None = None if manifest.checksums else {}
        delta = self._delta_base(base, plan.version, manifest, options)
        try:
            stats = fetch_chunks(
                buffer.region.tensor, chunk_size=manifest.chunk_size, progress=progress,
                planner=HubPlanner(hub, plan, me=hub.location), choose=choose,
                checksums=list(manifest.checksums) if deferred is None else None,
                deferred=deferred,
                checksum_fn=lambda c, piece: int(chunk_checksums(
                    piece, manifest.chunk_size, first_chunk=c)[0]),
                copy_checksums=lambda dst, src, c: copy_with_checksums(
                    dst, src, manifest.chunk_size, first_chunk=c).tolist(),
                verify=verify_rule(verify), options=options, on_chunk=on_chunk,
                before_write=populate, cancel=self._cancel, delta=delta)
            if deferred is not None:
                self._check_deferred(plan.version, deferred, options.deadline)
            with self._lock:
                buffer.pending = True  # before the hub lists it complete: reserved from now
            hub.complete_fetch(plan.fetch_id, traffic={
                w: [n, stats.wire.get(w, n)] for w, n in stats.sources.items()})
        except BaseException as exc:
            _quietly(hub.release, plan.fetch_id)
            self._unexpose(buffer, timeout=min(options.read_timeout, FAILED_DRAIN_S))
            if self._cancel.is_set() and isinstance(exc, FetchError):
                raise FetchError(f"model {self.model!r}: the store is closed; the fetch of "
                                 f"v{plan.version} was cancelled (open another store with "
                                 "worker.model(...) and fetch again)") from exc
            raise
        stats.version = plan.version
        log.info("fetched %s v%d: %d bytes in %.3f s (%.2f GB/s) from %s", self.model,
                 plan.version, stats.bytes, stats.seconds, stats.gbps,
                 ", ".join(sorted(stats.sources)) or "nobody")
        return buffer, stats

    def _delta_base(self, base: tuple[torch.Tensor, int | None] | None, version: int,
                    manifest: Manifest, options: FetchOptions) -> DeltaBase | None:
        """What a fetch of ``version`` may ask for deltas against (`fabric.deltas`).

        The version that was active when the fetch began (held whole, same layout), unless
        deltas are off, the store is symmetric, or it held none.
        """
        if (base is None or base[1] is None or base[1] == version or self.nvshmem is not None
                or delta_mode(options.deltas) == "off"):
            return None
        width = word_width([(getattr(torch, t.dtype), t.nbytes) for t in manifest.tensors])
        return DeltaBase(region_name(self.model, base[1], self.shard), base[0], width,
                         self.delta_policy)

    def _check_deferred(self, version: int, sums: dict[int, int], timeout: float) -> None:
        """Wait for the commit of ``version`` (copied while derived) and check what was read.

        ``sums``: chunk -> checksum of the chunks the copy verified (`fetch_chunks`'s
        ``deferred``), compared with the checksums the deriver committed.

        Raises:
            UnknownVersionError: the version was retired instead (its deriver failed).
            WaitTimeoutError: not committed within ``timeout``.
            FetchError: a chunk differs from what the deriver committed.
        """
        want = self.hub.wait_commit(self.model, version, shard=self.shard, timeout=timeout)
        bad = sorted(c for c, got in sums.items() if c >= len(want) or got != want[c])
        if bad:
            raise FetchError(f"model {self.model!r} v{version}: {len(bad)} chunks copied "
                             f"while it was derived (first: {bad[0]}) differ from the checksums "
                             "its deriver committed")

    # --- retract / release -------------------------------------------------------------

    def retract(self, version: int, *, wait: float = 30.0, delay: bool = False) -> str:
        """Stop serving `version` to peers; keep the bytes.

        Returns ``"done"`` once no read can be in flight (the memory may change), else
        the hub's state (``"retracting"``, ``"delayed"``) when `wait` ran out, or
        ``"retracting"`` when the hub is done but a read it does not track (a
        resharding reader's) is still in flight here after `wait`.

        Raises:
            RetentionError: it would leave the version with too few replicas and
                `delay` is false.
        """
        try:
            state = self.hub.retract(self.model, version, wait=wait, delay=delay)
        except UnknownVersionError:
            with self._lock:
                if not any(b.version == version and b.exposed for b in self.pool.buffers):
                    raise
            state = "done"  # an earlier retract got the hub's part done; reads here remain
        if state == "done":
            with self._lock:
                for buffer in self.pool.buffers:
                    if buffer.version == version and not self._drained(buffer, wait):
                        log.warning("%s v%d: a read is still in flight after %g s",
                                    self.model, version, wait)
                        return "retracting"
        return state

    def quarantine(self, version: int) -> None:
        """Stop serving ``version``: a reader found chunks of it corrupt here.

        The worker calls this when the hub says so (`HubClient.on_quarantine`). The buffers
        holding it are withdrawn from the read server and hold no version any more; if one
        was active, `version` becomes None (the tensors keep their bytes) and the next
        `fetch` or `sync` fetches a version afresh.
        """
        with self._lock:
            held = [b for b in self.pool.buffers if b.version == version]
            for buffer in held:
                self._unexpose(buffer, timeout=FAILED_DRAIN_S)
        if held:
            log.warning("%s v%d: a reader found chunks of it corrupt here; no longer served "
                        "(fetch it again)", self.model, version)

    def release(self, version: int, *, wait: float = 30.0) -> None:
        """Retract `version` and free its memory.

        Raises:
            FabricError: it is the version the store's tensors use now, or one fetched
                for a future not switched to yet, or reads are still in flight after `wait`.
            RetentionError: the hub still needs this replica.
        """
        with self._lock:
            buffer = self.pool.find(version)
            if buffer is None:
                return
            if buffer is self.pool.active:
                raise FabricError(f"{self.model!r} v{version} is the active version; fetch or "
                                  "publish another before releasing it")
            if buffer.pending:
                raise FabricError(f"{self.model!r} v{version} was fetched for a FetchFuture whose "
                                  "result() was not called yet; call it, or make a newer "
                                  "version active, before releasing it")
            buffer.releasing = True  # the lock is dropped for the retract: no fetch takes it
        try:
            if buffer.exposed and self.retract(version, wait=wait) != "done":
                raise FabricError(f"{self.model!r} v{version}: reads still in flight after "
                                  f"{wait:g} s; release it again later")
            with self._lock:
                if buffer.version != version or buffer not in self.pool:
                    return  # freed meanwhile (close, or another release)
                if self.nvshmem is not None:  # symmetric buffers are freed together, in close
                    self.pool.forget(buffer)
                    return
                self._drop(buffer)
        finally:
            buffer.releasing = False

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

    # --- buffers -----------------------------------------------------------------------

    def _held(self, version: int) -> Buffer | None:
        """Reserve a non-active buffer that holds all of `version`; else None.

        A buffer other than the active one that holds all of `version` (a fetched or
        published copy kept, e.g. pinned), reserved for the fetch's future; else None.
        """
        with self._lock:
            return self.pool.reserve(version)

    def _check_open(self) -> None:
        """Raises: FabricError: the store is closed."""
        if self._closed:
            raise FabricError(f"model {self.model!r}: the store is closed; open another "
                              "with worker.model(...)")

    def _new_buffer(self) -> Buffer:
        """A new buffer; in host memory it populates itself in the background.

        A new buffer; in host memory it populates itself in the background (writers:
        `_ready`, and a fetch's ``before_write``).

        Raises:
            FabricError: the store is closed, or it is a symmetric one (no new buffers).
        """
        return self.pool.add(self._new_region())

    def _new_region(self) -> Region | DeviceRegion:
        """Memory for a new buffer (see `_new_buffer`)."""
        self._check_open()
        if self.nvshmem is not None:
            raise self._no_symmetric_buffer()
        assert self.layout is not None
        if self.device.type == "cuda":
            return DeviceRegion(self.layout.nbytes, self.device)
        region = Region.create(f"{self.hub.worker}-{self.model}", self.layout.nbytes)
        region.populate(background=True)
        return region

    def _no_symmetric_buffer(self) -> FabricError:
        """Why a symmetric store cannot have another buffer now."""
        if len(self.pool):
            return FabricError(f"model {self.model!r}: all {len(self.pool)} symmetric buffers "
                               "hold versions readers still need; retract or release one first "
                               "(or open the store with more buffers)")
        return FabricError(f"model {self.model!r} lives in NVSHMEM symmetric memory, whose "
                           "buffers every PE allocates together in attach: attach the model on "
                           "every PE first")

    def _allocate_symmetric(self) -> Buffer:
        """Every symmetric buffer at once (collective); returns the first."""
        assert self.layout is not None and self.nvshmem is not None
        first = None
        for i in range(self.buffers):
            region = SymmetricBuffer(self.nvshmem, f"{self.model}/{i}", self.layout.nbytes,
                                     self.chunk_size)
            buffer = self.pool.add(region)
            first = first or buffer
        assert first is not None
        return first

    def _ready(self, buffer: Buffer) -> Buffer:
        """`buffer`, fully populated (the caller finishes what the background has not).

        A buffer that cannot be populated is freed.

        Raises:
            ArenaError: no room in /dev/shm for it.
        """
        if isinstance(buffer.region, Region):
            try:
                buffer.region.populate()
            except ArenaError:
                self._drop(buffer)
                raise
        return buffer

    def _drop(self, buffer: Buffer) -> None:
        with self._lock:
            self._forget(buffer)
            self.pool.remove(buffer)

    def _forget(self, buffer: Buffer) -> None:
        """Deregister ``buffer``'s memory from the worker's NIXL agent before it is freed."""
        if self.server.nixl is not None:
            self.server.nixl.forget(buffer.region.tensor)

    def _prepare_spare(self) -> None:
        """With `prepare_spare`, start populating a spare buffer now.

        With `prepare_spare`, start populating a spare buffer now, so the next version does
        not wait for fresh pages; only up to `PREPARED_BUFFERS`.
        """
        with self._lock:
            if (not self.prepare_spare or self.layout is None or self._closed
                    or not self.pool.wants_spare()):
                return
            try:
                self._new_buffer()
            except ArenaError as exc:  # an optimisation: the next version allocates it
                log.warning("%s: no spare buffer prepared: %s", self.model, exc)

    def _drop_spares(self) -> None:
        """Stop preparing spares and free unused ones.

        Stop preparing spares and free unused ones (an in-place publisher keeps its tensors
        in the active buffer and never writes into a spare).
        """
        with self._lock:
            self.prepare_spare = False
            if self.nvshmem is not None:
                return  # symmetric buffers are freed together, in close
            for buffer in self.pool.unused():
                self._drop(buffer)

    def _spare_buffer(self) -> Buffer:
        """A buffer that is neither active nor needed by readers.

        A buffer that is neither active nor needed by readers, reclaiming the oldest
        versions whose retract the hub allows, or allocating a new one.
        """
        return self.pool.take(self._reclaim, self._new_region)

    def _take_active(self) -> Buffer:
        """The active buffer, to fetch a version into in place: its own is retracted first.

        Raises:
            RetentionError: no other replica could serve the held version.
            FabricError: peers are still reading it after `IN_PLACE_DRAIN_S`.
        """
        buffer = self.pool.active
        assert buffer is not None
        held = buffer.version
        if buffer.exposed is not None:
            state = self.retract(held, wait=IN_PLACE_DRAIN_S) if held is not None else (
                "done" if self._drained(buffer, IN_PLACE_DRAIN_S) else "retracting")
            if state != "done":
                raise FabricError(f"model {self.model!r}: peers are still reading v{held} from "
                                  f"this store ({state}); fetch in place again later")
        self.pool.forget(buffer)
        return buffer

    def _reclaim(self, buffer: Buffer) -> bool:
        """Whether ``buffer`` (a reuse candidate) can take a new version now.

        An unused one whose last exposure has no read in flight, or an older version the hub
        lets this worker retract. A buffer /dev/shm had no room for is dropped instead.
        """
        if buffer.version is None and getattr(buffer.region, "populate_error", None):
            self._drop(buffer)  # /dev/shm had no room for it; try afresh
            return False
        if buffer.version is None:
            return self._drained(buffer, 5.0)  # False: a read of its last exposure is in flight
        try:
            return buffer.exposed is None or self.retract(buffer.version, wait=5.0) == "done"
        except RetentionError:
            return False  # another reader may still need it; try the next one

    def _expose_spare(self, version: int, chunk_size: int, *, in_place: bool = False
                      ) -> tuple[Buffer, ChunkProgress]:
        """A spare buffer, exposed empty as `version` (a partial replica that fills).

        With ``in_place``, the active buffer, its version retracted (`fetch`'s ``in_place``).
        """
        assert self.layout is not None
        with self._lock:
            buffer = self._take_active() if in_place else self._spare_buffer()
            progress = self._progress(buffer, chunk_size)
            buffer.exposed = self._expose(buffer, version, chunk_size, progress)
            buffer.version = version
            return buffer, progress

    def _expose(self, buffer: Buffer, version: int, chunk_size: int,
                progress: ChunkProgress) -> Exposure:
        """Serve ``buffer`` as this shard of ``version``.

        Readers on this host reach it without the read server through its shared-memory file
        or GPU descriptor.
        """
        region = cast(StoreRegion, buffer.region)
        name = region_name(self.model, version, self.shard)
        if region.path is None:
            return self.server.expose(name, region.tensor, chunk_size=chunk_size,
                                      progress=progress, gpu=region.gpu)
        return self.server.expose(name, region.tensor, chunk_size=chunk_size,
                                  progress=progress, shm_path=str(region.path))

    def _progress(self, buffer: Buffer, chunk_size: int, *, complete: bool = False
                  ) -> ChunkProgress:
        """Progress of a new exposure of ``buffer`` (symmetric: also its flags, reset)."""
        if isinstance(buffer.region, SymmetricBuffer):
            return buffer.region.progress(complete=complete)
        assert self.layout is not None
        return ChunkProgress(-(-self.layout.nbytes // chunk_size), complete=complete)

    def _unexpose(self, buffer: Buffer, *, timeout: float = 5.0) -> None:
        """Forget the buffer's version.

        It stays `exposed` (not reused, see `_spare_buffer`) while a read of it is still in
        flight after `timeout`.
        """
        self._drained(buffer, timeout)
        self.pool.forget(buffer)

    def _drained(self, buffer: Buffer, timeout: float) -> bool:
        """Retract the buffer's exposure on the read server.

        True (and no longer exposed) once no read of it is in flight, False if one still is
        after `timeout`.
        """
        if buffer.exposed is not None and not self.server.retract(buffer.exposed,
                                                                  timeout=timeout):
            return False
        buffer.exposed = None
        return True

    def _switch_to(self, buffer: Buffer | None, version: int | None) -> None:
        """Make `buffer`, which a fetch filled with `version`, the active one.

        Make `buffer`, which a fetch filled with `version`, the active one (None: the
        version was active already).

        Raises:
            FabricError: the store is closed (the buffer was freed with it), the buffer
                was released or reused, or a newer version became active first.
        """
        with self._lock:
            if self._closed:
                raise FabricError(f"model {self.model!r}: the store is closed, and v{version} "
                                  "was freed with it; open another store and fetch again")
            if buffer is None:
                return
            self.pool.switch(buffer, version)
            self._point_attached(buffer)

    def _activate(self, buffer: Buffer) -> None:
        with self._lock:
            self.pool.activate(buffer)
            self._point_attached(buffer)

    def _point_attached(self, buffer: Buffer) -> None:
        """Point the attached tensors at the now active ``buffer``; top up the spare."""
        if self._attached is not None and self.layout is not None:
            new = views(self.layout, buffer.region.tensor, self.aliases)
            for name, tensor in self._attached.items():
                tensor.data = new[name]
        self._prepare_spare()

    def _named(self, obj: nn.Module | Mapping[str, torch.Tensor],
               normalize: bool) -> dict[str, torch.Tensor]:
        """`named_tensors` of ``obj``, names normalized unless ``normalize`` is False."""
        tensors = named_tensors(obj)
        return normalize_names(tensors) if normalize else tensors

    def _prepare(self, obj: nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                 normalize: bool) -> PreparedSet:
        """``obj`` ready to pack: names, DTensors' local shards, aliases, casts (`publish`)."""
        tensors, sharding = local_shards(self._named(obj, normalize), model=self.model,
                                         shard=self.shard, num_shards=self.num_shards)
        return prepare(self._on_device(tensors), dtype=dtype, sharding=sharding)

    def _adopt(self, prepared: PreparedSet) -> None:
        """Make ``prepared``'s layout the store's, or check it is the store's.

        Raises:
            FabricError: the store holds another layout (or other ties or slices).
        """
        mine = (prepared.layout, dict(prepared.aliases), prepared.sharding)
        if self.layout is None:
            self.layout, self.aliases, self.sharding = mine
        elif mine != (self.layout, self.aliases, self.sharding):
            raise FabricError(f"model {self.model!r}: this tensor set's layout differs from the "
                              "one this store holds (names, shapes, dtypes, tied tensors or "
                              "shard slices); use another model name")

    @staticmethod
    def _pack(prepared: PreparedSet, buffer: Buffer, chunk_size: int | None = None
              ) -> list[int] | None:
        """Pack the published tensors of ``prepared`` into ``buffer`` (casting as laid out).

        With ``chunk_size``, also their chunk checksums, computed as the bytes are copied.
        """
        tensors = {n: t.detach() for n, t in prepared.published.items()}
        if chunk_size is None:
            pack(tensors, prepared.layout, out=buffer.region.tensor)
            return None
        return pack_with_checksums(tensors, prepared.layout, buffer.region.tensor,
                                   chunk_size).tolist()

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` if they have data on the store's device.

        Raises:
            TensorSetError: a meta tensor, or one on another device.
        """
        for name, t in check_has_data(tensors).items():
            if t.device != self.device:
                raise TensorSetError(
                    f"model {self.model!r} lives on {self.device}; tensor {name!r} is on "
                    f"{t.device} (open the store with device={str(t.device)!r})")
        return tensors

    def _require_attached(self) -> dict[str, torch.Tensor]:
        if self._attached is None:
            raise FabricError(f"model {self.model!r}: nothing to publish; pass the tensors or "
                              "attach them first")
        return self._attached

    def _require_active(self) -> Buffer:
        active = self.pool.active
        assert active is not None, "attached stores always have an active buffer"
        return active

    def _check_in_place(self, obj: nn.Module | Mapping[str, torch.Tensor] | None,
                        normalize: bool) -> None:
        attached = self._require_attached()
        if obj is not None:
            given = self._named(obj, normalize)
            if set(given) != set(attached) or any(
                    given[n].data_ptr() != attached[n].data_ptr() for n in given):
                raise FabricError("publish(snapshot=False) exposes attached tensors in place; "
                                  "these are not the attached ones (use snapshot=True)")


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


def _quietly(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # cleanup after a failure must not hide the failure
        log.warning("cleanup %s failed: %s", getattr(fn, "__name__", fn), exc)
