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
finishes the populate first. With ``prepare_spare`` (the default) the store
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

Trainer::

    store = worker.model("policy")
    v = store.publish(model)                  # snapshot: copy, expose, commit
    # or, with the weights already in the arena (store.attach(model) once):
    v = store.publish(snapshot=False, hold=True)  # expose in place; wait for a peer

Rollout::

    store.attach(model)                       # parameters move into the arena, once
    stats = store.fetch("latest")             # bytes land in the spare buffer, then switch
    future = store.fetch_async("latest")      # keep generating with the old version...
    stats = future.result()                   # ...switch when it suits you
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from weightfabric.fabric.arena import Region
from weightfabric.fabric.errors import (
    ArenaError,
    FabricError,
    ManifestMismatchError,
    RetentionError,
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
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.tensorset import (
    check_chunk_size,
    check_compatible,
    layout_from_manifest,
    layout_of,
    manifest_of,
    named_tensors,
    views,
)
from weightfabric.fabric.transports.server import Exposure
from weightfabric.kernels import PackLayout, chunk_checksums, pack

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime
    from weightfabric.fabric.worker import Worker

log = logging.getLogger(__name__)

MAX_BUFFERS = 4
PREPARED_BUFFERS = 2
"""`prepare_spare` tops the store up to this many buffers (active + spare), never more."""
FAILED_DRAIN_S = 0.5
"""Seconds a failed fetch waits for peers' reads of its partial replica before it raises
(and a fetch for its early exposure in other chunks than the publisher's); a buffer
still being read stays exposed, and is not reused, until they end."""


@dataclass
class _Buffer:
    region: Region | DeviceRegion | SymmetricBuffer
    version: int | None = None
    exposed: Exposure | None = None  # on the read server while peers may read it
    pending: bool = False
    """Filled by a fetch whose `FetchFuture.result` has not switched to it yet:
    reserved, not reused or released, until then or until a newer version is active."""
    releasing: bool = False  # `release` is retracting it: not reused meanwhile


class FetchFuture:
    """A fetch running in the background. `result` switches the store to the new
    version (in the caller's thread, at a moment the caller chose).

    Once the bytes are in, the buffer holding them is reserved for this future: later
    fetches do not reuse it and `release` refuses it, until `result` switches to it or
    a newer version becomes active (a superseded future then no longer pins memory,
    and its `result` raises `FabricError` instead of switching back).
    """

    def __init__(self, store: ModelStore, inner: Future) -> None:
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


class ModelStore:
    """Versions of one model as seen by one worker. Get it with `Worker.model`."""

    def __init__(self, worker: Worker, model: str, *, chunk_size: int,
                 device: torch.device | str = "cpu", shard: int = 0, num_shards: int = 1,
                 prepare_spare: bool = True, nvshmem: NvshmemRuntime | None = None,
                 buffers: int = PREPARED_BUFFERS) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"model {model!r}: shard {shard} outside 0..{num_shards - 1}")
        if nvshmem is not None and not 1 <= buffers <= MAX_BUFFERS:
            raise ValueError(f"model {model!r}: buffers must be 1..{MAX_BUFFERS}, got {buffers}")
        self.worker = worker
        self.model = model
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
        self._buffers: list[_Buffer] = []
        self._active: _Buffer | None = None
        self._attached: dict[str, torch.Tensor] | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"wf-fetch-{model}")
        self._cancel = threading.Event()  # set by `close`: the running fetch stops
        self._early_chunk_size = self.chunk_size
        """Chunks of the exposure made before `begin_fetch`: the last fetched version's."""

    # --- state ---------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The version the store's tensors hold now (None before the first one)."""
        return self._active.version if self._active else None

    @property
    def closed(self) -> bool:
        """True after `close`; `Worker.model` then opens a new store for the name."""
        return self._closed

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor of the active version (views of arena memory: read only
        while the version is exposed)."""
        if self._active is None or self.layout is None:
            raise FabricError(f"model {self.model!r} holds no version yet: attach or fetch first")
        return views(self.layout, self._active.region.tensor)

    # --- attach ----------------------------------------------------------------------

    def attach(self, obj: nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Move a model's parameters and persistent buffers into arena memory, once.

        Afterwards the module's tensors are views of the active buffer: `fetch`
        switches them to each new version without a staging copy, and a trainer can
        `publish(snapshot=False)` them in place.

        If the store already holds a version (fetched before attaching), the module
        takes that version's values.

        Raises:
            FabricError: already attached.
            ManifestMismatchError: the tensors do not fit the version the store holds.
            TypeError: not a module or a mapping of tensors on the store's device.
        """
        tensors = self._on_device(named_tensors(obj))
        with self._lock:
            if self._attached is not None:
                raise FabricError(f"model {self.model!r} is already attached to this worker")
            layout = layout_of(tensors)
            if self.layout is not None and layout != self.layout:
                raise ManifestMismatchError(
                    f"model {self.model!r}: the tensors to attach are laid out differently from "
                    f"v{self.version}, which this store holds (names, shapes or dtypes differ)")
            self.layout = layout
            buffer = self._active
            if buffer is None:  # keep the module's values; else it takes the version held
                buffer = self._allocate_symmetric() if self.nvshmem else self._ready(self._new_buffer())
                pack({n: t.detach() for n, t in tensors.items()}, layout, out=buffer.region.tensor)
            self._attached = tensors
            self._activate(buffer)

    # --- publish ---------------------------------------------------------------------

    def publish(self, obj: nn.Module | Mapping[str, torch.Tensor] | None = None, *,
                snapshot: bool = True, hold: bool = False, group: str | None = None,
                timeout: float = 120.0) -> int:
        """Publish a new version; returns its number.

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

        Raises:
            FabricError: in-place publish of tensors that are not attached, `hold`
                timed out (the version stays exposed), or no ``group`` with several shards.
            HubError: the hub refused (e.g. unreachable).
        """
        if self.num_shards > 1 and group is None:
            raise FabricError(f"model {self.model!r} has {self.num_shards} shards: pass the same "
                              "publish group key from every shard's publisher")
        with self._lock:
            if snapshot:
                tensors = (self._on_device(named_tensors(obj)) if obj is not None
                           else self._require_attached())
                layout = layout_of(tensors)
                if self.layout is None:
                    self.layout = layout
                elif layout != self.layout:
                    raise FabricError(f"model {self.model!r}: this tensor set's layout differs "
                                      "from the one this store holds; use another model name")
                buffer = self._ready(self._spare_buffer())
                pack({n: t.detach() for n, t in tensors.items()}, layout, out=buffer.region.tensor)
            else:
                self._check_in_place(obj)
                self._drop_spares()
                buffer = self._active
                if buffer.exposed is not None:
                    raise FabricError(f"the attached tensors are still exposed as v{buffer.version};"
                                      " retract that version before publishing them again")
            manifest = manifest_of(self.layout, buffer.region.tensor, self.chunk_size)
            hub = self.worker.hub
            version = hub.begin_publish(self.model, manifest, shard=self.shard,
                                        num_shards=self.num_shards, group=group)
            buffer.exposed = self.worker.server.expose(
                region_name(self.model, version, self.shard), buffer.region.tensor,
                chunk_size=self.chunk_size,
                progress=self._progress(buffer, self.chunk_size, complete=True),
                **_reach(buffer.region))
            buffer.version = version
            hub.commit(self.model, version)
            if snapshot and self._attached is None:
                self._set_active(buffer)
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

    # --- fetch -----------------------------------------------------------------------

    def fetch(self, version: int | str = "latest", *, verify: bool | None = None,
              options: FetchOptions | None = None,
              on_chunk: Callable[[int, int], None] | None = None) -> FetchStats:
        """Fetch a version and switch the store's tensors to it (a version the store
        still holds in another buffer, e.g. pinned, is switched to without a read).

        Args:
            version: a number or ``"latest"``.
            verify: check every chunk's checksum (True), none (False), or by default
                only chunks read from other hosts.
            options: concurrency and time limits of the fetch engine.
            on_chunk: progress callback (chunks done, chunks total).

        Returns:
            FetchStats: bytes, seconds, GB/s, sources used, chunks re-read.

        Raises:
            UnknownModelError, UnknownVersionError: nothing to fetch.
            ManifestMismatchError: the version's tensors do not fit the attached ones.
            FetchError: some chunks could not be read from any source in time, or the
                store was closed meanwhile.
            FabricError: the store is closed, or every buffer holds a version readers
                still need.
            ArenaError: no room in /dev/shm for a buffer.
        """
        return self.fetch_async(version, verify=verify, options=options,
                                on_chunk=on_chunk).result()

    def fetch_async(self, version: int | str = "latest", *, verify: bool | None = None,
                    options: FetchOptions | None = None,
                    on_chunk: Callable[[int, int], None] | None = None) -> FetchFuture:
        """Start `fetch` in the background; the store keeps its current version until
        the returned future's `result` is called. The buffer the fetch fills stays
        reserved for the future until then, or until a newer version is active (see
        `FetchFuture`).

        Raises:
            FabricError: the store is closed (the fetch's own errors come from `result`).
        """
        with self._lock:
            self._check_open()
            inner = self._fetcher.submit(self._fetch, version, verify,
                                         options or FetchOptions(), on_chunk)
        return FetchFuture(self, inner)

    def _fetch(self, version: int | str, verify: bool | None, options: FetchOptions,
               on_chunk: Callable[[int, int], None] | None) -> tuple[_Buffer | None, FetchStats]:
        if self.nvshmem is not None and not self._buffers:
            raise self._no_symmetric_buffer()
        hub = self.worker.hub
        if version == "latest":
            version = hub.latest(self.model) or "latest"
        if version == self.version:
            return None, FetchStats(version=self.version)
        held = self._held(version)
        if held is not None:  # still here (e.g. pinned): switch back to it, nothing moves
            return held, FetchStats(version=version)
        # Expose the buffer before the hub lists this worker as a partial replica, so
        # peers told to wait on it find the region at once.
        early_chunk = self._early_chunk_size
        early = (self._expose_spare(version, early_chunk)
                 if self.layout is not None and isinstance(version, int) else None)
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
                else:
                    check_compatible(self.layout, manifest, model=self.model, version=plan.version)
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
            buffer, progress = early or self._expose_spare(plan.version, manifest.chunk_size)
        except BaseException:
            _quietly(hub.release, plan.fetch_id)
            if early is not None:
                self._unexpose(early[0])
            raise
        region = buffer.region  # a fetch that overtakes the background populate does its part
        populate = (region.populate_range if isinstance(region, Region)
                    and region.populated_bytes < region.nbytes else None)
        choose = functools.partial(self.worker.transport_for, timeout=options.read_timeout,
                                   symmetric=self.nvshmem is not None)
        try:
            stats = fetch_chunks(
                buffer.region.tensor, chunk_size=manifest.chunk_size, progress=progress,
                planner=HubPlanner(hub, plan, me=self.worker.location), choose=choose,
                checksums=list(manifest.checksums),
                checksum_fn=lambda c, piece: int(chunk_checksums(
                    piece, manifest.chunk_size, first_chunk=c)[0]),
                verify=verify_rule(verify), options=options, on_chunk=on_chunk,
                before_write=populate, cancel=self._cancel)
            with self._lock:
                buffer.pending = True  # before the hub lists it complete: reserved from now
            hub.complete_fetch(plan.fetch_id)
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
            state = self.worker.hub.retract(self.model, version, wait=wait, delay=delay)
        except UnknownVersionError:
            with self._lock:
                if not any(b.version == version and b.exposed for b in self._buffers):
                    raise
            state = "done"  # an earlier retract got the hub's part done; reads here remain
        if state == "done":
            with self._lock:
                for buffer in self._buffers:
                    if buffer.version == version and not self._drained(buffer, wait):
                        log.warning("%s v%d: a read is still in flight after %g s",
                                    self.model, version, wait)
                        return "retracting"
        return state

    def release(self, version: int, *, wait: float = 30.0) -> None:
        """Retract `version` and free its memory.

        Raises:
            FabricError: it is the version the store's tensors use now, or one fetched
                for a future not switched to yet, or reads are still in flight after `wait`.
            RetentionError: the hub still needs this replica.
        """
        with self._lock:
            buffer = next((b for b in self._buffers if b.version == version), None)
            if buffer is None:
                return
            if buffer is self._active:
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
                if buffer.version != version or buffer not in self._buffers:
                    return  # freed meanwhile (close, or another release)
                if self.nvshmem is not None:  # symmetric buffers are freed together, in close
                    buffer.version = None
                    return
                self._buffers.remove(buffer)
                buffer.region.close()
        finally:
            buffer.releasing = False

    def close(self, *, tell_hub: bool = True) -> None:
        """Stop serving every version of this model and free the buffers (stopping
        any background populate first).

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
        of any fetch not switched to yet) raises `FabricError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # under the lock: no fetch_async submits after this
        self._cancel.set()
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if tell_hub and any(b.version is not None or b.exposed for b in self._buffers):
                try:
                    self.worker.hub.drop(self.model)
                except Exception as exc:  # the hub may be gone; the lease then runs out
                    log.warning("%s: could not tell the hub this worker drops it: %s",
                                self.model, exc)
            for buffer in self._buffers:
                if buffer.exposed:
                    self.worker.server.retract(buffer.exposed, timeout=5.0)
                buffer.region.close()
            self._buffers.clear()
            self._active = None

    # --- buffers -----------------------------------------------------------------------

    def _held(self, version: int | str) -> _Buffer | None:
        """A buffer other than the active one that holds all of `version` (a fetched or
        published copy kept, e.g. pinned), reserved for the fetch's future; else None."""
        with self._lock:
            for buffer in self._buffers:
                if (buffer.version == version and buffer is not self._active
                        and not buffer.releasing):
                    buffer.pending = True
                    return buffer
        return None

    def _check_open(self) -> None:
        """Raises:
            FabricError: the store is closed."""
        if self._closed:
            raise FabricError(f"model {self.model!r}: the store is closed; open another "
                              "with worker.model(...)")

    def _new_buffer(self) -> _Buffer:
        """A new buffer; in host memory it populates itself in the background (writers:
        `_ready`, and a fetch's ``before_write``).

        Raises:
            FabricError: the store is closed, or it is a symmetric one (no new buffers).
        """
        self._check_open()
        if self.nvshmem is not None:
            raise self._no_symmetric_buffer()
        assert self.layout is not None
        region: Region | DeviceRegion
        if self.device.type == "cuda":
            region = DeviceRegion(self.layout.nbytes, self.device)
        else:
            region = Region.create(f"{self.worker.name}-{self.model}", self.layout.nbytes)
            region.populate(background=True)
        buffer = _Buffer(region)
        self._buffers.append(buffer)
        return buffer

    def _no_symmetric_buffer(self) -> FabricError:
        """Why a symmetric store cannot have another buffer now."""
        if self._buffers:
            return FabricError(f"model {self.model!r}: all {len(self._buffers)} symmetric buffers "
                               "hold versions readers still need; retract or release one first "
                               "(or open the store with more buffers)")
        return FabricError(f"model {self.model!r} lives in NVSHMEM symmetric memory, whose "
                           "buffers every PE allocates together in attach: attach the model on "
                           "every PE first")

    def _allocate_symmetric(self) -> _Buffer:
        """Every symmetric buffer at once (collective); returns the first."""
        assert self.layout is not None and self.nvshmem is not None
        for i in range(self.buffers):
            region = SymmetricBuffer(self.nvshmem, f"{self.model}/{i}", self.layout.nbytes,
                                     self.chunk_size)
            self._buffers.append(_Buffer(region))
        return self._buffers[0]

    def _ready(self, buffer: _Buffer) -> _Buffer:
        """`buffer`, fully populated (the caller finishes what the background has not);
        a buffer that cannot be populated is freed.

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

    def _drop(self, buffer: _Buffer) -> None:
        with self._lock:
            if buffer in self._buffers:
                self._buffers.remove(buffer)
            buffer.region.close()

    def _prepare_spare(self) -> None:
        """With `prepare_spare`, start populating a spare buffer now, so the next
        version does not wait for fresh pages; only up to `PREPARED_BUFFERS`."""
        with self._lock:
            if (not self.prepare_spare or self.layout is None or self._closed
                    or len(self._buffers) >= PREPARED_BUFFERS
                    or any(b is not self._active and b.version is None for b in self._buffers)):
                return
            try:
                self._new_buffer()
            except ArenaError as exc:  # an optimisation: the next version allocates it
                log.warning("%s: no spare buffer prepared: %s", self.model, exc)

    def _drop_spares(self) -> None:
        """Stop preparing spares and free unused ones (an in-place publisher keeps its
        tensors in the active buffer and never writes into a spare)."""
        with self._lock:
            self.prepare_spare = False
            if self.nvshmem is not None:
                return  # symmetric buffers are freed together, in close
            for buffer in [b for b in self._buffers if b is not self._active and b.version is None]:
                self._drop(buffer)

    def _spare_buffer(self) -> _Buffer:
        """A buffer that is neither active nor needed by readers, reclaiming the oldest
        versions whose retract the hub allows, or allocating a new one."""
        for buffer in sorted((b for b in self._buffers
                              if b is not self._active and not b.pending and not b.releasing),
                             key=lambda b: b.version or -1):
            if buffer.version is None and getattr(buffer.region, "populate_error", None):
                self._drop(buffer)  # /dev/shm had no room for it; try afresh below
                continue
            if buffer.version is None:
                if self._drained(buffer, 5.0):
                    return buffer
                continue  # a read of its last exposure is still in flight
            try:
                if buffer.exposed is None or self.retract(buffer.version, wait=5.0) == "done":
                    buffer.version = None
                    return buffer
            except RetentionError:
                continue  # another reader may still need it; try the next one
        if len(self._buffers) >= MAX_BUFFERS:
            raise FabricError(f"model {self.model!r}: all {MAX_BUFFERS} buffers hold versions "
                              "readers still need or fetches whose result() was not called "
                              "yet; retract or release one, or call result(), first")
        return self._new_buffer()

    def _expose_spare(self, version: int, chunk_size: int) -> tuple[_Buffer, ChunkProgress]:
        """A spare buffer, exposed empty as `version` (a partial replica that fills)."""
        assert self.layout is not None
        with self._lock:
            buffer = self._spare_buffer()
            progress = self._progress(buffer, chunk_size)
            buffer.exposed = self.worker.server.expose(
                region_name(self.model, version, self.shard), buffer.region.tensor,
                chunk_size=chunk_size, progress=progress, **_reach(buffer.region))
            buffer.version = version
            return buffer, progress

    def _progress(self, buffer: _Buffer, chunk_size: int, *, complete: bool = False
                  ) -> ChunkProgress:
        """Progress of a new exposure of ``buffer`` (symmetric: also its flags, reset)."""
        if isinstance(buffer.region, SymmetricBuffer):
            return buffer.region.progress(complete=complete)
        assert self.layout is not None
        return ChunkProgress(-(-self.layout.nbytes // chunk_size), complete=complete)

    def _unexpose(self, buffer: _Buffer, *, timeout: float = 5.0) -> None:
        """Forget the buffer's version; it stays `exposed` (not reused, see
        `_spare_buffer`) while a read of it is still in flight after `timeout`."""
        self._drained(buffer, timeout)
        buffer.version, buffer.pending = None, False

    def _drained(self, buffer: _Buffer, timeout: float) -> bool:
        """Retract the buffer's exposure on the read server; True (and no longer
        exposed) once no read of it is in flight, False if one still is after `timeout`."""
        if buffer.exposed is not None and not self.worker.server.retract(buffer.exposed,
                                                                         timeout=timeout):
            return False
        buffer.exposed = None
        return True

    def _switch_to(self, buffer: _Buffer | None, version: int | None) -> None:
        """Make `buffer`, which a fetch filled with `version`, the active one (None:
        the version was active already).

        Raises:
            FabricError: the store is closed (the buffer was freed with it).
        """
        with self._lock:
            if self._closed:
                raise FabricError(f"model {self.model!r}: the store is closed, and v{version} "
                                  "was freed with it; open another store and fetch again")
            if buffer is None:
                return
            if buffer not in self._buffers or buffer.version != version:
                raise FabricError(f"model {self.model!r} v{version}: its buffer was released or "
                                  "reused before result() was called; fetch it again")
            if not buffer.pending:
                raise FabricError(f"model {self.model!r} v{version}: a newer version "
                                  f"(v{self.version}) became active before result() was called, "
                                  "so its buffer is no longer reserved; fetch it again")
            self._activate(buffer)

    def _activate(self, buffer: _Buffer) -> None:
        with self._lock:
            self._set_active(buffer)
            if self._attached is not None and self.layout is not None:
                for name, view in views(self.layout, buffer.region.tensor).items():
                    self._attached[name].data = view
            self._prepare_spare()

    def _set_active(self, buffer: _Buffer) -> None:
        """Make `buffer` active; fetched buffers of older versions no future switched
        to lose their reservation (a superseded future must not pin memory)."""
        self._active = buffer
        buffer.pending = False
        for other in self._buffers:
            if (other.pending and other.version is not None and buffer.version is not None
                    and other.version < buffer.version):
                other.pending = False

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, t in tensors.items():
            if t.device != self.device:
                raise TypeError(f"model {self.model!r} lives on {self.device}; tensor {name!r} is "
                                f"on {t.device} (open the store with device={str(t.device)!r})")
        return tensors

    def _require_attached(self) -> dict[str, torch.Tensor]:
        if self._attached is None:
            raise FabricError(f"model {self.model!r}: nothing to publish; pass the tensors or "
                              "attach them first")
        return self._attached

    def _check_in_place(self, obj: nn.Module | Mapping[str, torch.Tensor] | None) -> None:
        attached = self._require_attached()
        if obj is not None:
            given = named_tensors(obj)
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


def _reach(region: Region | DeviceRegion | SymmetricBuffer) -> dict[str, object]:
    """How readers reach a buffer without the read server: its shared-memory file, or
    its GPU descriptor (`ReadServer.expose` arguments)."""
    if region.path is None:
        return {"gpu": region.gpu}
    return {"shm_path": str(region.path)}


def _quietly(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # cleanup after a failure must not hide the failure
        log.warning("cleanup %s failed: %s", getattr(fn, "__name__", fn), exc)
