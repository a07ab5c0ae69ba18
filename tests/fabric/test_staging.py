"""Receive-path transforms: bounded staging plans and direct reads, bit for bit vs torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightfabric.fabric.relayout.direct import plan_direct, run_direct
from weightfabric.fabric.relayout.staging import HeldTensor, WantedTensor, plan_staging, run_staging
from weightfabric.kernels import (
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


def oracle_gather(layout: Layout, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from its shards, with plain torch ops (inverse of `oracle_split`)."""
    tp = layout.tp
    if isinstance(layout, Replicated):
        return shards[0]
    if isinstance(layout, Sharded):
        return torch.cat(shards, dim=layout.dim)
    if isinstance(layout, FusedQKV):
        nkv = NKV // tp if tp <= NKV else 1
        parts = [s.split([NH // tp * HD, nkv * HD, nkv * HD]) for s in shards]
        first = range(0, tp, max(1, tp // NKV))  # one holder of each kv head
        return torch.cat([torch.cat([p[0] for p in parts]), torch.cat([parts[r][1] for r in first]),
                          torch.cat([parts[r][2] for r in first])])
    if isinstance(layout, FusedGateUp):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    raise AssertionError(layout)


class Holder:
    """Source ranks' regions (flat uint8 CPU tensors) with the shards packed at offsets."""

    def __init__(self, tp: int) -> None:
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(tp)]
        self.cursor = [96] * tp  # leave a gap so offsets are exercised
        self.reads: list[tuple[int, int, int]] = []

    def put(self, rank: int, t: torch.Tensor) -> int:
        at = -(-self.cursor[rank] // 16) * 16  # after a gap, aligned for every dtype
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


def hold_fp8(holder: Holder, name: str, full: torch.Tensor, layout: Layout, dtype: torch.dtype,
             block: int = 16) -> tuple[HeldTensor, list[torch.Tensor]]:
    """Quantise each shard of ``full``; the held tensor and the shards dequantised to ``dtype``."""
    qs = [quantize_fp8_ref(shard, block) for shard in oracle_split(layout, full)]
    offsets = tuple(holder.put(r, q.view(torch.uint8)) for r, (q, _) in enumerate(qs))
    scale_offsets = tuple(holder.put(r, sc) for r, (_, sc) in enumerate(qs))
    held = HeldTensor(name=name, shape=tuple(full.shape), layout=layout, dtype=torch.float8_e4m3fn,
                      offsets=offsets, scale_offsets=scale_offsets, block=block)
    return held, [dequantize_fp8_ref(q, sc, dtype, block) for q, sc in qs]


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


def test_a_staging_buffer_given_is_used_instead_of_allocating_one():
    weights, plan, _, _, holder = fetch(2, 1, 0, 200)
    staging = torch.empty(plan.staging_nbytes + 5, dtype=torch.uint8)
    seen = []

    def read(rank, offset, out):
        seen.append(out.untyped_storage().data_ptr() == staging.untyped_storage().data_ptr())
        holder.reader()(rank, offset, out)

    dst = {name: torch.empty_like(t) for name, t in weights.items()}
    stats = run_staging(plan, read, dst, staging=staging)
    assert all(torch.equal(dst[name], t) for name, t in weights.items())
    assert stats.staging_allocated == 0 and seen and all(seen)


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
    held, deq = hold_fp8(holder, "w", full, src_layout, torch.bfloat16, block)
    wanted = WantedTensor(name="w", layout=dst_layout, dtype=torch.bfloat16)
    ref = reshard(plan_reshard(src_layout, dst_layout, (rows, cols)), deq, backend="torch")[0]
    for budget in (1 << 20, 9000):
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
    held, deq = hold_fp8(holder, "gu", full, src_layout, torch.float32, block)
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
    with pytest.raises(ValueError, match=f"needs {plan.staging_nbytes} contiguous uint8"):
        run_staging(plan, lambda *a: None, {"a": torch.zeros(4, 4)},
                    staging=torch.empty(plan.staging_nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="16-byte aligned"):
        run_staging(plan, lambda *a: None, {"a": torch.zeros(4, 4)},
                    staging=torch.empty(plan.staging_nbytes + 64, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="offsets"):
        HeldTensor(name="x", shape=(4, 4), layout=Sharded(tp=2), dtype=torch.float32, offsets=(0,))
    with pytest.raises(ValueError, match="block must be a power of two"):
        HeldTensor(name="x", shape=(4, 4), layout=Sharded(tp=1), dtype=torch.float8_e4m3fn,
                   offsets=(0,), scale_offsets=(64,), block=0)


# --- direct reads: the same plans executed straight from the source regions ---------------

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def holding(m: int, *, fp8: dict[str, torch.dtype], stored: dict[str, torch.dtype],
            wanted: dict[str, torch.dtype], seed: int = 0):
    """A TP-m holder of the model.

    Names in ``fp8`` quantised (read back as that dtype), the rest stored as ``stored``
    (default bf16) and read as ``wanted`` (default: stored).

    Returns the holder, held tensors, the reader dtype per name and the full tensors a
    reader must reconstruct (gathered from the holder's shards with torch ops).
    """
    holder = Holder(m)
    held, out_dtypes, fulls = [], {}, {}
    for name, full in model(seed, F32).items():
        layout = layouts(m)[name]
        if name in fp8:
            h, deq = hold_fp8(holder, name, full, layout, fp8[name])
            out_dtypes[name], fulls[name] = fp8[name], oracle_gather(layout, deq)
        else:
            t = full.to(stored.get(name, BF16))
            h = hold(holder, name, t, layout)
            out_dtypes[name] = wanted.get(name, t.dtype)
            fulls[name] = t.to(out_dtypes[name])
        held.append(h)
    return holder, held, out_dtypes, fulls


def empty_dst(plan, n: int, rank: int, out_dtypes, fulls) -> dict[str, torch.Tensor]:
    return {name: torch.full(plan.dst_shapes[name], float("nan"), dtype=dt).view(
        oracle_split(layouts(n)[name], fulls[name])[rank].shape) for name, dt in out_dtypes.items()}


def read_rank(m: int, n: int, rank: int, *, fp8=None, stored=None, wanted=None,
              budget: int | None = None, backend: str | None = None, seed: int = 0):
    """run_direct and run_staging of the same plan for reader ``rank`` of TP ``n``."""
    holder, held, out_dtypes, fulls = holding(m, fp8=fp8 or {}, stored=stored or {},
                                              wanted=wanted or {}, seed=seed)
    want = [WantedTensor(name=name, layout=layouts(n)[name], dtype=dt)
            for name, dt in out_dtypes.items()]
    plan = (plan_direct(held, want, rank=rank) if budget is None
            else plan_staging(held, want, rank=rank, budget=budget))
    direct = empty_dst(plan, n, rank, out_dtypes, fulls)
    stats = run_direct(plan, dict(enumerate(holder.regions())), direct, backend=backend)
    staged = empty_dst(plan, n, rank, out_dtypes, fulls)
    run_staging(plan, holder.reader(), staged, backend=backend)
    return plan, stats, direct, staged, fulls


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


MIXED = {"fp8": {"qkv": BF16, "gate_up": F32, "down": F16}, "stored": {"norm": F32},
         "wanted": {"norm": BF16}}


@pytest.mark.parametrize("m,n,rank", [(2, 1, 0), (1, 2, 0), (1, 2, 1), (2, 4, 3), (4, 2, 1)])
@pytest.mark.parametrize("case", ["bf16", "mixed"])
def test_direct_read_equals_staging_and_the_torch_reference(m, n, rank, case):
    kwargs = MIXED if case == "mixed" else {}
    plan, stats, direct, staged, fulls = read_rank(m, n, rank, **kwargs)
    for name, full in fulls.items():
        assert same_bits(direct[name], staged[name]), name
        assert same_bits(direct[name], oracle_split(layouts(n)[name], full)[rank]), name
    assert stats.launches == (2 if case == "mixed" else 1)
    assert stats.segments == sum(len(b.segments) for b in plan.bands)
    spans = sorted((b.name, b.src_rank, b.row0, b.row1) for b in plan.bands)
    assert all(a[:2] != b[:2] or a[3] <= b[2]  # no source row in two bands
               for a, b in zip(spans, spans[1:], strict=False))
    assert stats.written_bytes == sum(t.numel() * t.element_size() for t in direct.values())


@pytest.mark.parametrize("m,n,rank", [(2, 1, 0), (1, 2, 1), (2, 4, 2)])
def test_direct_read_of_mixed_fp8_set_through_the_interpreter(m, n, rank):
    plan, stats, direct, staged, fulls = read_rank(m, n, rank, backend="triton", **MIXED)
    for name, full in fulls.items():
        assert same_bits(direct[name], staged[name]), name
        assert same_bits(direct[name], oracle_split(layouts(n)[name], full)[rank]), name
    assert stats.launches == 2


@pytest.mark.parametrize("kwargs,budget", [
    ({}, 100), ({"fp8": {"qkv": BF16, "gate_up": F16, "down": F32}}, 5000)])
def test_any_staging_plan_runs_directly_with_the_same_bits(kwargs, budget):
    # a small budget cuts tensors into several bands (fp8 ones on block rows)
    plan, stats, direct, staged, fulls = read_rank(2, 1, 0, budget=budget, **kwargs)
    assert len(plan.bands) > 2 * len(fulls)
    assert stats.written_bytes == sum(t.numel() * t.element_size() for t in direct.values())
    for name, full in fulls.items():
        assert same_bits(direct[name], staged[name]), name
        assert same_bits(direct[name], oracle_split(layouts(1)[name], full)[0]), name


def test_direct_read_loads_only_what_lands_while_staging_fetches_whole_rows():
    plan, stats, *_ = read_rank(1, 2, 0)  # 'down' is column-sharded: staging over-fetches
    assert stats.read_bytes == plan.useful_bytes < plan.fetched_bytes
    plan, stats, *_ = read_rank(1, 2, 0, fp8={"down": BF16})
    (seg,) = [s for b in plan.bands if b.name == "down" for s in b.segments]
    assert (seg.rows, seg.cols) == (19, 7)  # of the 19 x 13 fp8 shard: 2 x 1 blocks of 16
    assert stats.read_bytes == plan.useful_bytes + 2 * 4 < plan.fetched_bytes  # + their scales


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.sampled_from([1, 2, 4]), n=st.sampled_from([1, 2, 4]),
       fp8=st.dictionaries(st.sampled_from(["qkv", "gate_up", "down"]), st.sampled_from([F32, BF16, F16])),
       norm=st.sampled_from([(BF16, BF16), (BF16, F32), (F32, BF16), (F32, F16)]),
       seed=st.integers(0, 3))
def test_shard_then_direct_read_on_every_rank_then_gather_gives_the_tensors_back(m, n, fp8, norm, seed):
    holder, held, out_dtypes, fulls = holding(m, fp8=fp8, stored={"norm": norm[0]},
                                              wanted={"norm": norm[1]}, seed=seed)
    want = [WantedTensor(name=k, layout=layouts(n)[k], dtype=dt) for k, dt in out_dtypes.items()]
    regions = dict(enumerate(holder.regions()))
    shards: dict[str, list[torch.Tensor]] = {name: [] for name in fulls}
    for rank in range(n):
        plan = plan_direct(held, want, rank=rank)
        dst = empty_dst(plan, n, rank, out_dtypes, fulls)
        run_direct(plan, regions, dst)
        for name, t in dst.items():
            shards[name].append(t)
    for name, full in fulls.items():
        assert same_bits(oracle_gather(layouts(n)[name], shards[name]), full), name
        if name == "norm":  # replicated: every reader rank holds all of it
            assert all(same_bits(s, full) for s in shards[name])


def test_direct_read_bad_sources_and_destinations_are_errors():
    held = [HeldTensor(name="a", shape=(4, 4), layout=Sharded(tp=2), dtype=F32, offsets=(0, 32))]
    plan = plan_direct(held, [WantedTensor(name="a", layout=Sharded(tp=1), dtype=F32)], rank=0)
    good = torch.zeros(64, dtype=torch.uint8)
    dst = {"a": torch.zeros(4, 4)}
    cases = [
        ({0: good}, r"source rank 1 \(tensor 'a'\): no source region given"),
        ({0: good, 1: torch.zeros(16)}, "flat contiguous uint8 tensor, got torch.float32"),
        ({0: good, 1: torch.zeros(8, 8, dtype=torch.uint8)}, "flat contiguous uint8"),
        ({0: good, 1: torch.zeros(128, dtype=torch.uint8)[::2]}, "flat contiguous uint8"),
        ({0: good, 1: good[:40]}, "source rank 1.*reads bytes 32..64 of a region of 40 bytes"),
        ({0: good, 1: torch.zeros(64, dtype=torch.uint8, device="meta")}, "region is on meta"),
        ({0: good, 1: torch.zeros(80, dtype=torch.uint8)[2:66]}, "float32 data at byte 32 is not aligned"),
    ]
    for sources, match in cases:
        with pytest.raises(ValueError, match=match):
            run_direct(plan, sources, dst)
    with pytest.raises(ValueError, match="direct: no destination tensor for 'a'"):
        run_direct(plan, {0: good, 1: good}, {})
    with pytest.raises(TypeError, match="direct: destination 'a'"):
        run_direct(plan, {0: good, 1: good}, {"a": torch.zeros(4, 4, dtype=torch.int32)})
    holder = Holder(1)
    fp8, _ = hold_fp8(holder, "w", torch.ones(20, 20), Sharded(tp=1), BF16)
    plan = plan_direct([fp8], [WantedTensor(name="w", layout=Sharded(tp=1), dtype=BF16)], rank=0)
    with pytest.raises(TypeError, match="plan dequantises to torch.bfloat16"):
        run_direct(plan, dict(enumerate(holder.regions())), {"w": torch.zeros(20, 20)})
    region = holder.regions()[0]
    with pytest.raises(ValueError, match=f"reads bytes {fp8.scale_offsets[0]}.."):
        run_direct(plan, {0: region[:fp8.scale_offsets[0] + 4]}, {"w": torch.zeros(20, 20, dtype=BF16)})
    assert run_direct(plan, {0: region}, {"w": torch.zeros(20, 20, dtype=BF16)}).launches == 1
