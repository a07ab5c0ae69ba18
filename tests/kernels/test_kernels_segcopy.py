"""The segment-copy engine: access-width choice, tiling and the check cache, against torch."""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels import segcopy
from weightfabric.kernels.segcopy import build_table, copy_segments, element_kind

OP = 1  # table column: the kernel's operation
VEC_RAW = 8


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _both(segments_of, block: int = 64) -> None:
    """Run ``segments_of(buffers)`` through Triton and torch on copies; equal bits."""
    got, want = segments_of(), segments_of()
    copy_segments(got[0], backend="triton", block=block)
    copy_segments(want[0], backend="torch")
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _ops(segments) -> list[int]:
    kinds = [element_kind(s.dtype, d.dtype) for s, d in segments]
    return build_table(segments, segcopy.anchor(segments[0][1].device), kinds, 64)[:, OP].tolist()


@pytest.mark.parametrize("src_at,dst_at,nbytes", [
    (0, 0, 4096), (0, 0, 1000 * 16 + 7), (3, 5, 333), (2, 6, 1002), (8, 24, 808), (16, 1, 4099),
    (0, 0, 5), (4, 8, 12)])
def test_1d_byte_runs_at_every_alignment(src_at, dst_at, nbytes):
    """Aligned bodies go as 16-byte vectors, tails and misaligned runs as narrower words."""
    def segments_of():
        src, dst = _bytes(nbytes + 64, 1), torch.zeros(nbytes + 64, dtype=torch.uint8)
        return [(src[src_at:src_at + nbytes], dst[dst_at:dst_at + nbytes])], [dst]
    _both(segments_of)
    ops = _ops(segments_of()[0])
    if src_at % 16 == 0 and dst_at % 16 == 0 and nbytes >= 16:
        assert ops[0] == VEC_RAW


def test_2d_windows_strided_sources_and_rows_shorter_and_longer_than_a_tile():
    g = torch.Generator().manual_seed(2)
    src = torch.randn(40, 320, generator=g).to(torch.bfloat16)  # 640-byte rows

    def segments_of():
        dst = torch.zeros(50, 336, dtype=torch.bfloat16)  # 672-byte rows
        segs = [(src[:, :128], dst[:40, :128]),          # 256-byte rows, 16-byte aligned: vectors
                (src[:, 130:140], dst[:40, 200:210]),    # 20-byte rows at a 4-byte offset
                (src[1:3, 5:299], dst[45:47, 3:297]),    # rows longer than one 64-unit tile
                (src[:7, :9].t(), dst[41:50, :7]),        # transposed source: strided inner dim
                (src[:0, :5], dst[:0, :5])]                 # empty: skipped
        return segs, [dst]
    _both(segments_of)
    ops = _ops(segments_of()[0])
    assert ops[0] == VEC_RAW and VEC_RAW not in ops[1:]


def test_3d_and_4d_segments_and_more_dims_than_the_kernel_takes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, 6, 7, generator=g)

    def segments_of():
        big = torch.zeros(3, 4, 5, 6, 9)
        out = torch.zeros(6, 5, 4, 3)
        return [(x[..., :5], big[..., 2:7]),                   # 5-D, split over dim 0
                (x[1, :, :, :, 2].permute(2, 1, 0), out[:, :, :, 1]),  # 3-D, strided inner
                (x[2, 1:3, :, :2, :4], big[0, :2, :, 3:5, :4])], [big, out]
    _both(segments_of, block=16)


def test_many_tiny_segments_share_one_launch():
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(1 + i % 5, generator=g) for i in range(300)]

    def segments_of():
        dst = torch.zeros(1600)
        segs, at = [], 0
        for s in srcs:
            segs.append((s, dst[at:at + s.numel()]))
            at += s.numel() + 1
        return segs, [dst]
    _both(segments_of)


@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                  (torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_casts_vectorised_body_tail_and_unaligned(pair):
    a, b = pair
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2000, generator=g) * 100).to(a)

    def segments_of():
        y = torch.zeros(2600, dtype=b)
        m = x[:1040].view(26, 40)
        return [(x[:1027], y[:1027]),                      # aligned body of 1024, tail of 3
                (x[1:500], y[1030:1529]),                  # misaligned: one element per lane
                (m[:, :16], y[1536:1536 + 26 * 40].view(26, 40)[:, 8:24])], [y]  # 2-D, vectors
    _both(segments_of)
    ops = _ops(segments_of()[0])
    assert ops[0] >= 9 and ops[1] == element_kind(a, b) and ops[-1] >= 9


def _counting(monkeypatch, name: str) -> list[int]:
    """Count calls of segcopy's ``name`` (each call appends its segment count)."""
    calls: list[int] = []
    original = getattr(segcopy, name)

    def counted(segments, *args):
        calls.append(len(segments))
        return original(segments, *args)

    monkeypatch.setattr(segcopy, name, counted)
    return calls


def _counting_checks(monkeypatch) -> list[int]:
    """Count `copy_segments`' checks, from an empty check cache (no earlier test's keys)."""
    monkeypatch.setattr(segcopy, "_CHECKED", segcopy.CheckCache())
    return _counting(monkeypatch, "check_segments")


def test_a_repeat_copy_skips_the_checks_and_reuses_the_table(monkeypatch):
    checks, builds = _counting_checks(monkeypatch), _counting(monkeypatch, "segment_table")
    src, dst = _bytes(5000, 6), torch.zeros(5000, dtype=torch.uint8)
    copy_segments([(src[16:4016], dst[32:4032])], backend="triton")
    src[16:4016] = _bytes(4000, 7)  # same key (new views of the same memory), new values
    copy_segments([(src[16:4016], dst[32:4032])], backend="triton")
    assert checks == [1] and builds == [1]
    assert torch.equal(dst[32:4032], src[16:4016]) and dst[:32].sum() == 0


def test_a_changed_copy_is_checked_again(monkeypatch):
    checks = _counting_checks(monkeypatch)
    x = torch.randn(6, 8)
    dst = torch.zeros(6, 8)
    copy_segments([(x, dst)], backend="triton")
    other = torch.zeros(6, 8)  # another tensor of the same shape
    copy_segments([(x, other)], backend="triton")
    strided = torch.zeros(8, 6).t()  # the same shape, other strides
    copy_segments([(x, strided)], backend="triton")
    assert checks == [1, 1, 1]
    assert torch.equal(dst, x) and torch.equal(other, x) and torch.equal(strided, x)
    # the same address, shape and strides as a checked call, another dtype: the same error
    # as a first call
    with pytest.raises(TypeError, match="segment 0: cannot cast torch.float32 -> torch.int32"):
        copy_segments([(x, dst.view(torch.int32))], backend="triton")
    with pytest.raises(ValueError, match="segment 0: source shape \\(6, 8\\) != destination"):
        copy_segments([(x, dst.view(8, 6))], backend="triton")
    assert checks == [1, 1, 1, 1, 1]
    half = torch.zeros(6, 8, dtype=torch.bfloat16)  # a cast: checked, then cached in turn
    for _ in range(2):
        copy_segments([(x, half)], backend="triton")
    assert checks[5:] == [1] and torch.equal(half, x.to(torch.bfloat16))


def test_the_check_cache_keeps_the_most_recently_used_keys(monkeypatch):
    checks = _counting_checks(monkeypatch)
    monkeypatch.setattr(segcopy._CHECKED, "size", 3)
    x = torch.arange(4.0)
    outs = [torch.zeros(4) for _ in range(5)]
    for out in outs:
        copy_segments([(x, out)], backend="triton")
    assert len(segcopy._CHECKED) == 3 and len(checks) == 5
    copy_segments([(x, outs[-1])], backend="triton")  # kept
    copy_segments([(x, outs[0])], backend="triton")  # evicted: checked again
    assert len(segcopy._CHECKED) == 3 and len(checks) == 6
    assert all(torch.equal(o, x) for o in outs)


def test_check_cache_entries_match_key_and_owner():
    cache = segcopy.CheckCache(size=2)
    owner = object()
    entry = cache.remember((1, 2), owner, reps=(0,))
    assert cache.get((1, 2), owner) is entry and entry.reps == (0,)
    assert cache.get((1, 2)) is None and cache.get((1, 2), object()) is None  # another owner
    assert cache.get((1, 3), owner) is None and cache.get(None) is None
    assert cache.get(([1],)) is None  # unhashable: no key, no error
    cache.remember(None)
    cache.remember(([1],))
    assert len(cache) == 1
    assert entry.table(("t",), lambda: 5) == 5 and entry.table(("t",), lambda: 6) == 5


def test_block_must_be_a_power_of_two():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="power of two"):
        copy_segments([(x, x.clone())], backend="triton", block=48)
