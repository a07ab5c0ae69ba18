"""Derive one engine rank's tensors from the publishers' shards of a version.

`EngineLayout.bind` says which block of which published tensor every target
tensor is made of (`Piece`s). Here each piece becomes byte reads of the shards
that hold it: a published tensor is whole in one shard, or (an FSDP2/DTensor
publisher) split along one dimension over the version's shards, each shard
holding ``[start, start + local)`` of it (`Manifest.sharding`). A block of a
row-major shard is ``rows`` runs of ``row_bytes`` bytes, ``row_stride`` apart:
one contiguous read when whole rows are wanted, else the span of those rows
(reads of column blocks, such as a row-parallel ``o_proj`` shard, read whole
rows). Rows are read in bands of at most ``budget`` bytes into one reused staging
buffer, and each band is copied (cast on the way) where the target wants it.

fp8 targets are assembled in their ``stage_dtype`` first (a temporary the size of
the tensor), then quantised blockwise (`kernels.quantize_fp8`: Triton on CUDA,
its torch reference on CPU) into the target and its scales. Padding rows (vocab
padding) are zeros.
"""

from __future__ import annotations

import logging
import queue
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from weightfabric.fabric.errors import FetchError, LayoutMismatchError, TransportError
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.relayout.rules import (
    BoundLayout,
    Piece,
    Published,
    TargetTensor,
    assemble,
    quantize_stack,
)
from weightfabric.fabric.relayout.staging import Staging
from weightfabric.fabric.tensorset import dtype_from_name

log = logging.getLogger(__name__)

ReadFn = Callable[..., None]
"""``read(shard, byte_offset, out, copy=None)``: fill ``out`` (contiguous uint8) from that
shard; ``copy(dst, src)``, if given, may do the copy (where the transport maps the source)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names (``bfloat16`` -> ``torch.bfloat16``).

    Raises:
        LayoutMismatchError: not a torch dtype.
    """
    dtype = dtype_from_name(name)
    if dtype is None:
        raise LayoutMismatchError(f"the version stores a tensor as {name!r}, not a torch dtype")
    return dtype


@dataclass(frozen=True)
class Held:
    """Where a slice of a published tensor lives: shard, byte offset, local shape.

    The shard holds ``[start, start + local_shape[dim])`` along ``dim`` of the logical
    tensor (``dim`` None: the whole tensor).
    """

    shard: int
    offset: int
    local_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0


@dataclass(frozen=True)
class PublishedVersion:
    """The tensors of a version as its shards' manifests describe them."""

    tensors: dict[str, Published]
    held: dict[str, tuple[Held, ...]]
    aliases: dict[str, str]

    @classmethod
    def of(cls, manifests: list[Manifest]) -> PublishedVersion:
        """Logical shapes, dtypes and holding shards of every published tensor.

        A tensor in several shards without sharding is replicated: it is read from the
        first shard that holds it.

        Raises:
            LayoutMismatchError: the shards disagree on a tensor's dtype or logical shape.
        """
        tensors: dict[str, Published] = {}
        held: dict[str, list[Held]] = {}
        aliases: dict[str, str] = {}
        for k, m in enumerate(manifests):
            aliases.update(m.alias_map())
            for spec in m.tensors:
                s = m.sharding_of(spec.name)
                shape = s.global_shape if s is not None else spec.shape
                p = Published(tuple(shape), torch_dtype(spec.dtype))
                if tensors.setdefault(spec.name, p) != p:
                    raise LayoutMismatchError(f"tensor {spec.name!r} is {tensors[spec.name]} in "
                                              f"one shard and {p} in shard {k}")
                h = Held(k, spec.offset, tuple(spec.shape), s.dim if s else None,
                         s.start if s else 0)
                if s is not None or not held.get(spec.name):
                    held.setdefault(spec.name, []).append(h)
        return cls(tensors, {n: tuple(h) for n, h in held.items()}, aliases)


@dataclass(frozen=True)
class _Read:
    """One block of one shard: ``rows`` runs of ``row_bytes``, ``stride`` bytes apart."""

    shard: int
    offset: int
    rows: int
    row_bytes: int
    stride: int
    dtype: torch.dtype
    piece: Piece
    row: int        # where the block lands, relative to the piece's destination
    col: int


def _box(p: Piece, ndim: int) -> list[tuple[int, int]]:
    """The piece's block of the logical tensor as one range per dim."""
    box = [] if p.index is None else [(p.index, p.index + 1)]
    box.append(p.rows)
    if p.cols is not None:
        box.append(p.cols)
    assert len(box) == ndim, (p, ndim)
    return box


def _reads(p: Piece, published: PublishedVersion) -> list[_Read]:
    """The reads of shards that fill piece ``p``."""
    dtype = published.tensors[p.source].dtype
    size = dtype.itemsize
    box = _box(p, len(published.tensors[p.source].shape))
    out = []
    for h in published.held[p.source]:
        local = list(box)
        if h.dim is not None:
            a, b = box[h.dim]
            a, b = max(a, h.start), min(b, h.start + h.local_shape[h.dim])
            if a >= b:
                continue
            local[h.dim] = (a - h.start, b - h.start)
        shape = h.local_shape
        if len(shape) == 1:           # [n] as n rows of one element
            (r0, r1), = local
            out.append(_Read(h.shard, h.offset + r0 * size, r1 - r0, size, size, dtype, p,
                             r0 - (box[0][0] - (h.start if h.dim == 0 else 0)), 0))
            continue
        rows_dim = len(shape) - 2     # [E, R, C] or [R, C]
        (r0, r1), (c0, c1) = local[rows_dim], local[rows_dim + 1]
        first = (local[0][0] * shape[1] if len(shape) == 3 else 0) + r0
        cols = shape[-1]
        gr0 = r0 + (h.start if h.dim == rows_dim else 0)
        gc0 = c0 + (h.start if h.dim == rows_dim + 1 else 0)
        out.append(_Read(h.shard, h.offset + (first * cols + c0) * size, r1 - r0,
                         (c1 - c0) * size, cols * size, dtype, p,
                         gr0 - box[rows_dim][0], gc0 - box[rows_dim + 1][0]))
    return out


@dataclass
class DeriveStats:
    """What a derivation read: bytes (including the column gaps of strided blocks) and reads."""

    bytes: int = 0
    reads: int = 0
    staging_bytes: int = 0


MappedFn = Callable[[int, int, int, list[tuple[int, int]]],
                    AbstractContextManager[torch.Tensor | None]]
"""``mapped(shard, offset, nbytes, ranges)``: one lease on that span of the shard, yielding
its mapped bytes (indexed by shard offsets) or None (`ShardReader.mapped`)."""

PIECE_BYTES = 4 << 20
"""A block copied straight from a mapped shard is copied, and reported written, in
pieces of at most this many bytes."""

BATCH_BYTES = 16 << 20
"""Bytes of consecutive targets read together: from each shard they touch, under one
lease when the shard is mapped (`MappedFn`)."""


def derive(bound: BoundLayout, published: PublishedVersion, read: ReadFn,
           dst: Mapping[str, torch.Tensor], *, budget: int = 64 << 20,
           staging: Sequence[Staging] = (),
           done: Callable[[list[str]], None] | None = None,
           place: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
           written: Callable[[torch.Tensor], None] | None = None,
           mapped: MappedFn | None = None, threads: int = 1) -> DeriveStats:
    """Fill ``dst`` (this rank's tensors of ``bound``) from reads of the version's shards.

    Targets are taken in order, in batches of about `BATCH_BYTES`, ``threads`` reads at
    a time (``read`` must then be thread-safe): the reads of the next batches are queued
    while the calling thread waits for the current one's, so targets complete in order
    and the pool stays busy. A batch's blocks in a shard that ``mapped`` maps are copied
    straight out of the mapping under one lease (column blocks too, without reading
    whole rows); the others are read one by one: blocks that land as one contiguous run
    of their target (whole rows, same dtype) straight into it, the rest in bands of at
    most ``budget`` bytes through a staging buffer per thread, then placed.

    Args:
        bound: the layout bound to this version and rank.
        published: the version's tensors (`PublishedVersion.of` its manifests).
        read: reads bytes of a shard (`ReadFn`).
        dst: name -> tensor of `BoundLayout.tensor_specs` (fp8 scales included).
        budget: staging bytes per read (a row wider than this is read whole); fp8
            targets queued ahead also stop at ``budget`` bytes of their staging copies.
        staging: buffers to reuse (missing ones, up to ``threads``, are made).
        done: called with the names of the ``dst`` tensors a batch completed (the
            targets, and their fp8 scales), as soon as they are final, in target order.
        place: copies a contiguous block's bytes into the target (``place(dst, src)``,
            e.g. checksumming them on the way: `fabric.store.Production.place`), passed
            to ``read`` as its ``copy``.
        written: called with each contiguous run of ``dst`` bytes copied straight in, once
            final (pieces of at most `PIECE_BYTES`), so peers may copy it before its batch
            is done (`fabric.store.Production.written`).
        mapped: leases a span of a shard for many blocks (`MappedFn`).
        threads: reads in flight at once.

    Raises:
        LayoutMismatchError: ``dst`` lacks a target or has another shape or dtype.
        FetchError, TransportError: from ``read``, or a lease lost while copying under it
            (no read is in flight once it raises).
    """
    for name, (shape, dtype) in bound.tensor_specs().items():
        t = dst.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise LayoutMismatchError(f"layout {bound.layout.name!r} rank {bound.rank}: "
                                      f"target {name!r} must be {shape} {dtype}, got {got}")
    threads = max(1, threads)
    buffers = [*staging, *(Staging() for _ in range(threads - len(staging)))]
    spare: queue.SimpleQueue[Staging] = queue.SimpleQueue()
    for b in buffers[:threads]:
        spare.put(b)
    device = next(iter(dst.values())).device
    stats = DeriveStats()

    def one(r: _Read, stage: torch.Tensor) -> tuple[int, int]:
        into = _direct_destination(r, stage, r.dtype.itemsize)
        if into is not None:
            read(r.shard, r.offset, into, *(() if place is None else (place,)))
            if written is not None:
                written(into)
            return into.numel(), 1
        buffer = spare.get()
        try:
            return _read_bands(r, read, stage, buffer, budget, device)
        finally:
            spare.put(buffer)

    def group(shard: int, blocks: list[tuple[_Read, torch.Tensor]]) -> tuple[int, int]:
        assert mapped is not None
        ranges = [(r.offset, _span(r)) for r, _ in blocks]
        lo = min(o for o, _ in ranges)
        hi = max(o + n for o, n in ranges)
        try:
            with mapped(shard, lo, hi - lo, ranges) as src:
                if src is not None:
                    for r, stage in blocks:
                        _copy_mapped(r, src, stage, place, written)
                    return sum(n for _, n in ranges), 1
        except TransportError as exc:
            # Some copies were made (checksummed, maybe marked final) and may be torn: this
            # derivation cannot be trusted; the next one starts afresh.
            raise FetchError(f"shard {shard}: the lease on bytes [{lo}, {hi}) was lost "
                             f"while copying them ({exc}); derive again") from exc
        out = [one(r, stage) for r, stage in blocks]
        return sum(n for n, _ in out), sum(k for _, k in out)

    def queue_batch(targets: list[TargetTensor]) -> _Batch:
        stages, blocks = {}, defaultdict(list)
        for target in targets:
            out = dst[target.name]
            stage = stages[target.name] = (
                torch.zeros(target.shape, dtype=target.stage_dtype, device=device)
                if target.scale is not None else out)
            if target.padded and target.scale is None:
                out.zero_()
            for piece in target.pieces:
                for r in _reads(piece, published):
                    blocks[r.shard].append((r, stage))
        futures = ([pool.submit(group, shard, b) for shard, b in blocks.items()]
                   if mapped is not None else
                   [pool.submit(one, r, stage) for b in blocks.values() for r, stage in b])
        return _Batch(targets, stages, futures)

    batches = _batches(bound.targets, published)
    with ThreadPoolExecutor(threads, thread_name_prefix="wf-derive") as pool:
        try:
            window: deque[_Batch] = deque()
            while True:
                while len(window) < 2 * threads and _stage_bytes(window) <= budget:
                    targets = next(batches, None)
                    if targets is None:
                        break
                    window.append(queue_batch(targets))
                if not window:
                    break
                batch = window.popleft()
                for f in batch.futures:
                    nbytes, reads = f.result()
                    stats.bytes += nbytes
                    stats.reads += reads
                names = []
                for target in batch.targets:
                    if target.scale is not None:
                        _quantize_into(target, batch.stages[target.name], dst)
                        names.append(target.scale[0])
                    names.append(target.name)
                if done is not None:
                    done(names)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)   # nothing writes dst after this
            raise
    stats.staging_bytes = sum(b.nbytes for b in buffers)
    return stats


@dataclass
class _Batch:
    """Consecutive targets whose reads are queued, with their staging copies (fp8)."""

    targets: list[TargetTensor]
    stages: dict[str, torch.Tensor]
    futures: list[Future[tuple[int, int]]]


def _batches(targets: Iterable[TargetTensor], published: PublishedVersion
             ) -> Iterator[list[TargetTensor]]:
    """``targets`` in order, cut into runs of about `BATCH_BYTES` of reads."""
    batch: list[TargetTensor] = []
    size = 0
    for target in targets:
        batch.append(target)
        size += sum(_span(r) for piece in target.pieces for r in _reads(piece, published))
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _span(r: _Read) -> int:
    """Bytes of the shard from the block's first byte to its last."""
    return (r.rows - 1) * r.stride + r.row_bytes if r.rows else 0


def _copy_mapped(r: _Read, src: torch.Tensor, stage: torch.Tensor,
                 place: Callable[[torch.Tensor, torch.Tensor], None] | None,
                 written: Callable[[torch.Tensor], None] | None) -> None:
    """Copy block ``r`` from ``src`` (its shard's mapped bytes) where ``stage`` wants it."""
    size = r.dtype.itemsize
    into = _direct_destination(r, stage, size)
    if into is not None:
        for lo in range(0, into.numel(), PIECE_BYTES):
            part = into[lo:lo + PIECE_BYTES]
            block = src[r.offset + lo:r.offset + lo + part.numel()]
            if place is None:
                part.copy_(block)
            else:
                place(part, block)
            if written is not None:
                written(part)
        return
    raw = src[r.offset:r.offset + _span(r)]
    rows = _direct_destination(r, stage, size, strided=True)
    if rows is not None:     # whole rows of the target, read from a wider source: one pass
        block = torch.as_strided(raw, (r.rows, r.row_bytes), (r.stride, 1))
        if place is None:
            rows.view(block.shape).copy_(block)
        else:
            place(rows, block)
        if written is not None:
            written(rows)
        return
    typed = raw.view(r.dtype)
    block = torch.as_strided(typed, (r.rows, r.row_bytes // size), (r.stride // size, 1))
    p = r.piece
    assemble(stage, Piece(p.target, p.source, p.index, (0, r.rows), None, p.entry,
                          p.row + r.row, p.col + r.col), block)


def _stage_bytes(window: Iterable[_Batch]) -> int:
    """Bytes of the fp8 targets' staging copies among the queued batches."""
    return sum(stage.numel() * stage.element_size() for b in window
               for t in b.targets if t.scale is not None for stage in [b.stages[t.name]])


def _read_bands(r: _Read, read: ReadFn, stage: torch.Tensor, staging: Staging, budget: int,
                device: torch.device) -> tuple[int, int]:
    """Read ``r`` in bands of rows through ``staging`` and place them; (bytes, reads)."""
    size = r.dtype.itemsize
    band = max(1, budget // r.stride) if r.row_bytes < r.stride else max(1, budget // r.row_bytes)
    total = reads = 0
    for first in range(0, r.rows, band):
        rows = min(band, r.rows - first)
        if r.row_bytes == r.stride:            # whole rows: one contiguous run
            nbytes = rows * r.row_bytes
        else:
            nbytes = (rows - 1) * r.stride + r.row_bytes
        want = rows * r.stride
        buffer = staging.get(want, device)
        read(r.shard, r.offset + first * r.stride, buffer[:nbytes])
        total += nbytes
        reads += 1
        typed = buffer[:want].view(r.dtype)
        block = torch.as_strided(typed, (rows, r.row_bytes // size), (r.stride // size, 1))
        p = r.piece
        sub = Piece(p.target, p.source, p.index, (0, rows), None, p.entry,
                    p.row + r.row + first, p.col + r.col)
        assemble(stage, sub, block)
    return total, reads


def _direct_destination(r: _Read, stage: torch.Tensor, size: int, *, strided: bool = False
                        ) -> torch.Tensor | None:
    """The target's bytes ``r`` fills, if they are one contiguous run of its dtype; else None.

    With ``strided``, also when the source rows are wider than the block (a column block
    that spans whole rows of the target).
    """
    if r.dtype != stage.dtype or (r.row_bytes != r.stride and not strided):
        return None
    p = r.piece
    dst = stage[p.entry] if p.entry is not None else stage
    row = p.row + r.row
    if dst.dim() == 1:
        view = dst[row:row + r.rows]
    else:
        cols = r.row_bytes // size
        if p.col + r.col != 0 or cols != dst.shape[1]:
            return None
        view = dst[row:row + r.rows]
    if not view.is_contiguous():
        return None
    return view.reshape(-1).view(torch.uint8)


def _quantize_into(target: TargetTensor, stage: torch.Tensor, dst: Mapping[str, torch.Tensor]) -> None:
    assert target.scale is not None and target.fp8_block is not None
    q, s = quantize_stack(stage, target.fp8_block)
    dst[target.name].copy_(q)
    dst[target.scale[0]].copy_(s)


__all__ = ["DeriveStats", "Held", "PublishedVersion", "ReadFn", "derive", "torch_dtype"]
