"""Chunk checksums: Triton (interpreter) vs torch reference, sensitivity, bad input."""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels import checksum
from weightfabric.kernels.checksum import (
    chunk_checksums,
    chunk_checksums_ref,
    chunk_checksums_triton,
)


def _buf(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes,chunk", [(4 * 1031, 400), (4096, 4096), (4, 4), (4 * 37 * 131, 1028)])
def test_triton_matches_torch_bit_exact(nbytes, chunk):
    b = _buf(nbytes)
    ref = chunk_checksums_ref(b, chunk)
    assert ref.shape == (-(-nbytes // chunk),)
    assert torch.equal(chunk_checksums(b, chunk, backend="triton"), ref)


@pytest.mark.parametrize("chunk", [40, 256, 1000], ids=["chunks-per-block", "one-per-block",
                                                      "blocks-per-chunk"])
@pytest.mark.parametrize("first_chunk", [0, 3])
def test_the_reference_agrees_across_its_blocks(monkeypatch, chunk, first_chunk):
    monkeypatch.setattr(checksum, "_REF_BLOCK_WORDS", 64)  # 256-byte blocks: many per buffer
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
@pytest.mark.parametrize("chunk", [36, 1028, 4096])
def test_triton_at_every_word_alignment_and_chunk_edge(monkeypatch, lead, chunk):
    """The kernel reads whole 16-byte blocks and tiles aligned in the buffer's space.

    A buffer starting 4, 8 or 12 bytes into a block, chunks ending mid-tile, and a chunk
    split over many programs (partial sums added atomically) still match.
    """
    monkeypatch.setattr(checksum, "PROGRAM_WORDS", 64)
    raw = _buf(4 * 600 + 16, seed=lead)
    b = raw[lead:lead + 4 * 599 - 8]
    want = chunk_checksums_ref(b, chunk, first_chunk=2)
    for block in (16, 64):
        assert torch.equal(chunk_checksums_triton(b, chunk, first_chunk=2, block=block), want)
    assert torch.equal(chunk_checksums_triton(b, chunk, first_chunk=2, split=1), want)
