"""Per-chunk 64-bit checksums of a byte buffer, identical on GPU and CPU.

The buffer (``torch.uint8``, 1-D, contiguous, length and address multiples of
4) is read as little-endian 32-bit words ``w[i]``, ``i`` the word's index in the
whole buffer. Chunk ``c`` covers bytes ``[c * chunk_size, (c + 1) * chunk_size)``
(the last chunk may be shorter). Its checksum, in wrapping int64 arithmetic::

    x = w[i] ^ (i * K1);  x *= K2;  x ^= x >>> 31;  x *= K3;  x ^= x >>> 29
    checksum[c] = sum(x over the chunk's words) + chunk_nbytes * K4

(``>>>`` is a logical shift.) Every word is mixed with its position, so swapped,
moved or changed words change the sum; a wrapping sum does not depend on the
order of the reduction, so the Triton kernel and the torch reference agree bit
for bit whatever the block sizes. Not cryptographic: it detects torn or
corrupted reads, not tampering.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.native import mixed_sums

K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
K3 = -7723592293110705685  # 0x94D049BB133111EB
K4 = -2960836687051489901  # 0xD6E8FEB86659FD93
DEFAULT_BLOCK = 1024
"""Words each program reads per loop step (4 KiB: one 16-byte vector per thread at 8 warps)."""
PROGRAM_WORDS = 65536
"""Words (256 KiB) each program of a chunk covers by default: a chunk is split over
``ceil(chunk_words / PROGRAM_WORDS)`` programs, so a few large chunks still fill the GPU."""
MAX_SPLIT = 65535
NUM_WARPS = 8
"""Warps per program. 1024-word blocks, 64 Ki words per program and 8 warps were the
fastest on an H200 (`tools/gpu/tune_kernels.py`)."""


@triton.jit
def _mix(w, pk):
    """Mixed words (uint64) of words ``w`` (uint64 < 2**32) at positions with ``pk = pos * K1``."""
    x = (w ^ pk) * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 31)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 29)


@triton.jit
def _checksum_kernel(
    words_ptr,     # *i32: the buffer's 16-byte-aligned block start (the buffer is word `lead`)
    out_ptr,       # *i64 [num_chunks]: zeroed; each program adds its wrapping partial sum
    total_words,   # words in the buffer
    chunk_words,   # words per chunk
    word_base,     # position of the buffer's first word in the whole byte space
    lead,          # words between `words_ptr` and the buffer's first word (0..3)
    span,          # words per program, a multiple of BLOCK
    step,          # BLOCK * K1 mod 2**64
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    # this program's words, in j = word index + lead (so that j % 4 == 0 is 16-byte aligned)
    c_lo = chunk * chunk_words + lead
    c_hi = tl.minimum(c_lo + chunk_words, total_words + lead)
    start = tl.multiple_of((c_lo // BLOCK) * BLOCK + part * span, BLOCK)  # tiles: BLOCK-aligned j
    lo = tl.maximum(start, c_lo)
    hi = tl.minimum(start + span, c_hi)
    end = tl.multiple_of((total_words + lead + 3) // 4 * 4, 4)  # j past the last 16-byte block
    lanes = tl.arange(0, BLOCK)
    k1 = 0x9E3779B97F4A7C15
    # position term (word_base + j - lead + lane) * K1, advanced by BLOCK * K1 per tile
    pk = ((word_base + start - lead).to(tl.uint64, bitcast=True)
          + lanes.to(tl.uint64)) * k1
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for k in range(0, tl.cdiv(hi - start, BLOCK)):
        t = start + k * BLOCK
        j = t + lanes
        if (t >= lo) & (t + BLOCK <= hi):  # a whole tile of this program: no masks
            wf = tl.load(words_ptr + j).to(tl.uint32, bitcast=True).to(tl.uint64)
            acc += _mix(wf, pk)
        else:  # an edge tile: read whole 16-byte blocks, count only [lo, hi)
            we = tl.load(words_ptr + j, mask=tl.max_constancy(j < end, 4), other=0)
            x = _mix(we.to(tl.uint32, bitcast=True).to(tl.uint64), pk)
            acc += tl.where((j >= lo) & (j < hi), x, 0)
        pk += step.to(tl.uint64)
    total = tl.sum(acc, axis=0)
    if part == 0:  # the length term, once per chunk
        total += ((c_hi - c_lo) * 4).to(tl.uint64, bitcast=True) * 0xD6E8FEB86659FD93
    tl.atomic_add(out_ptr + chunk, total.to(tl.int64, bitcast=True))


def _check(buffer: torch.Tensor, chunk_size: int, first_chunk: int) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
        got = buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise TypeError(f"checksum: buffer must be a torch.uint8 tensor, got {got}")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"checksum: buffer must be 1-D and contiguous, got shape "
                         f"{tuple(buffer.shape)}")
    if buffer.numel() % 4 or buffer.data_ptr() % 4:
        raise ValueError(f"checksum: buffer length ({buffer.numel()}) and address must be "
                         f"multiples of 4 bytes (misaligned)")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 4:
        raise ValueError(f"checksum: chunk_size must be a positive multiple of 4, got {chunk_size!r}")
    if not isinstance(first_chunk, int) or first_chunk < 0:
        raise ValueError(f"checksum: first_chunk must be a non-negative int, got {first_chunk!r}")


def _finish(sums: torch.Tensor, nbytes: int, chunk_size: int) -> torch.Tensor:
    n = sums.numel()
    lengths = torch.full((n,), chunk_size, dtype=torch.int64, device=sums.device)
    if n:
        lengths[-1] = nbytes - (n - 1) * chunk_size
    return sums + lengths * K4


def chunk_checksums_ref(buffer: torch.Tensor, chunk_size: int, *,
                        first_chunk: int = 0) -> torch.Tensor:
    """Torch reference of `chunk_checksums` (same integer arithmetic, wrapping int64).

    Works through the buffer in blocks of at most `_REF_BLOCK_WORDS` words, mixing
    each block in place in two reused int64 buffers: about 2.5 GB/s on 2 CPU cores,
    where allocating every temporary managed 0.8 (and whole-buffer ops far less).
    """
    _check(buffer, chunk_size, first_chunk)
    words = buffer.view(torch.uint32)
    chunk_words = chunk_size // 4
    num_chunks = -(-buffer.numel() // chunk_size)
    sums = torch.zeros(num_chunks, dtype=torch.int64, device=buffer.device)
    mixer = _Mixer(min(words.numel(), _REF_BLOCK_WORDS), buffer.device,
                   base=first_chunk * chunk_words)
    if chunk_words <= _REF_BLOCK_WORDS:  # whole chunks per block
        step = _REF_BLOCK_WORDS // chunk_words * chunk_words
        for start in range(0, words.numel(), step):
            x = mixer(words, start, start + step)
            first, full = start // chunk_words, x.numel() // chunk_words
            if full:
                sums[first:first + full] += x[:full * chunk_words].view(full, chunk_words).sum(1)
            if x.numel() % chunk_words:
                sums[first + full] += x[full * chunk_words:].sum()
    else:  # blocks within each chunk
        for chunk in range(num_chunks):
            end = min((chunk + 1) * chunk_words, words.numel())
            for start in range(chunk * chunk_words, end, _REF_BLOCK_WORDS):
                sums[chunk] += mixer(words, start, min(start + _REF_BLOCK_WORDS, end)).sum()
    return _finish(sums, buffer.numel(), chunk_size)


_REF_BLOCK_WORDS = 1 << 18
"""Words the reference mixes per step: large enough that the ten torch calls per
step cost little, small enough for two int64 buffers of 2 MiB each."""


class _Mixer:
    """Mixes blocks of words into `x` in place, `y` holding the shifted copies."""

    def __init__(self, block: int, device: torch.device, *, base: int) -> None:
        self.x = torch.empty(block, dtype=torch.int64, device=device)
        self.y = torch.empty(block, dtype=torch.int64, device=device)
        self.positions = torch.arange(block, dtype=torch.int64, device=device).mul_(K1)
        self.base = base

    def __call__(self, words: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The mixed words [`start`, `end`) (a view of `x`, valid until the next call)."""
        w = words[start:end]
        x, y = self.x[:w.numel()], self.y[:w.numel()]
        x.copy_(w)  # zero-extends the unsigned words
        torch.add(self.positions[:w.numel()], _wrap((self.base + start) * K1), out=y)
        x.bitwise_xor_(y).mul_(K2)
        torch.bitwise_right_shift(x, 31, out=y)
        x.bitwise_xor_(y.bitwise_and_(0x1FFFFFFFF)).mul_(K3)
        torch.bitwise_right_shift(x, 29, out=y)
        return x.bitwise_xor_(y.bitwise_and_(0x7FFFFFFFF))


def _wrap(value: int) -> int:
    """`value` as a wrapping int64."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def chunk_checksums_triton(buffer: torch.Tensor, chunk_size: int, *, first_chunk: int = 0,
                           block: int = DEFAULT_BLOCK, split: int | None = None) -> torch.Tensor:
    """Triton `chunk_checksums`.

    Grid (chunks, split), each program adding its wrapping partial sum (and part 0 the
    length term) into the chunk's zeroed result.

    ``split`` programs per chunk (default: one per `PROGRAM_WORDS` words); ``block``
    words per loop step, a power of two >= 4. The result does not depend on either.
    """
    _check(buffer, chunk_size, first_chunk)
    if not isinstance(block, int) or block < 4 or block & (block - 1):
        raise ValueError(f"checksum: block must be a power of two >= 4, got {block!r}")
    num_chunks = -(-buffer.numel() // chunk_size)
    out = torch.zeros(num_chunks, dtype=torch.int64, device=buffer.device)
    if num_chunks:
        chunk_words = chunk_size // 4
        if split is None:
            split = -(-chunk_words // PROGRAM_WORDS)
        split = max(1, min(split, MAX_SPLIT, -(-chunk_words // block)))
        # programs' spans are whole tiles; the first tile may start before the chunk
        span = -(-(chunk_words + block) // (split * block)) * block
        split = -(-(chunk_words + block) // span)
        # the kernel addresses the 16-byte block holding the first word (never past the
        # blocks the buffer touches), so every 4-word group it loads is one 16-byte vector
        lead = buffer.data_ptr() % 16 // 4
        words = buffer.view(torch.int32)
        if words.storage_offset() < lead:  # a storage not 16-byte aligned (never from torch)
            return chunk_checksums_ref(buffer, chunk_size, first_chunk=first_chunk)
        aligned = words.as_strided((words.numel() + lead,), (1,), words.storage_offset() - lead)
        _checksum_kernel[(num_chunks, split)](
            aligned, out, buffer.numel() // 4, chunk_words, first_chunk * chunk_words, lead, span,
            block * (K1 % 2**64) % 2**64, BLOCK=block,
            num_warps=NUM_WARPS)
    return out


def chunk_checksums(buffer: torch.Tensor, chunk_size: int, *, first_chunk: int = 0,
                    backend: str | None = None) -> torch.Tensor:
    """64-bit checksum of every ``chunk_size``-byte chunk of ``buffer``.

    Args:
        buffer: ``torch.uint8``, 1-D, contiguous; length and address multiples of 4.
        chunk_size: bytes per chunk, a positive multiple of 4.
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
    if buffer.device.type != "cpu":
        raise ValueError(f"checksum: the native loop reads host memory, got {buffer.device}")
    chunk_words = chunk_size // 4
    sums = mixed_sums(buffer.view(torch.uint32), chunk_words, first_chunk * chunk_words)
    return None if sums is None else _finish(sums, buffer.numel(), chunk_size)


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    sig = {"words_ptr": "*i32", "out_ptr": "*i64", "total_words": "i64", "chunk_words": "i64",
           "word_base": "i64", "lead": "i64", "span": "i64", "step": "u64", "BLOCK": "constexpr"}
    return [(_checksum_kernel, sig, {"BLOCK": DEFAULT_BLOCK})]
