"""Resharding: planner properties (hypothesis) and the one-launch executor vs torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def oracle_split(layout: Layout, full: torch.Tensor) -> list[torch.Tensor]:
    """Shards written directly with torch ops, independent of the planner."""
    tp = layout.tp
    if isinstance(layout, Replicated):
        return [full.clone() for _ in range(tp)]
    if isinstance(layout, Sharded):
        if layout.sizes is not None:
            return list(torch.split(full, list(layout.sizes), dim=layout.dim))
        return list(torch.tensor_split(full, tp, dim=layout.dim))
    if isinstance(layout, FusedQKV):
        nh, nkv, hd = layout.num_heads, layout.num_kv_heads, layout.head_dim
        q, k, v = full.split([nh * hd, nkv * hd, nkv * hd])
        qs = q.chunk(tp)
        if nkv >= tp:
            ks, vs = k.chunk(tp), v.chunk(tp)
        else:
            rep = tp // nkv
            ks = [k.reshape(nkv, hd, -1)[r // rep] for r in range(tp)]
            vs = [v.reshape(nkv, hd, -1)[r // rep] for r in range(tp)]
        return [torch.cat([qs[r], ks[r], vs[r]]) for r in range(tp)]
    if isinstance(layout, FusedGateUp):
        g, u = full.chunk(2)
        gs, us = torch.tensor_split(g, tp), torch.tensor_split(u, tp)
        return [torch.cat([gs[r], us[r]]) for r in range(tp)]
    if isinstance(layout, VocabParallel):
        per = layout.shard_shape(full.shape, 0)[0]
        padded = torch.zeros(per * tp, full.shape[1], dtype=full.dtype)
        padded[:full.shape[0]] = full
        return list(padded.chunk(tp))
    raise AssertionError(layout)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["sharded", "uneven", "replicated", "qkv", "gateup", "vocab"]))
    m, n = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    cols = draw(st.integers(1, 19))
    if kind == "qkv":
        m, n = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
        nkv = draw(st.sampled_from([1, 2, 4, 8]))
        nh = nkv * draw(st.integers(1, 2)) * max(1, 8 // nkv)
        hd = draw(st.integers(1, 4))
        src, dst = FusedQKV(m, nh, nkv, hd), FusedQKV(n, nh, nkv, hd)
        shape = ((nh + 2 * nkv) * hd, cols)
    elif kind == "gateup":
        shape = (2 * draw(st.integers(0, 23)), cols)
        src, dst = FusedGateUp(m), FusedGateUp(n)
    elif kind == "vocab":
        shape = (draw(st.integers(1, 70)), cols)
        pad = draw(st.sampled_from([1, 8, 16]))
        src, dst = VocabParallel(m, pad), VocabParallel(n, pad)
    elif kind == "uneven":
        dim = draw(st.integers(0, 1))
        shape = (draw(st.integers(1, 29)), cols)
        extent = shape[dim]
        cuts = sorted(draw(st.lists(st.integers(0, extent), min_size=m - 1, max_size=m - 1)))
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent], strict=True))
        src, dst = Sharded(m, dim, sizes), Sharded(n, draw(st.integers(0, 1)))
    else:
        shape = (draw(st.integers(1, 29)), cols)
        src = Sharded(m, draw(st.integers(0, 1))) if kind == "sharded" else Replicated(m)
        dst = draw(st.sampled_from([Sharded(n, 0), Sharded(n, 1), Replicated(n)]))
    if draw(st.booleans()):
        src, dst = dst, src
    return src, dst, shape


def _check_round_trip(src, dst, shape, backend, seed=0):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    plan = plan_reshard(src, dst, shape)
    out = reshard(plan, oracle_split(src, full), backend=backend)
    expect = oracle_split(dst, full)
    for r, (a, b) in enumerate(zip(out, expect, strict=True)):
        assert torch.equal(a, b), f"destination shard {r}"
    back = reshard(plan_reshard(dst, Replicated(1), shape), out, backend=backend)[0]
    assert torch.equal(back, full)
    # every destination element that holds data is written exactly once
    assert plan.num_elements == sum(p.numel() for p in expect) - _padding(dst, shape)


def _padding(layout, shape):
    if isinstance(layout, VocabParallel):
        return layout.tp * layout.shard_shape(shape, 0)[0] * shape[1] - shape[0] * shape[1]
    return 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_shard_reshard_gather_reproduces_the_original_torch(case):
    _check_round_trip(*case, backend="torch")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_shard_reshard_gather_reproduces_the_original_triton(case):
    _check_round_trip(*case, backend="triton")


@settings(max_examples=80, deadline=None)
@given(cases())
def test_source_ownership_is_a_partition(case):
    src, _, shape = case
    rows, cols = shape
    cover = torch.zeros(rows, cols, dtype=torch.int32)
    for p in src.owned(shape):
        cover[p.r0:p.r1, p.c0:p.c1] += 1
    assert torch.all(cover == 1)


@pytest.mark.parametrize("src,dst,shape", [
    (FusedQKV(8, 8, 2, 2), FusedQKV(2, 8, 2, 2), (24, 5)),     # kv heads replicated on source
    (FusedQKV(1, 8, 2, 2), FusedQKV(4, 8, 2, 2), (24, 5)),     # kv heads replicated on dest
    (FusedQKV(2, 16, 4, 3), FusedQKV(8, 16, 4, 3), (72, 7)),
    (Sharded(8, 0), Sharded(3, 0), (37, 13)),                  # uneven both sides
    (Sharded(3, 1), Sharded(5, 0), (37, 13)),                  # dim 1 -> dim 0
    (Sharded(3, 0, (0, 30, 7)), Replicated(2), (37, 5)),       # empty shard
    (FusedGateUp(3), FusedGateUp(2), (2 * 11, 6)),
    (VocabParallel(4, 16), VocabParallel(3, 8), (61, 5)),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_named_reshards_match_torch_shards(src, dst, shape, backend):
    _check_round_trip(src, dst, shape, backend)


def test_tp8_to_tp4_llama_qkv_with_cast_to_bf16():
    src, dst = FusedQKV(8, 64, 8, 8), FusedQKV(4, 64, 8, 8)
    shape = ((64 + 16) * 8, 37)
    full = torch.randn(shape)
    plan = plan_reshard(src, dst, shape)
    out = reshard(plan, oracle_split(src, full), dtype=torch.bfloat16, backend="triton")
    for a, b in zip(out, oracle_split(dst, full.to(torch.bfloat16)), strict=True):
        assert torch.equal(a, b)


def test_replicated_source_is_striped_over_ranks():
    plan = plan_reshard(Replicated(4), Sharded(1, 0), (8, 3))
    assert sorted(s.src_rank for s in plan.segments) == [0, 1, 2, 3]


def test_1d_tensors_and_1d_shards():
    full = torch.arange(10.0)
    plan = plan_reshard(Sharded(3, 0), Sharded(2, 0), (10,))
    out = reshard(plan, list(torch.tensor_split(full, 3)), backend="triton")
    assert torch.equal(torch.cat([o.view(-1) for o in out]), full)


def test_plan_rejects_overlapping_and_out_of_range_segments():
    with pytest.raises(ValueError, match="overlap in destination shard 0"):
        ReshardPlan(Replicated(1), Replicated(1), (4, 4),
                    (Segment(0, 0, 0, 0, 0, 0, 2, 2), Segment(0, 0, 0, 0, 1, 1, 2, 2)))
    with pytest.raises(ValueError, match="outside destination shard 0"):
        ReshardPlan(Replicated(1), Replicated(1), (4, 4), (Segment(0, 0, 0, 0, 3, 0, 2, 2),))


def test_layouts_reject_shapes_they_do_not_fit():
    with pytest.raises(ValueError, match="tp=3 must divide num_heads=8"):
        FusedQKV(3, 8, 2, 4)
    with pytest.raises(ValueError, match="needs 48 rows"):
        plan_reshard(FusedQKV(2, 8, 2, 4), Replicated(1), (40, 4))
    with pytest.raises(ValueError, match="sum to 5"):
        plan_reshard(Sharded(2, 0, (2, 3)), Replicated(1), (6, 2))
    with pytest.raises(ValueError, match="1-D or 2-D"):
        plan_reshard(Replicated(1), Replicated(1), (2, 2, 2))
    with pytest.raises(ValueError, match="non-negative ints"):
        Sharded(2, 0, (2.5, 2.5))
    for pad_to in (0, -8):  # -8 used to plan 8 of 10 rows; 0 divided by zero
        with pytest.raises(ValueError, match="pad_to must be a positive int"):
            VocabParallel(2, pad_to)


def test_reshard_rejects_wrong_shards():
    plan = plan_reshard(Sharded(2, 0), Replicated(1), (6, 2))
    with pytest.raises(ValueError, match="1 source shards given, layout has 2"):
        reshard(plan, [torch.zeros(6, 2)])
    with pytest.raises(ValueError, match="source shard 1 has shape"):
        reshard(plan, [torch.zeros(3, 2), torch.zeros(4, 2)])
    with pytest.raises(TypeError, match="mix dtypes"):
        reshard(plan, [torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.float64)])
    with pytest.raises(TypeError, match="destination shard 0"):
        reshard(plan, [torch.zeros(3, 2)] * 2, [torch.zeros(6, 2, dtype=torch.int32)])


def test_split_tensor_gives_each_ranks_shard_of_a_whole_tensor():
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert [s.tolist() for s in split_tensor(full, Sharded(tp=2, dim=1), backend="torch")] == \
        [full[:, :3].tolist(), full[:, 3:].tolist()]
    assert [tuple(s.shape) for s in split_tensor(torch.ones(5), Sharded(tp=2))] == [(3, 1), (2, 1)]
