"""Pack a tensor set into its buffer and checksum the buffer's chunks in one pass (Triton).

`kernels.pack.pack_with_checksums` uses this on CUDA tensors: each program owns one
tile of the *buffer* (``TILE`` bytes, never across a chunk edge: the tile is cut to
the largest power of two dividing ``chunk_size``), fetches every byte of it from
wherever it comes from, writes it to the buffer and mixes it into the chunk's
checksum (`kernels.checksum`'s function, the same bits as `chunk_checksums_ref`),
then adds its partial sum to the chunk with one atomic. Each byte is read once.

Where the bytes come from is a table of *pieces* in buffer order, int64 ``[n,
NCOL]``: columns ``lo`` (the piece's first buffer byte; piece ``i`` ends where
``i + 1`` starts), ``delta`` (buffer byte ``x`` of the piece lives at ``anchor +
delta + x``, the anchor being `kernels.segcopy.anchor`) and ``mode`` (bit 0: the
source is 4-byte aligned relative to the buffer, bit 1: 16-byte aligned, bit 2:
the source is the buffer itself). A contiguous tensor of its slot's dtype is a
piece read straight from the tensor. Everything else is a piece read from the
buffer in place: the padding (summed as it is, stale bytes of a reused buffer
too), and tensors the piece table cannot address (strided views, casts), which
`kernels.segcopy` writes into the buffer first, in a launch queued before this
one (those bytes are read twice).

Paths of a program: a tile inside one piece with a 4-byte-aligned source moves
32-bit words (16-byte vectors when the source is 16-byte aligned: hinted, true by
construction), ``SUB`` bytes per step; any other tile (a piece edge inside it, a
source at an odd address) moves bytes, ``BYTE_SUB`` per step, each lane finding
its piece by a binary search of the tile's few pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weightfabric.kernels.checksum import _finish
from weightfabric.kernels.layout import PackLayout
from weightfabric.kernels.segcopy import (
    anchor,
    element_kind,
    last_at_or_before,
    launch_table,
    segment_table,
)

TILE = 65536
"""Buffer bytes per program (at most: cut to the chunk size's largest power-of-two divisor)."""
SUB = 8192
"""Bytes a program moves per loop step on the word path (1,024 pairs, the checksum's step)."""
BYTE_SUB = 1024
"""Bytes a program moves per loop step on the byte path (tiles with a piece edge inside)."""
MIN_TILE = 64
"""Smallest tile; a chunk size whose largest power-of-two divisor is smaller is packed,
then checksummed (two passes)."""
NUM_WARPS = 8
NCOL = 3
WORDS, VECTORS, IN_PLACE = 1, 2, 4


@triton.jit
def _mix(d, p):
    """The checksum terms of pairs ``d`` (uint64) at pair positions ``p`` (int64)."""
    k = d ^ (p.to(tl.int64).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    return (k & 0xFFFFFFFF) * (k >> 32) + d


@triton.jit
def _tile_words(base_ptr, delta, out_ptr, lo, hi, mode, SUB: tl.constexpr, VEC: tl.constexpr):
    """Move and sum buffer bytes ``[lo, hi)`` of one piece as 32-bit words; the tile's sum.

    ``lo`` is a multiple of SUB (>= 16); ``mode``'s IN_PLACE bit: the source is the
    buffer itself (read, not written back). VEC: ``base_ptr + delta`` is 16-byte aligned
    (the host checked), so every step is 16-byte vectors; the hints are set here, on
    values computed here (Triton drops hints on a function's arguments).
    """
    src = base_ptr + delta
    if VEC:
        src = tl.multiple_of(src, 16)
    s32 = src.to(tl.pointer_type(tl.int32))
    d32 = out_ptr.to(tl.pointer_type(tl.int32))
    words = tl.arange(0, SUB // 4)
    pairs = tl.arange(0, SUB // 8)
    acc = tl.zeros([SUB // 8], dtype=tl.uint64)
    for b in range(lo, hi, SUB):
        w0 = b // 4
        if VEC:
            w0 = tl.multiple_of(w0, 4)
        j = w0 + words
        if b + SUB <= hi:  # a whole step: no masks
            w = tl.load(s32 + j)
            if (mode & 4) == 0:
                tl.store(d32 + j, w)
        else:  # the tile's (and buffer's) end: only its words, a missing high half is zero
            inside = j < hi // 4
            w = tl.load(s32 + j, mask=inside, other=0)
            if (mode & 4) == 0:
                tl.store(d32 + j, w, mask=inside)
        a, c = tl.split(tl.reshape(w.to(tl.uint32, bitcast=True).to(tl.uint64), (SUB // 8, 2)))
        p = b // 8 + pairs
        acc += tl.where(p * 8 < hi, _mix(a | (c << 32), p), 0)
    return tl.sum(acc, axis=0)


@triton.jit
def _tile_bytes(base_ptr, table_ptr, out_ptr, lo, hi, first, last,
                BSUB: tl.constexpr, NCOL: tl.constexpr):
    """Move and sum buffer bytes ``[lo, hi)`` (pieces ``first..last``) byte by byte; the sum."""
    lanes = tl.arange(0, BSUB).to(tl.int64)
    pairs = tl.arange(0, BSUB // 8)
    shifts = (tl.arange(0, 8) * 8).to(tl.uint64)
    acc = tl.zeros([BSUB // 8], dtype=tl.uint64)
    for b in range(lo, hi, BSUB):
        x = b + lanes
        inside = x < hi
        piece = first + lanes * 0  # each lane: the last of the tile's pieces starting <= x
        size = last - first + 1
        while size > 1:
            half = size // 2
            go = tl.load(table_ptr + (piece + half) * NCOL) <= x
            piece = tl.where(go, piece + half, piece)
            size -= half
        delta = tl.load(table_ptr + piece * NCOL + 1)
        v = tl.load(base_ptr + delta + x, mask=inside, other=0)
        tl.store(out_ptr + x, v, mask=inside)
        d = tl.sum(tl.reshape(v.to(tl.uint64), (BSUB // 8, 8)) << shifts[None, :], axis=1)
        p = b // 8 + pairs
        acc += tl.where(p * 8 < hi, _mix(d, p), 0)
    return tl.sum(acc, axis=0)


@triton.jit
def _pack_checksum_kernel(
    base_ptr,      # *u8: the anchor; a piece's byte x lives at base_ptr + delta + x
    out_ptr,       # *u8: the buffer (written)
    table_ptr,     # *i64 [num_pieces, NCOL]: lo, delta, mode (read only)
    num_pieces,    # rows of the table
    sums_ptr,      # *i64 [num_chunks]: zeroed; each program adds its tile's wrapping sum
    nbytes,        # bytes of the buffer packed and summed (a multiple of 4)
    chunk_bytes,   # chunk size, a multiple of TILE
    TILE: tl.constexpr, SUB: tl.constexpr, BSUB: tl.constexpr, NCOL: tl.constexpr,
):
    lo = tl.program_id(0).to(tl.int64) * TILE
    hi = tl.minimum(lo + TILE, nbytes)
    first = last_at_or_before(table_ptr, num_pieces, lo, NCOL)
    last = last_at_or_before(table_ptr, num_pieces, hi - 1, NCOL)
    mode = tl.load(table_ptr + first * NCOL + 2)
    if (first == last) & ((mode & 1) != 0):  # one piece, a word-aligned source
        delta = tl.load(table_ptr + first * NCOL + 1)
        if (mode & 2) != 0:
            total = _tile_words(base_ptr, delta, out_ptr, lo, hi, mode, SUB, True)
        else:
            total = _tile_words(base_ptr, delta, out_ptr, lo, hi, mode, SUB, False)
    else:
        total = _tile_bytes(base_ptr, table_ptr, out_ptr, lo, hi, first, last, BSUB, NCOL)
    tl.atomic_add(sums_ptr + lo // chunk_bytes, total.to(tl.int64, bitcast=True))


def tile_for(chunk_size: int, tile: int = TILE) -> int | None:
    """The fused kernel's tile for ``chunk_size``-byte chunks, or None (then: two passes)."""
    t = min(tile, chunk_size & -chunk_size)
    return t if t >= MIN_TILE else None


@dataclass(frozen=True)
class FusedPlan:
    """What one fused pack + checksum launch needs; depends only on what `plan` reads.

    Attributes:
        table: the piece table, on the buffer's device.
        num_pieces: its rows.
        tile: bytes per program.
        copies: `segcopy` ``(table, rows, programs)`` for the tensors written first
            (strided, cast), or None.
    """

    table: torch.Tensor
    num_pieces: int
    tile: int
    copies: tuple[torch.Tensor, int, int] | None


def pieces(tensors: Mapping[str, torch.Tensor], layout: PackLayout, out: torch.Tensor,
           base_addr: int) -> tuple[list[list[int]], list[str]]:
    """The piece table's rows for ``layout`` over ``out``, and the slots written beforehand.

    Consecutive pieces read from the same mapping merge; empty slots are skipped.
    """
    in_place = out.data_ptr() - base_addr
    in_mode = WORDS | IN_PLACE | (VECTORS if out.data_ptr() % 16 == 0 else 0)
    rows: list[list[int]] = []

    def add(lo: int, delta: int, mode: int) -> None:
        if rows and rows[-1][1] == delta and rows[-1][2] == mode:
            return  # the previous piece goes on
        if rows and rows[-1][0] == lo:
            rows[-1] = [lo, delta, mode]  # the previous piece was empty
        else:
            rows.append([lo, delta, mode])

    add(0, in_place, in_mode)
    first_written: list[str] = []
    for s in sorted(layout, key=lambda s: s.offset):
        t = tensors[s.name]
        if not s.nbytes:
            continue
        if t.dtype != s.dtype or not t.is_contiguous():
            first_written.append(s.name)
            continue
        rel = t.data_ptr() - s.offset
        mode = (WORDS if rel % 4 == 0 else 0) | (VECTORS if rel % 16 == 0 else 0)
        add(s.offset, rel - base_addr, mode)
        add(s.offset + s.nbytes, in_place, in_mode)
    if len(rows) > 1 and rows[-1][0] >= layout.nbytes:
        rows.pop()
    return rows, first_written


def plan(tensors: Mapping[str, torch.Tensor], layout: PackLayout, out: torch.Tensor,
         tile: int, block: int) -> FusedPlan:
    """Build the `FusedPlan` (inputs already validated by `kernels.pack`)."""
    base = anchor(out.device)
    rows, first_written = pieces(tensors, layout, out, base.data_ptr())
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL).to(out.device)
    copies = None
    if first_written:
        segments = [(tensors[n], out[layout[n].offset:layout[n].offset + layout[n].nbytes]
                     .view(layout[n].dtype).view(layout[n].shape)) for n in first_written]
        kinds = [element_kind(layout[n].source_dtype, layout[n].dtype) for n in first_written]
        copies = segment_table(segments, kinds, block)
    return FusedPlan(table, table.shape[0], tile, copies)


def launch(fused: FusedPlan, out: torch.Tensor, nbytes: int, chunk_size: int,
           block: int) -> torch.Tensor:
    """Run ``fused`` on ``out``; ``chunk_checksums(out[:nbytes], chunk_size)``."""
    sums = torch.zeros(-(-nbytes // chunk_size), dtype=torch.int64, device=out.device)
    if fused.copies is not None:
        launch_table(out.device, *fused.copies, block=block)
    programs = -(-nbytes // fused.tile)
    if programs:
        _pack_checksum_kernel[(programs,)](
            anchor(out.device), out, fused.table, fused.num_pieces, sums, nbytes, chunk_size,
            TILE=fused.tile, SUB=min(SUB, fused.tile), BSUB=min(BYTE_SUB, fused.tile), NCOL=NCOL,
            num_warps=NUM_WARPS)
    return _finish(sums, nbytes, chunk_size)


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    sig = {"base_ptr": "*u8", "out_ptr": "*u8", "table_ptr": "*i64", "num_pieces": "i64",
           "sums_ptr": "*i64", "nbytes": "i64", "chunk_bytes": "i64",
           "TILE": "constexpr", "SUB": "constexpr", "BSUB": "constexpr", "NCOL": "constexpr"}
    return [(_pack_checksum_kernel, sig,
             {"TILE": TILE, "SUB": SUB, "BSUB": BYTE_SUB, "NCOL": NCOL})]
