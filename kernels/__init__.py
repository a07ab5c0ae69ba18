"""Triton kernels for moving weights, each with a pure-torch reference.

Every public kernel function takes ``backend="triton" | "torch" | None``; None runs
Triton on CUDA tensors and the torch reference elsewhere (see `kernels.dispatch`).
"""

from weightfabric.kernels.checksum import chunk_checksums, chunk_checksums_ref, copy_with_checksums
from weightfabric.kernels.delta import (
    DeltaFormatError,
    DeltaInfo,
    changed_words,
    decode_delta,
    decode_delta_ref,
    delta_info,
    encode_delta,
    encode_delta_ref,
)
from weightfabric.kernels.dequant_segments import (
    Fp8Segment,
    dequantize_fp8_segments,
    dequantize_fp8_segments_ref,
)
from weightfabric.kernels.dispatch import choose_backend, interpreting
from weightfabric.kernels.fp8 import (
    dequantize_fp8,
    dequantize_fp8_ref,
    quantize_fp8,
    quantize_fp8_ref,
    scale_shape,
)
from weightfabric.kernels.layout import PackLayout, Slot, plan_layout
from weightfabric.kernels.pack import pack, pack_ref, pack_with_checksums, unpack, unpack_ref
from weightfabric.kernels.reshard import reshard, split_tensor
from weightfabric.kernels.reshard_plan import (
    FusedGateUp,
    FusedQKV,
    Layout,
    Replicated,
    ReshardPlan,
    Segment,
    Sharded,
    VocabParallel,
    plan_reshard,
)
from weightfabric.kernels.segcopy import SUPPORTED_CASTS, copy_segments, copy_segments_ref

__all__ = [
    "DeltaFormatError",
    "DeltaInfo",
    "Fp8Segment",
    "FusedGateUp",
    "FusedQKV",
    "Layout",
    "Replicated",
    "ReshardPlan",
    "Segment",
    "Sharded",
    "VocabParallel",
    "plan_reshard",
    "reshard",
    "split_tensor",
    "SUPPORTED_CASTS",
    "PackLayout",
    "Slot",
    "choose_backend",
    "changed_words",
    "chunk_checksums",
    "chunk_checksums_ref",
    "copy_segments",
    "copy_with_checksums",
    "copy_segments_ref",
    "decode_delta",
    "decode_delta_ref",
    "delta_info",
    "dequantize_fp8",
    "dequantize_fp8_ref",
    "dequantize_fp8_segments",
    "dequantize_fp8_segments_ref",
    "encode_delta",
    "encode_delta_ref",
    "interpreting",
    "pack",
    "pack_ref",
    "pack_with_checksums",
    "plan_layout",
    "quantize_fp8",
    "quantize_fp8_ref",
    "scale_shape",
    "unpack",
    "unpack_ref",
]
