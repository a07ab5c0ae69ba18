"""Receive-path transforms: fetch a holder's shards through a bounded staging buffer.

When the reader's layout of a tensor set differs from the holder's (tensor-parallel
degree m -> n, fused QKV / gate-up partitions, fp8 -> bf16), bytes cannot land
straight in the reader's weights. Instead, for one reader rank:

1. `plan_staging` intersects every tensor's holder layout with the reader's
   (`kernels.plan_reshard`), keeps the segments this rank writes, and groups the
   source rows they read into *bands*: contiguous row ranges of one source shard,
   each small enough that its bytes (plus the fp8 scales and the dequantising
   scratch) fit in ``budget`` bytes. A tensor larger than the budget becomes
   several bands.
2. `run_staging` reads each band into one reused staging buffer (through any
   reader callable: a `Transport`, a local copy in tests) and writes the band's
   pieces into the destination shards with `kernels.copy_segments`, or, when the
   holder stores fp8, dequantises them straight there with
   `kernels.dequantize_fp8_segments` (one launch per band; Triton on CUDA tensors).

`fabric.relayout.direct.run_direct` executes the same plans with no staging buffer,
loading straight from source regions the reader's device can address.

Holder shards are stored row-major and contiguous (``[rows, cols]`` of the
shard, 1-D tensors as ``[n, 1]``) at a byte offset of the source rank's region;
an fp8 shard has float32 blockwise scales (`kernels.scale_shape`) at its own
offset. Nothing here depends on the device: the same code runs on CPU (tests) and
on GPU (staging on the destination's device).

Staging memory per band, in bytes::

    band rows x cols x stored itemsize            (the fetched rows)
  + fp8 only: padding to 256 bytes, then scale rows x scale cols x 4   (their scales)
  + fp8 only: the torch path's scratch, `kernels.dequant_segments.ref_scratch_bytes`
    (a strip of about 2,048 elements, at least one row, 12 bytes each, and indices;
    Triton needs none)

``peak_bytes`` of a plan is the largest band, never above the budget. A band of
an fp8 tensor starts on a multiple of the quantisation block so its scales line
up; its smallest unit is one block of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightfabric.kernels import Fp8Segment, copy_segments, dequantize_fp8_segments
from weightfabric.kernels.dequant_segments import ref_scratch_bytes
from weightfabric.kernels.fp8 import check_block
from weightfabric.kernels.reshard_plan import Layout, Segment, plan_reshard
from weightfabric.kernels.segcopy import element_kind

FP8 = torch.float8_e4m3fn
_DEQUANT_OUT = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = 256

ReadFn = Callable[[int, int, torch.Tensor], None]
"""``read(src_rank, byte_offset, out)``: fill ``out`` (contiguous uint8) from the source
rank's region at ``byte_offset``."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _shape2(shape: Sequence[int]) -> tuple[int, int]:
    return (int(shape[0]), 1) if len(shape) == 1 else (int(shape[0]), int(shape[1]))


class Staging:
    """One uint8 buffer reused read after read (and derivation after derivation)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Its size now."""
        return self._buffer.numel()

    def data_ptr(self) -> int:
        """The address of the buffer now (the same until it grows or moves)."""
        return self._buffer.data_ptr()

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """At least ``nbytes`` bytes on ``device`` (the old buffer is freed before growing)."""
        if self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(0, dtype=torch.uint8)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer


@dataclass(frozen=True, kw_only=True)
class HeldTensor:
    """One logical tensor as the holder stores it.

    Attributes:
        name: tensor name (the key of the reader's destination).
        shape: logical (unsharded) shape, 1-D or 2-D.
        layout: the holder's layout (its ``tp`` is the number of source ranks).
        dtype: stored dtype; ``torch.float8_e4m3fn`` means blockwise fp8 with scales.
        offsets: per source rank, byte offset of its shard in that rank's region.
        scale_offsets: fp8 only: per source rank, byte offset of its float32 scales.
        block: fp8 quantisation block edge.
    """

    name: str
    shape: tuple[int, ...]
    layout: Layout
    dtype: torch.dtype
    offsets: tuple[int, ...]
    scale_offsets: tuple[int, ...] | None = None
    block: int = 128

    def __post_init__(self) -> None:
        if len(self.shape) not in (1, 2):
            raise ValueError(f"staging: tensor {self.name!r} must be 1-D or 2-D, got {self.shape}")
        if len(self.offsets) != self.layout.tp:
            raise ValueError(f"staging: tensor {self.name!r} has {len(self.offsets)} shard "
                             f"offsets, its layout has tp={self.layout.tp}")
        if self.dtype == FP8:
            if len(self.shape) != 2:
                raise ValueError(f"staging: fp8 tensor {self.name!r} must be 2-D")
            if self.scale_offsets is None or len(self.scale_offsets) != self.layout.tp:
                raise ValueError(f"staging: fp8 tensor {self.name!r} needs one scale offset "
                                 f"per source rank ({self.layout.tp})")
            check_block(self.block, f"staging: fp8 tensor {self.name!r}")

    @property
    def is_fp8(self) -> bool:
        """Whether the tensor is held as blockwise fp8."""
        return self.dtype == FP8


@dataclass(frozen=True, kw_only=True)
class WantedTensor:
    """One logical tensor as the reader wants it: its layout and dtype."""

    name: str
    layout: Layout
    dtype: torch.dtype


@dataclass(frozen=True)
class Band:
    """One staging step: rows ``[row0, row1)`` of source rank ``src_rank``'s shard of ``name``.

    ``segments`` are this band's pieces, with ``src_row`` relative to ``row0``.
    """

    name: str
    src_rank: int
    row0: int
    row1: int
    cols: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    offset: int
    nbytes: int
    scale_offset: int | None
    scale_nbytes: int
    block: int
    staging_bytes: int
    segments: tuple[Segment, ...]

    @property
    def rows(self) -> int:
        """Rows in the band."""
        return self.row1 - self.row0


@dataclass(frozen=True)
class StagingPlan:
    """Bands for one reader rank, in execution order.

    Attributes:
        rank: the reader's rank in its layouts.
        budget: the staging bound asked for.
        bands: the steps.
        peak_bytes: largest step (the staging memory `run_staging` uses).
        fetched_bytes: bytes read from sources, scales included.
        useful_bytes: bytes of source elements that land in a destination.
        dst_shapes: destination shard shape (2-D) per tensor name.
    """

    rank: int
    budget: int
    bands: tuple[Band, ...]
    peak_bytes: int
    fetched_bytes: int
    useful_bytes: int
    dst_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def staging_nbytes(self) -> int:
        """The staging buffer `run_staging` needs.

        The largest band as read (fp8: with its scales), without the dequantising scratch
        (allocated by the torch path).
        """
        return max((_round_up(b.nbytes, _ALIGN) + b.scale_nbytes if b.dtype == FP8 else b.nbytes
                    for b in self.bands), default=0)


@dataclass
class StagingStats:
    """What `run_staging` did."""

    bands: int = 0
    fetched_bytes: int = 0
    peak_bytes: int = 0
    staging_allocated: int = 0


def _intervals(segments: Sequence[Segment], align: int = 1) -> list[tuple[int, int]]:
    """Merged source-row intervals read by ``segments``, each starting on a multiple of ``align``."""
    spans = sorted((s.src_row - s.src_row % align, s.src_row + s.rows) for s in segments)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _clip(segments: Sequence[Segment], row0: int, row1: int) -> tuple[Segment, ...]:
    out = []
    for s in segments:
        lo, hi = max(s.src_row, row0), min(s.src_row + s.rows, row1)
        if lo < hi:
            out.append(Segment(s.src_rank, lo - row0, s.src_col, s.dst_rank,
                               s.dst_row + lo - s.src_row, s.dst_col, hi - lo, s.cols))
    return tuple(out)


def _band_cost(rows: int, cols: int, held: HeldTensor) -> int:
    """Staging bytes of a band of ``rows`` rows (fp8: starting on a block boundary)."""
    data = rows * cols * _itemsize(held.dtype)
    if not held.is_fp8:
        return data
    srows, scols = -(-rows // held.block), -(-cols // held.block)
    return _round_up(data, _ALIGN) + srows * scols * 4 + ref_scratch_bytes(rows, cols)


def plan_staging(held: Sequence[HeldTensor], wanted: Sequence[WantedTensor], *, rank: int,
                 budget: int) -> StagingPlan:
    """Plan a bounded-staging fetch of a tensor set for reader rank ``rank``.

    Parameters:
        held: the holder's tensors (layouts, stored dtypes, byte offsets).
        wanted: the reader's layout and dtype of each tensor (same names).
        rank: this reader's rank in the ``wanted`` layouts.
        budget: staging bytes allowed at any one time.

    Returns:
        A `StagingPlan` whose ``peak_bytes`` is at most ``budget``.

    Raises:
        ValueError: names differ, a rank is out of range, a layout does not fit a
            shape, or ``budget`` cannot hold one row band of some tensor (the
            message names the tensor and the smallest budget that works).
        TypeError: a dtype pair the copy kernels cannot do.

    Example:
        >>> from kernels import Sharded
        >>> h = HeldTensor(name="w", shape=(4, 8), layout=Sharded(tp=2), dtype=torch.float32,
        ...                offsets=(0, 0))
        >>> plan = plan_staging([h], [WantedTensor(name="w", layout=Sharded(tp=1),
        ...                     dtype=torch.float32)], rank=0, budget=256)
        >>> [(b.src_rank, b.row0, b.row1) for b in plan.bands], plan.peak_bytes
        ([(0, 0, 2), (1, 0, 2)], 64)
    """
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"staging: budget must be a positive number of bytes, got {budget!r}")
    by_name = {w.name: w for w in wanted}
    if len(by_name) != len(wanted) or {h.name for h in held} != set(by_name) or len(held) != len(by_name):
        raise ValueError(f"staging: holder tensors {sorted(h.name for h in held)} and reader "
                         f"tensors {sorted(by_name)} must name the same set, once each")
    bands: list[Band] = []
    dst_shapes: dict[str, tuple[int, int]] = {}
    useful = 0
    for h in held:
        w = by_name[h.name]
        if not 0 <= rank < w.layout.tp:
            raise ValueError(f"staging: rank {rank} outside the reader layout of {h.name!r} "
                             f"(tp={w.layout.tp})")
        if h.is_fp8:
            if w.dtype not in _DEQUANT_OUT:
                raise TypeError(f"staging: fp8 tensor {h.name!r} dequantises to one of "
                                f"{list(_DEQUANT_OUT)}, not {w.dtype}")
            out_dtype = w.dtype
        else:
            element_kind(h.dtype, w.dtype, f"staging: tensor {h.name!r}")
            out_dtype = h.dtype
        plan = plan_reshard(h.layout, w.layout, h.shape)
        dst_shapes[h.name] = plan.dst_shapes[rank]
        mine = [s for s in plan.segments if s.dst_rank == rank]
        useful += sum(s.rows * s.cols for s in mine) * _itemsize(h.dtype)
        for src in range(h.layout.tp):
            segs = [s for s in mine if s.src_rank == src]
            if not segs:
                continue
            shard_rows, cols = plan.src_shapes[src]
            unit = min(h.block, shard_rows) if h.is_fp8 else 1
            if _band_cost(unit, cols, h) > budget:
                raise ValueError(
                    f"staging: budget of {budget} bytes is smaller than one row band of tensor "
                    f"{h.name!r} ({unit} row(s) of {cols} {h.dtype} = "
                    f"{_band_cost(unit, cols, h)} bytes of staging); raise the budget")
            for row, hi in _intervals(segs, h.block if h.is_fp8 else 1):
                while row < hi:
                    end = _largest_band(row, hi, shard_rows, cols, h, budget)
                    bands.append(_band(h, src, row, end, cols, out_dtype, _clip(segs, row, end)))
                    row = end
    peak = max((b.staging_bytes for b in bands), default=0)
    fetched = sum(b.nbytes + b.scale_nbytes for b in bands)
    return StagingPlan(rank, budget, tuple(bands), peak, fetched, useful, dst_shapes)


def _largest_band(row: int, hi: int, shard_rows: int, cols: int, h: HeldTensor,
                  budget: int) -> int:
    """End row of the largest band starting at ``row`` that fits the budget."""
    if not h.is_fp8:
        per_row = cols * _itemsize(h.dtype)
        return row + max(1, min(hi - row, budget // per_row))
    blocks_left = -(-(hi - row) // h.block)
    lo_k, hi_k = 1, blocks_left  # largest k block-rows that fit (cost is monotone in k)
    while lo_k < hi_k:
        mid = (lo_k + hi_k + 1) // 2
        if _band_cost(min(mid * h.block, shard_rows - row), cols, h) <= budget:
            lo_k = mid
        else:
            hi_k = mid - 1
    return min(row + lo_k * h.block, shard_rows)


def _band(h: HeldTensor, src: int, row0: int, row1: int, cols: int, out_dtype: torch.dtype,
          segments: tuple[Segment, ...]) -> Band:
    row_bytes = cols * _itemsize(h.dtype)
    scale_offset, scale_nbytes = None, 0
    if h.is_fp8:
        assert h.scale_offsets is not None
        scols = -(-cols // h.block)
        srow0, srow1 = row0 // h.block, -(-row1 // h.block)
        scale_offset = h.scale_offsets[src] + srow0 * scols * 4
        scale_nbytes = (srow1 - srow0) * scols * 4
    return Band(h.name, src, row0, row1, cols, h.dtype, out_dtype, h.offsets[src] + row0 * row_bytes,
                (row1 - row0) * row_bytes, scale_offset, scale_nbytes, h.block,
                _band_cost(row1 - row0, cols, h), segments)


def destination_views(plan: StagingPlan, dst: Mapping[str, torch.Tensor], *,
                      what: str = "staging") -> tuple[dict[str, torch.Tensor], torch.device]:
    """Check ``dst`` against ``plan``; return each tensor's 2-D view and their device.

    Raises:
        ValueError: a destination is missing or has the wrong shape, or destinations
            sit on several devices (messages start with ``what``).
        TypeError: a destination dtype does not match the plan.
    """
    views: dict[str, torch.Tensor] = {}
    for name, shape in plan.dst_shapes.items():
        if name not in dst:
            raise ValueError(f"{what}: no destination tensor for {name!r}")
        t = dst[name]
        if t.dim() == 1 and shape[1] == 1:
            t = t.unsqueeze(1)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what}: destination {name!r} has shape {tuple(dst[name].shape)}, "
                             f"the reader layout needs {shape}")
        views[name] = t
    devices = {t.device for t in views.values()}
    if len(devices) > 1:
        raise ValueError(f"{what}: destinations span several devices {sorted(map(str, devices))}")
    for b in plan.bands:
        have = views[b.name].dtype
        if b.dtype == FP8 and have != b.out_dtype:
            raise TypeError(f"{what}: destination {b.name!r} is {have}, the plan dequantises to "
                            f"{b.out_dtype}")
        if b.dtype != FP8:
            element_kind(b.dtype, have, f"{what}: destination {b.name!r}")
    return views, next(iter(devices), torch.device("cpu"))


def run_staging(plan: StagingPlan, read: ReadFn, dst: Mapping[str, torch.Tensor], *,
                backend: str | None = None, staging: torch.Tensor | None = None) -> StagingStats:
    """Execute ``plan``: fetch every band into staging and transform it into ``dst``.

    Parameters:
        plan: from `plan_staging`.
        read: ``read(src_rank, byte_offset, out)`` fills ``out`` (contiguous uint8 on
            the destinations' device) from the source rank's region.
        dst: tensor name -> this rank's destination shard (the reader layout's shard
            shape, 2-D or 1-D for 1-D tensors; any strides; the wanted dtype).
        backend: kernel backend (``None``: Triton on CUDA tensors, torch elsewhere).
        staging: a contiguous uint8 buffer of at least ``plan.staging_nbytes`` bytes on
            the destinations' device, starting on a 16-byte boundary, to stage in
            instead of allocating one.

    Returns:
        `StagingStats`; ``staging_allocated`` is the staging buffer allocated here
        (``plan.staging_nbytes``; 0 when ``staging`` was given).

    Raises:
        ValueError: a destination is missing or has the wrong shape, destinations sit
            on several devices, or ``staging`` is too small, elsewhere, misaligned or
            not uint8.
        TypeError: a destination dtype does not match the plan.
    """
    views, device = destination_views(plan, dst)
    size = plan.staging_nbytes
    if staging is None:
        staging = torch.empty(size, dtype=torch.uint8, device=device)
        stats = StagingStats(staging_allocated=size)
    elif (staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous()
          or staging.numel() < size or staging.device != device or staging.data_ptr() % 16):
        raise ValueError(f"staging: the buffer given is {staging.dtype} {tuple(staging.shape)} on "
                         f"{staging.device} at address {staging.data_ptr():#x}; this plan needs "
                         f"{size} contiguous uint8 bytes on {device}, 16-byte aligned")
    else:
        stats = StagingStats()
    for b in plan.bands:
        raw = staging[:b.nbytes]
        read(b.src_rank, b.offset, raw)
        src = raw.view(b.dtype).view(b.rows, b.cols)
        targets = [views[b.name][s.dst_row:s.dst_row + s.rows, s.dst_col:s.dst_col + s.cols]
                   for s in b.segments]
        if b.dtype == FP8:  # dequantised straight into the destinations
            assert b.scale_offset is not None
            at = _round_up(b.nbytes, _ALIGN)
            scales = staging[at:at + b.scale_nbytes]
            read(b.src_rank, b.scale_offset, scales)
            scales = scales.view(torch.float32).view(-1, -(-b.cols // b.block))
            dequantize_fp8_segments([Fp8Segment(src, scales, t, row=s.src_row, col=s.src_col,
                                                 block=b.block)
                                     for s, t in zip(b.segments, targets, strict=True)],
                                    backend=backend)
        else:
            copy_segments([(src[s.src_row:s.src_row + s.rows, s.src_col:s.src_col + s.cols], t)
                           for s, t in zip(b.segments, targets, strict=True)], backend=backend)
        if device.type == "cuda":  # the next band's read reuses the staging bytes
            torch.cuda.current_stream(device).synchronize()
        stats.bands += 1
        stats.fetched_bytes += b.nbytes + b.scale_nbytes
        stats.peak_bytes = max(stats.peak_bytes, b.staging_bytes)
    return stats
