"""`SlotMarks`: chunks are marked once every tensor byte in them is written."""

from __future__ import annotations

import threading

import torch

from weightfabric.fabric.progress import ChunkProgress, SlotMarks
from weightfabric.kernels.checksum import ChunkSums, chunk_checksums


def test_a_chunk_is_marked_when_every_tensor_in_it_is_done() -> None:
    # chunks of 100 bytes; a: [0, 150), padding [150, 200), b: [200, 260), c: [260, 400)
    progress = ChunkProgress(5)
    marks = SlotMarks([("a", 0, 150), ("b", 200, 60), ("c", 260, 140), ("e", 400, 0)], 100,
                      progress)
    assert progress.bitmap() == bytes([0, 0, 0, 0, 1])     # chunk 4 holds no tensor byte
    marks.done(["b"])
    assert progress.bitmap() == bytes([0, 0, 0, 0, 1])     # chunk 2 still waits for c
    marks.done(["a"])
    assert progress.bitmap() == bytes([1, 1, 0, 0, 1])     # chunk 1: a's tail + padding
    marks.done(["c", "e", "unknown"])
    assert progress.complete


def test_written_ranges_count_once_however_they_overlap() -> None:
    progress = ChunkProgress(3)
    marks = SlotMarks([("a", 0, 300)], 100, progress)
    marks.written(0, 50)
    marks.written(20, 60)                  # overlaps: bytes 50..80 are new
    assert progress.bitmap() == bytes([0, 0, 0])
    marks.written(80, 20)                  # touches: chunk 0 complete
    assert progress.bitmap() == bytes([1, 0, 0])
    marks.written(150, 100)
    marks.written(100, 60)
    assert progress.bitmap() == bytes([1, 1, 0])
    marks.done(["a"])                      # the rest, once
    assert progress.complete and marks._left == [0, 0, 0]


def test_chunk_sums_copies_from_threads_and_refuses_bytes_outside_the_buffer() -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    sums = ChunkSums(dst.numel(), 4096)

    def copy(lo: int, hi: int) -> None:
        if not sums.copy(lo, dst[lo:hi], src[lo:hi]):      # offsets not multiples of 8
            dst[lo:hi].copy_(src[lo:hi])                   # are refused: copied, summed later
    cuts = [*range(0, src.numel(), 3000), src.numel()]
    threads = [threading.Thread(target=copy, args=(a, b))
               for a, b in zip(cuts, cuts[1:], strict=False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(dst, src)
    assert torch.equal(sums.finish(dst), chunk_checksums(src, 4096))
    outside = torch.empty(64, dtype=torch.uint8)
    assert not sums.copy(-64, outside, src[:64])
    assert not sums.copy(src.numel(), outside, src[:64])


def test_a_range_copied_again_replaces_what_its_first_copy_summed() -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    torn = torch.zeros_like(src)
    dst = torch.empty_like(src)
    sums = ChunkSums(src.numel(), 4096)
    assert sums.copy(1024, dst[1024:9000], torn[1024:9000])     # a read that went wrong
    assert sums.copy(1024, dst[1024:9000], src[1024:9000])      # retried elsewhere
    dst[:1024].copy_(src[:1024])
    dst[9000:].copy_(src[9000:])
    assert torch.equal(sums.finish(dst), chunk_checksums(src, 4096))
