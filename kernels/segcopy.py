"""One launch copies a whole list of strided segments, with an optional cast.

This is the engine under pack/unpack and resharding. A *segment* is a pair of
tensor views of the same shape, ``(src, dst)``; ``dst`` receives ``src``. Any
strides are allowed on either side (up to 4 dims after merging dims that are
contiguous on both sides; more are split into several segments). Supported
``(src.dtype, dst.dtype)`` pairs: equal dtypes of 1, 2, 4 or 8 bytes (a raw
copy, bit-exact for every value), float32 -> bfloat16 / float16 (round to
nearest even; a NaN stays a NaN, its payload bits unspecified), bfloat16 / float16 -> float32
(exact).

Kernel layout: a segment table, int64 ``[num_segments, NCOL]`` with columns
``src_off, dst_off`` (bytes relative to one base pointer), ``numel``, ``kind``
(element operation), ``n1, n2, n3`` (sizes of dims 1..3), four src strides, four
dst strides (elements), ``contiguous`` (1 when both sides are dense). Each
program copies ``BLOCK`` elements of one segment, found through the per-program
arrays ``prog_seg`` / ``prog_start``. The float32 -> bfloat16 rounding is done
in integer arithmetic so the interpreter and the GPU give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from weightfabric.kernels.bits import bf16_rne_bits
from weightfabric.kernels.dispatch import choose_backend

NCOL = 16
DEFAULT_BLOCK = 1024

# element operations (column `kind`)
_COPY_BY_SIZE = {1: 0, 2: 1, 4: 2, 8: 3}
_CASTS = {
    (torch.float32, torch.bfloat16): 4,
    (torch.bfloat16, torch.float32): 5,
    (torch.float32, torch.float16): 6,
    (torch.float16, torch.float32): 7,
}
SUPPORTED_CASTS: tuple[tuple[torch.dtype, torch.dtype], ...] = tuple(_CASTS)

Segment = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def program_segment(table_ptr, prog_seg_ptr, prog_start_ptr, NCOL: tl.constexpr):
    """This program's row of a segment table (a pointer) and its first unit (int64).

    Shared by the table-driven kernels; the per-program arrays come from `program_map`.
    """
    pid = tl.program_id(0)
    seg = tl.load(prog_seg_ptr + pid).to(tl.int64)
    return table_ptr + seg * NCOL, tl.load(prog_start_ptr + pid)


@triton.jit
def _segcopy_kernel(
    base_ptr,        # *u8: every segment address is base_ptr + byte offset
    table_ptr,       # *i64 [num_segments, NCOL]: the segment table (read only)
    prog_seg_ptr,    # *i32 [num_programs]: segment of each program
    prog_start_ptr,  # *i64 [num_programs]: first element of each program's block
    BLOCK: tl.constexpr,
    NCOL: tl.constexpr,
):
    row, start = program_segment(table_ptr, prog_seg_ptr, prog_start_ptr, NCOL)
    src_off = tl.load(row + 0)
    dst_off = tl.load(row + 1)
    numel = tl.load(row + 2)
    kind = tl.load(row + 3)
    contiguous = tl.load(row + 15)

    e = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < numel
    if contiguous == 1:
        src_idx = e
        dst_idx = e
    else:
        n1 = tl.load(row + 4)
        n2 = tl.load(row + 5)
        n3 = tl.load(row + 6)
        i3 = e % n3
        t = e // n3
        i2 = t % n2
        t = t // n2
        i1 = t % n1
        i0 = t // n1
        src_idx = (i0 * tl.load(row + 7) + i1 * tl.load(row + 8)
                   + i2 * tl.load(row + 9) + i3 * tl.load(row + 10))
        dst_idx = (i0 * tl.load(row + 11) + i1 * tl.load(row + 12)
                   + i2 * tl.load(row + 13) + i3 * tl.load(row + 14))

    src = base_ptr + src_off
    dst = base_ptr + dst_off
    if kind == 0:  # raw 1-byte copy (reads src bytes, writes dst bytes)
        v8 = tl.load(src + src_idx, mask=mask)
        tl.store(dst + dst_idx, v8, mask=mask)
    elif kind == 1:  # raw 2-byte copy
        s16 = src.to(tl.pointer_type(tl.int16))
        d16 = dst.to(tl.pointer_type(tl.int16))
        tl.store(d16 + dst_idx, tl.load(s16 + src_idx, mask=mask), mask=mask)
    elif kind == 2:  # raw 4-byte copy
        s32 = src.to(tl.pointer_type(tl.int32))
        d32 = dst.to(tl.pointer_type(tl.int32))
        tl.store(d32 + dst_idx, tl.load(s32 + src_idx, mask=mask), mask=mask)
    elif kind == 3:  # raw 8-byte copy
        s64 = src.to(tl.pointer_type(tl.int64))
        d64 = dst.to(tl.pointer_type(tl.int64))
        tl.store(d64 + dst_idx, tl.load(s64 + src_idx, mask=mask), mask=mask)
    elif kind == 4:  # float32 -> bfloat16, round to nearest even in integer math (NaN stays NaN)
        sbits = src.to(tl.pointer_type(tl.int32))
        dbf = dst.to(tl.pointer_type(tl.int16))
        tl.store(dbf + dst_idx, bf16_rne_bits(tl.load(sbits + src_idx, mask=mask)), mask=mask)
    elif kind == 5:  # bfloat16 -> float32 (exact: the bits move up 16 places)
        sbf = src.to(tl.pointer_type(tl.int16))
        dbits = dst.to(tl.pointer_type(tl.int32))
        h = tl.load(sbf + src_idx, mask=mask).to(tl.int32) & 0xFFFF
        tl.store(dbits + dst_idx, h << 16, mask=mask)
    elif kind == 6:  # float32 -> float16 (hardware / numpy round to nearest even)
        sf32 = src.to(tl.pointer_type(tl.float32))
        df16 = dst.to(tl.pointer_type(tl.float16))
        tl.store(df16 + dst_idx, tl.load(sf32 + src_idx, mask=mask).to(tl.float16), mask=mask)
    else:  # kind 7: float16 -> float32 (exact)
        sf16 = src.to(tl.pointer_type(tl.float16))
        df32 = dst.to(tl.pointer_type(tl.float32))
        tl.store(df32 + dst_idx, tl.load(sf16 + src_idx, mask=mask).to(tl.float32), mask=mask)


def element_kind(src_dtype: torch.dtype, dst_dtype: torch.dtype, what: str = "segment") -> int:
    """The kernel's element operation for a dtype pair; TypeError if unsupported."""
    if src_dtype == dst_dtype:
        size = torch.empty((), dtype=src_dtype).element_size()
        if size not in _COPY_BY_SIZE or src_dtype.is_complex:
            raise TypeError(f"{what}: dtype {src_dtype} is not supported")
        return _COPY_BY_SIZE[size]
    kind = _CASTS.get((src_dtype, dst_dtype))
    if kind is None:
        pairs = ", ".join(f"{a}->{b}" for a, b in _CASTS)
        raise TypeError(f"{what}: cannot cast {src_dtype} -> {dst_dtype}; supported: {pairs}")
    return kind


def _merge_dims(shape: Sequence[int], ss: Sequence[int], ds: Sequence[int]) -> list[tuple[int, int, int]]:
    """Drop size-1 dims and merge neighbours contiguous on both sides."""
    dims = [(n, a, b) for n, a, b in zip(shape, ss, ds, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, a, b in dims:
        if merged:
            pn, pa, pb = merged[-1]
            if pa == a * n and pb == b * n:
                merged[-1] = (pn * n, a, b)
                continue
        merged.append((n, a, b))
    return merged or [(1, 1, 1)]


def _rows(src: torch.Tensor, dst: torch.Tensor, base_ptr: int, kind: int) -> list[list[int]]:
    dims = _merge_dims(src.shape, src.stride(), dst.stride())
    if len(dims) > 4:  # split over the leading dim until 4 remain
        return [r for i in range(src.shape[0]) for r in _rows(src[i], dst[i], base_ptr, kind)]
    dims = [(1, 0, 0)] * (4 - len(dims)) + dims
    numel = src.numel()
    contiguous = int(dims[3][1] == 1 and dims[3][2] == 1 and all(d[0] == 1 for d in dims[:3]))
    return [[src.data_ptr() - base_ptr, dst.data_ptr() - base_ptr, numel, kind,
             dims[1][0], dims[2][0], dims[3][0],
             *(d[1] for d in dims), *(d[2] for d in dims), contiguous]]


def check_segments(segments: Sequence[Segment], what: str = "segment") -> list[int]:
    """Validate shapes, devices and dtypes; return each segment's element kind."""
    kinds = []
    for i, (src, dst) in enumerate(segments):
        if src.shape != dst.shape:
            raise ValueError(f"{what} {i}: source shape {tuple(src.shape)} != destination "
                             f"shape {tuple(dst.shape)}")
        if src.device != dst.device:
            raise ValueError(f"{what} {i}: source on {src.device}, destination on {dst.device}")
        kinds.append(element_kind(src.dtype, dst.dtype, f"{what} {i}"))
    return kinds


def build_table(segments: Sequence[Segment], base: torch.Tensor,
                kinds: Sequence[int]) -> torch.Tensor:
    """The int64 segment table (on CPU) for ``segments`` relative to ``base``."""
    rows: list[list[int]] = []
    for (src, dst), kind in zip(segments, kinds, strict=True):
        if src.numel():
            rows.extend(_rows(src, dst, base.data_ptr(), kind))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL)


def program_map(numels: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-program (segment id int32, first element int64) for ``numels`` split in blocks."""
    blocks = (numels + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(len(seg), dtype=torch.int64) - first.repeat_interleave(blocks)) * block
    return seg, start


def copy_segments_ref(segments: Sequence[Segment]) -> None:
    """Torch reference: ``dst.copy_(src)`` for every segment, in order."""
    for src, dst in segments:
        dst.copy_(src)


def copy_segments_triton(segments: Sequence[Segment], kinds: Sequence[int], *,
                         block: int = DEFAULT_BLOCK) -> None:
    """Launch `_segcopy_kernel` once for all of ``segments`` (already validated)."""
    if not segments:
        return
    device = segments[0][1].device
    base = torch.empty(16, dtype=torch.uint8, device=device)  # anchor for byte offsets
    table = build_table(segments, base, kinds)
    if table.shape[0] == 0:
        return
    prog_seg, prog_start = program_map(table[:, 2], block)
    _segcopy_kernel[(len(prog_seg),)](
        base_ptr=base,
        table_ptr=table.to(device), prog_seg_ptr=prog_seg.to(device),
        prog_start_ptr=prog_start.to(device), BLOCK=block, NCOL=NCOL)


def copy_segments(segments: Sequence[Segment], *, backend: str | None = None,
                  block: int = DEFAULT_BLOCK) -> None:
    """Copy every ``(src, dst)`` view pair, in one kernel launch on the Triton backend.

    Destinations must not overlap each other or any source (not checked here;
    callers that build segments check their own invariants).

    Raises:
        ValueError: shape or device mismatch (names the segment index).
        TypeError: unsupported dtype pair (names the segment index).
    """
    kinds = check_segments(segments)
    tensors = [t for pair in segments for t in pair]
    if choose_backend(backend, *tensors, op="copy_segments") == "torch":
        copy_segments_ref(segments)
    else:
        copy_segments_triton(segments, kinds, block=block)


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    sig = {"base_ptr": "*u8", "table_ptr": "*i64", "prog_seg_ptr": "*i32",
           "prog_start_ptr": "*i64", "BLOCK": "constexpr", "NCOL": "constexpr"}
    return [(_segcopy_kernel, sig, {"BLOCK": DEFAULT_BLOCK, "NCOL": NCOL})]
