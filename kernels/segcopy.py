"""One launch copies a whole list of strided segments, with an optional cast.

This is the engine under pack/unpack and resharding. A *segment* is a pair of
tensor views of the same shape, ``(src, dst)``; ``dst`` receives ``src``. Any
strides are allowed on either side (up to 4 dims after merging dims that are
contiguous on both sides; more are split into several segments). Supported
``(src.dtype, dst.dtype)`` pairs: equal dtypes of 1, 2, 4 or 8 bytes (a raw
copy, bit-exact for every value), float32 -> bfloat16 / float16 (round to
nearest even; a NaN stays a NaN, its payload bits unspecified), bfloat16 / float16 -> float32
(exact).

Kernel layout (built for memory speed on Hopper): each segment becomes rows of
an inner run (``rows x len`` *units*, up to 3 outer dims flattened into rows).
The host picks, per segment, the widest unit its addresses, byte strides and
run length allow: a raw copy whose run is contiguous on both sides and 16-byte
aligned moves 16-byte vectors (int32 x 4, with `tl.multiple_of` /
`tl.max_contiguous` hints that are true by construction); otherwise 8-, 4-, 2-
or 1-byte words. A 1-D segment whose length is not a multiple of the vector is
split into an aligned body and a short tail. Casts move 4 elements per vector
when aligned. A program moves one tile of ``BLOCK`` units (32 KiB on the 16-byte
path) of one segment: ``2**shift`` columns (a power of two covering the run, at
most ``BLOCK``) times ``BLOCK >> shift`` rows, so short rows do not waste lanes
and the inner index needs no division. The grid is flat over every tile of every
segment; each program finds its segment by a binary search of the table's
``first`` column (a prefix sum of tiles per segment): per program, not per
element, and nothing per program is built on the host.

Host cost per call: `copy_segments`' checks depend only on each view's address,
dtype, shape, strides and device, so a call whose key (those properties) passed
them before skips them and reuses the table built for that key (`CheckCache`,
also used by `kernels.reshard` and `kernels.dequant_segments`): a repeated copy
costs the host the key and the launch.

Segment table: int64 ``[num_segments, NCOL]``, columns ``first`` (first tile),
``op``, ``src_off, dst_off`` (bytes from one anchor allocation), ``rows, len``
(units), ``shift, cpt, rpt`` (columns and rows per tile), ``col_tiles``,
``n1, n2`` (sizes of outer dims 1..2), three src and three dst outer strides,
and the inner strides (units). The float32 -> bfloat16 rounding is done in
integer arithmetic so the interpreter and the GPU give the same bits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from weightfabric.kernels.bits import bf16_rne_bits
from weightfabric.kernels.dispatch import choose_backend

NCOL = 20
DEFAULT_BLOCK = 8192
"""Units per program: 8192 x 4 bytes = 32 KiB read and 32 KiB written on the 16-byte path."""
SUB_BLOCK = 2048
"""Lanes a program moves per step of its loop over the tile (all 8192 at once spilled
registers on an H200: pack ran at 116 GB/s). 8192 / 2048 / 4 warps was the fastest
setting `tools/gpu/tune_kernels.py` found there (docs/benchmarks.md)."""
NUM_WARPS = 4

# element operations (what one unit does); `kind` in the public API
_COPY_BY_SIZE = {1: 0, 2: 1, 4: 2, 8: 3}
_CASTS = {
    (torch.float32, torch.bfloat16): 4,
    (torch.bfloat16, torch.float32): 5,
    (torch.float32, torch.float16): 6,
    (torch.float16, torch.float32): 7,
}
SUPPORTED_CASTS: tuple[tuple[torch.dtype, torch.dtype], ...] = tuple(_CASTS)
_KIND_BYTES = {0: (1, 1), 1: (2, 2), 2: (4, 4), 3: (8, 8), 4: (4, 2), 5: (2, 4), 6: (4, 2), 7: (2, 4)}
# kernel ops: 0..7 the element kinds on any inner stride; 8 raw 16-byte vectors (int32 x 4);
# 9..12 the casts 4..7, four elements per vector
_VEC = 4
_VEC_OP = {2: 8, 4: 9, 5: 10, 6: 11, 7: 12}

Segment = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def find_segment(table_ptr, num_segments, NCOL: tl.constexpr):
    """(row pointer, tile within the segment) of this program.

    Column 0 of the table holds each segment's first tile (strictly increasing,
    0 first); a binary search finds the last segment starting at or before the
    program id: log2(num_segments) scalar loads per program.
    """
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + last_at_or_before(table_ptr, num_segments, pid, NCOL) * NCOL
    return row, pid - tl.load(row)


@triton.jit
def last_at_or_before(table_ptr, num_rows, x, NCOL: tl.constexpr):
    """Index of the last row whose column 0 (increasing, row 0 <= x) is <= scalar ``x``."""
    lo = x * 0
    hi = lo + num_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid * NCOL) <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length,
          KIND: tl.constexpr, VEC: tl.constexpr, SA: tl.constexpr, DA: tl.constexpr):
    """Move the units of rows ``r`` x columns ``c`` with element operation KIND.

    Move the units of rows ``r`` x columns ``c`` (row offsets ``so`` / ``do``) with element
    operation KIND.

    VEC == 1: inner strides from the table row. VEC > 1: the inner run is contiguous
    on both sides, run length and row offsets are multiples of VEC and the byte
    offsets of SA / DA (the host checked), and each run of VEC lanes shares its row:
    every run is one vector access. The hints are set here, on values computed here
    (Triton drops hints on a function's arguments).
    """
    mask = (r < num_rows) & (c < length)
    if VEC > 1:
        so = tl.max_contiguous(tl.multiple_of(so + c, VEC), VEC)
        do = tl.max_contiguous(tl.multiple_of(do + c, VEC), VEC)
        mask = tl.max_constancy(mask, VEC)
        src = tl.multiple_of(base_ptr + src_off, SA)
        dst = tl.multiple_of(base_ptr + dst_off, DA)
    else:
        so = so + c * tl.load(row + 18)
        do = do + c * tl.load(row + 19)
        src = base_ptr + src_off
        dst = base_ptr + dst_off
    if KIND == 0:  # raw 1-byte units
        tl.store(dst + do, tl.load(src + so, mask=mask), mask=mask)
    elif KIND == 1:  # raw 2-byte units
        s16 = src.to(tl.pointer_type(tl.int16))
        d16 = dst.to(tl.pointer_type(tl.int16))
        tl.store(d16 + do, tl.load(s16 + so, mask=mask), mask=mask)
    elif KIND == 2:  # raw 4-byte units (16-byte vectors when VEC == 4)
        s32 = src.to(tl.pointer_type(tl.int32))
        d32 = dst.to(tl.pointer_type(tl.int32))
        tl.store(d32 + do, tl.load(s32 + so, mask=mask), mask=mask)
    elif KIND == 3:  # raw 8-byte units
        s64 = src.to(tl.pointer_type(tl.int64))
        d64 = dst.to(tl.pointer_type(tl.int64))
        tl.store(d64 + do, tl.load(s64 + so, mask=mask), mask=mask)
    elif KIND == 4:  # float32 -> bfloat16, round to nearest even in integer math (NaN stays NaN)
        sbits = src.to(tl.pointer_type(tl.int32))
        dbf = dst.to(tl.pointer_type(tl.int16))
        tl.store(dbf + do, bf16_rne_bits(tl.load(sbits + so, mask=mask)), mask=mask)
    elif KIND == 5:  # bfloat16 -> float32 (exact: the bits move up 16 places)
        sbf = src.to(tl.pointer_type(tl.int16))
        dbits = dst.to(tl.pointer_type(tl.int32))
        h = tl.load(sbf + so, mask=mask).to(tl.int32) & 0xFFFF
        tl.store(dbits + do, h << 16, mask=mask)
    elif KIND == 6:  # float32 -> float16 (hardware / numpy round to nearest even)
        sf32 = src.to(tl.pointer_type(tl.float32))
        df16 = dst.to(tl.pointer_type(tl.float16))
        tl.store(df16 + do, tl.load(sf32 + so, mask=mask).to(tl.float16), mask=mask)
    else:  # KIND 7: float16 -> float32 (exact)
        sf16 = src.to(tl.pointer_type(tl.float16))
        df32 = dst.to(tl.pointer_type(tl.float32))
        tl.store(df32 + do, tl.load(sf16 + so, mask=mask).to(tl.float32), mask=mask)


@triton.jit
def _segcopy_kernel(
    base_ptr,        # *u8: every segment address is base_ptr + byte offset
    table_ptr,       # *i64 [num_segments, NCOL]: the segment table (read only)
    num_segments,    # rows of the table
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    NCOL: tl.constexpr,
):
    row, tile = find_segment(table_ptr, num_segments, NCOL)
    op = tl.load(row + 1)
    src_off = tl.load(row + 2)
    dst_off = tl.load(row + 3)
    num_rows = tl.load(row + 4)
    length = tl.load(row + 5)
    shift = tl.load(row + 6).to(tl.int32)
    cpt = tl.load(row + 7)
    rpt = tl.load(row + 8)
    col_tiles = tl.load(row + 9)
    n1 = tl.load(row + 10)
    n2 = tl.load(row + 11)
    s0, s1, s2 = tl.load(row + 12), tl.load(row + 13), tl.load(row + 14)
    d0, d1, d2 = tl.load(row + 15), tl.load(row + 16), tl.load(row + 17)

    # the tile: BLOCK lanes as (BLOCK >> shift) rows x 2**shift columns, no division,
    # moved SUB lanes at a time (few registers per thread: no spills at any BLOCK)
    tile_r = tile // col_tiles
    tile_c = tile - tile_r * col_tiles
    for k in range(0, BLOCK // SUB):
        lane = k * SUB + tl.arange(0, SUB)
        r = tile_r * rpt + (lane >> shift).to(tl.int64)
        c = tile_c * cpt + (lane & (cpt.to(tl.int32) - 1)).to(tl.int64)
        if n1 * n2 > 1:  # 3 or 4 dims: split the row index (per element, rare)
            i2 = r % n2
            t = r // n2
            i1 = t % n1
            i0 = t // n1
            so = i0 * s0 + i1 * s1 + i2 * s2
            do = i0 * d0 + i1 * d1 + i2 * d2
        else:
            so = r * s0
            do = r * d0

        if op == 8:  # the hot path: raw copy, 16-byte vectors
            _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 2, 4, 16, 16)
        elif op < 4:  # raw copy of 1-, 2-, 4- or 8-byte units, any inner strides
            if op == 0:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 0, 1, 1, 1)
            elif op == 1:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 1, 1, 1, 1)
            elif op == 2:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 2, 1, 1, 1)
            else:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 3, 1, 1, 1)
        elif op < 8:  # casts, any inner strides
            if op == 4:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 4, 1, 1, 1)
            elif op == 5:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 5, 1, 1, 1)
            elif op == 6:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 6, 1, 1, 1)
            else:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 7, 1, 1, 1)
        else:  # casts of aligned contiguous runs, 4 elements per vector
            if op == 9:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 4, 4, 16, 8)
            elif op == 10:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 5, 4, 8, 16)
            elif op == 11:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 6, 4, 16, 8)
            else:
                _move(base_ptr, row, src_off, dst_off, so, do, r, c, num_rows, length, 7, 4, 8, 16)


def element_kind(src_dtype: torch.dtype, dst_dtype: torch.dtype, what: str = "segment") -> int:
    """The kernel's element operation for a dtype pair; TypeError if unsupported."""
    if src_dtype == dst_dtype:
        size = src_dtype.itemsize
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


def _lowbit(x: int) -> int:
    """Largest power of two dividing ``x`` (capped at 16; 16 for 0)."""
    return min(16, x & -x) if x else 16


def _geometry(op: int, src_off: int, dst_off: int, outer: list[tuple[int, int, int]],
              length: int, sin: int, din: int, block: int) -> list[int]:
    """A table row (first tile left 0) for rows ``outer`` x ``length`` units."""
    outer = [(1, 0, 0)] * (3 - len(outer)) + outer
    rows = outer[0][0] * outer[1][0] * outer[2][0]
    cpt = min(block, 1 << max(0, (length - 1).bit_length()))
    return [0, op, src_off, dst_off, rows, length, cpt.bit_length() - 1, cpt, block // cpt,
            -(-length // cpt), outer[1][0], outer[2][0],
            *(d[1] for d in outer), *(d[2] for d in outer), sin, din]


def _rows(src: torch.Tensor, dst: torch.Tensor, base_ptr: int, kind: int, block: int) -> list[list[int]]:
    dims = _merge_dims(src.shape, src.stride(), dst.stride())
    if len(dims) > 4:  # split over the leading dim until 4 remain
        return [r for i in range(src.shape[0]) for r in _rows(src[i], dst[i], base_ptr, kind, block)]
    return _split_rows(src.data_ptr() - base_ptr, dst.data_ptr() - base_ptr, dims, kind, block)


def _split_rows(src_off: int, dst_off: int, dims: list[tuple[int, int, int]], kind: int,
                block: int) -> list[list[int]]:
    """Table rows for one segment.

    The widest access its alignment allows, a 1-D segment split into a vector body and a
    narrower tail.
    """
    ssize, dsize = _KIND_BYTES[kind]
    (n, sin, din), outer = dims[-1], dims[:-1]
    if sin != 1 or din != 1:  # strided inner dim: one element per lane
        return [_geometry(kind, src_off, dst_off, outer, n, sin, din, block)]
    if kind <= 3:  # raw copy of a contiguous run: bytes, widest aligned word
        nbytes = n * ssize
        g = _lowbit(src_off)
        for x in (dst_off, *(d[1] * ssize for d in outer), *(d[2] * ssize for d in outer)):
            g = min(g, _lowbit(x))
        if not outer and nbytes % g and nbytes > g:  # 1-D: aligned body, then the tail
            body = nbytes - nbytes % g
            return (_split_rows(src_off, dst_off, [(body, 1, 1)], 0, block)
                    + _split_rows(src_off + body, dst_off + body, [(nbytes - body, 1, 1)], 0, block))
        g = min(g, _lowbit(nbytes))
        unit = min(g, 8) if g < 16 else 4
        scaled = [(m, a * ssize // unit, b * ssize // unit) for m, a, b in outer]
        op = _VEC_OP[2] if g == 16 else _COPY_BY_SIZE[unit]
        return [_geometry(op, src_off, dst_off, scaled, nbytes // unit, 1, 1, block)]
    # a cast: 4 elements per vector when both sides are aligned to 4 elements
    aligned = (src_off % (_VEC * ssize) == 0 and dst_off % (_VEC * dsize) == 0
               and all(a % _VEC == 0 and b % _VEC == 0 for _, a, b in outer))
    if aligned and not outer and n % _VEC and n > _VEC:
        body = n - n % _VEC
        return (_split_rows(src_off, dst_off, [(body, 1, 1)], kind, block)
                + [_geometry(kind, src_off + body * ssize, dst_off + body * dsize, [],
                             n - body, 1, 1, block)])
    op = _VEC_OP[kind] if aligned and n % _VEC == 0 else kind
    return [_geometry(op, src_off, dst_off, outer, n, 1, 1, block)]


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


def check_block(block: int) -> None:
    """ValueError unless ``block`` (units per program) is a power of two >= 16."""
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"copy_segments: block must be a power of two >= 16, got {block!r}")


def build_table(segments: Sequence[Segment], base: torch.Tensor, kinds: Sequence[int],
                block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The int64 segment table (on CPU) for ``segments`` relative to ``base``.

    The int64 segment table (on CPU) for ``segments`` relative to ``base``, column ``first``
    filled with each row's first tile (a prefix sum; the grid is the total).
    """
    check_block(block)
    rows: list[list[int]] = []
    for (src, dst), kind in zip(segments, kinds, strict=True):
        if src.numel():
            rows.extend(_rows(src, dst, base.data_ptr(), kind, block))
    first = 0
    for row in rows:
        row[0] = first
        first += -(-row[4] // row[8]) * row[9]  # row tiles x column tiles
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL)


def num_tiles(table: torch.Tensor) -> int:
    """Programs a launch over ``table`` needs (its tiles)."""
    if not table.shape[0]:
        return 0
    last = table[-1].tolist()
    return last[0] + -(-last[4] // last[8]) * last[9]


_ANCHORS: dict[torch.device, torch.Tensor] = {}
CHECK_CACHE_SIZE = 64
"""Checked call keys a `CheckCache` keeps (each with its device tables, a few KiB),
least recently used out first."""
KEY_ERRORS = (AttributeError, TypeError, ValueError, RuntimeError)
"""What taking a call key of malformed arguments raises (the checks then report them)."""


def anchor(device: torch.device) -> torch.Tensor:
    """A 16-byte-aligned allocation on ``device`` that table offsets count from.

    A 16-byte-aligned allocation on ``device`` that table byte offsets count from, kept for
    the process's life so that tables can be reused between calls.
    """
    a = _ANCHORS.get(device)
    if a is None:
        raw = torch.empty(32, dtype=torch.uint8, device=device)
        a = raw[-raw.data_ptr() % 16:][:16]
        _ANCHORS[device] = a
    return a


def tensor_key(t: torch.Tensor) -> tuple:
    """What a check or a table can depend on: address, dtype, shape, strides, device."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)


def first_per_device(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Index of the first of ``tensors`` on each device they are on."""
    first: dict[torch.device, int] = {}
    for i, t in enumerate(tensors):
        first.setdefault(t.device, i)
    return tuple(first.values())


class Checked:
    """A call key that passed its checks, and the tables built for it.

    ``owner``: an object the key holds by identity (kept alive while the entry is);
    ``reps``: indices of one tensor per device of the call (`first_per_device`), so
    that `choose_backend` sees the same devices without a pass over every tensor.
    """

    def __init__(self, key: tuple | None, owner: object, reps: tuple[int, ...]) -> None:
        self.key = key
        self.owner = owner
        self.reps = reps
        self.tables: dict[tuple, Any] = {}

    def table(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The table under ``key``, from ``build()`` the first time."""
        hit = self.tables.get(key)
        if hit is None:
            hit = self.tables[key] = build()
        return hit


def _hash(key: tuple | None) -> int | None:
    """``hash(key)``; None for no key or an unhashable one."""
    try:
        return None if key is None else hash(key)
    except TypeError:  # an unhashable part: not a key the checks pass
        return None


class CheckCache:
    """Call keys whose checks passed, at most ``size`` (least recently used out first).

    Entries are filed by the key's hash, computed once per call (a key of hundreds of
    tensors takes ~0.1 ms to hash), and a hit compares the whole key.
    """

    def __init__(self, size: int = CHECK_CACHE_SIZE) -> None:
        self.size = size
        self._entries: OrderedDict[int, Checked] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple | None, owner: object = None) -> Checked | None:
        """The entry of a key checked before (with this very ``owner``), or None."""
        h = _hash(key)
        if h is None:
            return None
        with self._lock:
            hit = self._entries.get(h)
            if hit is None or hit.owner is not owner or hit.key != key:
                return None
            self._entries.move_to_end(h)
            return hit

    def remember(self, key: tuple | None, owner: object = None,
                 reps: tuple[int, ...] = ()) -> Checked:
        """A new entry for a key whose checks just passed (kept unless ``key`` is None)."""
        entry = Checked(key, owner, reps)
        h = _hash(key)
        if h is not None:
            with self._lock:
                self._entries[h] = entry
                self._entries.move_to_end(h)
                while len(self._entries) > self.size:
                    self._entries.popitem(last=False)
        return entry


_CHECKED = CheckCache()


def copy_segments_ref(segments: Sequence[Segment]) -> None:
    """Torch reference: ``dst.copy_(src)`` for every segment, in order."""
    for src, dst in segments:
        dst.copy_(src)


def segment_table(segments: Sequence[Segment], kinds: Sequence[int],
                  block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, int, int]:
    """``(device table, rows, programs)`` for non-empty ``segments`` (built, not cached)."""
    device = segments[0][1].device
    table = build_table(segments, anchor(device), kinds, block)
    return table.to(device), table.shape[0], num_tiles(table)


def launch_table(device: torch.device, table: torch.Tensor, num_segments: int, programs: int, *,
                 block: int = DEFAULT_BLOCK) -> None:
    """Launch `_segcopy_kernel` over a `segment_table` built with the same ``block``."""
    if programs:
        _segcopy_kernel[(programs,)](anchor(device), table, num_segments, BLOCK=block,
                                     SUB=min(block, SUB_BLOCK), NCOL=NCOL, num_warps=NUM_WARPS)


def copy_segments(segments: Sequence[Segment], *, backend: str | None = None,
                  block: int = DEFAULT_BLOCK) -> None:
    """Copy every ``(src, dst)`` view pair, in one kernel launch on the Triton backend.

    Destinations must not overlap each other or any source (not checked here;
    callers that build segments check their own invariants).

    Raises:
        ValueError: shape or device mismatch (names the segment index).
        TypeError: unsupported dtype pair (names the segment index).
    """
    checked = _checked_segments(segments)
    reps = [segments[i][1] for i in checked.reps]
    if choose_backend(backend, *reps, op="copy_segments") == "torch":
        copy_segments_ref(segments)
    elif segments:
        def build() -> tuple[torch.Tensor, int, int]:
            return segment_table(segments, [element_kind(s.dtype, d.dtype) for s, d in segments],
                                 block)

        launch_table(reps[0].device, *checked.table(("segcopy", block), build), block=block)


def _checked_segments(segments: Sequence[Segment]) -> Checked:
    """`check_segments`, skipped for a call key checked before."""
    try:
        key: tuple | None = ("segcopy", *[(*tensor_key(s), *tensor_key(d)) for s, d in segments])
    except KEY_ERRORS:
        key = None
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    check_segments(segments)
    return _CHECKED.remember(key, reps=first_per_device(d for _, d in segments))


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    sig = {"base_ptr": "*u8", "table_ptr": "*i64", "num_segments": "i64",
           "BLOCK": "constexpr", "SUB": "constexpr", "NCOL": "constexpr"}
    return [(_segcopy_kernel, sig, {"BLOCK": DEFAULT_BLOCK, "SUB": SUB_BLOCK, "NCOL": NCOL})]
