"""`StoreFetching`: how a `ModelStore` fetches versions and switches to them.

A fetch runs on the store's one fetch thread: it exposes a spare buffer as a partial
replica (before the hub lists this worker, so peers find it at once), reads the version's
chunks into it with the fetch engine (`fabric.fetch`, planned by the hub, deltas against
the version held where they pay), and hands back a `FetchFuture` whose `result` switches
the store's tensors in the caller's thread. `sync` is the rollout loop's call: wait for
a newer version (`fetch_newer`) and fetch it. Which buffer a version goes into, and the
switch itself, are `store_buffers`'s.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from weightfabric.fabric.arena import Region
from weightfabric.fabric.buffer_pool import Buffer
from weightfabric.fabric.checks import check_version
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.deltas import DeltaBase, DeltaPolicy, delta_mode, word_width
from weightfabric.fabric.errors import FabricError, ManifestMismatchError, UnknownVersionError
from weightfabric.fabric.fetch import (
    FetchError,
    FetchOptions,
    FetchStats,
    fetch_chunks,
    verify_rule,
)
from weightfabric.fabric.fetch_planner import HubPlanner
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.store_buffers import FAILED_DRAIN_S, StoreBuffers
from weightfabric.fabric.store_state import log, quietly
from weightfabric.fabric.tensorset import check_compatible, layout_from_manifest
from weightfabric.fabric.transports.selector import TransportSelector
from weightfabric.kernels import chunk_checksums, copy_with_checksums

if TYPE_CHECKING:
    from weightfabric.fabric.store import ModelStore

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


class StoreFetching(StoreBuffers):
    """The fetching part of `ModelStore`: fetch into a spare buffer, switch at `result`."""

    transports: TransportSelector
    delta_policy: DeltaPolicy
    _fetcher: ThreadPoolExecutor
    _cancel: threading.Event
    _early_chunk_size: int
    on_fetched: Callable[[str, FetchStats], None] | None = None
    """Told of each fetch that read a version (model, stats): the worker's metrics."""

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
        return FetchFuture(cast("ModelStore", self), inner)  # only ModelStore has this part

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
            quietly(hub.release, plan.fetch_id)
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
                checksum_fn=lambda c, piece: chunk_checksums(
                    piece, manifest.chunk_size, first_chunk=c).tolist(),
                copy_checksums=lambda dst, src, c: copy_with_checksums(
                    dst, src, manifest.chunk_size, first_chunk=c),
                verify=verify_rule(verify), options=options, on_chunk=on_chunk,
                before_write=populate, cancel=self._cancel, delta=delta)
            if deferred is not None:
                self._check_deferred(plan.version, deferred, options.deadline)
            with self._lock:
                buffer.pending = True  # before the hub lists it complete: reserved from now
            hub.complete_fetch(plan.fetch_id, traffic={
                w: [n, stats.wire.get(w, n)] for w, n in stats.sources.items()})
        except BaseException as exc:
            quietly(hub.release, plan.fetch_id)
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
        if self.on_fetched is not None:
            self.on_fetched(self.model, stats)
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
