"""Resharding: planner properties (hypothesis) and the one-launch executor vs torch."""

from __future__ import annotations

import importlib

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
from weightfabric.kernels.segcopy import CheckCache


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


# --- checks and tables cached per call key ------------------------------------------------------

reshard_module = importlib.import_module("weightfabric.kernels.reshard")  # the name is the function's


def _counting(monkeypatch) -> tuple[list[str], list[int]]:
    """From an empty check cache: the sides `_as_2d` checks, and each table built (its block)."""
    monkeypatch.setattr(reshard_module, "_CHECKED", CheckCache())
    sides: list[str] = []
    builds: list[int] = []
    as_2d, table = reshard_module._as_2d, reshard_module._table

    def counted_as_2d(shards, shapes, side):
        sides.append(side)
        return as_2d(shards, shapes, side)

    def counted_table(plan, src, dst, block):
        builds.append(block)
        return table(plan, src, dst, block)

    monkeypatch.setattr(reshard_module, "_as_2d", counted_as_2d)
    monkeypatch.setattr(reshard_module, "_table", counted_table)
    return sides, builds


def _qkv_case() -> tuple[ReshardPlan, list[torch.Tensor], torch.Tensor]:
    src_layout, shape = FusedQKV(2, 8, 2, 4), ((8 + 2 * 2) * 4, 9)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    plan = plan_reshard(src_layout, FusedQKV(4, 8, 2, 4), shape)
    return plan, [t.contiguous() for t in oracle_split(src_layout, full)], full


def _assert_resharded(plan: ReshardPlan, full: torch.Tensor, dst: list[torch.Tensor]) -> None:
    """``dst`` holds the oracle's shards of ``full``, bit for bit."""
    for got, want in zip(dst, oracle_split(plan.dst, full), strict=True):
        bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
        assert torch.equal(got.contiguous().view(bits), want.to(got.dtype).view(bits))


def test_a_repeat_reshard_skips_the_checks_and_reuses_the_table(monkeypatch):
    sides, builds = _counting(monkeypatch)
    plan, src, full = _qkv_case()
    dst = [torch.full(s, float("nan")) for s in plan.dst_shapes]
    reshard(plan, src, dst, backend="triton")
    for t in (*src, full):
        t.mul_(-3)  # same key, new values: the cached table moves the new ones
    out = reshard(plan, src, dst, backend="triton")
    assert sides == ["source", "destination"] and builds == [reshard_module.DEFAULT_BLOCK]
    assert all(a is b for a, b in zip(out, dst, strict=True))
    _assert_resharded(plan, full, dst)
    reshard(plan, src, [t.fill_(0) for t in dst], backend="triton", block=64)  # another table
    assert sides == ["source", "destination"] and builds[1:] == [64]
    _assert_resharded(plan, full, dst)


def test_a_changed_reshard_is_checked_again(monkeypatch):
    sides, _ = _counting(monkeypatch)
    plan, src, full = _qkv_case()
    dst = [torch.zeros(s) for s in plan.dst_shapes]
    reshard(plan, src, dst, backend="triton")
    other = [torch.zeros(s) for s in plan.dst_shapes]  # other tensors of the same shapes
    reshard(plan, src, other, backend="triton")
    strided = [torch.zeros(s[::-1]).t() for s in plan.dst_shapes]  # same shapes, other strides
    reshard(plan, src, strided, backend="triton")
    cast = [torch.zeros(s, dtype=torch.bfloat16) for s in plan.dst_shapes]  # another dtype
    reshard(plan, src, cast, backend="triton")
    equal_plan = plan_reshard(plan.src, plan.dst, plan.shape)  # an equal, other plan object
    reshard(equal_plan, src, dst, backend="triton")
    assert sides.count("destination") == 5
    for out in (dst, other, strided, cast):
        _assert_resharded(plan, full, out)
    # the addresses, shapes and strides of a checked call, one of them another dtype or shape:
    # the errors of a first call
    with pytest.raises(TypeError, match="destination shard 1: cannot cast"):
        reshard(plan, src, [dst[0], dst[1].view(torch.int32), *dst[2:]], backend="triton")
    with pytest.raises(ValueError, match="source shard 1 has shape \\(24, 8\\)"):
        reshard(plan, [src[0], src[1][:, :8]], dst, backend="triton")
    with pytest.raises(ValueError, match="2 destination shards given, layout has 4"):
        reshard(plan, src, dst[:2], backend="triton")


def test_allocated_and_1d_destinations_through_the_cache(monkeypatch):
    sides, _ = _counting(monkeypatch)
    full = torch.arange(10.0)
    plan = plan_reshard(Sharded(3, 0), Sharded(2, 0), (10,))
    src = list(torch.tensor_split(full, 3))
    dst = [torch.zeros(5), torch.zeros(5)]
    for _ in range(2):
        out = reshard(plan, src, dst, backend="triton")
        assert [tuple(o.shape) for o in out] == [(5, 1), (5, 1)]
        assert torch.equal(torch.cat([o.view(-1) for o in out]), full)
    assert sides.count("destination") == 1
    for _ in range(2):  # destinations allocated per call (the source checks come first)
        out = reshard(plan, src, dtype=torch.bfloat16, backend="triton")
        assert torch.equal(torch.cat([o.view(-1) for o in out]), full.to(torch.bfloat16))


def test_the_reshard_check_cache_is_bounded(monkeypatch):
    sides, _ = _counting(monkeypatch)
    monkeypatch.setattr(reshard_module._CHECKED, "size", 3)
    plan, src, full = _qkv_case()
    dsts = [[torch.zeros(s) for s in plan.dst_shapes] for _ in range(5)]
    for dst in dsts:
        reshard(plan, src, dst, backend="triton")
    assert len(reshard_module._CHECKED) == 3
    reshard(plan, src, dsts[-1], backend="triton")  # kept
    reshard(plan, src, dsts[0], backend="triton")  # evicted: checked again
    assert len(reshard_module._CHECKED) == 3 and sides.count("destination") == 6
    for dst in dsts:
        _assert_resharded(plan, full, dst)
