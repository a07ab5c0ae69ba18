"""Fused fp8 dequantise-into-windows: Triton (interpreter) vs torch, bit for bit, and bad input."""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels import (
    Fp8Segment,
    dequant_segments,
    dequantize_fp8_segments,
    dequantize_fp8_segments_ref,
)
from weightfabric.kernels.fp8 import dequantize_fp8_ref, quantize_fp8_ref, scale_shape
from weightfabric.kernels.segcopy import CheckCache

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, except that a NaN may carry any payload (it must stay a NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(_BITS[got.dtype])[~nan], want.view(_BITS[want.dtype])[~nan])


def shard(rows: int, cols: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)
    return quantize_fp8_ref(x, block)


def random_segments(g: torch.Generator, block: int, count: int) -> tuple[list[Fp8Segment], list]:
    """Random unaligned windows of a few shards into strided destinations of every dtype."""
    shards = [shard(int(torch.randint(1, 90, (1,), generator=g)),
                    int(torch.randint(1, 300, (1,), generator=g)), block, seed=i) for i in range(3)]
    segments, outs = [], []
    for i in range(count):
        q, s = shards[i % len(shards)]
        rows, cols = q.shape
        r0 = int(torch.randint(0, rows, (1,), generator=g))
        c0 = int(torch.randint(0, cols, (1,), generator=g))
        nr = int(torch.randint(1, rows - r0 + 1, (1,), generator=g))
        nc = int(torch.randint(1, cols - c0 + 1, (1,), generator=g))
        dtype = OUT_DTYPES[i % 3]
        # a destination window inside a larger tensor, transposed every other time
        big = torch.full((nc + 5, nr + 3) if i % 2 else (nr + 3, nc + 5), float("nan"), dtype=dtype)
        dst = big[2:2 + nc, 1:1 + nr].t() if i % 2 else big[1:1 + nr, 2:2 + nc]
        segments.append(Fp8Segment(q, s, dst, row=r0, col=c0, block=block))
        outs.append(big)
    return segments, outs


def clone_onto(segments: list[Fp8Segment], outs: list[torch.Tensor]) -> tuple[list[Fp8Segment], list]:
    """The same windows into fresh copies of the destination tensors."""
    copies = [o.clone() for o in outs]
    moved = []
    for s, o, c in zip(segments, outs, copies, strict=True):
        view = c.as_strided(s.dst.shape, s.dst.stride(), s.dst.storage_offset())
        assert view.data_ptr() - c.data_ptr() == s.dst.data_ptr() - o.data_ptr()
        moved.append(Fp8Segment(s.q, s.scale, view, row=s.row, col=s.col, block=s.block))
    return moved, copies


@pytest.mark.parametrize("block,seed", [(16, 0), (32, 1), (128, 2)])
def test_triton_matches_torch_reference_on_random_unaligned_windows(block, seed):
    g = torch.Generator().manual_seed(seed)
    segments, outs = random_segments(g, block, 12)
    ref_segments, ref_outs = clone_onto(segments, outs)
    dequantize_fp8_segments(segments, backend="triton")
    dequantize_fp8_segments_ref(ref_segments)
    for got, want in zip(outs, ref_outs, strict=True):
        assert_same_bits(got, want)  # the NaN frame around each window is untouched too
    assert any(s.row % block or s.col % block for s in segments)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("strip", [dequant_segments.REF_STRIP, 50, 1])  # the reference's rows a step
def test_reference_equals_whole_shard_dequantise_then_window(dtype, strip, monkeypatch):
    monkeypatch.setattr(dequant_segments, "REF_STRIP", strip)
    block = 16
    q, s = shard(45, 70, block, seed=7)
    full = dequantize_fp8_ref(q, s, dtype, block)
    for r0, c0, nr, nc in [(0, 0, 45, 70), (3, 5, 17, 33), (15, 15, 2, 2), (44, 69, 1, 1)]:
        for backend in ("torch", "triton"):
            out = torch.empty(nr, nc, dtype=dtype)
            dequantize_fp8_segments([Fp8Segment(q, s, out, row=r0, col=c0, block=block)],
                                    backend=backend)
            assert_same_bits(out, full[r0:r0 + nr, c0:c0 + nc])


def test_windows_larger_than_one_tile_and_a_strided_byte_region_source():
    block = 32
    q, s = shard(70, 300, block, seed=3)
    # the shard as a row-padded view of a flat byte region, as a peer's memory would be
    region = torch.zeros(10 + 70 * 320, dtype=torch.uint8)
    region[10:].view(70, 320)[:, :300] = q.view(torch.uint8)
    q_view = region[10:].view(FP8).view(70, 320)[:, :300]
    out = torch.empty(66, 290, dtype=torch.bfloat16)
    dequantize_fp8_segments([Fp8Segment(q_view, s, out, row=3, col=7, block=block)],
                            backend="triton")
    assert_same_bits(out, dequantize_fp8_ref(q, s, torch.bfloat16, block)[3:69, 7:297])


@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy, under the interpreter
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_fp8_code_with_nan_subnormal_overflow_and_tiny_scales(dtype):
    # all 256 codes (0x7F / 0xFF are NaN, 0x01..0x07 subnormal, 0x80 is -0) in each block
    codes = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(2, 2)
    q = codes.view(FP8)
    # scale 1; 2**100 (float32 fine, bf16 fine, float16 overflows to inf); 1e38 (float32
    # overflows to inf for large codes); 2**-140 (float32 subnormal products, flushed in f16)
    scale = torch.tensor([[1.0, 2.0**100], [1e38, 2.0**-140]])
    out = torch.empty(31, 30, dtype=dtype)
    dequantize_fp8_segments([Fp8Segment(q, scale, out, row=1, col=2, block=16)], backend="triton")
    want = (q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(dtype)
    assert_same_bits(out, want[1:, 2:])
    assert out.isnan().sum() == 8  # codes 0x7F and 0xFF in each of the four blocks
    assert out.isinf().any() and (out != 0).any()


def test_mixed_blocks_and_dtypes_share_one_launch_and_zero_size_windows_are_skipped():
    a, sa = shard(40, 50, 16, seed=1)
    b, sb = shard(9, 130, 128, seed=2)
    outs = [torch.empty(40, 50), torch.empty(9, 3, dtype=torch.bfloat16),
            torch.empty(0, 5, dtype=torch.float16)]
    dequantize_fp8_segments([Fp8Segment(a, sa, outs[0], block=16),
                             Fp8Segment(b, sb, outs[1], row=0, col=127, block=128),
                             Fp8Segment(b, sb, outs[2], row=9, col=0, block=128)], backend="triton")
    assert_same_bits(outs[0], dequantize_fp8_ref(a, sa, torch.float32, 16))
    assert_same_bits(outs[1], dequantize_fp8_ref(b, sb, torch.bfloat16, 128)[:, 127:])
    dequantize_fp8_segments([], backend="triton")


def test_bad_input_names_the_segment():
    q, s = shard(40, 40, 16, seed=0)
    ok = Fp8Segment(q, s, torch.empty(4, 4), row=2, col=3, block=16)

    def seg(**kw) -> list[Fp8Segment]:
        fields = {"q": ok.q, "scale": ok.scale, "dst": ok.dst, "row": ok.row, "col": ok.col,
                  "block": ok.block, **kw}
        return [ok, Fp8Segment(**fields)]

    cases = [
        (TypeError, r"segment 1: q has dtype torch.uint8", seg(q=q.view(torch.uint8))),
        (TypeError, r"segment 1: scale has dtype torch.float64", seg(scale=s.double())),
        (TypeError, r"segment 1: dst has dtype torch.int16", seg(dst=torch.empty(4, 4, dtype=torch.int16))),
        (ValueError, r"segment 1: q and dst must be 2-D", seg(dst=torch.empty(4))),
        (ValueError, r"segment 1: scale has shape \(2, 3\).*needs \(3, 3\)", seg(scale=s[:2])),
        (ValueError, r"segment 1: scale has shape \(3, 3\).*with block 32 needs \(2, 2\)",
         seg(block=32)),
        (ValueError, r"segment 1: block must be a power of two", seg(block=24)),
        (ValueError, r"segment 1: window rows 38..42 x cols 3..7 lies outside q of shape \(40, 40\)",
         seg(row=38)),
        (ValueError, r"segment 1: window rows -1..3", seg(row=-1)),
        (ValueError, r"segment 1: q, scale and dst on cpu, cpu, meta",
         seg(dst=torch.empty(4, 4, device="meta"))),
    ]
    for exc, match, segments in cases:
        with pytest.raises(exc, match=match):
            dequantize_fp8_segments(segments, backend="torch")
    assert scale_shape((40, 40), 16) == (3, 3)
    with pytest.raises(ValueError, match="backend"):
        dequantize_fp8_segments([ok], backend="cuda")


# --- checks and tables cached per call key ------------------------------------------------------

def _counting(monkeypatch) -> tuple[list[int], list[int]]:
    """From an empty check cache: each check's and each table build's window count."""
    monkeypatch.setattr(dequant_segments, "_CHECKED", CheckCache())
    checks: list[int] = []
    builds: list[int] = []
    check, build = dequant_segments.check_fp8_segments, dequant_segments._device_table

    def counted_check(segments, what="dequantize_fp8_segments"):
        checks.append(len(segments))
        return check(segments, what)

    def counted_build(segments, device):
        builds.append(len(segments))
        return build(segments, device)

    monkeypatch.setattr(dequant_segments, "check_fp8_segments", counted_check)
    monkeypatch.setattr(dequant_segments, "_device_table", counted_build)
    return checks, builds


def _assert_dequantized(segments: list[Fp8Segment]) -> None:
    """Every window holds the torch reference's bits."""
    for s in segments:
        want = torch.empty(s.dst.shape, dtype=s.dst.dtype)
        dequantize_fp8_segments_ref([Fp8Segment(s.q, s.scale, want, s.row, s.col, s.block)])
        assert_same_bits(s.dst.contiguous(), want)


def test_a_repeat_call_skips_the_checks_and_reuses_the_table(monkeypatch):
    checks, builds = _counting(monkeypatch)
    segments, outs = random_segments(torch.Generator().manual_seed(5), 16, 9)
    dequantize_fp8_segments(segments, backend="triton")
    segments[0].q.view(torch.uint8).bitwise_xor_(0x15)  # same key, new codes: read by the table
    # new window objects and views of the same memory: the same key
    again = [Fp8Segment(s.q, s.scale, s.dst.as_strided(s.dst.shape, s.dst.stride()), s.row,
                        s.col, s.block) for s in segments]
    dequantize_fp8_segments(again, backend="triton")
    assert checks == [9] and builds == [9]
    _assert_dequantized(segments)
    dequantize_fp8_segments(again, backend="torch")  # the reference path takes the entry too
    assert checks == [9]
    _assert_dequantized(segments)


def test_a_changed_call_is_checked_again(monkeypatch):
    checks, builds = _counting(monkeypatch)
    q, s = shard(40, 70, 16, seed=4)
    out = torch.empty(8, 30, dtype=torch.bfloat16)
    ok = Fp8Segment(q, s, out, row=3, col=5, block=16)
    dequantize_fp8_segments([ok], backend="triton")
    changed = [
        Fp8Segment(q, s, torch.empty(8, 30, dtype=torch.bfloat16), 3, 5, 16),  # another tensor
        Fp8Segment(q, s, torch.empty(30, 8, dtype=torch.bfloat16).t(), 3, 5, 16),  # strides
        Fp8Segment(q, s, torch.empty(8, 30), 3, 5, 16),  # another dtype
        Fp8Segment(q, s, out, 4, 5, 16),  # another window
        Fp8Segment(q.clone(), s, out, 3, 5, 16),  # another shard
    ]
    for seg in changed:
        dequantize_fp8_segments([seg], backend="triton")
        _assert_dequantized([seg])
    assert checks == [1] * 6 and builds == [1] * 6
    # the addresses, shapes and strides of a checked call, one of them another dtype, or a
    # block that equals a checked one but is no int: the errors of a first call
    bad = [(TypeError, "segment 0: dst has dtype torch.int16",
            Fp8Segment(q, s, out.view(torch.int16), 3, 5, 16)),
           (TypeError, "segment 0: q has dtype torch.uint8",
            Fp8Segment(q.view(torch.uint8), s, out, 3, 5, 16)),
           (ValueError, "segment 0: block must be a power of two >= 16, got 16.0",
            Fp8Segment(q, s, out, 3, 5, 16.0)),
           (ValueError, "segment 0: window rows 33..41",
            Fp8Segment(q, s, out, 33, 5, 16))]
    for exc, match, seg in bad:
        with pytest.raises(exc, match=match):
            dequantize_fp8_segments([seg], backend="triton")
    assert checks == [1] * 10


def test_the_dequant_check_cache_is_bounded(monkeypatch):
    checks, _ = _counting(monkeypatch)
    monkeypatch.setattr(dequant_segments._CHECKED, "size", 3)
    q, s = shard(20, 20, 16, seed=6)
    windows = [Fp8Segment(q, s, torch.empty(4, 4), row=i, col=i, block=16) for i in range(5)]
    for w in windows:
        dequantize_fp8_segments([w], backend="triton")
    assert len(dequant_segments._CHECKED) == 3
    dequantize_fp8_segments([windows[-1]], backend="triton")  # kept
    dequantize_fp8_segments([windows[0]], backend="triton")  # evicted: checked again
    assert len(dequant_segments._CHECKED) == 3 and len(checks) == 6
    _assert_dequantized(windows)
