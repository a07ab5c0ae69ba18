"""Lossless delta of one chunk of weight bytes against an older version of the same chunk.

Between consecutive RL versions only a few percent of the bf16 values change, so a
chunk of version ``v`` is sent as the words that changed since a base version the
receiver already holds. `encode_delta` builds the delta, `decode_delta` applies it,
bit-exact: words are compared as integers (their bits), so NaN payloads and
``-0.0`` vs ``+0.0`` are changes like any other.

Wire format (little-endian). The chunk, ``nbytes`` bytes, is read as
``nwords = nbytes / width`` words of ``width`` bytes (1, 2, 4 or 8, dividing
``nbytes``); word ``p`` *changed* when its bits differ between base and v. The
positions of the ``count`` changed words are ``p_0 < p_1 < ...``. A blob is a
24-byte header, struct ``"<4sBBBBQQ"``::

    offset  size  field
         0     4  magic      b"WFD1"
         4     1  kind       0 FULL, 1 GAPS, 2 MASK
         5     1  width      1, 2, 4 or 8
         6     1  gap_bytes  GAPS: 2 or 4; FULL and MASK: 0
         7     1  reserved   0
         8     8  nbytes     u64, the decoded length (that of base)
        16     8  count      u64, changed words (FULL too: the true count)

then the payload of its kind:

- FULL: the ``nbytes`` bytes of v.
- GAPS: ``count`` gaps, then ``count`` values. ``gap_i = p_i - p_{i-1} - 1`` with
  ``p_{-1} = -1`` (so ``gap_i >= 0``), each an unsigned little-endian integer of
  ``gap_bytes`` bytes. Values: the changed words of v, ``count * width`` bytes in
  position order.
- MASK: a bitmask of ``ceil(nwords / 8)`` bytes (bit ``i`` of byte ``j``, LSB first,
  is word ``8j + i``; 1 = changed; the padding bits of the last byte are 0), then
  the ``count`` values in position order.

A blob is exactly as long as its header says. The encoder picks the smaller of
GAPS (``gap_bytes`` 2 when every gap is below 65536, else 4; not possible with a
gap of ``2**32`` or more) and MASK (GAPS on a tie), and FULL when that is not
smaller than FULL; a delta with no changed word is GAPS with count 0 (header
only, ``gap_bytes`` 2). The decoder accepts any blob of this format (``gap_bytes``
4 with small gaps too) and rejects everything else with `DeltaFormatError`
before it writes a byte: a hostile blob can neither write out of bounds nor
leave ``out`` half-written.

Backends: on CPU, sparse changes (a sixteenth of the words or fewer: where GAPS can
win) are found by one native pass over both buffers (`kernels.native.delta_scan`,
64 bytes compared at a time; about 2x the torch path), which falls back to the torch
path for denser ones, or where no C compiler is. The torch one is the reference and
the CPU's dense path. It works in chunks of
`CHUNK_WORDS` words (temporaries stay in cache): ``ne`` / ``nonzero`` / a gather
to encode, ``index_copy_`` at the summed gaps or ``masked_scatter_`` to decode;
on a 2-core VM, 64 MiB of bf16 at 2 % density encodes at about 1.8 GB/s of input
and decodes at about 8 GB/s (15+ GB/s in place). On CUDA, Triton kernels over
blocks of ``BLOCK`` words: encode counts changed words per block, takes an
exclusive prefix over the blocks in torch and compacts positions and values (each
block at its offset plus the in-block prefix, ``tl.cumsum``; no positions when the
count alone rules GAPS out), and packs the bitmask; decode scatters values at the
positions (gaps summed in torch) or, for MASK, popcounts per block and expands
the bits, gathering value ``offset + in-block prefix``. On an H100, 1 GiB at 2 %
encodes in 2.5 ms and decodes in 1.5 ms (0.75 ms in place). Both backends produce
the same blobs, byte for byte. Words are viewed as int8 / int16 / int32 / int64 by
their width (the host is little-endian).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.native import delta_scan

MAGIC = b"WFD1"
HEADER = struct.Struct("<4sBBBBQQ")
HEADER_BYTES = HEADER.size  # 24
FULL, GAPS, MASK = 0, 1, 2
KIND_NAMES = {FULL: "full", GAPS: "gaps", MASK: "mask"}
WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TRITON_TYPES = {1: "*i8", 2: "*i16", 4: "*i32", 8: "*i64"}
DEFAULT_BLOCK = 1024
"""Words each program of a Triton kernel covers."""
NUM_WARPS = 4


class DeltaFormatError(ValueError):
    """A blob that is not a well-formed delta for the given buffers."""


@dataclass(frozen=True)
class DeltaInfo:
    """What a blob's header says (see the module docstring).

    Attributes:
        kind: ``"full"``, ``"gaps"`` or ``"mask"``.
        width: bytes per word.
        nbytes: decoded length.
        count: changed words (for FULL too).
        gap_bytes: bytes per gap (GAPS), else 0.
        wire_bytes: length of the blob.
    """

    kind: str
    width: int
    nbytes: int
    count: int
    gap_bytes: int
    wire_bytes: int

    @property
    def nwords(self) -> int:
        """Words in the chunk."""
        return self.nbytes // self.width

    @property
    def changed_fraction(self) -> float:
        """``count / nwords`` (0.0 for an empty chunk)."""
        return self.count / self.nwords if self.nwords else 0.0


@dataclass(frozen=True)
class _Header:
    kind: int
    width: int
    gap_bytes: int
    nbytes: int
    count: int


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _delta_count_kernel(
    base_ptr, new_ptr,   # *word [nwords]
    counts_ptr,          # *i32 [cdiv(nwords, BLOCK)]: changed words per block (written)
    nwords,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < nwords
    a = tl.load(base_ptr + idx, mask=inside, other=0)
    b = tl.load(new_ptr + idx, mask=inside, other=0)
    tl.store(counts_ptr + pid, tl.sum((a != b).to(tl.int32), axis=0))


@triton.jit
def _delta_compact_kernel(
    base_ptr, new_ptr,   # *word [nwords]
    offsets_ptr,         # *i64 [blocks]: changed words before each block
    pos_ptr,             # *i64 [count]: positions of the changed words (written if POSITIONS)
    vals_ptr,            # *word [count]: their new values (written)
    nwords,
    BLOCK: tl.constexpr,
    POSITIONS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < nwords
    a = tl.load(base_ptr + idx, mask=inside, other=0)
    b = tl.load(new_ptr + idx, mask=inside, other=0)
    changed = a != b  # the padding lanes load equal zeros
    c = changed.to(tl.int32)
    dst = tl.load(offsets_ptr + pid) + (tl.cumsum(c, axis=0) - c)
    if POSITIONS:
        tl.store(pos_ptr + dst, idx, mask=changed)
    tl.store(vals_ptr + dst, b, mask=changed)


@triton.jit
def _delta_bitmask_kernel(
    base_ptr, new_ptr,   # *word [nwords]
    mask_ptr,            # *u8 [cdiv(nwords, 8)]: bit i of byte j = word 8j+i changed (written)
    nwords,
    BLOCK: tl.constexpr,  # words per program, BLOCK // 8 bytes
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    bit = tl.arange(0, 8)
    idx = row[:, None] * 8 + bit[None, :]
    inside = idx < nwords
    a = tl.load(base_ptr + idx, mask=inside, other=0)
    b = tl.load(new_ptr + idx, mask=inside, other=0)
    byte = tl.sum((a != b).to(tl.int32) << bit[None, :], axis=1)
    tl.store(mask_ptr + row, byte.to(tl.uint8), mask=row * 8 < nwords)


@triton.jit
def _delta_scatter_kernel(
    pos_ptr,             # *i64 [count]: positions, strictly increasing, < nwords
    vals_ptr,            # *word [count]
    out_ptr,             # *word [nwords] (written at the positions)
    count,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inside = i < count
    p = tl.load(pos_ptr + i, mask=inside, other=0)
    v = tl.load(vals_ptr + i, mask=inside, other=0)
    tl.store(out_ptr + p, v, mask=inside)


@triton.jit
def _mask_bits(mask_ptr, pid, nwords, BLOCK: tl.constexpr):
    """(bits [BLOCK // 8, 8] as int32 0/1, word indices) of block ``pid`` of the bitmask."""
    row = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    shift = tl.arange(0, 8)
    byte = tl.load(mask_ptr + row, mask=row * 8 < nwords, other=0).to(tl.int32)
    return (byte[:, None] >> shift[None, :]) & 1, row[:, None] * 8 + shift[None, :]


@triton.jit
def _delta_popcount_kernel(
    mask_ptr,            # *u8 [cdiv(nwords, 8)]
    counts_ptr,          # *i32 [cdiv(nwords, BLOCK)]: set bits per block, padding too (written)
    nwords,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bits, _ = _mask_bits(mask_ptr, pid, nwords, BLOCK)
    tl.store(counts_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))


@triton.jit
def _delta_expand_kernel(
    mask_ptr,            # *u8 [cdiv(nwords, 8)], padding bits 0
    offsets_ptr,         # *i64 [blocks]: set bits before each block
    vals_ptr,            # *word [count]
    out_ptr,             # *word [nwords] (written where the bit is set)
    nwords,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bits, idx = _mask_bits(mask_ptr, pid, nwords, BLOCK)
    per_byte = tl.sum(bits, axis=1)
    before = (tl.cumsum(per_byte, axis=0) - per_byte)[:, None] + (tl.cumsum(bits, axis=1) - bits)
    changed = (bits != 0) & (idx < nwords)
    v = tl.load(vals_ptr + tl.load(offsets_ptr + pid) + before, mask=changed, other=0)
    tl.store(out_ptr + idx, v, mask=changed)


# ----------------------------------------------------------------------------- checks


def _check_buffer(t: torch.Tensor, what: str, op: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{op}: {what} must be a torch.uint8 tensor, got {got}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{op}: {what} must be 1-D and contiguous, got shape {tuple(t.shape)}")


def _check_pair(base: torch.Tensor, other: torch.Tensor, other_name: str, width: int,
                op: str) -> None:
    _check_buffer(base, "base", op)
    _check_buffer(other, other_name, op)
    if base.numel() != other.numel():
        raise ValueError(f"{op}: base has {base.numel()} bytes, {other_name} {other.numel()}")
    if width not in WORD_DTYPES:
        raise ValueError(f"{op}: width must be one of {sorted(WORD_DTYPES)}, got {width!r}")
    if base.numel() % width:
        raise ValueError(f"{op}: width {width} does not divide the length ({base.numel()} bytes)")
    if base.data_ptr() % width or other.data_ptr() % width:
        raise ValueError(f"{op}: buffer addresses must be multiples of the width ({width})")


def _check_block(block: int, op: str) -> None:
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"{op}: block must be a power of two >= 16, got {block!r}")


def _wire_bytes(kind: int, width: int, gap_bytes: int, nbytes: int, count: int) -> int:
    if kind == FULL:
        return HEADER_BYTES + nbytes
    if kind == GAPS:
        return HEADER_BYTES + count * (gap_bytes + width)
    return HEADER_BYTES + -(-nbytes // width // 8) + count * width


def _parse(head: bytes, wire_bytes: int, nbytes: int | None = None) -> _Header:
    """The header of a blob of ``wire_bytes`` bytes starting with ``head``, checked."""
    if wire_bytes < HEADER_BYTES:
        raise DeltaFormatError(f"delta: blob of {wire_bytes} bytes, shorter than the header")
    magic, kind, width, gap_bytes, reserved, size, count = HEADER.unpack(head[:HEADER_BYTES])
    if magic != MAGIC:
        raise DeltaFormatError(f"delta: bad magic {magic!r}, expected {MAGIC!r}")
    if kind not in KIND_NAMES:
        raise DeltaFormatError(f"delta: unknown kind {kind}")
    if width not in WORD_DTYPES:
        raise DeltaFormatError(f"delta: unknown width {width}")
    if gap_bytes not in ((2, 4) if kind == GAPS else (0,)):
        raise DeltaFormatError(f"delta: gap_bytes {gap_bytes} with kind {KIND_NAMES[kind]}")
    if reserved:
        raise DeltaFormatError(f"delta: reserved header byte is {reserved}, not 0")
    if size % width:
        raise DeltaFormatError(f"delta: width {width} does not divide nbytes {size}")
    if nbytes is not None and size != nbytes:
        raise DeltaFormatError(f"delta: blob decodes to {size} bytes, the buffers have {nbytes}")
    if count > size // width:
        raise DeltaFormatError(f"delta: count {count} > {size // width} words")
    want = _wire_bytes(kind, width, gap_bytes, size, count)
    if wire_bytes != want:
        raise DeltaFormatError(f"delta: blob has {wire_bytes} bytes, its header implies {want}")
    return _Header(kind, width, gap_bytes, size, count)


def _read_header(blob: torch.Tensor, nbytes: int | None = None) -> _Header:
    _check_buffer(blob, "blob", "decode_delta")
    head = bytes(blob[:HEADER_BYTES].tolist())
    return _parse(head.ljust(HEADER_BYTES, b"\0"), blob.numel(), nbytes)


def delta_info(blob: torch.Tensor | bytes | bytearray | memoryview) -> DeltaInfo:
    """What the header of ``blob`` (a uint8 tensor or bytes) says; reads only the header.

    Raises:
        DeltaFormatError: a malformed header, or a length other than the header implies.
    """
    if isinstance(blob, torch.Tensor):
        h = _read_header(blob)
        wire = blob.numel()
    else:
        data = bytes(blob)
        wire = len(data)
        h = _parse(data[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0"), wire)
    return DeltaInfo(KIND_NAMES[h.kind], h.width, h.nbytes, h.count, h.gap_bytes, wire)


# ----------------------------------------------------------------------------- encode


def _choose(nwords: int, width: int, count: int, max_gap: int) -> tuple[int, int]:
    """(kind, gap_bytes) of the smallest blob."""
    if count == 0:
        return GAPS, 2
    gap_bytes = 2 if max_gap < 1 << 16 else 4 if max_gap < 1 << 32 else 0
    mask_size = -(-nwords // 8) + count * width
    if gap_bytes and count * (gap_bytes + width) <= mask_size:
        kind, size = GAPS, count * (gap_bytes + width)
    else:
        kind, size, gap_bytes = MASK, mask_size, 0
    return (FULL, 0) if size >= nwords * width else (kind, gap_bytes)


@dataclass
class _Changes:
    """The changed words as a backend found them, in position order, in parts."""

    count: int
    max_gap: int
    gaps: list[torch.Tensor]  # int64
    vals: list[torch.Tensor]  # the new words
    bitmask: Callable[[], torch.Tensor]  # computes the MASK bitmask, uint8


_GAP_DTYPES = {2: torch.uint16, 4: torch.uint32}


def _assemble(new: torch.Tensor, width: int, changes: _Changes) -> torch.Tensor:
    """The blob of the smallest kind."""
    nbytes, count = new.numel(), changes.count
    kind, gap_bytes = _choose(nbytes // width, width, count, changes.max_gap)
    header = HEADER.pack(MAGIC, kind, width, gap_bytes, 0, nbytes, count)
    parts = [torch.tensor(list(header), dtype=torch.uint8, device=new.device)]
    if kind == FULL:
        parts.append(new)
    else:
        if kind == GAPS:  # every gap fits: converted exactly, little-endian
            parts += [g.to(_GAP_DTYPES[gap_bytes]).view(torch.uint8) for g in changes.gaps]
        else:
            parts.append(changes.bitmask())
        parts += [v.view(torch.uint8) for v in changes.vals]
    return torch.cat(parts)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Bitmask (LSB first) of ``flags``: bool, a multiple of 8 long, on a fresh allocation."""
    x = flags.view(torch.uint8).view(torch.int64)  # byte i of each int64: flag 8k + i (0 / 1)
    x = x | (x >> 7)  # byte 0 bits 0-1: flags 0-1
    x |= x >> 14      # bits 0-3
    x |= x >> 28      # bits 0-7
    return x.bitwise_and_(0xFF).to(torch.uint8)


CHUNK_WORDS = 1 << 20
"""Words the torch backend handles per step on the CPU, a multiple of 8 (1 MiB of flags:
the temporaries stay in cache and their allocations are reused); one step elsewhere."""


def _chunks(nwords: int, device: torch.device) -> list[tuple[int, int]]:
    step = CHUNK_WORDS if device.type == "cpu" else max(8, -(-nwords // 8) * 8)
    return [(start, min(start + step, nwords)) for start in range(0, nwords, step)]


def encode_delta_ref(base: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """Torch `encode_delta`: ``ne``, ``nonzero`` and a gather per chunk; bitmask by bit folding."""
    _check_pair(base, new, "new", width, "encode_delta")
    dt = WORD_DTYPES[width]
    b, n = base.view(dt), new.view(dt)
    chunks = _chunks(n.numel(), new.device)
    flags = torch.empty(-(-chunks[0][1] // 8) * 8 if chunks else 0, dtype=torch.bool,
                        device=new.device)
    gaps, vals = [], []
    count, max_gap, last = 0, 0, -1
    for start, stop in chunks:
        f = torch.ne(b[start:stop], n[start:stop], out=flags[:stop - start])
        p = f.nonzero().squeeze(1)
        if p.numel():
            vals.append(n[start:stop][p])
            g = torch.diff(p.add_(start), prepend=p.new_full((1,), last)).sub_(1)
            gaps.append(g)
            count, max_gap, last = count + p.numel(), max(max_gap, int(g.max())), int(p[-1])

    def bitmask() -> torch.Tensor:
        bits = torch.empty(-(-n.numel() // 8), dtype=torch.uint8, device=new.device)
        for start, stop in chunks:  # each a multiple of 8 words but the last
            padded = flags[:-(-(stop - start) // 8) * 8]
            padded[stop - start:] = False
            torch.ne(b[start:stop], n[start:stop], out=padded[:stop - start])
            bits[start // 8:start // 8 + padded.numel() // 8] = _pack_bits(padded)
        return bits

    return _assemble(new, width, _Changes(count, max_gap, gaps, vals, bitmask))


def changed_words(base: torch.Tensor, new: torch.Tensor, width: int, *,
                  backend: str | None = None) -> int:
    """Number of ``width``-byte words whose bits differ between ``base`` and ``new``.

    Arguments as for `encode_delta`; the Triton backend runs only the encoder's first
    kernel (changed words per block).
    """
    _check_pair(base, new, "new", width, "changed_words")
    dt = WORD_DTYPES[width]
    b, n = base.view(dt), new.view(dt)
    if choose_backend(backend, base, new, op="changed_words") == "triton":
        return int(_block_counts(b, n, DEFAULT_BLOCK).sum()) if n.numel() else 0
    chunks = _chunks(n.numel(), new.device)
    flags = torch.empty(chunks[0][1] if chunks else 0, dtype=torch.bool, device=new.device)
    total = 0
    for start, stop in chunks:
        f = torch.ne(b[start:stop], n[start:stop], out=flags[:stop - start])
        total += int(torch.count_nonzero(f))
    return total


def _block_counts(b: torch.Tensor, n: torch.Tensor, block: int) -> torch.Tensor:
    """Changed words per ``block`` words (int32), of a non-empty pair of word views."""
    counts = torch.empty(-(-n.numel() // block), dtype=torch.int32, device=n.device)
    _delta_count_kernel[(counts.numel(),)](b, n, counts, n.numel(), BLOCK=block,
                                           num_warps=NUM_WARPS)
    return counts


def encode_delta_triton(base: torch.Tensor, new: torch.Tensor, width: int, *,
                        block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Triton `encode_delta`, ``block`` words per program (a power of two >= 16)."""
    _check_pair(base, new, "new", width, "encode_delta")
    _check_block(block, "encode_delta")
    dt = WORD_DTYPES[width]
    b, n = base.view(dt), new.view(dt)
    nwords = n.numel()
    grid = (-(-nwords // block),)
    counts = _block_counts(b, n, block) if nwords else n.new_empty(0, dtype=torch.int32)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    count = int(ends[-1]) if nwords else 0
    # GAPS costs at least 2 + width bytes a change, MASK ceil(nwords / 8) + width: past
    # this, MASK or FULL whatever the gaps, so neither positions nor (FULL) values
    dense = 2 * count > -(-nwords // 8)
    full = dense and _choose(nwords, width, count, 0)[0] == FULL
    pos = torch.empty(0 if dense else count, dtype=torch.int64, device=new.device)
    vals = torch.empty(0 if full else count, dtype=dt, device=new.device)
    if count and not full:
        _delta_compact_kernel[grid](b, n, ends - counts, ends if dense else pos, vals, nwords,
                                    BLOCK=block, POSITIONS=not dense, num_warps=NUM_WARPS)

    def bitmask() -> torch.Tensor:
        bits = torch.empty(-(-nwords // 8), dtype=torch.uint8, device=new.device)
        _delta_bitmask_kernel[grid](b, n, bits, nwords, BLOCK=block, num_warps=NUM_WARPS)
        return bits

    if dense:  # `_assemble` picks the same kind without the gaps
        return _assemble(new, width, _Changes(count, 0, [], [vals], bitmask))
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)).sub_(1)
    max_gap = int(gaps.max()) if count else 0
    return _assemble(new, width, _Changes(count, max_gap, [gaps], [vals], bitmask))


def encode_delta(base: torch.Tensor, new: torch.Tensor, width: int, *,
                 backend: str | None = None) -> torch.Tensor:
    """The delta that turns ``base`` into ``new`` (format in the module docstring).

    Args:
        base, new: ``torch.uint8``, 1-D, contiguous, the same length, on one device;
            addresses multiples of ``width``.
        width: bytes per word: 1, 2, 4 or 8 (the element size of the weights), dividing
            the length.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Returns:
        The blob, a 1-D uint8 tensor on the inputs' device: the smallest of FULL, GAPS
        and MASK; byte-identical on both backends.

    Raises:
        TypeError: not uint8.  ValueError: bad shapes, lengths, width or addresses.
    """
    if choose_backend(backend, base, new, op="encode_delta") == "torch":
        if new.device.type == "cpu":
            blob = _encode_native(base, new, width)
            if blob is not None:
                return blob
        return encode_delta_ref(base, new, width)
    return encode_delta_triton(base, new, width)


def _encode_native(base: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor | None:
    """`encode_delta` of sparse changes by the native scan; None where it does not apply.

    None without the compiled loop, or when more than a sixteenth of the words changed
    (GAPS, 2 gap bytes a word, can no longer beat MASK: the torch path encodes those).
    """
    _check_pair(base, new, "new", width, "encode_delta")
    nwords = new.numel() // width
    found = delta_scan(base, new, width, nwords // 16 + 1)
    if found is None:
        return None
    pos, raw = found
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)).sub_(1)

    def bitmask() -> torch.Tensor:  # rare: gaps of 2**16 or more can make MASK smaller
        flags = torch.zeros(-(-nwords // 8) * 8, dtype=torch.bool)
        flags[pos] = True
        return _pack_bits(flags)

    return _assemble(new, width, _Changes(pos.numel(), int(gaps.max()) if pos.numel() else 0,
                                          [gaps], [raw.view(WORD_DTYPES[width])], bitmask))


# ----------------------------------------------------------------------------- decode


def _gap_positions(raw: torch.Tensor, h: _Header) -> torch.Tensor:
    """Positions (int64) from the gap bytes; DeltaFormatError if they run past the chunk."""
    gaps = _words(raw, h.gap_bytes, torch.uint16 if h.gap_bytes == 2 else torch.uint32)
    gaps = gaps.to(torch.int64)
    if h.count < 1 << 31:  # below 2**31 * 2**32: the sum cannot wrap
        total = int(gaps.sum())
    else:  # exactly, in two halves
        lo, hi = torch.stack([(gaps & 0xFFFF).sum(), (gaps >> 16).sum()]).tolist()
        total = hi * 65536 + lo
    if total + h.count > h.nbytes // h.width:
        raise DeltaFormatError(f"delta: gaps run past the last of {h.nbytes // h.width} words")
    return gaps.add_(1).cumsum_(0).sub_(1)


def _unpack_bits(bitmask: torch.Tensor) -> torch.Tensor:
    """Flags (bool, 8 per byte) of a bitmask: bit i of byte j at 8j + i; inverts `_pack_bits`."""
    x = bitmask.to(torch.int64)
    x = (x | (x << 28)).bitwise_and_(0x0000000F0000000F)
    x = (x | (x << 14)).bitwise_and_(0x0003000300030003)
    x = (x | (x << 7)).bitwise_and_(0x0101010101010101)
    return x.view(torch.uint8).view(torch.bool)


_POPCOUNT = [bin(i).count("1") for i in range(256)]


def _popcount(bitmask: torch.Tensor) -> int:
    """Set bits of a uint8 tensor."""
    hist = torch.bincount(bitmask, minlength=256)
    return int((hist * torch.tensor(_POPCOUNT, device=hist.device)).sum())


def _check_padding(bitmask: torch.Tensor, nwords: int) -> None:
    if nwords % 8 and int(bitmask[-1]) >> (nwords % 8):
        raise DeltaFormatError("delta: padding bits of the bitmask are set")


def _words(raw: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` bytes viewed as ``width``-byte ``dtype``, copied where not aligned to ``width``."""
    if raw.data_ptr() % width or raw.storage_offset() % width:
        raw = raw.clone()
    return raw.view(dtype)


def _decode(blob: torch.Tensor, base: torch.Tensor, out: torch.Tensor, triton_: bool,
            block: int) -> None:
    _check_buffer(base, "base", "decode_delta")
    _check_buffer(out, "out", "decode_delta")
    if base.numel() != out.numel():
        raise ValueError(f"decode_delta: base has {base.numel()} bytes, out {out.numel()}")
    in_place = out.data_ptr() == base.data_ptr()
    if not in_place and base.numel() and (
            out.data_ptr() < base.data_ptr() + base.numel()
            and base.data_ptr() < out.data_ptr() + out.numel()):
        raise ValueError("decode_delta: out overlaps base without being it")
    h = _read_header(blob, out.numel())
    _check_pair(base, out, "out", h.width, "decode_delta")
    blob = blob.to(out.device)
    nwords = h.nbytes // h.width
    if h.kind == FULL:
        out.copy_(blob[HEADER_BYTES:])
        return
    dt = WORD_DTYPES[h.width]
    o = out.view(dt)
    if h.kind == GAPS:
        split = HEADER_BYTES + h.count * h.gap_bytes
        pos = _gap_positions(blob[HEADER_BYTES:split], h)
        vals = _words(blob[split:], h.width, dt)
        if not in_place:
            out.copy_(base)
        if not h.count:
            return
        if triton_:
            grid = (-(-h.count // block),)
            _delta_scatter_kernel[grid](pos, vals, o, h.count, BLOCK=block, num_warps=NUM_WARPS)
        else:
            o.index_copy_(0, pos, vals)
        return
    split = HEADER_BYTES + -(-nwords // 8)
    bitmask, vals = blob[HEADER_BYTES:split], _words(blob[split:], h.width, dt)
    _check_padding(bitmask, nwords)
    if triton_:
        grid = (-(-nwords // block),)
        counts = torch.empty(grid, dtype=torch.int32, device=out.device)
        if nwords:
            _delta_popcount_kernel[grid](bitmask, counts, nwords, BLOCK=block,
                                         num_warps=NUM_WARPS)
        ends = torch.cumsum(counts, 0, dtype=torch.int64)
        total = int(ends[-1]) if nwords else 0
    else:
        total = _popcount(bitmask)
    if total != h.count:
        raise DeltaFormatError(f"delta: the bitmask has {total} bits set, the header says "
                               f"{h.count}")
    if not in_place:
        out.copy_(base)
    if not h.count:
        return
    if triton_:
        _delta_expand_kernel[grid](bitmask, ends - counts, vals, o, nwords, BLOCK=block,
                                   num_warps=NUM_WARPS)
        return
    done = 0
    for start, stop in _chunks(nwords, out.device):  # each a multiple of 8 words but the last
        flags = _unpack_bits(bitmask[start // 8:-(-stop // 8)])[:stop - start]
        o[start:stop].masked_scatter_(flags, vals[done:])
        done += int(torch.count_nonzero(flags))


def decode_delta_ref(blob: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """Torch `decode_delta`: ``index_copy_`` at the summed gaps, or chunked ``masked_scatter_``."""
    _decode(blob, base, out, False, DEFAULT_BLOCK)


def decode_delta_triton(blob: torch.Tensor, base: torch.Tensor, out: torch.Tensor, *,
                        block: int = DEFAULT_BLOCK) -> None:
    """Triton `decode_delta`, ``block`` words (or gaps) per program, a power of two >= 16."""
    _check_block(block, "decode_delta")
    _decode(blob, base, out, True, block)


def decode_delta(blob: torch.Tensor, base: torch.Tensor, out: torch.Tensor, *,
                 backend: str | None = None) -> None:
    """Write the version ``blob`` encodes against ``base`` into ``out``, bit-exact.

    Args:
        blob: a blob of `encode_delta` (1-D uint8; on the CPU or on the buffers' device).
        base: the base version, ``torch.uint8``, 1-D, contiguous.
        out: where the new version goes, like ``base``; ``base`` itself (in place: only
            the changed words are written) or a buffer not overlapping it (``base`` is
            copied into it first, except for FULL).
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Raises:
        DeltaFormatError: a malformed blob or one for another length; ``out`` is then
            untouched.  TypeError, ValueError: bad buffers.
    """
    if choose_backend(backend, base, out, op="decode_delta") == "torch":
        decode_delta_ref(blob, base, out)
    else:
        decode_delta_triton(blob, base, out)


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check, every word width."""
    const = {"BLOCK": DEFAULT_BLOCK}
    specs: list[tuple[object, dict[str, str], dict[str, int]]] = [
        (_delta_popcount_kernel, {"mask_ptr": "*u8", "counts_ptr": "*i32", "nwords": "i64",
                                  "BLOCK": "constexpr"}, const)]
    for w in sorted(_TRITON_TYPES):
        t = _TRITON_TYPES[w]
        specs += [
            (_delta_count_kernel, {"base_ptr": t, "new_ptr": t, "counts_ptr": "*i32",
                                   "nwords": "i64", "BLOCK": "constexpr"}, const),
            *[(_delta_compact_kernel, {"base_ptr": t, "new_ptr": t, "offsets_ptr": "*i64",
                                       "pos_ptr": "*i64", "vals_ptr": t, "nwords": "i64",
                                       "BLOCK": "constexpr", "POSITIONS": "constexpr"},
               {**const, "POSITIONS": positions}) for positions in (1, 0)],
            (_delta_bitmask_kernel, {"base_ptr": t, "new_ptr": t, "mask_ptr": "*u8",
                                     "nwords": "i64", "BLOCK": "constexpr"}, const),
            (_delta_scatter_kernel, {"pos_ptr": "*i64", "vals_ptr": t, "out_ptr": t,
                                     "count": "i64", "BLOCK": "constexpr"}, const),
            (_delta_expand_kernel, {"mask_ptr": "*u8", "offsets_ptr": "*i64", "vals_ptr": t,
                                    "out_ptr": t, "nwords": "i64", "BLOCK": "constexpr"}, const),
        ]
    return specs
