"""Receive path without staging: the reader's kernels load straight from the holders' memory.

Within a node a holder's region is addressable from the reader's GPU (a CUDA
IPC mapping, or an NVSHMEM ``get_peer_tensor`` view): a plain device pointer.
`run_direct` executes a `fabric.relayout.staging.StagingPlan` against those regions
with no staging buffer: every piece of a plain tensor goes into one
`kernels.copy_segments` launch (with its cast, e.g. float32 -> bfloat16), every
piece of an fp8 tensor into one `kernels.dequantize_fp8_segments` launch, which
reads the fp8 window and its block scales and writes the dequantised values in
place. Only the elements a destination needs are read, so column-sharded
sources are not over-fetched as they are through staging.

Any staging plan can be run directly (its bands only partition the rows it
reads); `plan_direct` plans without a budget, one band per row range.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightfabric.fabric.relayout.staging import (
    FP8,
    Band,
    HeldTensor,
    StagingPlan,
    WantedTensor,
    destination_views,
    plan_staging,
)
from weightfabric.kernels import Fp8Segment, copy_segments, dequantize_fp8_segments


@dataclass
class DirectStats:
    """What `run_direct` did.

    Attributes:
        launches: calls into the kernels (0, 1 or 2; one kernel launch each on Triton).
        segments: pieces copied or dequantised.
        read_bytes: source bytes the kernels load: the pieces' elements, plus, for
            fp8, the scales of the blocks each piece touches.
        written_bytes: destination bytes written.
    """

    launches: int = 0
    segments: int = 0
    read_bytes: int = 0
    written_bytes: int = 0


def plan_direct(held: Sequence[HeldTensor], wanted: Sequence[WantedTensor], *,
                rank: int) -> StagingPlan:
    """`plan_staging` without a budget: one band per source row range (for `run_direct`).

    The plan's ``peak_bytes`` is what `run_staging` would need for it; `run_direct`
    allocates nothing.
    """
    return plan_staging(held, wanted, rank=rank, budget=sys.maxsize)


def _region(sources: Mapping[int, torch.Tensor], b: Band, device: torch.device) -> torch.Tensor:
    """The source rank's flat region, checked to hold band ``b`` (data and scales)."""
    what = f"direct: source rank {b.src_rank} (tensor {b.name!r})"
    region = sources.get(b.src_rank)
    if region is None:
        raise ValueError(f"{what}: no source region given")
    if region.dtype != torch.uint8 or region.dim() != 1 or region.stride(0) != 1:
        raise ValueError(f"{what}: the region must be a flat contiguous uint8 tensor, got "
                         f"{region.dtype} of shape {tuple(region.shape)}")
    if region.device != device:
        raise ValueError(f"{what}: the region is on {region.device}, destinations on {device}")
    spans = [(b.offset, b.nbytes, b.dtype)]
    if b.dtype == FP8:
        assert b.scale_offset is not None
        spans.append((b.scale_offset, b.scale_nbytes, torch.float32))
    for offset, nbytes, dtype in spans:
        if offset < 0 or offset + nbytes > region.numel():
            raise ValueError(f"{what}: reads bytes {offset}..{offset + nbytes} of a region of "
                             f"{region.numel()} bytes")
        if (region.data_ptr() + offset) % dtype.itemsize:
            raise ValueError(f"{what}: {dtype} data at byte {offset} is not aligned to "
                             f"{dtype.itemsize} bytes")
    return region


def run_direct(plan: StagingPlan, sources: Mapping[int, torch.Tensor],
               dst: Mapping[str, torch.Tensor], *, backend: str | None = None) -> DirectStats:
    """Execute ``plan`` by reading the source regions in place, with no staging memory.

    Parameters:
        plan: from `plan_direct` or `plan_staging` (any budget).
        sources: source rank -> flat contiguous uint8 tensor addressing that rank's
            whole region (on GPU an IPC mapping or peer view), on the destinations'
            device. Only the ranks the plan reads are needed.
        dst: tensor name -> this rank's destination shard, as for `run_staging`.
        backend: kernel backend (``None``: Triton on CUDA tensors, torch elsewhere).

    Returns:
        `DirectStats`. On CUDA the kernels are queued on the current stream: keep the
        sources exposed (their leases held) until that stream has been synchronised.

    Raises:
        ValueError: a destination is missing or misshapen, or a source region is
            missing, not flat uint8, on another device, too short for the plan or
            misaligned for its dtype (the message names the rank and tensor).
        TypeError: a destination dtype does not match the plan.

    Example:
        >>> from kernels import Sharded
        >>> h = HeldTensor(name="w", shape=(4, 2), layout=Sharded(tp=2), dtype=torch.float32,
        ...                offsets=(0, 0))
        >>> w = WantedTensor(name="w", layout=Sharded(tp=1), dtype=torch.bfloat16)
        >>> regions = {r: torch.arange(4.0 * r, 4.0 * r + 4).view(torch.uint8) for r in (0, 1)}
        >>> out = torch.empty(4, 2, dtype=torch.bfloat16)
        >>> run_direct(plan_direct([h], [w], rank=0), regions, {"w": out})
        DirectStats(launches=1, segments=2, read_bytes=32, written_bytes=16)
        >>> out[3].tolist()
        [6.0, 7.0]
    """
    views, device = destination_views(plan, dst, what="direct")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    windows: list[Fp8Segment] = []
    stats = DirectStats()
    for b in plan.bands:
        region = _region(sources, b, device)
        shard = region[b.offset:b.offset + b.nbytes].view(b.dtype).view(b.rows, b.cols)
        out = views[b.name]
        itemsize = b.dtype.itemsize
        if b.dtype == FP8:  # the band starts on a block row, so its scales start with it
            assert b.scale_offset is not None, "staging._band sets an fp8 band's scale_offset"
            scales = region[b.scale_offset:b.scale_offset + b.scale_nbytes].view(torch.float32)
            scales = scales.view(-1, -(-b.cols // b.block))
        for s in b.segments:
            target = out[s.dst_row:s.dst_row + s.rows, s.dst_col:s.dst_col + s.cols]
            if b.dtype == FP8:
                windows.append(Fp8Segment(shard, scales, target, row=s.src_row, col=s.src_col,
                                          block=b.block))
                blocks = (((s.src_row + s.rows - 1) // b.block - s.src_row // b.block + 1)
                          * ((s.src_col + s.cols - 1) // b.block - s.src_col // b.block + 1))
                stats.read_bytes += 4 * blocks
            else:
                pairs.append((shard[s.src_row:s.src_row + s.rows, s.src_col:s.src_col + s.cols],
                              target))
            stats.segments += 1
            stats.read_bytes += s.rows * s.cols * itemsize
            stats.written_bytes += s.rows * s.cols * target.element_size()
    if pairs:
        copy_segments(pairs, backend=backend)
        stats.launches += 1
    if windows:
        dequantize_fp8_segments(windows, backend=backend)
        stats.launches += 1
    return stats
