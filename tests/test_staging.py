"""Receive-path transforms: bounded staging plans, and reshard/dequant bit for bit vs torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric.staging import HeldTensor, WantedTensor, plan_staging, run_staging
from kernels import (
    FusedGateUp,
    FusedQKV,
    Layout,
    Replicated,
    Sharded,
    dequantize_fp8_ref,
    plan_reshard,
    quantize_fp8_ref,
    reshard,
)

# GQA: 8 query heads, 2 kv heads, head_dim 4 -> 48 rows
NH, NKV, HD, HIDDEN, INTER = 8, 2, 4, 19, 13


def oracle_split(layout: Layout, full: torch.Tensor) -> list[torch.Tensor]:
    """Shards written with plain torch ops, independent of the planner."""
    tp = layout.tp
    if isinstance(layout, Replicated):
        return [full.clone() for _ in range(tp)]
    if isinstance(layout, Sharded):
        return [t.contiguous() for t in torch.tensor_split(full, tp, dim=layout.dim)]
    if isinstance(layout, FusedQKV):
        q, k, v = full.split([NH * HD, NKV * HD, NKV * HD])
        rep = max(1, tp // NKV)
        ks = [k.reshape(NKV, HD, -1)[r // rep] if tp > NKV else k.chunk(tp)[r] for r in range(tp)]
        vs = [v.reshape(NKV, HD, -1)[r // rep] if tp > NKV else v.chunk(tp)[r] for r in range(tp)]
        return [torch.cat([q.chunk(tp)[r], ks[r], vs[r]]) for r in range(tp)]
    if isinstance(layout, FusedGateUp):
        g, u = full.chunk(2)
        return [torch.cat([a, b]) for a, b in zip(torch.tensor_split(g, tp), torch.tensor_split(u, tp),
                                                  strict=True)]
    raise AssertionError(layout)


class Holder:
    """Source ranks' regions (flat uint8 CPU tensors) with the shards packed at offsets."""

    def __init__(self, tp: int) -> None:
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(tp)]
        self.cursor = [96] * tp  # leave a gap so offsets are exercised
        self.reads: list[tuple[int, int, int]] = []

    def put(self, rank: int, t: torch.Tensor) -> int:
        at = self.cursor[rank]
        raw = t.contiguous().view(-1).view(torch.uint8) if t.dim() else t.view(torch.uint8)
        self.parts[rank].append((at, raw))
        self.cursor[rank] = at + raw.numel() + 40
        return at

    def regions(self) -> list[torch.Tensor]:
        out = []
        for rank, parts in enumerate(self.parts):
            region = torch.full((self.cursor[rank],), 0xAB, dtype=torch.uint8)
            for at, raw in parts:
                region[at:at + raw.numel()] = raw
            out.append(region)
        return out

    def reader(self):
        regions = self.regions()

        def read(rank: int, offset: int, out: torch.Tensor) -> None:
            assert out.dtype == torch.uint8 and out.is_contiguous()
            self.reads.append((rank, offset, out.numel()))
            out.copy_(regions[rank][offset:offset + out.numel()])
        return read


def hold(holder: Holder, name: str, full: torch.Tensor, layout: Layout) -> HeldTensor:
    offsets = tuple(holder.put(r, s) for r, s in enumerate(oracle_split(layout, full)))
    return HeldTensor(name=name, shape=tuple(full.shape), layout=layout, dtype=full.dtype,
                      offsets=offsets)


def model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"qkv": torch.randn((NH + 2 * NKV) * HD, HIDDEN, generator=g).to(dtype),
            "gate_up": torch.randn(2 * INTER, HIDDEN, generator=g).to(dtype),
            "down": torch.randn(HIDDEN, INTER, generator=g).to(dtype),
            "norm": torch.randn(HIDDEN, generator=g).to(dtype)}


def layouts(tp: int) -> dict[str, Layout]:
    return {"qkv": FusedQKV(tp=tp, num_heads=NH, num_kv_heads=NKV, head_dim=HD),
            "gate_up": FusedGateUp(tp=tp), "down": Sharded(tp=tp, dim=1), "norm": Replicated(tp=tp)}


def fetch(m: int, n: int, rank: int, budget: int, backend: str | None = None):
    weights = model()
    holder = Holder(m)
    held = [hold(holder, name, t, layouts(m)[name]) for name, t in weights.items()]
    wanted = [WantedTensor(name=name, layout=layouts(n)[name], dtype=t.dtype)
              for name, t in weights.items()]
    plan = plan_staging(held, wanted, rank=rank, budget=budget)
    dst = {name: torch.full(plan.dst_shapes[name], float("nan"), dtype=t.dtype).view(
        oracle_split(layouts(n)[name], t)[rank].shape) for name, t in weights.items()}
    stats = run_staging(plan, holder.reader(), dst, backend=backend)
    return weights, plan, stats, dst, holder


@pytest.mark.parametrize("budget", [1 << 20, 200, 38])
def test_tp2_to_tp1_with_fused_qkv_gqa_and_gate_up_is_bit_exact(budget):
    weights, plan, stats, dst, _ = fetch(2, 1, 0, budget)
    for name, t in weights.items():
        assert torch.equal(dst[name].view(torch.int16), t.view(torch.int16)), name
    assert stats.peak_bytes == plan.peak_bytes <= budget
    assert stats.staging_allocated <= budget


@pytest.mark.parametrize("rank", [0, 1])
def test_tp1_to_tp2_each_rank_gets_its_shard_bit_exact(rank):
    weights, plan, _, dst, _ = fetch(1, 2, rank, 100)
    for name, t in weights.items():
        want = oracle_split(layouts(2)[name], t)[rank]
        assert torch.equal(dst[name].view(torch.int16), want.view(torch.int16)), name
    # a TP2 reader of a TP1 holder reads only its half of every sharded tensor
    assert plan.fetched_bytes < sum(t.numel() * 2 for t in weights.values())


def test_triton_backend_under_the_interpreter_matches_torch():
    weights, _, _, dst, _ = fetch(2, 4, 3, 300, backend="triton")
    for name, t in weights.items():
        want = oracle_split(layouts(4)[name], t)[3]
        assert torch.equal(dst[name].view(torch.int16), want.view(torch.int16)), name


def test_a_tensor_larger_than_the_budget_is_split_into_row_bands():
    _, plan, stats, _, holder = fetch(2, 1, 0, 3 * HIDDEN * 2)
    qkv = [b for b in plan.bands if b.name == "qkv"]
    assert all(b.rows <= 3 for b in qkv) and len(qkv) >= 48 // 3
    assert stats.bands == len(plan.bands)
    assert max(nbytes for _, _, nbytes in holder.reads) <= plan.budget
    assert sum(nbytes for _, _, nbytes in holder.reads) == plan.fetched_bytes == stats.fetched_bytes


def test_budget_smaller_than_one_row_is_a_clear_error():
    weights = model()
    holder = Holder(2)
    held = [hold(holder, "down", weights["down"], Sharded(tp=2, dim=1))]
    wanted = [WantedTensor(name="down", layout=Sharded(tp=1, dim=1), dtype=torch.bfloat16)]
    row = (INTER - INTER // 2) * 2  # widest source shard row, bf16
    with pytest.raises(ValueError, match=r"budget of 13 bytes is smaller than one row band of "
                                         r"tensor 'down'.*raise the budget"):
        plan_staging(held, wanted, rank=0, budget=13)
    assert plan_staging(held, wanted, rank=0, budget=row).peak_bytes == row


def test_fp8_holder_dequantises_to_bf16_bit_exact_with_torch_reference():
    block, rows, cols = 16, 2 * 40, 37  # edge tiles in both dims
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) * 5
    src_layout, dst_layout = Sharded(tp=2, dim=0), Sharded(tp=1, dim=0)
    holder = Holder(2)
    offsets, scale_offsets, deq = [], [], []
    for r, shard in enumerate(oracle_split(src_layout, full)):
        q, s = quantize_fp8_ref(shard, block)
        offsets.append(holder.put(r, q.view(torch.uint8)))
        scale_offsets.append(holder.put(r, s))
        deq.append(dequantize_fp8_ref(q, s, torch.bfloat16, block))
    held = HeldTensor(name="w", shape=(rows, cols), layout=src_layout, dtype=torch.float8_e4m3fn,
                      offsets=tuple(offsets), scale_offsets=tuple(scale_offsets), block=block)
    wanted = WantedTensor(name="w", layout=dst_layout, dtype=torch.bfloat16)
    ref = reshard(plan_reshard(src_layout, dst_layout, (rows, cols)), deq, backend="torch")[0]
    for budget in (1 << 20, 2500):
        plan = plan_staging([held], [wanted], rank=0, budget=budget)
        out = torch.zeros(rows, cols, dtype=torch.bfloat16)
        stats = run_staging(plan, holder.reader(), {"w": out})
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
        assert stats.peak_bytes <= budget
        assert all(b.row0 % block == 0 for b in plan.bands)
    assert len(plan.bands) > 2  # the small budget forced several bands per shard
    with pytest.raises(ValueError, match="one row band of tensor 'w' \\(16 row"):
        plan_staging([held], [wanted], rank=0, budget=1000)


def test_fp8_gate_up_tp2_to_tp1_dequantises_through_the_interpreter():
    block = 16
    full = torch.randn(2 * 24, 20, generator=torch.Generator().manual_seed(5))
    src_layout, dst_layout = FusedGateUp(tp=2), FusedGateUp(tp=1)
    holder = Holder(2)
    offsets, scale_offsets, deq = [], [], []
    for r, shard in enumerate(oracle_split(src_layout, full)):
        q, s = quantize_fp8_ref(shard, block)
        offsets.append(holder.put(r, q.view(torch.uint8)))
        scale_offsets.append(holder.put(r, s))
        deq.append(dequantize_fp8_ref(q, s, torch.float32, block))
    held = HeldTensor(name="gu", shape=tuple(full.shape), layout=src_layout,
                      dtype=torch.float8_e4m3fn, offsets=tuple(offsets),
                      scale_offsets=tuple(scale_offsets), block=block)
    plan = plan_staging([held], [WantedTensor(name="gu", layout=dst_layout, dtype=torch.float32)],
                        rank=0, budget=1 << 16)
    out = torch.zeros(full.shape)
    run_staging(plan, holder.reader(), {"gu": out}, backend="triton")
    ref = reshard(plan_reshard(src_layout, dst_layout, tuple(full.shape)), deq, backend="torch")[0]
    assert torch.equal(out, ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.sampled_from([1, 2, 4]), n=st.sampled_from([1, 2, 4]), data=st.data())
def test_staging_never_exceeds_the_budget_and_fills_every_element(m, n, data):
    rank = data.draw(st.integers(0, n - 1))
    budget = data.draw(st.integers(38, 4000))  # widest source row: 19 bf16 columns
    weights, plan, stats, dst, holder = fetch(m, n, rank, budget)
    assert plan.peak_bytes <= budget and stats.staging_allocated <= budget
    assert max(nbytes for _, _, nbytes in holder.reads) <= budget
    for name, t in weights.items():
        want = oracle_split(layouts(n)[name], t)[rank]
        assert torch.equal(dst[name].view(torch.int16), want.view(torch.int16)), name


def test_mismatched_tensor_sets_and_bad_destinations_are_errors():
    held = [HeldTensor(name="a", shape=(4, 4), layout=Sharded(tp=1), dtype=torch.float32,
                       offsets=(0,))]
    with pytest.raises(ValueError, match="must name the same set"):
        plan_staging(held, [WantedTensor(name="b", layout=Sharded(tp=1), dtype=torch.float32)],
                     rank=0, budget=64)
    with pytest.raises(ValueError, match="rank 2 outside"):
        plan_staging(held, [WantedTensor(name="a", layout=Sharded(tp=2), dtype=torch.float32)],
                     rank=2, budget=64)
    with pytest.raises(TypeError, match="tensor 'a'"):
        plan_staging(held, [WantedTensor(name="a", layout=Sharded(tp=1), dtype=torch.int32)],
                     rank=0, budget=64)
    plan = plan_staging(held, [WantedTensor(name="a", layout=Sharded(tp=1), dtype=torch.float32)],
                        rank=0, budget=64)
    with pytest.raises(ValueError, match="no destination tensor for 'a'"):
        run_staging(plan, lambda *a: None, {})
    with pytest.raises(ValueError, match="needs \\(4, 4\\)"):
        run_staging(plan, lambda *a: None, {"a": torch.zeros(4, 5)})
    with pytest.raises(ValueError, match="offsets"):
        HeldTensor(name="x", shape=(4, 4), layout=Sharded(tp=2), dtype=torch.float32, offsets=(0,))
