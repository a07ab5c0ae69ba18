"""Chunk checksums: Triton (interpreter) vs torch reference, sensitivity, bad input."""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels import checksum, native
from weightfabric.kernels.checksum import (
    chunk_checksums,
    chunk_checksums_ref,
    chunk_checksums_triton,
)


def _buf(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes,chunk", [(4 * 1031, 400), (4096, 4096), (4, 8), (12, 8),
                                          (4 * 37 * 131, 1032)])
def test_triton_matches_torch_bit_exact(nbytes, chunk):
    b = _buf(nbytes)
    ref = chunk_checksums_ref(b, chunk)
    assert ref.shape == (-(-nbytes // chunk),)
    assert torch.equal(chunk_checksums(b, chunk, backend="triton"), ref)


@pytest.mark.parametrize("chunk", [40, 256, 1000], ids=["chunks-per-block", "one-per-block",
                                                      "blocks-per-chunk"])
@pytest.mark.parametrize("first_chunk", [0, 3])
def test_the_reference_agrees_across_its_blocks(monkeypatch, chunk, first_chunk):
    monkeypatch.setattr(checksum, "_REF_BLOCK_PAIRS", 32)  # 256-byte blocks: many per buffer
    b = _buf(4 * 1031, seed=2)
    assert torch.equal(chunk_checksums_ref(b, chunk, first_chunk=first_chunk),
                       chunk_checksums_triton(b, chunk, first_chunk=first_chunk))


def test_result_does_not_depend_on_block_and_split():
    b = _buf(4 * 999)
    a = chunk_checksums_triton(b, 1200, block=32, split=3)
    assert torch.equal(a, chunk_checksums_triton(b, 1200, block=256, split=1))


def test_swapped_words_and_flipped_bits_change_the_checksum():
    b = _buf(4096, seed=5)
    base = chunk_checksums(b, 4096, backend="triton")
    words = b.view(torch.int32).clone()
    words[[3, 700]] = words[[700, 3]]
    assert words[3] != words[700]
    assert not torch.equal(chunk_checksums(words.view(torch.uint8), 4096, backend="triton"), base)
    flipped = b.clone()
    flipped[1234] ^= 1
    assert not torch.equal(chunk_checksums_ref(flipped, 4096), base)


def test_moving_a_chunk_changes_its_checksum():
    b = torch.cat([_buf(256, 1), _buf(256, 1)])  # two identical chunks
    sums = chunk_checksums_ref(b, 256)
    assert sums[0] != sums[1]


def test_empty_buffer_has_no_chunks():
    assert chunk_checksums_ref(torch.empty(0, dtype=torch.uint8), 64).numel() == 0


def test_bad_input_is_rejected():
    with pytest.raises(TypeError, match="uint8"):
        chunk_checksums(torch.zeros(8), 4)
    with pytest.raises(ValueError, match="multiples of 4"):
        chunk_checksums(_buf(10), 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_checksums(_buf(16), 6)
    with pytest.raises(ValueError, match="multiple of 8"):
        chunk_checksums(_buf(16), 12)
    with pytest.raises(ValueError, match="misaligned"):
        chunk_checksums(_buf(20)[1:17], 8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_slice_verifies_on_its_own_with_first_chunk(backend):
    buf = (torch.arange(4 * 96 + 40, dtype=torch.int64) * 31 % 256).to(torch.uint8)
    whole = chunk_checksums(buf, 96, backend=backend)
    for c in range(whole.numel()):
        piece = buf[c * 96:(c + 1) * 96]
        assert chunk_checksums(piece, 96, first_chunk=c, backend=backend).tolist() == [whole[c]]
    assert torch.equal(chunk_checksums(buf[192:], 96, first_chunk=2, backend=backend), whole[2:])
    with pytest.raises(ValueError, match="first_chunk"):
        chunk_checksums(buf, 96, first_chunk=-1, backend=backend)


@pytest.mark.parametrize("lead", [0, 4, 8, 12])
@pytest.mark.parametrize("chunk", [40, 1032, 4096])
def test_triton_at_every_word_alignment_and_chunk_edge(monkeypatch, lead, chunk):
    """Unaligned buffers, chunk edges mid-tile and split chunks match the reference.

    A buffer starting 4, 8 or 12 bytes into a 16-byte block, chunks ending mid-tile, an
    odd last word, and a chunk split over many programs (partial sums added atomically).
    """
    monkeypatch.setattr(checksum, "PROGRAM_PAIRS", 32)
    raw = _buf(4 * 600 + 16, seed=lead)
    b = raw[lead:lead + 4 * 599 - 8]
    want = chunk_checksums_ref(b, chunk, first_chunk=2)
    for block in (16, 64):
        assert torch.equal(chunk_checksums_triton(b, chunk, first_chunk=2, block=block), want)
    assert torch.equal(chunk_checksums_triton(b, chunk, first_chunk=2, split=1), want)


# --- the compiled CPU loop (kernels.native) --------------------------------------------------

needs_native = pytest.mark.skipif(native.checksum_library() is None,
                                  reason="no C compiler built the native checksum")


@needs_native
@pytest.mark.parametrize("nbytes,chunk,first_chunk,lead", [
    (4, 8, 0, 0), (12, 8, 0, 0), (4 * 1031, 400, 3, 4), (4 * 37 * 131, 1032, 0, 12),
    (9 << 20, 1 << 20, 5, 0),            # split over threads inside and across chunks
    (12 << 20, 12 << 20, 0, 8),          # one chunk larger than a thread's share
])
def test_native_matches_torch_and_triton_bit_exact(monkeypatch, nbytes, chunk, first_chunk, lead):
    monkeypatch.setattr(native, "_MIN_TASK_PAIRS", 1 << 15)   # threads even for small buffers
    b = _buf(nbytes + lead)[lead:]
    ref = chunk_checksums_ref(b, chunk, first_chunk=first_chunk)
    got = checksum.chunk_checksums_native(b, chunk, first_chunk=first_chunk)
    assert got is not None and torch.equal(got, ref)
    assert torch.equal(chunk_checksums(b, chunk, first_chunk=first_chunk), ref)  # the default
    if nbytes < 1 << 16:
        assert torch.equal(chunk_checksums_triton(b, chunk, first_chunk=first_chunk), ref)


@needs_native
def test_native_detects_a_flipped_bit_a_swap_and_a_truncation():
    b = _buf(1 << 16)
    base = checksum.chunk_checksums_native(b, 4096)
    flipped = b.clone()
    flipped[5000] ^= 1
    swapped = b.clone().view(torch.int32)
    swapped[[10, 11]] = swapped[[11, 10]]
    assert base is not None
    for bad in (flipped, swapped.view(torch.uint8)):
        got = checksum.chunk_checksums_native(bad, 4096)
        assert got is not None and int((got != base).sum()) == 1
    short = checksum.chunk_checksums_native(b[:-4], 4096)
    assert short is not None and short[-1] != base[-1]


def test_without_the_native_loop_cpu_checksums_use_the_torch_reference(monkeypatch):
    monkeypatch.setenv("WEIGHTFABRIC_NATIVE", "0")
    native.checksum_library.cache_clear()
    try:
        b = _buf(4 * 1031)
        assert checksum.chunk_checksums_native(b, 400) is None
        assert torch.equal(chunk_checksums(b, 400), chunk_checksums_ref(b, 400))
    finally:
        native.checksum_library.cache_clear()


def test_the_native_library_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("WEIGHTFABRIC_CACHE", str(tmp_path))
    native.checksum_library.cache_clear()
    try:
        if native.checksum_library() is None:
            pytest.skip("no C compiler")
        built = list(tmp_path.glob("checksum-*.so"))
        assert len(built) == 1
        native.checksum_library.cache_clear()
        assert native.checksum_library() is not None and list(tmp_path.glob("checksum-*.so")) == built
    finally:
        native.checksum_library.cache_clear()


_FORK_BUFFER = _buf(16 << 20, seed=3)


def _checksum_in_child(queue, expected) -> None:
    got = checksum.chunk_checksums_native(_FORK_BUFFER, 1 << 20)   # no torch thread pool here
    queue.put(got is not None and got.tolist() == expected)


@needs_native
def test_a_forked_child_checksums_with_threads_of_its_own(monkeypatch):
    """The parent's thread pool does not survive a fork; the child must not wait on it."""
    import multiprocessing

    monkeypatch.setattr(native, "_MIN_TASK_PAIRS", 1 << 15)
    monkeypatch.setattr(native, "_threads", lambda: 2)
    expected = chunk_checksums_ref(_FORK_BUFFER, 1 << 20).tolist()
    assert checksum.chunk_checksums_native(_FORK_BUFFER, 1 << 20).tolist() == expected  # pool up
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_checksum_in_child, args=(queue, expected))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


# --- detection, on every implementation -------------------------------------------------------

def _implementations():
    impls = {"torch": chunk_checksums_ref, "triton": chunk_checksums_triton}
    if native.checksum_library() is not None:
        impls["native"] = checksum.chunk_checksums_native
    return impls


@pytest.mark.parametrize("impl", ["torch", "triton", "native"])
@pytest.mark.parametrize("fill", ["random", "zeros"])
def test_a_changed_word_a_swapped_pair_and_a_truncation_are_detected(impl, fill):
    """Anywhere in a chunk: any changed 32-bit word, two swapped (unequal) words, a chunk cut short.

    Zeros too: a keyed half that is zero must not hide its partner's change.
    """
    fn = _implementations().get(impl)
    if fn is None:
        pytest.skip("no C compiler built the native checksum")
    b = _buf(4 * 517) if fill == "random" else torch.zeros(4 * 517, dtype=torch.uint8)
    base = fn(b, 512)
    rng = torch.Generator().manual_seed(11)
    for _ in range(12):
        i = int(torch.randint(0, 517, (1,), generator=rng))
        words = b.clone().view(torch.int32)
        words[i] ^= int(torch.randint(1, 2**31 - 1, (1,), generator=rng))
        got = fn(words.view(torch.uint8), 512)
        assert (got != base).tolist() == [c == i * 4 // 512 for c in range(base.numel())]
    for i, j in ((0, 1), (3, 700 % 517), (127, 128), (10, 300)):
        words = b.clone().view(torch.int32)
        words[i] = 7 if fill == "zeros" else words[i]
        before = fn(words.view(torch.uint8), 512)
        words[[i, j]] = words[[j, i]]
        assert not torch.equal(fn(words.view(torch.uint8), 512), before), (i, j)
    assert fn(b[:-4], 512)[-1] != base[-1]
    assert fn(b[:512 * 3 + 256], 512)[-1] != base[3]


@pytest.mark.parametrize("backend", ["torch", "triton", None])
@pytest.mark.parametrize("nbytes,chunk,first_chunk,lead", [
    (4, 8, 0, 0), (4 * 1031, 400, 2, 4), (4 * 37 * 131, 1032, 0, 12), (3 << 20, 1 << 20, 1, 8)])
def test_the_fused_copy_equals_copy_then_checksum(backend, nbytes, chunk, first_chunk, lead):
    if backend == "triton" and nbytes > 1 << 16:
        pytest.skip("the interpreter is slow on megabytes")
    src = _buf(nbytes + lead, seed=4)[lead:]
    dst = torch.full((nbytes + 16,), 0xEE, dtype=torch.uint8)[8:8 + nbytes]
    sums = checksum.copy_with_checksums(dst, src, chunk, first_chunk=first_chunk, backend=backend)
    assert torch.equal(dst, src)
    assert torch.equal(sums, chunk_checksums_ref(src, chunk, first_chunk=first_chunk))


@needs_native
def test_the_native_fused_copy_streams_large_copies_over_threads(monkeypatch):
    monkeypatch.setattr(native, "_MIN_TASK_PAIRS", 1 << 15)
    src = _buf(5 << 20, seed=9)
    dst = torch.zeros(5 << 20, dtype=torch.uint8)
    sums = checksum.copy_with_checksums(dst, src, 1 << 20, first_chunk=3)
    assert torch.equal(dst, src)
    assert torch.equal(sums, chunk_checksums_ref(src, 1 << 20, first_chunk=3))


def test_the_fused_copy_rejects_bad_input():
    with pytest.raises(ValueError, match="dst has"):
        checksum.copy_with_checksums(_buf(16), _buf(24), 8)
    with pytest.raises(TypeError, match="dst"):
        checksum.copy_with_checksums(torch.zeros(4), _buf(16), 8)


@pytest.mark.parametrize(("rows", "row_bytes", "stride", "offset", "chunk"), [
    (300, 512, 1024, 4096, 8192),     # a column block, rows crossing chunk edges
    (7, 24, 40, 8, 64),               # rows of 3 pairs, a chunk every 2.7 rows
    (1, 4096, 8192, 0, 4096),
])
def test_chunk_sums_of_row_strided_copies_equal_copy_then_checksum(rows, row_bytes, stride,
                                                                   offset, chunk):
    """`ChunkSums.copy` of a 2-D row-strided source (native `rows_sums`) against the reference."""
    g = torch.Generator().manual_seed(rows)
    wide = torch.randint(0, 256, (rows * stride,), dtype=torch.uint8, generator=g)
    block = torch.as_strided(wide, (rows, row_bytes), (stride, 1))
    nbytes = offset + rows * row_bytes + 24
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    want = buf.clone()
    want[offset:offset + rows * row_bytes].copy_(block.reshape(-1))
    sums = checksum.ChunkSums(nbytes, chunk)
    assert sums.copy(offset, buf[offset:offset + rows * row_bytes], block)
    assert torch.equal(buf, want)
    assert torch.equal(sums.finish(buf), chunk_checksums_ref(want, chunk))


def test_row_strided_copies_it_cannot_sum_are_left_to_the_caller():
    wide = torch.zeros(64 * 10, dtype=torch.uint8)
    sums = checksum.ChunkSums(1024, 64)
    dst = torch.zeros(10 * 12, dtype=torch.uint8)
    assert not sums.copy(0, dst, torch.as_strided(wide, (10, 12), (64, 1)))    # 12 % 8
    dst = torch.zeros(10 * 16, dtype=torch.uint8)
    assert not sums.copy(0, dst, torch.as_strided(wide, (10, 16), (62, 1)))    # stride % 4
    assert not sums.copy(4, dst, torch.as_strided(wide, (10, 16), (64, 1)))    # offset % 8
    assert sums.covered == []
