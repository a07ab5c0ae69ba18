"""Blockwise fp8: Triton (interpreter) vs torch's own float8 conversion, bit for bit."""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels.fp8 import (
    dequantize_fp8,
    dequantize_fp8_ref,
    quantize_fp8,
    quantize_fp8_ref,
    scale_shape,
)


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-7, 3, shape[-1])
    return x.to(dtype)


@pytest.mark.parametrize("shape,dtype,block", [
    ((37, 131), torch.bfloat16, 32), ((37, 131), torch.float32, 128),
    ((131,), torch.float16, 32), ((300,), torch.float32, 128)])
def test_quantize_matches_torch_bit_exact(shape, dtype, block):
    x = _weights(shape, dtype)
    if len(shape) == 2:
        x[:5, :40] = 0  # an all-zero tile takes scale 1
    q, s = quantize_fp8(x, block=block, backend="triton")
    qr, sr = quantize_fp8_ref(x, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == scale_shape(shape, block)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_a_tile_whose_scale_underflows_takes_scale_1_in_both_backends():
    """A tile's amax / 448 is 0 in float32 for amax below ~3e-43.

    Such a tile is scaled by 1 (its values round to 0), never by 0, which would make NaN
    codes of finite input.
    """
    x = torch.zeros(16, 32)
    x[0, 0], x[0, 17] = 1e-43, 1.0  # the second tile is ordinary
    q, s = quantize_fp8(x, block=16, backend="triton")
    qr, sr = quantize_fp8_ref(x, 16)
    assert torch.equal(s, torch.tensor([[1.0, 1.0 / 448]])) and torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert not dequantize_fp8_ref(qr, sr, torch.float32, 16).isnan().any()


def test_quantize_strided_input():
    x = _weights((131, 37), torch.bfloat16).t()
    q, s = quantize_fp8(x, block=32, backend="triton")
    qr, sr = quantize_fp8_ref(x, 32)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_fp8_rounding_ties_subnormals_and_saturation():
    # each 16-wide block starts with 448, so its scale is exactly 1 and the
    # other values are converted as they are
    g = torch.Generator().manual_seed(4)
    probes = torch.cat([
        torch.linspace(-448, 448, 1501), torch.linspace(-0.02, 0.02, 1501),
        torch.arange(0, 64) * 2.0**-10,               # ties between fp8 subnormals
        (torch.arange(8, 120) + 0.5) * 2.0**-3,        # ties between normals
        torch.randn(500, generator=g) * 2.0**-12])
    blocks = probes.split(15)
    x = torch.cat([torch.cat([torch.tensor([448.0]), b, torch.zeros(15 - len(b))]) for b in blocks])
    q, s = quantize_fp8(x, block=16, backend="triton")
    assert torch.all(s == 1.0)
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    big = torch.tensor([1e6, -1e6] + [1.0] * 14)
    qb, sb = quantize_fp8(big, block=16, backend="triton")
    assert qb.float()[0] == 448.0 and qb.float()[1] == -448.0  # saturates, no NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_matches_torch_bit_exact(dtype):
    x = _weights((37, 131), torch.float32, seed=3)
    q, s = quantize_fp8_ref(x, 32)
    y = dequantize_fp8(q, s, dtype=dtype, block=32, backend="triton")
    yr = dequantize_fp8_ref(q, s, dtype, 32)
    assert y.dtype == dtype and torch.equal(y, yr)
    err = (y.float() - x).abs().max() / x.abs().max()
    assert err < 0.07  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_every_code_nan_codes_stay_nan(dtype):
    q = torch.arange(256, dtype=torch.uint8).view(16, 16).view(torch.float8_e4m3fn)
    y = dequantize_fp8(q, torch.tensor([[0.25]]), dtype=dtype, block=16, backend="triton")
    want = dequantize_fp8_ref(q, torch.tensor([[0.25]]), dtype, 16)
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(y.isnan(), nan)  # codes 0x7F and 0xFF
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(y.view(bits)[~nan], want.view(bits)[~nan])  # -0.0 and subnormals too


def test_fp8_bad_input():
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        quantize_fp8(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D or 2-D"):
        quantize_fp8(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8(torch.zeros(4), block=100)
    q, s = quantize_fp8(torch.ones(40, 40), block=32, backend="torch")
    with pytest.raises(ValueError, match="scale has shape"):
        dequantize_fp8(q, s[:1], block=32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_fp8(q.float(), s, block=32)
    with pytest.raises(TypeError, match="output dtype"):
        dequantize_fp8(q, s, dtype=torch.int8, block=32)
    for shape in ((5, 0), (0,)):  # empty: both backends return an empty result
        empty = torch.zeros(shape).to(torch.float8_e4m3fn)
        scales = torch.ones(scale_shape(shape, 32))
        for backend in ("torch", "triton"):
            assert dequantize_fp8(empty, scales, block=32, backend=backend).shape == shape


@pytest.mark.parametrize("shape", [(37, 131), (131,), (1, 300), (0,)])
def test_outputs_are_new_contiguous_tensors_of_the_input_shape_and_repeat_bit_exact(shape):
    x = _weights(shape, torch.bfloat16, seed=5) if shape[-1] else torch.zeros(shape)
    qr, sr = quantize_fp8_ref(x, 32)
    for _ in range(2):  # a repeat gives the same bits
        q, s = quantize_fp8(x, block=32, backend="triton")
        assert q.shape == x.shape and s.shape == scale_shape(shape, 32)
        assert q.is_contiguous() and s.is_contiguous()
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        for dtype in (torch.float32, torch.bfloat16):
            y = dequantize_fp8(q, s, dtype=dtype, block=32, backend="triton")
            assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
            assert torch.equal(y, dequantize_fp8_ref(qr, sr, dtype, 32))
    q2, _ = quantize_fp8(x, block=32, backend="triton")
    assert q2.data_ptr() != q.data_ptr() or not q.numel()  # each call's own output
