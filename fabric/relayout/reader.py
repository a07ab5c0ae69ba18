"""Fetch a version into another tensor-parallel layout, transforming it as it lands.

The trainer's model-parallel ranks publish their shards of one version
(``worker.model(name, shard=k, num_shards=n)`` and ``publish(group=...)``). A reader
whose layout differs (another TP degree, fused QKV or gate-up split differently,
fp8 stored and bf16 wanted) cannot take any shard as it is. A `ReshardReader`
asks the hub where each shard of a version lives (`HubClient.locate`), plans the
rows its rank needs (`fabric.relayout.staging.plan_staging`, bounded by ``budget``), reads
each band of rows from a holder of that shard through the worker's transports,
and runs the reshard and dequantisation kernels into the reader's tensors; it
keeps its buffers for the next version. `fetch_resharded` is the one-shot form.

The reader holds no replica: it does not serve what it read, and the hub records
nothing, so a holder may retract meanwhile; its read server then refuses the read
and the next holder of that shard is tried.

Verification (`fabric.fetch.band_verify_rule`): by default the bands read from
holders on other hosts are checked against the shard's published chunk checksums,
same-host bands are not (``verify=True`` checks all, ``False`` none): a verified
band is widened to whole chunks, which multiplies the bytes read. Bands do not align with chunks, so a verified band is read as
the whole chunks covering it; each is checked, then the band's bytes are copied
into staging. Chunks a band only partly covers stay in a small cache for the
neighbouring band. A bad chunk counts as its holder failing: the next holder of
the shard is tried, and `FetchError` names the chunk when none is left. The
scratch and cache are memory beyond ``budget`` (bounded: see `ReshardReader`).
This covers staged reads only; `fabric.relayout.direct.run_direct` loads peer memory in
place and checks nothing.

fp8: a tensor stored as ``float8_e4m3fn`` carries its blockwise float32 scales as
the tensor ``name + scale_suffix`` of the same shard.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weightfabric.fabric.checks import check_version
from weightfabric.fabric.errors import FetchError, ManifestMismatchError, TransportError
from weightfabric.fabric.fetch import Source, band_verify_rule
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.relayout.staging import (
    FP8,
    HeldTensor,
    Staging,
    StagingPlan,
    WantedTensor,
    plan_staging,
    run_staging,
)
from weightfabric.fabric.tensorset import layout_from_manifest
from weightfabric.fabric.transports import SourceAddress
from weightfabric.fabric.transports.base import CopyFn
from weightfabric.fabric.transports.shm import ShmTransport
from weightfabric.kernels import Layout, chunk_checksums
from weightfabric.kernels.fp8 import DEFAULT_BLOCK, check_block, scale_shape

if TYPE_CHECKING:
    from weightfabric.fabric.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resharding:
    """How one logical tensor is split on each side.

    Attributes:
        shape: the logical (unsharded) shape, 1-D or 2-D.
        held: the publishers' layout (its ``tp`` is the version's number of shards).
        wanted: the reader's layout.
        block: for a tensor published in fp8, the edge of the square blocks its
            publishers quantised with (``kernels.quantize_fp8(block=)``).
    """

    shape: tuple[int, ...]
    held: Layout
    wanted: Layout
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        check_block(self.block, "Resharding")


@dataclass
class ReshardStats:
    """What `fetch_resharded` did.

    Attributes:
        fetched_bytes: bytes read from holders: the bands, widened to whole chunks
            where verified, and reads discarded for a bad checksum.
        useful_bytes: bytes of source elements that land in a destination.
        staging_peak_bytes: the staging buffer (at most ``budget``).
        verify_peak_bytes: verification memory beyond it (scratch and chunk cache),
            including what a kept `ReshardReader` still holds from earlier fetches.
        verified_chunks: chunks read and found to match their checksums.
        reused_chunks: verified chunks taken from the cache instead of read again.
        sources: worker -> bytes of accepted reads from it.
        failed_sources: holders that failed a read or sent a bad chunk, in order.
    """

    version: int
    seconds: float = 0.0
    bands: int = 0
    fetched_bytes: int = 0
    useful_bytes: int = 0
    staging_peak_bytes: int = 0
    verify_peak_bytes: int = 0
    verified_chunks: int = 0
    reused_chunks: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    failed_sources: list[str] = field(default_factory=list)


def held_tensors(manifests: list[Manifest], tensors: Mapping[str, Resharding], *,
                 scale_suffix: str = ".scale") -> list[HeldTensor]:
    """`HeldTensor`s of ``tensors`` from the shards' manifests (offsets, stored dtypes).

    A name a shard publishes as an alias (tied weights) reads its published tensor's bytes.

    Raises:
        ManifestMismatchError: a tensor (or an fp8 tensor's scales) is missing from a
            shard, or its stored shape is not what the held layout gives that shard.
    """
    layouts = [layout_from_manifest(m) for m in manifests]
    out = []
    for name, r in tensors.items():
        if r.held.tp != len(manifests):
            raise ManifestMismatchError(f"tensor {name!r}: held layout has tp={r.held.tp}, the "
                                        f"version has {len(manifests)} shards")
        offsets, scales, dtypes = [], [], set()
        for k, lay in enumerate(layouts):
            stored = manifests[k].alias_map().get(name, name)  # a tied tensor's bytes
            if stored not in lay.names:
                raise ManifestMismatchError(f"shard {k} has no tensor {name!r}")
            slot = lay[stored]
            want = r.held.shard_shape(r.shape, k)
            if tuple(slot.shape) not in (want, want[:1] if want[1:] == (1,) else want):
                raise ManifestMismatchError(f"tensor {name!r} is {tuple(slot.shape)} in shard {k}; "
                                            f"the held layout gives {want}")
            offsets.append(slot.offset)
            dtypes.add(slot.dtype)
            if slot.dtype == FP8:
                scale = stored + scale_suffix
                if scale not in lay.names:
                    raise ManifestMismatchError(f"fp8 tensor {name!r} has no scales {scale!r} "
                                                f"in shard {k}")
                grid = scale_shape(tuple(slot.shape), r.block)
                if lay[scale].dtype != torch.float32 or tuple(lay[scale].shape) != grid:
                    raise ManifestMismatchError(
                        f"scales {scale!r} are {lay[scale].dtype} {tuple(lay[scale].shape)} in "
                        f"shard {k}; fp8 blocks of {r.block} need float32 {grid} (pass the "
                        "publishers' block as Resharding(block=...))")
                scales.append(lay[scale].offset)
        if len(dtypes) != 1:
            raise ManifestMismatchError(f"tensor {name!r} is stored as {sorted(map(str, dtypes))} "
                                        "in different shards")
        dtype = dtypes.pop()
        out.append(HeldTensor(name=name, shape=tuple(r.shape), layout=r.held, dtype=dtype,
                              offsets=tuple(offsets),
                              scale_offsets=tuple(scales) if dtype == FP8 else None,
                              block=r.block))
    return out


_CACHED_CHUNKS = 4
"""Verified chunks kept for later bands (LRU)."""


class ChunkBuffers:
    """The memory verified reads reuse, band after band and fetch after fetch.

    ``scratch`` receives a run of whole chunks (grown to the largest run); `_CACHED_CHUNKS`
    slots keep chunks a band used only in part, so the next band does not read them
    again. Both are allocated once and kept: on CPU, first-touch page faults of fresh
    buffers cost more than the copies into them.
    """

    def __init__(self) -> None:
        self._scratch = Staging()
        self._slots = torch.empty(0, 0, dtype=torch.uint8)
        self._cached: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """The memory held: scratch and cache slots."""
        return self._scratch.nbytes + self._slots.numel()

    def clear(self) -> None:
        """Forget the cached chunks (a new fetch); the memory stays."""
        self._cached.clear()

    def scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of scratch on ``device`` (grown, never shrunk)."""
        return self._scratch.get(nbytes, device)[:nbytes]

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        """The cached chunk ``key`` = (shard, chunk), now the most recently used, or None."""
        if key not in self._cached:
            return None
        self._cached.move_to_end(key)
        slot, nbytes = self._cached[key]
        return self._slots[slot, :nbytes]

    def put(self, key: tuple[int, int], chunk: torch.Tensor, chunk_size: int) -> None:
        """Copy ``chunk`` into a slot, evicting the least recently used if all are taken.

        Copy ``chunk`` (at most ``chunk_size`` bytes, its manifest's chunk size) into a
        slot, evicting the least recently used chunk if all are taken. Slots are sized by
        ``chunk_size``, not by the chunk: a shard's short last chunk cached first does not
        make the next full one reallocate them.
        """
        if self._slots.shape[1] < chunk_size or self._slots.device != chunk.device:
            self._cached.clear()
            self._slots = torch.empty(0, 0, dtype=torch.uint8)
            self._slots = torch.empty(_CACHED_CHUNKS, chunk_size, dtype=torch.uint8,
                                      device=chunk.device)
        taken = {slot for slot, _ in self._cached.values()}
        if len(taken) < _CACHED_CHUNKS:
            slot = min(set(range(_CACHED_CHUNKS)) - taken)
        else:
            slot, _ = self._cached.popitem(last=False)[1]
        self._slots[slot, :chunk.numel()].copy_(chunk)
        self._cached[key] = (slot, chunk.numel())


class _BadChunk(Exception):
    """A holder sent a chunk whose checksum is not the published one."""


class ShardReader:
    """``read(shard, offset, out)`` over the holders the hub named, best first.

    ``read(shard, offset, out)`` over the holders the hub named, best first, moving on to
    the next holder of a shard when one fails or sends a chunk whose checksum is wrong.

    Thread-safe: reads may run concurrently (verified ones take turns, sharing
    ``buffers``). A read from a holder ``verify`` selects covers whole chunks: the chunks the band
    touches that are not cached are read in one request into the scratch of
    ``buffers``, each is checked against the shard's manifest, and the band's bytes
    are copied into ``out``. A chunk a band covers only in part (the neighbouring
    band, tensor or fp8 scales start in it) is kept in the cache of ``buffers``, so the
    next band does not read it again. Memory: the scratch (at most the largest read +
    2 chunks) and the cache (4 chunks).
    """

    def __init__(self, worker: Worker, where: dict, manifests: list[Manifest], *,
                 verify: Callable[[Source], bool], timeout: float,
                 buffers: ChunkBuffers) -> None:
        self.worker, self.manifests, self.verify, self.timeout = worker, manifests, verify, timeout
        self.model, self.version = where["model"], where["version"]
        self.holders = [list(s["holders"]) for s in where["shards"]]
        self.addresses = {w: SourceAddress.from_dict(info["endpoints"]["read"],
                                                     cap=info.get("cap", b""))
                          for w, info in where["workers"].items() if "read" in info["endpoints"]}
        self.failed: list[str] = []
        self.sources: dict[str, int] = {}
        self.fetched_bytes = self.verified_chunks = self.reused_chunks = 0
        self.buffers = buffers
        buffers.clear()
        self._lock = threading.Lock()        # the counters, `failed`
        self._verifying = threading.Lock()   # `buffers`: one verified read at a time
        # a kept reader holds the memory of its earlier verified fetches, used or not
        self.verify_peak_bytes = buffers.nbytes

    def __call__(self, shard: int, offset: int, out: torch.Tensor,
                 copy: CopyFn | None = None) -> None:
        """Fill ``out`` with the bytes at ``offset`` of ``shard``, from its best holder left.

        ``copy(dst, src)`` does the copy where the transport maps the source (shared
        memory) and the read is not verified (`Transport.fuses_copy`).

        Raises:
            FetchError: no holder of the shard could serve them.
        """
        errors = []
        for source in self._sources(shard):
            try:
                if self._verified(shard, source):
                    with self._verifying:
                        nbytes = self._read_verified(source, shard, offset, out)
                else:
                    nbytes = self._read(source, offset, out, copy)
            except (TransportError, _BadChunk) as exc:
                self._give_up(shard, source, exc)
                errors.append(f"{source.worker}: {exc}")
                continue
            self._served(source, nbytes)
            return
        raise FetchError(f"{self.model!r} v{self.version} shard {shard}: no holder could serve "
                         f"bytes [{offset}, {offset + out.numel()}): {'; '.join(errors) or 'none left'}")

    @contextmanager
    def mapped(self, shard: int, offset: int, nbytes: int, ranges: list[tuple[int, int]]
               ) -> Iterator[torch.Tensor | None]:
        """One lease on ``[offset, offset + nbytes)`` of ``shard``: its mapped bytes, or None.

        For many blocks of one span (`ShmTransport.mapped`): the best holder left, when
        it is on this host in shared memory and its bytes need no verifying; the block
        copies ``ranges`` (region offsets) out of the yielded tensor. None: no such holder
        (read block by block instead). Holders that refuse the lease are given up on.

        Raises:
            TransportError: the lease was lost before the block ended (discard the copies).
        """
        with contextlib.ExitStack() as stack:
            src, used = None, None
            for source in self._sources(shard):
                try:
                    transport = self.worker.transport_for(source, timeout=self.timeout)
                    if not isinstance(transport, ShmTransport) or self._verified(shard, source):
                        break
                    src = stack.enter_context(transport.mapped(
                        source.address, source.region, offset, nbytes, ranges,
                        timeout=self.timeout))
                    used = source
                    break
                except TransportError as exc:
                    self._give_up(shard, source, exc)
            yield src
        if used is not None:     # the lease held to the end
            copied = sum(n for _, n in ranges)
            with self._lock:
                self.fetched_bytes += copied
            self._served(used, copied)

    def _sources(self, shard: int) -> Iterator[Source]:
        """The holders of ``shard`` not given up on, best first."""
        for holder in self.holders[shard]:
            if holder not in self.failed and holder in self.addresses:
                yield Source(holder, self.addresses[holder],
                             region_name(self.model, self.version, shard))

    def _verified(self, shard: int, source: Source) -> bool:
        """Whether bytes of ``shard`` read from ``source`` are checked against its checksums."""
        return bool(self.manifests[shard].checksums) and self.verify(source)

    def _give_up(self, shard: int, source: Source, exc: Exception) -> None:
        log.warning("read of shard %d from %s failed (%s); trying the next holder", shard,
                    source.worker, exc)
        with self._lock:
            self.failed.append(source.worker)

    def _served(self, source: Source, nbytes: int) -> None:
        with self._lock:
            self.sources[source.worker] = self.sources.get(source.worker, 0) + nbytes

    def _read(self, source: Source, offset: int, out: torch.Tensor,
              copy: CopyFn | None = None) -> int:
        """Fill ``out`` from ``source``; returns the bytes read (counted in `fetched_bytes`)."""
        transport = self.worker.transport_for(source, timeout=self.timeout)
        fused: dict[str, Any] = ({"copy": copy} if copy is not None and transport.fuses_copy
                                 else {})
        transport.read(source.address, source.region, offset, out, timeout=self.timeout,
                       **fused)
        with self._lock:
            self.fetched_bytes += out.numel()
        return out.numel()

    def _read_verified(self, source: Source, shard: int, offset: int, out: torch.Tensor) -> int:
        """Fill ``out`` from verified whole chunks, cached or read from ``source``.

        Returns the bytes read (whole chunks; none for chunks found in the cache).

        Raises:
            TransportError: the read failed.  _BadChunk: a chunk's checksum is wrong.
        """
        manifest, end = self.manifests[shard], offset + out.numel()
        size = manifest.chunk_size
        touched = range(offset // size, (end - 1) // size + 1)
        chunks = {c: self.buffers.get((shard, c)) for c in touched}
        need = [c for c, chunk in chunks.items() if chunk is None]
        run = range(need[0], need[-1] + 1) if need else range(0)
        nbytes = 0
        if run:
            got, nbytes = self._read_chunks(source, shard, run, out.device)
            chunks.update(got)
        self.reused_chunks += len(touched) - len(run)
        partly_used = []
        for c, chunk in chunks.items():
            assert chunk is not None, "every chunk not cached is in run, read just above"
            a, b = max(offset, c * size), min(end, (c + 1) * size)
            out[a - offset:b - offset].copy_(chunk[a - c * size:b - c * size])
            if c in run and (a > c * size or b < min((c + 1) * size, manifest.total_bytes)):
                partly_used.append((c, chunk))
        for c, chunk in partly_used:  # after the copies: caching may evict a chunk used above
            self.buffers.put((shard, c), chunk, size)
        self.verify_peak_bytes = max(self.verify_peak_bytes, self.buffers.nbytes)
        return nbytes

    def _read_chunks(self, source: Source, shard: int, run: range,
                     device: torch.device) -> tuple[dict[int, torch.Tensor], int]:
        """Read chunks ``run`` of ``shard`` in one request and check them.

        Chunks ``run`` of ``shard``, read in one request into the scratch buffer and checked
        against the manifest's checksums: chunk -> its bytes (scratch views), and the bytes
        read.
        """
        manifest = self.manifests[shard]
        size = manifest.chunk_size
        lo, hi = run[0] * size, min(run[-1] * size + size, manifest.total_bytes)
        span = self.buffers.scratch(hi - lo, device)
        nbytes = self._read(source, lo, span)
        sums = chunk_checksums(span, size, first_chunk=run[0]).tolist()
        for c, got in zip(run, sums, strict=True):
            if got != manifest.checksums[c]:
                raise _BadChunk(f"chunk {c} failed its checksum")
        self.verified_chunks += len(run)
        return {c: span[(c - run[0]) * size:][:size] for c in run}, nbytes


class ReshardReader:
    """Reads versions of a sharded model into this rank's tensors in another layout.

    One per reader rank and model, kept across training steps: `fetch` plans each
    version anew (the hub names the holders; the shards' manifests may change) but
    reuses its buffers, so a loop that fetches every version does not allocate and
    fault in fresh staging memory each time. It holds up to ``budget`` bytes of
    staging and, once a verified read ran, the verification memory described under
    ``budget``; drop the reader to free them.

    Args:
        worker: the reader's worker (its transports are used).
        model: the model the publishers' ranks publish shards of.
        tensors: name -> `Resharding` (logical shape, held and wanted layouts).
        rank: this reader's rank in the wanted layouts.
        budget: staging bytes at any one time. Verified reads need more, beyond it: a
            scratch buffer as large as the largest band widened to whole chunks (at
            most band + 2 chunks) and a cache of 4 chunks, so at most the largest
            band + 6 x ``chunk_size`` of the shards' manifests (``verify_peak_bytes``).
        scale_suffix: an fp8 tensor ``name``'s blockwise scales are the tensor
            ``name + scale_suffix`` of the same shard.
        verify: check the bytes against the published chunk checksums: all (True),
            none (False), or by default (None) only those read from other hosts.
            A shard published without checksums is read unverified.
        timeout: per band read.
    """

    def __init__(self, worker: Worker, model: str, tensors: Mapping[str, Resharding], *,
                 rank: int, budget: int = 64 << 20, scale_suffix: str = ".scale",
                 verify: bool | None = None, timeout: float = 30.0) -> None:
        self.worker, self.model, self.tensors, self.rank = worker, model, dict(tensors), rank
        self.budget, self.scale_suffix, self.timeout = budget, scale_suffix, timeout
        self._verify = band_verify_rule(verify)
        self._staging = Staging()
        self._chunks = ChunkBuffers()

    def fetch(self, dst: Mapping[str, torch.Tensor], version: int | str = "latest", *,
              wanted_dtypes: Mapping[str, torch.dtype] | None = None) -> ReshardStats:
        """Read ``version`` into ``dst``, band by band, in place.

        A fetch that raises once bands were written leaves ``dst`` part new version,
        part what it held (unlike `ModelStore.fetch`, which fills a spare buffer):
        fetch into tensors the engine is not using, or fetch again before using them.

        Args:
            dst: name -> this rank's destination (the wanted layout's shard shape, any
                device the kernels run on; 1-D tensors as 1-D).
            version: a committed version's number, or ``"latest"``.
            wanted_dtypes: dtype per tensor (default: each ``dst`` tensor's dtype).

        Returns:
            `ReshardStats`.

        Raises:
            UnknownModelError, UnknownVersionError, NoSourceError: from the hub.
            ManifestMismatchError: the shards do not hold the tensors as described.
            FetchError: some band could not be read from any holder of its shard (none
                left, or every one failed or sent a chunk with a bad checksum).
            BadRequestError: ``version`` is not an ``int > 0`` or ``"latest"``.
            ValueError, TypeError: bad layouts, budget or destinations (see `plan_staging`).
        """
        version = check_version(version)
        missing = sorted(set(self.tensors) - set(dst))
        if missing:
            raise ValueError(f"resharded fetch: no destination for {missing}")
        start = time.monotonic()
        where = self.worker.hub.locate(self.model, version)
        manifests = [Manifest.from_wire(s["manifest"]) for s in where["shards"]]
        held = held_tensors(manifests, self.tensors, scale_suffix=self.scale_suffix)
        dtypes = dict(wanted_dtypes or {})
        wanted = [WantedTensor(name=n, layout=r.wanted, dtype=dtypes.get(n, dst[n].dtype))
                  for n, r in self.tensors.items()]
        plan: StagingPlan = plan_staging(held, wanted, rank=self.rank, budget=self.budget)
        read = ShardReader(self.worker, where, manifests, verify=self._verify,
                            timeout=self.timeout, buffers=self._chunks)
        staged = run_staging(plan, read, dst, staging=self._staging_for(plan, dst))
        stats = ReshardStats(version=where["version"], seconds=time.monotonic() - start,
                             bands=staged.bands, fetched_bytes=read.fetched_bytes,
                             useful_bytes=plan.useful_bytes, staging_peak_bytes=staged.peak_bytes,
                             verify_peak_bytes=read.verify_peak_bytes,
                             verified_chunks=read.verified_chunks,
                             reused_chunks=read.reused_chunks, sources=read.sources,
                             failed_sources=read.failed)
        log.info("fetched %s v%d resharded for rank %d: %d bands, %d bytes in %.3f s", self.model,
                 stats.version, self.rank, stats.bands, stats.fetched_bytes, stats.seconds)
        return stats

    def _staging_for(self, plan: StagingPlan, dst: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The kept staging buffer, replaced when ``plan`` needs more or another device."""
        device = dst[next(iter(self.tensors))].device if self.tensors else torch.device("cpu")
        return self._staging.get(plan.staging_nbytes, device)


def fetch_resharded(worker: Worker, model: str, tensors: Mapping[str, Resharding],
                    dst: Mapping[str, torch.Tensor], *, rank: int, version: int | str = "latest",
                    wanted_dtypes: Mapping[str, torch.dtype] | None = None,
                    budget: int = 64 << 20, scale_suffix: str = ".scale",
                    verify: bool | None = None, timeout: float = 30.0) -> ReshardStats:
    """Read ``version`` of a sharded model into this reader's shards of ``tensors``, once.

    A `ReshardReader` used for one fetch (arguments as there and in its `fetch`); a
    loop fetching every version should keep a `ReshardReader`, which reuses its buffers.

    Raises:
        BadRequestError: ``version`` is not an ``int > 0`` or ``"latest"``.
    """
    version = check_version(version)
    reader = ReshardReader(worker, model, tensors, rank=rank, budget=budget,
                           scale_suffix=scale_suffix, verify=verify, timeout=timeout)
    return reader.fetch(dst, version, wanted_dtypes=wanted_dtypes)
