"""Per-chunk 64-bit checksums of a byte buffer, identical on GPU and CPU.

The buffer (``torch.uint8``, 1-D, contiguous, length and address multiples of
4) is read as little-endian 64-bit words ``d[p]`` (pairs of 32-bit words; an odd
last 32-bit word is padded with a zero high half), ``p`` the pair's position in
the whole byte space (byte ``8 * p``). Chunk ``c`` covers bytes
``[c * chunk_size, (c + 1) * chunk_size)`` (the last chunk may be shorter;
``chunk_size`` a multiple of 8). Its checksum, in wrapping 64-bit arithmetic::

    k = d[p] ^ (p * K1)
    checksum[c] = sum(lo32(k) * hi32(k) + d[p] over the chunk's pairs) + chunk_nbytes * K4

The product of the keyed halves is the multiply-accumulate of UMAC's NH and of
XXH3: one 32 x 32 -> 64-bit multiply and a few adds per 8 bytes, which a CPU
vectorises (four or eight pairs per instruction) and a GPU does in one wide
multiply, so the checksum runs at memory speed on both. The key mixes in each
pair's position, so swapped or moved words change the sum; the raw ``d[p]``
term keeps a word whose keyed partner is zero from dropping out, so any single
changed word, and any flipped bit, is always detected. A wrapping sum does not
depend on the order of the reduction: the Triton kernel, the compiled CPU loop
(`kernels.native`) and the torch reference agree bit for bit whatever their
block sizes and threads. Not cryptographic: it detects torn or corrupted reads,
not tampering.

`copy_with_checksums` copies a buffer and checksums it in the same pass (the
bytes are read once), for reads that land and verify chunks.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.native import pair_sums, rows_sums

K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
K4 = -2960836687051489901  # 0xD6E8FEB86659FD93
_LOW = 0xFFFFFFFF
DEFAULT_BLOCK = 1024
"""Pairs each program reads per loop step (8 KiB)."""
PROGRAM_PAIRS = 32768
"""Pairs (256 KiB) each program of a chunk covers by default: a chunk is split over
``ceil(chunk_pairs / PROGRAM_PAIRS)`` programs, so a few large chunks still fill the GPU."""
MAX_SPLIT = 65535
NUM_WARPS = 8


@triton.jit
def _checksum_kernel(
    src_ptr,       # *i32: the buffer's words
    dst_ptr,       # *i32: where COPY writes them (else unused)
    out_ptr,       # *i64 [num_chunks]: zeroed; each program adds its wrapping partial sum
    total_words,   # 32-bit words in the buffer
    chunk_pairs,   # pairs per chunk
    pair_base,     # position of the buffer's first pair in the whole byte space
    span,          # pairs per program, a multiple of BLOCK
    step,          # BLOCK * K1 mod 2**64
    BLOCK: tl.constexpr,
    COPY: tl.constexpr,
    ALIGNED: tl.constexpr,  # chunk_pairs % 4 == 0 and both buffers 16-byte aligned
):
    chunk = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    total_pairs = (total_words + 1) // 2
    c_lo = chunk * chunk_pairs
    c_hi = tl.minimum(c_lo + chunk_pairs, total_pairs)
    lo = c_lo + part * span
    hi = tl.minimum(lo + span, c_hi)
    lanes = tl.arange(0, BLOCK)
    words = tl.arange(0, 2 * BLOCK)
    pk = (pair_base + lo).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    pk = pk + lanes.to(tl.uint64) * 0x9E3779B97F4A7C15
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for t in range(lo, hi, BLOCK):
        j0 = 2 * t
        if ALIGNED:  # every tile starts 32 bytes into 16-byte-aligned words: vector loads
            j0 = tl.multiple_of(j0, 8)
        j = j0 + words
        if t + BLOCK <= hi and 2 * (t + BLOCK) <= total_words:  # a whole tile: no masks
            w = tl.load(src_ptr + j)
            if COPY:
                tl.store(dst_ptr + j, w)
        else:  # the last tile of a program: only its words, a missing high half is zero
            inside = (j < 2 * hi) & (j < total_words)
            w = tl.load(src_ptr + j, mask=inside, other=0)
            if COPY:
                tl.store(dst_ptr + j, w, mask=inside)
        a, b = tl.split(tl.reshape(w.to(tl.uint32, bitcast=True).to(tl.uint64), (BLOCK, 2)))
        d = a | (b << 32)
        k = d ^ pk
        x = (k & 0xFFFFFFFF) * (k >> 32) + d
        acc += tl.where(t + lanes < hi, x, 0)
        pk += step.to(tl.uint64)
    total = tl.sum(acc, axis=0)
    if part == 0:  # the length term, once per chunk
        nbytes = tl.minimum(c_lo * 8 + chunk_pairs * 8, total_words * 4) - c_lo * 8
        total += nbytes.to(tl.uint64, bitcast=True) * 0xD6E8FEB86659FD93
    tl.atomic_add(out_ptr + chunk, total.to(tl.int64, bitcast=True))


def _check(buffer: torch.Tensor, chunk_size: int, first_chunk: int, what: str = "buffer") -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
        got = buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise TypeError(f"checksum: {what} must be a torch.uint8 tensor, got {got}")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"checksum: {what} must be 1-D and contiguous, got shape "
                         f"{tuple(buffer.shape)}")
    if buffer.numel() % 4 or buffer.data_ptr() % 4:
        raise ValueError(f"checksum: {what} length ({buffer.numel()}) and address must be "
                         f"multiples of 4 bytes (misaligned)")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 8:
        raise ValueError(f"checksum: chunk_size must be a positive multiple of 8, got {chunk_size!r}")
    if not isinstance(first_chunk, int) or first_chunk < 0:
        raise ValueError(f"checksum: first_chunk must be a non-negative int, got {first_chunk!r}")


def check_chunking(buffer: torch.Tensor, chunk_size: int, first_chunk: int = 0) -> None:
    """`chunk_checksums`' checks of its arguments: TypeError / ValueError as it raises them."""
    _check(buffer, chunk_size, first_chunk)


def _finish(sums: torch.Tensor, nbytes: int, chunk_size: int) -> torch.Tensor:
    n = sums.numel()
    lengths = torch.full((n,), chunk_size, dtype=torch.int64, device=sums.device)
    if n:
        lengths[-1] = nbytes - (n - 1) * chunk_size
    return sums + lengths * K4


def _wrap(value: int) -> int:
    """`value` as a wrapping int64."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _odd_word_term(words: torch.Tensor, pair_base: int) -> int:
    """The term of an odd last 32-bit word (its pair's high half zero), as an int64."""
    d = int(words[-1])
    k = d ^ ((pair_base + words.numel() // 2) * K1 % 2**64)
    return _wrap((k & _LOW) * (k >> 32) + d)


def chunk_checksums_ref(buffer: torch.Tensor, chunk_size: int, *,
                        first_chunk: int = 0) -> torch.Tensor:
    """Torch reference of `chunk_checksums` (same integer arithmetic, wrapping int64).

    Mixes blocks of at most `_REF_BLOCK_PAIRS` pairs in place in reused int64
    buffers (one torch call per arithmetic step and block).
    """
    _check(buffer, chunk_size, first_chunk)
    words = buffer.view(torch.uint32)
    chunk_pairs = chunk_size // 8
    num_chunks = -(-buffer.numel() // chunk_size)
    pairs = words.numel() // 2
    pair_base = first_chunk * chunk_pairs
    sums = torch.zeros(num_chunks, dtype=torch.int64, device=buffer.device)
    mixer = _Mixer(min(max(pairs, 1), _REF_BLOCK_PAIRS), buffer.device)
    for chunk in range(num_chunks):
        end = min((chunk + 1) * chunk_pairs, pairs)
        for start in range(chunk * chunk_pairs, end, _REF_BLOCK_PAIRS):
            stop = min(start + _REF_BLOCK_PAIRS, end)
            sums[chunk] += mixer(words[2 * start:2 * stop], pair_base + start).sum()
    if words.numel() % 2:
        sums[-1] += _odd_word_term(words, pair_base)
    return _finish(sums, buffer.numel(), chunk_size)


_REF_BLOCK_PAIRS = 1 << 17
"""Pairs the reference mixes per step: large enough that its torch calls per step
cost little, small enough for three int64 buffers of 1 MiB each."""


class _Mixer:
    """Mixes blocks of pairs into `x` in place, `d` and `y` holding the words and keys."""

    def __init__(self, block: int, device: torch.device) -> None:
        self.d, self.x, self.y = (torch.empty(block, dtype=torch.int64, device=device)
                                  for _ in range(3))
        self.positions = torch.arange(block, dtype=torch.int64, device=device).mul_(K1)

    def __call__(self, words: torch.Tensor, position: int) -> torch.Tensor:
        """The mixed pairs of ``words`` (an even count), the first at pair ``position``.

        A view of `x`, valid until the next call.
        """
        n = words.numel() // 2
        d, x, y = self.d[:n], self.x[:n], self.y[:n]
        d.copy_(words[1::2]).bitwise_left_shift_(32)   # zero-extends the unsigned words
        x.copy_(words[0::2])
        d.bitwise_or_(x)
        torch.add(self.positions[:n], _wrap(position * K1), out=x)
        x.bitwise_xor_(d)
        torch.bitwise_right_shift(x, 32, out=y)
        return x.bitwise_and_(_LOW).mul_(y.bitwise_and_(_LOW)).add_(d)


def _grid(chunk_size: int, block: int, split: int | None) -> tuple[int, int]:
    """(programs per chunk, pairs per program) for `chunk_size`-byte chunks."""
    chunk_pairs = chunk_size // 8
    if split is None:
        split = -(-chunk_pairs // PROGRAM_PAIRS)
    split = max(1, min(split, MAX_SPLIT, -(-chunk_pairs // block)))
    span = -(-chunk_pairs // (split * block)) * block
    return -(-chunk_pairs // span), span


def _launch(src: torch.Tensor, dst: torch.Tensor | None, chunk_size: int, first_chunk: int,
            block: int, split: int | None) -> torch.Tensor:
    if not isinstance(block, int) or block < 4 or block & (block - 1):
        raise ValueError(f"checksum: block must be a power of two >= 4, got {block!r}")
    num_chunks = -(-src.numel() // chunk_size)
    out = torch.zeros(num_chunks, dtype=torch.int64, device=src.device)
    if num_chunks:
        split, span = _grid(chunk_size, block, split)
        words = src.view(torch.int32)
        aligned = chunk_size % 32 == 0 and all(
            t.data_ptr() % 16 == 0 for t in (src, src if dst is None else dst))
        _checksum_kernel[(num_chunks, split)](
            words, words if dst is None else dst.view(torch.int32), out, words.numel(),
            chunk_size // 8, first_chunk * (chunk_size // 8), span, block * (K1 % 2**64) % 2**64,
            BLOCK=block, COPY=dst is not None, ALIGNED=aligned, num_warps=NUM_WARPS)
    return out


def chunk_checksums_triton(buffer: torch.Tensor, chunk_size: int, *, first_chunk: int = 0,
                           block: int = DEFAULT_BLOCK, split: int | None = None) -> torch.Tensor:
    """Triton `chunk_checksums`.

    Grid (chunks, split), each program adding its wrapping partial sum (and part 0 the
    length term) into the chunk's zeroed result. ``split`` programs per chunk (default:
    one per `PROGRAM_PAIRS` pairs); ``block`` pairs per loop step, a power of two >= 4.
    The result does not depend on either.
    """
    _check(buffer, chunk_size, first_chunk)
    return _launch(buffer, None, chunk_size, first_chunk, block, split)


def chunk_checksums(buffer: torch.Tensor, chunk_size: int, *, first_chunk: int = 0,
                    backend: str | None = None) -> torch.Tensor:
    """64-bit checksum of every ``chunk_size``-byte chunk of ``buffer``.

    Args:
        buffer: ``torch.uint8``, 1-D, contiguous; length and address multiples of 4.
        chunk_size: bytes per chunk, a positive multiple of 8.
        first_chunk: index of the buffer's first chunk in the whole byte space, so
            that a slice starting at chunk ``c`` can be verified on its own:
            ``chunk_checksums(buf[c*cs:], cs, first_chunk=c) == chunk_checksums(buf, cs)[c:]``.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors; on CPU ones the
            compiled loop of `kernels.native`, or the torch reference without a compiler).

    Returns:
        int64 tensor ``[ceil(len / chunk_size)]`` on the buffer's device.

    Raises:
        TypeError: buffer not uint8.  ValueError: bad shape, length, alignment or chunk size.
    """
    if choose_backend(backend, buffer, op="chunk_checksums") == "torch":
        if backend is None:  # a CPU tensor: the compiled loop where the machine built one
            native = chunk_checksums_native(buffer, chunk_size, first_chunk=first_chunk)
            if native is not None:
                return native
        return chunk_checksums_ref(buffer, chunk_size, first_chunk=first_chunk)
    return chunk_checksums_triton(buffer, chunk_size, first_chunk=first_chunk)


def chunk_checksums_native(buffer: torch.Tensor, chunk_size: int, *,
                           first_chunk: int = 0) -> torch.Tensor | None:
    """`chunk_checksums` of a CPU buffer in one fused pass (`kernels.native`), or None.

    None where no compiled loop could be built (no C compiler, ``WEIGHTFABRIC_NATIVE=0``).
    """
    _check(buffer, chunk_size, first_chunk)
    return _native(buffer, None, chunk_size, first_chunk)


def _native(src: torch.Tensor, dst: torch.Tensor | None, chunk_size: int,
            first_chunk: int) -> torch.Tensor | None:
    if src.device.type != "cpu" or (dst is not None and dst.device.type != "cpu"):
        raise ValueError("checksum: the native loop reads and writes host memory")
    words = src.view(torch.uint32)
    pair_base = first_chunk * (chunk_size // 8)
    sums = pair_sums(words, None if dst is None else dst.view(torch.uint32), chunk_size // 8,
                     pair_base)
    if sums is None:
        return None
    if words.numel() % 2:  # the odd last word: the loop sums whole pairs
        if dst is not None:
            dst[-4:] = src[-4:]
        if sums.numel() < -(-src.numel() // chunk_size):  # a last chunk of just that word
            sums = torch.cat([sums, sums.new_zeros(1)])
        sums[-1] += _odd_word_term(words, pair_base)
    return _finish(sums, src.numel(), chunk_size)


def copy_with_checksums(dst: torch.Tensor, src: torch.Tensor, chunk_size: int, *,
                        first_chunk: int = 0, backend: str | None = None) -> torch.Tensor:
    """Copy ``src`` into ``dst`` and return ``chunk_checksums(src, ...)``, in one pass.

    The bytes are read once: the checksum is computed as they pass through the copy (the
    compiled CPU loop, with streaming stores for large copies, or the Triton kernel
    writing what it reads). Without either, a ``copy_`` then `chunk_checksums`.

    Args:
        dst, src: ``torch.uint8``, 1-D, contiguous, the same length, on one device;
            length and addresses multiples of 4; not overlapping.
        chunk_size, first_chunk, backend: as for `chunk_checksums`.

    Raises:
        TypeError, ValueError: as `chunk_checksums`, or ``dst`` of another length.
    """
    _check(src, chunk_size, first_chunk, "src")
    _check(dst, chunk_size, first_chunk, "dst")
    if dst.numel() != src.numel():
        raise ValueError(f"checksum: dst has {dst.numel()} bytes, src {src.numel()}")
    if choose_backend(backend, src, dst, op="copy_with_checksums") == "triton":
        return _launch(src, dst, chunk_size, first_chunk, DEFAULT_BLOCK, None)
    if backend is None:
        native = _native(src, dst, chunk_size, first_chunk)
        if native is not None:
            return native
    dst.copy_(src)
    return chunk_checksums_ref(dst, chunk_size, first_chunk=first_chunk)


class ChunkSums:
    """The chunk checksums of a buffer assembled range by range, copies fused where they can be.

    `copy` writes a range (e.g. one tensor, as a pack does) and sums it in the same pass;
    `finish` sums whatever no `copy` covered (padding, ranges written otherwise) from
    the assembled buffer and returns ``chunk_checksums(buffer, chunk_size)``. CPU only.
    Copies of disjoint ranges may run on several threads at once; a range copied again
    (a read retried from another source) replaces what its first copy summed.
    """

    def __init__(self, nbytes: int, chunk_size: int) -> None:
        if nbytes % 4 or chunk_size <= 0 or chunk_size % 8:
            raise ValueError(f"checksum: {nbytes} bytes in chunks of {chunk_size}: the length "
                             "must be a multiple of 4, the chunk size of 8")
        self.nbytes, self.chunk_size = nbytes, chunk_size
        self.sums = torch.zeros(-(-nbytes // chunk_size), dtype=torch.int64)
        self.covered: list[tuple[int, int]] = []
        self._parts: dict[tuple[int, int], torch.Tensor] = {}  # what each range added
        self._lock = threading.Lock()

    def copy(self, offset: int, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Copy ``src`` into ``dst`` (the buffer's bytes from ``offset``), summing as it goes.

        ``dst``: uint8, 1-D, contiguous, on the CPU. ``src``: the same bytes as a 1-D
        contiguous uint8 tensor, or as rows (2-D uint8, each row contiguous, rows any
        stride apart: a column block of a wider tensor) that land end to end. Returns
        False, having done nothing, where the compiled loop cannot (none built, ``offset``
        not a multiple of 8, an address or row stride not a multiple of 4, rows not a
        multiple of 8 bytes): the caller copies instead.
        """
        if src.dim() == 2:
            return self._copy_rows(offset, dst, src)
        whole = src.numel() // 8 * 8
        if (offset % 8 or src.data_ptr() % 4 or dst.data_ptr() % 4 or not whole
                or offset < 0 or offset + src.numel() > self.nbytes):
            return False
        part = pair_sums(src[:whole].view(torch.uint32), dst[:whole].view(torch.uint32),
                         self.chunk_size // 8, offset // 8)
        if part is None:
            return False
        if whole < src.numel():
            dst[whole:].copy_(src[whole:])
        self._record(offset, whole, part)
        return True

    def _copy_rows(self, offset: int, dst: torch.Tensor, rows: torch.Tensor) -> bool:
        n, row_bytes = rows.shape
        nbytes = n * row_bytes
        if (offset % 8 or row_bytes % 8 or rows.stride(1) != 1 or rows.stride(0) % 4
                or rows.data_ptr() % 4 or dst.data_ptr() % 4 or not nbytes or offset < 0
                or offset + nbytes > self.nbytes or dst.numel() != nbytes):
            return False
        part = rows_sums(rows, dst, self.chunk_size // 8, offset // 8)
        if part is None:
            return False
        self._record(offset, nbytes, part)
        return True

    def _record(self, offset: int, whole: int, part: torch.Tensor) -> None:
        """Add the sums ``part`` of bytes ``[offset, offset + whole)``, copied (again)."""
        with self._lock:
            again = self._parts.get((offset, whole))
            if again is not None:
                self._add(offset, -again)
            else:
                self.covered.append((offset, offset + whole))
            self._parts[(offset, whole)] = part
            self._add(offset, part)

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        """``chunk_checksums(buffer, chunk_size)``, ``buffer`` being the assembled bytes."""
        _check(buffer, self.chunk_size, 0)
        if buffer.numel() != self.nbytes:
            raise ValueError(f"checksum: the buffer has {buffer.numel()} bytes, not {self.nbytes}")
        words = buffer.view(torch.uint32)
        pos = 0
        for lo, hi in [*sorted(self.covered), (self.nbytes, self.nbytes)]:
            if lo > pos:
                gap = words[pos // 4:lo // 4]
                part = pair_sums(gap, None, self.chunk_size // 8, pos // 8)
                if part is None:  # no compiled loop: the reference, chunk by chunk
                    return chunk_checksums_ref(buffer, self.chunk_size)
                self._add(pos, part)
                if gap.numel() % 2:  # only at the end of the buffer
                    self.sums[-1] += _odd_word_term(gap, pos // 8)
            pos = max(pos, hi)
        return _finish(self.sums, self.nbytes, self.chunk_size)

    def _add(self, offset: int, part: torch.Tensor) -> None:
        first = offset // self.chunk_size
        self.sums[first:first + part.numel()] += part


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check: checksum, and copy."""
    sig = {"src_ptr": "*i32", "dst_ptr": "*i32", "out_ptr": "*i64", "total_words": "i64",
           "chunk_pairs": "i64", "pair_base": "i64", "span": "i64", "step": "u64",
           "BLOCK": "constexpr", "COPY": "constexpr", "ALIGNED": "constexpr"}
    return [(_checksum_kernel, sig, {"BLOCK": DEFAULT_BLOCK, "COPY": copy, "ALIGNED": 1})
            for copy in (0, 1)]
