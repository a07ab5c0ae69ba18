"""Execute a `ReshardPlan`: every segment of it in one kernel launch.

Shards are tensors of the plan's shard shapes (``[rows, cols]``; for a 1-D
logical tensor, 1-D shards of ``rows`` are accepted too), any strides, all on
one device. Source and destination dtypes must be equal or a supported cast
(`kernels.segcopy.SUPPORTED_CASTS`, e.g. float32 -> bfloat16). Destination
elements no segment covers (vocabulary padding) are left untouched.

Host cost per call: the checks depend only on the plan object and each shard's
address, dtype, shape, strides and device; a call whose key (those) passed them
before skips them and reuses the segment table built for it (`_CHECKED`, a
`kernels.segcopy.CheckCache`): no view per segment is made either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.reshard_plan import Layout, ReshardPlan, plan_reshard
from weightfabric.kernels.segcopy import (
    DEFAULT_BLOCK,
    KEY_ERRORS,
    CheckCache,
    Checked,
    Segment,
    copy_segments_ref,
    element_kind,
    launch_table,
    segment_table,
    tensor_key,
)

_CHECKED = CheckCache()


def _as_2d(shards: Sequence[torch.Tensor], shapes: Sequence[tuple[int, int]], side: str) -> list[torch.Tensor]:
    if len(shards) != len(shapes):
        raise ValueError(f"reshard: {len(shards)} {side} shards given, layout has {len(shapes)} ranks")
    out = []
    for rank, (t, shape) in enumerate(zip(shards, shapes, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"reshard: {side} shard {rank} is a {type(t).__name__}, not a tensor")
        if t.dim() == 1 and shape[1] == 1:
            t = t.unsqueeze(1)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"reshard: {side} shard {rank} has shape {tuple(t.shape)}, the layout "
                             f"needs {tuple(shape)}")
        out.append(t)
    return out


def _2d(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Checked shards as `_as_2d` gives them: 1-D ones as ``[n, 1]``."""
    return [t.unsqueeze(1) if t.dim() == 1 else t for t in shards]


def _views(plan: ReshardPlan, src: list[torch.Tensor], dst: list[torch.Tensor]) -> list[Segment]:
    return [(src[s.src_rank][s.src_row:s.src_row + s.rows, s.src_col:s.src_col + s.cols],
             dst[s.dst_rank][s.dst_row:s.dst_row + s.rows, s.dst_col:s.dst_col + s.cols])
            for s in plan.segments]


def _sources(plan: ReshardPlan, src_shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The source shards, 2-D; errors for a wrong count, shape or mixed dtypes."""
    src = _as_2d(src_shards, plan.src_shapes, "source")
    dtypes = {t.dtype for t in src}
    if len(dtypes) != 1:
        raise TypeError(f"reshard: source shards mix dtypes {sorted(map(str, dtypes))}")
    return src


def _checked(plan: ReshardPlan, src_shards: Sequence[torch.Tensor],
             dst_shards: Sequence[torch.Tensor]) -> Checked:
    """`reshard`'s checks, skipped for a call key (plan, shards) checked before."""
    try:
        key: tuple | None = (id(plan), tuple([tensor_key(t) for t in src_shards]),
                             tuple([tensor_key(t) for t in dst_shards]))
    except KEY_ERRORS:
        key = None
    hit = _CHECKED.get(key, plan)
    if hit is not None:
        return hit
    src = _sources(plan, src_shards)
    dst = _as_2d(dst_shards, plan.dst_shapes, "destination")
    for rank, t in enumerate(dst):
        element_kind(src[0].dtype, t.dtype, f"reshard: destination shard {rank}")
    return _CHECKED.remember(key, plan)


def _table(plan: ReshardPlan, src: list[torch.Tensor], dst: list[torch.Tensor],
           block: int) -> tuple[torch.Tensor, int, int]:
    segments = _views(plan, src, dst)
    return segment_table(segments, [element_kind(a.dtype, b.dtype) for a, b in segments], block)


def reshard(plan: ReshardPlan, src_shards: Sequence[torch.Tensor],
            dst_shards: Sequence[torch.Tensor] | None = None, *, dtype: torch.dtype | None = None,
            backend: str | None = None, block: int = DEFAULT_BLOCK) -> list[torch.Tensor]:
    """Copy ``src_shards`` (layout ``plan.src``) into ``dst_shards`` (layout ``plan.dst``).

    Args:
        plan: from `plan_reshard`.
        src_shards: one tensor per source rank.
        dst_shards: one tensor per destination rank; zero-filled tensors of
            ``dtype`` (default: the source dtype) are allocated when None.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Returns:
        The destination shards (2-D views for 1-D tensors).

    Raises:
        ValueError: wrong shard count or shape, mixed devices.
        TypeError: mixed source dtypes or an unsupported cast (names the shard).
    """
    if dst_shards is None:
        first = _sources(plan, src_shards)[0]
        dst_shards = [torch.zeros(s, dtype=dtype or first.dtype, device=first.device)
                      for s in plan.dst_shapes]
    checked = _checked(plan, src_shards, dst_shards)
    src, dst = _2d(src_shards), _2d(dst_shards)
    if choose_backend(backend, *src, *dst, op="reshard") == "torch":
        copy_segments_ref(_views(plan, src, dst))
    elif plan.segments:
        table = checked.table(("reshard", block), lambda: _table(plan, src, dst, block))
        launch_table(dst[0].device, *table, block=block)
    return dst


def split_tensor(full: torch.Tensor, layout: Layout, *, backend: str | None = None
                 ) -> list[torch.Tensor]:
    """The shards of a whole (unsharded) tensor under ``layout``, one per rank.

    The shards of a whole (unsharded) tensor under ``layout``, one per rank (2-D, like
    `reshard`'s destinations; 1-D tensors as ``[n, 1]``).
    """
    whole = dataclasses.replace(layout, tp=1)
    return reshard(plan_reshard(whole, layout, tuple(full.shape)), [full], backend=backend)
