"""`StorePublishing`: how a `ModelStore` publishes versions, and makes derived ones.

A snapshot `publish` lays the tensors out (names normalized, tied tensors once, DTensors
as local shards, an optional cast: `tensorset.prepare`), packs them into a spare buffer
with their chunk checksums, exposes it and commits it at the hub; an in-place one exposes
the attached tensors' buffer as it is. A publish that fails after the hub assigned its
number aborts that version. `reserve` fixes the layout and starts populating the buffer
ahead of the first snapshot, `wait_replicated` waits for other holders before a trainer
leaves, and `produce` makes a version computed here rather than read (a derived layout):
it fills a spare buffer through a `Production` while peers copy what is final. The
buffers themselves are `store_buffers`'s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from weightfabric.fabric.buffer_pool import Buffer
from weightfabric.fabric.checks import check_version
from weightfabric.fabric.dtensors import local_shards
from weightfabric.fabric.errors import (
    BadRequestError,
    FabricError,
    NoSourceError,
    ReplicationTimeoutError,
    TensorSetError,
    UnknownVersionError,
)
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.progress import ChunkProgress, SlotMarks
from weightfabric.fabric.store_buffers import FAILED_DRAIN_S, StoreBuffers
from weightfabric.fabric.store_state import log, quietly
from weightfabric.fabric.tensorset import (
    PreparedSet,
    check_has_data,
    manifest_of,
    named_tensors,
    normalize_names,
    prepare,
    views,
)
from weightfabric.kernels import pack, pack_with_checksums
from weightfabric.kernels.checksum import ChunkSums


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


class StorePublishing(StoreBuffers):
    """The publishing part of `ModelStore`: lay out, pack, expose, commit; produce."""

    _published: int | None  # the last version this store published

    def reserve(self, obj: nn.Module | Mapping[str, torch.Tensor], *,
                dtype: torch.dtype | None = None, normalize_names: bool = True) -> None:
        """Lay out ``obj`` and start populating the buffer its first snapshot will fill.

        A trainer calls this at start-up, so that its first ``publish(obj)`` copies into
        memory already faulted in (off the critical path, in the background) instead of
        paying for fresh pages then (about 0.5-1 s per GB of /dev/shm). Nothing is
        published or copied. Arguments as for `publish`; a later publish must lay its
        tensors out the same way. A GPU store allocates (and exports) that buffer now.

        Raises:
            FabricError, TensorSetError: as `publish` (another layout, bad tensors).
        """
        with self._lock:
            self._adopt(self._prepare(obj, dtype, normalize_names))
        self._prepare_spare()

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
                buffer = self._ready(self._snapshot_buffer())
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
        quietly(functools.partial(self.hub.abort_publish, reason=reason), self.model, version)

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

    # --- tensor sets -------------------------------------------------------------------

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
