"""Float conversions in integer arithmetic, shared by the Triton kernels.

Each helper is a `@triton.jit` function called from inside a kernel. Doing
these conversions on integer bits (rather than with the hardware or numpy
casts) makes the Triton interpreter and the GPU produce the same bits as
torch's own conversions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rne_bits(bits):
    """bfloat16 bits (int16) of float32 bits ``bits`` (int32), round to nearest even.

    A NaN stays a NaN (quiet bit set); infinities and overflow give infinity.
    """
    b = bits.to(tl.int64) & 0xFFFFFFFF
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def e4m3_to_f32(code):
    """float32 value of float8_e4m3fn codes ``code`` (int32, 0..255), exact.

    Codes 0x7F and 0xFF (the format's only NaNs) give a NaN; 0x80 gives -0.0.
    """
    e = (code >> 3) & 0xF
    mant = code & 7
    normal = ((code & 0x80) << 24) | ((e + 120) << 23) | (mant << 20)
    normal = tl.where((code & 0x7F) == 0x7F, 0x7FC00000, normal)
    # e == 0: mant * 2**-9 (exact), then the sign bit set directly: Triton before 3.7
    # compiles a float `-x` as `0 - x`, which turns -0.0 into +0.0
    sub = (mant.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | ((code & 0x80) << 24)
    return tl.where(e == 0, sub, normal).to(tl.float32, bitcast=True)
