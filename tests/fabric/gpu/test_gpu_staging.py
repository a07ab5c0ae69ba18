"""Receive-path reshard and fp8 dequant on a GPU (Triton kernels), staged and direct, vs torch."""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.gpu.probe import probe
from weightfabric.fabric.relayout.direct import plan_direct, run_direct
from weightfabric.fabric.relayout.staging import HeldTensor, WantedTensor, plan_staging, run_staging
from weightfabric.kernels import (
    Fp8Segment,
    FusedQKV,
    Sharded,
    dequantize_fp8_ref,
    dequantize_fp8_segments,
    dequantize_fp8_segments_ref,
    plan_reshard,
    quantize_fp8_ref,
    reshard,
)

MISSING_CUDA = probe().missing("cuda")
pytestmark = pytest.mark.skipif(MISSING_CUDA is not None, reason=str(MISSING_CUDA))


def regions_reader(regions: list[torch.Tensor]):
    def read(rank: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(regions[rank][offset:offset + out.numel()])
    return read


def test_tp2_to_tp1_fused_qkv_on_gpu_matches_torch_bit_for_bit():
    nh, nkv, hd, hidden = 32, 8, 128, 4096
    src, dst = FusedQKV(tp=2, num_heads=nh, num_kv_heads=nkv, head_dim=hd), FusedQKV(
        tp=1, num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    shape = ((nh + 2 * nkv) * hd, hidden)
    full = torch.randn(shape, device="cuda").to(torch.bfloat16)
    shards = reshard(plan_reshard(dst, src, shape), [full], backend="torch")
    regions = [s.contiguous().view(-1).view(torch.uint8) for s in shards]
    held = HeldTensor(name="qkv", shape=shape, layout=src, dtype=torch.bfloat16, offsets=(0, 0))
    plan = plan_staging([held], [WantedTensor(name="qkv", layout=dst, dtype=torch.bfloat16)],
                        rank=0, budget=8 << 20)
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    stats = run_staging(plan, regions_reader(regions), {"qkv": out})
    assert torch.equal(out.view(torch.int16), full.view(torch.int16))
    assert stats.peak_bytes <= 8 << 20 and len(plan.bands) > 2


def test_fp8_tp2_to_tp1_dequant_on_gpu_matches_torch_reference():
    rows, cols = 2 * 2048, 5000
    src, dst = Sharded(tp=2, dim=0), Sharded(tp=1, dim=0)
    full = torch.randn(rows, cols, device="cuda")
    regions, offsets, scale_offsets, deq = [], [], [], []
    for shard in full.chunk(2):
        q, s = quantize_fp8_ref(shard)
        qb, sb = q.view(-1).view(torch.uint8), s.view(-1).view(torch.uint8)
        regions.append(torch.cat([qb, torch.zeros(256 - qb.numel() % 256, dtype=torch.uint8,
                                                  device="cuda"), sb]))
        offsets.append(0)
        scale_offsets.append(qb.numel() + 256 - qb.numel() % 256)
        deq.append(dequantize_fp8_ref(q, s, torch.bfloat16))
    held = HeldTensor(name="w", shape=(rows, cols), layout=src, dtype=torch.float8_e4m3fn,
                      offsets=tuple(offsets), scale_offsets=tuple(scale_offsets))
    plan = plan_staging([held], [WantedTensor(name="w", layout=dst, dtype=torch.bfloat16)],
                        rank=0, budget=16 << 20)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    run_staging(plan, regions_reader(regions), {"w": out})
    ref = reshard(plan_reshard(src, dst, (rows, cols)), deq, backend="torch")[0]
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_fused_fp8_windows_on_gpu_match_torch_reference():
    block = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, s = quantize_fp8_ref(torch.randn(3000, 5000, device="cuda", generator=g))
    # unaligned windows, every output dtype, a transposed destination
    outs = [torch.empty(1000, 2000, device="cuda"),
            torch.empty(777, 4321, dtype=torch.bfloat16, device="cuda"),
            torch.empty(300, 129, dtype=torch.float16, device="cuda").t()]
    corners = [(5, 7), (2200, 600), (1, 4700)]
    segments = [Fp8Segment(q, s, o, row=r, col=c, block=block)
                for o, (r, c) in zip(outs, corners, strict=True)]
    refs = [torch.empty_like(o) for o in outs]
    dequantize_fp8_segments(segments)  # Triton: CUDA tensors
    dequantize_fp8_segments_ref([Fp8Segment(q, s, r, row=a.row, col=a.col, block=block)
                                 for r, a in zip(refs, segments, strict=True)])
    for o, r in zip(outs, refs, strict=True):
        bits = torch.int32 if o.dtype == torch.float32 else torch.int16
        assert torch.equal(o.contiguous().view(bits), r.contiguous().view(bits))


def test_direct_read_on_gpu_equals_staging_for_fp8_and_bf16_tp2_to_tp1():
    rows, cols = 2 * 2048, 5000
    src, dst = Sharded(tp=2, dim=0), Sharded(tp=1, dim=0)
    full = torch.randn(rows, cols, device="cuda")
    regions, offsets, scale_offsets = [], [], []
    for shard in full.chunk(2):
        q, s = quantize_fp8_ref(shard)
        qb, sb = q.view(-1).view(torch.uint8), s.view(-1).view(torch.uint8)
        wb = shard.to(torch.bfloat16).view(-1).view(torch.uint8)
        regions.append(torch.cat([qb, sb, wb]))
        offsets.append((0, qb.numel() + sb.numel()))
        scale_offsets.append(qb.numel())
    held = [HeldTensor(name="w8", shape=(rows, cols), layout=src, dtype=torch.float8_e4m3fn,
                       offsets=tuple(o[0] for o in offsets), scale_offsets=tuple(scale_offsets)),
            HeldTensor(name="w", shape=(rows, cols), layout=src, dtype=torch.bfloat16,
                       offsets=tuple(o[1] for o in offsets))]
    wanted = [WantedTensor(name=h.name, layout=dst, dtype=torch.bfloat16) for h in held]
    plan = plan_direct(held, wanted, rank=0)
    direct = {h.name: torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda") for h in held}
    staged = {h.name: torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda") for h in held}
    stats = run_direct(plan, dict(enumerate(regions)), direct)
    run_staging(plan_staging(held, wanted, rank=0, budget=16 << 20), regions_reader(regions), staged)
    torch.cuda.synchronize()
    assert stats.launches == 2
    for name in direct:
        assert torch.equal(direct[name].view(torch.int16), staged[name].view(torch.int16)), name
    assert torch.equal(direct["w"], full.to(torch.bfloat16))
