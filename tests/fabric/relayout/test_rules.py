"""Engine layouts as data (fabric.relayout.rules): splits, binding, errors, keys."""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.errors import LayoutError, LayoutMismatchError
from weightfabric.fabric.relayout.rules import (
    EngineLayout,
    Published,
    Rule,
    Split,
    Term,
    derive_reference,
    identity_layout,
)
from weightfabric.kernels.fp8 import quantize_fp8_ref


def ranges(split: Split, extent: int) -> list[tuple[int, int]]:
    return [split.range(extent, r) for r in range(split.parts)]


def pub(tensors: dict[str, torch.Tensor]) -> dict[str, Published]:
    return {n: Published(tuple(t.shape), t.dtype) for n, t in tensors.items()}


# ------------------------------------------------------------ Split
def test_six_rows_over_four_ranks_in_each_style():
    with pytest.raises(LayoutError, match="do not split evenly"):
        Split(0, 4).range(6, 0)
    assert ranges(Split(0, 4, style="chunk"), 6) == [(0, 2), (2, 4), (4, 6), (6, 6)]
    assert ranges(Split(0, 4, style="tensor_split"), 6) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert ranges(Split(0, 4, style="sizes", sizes=(1, 0, 3, 2)), 6) == [
        (0, 1), (1, 1), (1, 4), (4, 6)]
    assert ranges(Split(0, 2), 6) == [(0, 3), (3, 6)]
    with pytest.raises(LayoutError, match="sum to 5"):
        Split(0, 4, style="sizes", sizes=(1, 1, 1, 2)).range(6, 0)


def test_units_and_replicated_units():
    heads = Split(0, 2, unit=8)
    assert ranges(heads, 32) == [(0, 16), (16, 32)]
    with pytest.raises(LayoutError, match="whole number of units"):
        heads.range(30, 0)
    with pytest.raises(LayoutError, match="2 units do not split evenly over 4"):
        Split(0, 4, unit=8).range(16, 0)
    kv = Split(0, 4, unit=8, replicate=True)  # 2 kv heads at tp 4: ranks 0,1 head 0; 2,3 head 1
    assert ranges(kv, 16) == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert ranges(kv, 64) == [(0, 16), (16, 32), (32, 48), (48, 64)]  # 8 heads: an even split
    with pytest.raises(LayoutError, match="3 units"):  # 3 heads neither split nor divide 4
        kv.range(24, 0)


def test_pad_to_pads_then_splits_evenly():
    vocab = Split(0, 2, pad_to=64)
    assert vocab.padded(100) == 128
    assert ranges(vocab, 100) == [(0, 64), (64, 128)]
    assert ranges(Split(0, 1, pad_to=64), 128) == [(0, 128)]
    with pytest.raises(LayoutError, match="padded to 64"):
        Split(0, 3, pad_to=64).range(10, 0)
    emb = torch.randn(100, 4)
    layout = EngineLayout("v", (Rule("e", ((Term("e"),),), split=vocab),), tp=2)
    r1 = derive_reference(layout, {"e": emb}, 1)["e"]
    assert r1.shape == (64, 4)
    assert torch.equal(r1[:36], emb[64:]) and not r1[36:].any()


@pytest.mark.parametrize("kw,match", [
    (dict(dim=2, parts=2), "dim"),
    (dict(dim=0, parts=0), "positive"),
    (dict(dim=0, parts=2, unit=0), "positive"),
    (dict(dim=0, parts=2, style="halves"), "unknown style"),
    (dict(dim=0, parts=2, style="sizes"), "sizes"),
    (dict(dim=0, parts=2, sizes=(1, 1)), "sizes"),
    (dict(dim=0, parts=2, style="sizes", sizes=(1,)), "counts"),
    (dict(dim=0, parts=2, style="chunk", pad_to=64), "pad_to"),
])
def test_bad_splits_are_layout_errors(kw, match):
    with pytest.raises(LayoutError, match=match):
        Split(**kw)
    with pytest.raises(LayoutError, match="rank 4"):
        Split(0, 4).range(8, 4)


# ------------------------------------------------------------ rules and layouts
def qkv_rule(tp: int) -> Rule:
    return Rule("qkv", ((Term("q"), Term("k"), Term("v")),),
                split=Split(0, tp, unit=2, replicate=True))


def test_fused_tensor_of_each_rank():
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    layout = EngineLayout("qkv", (qkv_rule(4),), tp=4)
    got = [derive_reference(layout, {"q": q, "k": k, "v": v}, r)["qkv"] for r in range(4)]
    for r in range(4):
        kv = slice((r // 2) * 2, (r // 2) * 2 + 2)  # 2 kv heads of 2 rows, each on 2 ranks
        assert torch.equal(got[r], torch.cat([q[2 * r:2 * r + 2], k[kv], v[kv]]))


def test_stacked_entries_over_ep_with_rows_of_a_stacked_tensor():
    gate_up = torch.randn(4, 6, 5)  # 4 experts, [gate (3 rows); up (3 rows)]
    entries = tuple((Term("gu", index=e, rows=(0, 3)), Term("gu", index=e, rows=(3, 6)))
                    for e in range(4))
    layout = EngineLayout("moe", (Rule("w13", entries, ep=Split(0, 2)),), ep=2)
    got = derive_reference(layout, {"gu": gate_up}, 1)["w13"]
    assert torch.equal(got, gate_up[2:])
    flat = EngineLayout("flat", (Rule("w13", entries, ep=Split(0, 4, style="tensor_split"),
                                      flat=True),), tp=2, ep=2)
    for rank in range(4):  # the flat rank, not the ep index, picks the expert
        assert torch.equal(derive_reference(flat, {"gu": gate_up}, rank)["w13"],
                           gate_up[rank:rank + 1])


def test_a_rank_without_entries_holds_an_empty_stack():
    w = torch.randn(3, 4, 2)
    layout = EngineLayout("e", (Rule("w", tuple((Term("w", index=e),) for e in range(3)),
                                     ep=Split(0, 4, style="chunk")),), ep=4)
    shapes = [derive_reference(layout, {"w": w}, r)["w"].shape for r in range(4)]
    assert shapes == [(1, 4, 2), (1, 4, 2), (1, 4, 2), (0, 4, 2)]


def test_cast_and_fp8_targets():
    w = torch.randn(32, 48)
    layout = EngineLayout("q", (Rule("w", ((Term("w"),),), dtype=torch.bfloat16, fp8_block=16),
                                Rule("b", ((Term("b"),),), dtype=torch.bfloat16)))
    got = derive_reference(layout, {"w": w, "b": w[0]}, 0)
    q, s = quantize_fp8_ref(w.to(torch.bfloat16), 16)
    assert torch.equal(got["w"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["w_scale_inv"], s) and got["w_scale_inv"].shape == (2, 3)
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], w[0].to(torch.bfloat16))


# ------------------------------------------------------------ bind errors
def test_bind_names_the_missing_tensor_and_the_rule():
    layout = EngineLayout("qkv", (qkv_rule(2),), tp=2)
    with pytest.raises(LayoutMismatchError, match=r"rule 'qkv'.*no tensor 'v'"):
        layout.bind(pub({"q": torch.zeros(8, 3), "k": torch.zeros(4, 3)}), 0)


def test_bind_names_a_tensor_of_the_wrong_shape():
    layout = EngineLayout("qkv", (qkv_rule(2),), tp=2)
    with pytest.raises(LayoutMismatchError, match=r"rule 'qkv'.*'k'.*line up"):
        layout.bind(pub({"q": torch.zeros(8, 3), "k": torch.zeros(4, 5), "v": torch.zeros(4, 3)}),
                    0)
    rows = EngineLayout("r", (Rule("r", ((Term("w", rows=(0, 9)),),)),))
    with pytest.raises(LayoutMismatchError, match=r"rule 'r'.*rows \[0, 9\).*'w'"):
        rows.bind(pub({"w": torch.zeros(8, 3)}), 0)
    three = EngineLayout("t", (Rule("t", ((Term("w"),),)),))
    with pytest.raises(LayoutMismatchError, match="'w' is 3-D"):
        three.bind(pub({"w": torch.zeros(2, 2, 2)}), 0)


def test_bind_names_heads_that_do_not_split():
    layout = EngineLayout("qkv", (qkv_rule(4),), tp=4)
    with pytest.raises(LayoutMismatchError, match=r"rule 'qkv'.*'q' \(6, 3\).*over 4 ranks"):
        layout.bind(pub({"q": torch.zeros(6, 3), "k": torch.zeros(2, 3), "v": torch.zeros(2, 3)}),
                    0)


def test_bind_checks_the_expected_shapes_and_the_rank():
    layout = EngineLayout("x", (Rule("w", ((Term("w"),),)),), expects=(("w", (4, 4)),))
    layout.bind(pub({"w": torch.zeros(4, 4)}), 0)
    with pytest.raises(LayoutMismatchError, match=r"rule 'w'.*\(4, 5\).*written for \(4, 4\)"):
        layout.bind(pub({"w": torch.zeros(4, 5)}), 0)
    with pytest.raises(LayoutError, match="rank 1"):
        layout.bind(pub({"w": torch.zeros(4, 4)}), 1)


# ------------------------------------------------------------ malformed layouts, keys
def test_malformed_layouts_are_layout_errors():
    w = Rule("w", ((Term("w"),),), fp8_block=16)
    with pytest.raises(LayoutError, match="twice"):
        EngineLayout("d", (w, Rule("w", ((Term("x"),),))))
    with pytest.raises(LayoutError, match="twice"):  # w's scales are w_scale_inv
        EngineLayout("d", (w, Rule("w_scale_inv", ((Term("x"),),))))
    with pytest.raises(LayoutError, match="over 2 ranks; the layout has 4"):
        EngineLayout("p", (qkv_rule(2),), tp=4)
    with pytest.raises(LayoutError, match="flat"):
        EngineLayout("p", (Rule("w", ((Term("w"),),), split=Split(0, 2), flat=True),), tp=2,
                     ep=2)
    with pytest.raises(LayoutError, match="power of two"):
        Rule("w", ((Term("w"),),), fp8_block=24)
    with pytest.raises(LayoutError, match="name"):
        EngineLayout("a/b", ())
    with pytest.raises(LayoutError, match="tp and ep"):
        EngineLayout("a", (), tp=0)
    with pytest.raises(LayoutError, match="at least one term"):
        Rule("w", ())
    with pytest.raises(LayoutError, match="ep splits stacked entries"):
        Rule("w", ((Term("w"),),), ep=Split(0, 2))


def test_key_is_stable_and_differs_with_tp():
    a, b = EngineLayout("qkv", (qkv_rule(2),), tp=2), EngineLayout("qkv", (qkv_rule(2),), tp=2)
    assert a.key == b.key and a.key.startswith("qkv-")
    assert EngineLayout("qkv", (qkv_rule(4),), tp=4).key != a.key
    assert EngineLayout("qkv", (qkv_rule(2),), tp=2, ep=2).key != a.key
    assert a.derived_model("m", 1) == f"m@{a.key}.r1"


def test_identity_layout_and_aliases():
    tensors = {"emb": torch.randn(5, 3), "experts": torch.randn(2, 3, 4)}
    layout = identity_layout({n: t.shape for n, t in tensors.items()}, dtype=torch.float16)
    got = derive_reference(layout, tensors, 0)
    assert all(torch.equal(got[n], t.half()) for n, t in tensors.items())
    tied = identity_layout({"emb": (5, 3), "head": (5, 3)})
    got = derive_reference(tied, {"emb": tensors["emb"]}, 0, aliases={"head": "emb"})
    assert torch.equal(got["head"], tensors["emb"])
