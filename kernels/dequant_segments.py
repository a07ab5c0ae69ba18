"""One launch dequantises a whole list of blockwise-fp8 windows into strided destinations.

A *segment* (`Fp8Segment`) is a 2-D window of an fp8 shard: rows
``row .. row + R`` and columns ``col .. col + C`` of ``q`` (float8_e4m3fn
``[rows, cols]``, any strides), with the shard's float32 block scales
(`kernels.fp8.scale_shape`; element ``(r, c)`` of the shard uses
``scale[r // block, c // block]``, so windows need not start or end on a block
edge), and a destination view ``dst`` of shape ``[R, C]`` (float32, bfloat16 or
float16, any strides). Every element becomes ``float32(q) * scale`` rounded to
the destination dtype, exactly as `kernels.fp8.dequantize_fp8` computes it: the
fused kernel gives the same bits as dequantising the whole shard and then copying
the window, without the temporary.

Kernel layout: like `kernels.segcopy`, one base pointer and a segment table,
int64 ``[num_segments, NCOL]`` (byte offsets from the base, so sources may live
in any allocation the device can address, e.g. a peer's IPC mapping), with
columns ``first`` (the segment's first tile, a prefix sum), ``q_off, scale_off,
dst_off`` (bytes), ``kind`` (0 float32, 1 bfloat16, 2 float16), ``R, C, row,
col``, q strides, scale strides, dst strides (elements, 2 each), ``log2(block)``
and the number of column tiles. Each program handles a ``BR x BC`` tile of one
segment, found by `kernels.segcopy.find_segment` (a binary search of ``first``;
no per-program arrays on the host).

Host cost per call: the checks depend only on each window's ``row``, ``col``,
``block`` and its tensors' addresses, dtypes, shapes, strides and devices; a call
whose key (those) passed them before skips them and reuses the table built for it
(`_CHECKED`, a `kernels.segcopy.CheckCache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weightfabric.kernels.bits import bf16_rne_bits, e4m3_to_f32
from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.fp8 import DEFAULT_BLOCK, check_block, scale_shape
from weightfabric.kernels.segcopy import (
    KEY_ERRORS,
    CheckCache,
    Checked,
    anchor,
    find_segment,
    first_per_device,
    tensor_key,
)

NCOL = 17
TILE_ROWS = 32
TILE_COLS = 128
FP8 = torch.float8_e4m3fn
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CHECKED = CheckCache()


@triton.jit
def _dequant_segments_kernel(
    base_ptr,        # *u8: every address is base_ptr + a byte offset from the table
    table_ptr,       # *i64 [num_segments, NCOL]: the segment table (read only)
    num_segments,    # rows of the table (column 0: each segment's first tile)
    BR: tl.constexpr, BC: tl.constexpr,
    NCOL: tl.constexpr,
):
    row, tile = find_segment(table_ptr, num_segments, NCOL)
    q_off = tl.load(row + 1)
    scale_off = tl.load(row + 2)
    dst_off = tl.load(row + 3)
    kind = tl.load(row + 4)
    num_rows = tl.load(row + 5)
    num_cols = tl.load(row + 6)
    r0 = tl.load(row + 7)
    c0 = tl.load(row + 8)
    shift = tl.load(row + 15)
    col_tiles = tl.load(row + 16)

    # window coordinates of this tile, and the shard coordinates they read
    i = (tile // col_tiles) * BR + tl.arange(0, BR).to(tl.int64)
    j = (tile % col_tiles) * BC + tl.arange(0, BC).to(tl.int64)
    mask = (i < num_rows)[:, None] & (j < num_cols)[None, :]
    r = r0 + i
    c = c0 + j

    # reads: BR x BC fp8 bytes of the shard, and the scales of the blocks they fall in
    q_idx = r[:, None] * tl.load(row + 9) + c[None, :] * tl.load(row + 10)
    code = tl.load(base_ptr + q_off + q_idx, mask=mask, other=0).to(tl.int32)
    s_idx = (r >> shift)[:, None] * tl.load(row + 11) + (c >> shift)[None, :] * tl.load(row + 12)
    scales = (base_ptr + scale_off).to(tl.pointer_type(tl.float32))
    y = e4m3_to_f32(code) * tl.load(scales + s_idx, mask=mask, other=1.0)

    # writes: the BR x BC tile of the destination window
    d_idx = i[:, None] * tl.load(row + 13) + j[None, :] * tl.load(row + 14)
    dst = base_ptr + dst_off
    if kind == 0:
        tl.store(dst.to(tl.pointer_type(tl.float32)) + d_idx, y, mask=mask)
    elif kind == 1:  # bfloat16 bits, round to nearest even in integer arithmetic
        tl.store(dst.to(tl.pointer_type(tl.int16)) + d_idx,
                 bf16_rne_bits(y.to(tl.int32, bitcast=True)), mask=mask)
    else:  # kind 2: float16, hardware / numpy round to nearest even
        tl.store(dst.to(tl.pointer_type(tl.float16)) + d_idx, y.to(tl.float16), mask=mask)


@dataclass(frozen=True)
class Fp8Segment:
    """Window ``dst.shape`` at ``(row, col)`` of fp8 shard ``q`` with block scales ``scale``.

    Attributes:
        q: float8_e4m3fn shard ``[rows, cols]``, any strides (a 1-D vector as ``[1, n]``).
        scale: float32 ``scale_shape(q.shape, block)``, any strides.
        dst: destination window ``[R, C]``: float32, bfloat16 or float16, any strides.
        row: first shard row of the window.
        col: first shard column of the window.
        block: quantisation block edge (power of two >= 16).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dst: torch.Tensor
    row: int = 0
    col: int = 0
    block: int = DEFAULT_BLOCK

    @property
    def window(self) -> torch.Tensor:
        """The fp8 source window (a view of ``q``)."""
        rows, cols = self.dst.shape
        return self.q[self.row:self.row + rows, self.col:self.col + cols]


def check_fp8_segments(segments: Sequence[Fp8Segment], what: str = "dequantize_fp8_segments") -> None:
    """Validate dtypes, shapes, scale shapes, windows and devices (errors name the segment)."""
    for i, s in enumerate(segments):
        at = f"{what}: segment {i}"
        if s.q.dtype != FP8:
            raise TypeError(f"{at}: q has dtype {s.q.dtype}, needs {FP8}")
        if s.scale.dtype != torch.float32:
            raise TypeError(f"{at}: scale has dtype {s.scale.dtype}, needs torch.float32")
        if s.dst.dtype not in _OUT_KIND:
            raise TypeError(f"{at}: dst has dtype {s.dst.dtype}, needs one of {list(_OUT_KIND)}")
        if s.q.dim() != 2 or s.dst.dim() != 2:
            raise ValueError(f"{at}: q and dst must be 2-D, got shapes {tuple(s.q.shape)} and "
                             f"{tuple(s.dst.shape)}")
        check_block(s.block, at)
        want = scale_shape(tuple(s.q.shape), s.block)
        if tuple(s.scale.shape) != want:
            raise ValueError(f"{at}: scale has shape {tuple(s.scale.shape)}, q of shape "
                             f"{tuple(s.q.shape)} with block {s.block} needs {want}")
        (rows, cols), (num_rows, num_cols) = s.dst.shape, s.q.shape
        if s.row < 0 or s.col < 0 or s.row + rows > num_rows or s.col + cols > num_cols:
            raise ValueError(f"{at}: window rows {s.row}..{s.row + rows} x cols {s.col}.."
                             f"{s.col + cols} lies outside q of shape {(num_rows, num_cols)}")
        if not s.q.device == s.scale.device == s.dst.device:
            raise ValueError(f"{at}: q, scale and dst on {s.q.device}, {s.scale.device}, "
                             f"{s.dst.device}")


REF_STRIP = 2048
"""Elements the torch reference dequantises at a time (at least one row of a window)."""


def ref_scratch_bytes(rows: int, cols: int) -> int:
    """Most bytes of temporaries the torch reference allocates for a ``rows x cols`` window.

    Per element of a strip a float32 copy and its gathered scale (8 bytes; 12 bound them
    with the scale rows gathered first), plus the int64 row and column scale indices.
    """
    strip = min(rows, _strip_rows(cols))
    return 12 * strip * cols + 16 * (cols + strip)


def _strip_rows(cols: int) -> int:
    """Rows of a ``cols``-wide window the torch reference dequantises at a time."""
    return max(1, REF_STRIP // max(cols, 1))


def dequantize_fp8_segments_ref(segments: Sequence[Fp8Segment]) -> None:
    """Torch reference of the fp8 segment dequantisation.

    Torch reference: ``dst = (float32(window) * its scales).to(dst.dtype)`` per segment, a
    strip of rows at a time (`ref_scratch_bytes` bounds its temporaries).
    """
    for s in segments:
        rows, cols = s.dst.shape
        if not rows * cols:
            continue
        b = s.block
        col_scale = torch.arange(s.col, s.col + cols, device=s.q.device) // b
        step = _strip_rows(cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            row_scale = torch.arange(s.row + r0, s.row + r1, device=s.q.device) // b
            out = s.q[s.row + r0:s.row + r1, s.col:s.col + cols].float()
            out.mul_(s.scale[row_scale][:, col_scale])
            s.dst[r0:r1].copy_(out)  # rounds to dst's dtype as .to() would


def _table(segments: Sequence[Fp8Segment], base: torch.Tensor, tile_cols: int) -> torch.Tensor:
    at = base.data_ptr()
    rows = []
    for s in segments:
        num_rows, num_cols = s.dst.shape
        if num_rows * num_cols:
            rows.append([0, s.q.data_ptr() - at, s.scale.data_ptr() - at, s.dst.data_ptr() - at,
                         _OUT_KIND[s.dst.dtype], num_rows, num_cols, s.row, s.col,
                         *s.q.stride(), *s.scale.stride(), *s.dst.stride(),
                         s.block.bit_length() - 1, -(-num_cols // tile_cols)])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL)


def _device_table(segments: Sequence[Fp8Segment], device: torch.device
                  ) -> tuple[torch.Tensor, int, int]:
    """``(device table, rows, programs)`` for validated ``segments``."""
    table = _table(segments, anchor(device), TILE_COLS)
    tiles = -(-table[:, 5] // TILE_ROWS) * table[:, 16]
    if len(tiles):
        table[:, 0] = torch.cumsum(tiles, 0) - tiles
    return table.to(device), table.shape[0], int(tiles.sum())


def _launch(segments: Sequence[Fp8Segment], checked: Checked) -> None:
    """Launch `_dequant_segments_kernel` once for all of ``segments`` (checked, not empty)."""
    device = segments[0].dst.device
    table, num_segments, programs = checked.table(
        ("dequant",), lambda: _device_table(segments, device))
    if programs:
        _dequant_segments_kernel[(programs,)](
            anchor(device), table, num_segments, BR=TILE_ROWS, BC=TILE_COLS, NCOL=NCOL)


def _call_key(segments: Sequence[Fp8Segment]) -> tuple | None:
    """What the checks and the table depend on; None where it cannot be taken.

    Per window its tensors' `tensor_key` (a shard's q and scale once per call: many
    windows share them) and ``row, col, block``, the three exact ints (``16.0 == 16``:
    a float block must not find the entry of an int one).
    """
    shards: dict[int, tuple] = {}

    def shard(t: torch.Tensor) -> tuple:
        k = shards.get(id(t))  # the tensors outlive the call: no id is reused during it
        if k is None:
            k = shards[id(t)] = tensor_key(t)
        return k

    try:
        key = tuple([(shard(s.q), shard(s.scale), tensor_key(s.dst), s.row, s.col, s.block)
                     for s in segments])
    except KEY_ERRORS:
        return None
    exact = all(type(s.row) is type(s.col) is type(s.block) is int for s in segments)
    return key if exact else None


def _checked(segments: Sequence[Fp8Segment]) -> Checked:
    """`check_fp8_segments`, skipped for a call key checked before."""
    key = _call_key(segments)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    check_fp8_segments(segments)
    return _CHECKED.remember(key, reps=first_per_device(s.dst for s in segments))


def dequantize_fp8_segments(segments: Sequence[Fp8Segment], *, backend: str | None = None) -> None:
    """Dequantise every fp8 window into its destination, in one kernel launch on Triton.

    The result equals ``dequantize_fp8(q, scale)`` of the whole shard, cut to the
    window and written to ``dst``, bit for bit (a NaN code stays NaN, payload
    unspecified), without the shard-sized temporary. Destinations must not
    overlap each other or any source (not checked).

    Args:
        segments: the windows (`Fp8Segment`); sources may be views of any
            tensor on the destinations' device, e.g. a flat byte region viewed as
            ``float8_e4m3fn`` / ``float32``.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Raises:
        TypeError: a q, scale or dst dtype is wrong (names the segment index).
        ValueError: not 2-D, a scale shape that does not fit q and block, a bad
            block, a window outside q, or tensors on several devices.

    Example:
        >>> q = (torch.arange(40.0).view(2, 20) % 8).to(torch.float8_e4m3fn)
        >>> scale = torch.tensor([[0.5, 2.0]])  # blocks of 16 columns
        >>> out = torch.empty(2, 3)
        >>> dequantize_fp8_segments([Fp8Segment(q, scale, out, row=0, col=15, block=16)])
        >>> out.tolist()
        [[3.5, 0.0, 2.0], [1.5, 8.0, 10.0]]
    """
    checked = _checked(segments)
    reps = [segments[i].dst for i in checked.reps]
    if choose_backend(backend, *reps, op="dequantize_fp8_segments") == "torch":
        dequantize_fp8_segments_ref(segments)
    elif segments:
        _launch(segments, checked)


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    sig = {"base_ptr": "*u8", "table_ptr": "*i64", "num_segments": "i64",
           "BR": "constexpr", "BC": "constexpr", "NCOL": "constexpr"}
    return [(_dequant_segments_kernel, sig, {"BR": TILE_ROWS, "BC": TILE_COLS, "NCOL": NCOL})]
