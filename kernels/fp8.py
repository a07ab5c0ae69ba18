"""Blockwise float8_e4m3fn quantisation with one float32 scale per block, and back.

Layout: a 2-D weight ``[M, N]`` is cut into ``block x block`` tiles (default
128 x 128, edge tiles smaller); a 1-D vector ``[N]`` into ``1 x block`` pieces.
Scales are float32 ``[ceil(M/block), ceil(N/block)]`` (2-D) or ``[ceil(N/block)]``
(1-D). For a tile with ``amax = max|x|``::

    scale = amax / 448 (or 1 when amax == 0)
    q     = float8_e4m3fn(clamp(x / scale, -448, 448))   round to nearest even
    x'    = float32(q) * scale, then cast to the output dtype (RNE)

dtype rules: input bfloat16, float16 or float32 (any strides), finite values;
output of dequantisation float32, bfloat16 or float16. Both kernels do every
rounding step with correctly rounded float32 operations or explicit integer
arithmetic (no hardware fp8 conversion), so the interpreter and the GPU produce
the same bits as torch's own conversion: no interpreter tolerance is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightfabric.kernels.bits import bf16_rne_bits, e4m3_to_f32
from weightfabric.kernels.dispatch import choose_backend

FP8_MAX = 448.0
DEFAULT_BLOCK = 128
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _quantize_kernel(
    x_ptr, stride_xm, stride_xn,   # input tile source [M, N] (read)
    q_ptr,                         # *u8 [M, N] contiguous: fp8 bits (written)
    scale_ptr,                     # *f32 [cdiv(M, BM), cdiv(N, BN)] (written)
    M, N,
    BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :] * stride_xn,
                mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale > 0.0, scale, 1.0)  # all zero, or so tiny that amax / 448 is 0
    v = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    # float32 -> e4m3fn bits, round to nearest even, in integer arithmetic
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = (bits & 0x7FFFFFFF).to(tl.int64)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    s = tl.minimum(141 - (a >> 23), 31)
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> s
    rem = m & ((tl.full(a.shape, 1, tl.int64) << s) - 1)
    half = tl.full(a.shape, 1, tl.int64) << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int64)
    code = tl.where(a >= 0x3C800000, normal, q) | sign
    tl.store(q_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], code.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + pid_m * tl.cdiv(N, BN) + pid_n, scale)


@triton.jit
def _dequantize_kernel(
    q_ptr,                 # *u8 [M, N] contiguous: fp8 bits (read)
    scale_ptr,             # *f32 [cdiv(M, BM), cdiv(N, BN)] (read)
    y_ptr,                 # output [M, N] contiguous, OUT_KIND 0 f32 / 1 bf16 bits / 2 f16
    M, N,
    BM: tl.constexpr, BN: tl.constexpr, OUT_KIND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    f = e4m3_to_f32(tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32))
    y = f * tl.load(scale_ptr + pid_m * tl.cdiv(N, BN) + pid_n)
    if OUT_KIND == 0:
        tl.store(y_ptr + offs, y, mask=mask)
    elif OUT_KIND == 1:  # bfloat16 bits, round to nearest even
        tl.store(y_ptr + offs, bf16_rne_bits(y.to(tl.int32, bitcast=True)), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(tl.float16), mask=mask)


def _as_2d(x: torch.Tensor, block: int, what: str) -> tuple[torch.Tensor, int, int]:
    if x.dim() == 2:
        return x, block, block
    if x.dim() == 1:
        return x.unsqueeze(0), 1, block
    raise ValueError(f"{what}: expected a 1-D or 2-D tensor, got shape {tuple(x.shape)}")


def check_block(block: int, what: str) -> None:
    """ValueError (prefixed with ``what``) unless ``block`` is a power of two >= 16."""
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"{what}: block must be a power of two >= 16, got {block}")


def scale_shape(shape: tuple[int, ...], block: int = DEFAULT_BLOCK) -> tuple[int, ...]:
    """Shape of the scale tensor for a weight of ``shape``."""
    return tuple(-(-d // block) for d in shape)


def quantize_fp8_ref(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_fp8` (torch's own float8 conversion)."""
    x2, bm, bn = _as_2d(x, block, "quantize_fp8")
    M, N = x2.shape
    mt, nt = -(-M // bm), -(-N // bn)
    xf = torch.zeros((mt * bm, nt * bn), dtype=torch.float32, device=x.device)
    xf[:M, :N] = x2.float()
    tiles = xf.view(mt, bm, nt, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # as the kernel
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(mt * bm, nt * bn)[:M, :N].contiguous()
    return q.view(x.shape), scale.view(scale_shape(tuple(x.shape), block))


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                       block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Torch reference of `dequantize_fp8`."""
    q2, bm, bn = _as_2d(q, block, "dequantize_fp8")
    if not q.numel():
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    s2 = scale.view(-1, scale.shape[-1]).float()
    full = s2.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:q2.shape[0], :q2.shape[1]]
    return (q2.float() * full).to(dtype).view(q.shape)


def quantize_fp8(x: torch.Tensor, *, block: int = DEFAULT_BLOCK,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to float8_e4m3fn with one float32 scale per block.

    Args:
        x: 1-D or 2-D bfloat16 / float16 / float32 tensor (any strides), finite.
        block: tile edge (power of two >= 16), 128 by default.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Returns:
        ``(q, scale)``: q float8_e4m3fn of x's shape (contiguous), scale float32
        of `scale_shape`.

    Raises:
        TypeError: unsupported dtype.  ValueError: not 1-D / 2-D, bad block.
    """
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"quantize_fp8: x has dtype {x.dtype}; supported: {list(_IN_DTYPES)}")
    check_block(block, "quantize_fp8")
    x2, bm, bn = _as_2d(x, block, "quantize_fp8")
    if choose_backend(backend, x, op="quantize_fp8") == "torch":
        return quantize_fp8_ref(x, block)
    M, N = x2.shape
    grid = (-(-M // bm), -(-N // bn))
    # allocated in their final shapes (a 1-D x's scales: the grid's one row); a view
    # costs the host as much as an allocation
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(grid[-x.dim():], dtype=torch.float32, device=x.device)
    if q.numel():
        _quantize_kernel[grid](x_ptr=x2, stride_xm=x2.stride(0), stride_xn=x2.stride(1),
                               q_ptr=q.view(torch.uint8), scale_ptr=scale, M=M, N=N, BM=bm, BN=bn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
                   block: int = DEFAULT_BLOCK, backend: str | None = None) -> torch.Tensor:
    """Inverse of `quantize_fp8`: ``float32(q) * scale`` per block, cast to ``dtype``.

    Args:
        q: float8_e4m3fn, 1-D or 2-D, contiguous.
        scale: float32 of ``scale_shape(q.shape, block)``.
        dtype: output dtype: float32, bfloat16 or float16.

    Raises:
        TypeError: wrong dtypes.  ValueError: wrong scale shape, not contiguous.
    """
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_fp8: q must be float8_e4m3fn, got {q.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"dequantize_fp8: scale must be float32, got {scale.dtype}")
    if dtype not in _OUT_KIND:
        raise TypeError(f"dequantize_fp8: output dtype {dtype} not in {list(_OUT_KIND)}")
    check_block(block, "dequantize_fp8")
    want = scale_shape(tuple(q.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_fp8: scale has shape {tuple(scale.shape)}, q of shape "
                         f"{tuple(q.shape)} needs {want}")
    if not q.is_contiguous() or not scale.is_contiguous():
        raise ValueError("dequantize_fp8: q and scale must be contiguous")
    q2, bm, bn = _as_2d(q, block, "dequantize_fp8")
    if choose_backend(backend, q, scale, op="dequantize_fp8") == "torch":
        return dequantize_fp8_ref(q, scale, dtype, block)
    M, N = q2.shape
    y = torch.empty(q.shape, dtype=dtype, device=q.device)  # contiguous: as [M, N]
    out = y.view(torch.int16) if dtype == torch.bfloat16 else y
    if y.numel():
        _dequantize_kernel[(-(-M // bm), -(-N // bn))](
            q_ptr=q.view(torch.uint8), scale_ptr=scale, y_ptr=out, M=M, N=N,
            BM=bm, BN=bn, OUT_KIND=_OUT_KIND[dtype])
    return y


def aot_specs() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) for the Hopper compile check."""
    specs: list[tuple[object, dict[str, str], dict[str, int]]] = []
    for xt in ("*bf16", "*fp32", "*fp16"):
        specs.append((_quantize_kernel,
                      {"x_ptr": xt, "stride_xm": "i64", "stride_xn": "i64", "q_ptr": "*u8",
                       "scale_ptr": "*fp32", "M": "i32", "N": "i32",
                       "BM": "constexpr", "BN": "constexpr"},
                      {"BM": DEFAULT_BLOCK, "BN": DEFAULT_BLOCK}))
    for kind, yt in ((0, "*fp32"), (1, "*i16"), (2, "*fp16")):
        specs.append((_dequantize_kernel,
                      {"q_ptr": "*u8", "scale_ptr": "*fp32", "y_ptr": yt, "M": "i32", "N": "i32",
                       "BM": "constexpr", "BN": "constexpr", "OUT_KIND": "constexpr"},
                      {"BM": DEFAULT_BLOCK, "BN": DEFAULT_BLOCK, "OUT_KIND": kind}))
    return specs
