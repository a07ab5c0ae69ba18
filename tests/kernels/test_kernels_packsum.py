"""Pack fused with the chunk checksums (`kernels.packsum`): Triton (interpreter) vs torch.

The references: ``pack_ref``, then ``chunk_checksums_ref``; bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from weightfabric.kernels import packsum
from weightfabric.kernels.checksum import chunk_checksums_ref
from weightfabric.kernels.layout import plan_layout
from weightfabric.kernels.pack import pack_ref, pack_with_checksums


def _mixed_set(seed: int = 1) -> dict[str, torch.Tensor]:
    """Mixed dtypes and odd sizes, sources 16-, 4-, 2- and 1-byte aligned, a cast, a transpose."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    return {
        "w": torch.randn(23, 41, generator=g),                      # 3,772 B: several tiles
        "b16": torch.randn(333, generator=g).to(torch.bfloat16),    # 666 B, odd word count
        "odd": raw[3:3 + 77],                                       # 1-byte units, odd address
        "i64": torch.randint(-2**40, 2**40, (5, 7), generator=g),   # 280 B
        "t": torch.randn(9, 13, generator=g).t(),                   # strided: written first
        "cast": torch.randn(11, 7, generator=g),                    # fp32 -> bf16: written first
        "off2": raw[2:2 + 2 * 101].view(torch.int16),               # 2-byte aligned source
        "off4": raw[20:20 + 4 * 300].view(torch.float32),           # 4-byte aligned source
        "tiny": torch.tensor([7], dtype=torch.int8),                # 1 byte
        "empty": torch.empty(0, 3),
    }


def _layout(tensors: dict[str, torch.Tensor], alignment: int = 32):
    return plan_layout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                       alignment=alignment, compact_below=512, small_alignment=1,
                       cast={"cast": torch.bfloat16})


def _check(tensors, layout, chunk, fill=0x5A):
    """The fused call and the references on buffers holding the same stale bytes."""
    want = pack_ref(tensors, layout, torch.full((layout.nbytes,), fill, dtype=torch.uint8))
    out = torch.full((layout.nbytes,), fill, dtype=torch.uint8)
    sums = pack_with_checksums(tensors, layout, out, chunk, backend="triton")
    assert torch.equal(out, want)
    assert torch.equal(sums, chunk_checksums_ref(want, chunk))
    return out, sums


@pytest.fixture
def launches(monkeypatch):
    """Counts the fused launches (so a test knows the fused kernel, not two passes, ran)."""
    calls: list[int] = []
    launch = packsum.launch

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(packsum, "launch", counted)
    return calls


@pytest.mark.parametrize("chunk", [256, 1024, 4096])
def test_fused_pack_and_checksum_equal_the_references(launches, chunk):
    """Chunk edges inside tensors and chunks over several tensors and padding.

    Tensors smaller than a chunk, and the last chunk partial (the buffer: 6,848 B).
    """
    tensors = _mixed_set()
    layout = _layout(tensors)
    assert layout.nbytes % chunk or chunk > layout.nbytes  # the last chunk is partial
    _check(tensors, layout, chunk)
    assert launches == [1]


def test_every_path_over_several_steps_per_tile(launches, monkeypatch):
    """Steps smaller than the tile: words (vector and not), bytes, in place; 64-byte tiles."""
    monkeypatch.setattr(packsum, "SUB", 64)
    monkeypatch.setattr(packsum, "BYTE_SUB", 16)
    tensors = _mixed_set(2)
    _check(tensors, _layout(tensors), 512)
    small = {k: tensors[k] for k in ("b16", "odd", "tiny", "off2")}
    _check(small, _layout(small, alignment=16), 64)
    assert launches == [1, 1]


def test_an_odd_last_word_and_a_buffer_of_one_word(launches):
    """A length of 4 mod 8: the last pair's high half is zero, as in chunk_checksums_ref."""
    tensors = {"a": torch.arange(5, dtype=torch.int32), "b": torch.arange(3, dtype=torch.int16)}
    layout = plan_layout(tensors, alignment=4, small_alignment=4)
    assert layout.nbytes % 8 == 4
    _check(tensors, layout, 256)
    one = {"x": torch.tensor([1.5])}
    _check(one, plan_layout(one, alignment=4), 64)
    assert launches == [1, 1]


def test_a_repeat_reuses_the_plan_with_new_data_and_another_buffer_gets_its_own(launches):
    tensors = _mixed_set(3)
    layout = _layout(tensors)
    _check(tensors, layout, 1024)
    for t in tensors.values():  # same addresses, new values: the cached plan, new bytes
        if t.numel() and t.is_floating_point():
            t.mul_(-3)
    _check(tensors, layout, 1024, fill=0)
    _check(tensors, layout, 256)  # another tile size: another plan
    other = {**tensors, "w": tensors["w"].clone()}  # one tensor moved
    _check(other, layout, 1024)
    assert launches == [1, 1, 1, 1]


def test_chunk_sizes_without_a_64_byte_divisor_pack_then_checksum(launches):
    tensors = _mixed_set(4)
    layout = _layout(tensors)
    _check(tensors, layout, 200)  # largest power-of-two divisor: 8
    assert launches == []
    assert packsum.tile_for(200) is None and packsum.tile_for(3 << 20) == packsum.TILE
    assert packsum.tile_for(256) == 256


def test_bad_chunk_sizes_and_inputs_are_rejected_before_anything_is_written():
    tensors = _mixed_set(5)
    layout = _layout(tensors)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="chunk_size"):
        pack_with_checksums(tensors, layout, out, 100, backend="triton")
    assert not out.any()
    pack_with_checksums(tensors, layout, out, 512, backend="triton")  # checked and cached
    with pytest.raises(ValueError, match="'w'.*shape"):  # a new key: checked again
        pack_with_checksums({**tensors, "w": tensors["w"][:, :40]}, layout, out, 512,
                            backend="triton")


def test_the_piece_table_merges_and_classifies():
    base = torch.zeros(64, dtype=torch.uint8)[:16]
    tensors = {"a": torch.zeros(4, dtype=torch.int32), "b": torch.zeros(3, dtype=torch.int16),
               "t": torch.zeros(2, 2).t()}
    layout = plan_layout(tensors, alignment=16, small_alignment=16)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    rows, first = packsum.pieces(tensors, layout, out, base.data_ptr())
    assert first == ["t"]
    los = [r[0] for r in rows]
    assert los[0] == 0 and los == sorted(los) and all(r0 < layout.nbytes for r0 in los)
    modes = {r[0]: r[2] for r in rows}
    assert modes[layout["a"].offset] & packsum.WORDS
    # "t" is written first: its bytes are read in place, merged with the padding after "b"
    in_place = [r for r in rows if r[2] & packsum.IN_PLACE]
    assert all(r[1] == out.data_ptr() - base.data_ptr() for r in in_place)


def test_the_bench_rows_of_pack_and_checksum_run_on_cpu():
    from weightfabric.tools.bench.kernels import _pack_checksum_rows

    tensors = {n: t for n, t in _mixed_set(6).items() if n not in ("t", "cast")}
    tensors["w16"] = torch.randn(40, 64).to(torch.bfloat16)
    layout = plan_layout(tensors)
    rows = []
    _pack_checksum_rows(lambda *row: rows.append(row), tensors, layout,
                        torch.empty(layout.nbytes, dtype=torch.uint8), 1024,
                        torch.device("cpu"), 1, 1e-3)
    assert [r[0] for r in rows] == ["pack+checksum, fused"] * 2
    assert [r[3] for r in rows] == ["copy_ of the same bytes", "pack, then chunk_checksums"]
