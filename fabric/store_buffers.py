"""`StoreBuffers`: a `ModelStore`'s buffers, and the versions they hold.

A store's memory is a few model-sized buffers (a `BufferPool`); this part allocates them
(a host buffer populates its pages in the background, a symmetric store allocates all of
its buffers at once in `attach`), keeps a populated spare ready (``prepare_spare``), picks
the buffer the next version goes into (a spare, an older version the hub lets it retract,
or, in place, the active one), exposes buffers on the read server and withdraws them once
no read is in flight, switches the attached tensors to the active one, and stops serving
or frees the versions held (`retract`, `quarantine`, `release`). Publishing
(`store_publish`) and fetching (`store_fetch`) build on it; the rules of which buffer may
be reused are the `BufferPool`'s.
"""

from __future__ import annotations

import time
from typing import cast

import torch

from weightfabric.fabric.arena import Region
from weightfabric.fabric.buffer_pool import Buffer
from weightfabric.fabric.errors import (
    ArenaError,
    FabricError,
    RetentionError,
    UnknownVersionError,
)
from weightfabric.fabric.gpu.region import DeviceRegion, SymmetricBuffer
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.store_state import StoreState, log
from weightfabric.fabric.tensorset import views
from weightfabric.fabric.transports.server import Exposure

StoreRegion = Region | DeviceRegion | SymmetricBuffer
"""The memory of a store's buffer: a shared-memory file, a GPU allocation, or symmetric memory."""

IN_PLACE_DRAIN_S = 30.0
"""Seconds an in-place fetch waits for peers' reads of the version it overwrites."""
SNAPSHOT_RETRACT_S = 0.2
"""Seconds a snapshot publish waits for the hub to retract the version in its active
buffer, to write into those populated pages instead of a spare still populating."""
FAILED_DRAIN_S = 0.5
"""Seconds a failed fetch waits for peers' reads of its partial replica before it raises
(and a fetch for its early exposure in other chunks than the publisher's); a buffer
still being read stays exposed, and is not reused, until they end."""


class StoreBuffers(StoreState):
    """The buffers part of `ModelStore`: allocate, expose, reuse, switch, free."""

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

    # --- buffers -----------------------------------------------------------------------

    def _held(self, version: int) -> Buffer | None:
        """Reserve a non-active buffer that holds all of `version`; else None.

        A buffer other than the active one that holds all of `version` (a fetched or
        published copy kept, e.g. pinned), reserved for the fetch's future; else None.
        """
        with self._lock:
            return self.pool.reserve(version)

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
        """With `prepare_spare`, make a spare buffer now (host memory populates it meanwhile).

        So that the next version waits neither for fresh pages nor for a GPU allocation and
        its IPC export; only up to `PREPARED_BUFFERS`.
        """
        with self._lock:
            if (not self.prepare_spare or self.layout is None or self._closed
                    or not self.pool.wants_spare()):
                return
            try:
                self._new_buffer()
            except (ArenaError, torch.OutOfMemoryError) as exc:  # the next version allocates it
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

    def _snapshot_buffer(self) -> Buffer:
        """The buffer a snapshot `publish` fills: a spare (`_spare_buffer`), with one exception.

        A store that only publishes (nothing attached) whose spare is still populating
        (its first versions, back to back) takes its active buffer instead, whose pages
        are there, if its version may go: no read of it in flight here, and the hub lets
        it retract (other workers hold it) at once. Else the spare, finished in line.
        """
        active = self.pool.active
        if (self._attached is None and active is not None and active.version is not None
                and active.exposed is not None and not active.exposed.inflight
                and not active.pending and not active.releasing and _populated(active)
                and any(not _populated(b) for b in self.pool.unused())):
            try:
                state = self.retract(active.version, wait=SNAPSHOT_RETRACT_S)
            except RetentionError:
                state = "kept"
            if state == "done":
                self.pool.forget(active)
                return active
        return self._spare_buffer()

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


def _populated(buffer: Buffer) -> bool:
    """Whether every page of ``buffer`` is there (always, outside host memory)."""
    region = buffer.region
    return not isinstance(region, Region) or region.populated_bytes >= region.nbytes
