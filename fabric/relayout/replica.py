"""`LayoutStore`: an engine rank's weights in an engine layout, kept as a derived replica.

A rollout engine rank opens ``worker.layout_model("policy", layout, rank=r)`` and
fetches versions of ``policy`` in its own layout (`EngineLayout`: fused, split
over its tensor/expert-parallel ranks, cast or quantised). For each version N:

The reader asks the hub about N in this layout and rank (`HubClient.begin_derive`
on the hub's derived model ``policy@<layout key>.r<rank>``,
`EngineLayout.derived_model`; from the second version on, the only hub call before
bytes move):

1. ``fetch``: some worker holds N already; the bytes are fetched from it like any
   replica: striped over the holders, chunk-pipelined with other readers, verified
   by the checksums the deriving reader published.
2. ``wait``: another reader derives N now; this one copies it from that reader as
   it is made (the hub plans the uncommitted version, the deriver marks chunks as
   they are final) and checks the bytes against the checksums the deriver commits
   before it switches. A deriver that dies or fails is forgotten by the hub, and
   the next reader derives.
3. ``derive``: this reader derives N: it reads just the blocks of the published
   shards this rank needs (`fabric.relayout.derive`), after checking the layout
   against the version (a `LayoutMismatchError` before any byte moves), into a
   spare buffer it exposed before asking, checksums what it made on the way and
   commits it as N of the derived model.

Either way the new version lands in a spare buffer and the store switches to it at
`FetchFuture.result` (double-buffered, like `ModelStore.fetch`); a version already
held is not read again. Leases, retract, retention and pins work per layout through
the derived model's `ModelStore` (`LayoutStore.store`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from weightfabric.fabric.checks import check_version
from weightfabric.fabric.client import locate_data
from weightfabric.fabric.errors import (
    FetchError,
    LayoutError,
    ManifestMismatchError,
    NoSourceError,
    UnknownVersionError,
    WaitTimeoutError,
)
from weightfabric.fabric.fetch import FetchOptions, FetchStats, band_verify_rule
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.relayout.derive import PublishedVersion, derive
from weightfabric.fabric.relayout.reader import ChunkBuffers, ShardReader
from weightfabric.fabric.relayout.rules import BoundLayout, EngineLayout
from weightfabric.fabric.relayout.staging import Staging
from weightfabric.fabric.store import FetchFuture, ModelStore, Production, fetch_newer
from weightfabric.fabric.tensorset import DEFAULT_CHUNK_SIZE, layout_manifest, layout_of

if TYPE_CHECKING:
    from weightfabric.fabric.buffer_pool import Buffer
    from weightfabric.fabric.hub_messages import DeriveReply
    from weightfabric.fabric.progress import ChunkProgress
    from weightfabric.fabric.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class LayoutFetchStats(FetchStats):
    """`FetchStats` of a layout fetch; ``derived``: this reader derived the version.

    When derived, ``bytes`` and ``sources`` count the reads of the published shards;
    otherwise they count the copy from the layout's other replicas.
    """

    derived: bool = False

    def to_dict(self) -> dict[str, object]:
        """Every field, as plain data (for JSON)."""
        return {**super().to_dict(), "derived": self.derived}


class LayoutStore:
    """Versions of a model in one engine layout, for one rank. Get it with `Worker.layout_model`.

    Args:
        worker: the reader's worker.
        model: the published model's name.
        layout: the engine layout.
        rank: this reader's rank in the layout (``ep_rank * tp + tp_rank``).
        device: where the tensors live (``"cpu"`` or a CUDA device).
        budget: staging bytes per read while deriving.
        derive_wait: seconds to wait for another reader deriving the same version.
        timeout: per read while deriving.
        chunk_size: chunks of the derived versions this reader publishes.
        threads: reads in flight at once while deriving (default: torch's intra-op thread
            count, as the native checksum uses, at most 4; more threads than cores only
            add contention).
    """

    def __init__(self, worker: Worker, model: str, layout: EngineLayout, *, rank: int,
                 device: torch.device | str = "cpu", budget: int = 64 << 20,
                 derive_wait: float = 600.0, timeout: float = 30.0,
                 chunk_size: int | None = None, threads: int | None = None) -> None:
        if not 0 <= rank < layout.ranks:
            raise LayoutError(f"layout {layout.name!r} has {layout.ranks} ranks; rank {rank} "
                              "is outside")
        self.worker, self.model, self.layout, self.rank = worker, model, layout, rank
        self.budget, self.derive_wait, self.timeout = budget, derive_wait, timeout
        self.threads = threads or min(4, torch.get_num_threads())
        self.name = layout.derived_model(model, rank)
        """The hub's name of this layout and rank's derived replicas."""
        self.store: ModelStore = worker.model(self.name, device=device,
                                              chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)
        """The derived model's store: its buffers, exposure, retract and release."""
        self._chunks = ChunkBuffers()
        self._bound: tuple[object, PublishedVersion, BoundLayout] | None = None
        self._staging = [Staging() for _ in range(max(1, self.threads))]

    # ---------------------------------------------------------------- state
    @property
    def version(self) -> int | None:
        """The version the tensors hold now (None before the first one)."""
        return self.store.version

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of the active version, in the engine layout."""
        return self.store.tensors

    def attach(self, tensors: nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Move the engine's own tensors (this rank's, in the layout) into the store, once.

        Afterwards they are views of the active buffer and every fetch switches them to
        the new version (see `ModelStore.attach`).
        """
        self.store.attach(tensors)

    # ---------------------------------------------------------------- fetch
    def fetch(self, version: int | str = "latest", *, verify: bool | None = None,
              options: FetchOptions | None = None) -> LayoutFetchStats:
        """Fetch ``version`` in this layout and switch the tensors to it.

        Args:
            version: an ``int > 0`` or ``"latest"`` (the published model's numbers).
            verify: check chunk checksums: all (True), none (False), or by default every
                chunk of a copy and the derivation reads from other hosts
                (`fabric.fetch.band_verify_rule`).
            options: the copy's fetch options (`ModelStore.fetch`).

        Raises:
            BadRequestError: ``version`` is not an ``int > 0`` or ``"latest"``.
            LayoutMismatchError: the layout does not fit the version (nothing moved).
            UnknownModelError, UnknownVersionError, NoSourceError: from the hub.
            FetchError: bytes could not be read from any holder.
            WaitTimeoutError: another reader derived it for longer than ``derive_wait``.
        """
        stats = self.fetch_async(version, verify=verify, options=options).result()
        assert isinstance(stats, LayoutFetchStats)
        return stats

    def fetch_async(self, version: int | str = "latest", *, verify: bool | None = None,
                    options: FetchOptions | None = None) -> FetchFuture:
        """Start `fetch` in the background; `FetchFuture.result` switches to the version."""
        version = check_version(version)
        return self.store.submit(lambda: self._fetch(version, verify, options or FetchOptions()))

    def sync(self, *, timeout: float = 30.0, verify: bool | None = None,
             options: FetchOptions | None = None) -> LayoutFetchStats:
        """Wait for a version of the model newer than the one held, fetch it, switch.

        A version retired between the wait and the fetch (newer ones were committed
        meanwhile) is followed by the newest one instead, as in `ModelStore.sync`.

        Raises:
            WaitTimeoutError: none newer within ``timeout``; and what `fetch` raises.
        """
        return fetch_newer(self.worker.hub, self.model, lambda: self.version, timeout,
                           lambda v: self.fetch(v, verify=verify, options=options))

    def close(self) -> None:
        """Close the derived model's store (its replicas leave the hub)."""
        self.store.close()

    # ---------------------------------------------------------------- internals
    def _fetch(self, version: int | str, verify: bool | None, options: FetchOptions
               ) -> tuple[Buffer | None, LayoutFetchStats]:
        hub = self.worker.hub
        number = hub.latest(self.model) if version == "latest" else version
        if number is None:
            raise UnknownVersionError(f"{self.model!r} has no committed version yet")
        assert isinstance(number, int)
        if number == self.store.version:
            return None, LayoutFetchStats(version=number)
        held = self.store._held(number)
        if held is not None:
            return held, LayoutFetchStats(version=number)
        end, copy_failed = time.monotonic() + self.derive_wait, False
        while True:
            # The layout of a later version is known already (unless the published shapes
            # changed): one hub call says whether to copy, follow the deriver, or derive.
            known = self.store.layout is not None
            reply, early = self._claim(number) if known else (None, None)
            if reply is None or reply.action == "derive" or (reply.action == "fetch"
                                                             and copy_failed):
                # the first time, the published manifests give the layout (the holders of
                # the published tensors may be gone while engines hold the layout)
                where = (locate_data(reply.base) if reply is not None and reply.base is not None
                         else locate_data(hub.locate_reply(self.model, number,
                                                           manifests_only=reply is None)))
                manifests = [Manifest.from_wire(s["manifest"]) for s in where["shards"]]
                try:
                    published, bound = self._bind(manifests)
                except BaseException as exc:
                    if early is not None:
                        self.store._unexpose(early[0])
                        self._abort(number, exc)
                    raise
                if reply is None:
                    reply, early = self._claim(number)
                    if reply.base is not None:    # to derive: where the published shards are
                        where = locate_data(reply.base)
                if reply.action == "derive" or (reply.action == "fetch" and copy_failed):
                    # a holder the hub still lists could not be read: derive, unregistered
                    return self._derive(number, bound, published, where, manifests, verify,
                                        exposed=early)
            if reply.action == "fetch":
                copied, copy_failed = self._copy(number, verify, options)
                if copied is not None:
                    return copied
                continue
            if reply.by is not None:
                # copy the chunks as the deriver makes them, checked once it commits
                copied, _ = self._copy(number, verify, options)
                if copied is not None:
                    return copied
            left = end - time.monotonic()   # "wait" for the deriver
            if left <= 0:
                raise WaitTimeoutError(
                    f"{self.name!r} v{number}: {reply.by or 'another reader'} has been "
                    f"deriving it for more than {self.derive_wait:g} s; raise derive_wait")
            with contextlib.suppress(WaitTimeoutError):   # answered once the deriver commits
                hub.wait_version(self.name, after=number - 1, timeout=min(left, 1.0))

    def _claim(self, number: int) -> tuple[DeriveReply, tuple[Buffer, ChunkProgress] | None]:
        """`HubClient.begin_derive` of ``number`` in the store's layout.

        A spare buffer is exposed (empty) first, so that peers the hub tells to follow this
        worker find it at once; it stays exposed only when this worker is to derive.
        """
        store = self.store
        assert store.layout is not None
        early = store._expose_spare(number, store.chunk_size)
        try:
            reply = self.worker.hub.begin_derive(
                self.name, number, layout_manifest(store.layout, store.chunk_size),
                with_base=True)
        except BaseException:
            store._unexpose(early[0])
            raise
        if reply.action != "derive":
            store._unexpose(early[0])
            return reply, None
        return reply, early

    def _abort(self, number: int, exc: BaseException) -> None:
        """Give up deriving ``number`` (it failed with ``exc``): the hub retires it."""
        try:
            self.worker.hub.abort_publish(self.name, number,
                                          reason=f"{type(exc).__name__}: {exc}"[:200])
        except Exception as abort_exc:  # the deriver's error matters more
            log.warning("%s v%d: abort after a failed derive failed: %s", self.name, number,
                        abort_exc)

    def _copy(self, number: int, verify: bool | None, options: FetchOptions
              ) -> tuple[tuple[Buffer | None, LayoutFetchStats] | None, bool]:
        """Fetch ``number`` from the layout's replicas (`ModelStore.fetch`).

        While the version is still being derived the copy follows the deriver chunk by
        chunk and is checked against the checksums it commits.

        Returns the fetch's result (or None) and whether it failed.
        """
        try:
            buffer, stats = self.store._fetch(number, verify, options, None)
        except (FetchError, NoSourceError, UnknownVersionError, WaitTimeoutError) as exc:
            log.warning("%s v%d: copying it from its replicas failed (%s); asking the hub "
                        "again", self.name, number, exc)
            return None, True
        return (buffer, LayoutFetchStats(**vars(stats))), False

    def _bind(self, manifests: list[Manifest]) -> tuple[PublishedVersion, BoundLayout]:
        """The layout bound to the version these manifests describe (and checked).

        Kept for the next version: an RL loop's versions lay their tensors out alike, and
        only their checksums differ.
        """
        key = tuple((m.tensors, m.sharding, m.aliases) for m in manifests)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1], self._bound[2]
        published = PublishedVersion.of(manifests)
        bound = self.layout.bind(published.tensors, self.rank, aliases=published.aliases)
        self._set_layout(bound)
        self._bound = (key, published, bound)
        return published, bound

    def _set_layout(self, bound: BoundLayout) -> None:
        layout = layout_of(bound.empty("meta"))
        if self.store.layout is None:
            self.store.layout = layout
        elif self.store.layout != layout:
            raise ManifestMismatchError(
                f"{self.name!r}: this version's tensors in layout {self.layout.name!r} differ "
                "from the ones this store holds (the published shapes changed); open a new "
                "LayoutStore")

    def _derive(self, number: int, bound: BoundLayout, published: PublishedVersion,
                where: dict, manifests: list[Manifest], verify: bool | None, *,
                exposed: tuple[Buffer, ChunkProgress] | None) -> tuple[Buffer, LayoutFetchStats]:
        """Derive ``number`` into ``exposed`` (`_claim`'s) and commit it.

        Without ``exposed`` (a holder the hub lists could not be read), into a spare
        buffer, and the version stays private.
        """
        register = exposed is not None
        hub, start = self.worker.hub, time.monotonic()
        reader = ShardReader(self.worker, where, manifests, verify=band_verify_rule(verify),
                              timeout=self.timeout, buffers=self._chunks)

        def fill(out: Production) -> None:
            stats = derive(bound, published, reader, out.tensors, budget=self.budget,
                           staging=self._staging, done=out.done, place=out.place,
                           written=out.written, mapped=reader.mapped, threads=self.threads)
            log.debug("%s v%d derived: %d bytes in %d reads", self.name, number, stats.bytes,
                      stats.reads)

        def announce(manifest: Manifest) -> None:
            hub.commit(self.name, number, checksums=list(manifest.checksums))

        try:
            buffer = self.store.produce(number, fill, announce if register else None,
                                        exposed=exposed)
        except BaseException as exc:
            if register:
                self._abort(number, exc)
            raise
        stats = LayoutFetchStats(version=number, bytes=reader.fetched_bytes,
                                 seconds=time.monotonic() - start, sources=dict(reader.sources),
                                 failed_sources=list(reader.failed), derived=True)
        log.info("derived %s v%d for %s rank %d: %d bytes in %.3f s", self.model, number,
                 self.layout.name, self.rank, stats.bytes, stats.seconds)
        return buffer, stats


__all__ = ["LayoutFetchStats", "LayoutStore"]
