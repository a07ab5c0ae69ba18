"""Pack/unpack and the layout planner: Triton (interpreter) vs torch reference, bad input."""

from __future__ import annotations

import importlib

import pytest
import torch

from weightfabric.kernels.layout import PackLayout, Slot, plan_layout
from weightfabric.kernels.pack import pack, pack_ref, unpack, unpack_ref
from weightfabric.kernels.segcopy import copy_segments


def _tensor_set() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(131, 37, generator=g)
    return {
        "w": torch.randn(37, 131, generator=g),                      # contiguous fp32
        "w_t": base.t(),                                               # strided (transposed)
        "bias": torch.randn(37, generator=g).to(torch.bfloat16),       # tiny bf16
        "idx": torch.randint(-2**40, 2**40, (5, 7), generator=g),      # int64
        "mask": torch.randint(0, 2, (3, 5), generator=g).bool(),       # 1-byte
        "half": torch.randn(8, 9, 10, generator=g).to(torch.float16)[:, ::2, 1:],  # 3-D strided
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def test_plan_layout_aligns_large_and_compacts_small_tensors():
    lay = plan_layout({"a": ((1000,), torch.float32), "t1": ((3,), torch.float32),
                       "b": ((2000,), torch.bfloat16), "t2": ((1,), torch.int64)},
                      alignment=512, compact_below=1024, small_alignment=16)
    assert lay.names == ["a", "b", "t1", "t2"]
    assert lay["a"].offset == 0 and lay["b"].offset == 4096
    assert lay["t1"].offset == 8096 and lay["t2"].offset == 8112  # compacted, 16-aligned
    assert lay.nbytes == 8192 and lay.nbytes % 512 == 0
    assert lay.fingerprint() == plan_layout(
        {"a": ((1000,), torch.float32), "t1": ((3,), torch.float32),
         "b": ((2000,), torch.bfloat16), "t2": ((1,), torch.int64)},
        alignment=512, compact_below=1024).fingerprint()


def test_plan_layout_with_cast_halves_float32_slots_only():
    lay = plan_layout({"w": ((64, 64), torch.float32), "i": ((10,), torch.int32)},
                      cast=torch.bfloat16)
    assert lay["w"].dtype == torch.bfloat16 and lay["w"].nbytes == 64 * 64 * 2
    assert lay["i"].dtype == torch.int32


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pack_then_unpack_round_trips_bit_exact(backend):
    ts = _tensor_set()
    lay = plan_layout(ts, alignment=128, compact_below=256)
    buf = pack(ts, lay, backend=backend)
    ref = pack_ref(ts, lay, torch.zeros(lay.nbytes, dtype=torch.uint8))
    assert torch.equal(buf, ref)
    out = unpack(buf, lay, backend=backend)
    for name, t in ts.items():
        assert torch.equal(out[name], t), name


def test_pack_with_cast_matches_torch_rounding_bit_exact():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(37, 131, generator=g) * 1e3
    w[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-42, 3.3895e38])
    w[1, :3] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20])  # ties, near-tie
    h = torch.randn(13, 17, generator=g).t()
    ts = {"w": w, "h": h}
    lay = plan_layout(ts, cast={"w": torch.bfloat16, "h": torch.float16})
    buf = pack(ts, lay, backend="triton")
    assert torch.equal(buf, pack_ref(ts, lay, torch.zeros(lay.nbytes, dtype=torch.uint8)))
    back = {"w": torch.empty(37, 131), "h": torch.empty(17, 13)}
    unpack(buf, lay, out=back, backend="triton")
    expect = unpack_ref(buf, lay, {"w": torch.empty(37, 131), "h": torch.empty(17, 13)})
    assert torch.equal(back["w"], expect["w"]) and torch.equal(back["h"], expect["h"])


def test_bf16_cast_keeps_nan_a_nan():
    x = torch.tensor([float("nan"), -float("nan"), 1.0])
    y = torch.empty(3, dtype=torch.bfloat16)
    copy_segments([(x, y)], backend="triton")
    assert torch.isnan(y[:2]).all() and y[2] == 1.0


def test_unpack_into_strided_destinations():
    ts = _tensor_set()
    lay = plan_layout(ts)
    buf = pack(ts, lay, backend="torch")
    holder = torch.zeros(37, 2, 131)
    out = {n: torch.empty_like(t) for n, t in ts.items()}
    out["w"] = holder[:, 1, :]
    unpack(buf, lay, out=out, backend="triton")
    assert torch.equal(holder[:, 1, :], ts["w"]) and holder[:, 0, :].abs().sum() == 0


def test_many_segments_across_several_blocks():
    g = torch.Generator().manual_seed(3)
    ts = {f"t{i}": torch.randn(1 + 7 * i, generator=g) for i in range(40)}
    lay = plan_layout(ts)
    buf = pack(ts, lay, backend="triton", block=64)
    assert torch.equal(buf, pack(ts, lay, backend="torch"))


# ---- bad input ---------------------------------------------------------------

def test_pack_rejects_wrong_shape_naming_the_tensor():
    lay = plan_layout({"w": ((4, 4), torch.float32)})
    with pytest.raises(ValueError, match="'w'.*shape"):
        pack({"w": torch.zeros(4, 5)}, lay)


def test_pack_rejects_wrong_dtype_naming_the_tensor():
    lay = plan_layout({"w": ((4, 4), torch.float32)})
    with pytest.raises(TypeError, match="'w'.*dtype"):
        pack({"w": torch.zeros(4, 4, dtype=torch.float64)}, lay)


def test_pack_rejects_missing_and_extra_tensors():
    lay = plan_layout({"w": ((4,), torch.float32)})
    with pytest.raises(ValueError, match="missing \\['w'\\].*unexpected \\['v'\\]"):
        pack({"v": torch.zeros(4)}, lay)


def test_pack_rejects_short_and_misaligned_buffers():
    lay = plan_layout({"w": ((4,), torch.float32)})
    with pytest.raises(ValueError, match="needs 256"):
        pack({"w": torch.zeros(4)}, lay, out=torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="misaligned"):
        pack({"w": torch.zeros(4)}, lay, out=torch.zeros(300, dtype=torch.uint8)[1:258])
    with pytest.raises(TypeError, match="uint8"):
        pack({"w": torch.zeros(4)}, lay, out=torch.zeros(256))


def test_layout_rejects_overlapping_and_misaligned_slots():
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        PackLayout((Slot("a", (4,), torch.float32, torch.float32, 0, 16),
                    Slot("b", (4,), torch.float32, torch.float32, 8, 16)), 64)
    with pytest.raises(ValueError, match="'a'.*misaligned"):
        PackLayout((Slot("a", (4,), torch.float32, torch.float32, 2, 16),), 64)
    with pytest.raises(ValueError, match="'a'.*outside"):
        PackLayout((Slot("a", (4,), torch.float32, torch.float32, 64, 16),), 64)


def test_layout_rejects_unsupported_dtypes_and_casts():
    with pytest.raises(TypeError, match="'c'.*not supported"):
        plan_layout({"c": ((4,), torch.complex64)})
    with pytest.raises(TypeError, match="'w'.*cannot cast"):
        plan_layout({"w": ((4,), torch.int32)}, cast={"w": torch.float32})
    with pytest.raises(ValueError, match="power of two"):
        plan_layout({"w": ((4,), torch.int32)}, alignment=48)


def test_unpack_rejects_overlapping_destinations():
    lay = plan_layout({"a": ((4,), torch.float32), "b": ((4,), torch.float32)})
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    shared = torch.zeros(6)
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        unpack(buf, lay, out={"a": shared[:4], "b": shared[2:]})


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lay = plan_layout({"w": ((4,), torch.float32)})
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pack({"w": torch.zeros(4)}, lay, backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        pack({"w": torch.zeros(4)}, lay, backend="cuda")


# --- pack fused with the chunk checksums --------------------------------------------------------

def _checksummed_set() -> tuple[dict[str, torch.Tensor], PackLayout]:
    tensors = _tensor_set()
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)
    tensors["odd_bf16"] = raw[16:16 + 2 * 4097].view(torch.bfloat16)   # 8194 bytes: a tail
    tensors["off4"] = raw[20:20 + 4 * 1000].view(torch.float32)       # 4-byte aligned source
    tensors["cast"] = torch.randn(33, 70, generator=g)                 # fp32 -> bf16 in the pack
    layout = plan_layout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                         alignment=256, cast={"cast": torch.bfloat16})
    return tensors, layout


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
@pytest.mark.parametrize("chunk", [256, 1024, 4096])
def test_pack_with_checksums_equals_pack_then_checksum(monkeypatch, backend, chunk):
    from weightfabric.kernels import checksum, native
    from weightfabric.kernels.checksum import chunk_checksums_ref
    from weightfabric.kernels.pack import pack_with_checksums

    fused: list[int] = []
    copy = checksum.ChunkSums.copy

    def counted(self, offset, dst, src):
        done = copy(self, offset, dst, src)
        fused.append(done)
        return done

    monkeypatch.setattr(checksum.ChunkSums, "copy", counted)
    tensors, layout = _checksummed_set()
    want = pack_ref(tensors, layout, torch.zeros(layout.nbytes, dtype=torch.uint8))
    out = torch.full((layout.nbytes,), 0, dtype=torch.uint8)
    sums = pack_with_checksums(tensors, layout, out, chunk, backend=backend)
    assert torch.equal(out, want)
    assert torch.equal(sums, chunk_checksums_ref(want, chunk))
    if backend is None and native.checksum_library() is not None:  # w, idx, odd_bf16, off4...
        assert sum(fused) >= 4


def test_pack_with_checksums_covers_padding_it_did_not_write():
    """Padding the pack leaves alone (stale bytes of a reused buffer) is summed as it is."""
    from weightfabric.kernels.checksum import chunk_checksums_ref
    from weightfabric.kernels.pack import pack_with_checksums

    tensors, layout = _checksummed_set()
    out = torch.full((layout.nbytes,), 0x5A, dtype=torch.uint8)
    sums = pack_with_checksums(tensors, layout, out, 512)
    assert torch.equal(sums, chunk_checksums_ref(out, 512))


# --- checks and tables cached per call key ------------------------------------------------------

def test_a_repeat_call_skips_the_checks_and_a_changed_call_is_checked_again(monkeypatch):
    pack_module = importlib.import_module("weightfabric.kernels.pack")

    checked: list[str] = []
    check = pack_module._check_tensors

    def counted(tensors, layout, what, **kw):
        checked.append(what)
        return check(tensors, layout, what, **kw)

    monkeypatch.setattr(pack_module, "_check_tensors", counted)
    ts = _tensor_set()
    lay = plan_layout(ts, alignment=128, compact_below=256)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    pack(ts, lay, out=buf, backend="triton")
    ts["w"].mul_(-2)  # same key, new values: the cached table moves the new bytes
    pack(ts, lay, out=buf, backend="triton")
    assert checked == ["pack"]
    assert torch.equal(buf, pack_ref(ts, lay, torch.zeros_like(buf)))
    out = {n: torch.empty_like(t) for n, t in ts.items()}
    for _ in range(2):
        unpack(buf, lay, out=out, backend="triton")
    assert checked == ["pack", "unpack"]
    assert all(torch.equal(out[n], t) for n, t in ts.items())

    # what differs from a checked key is checked again (and rejected)
    with pytest.raises(ValueError, match="'w'.*shape"):  # same address, another shape
        pack({**ts, "w": ts["w"].view(131, 37)}, lay, out=buf)
    with pytest.raises(ValueError, match="unexpected \\['x'\\]"):
        pack({**ts, "x": torch.zeros(1)}, lay, out=buf)
    inside = torch.zeros(lay.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'mask' overlaps"):
        pack({**ts, "mask": inside[:15].view(torch.bool).view(3, 5)}, lay, out=inside)
    with pytest.raises(ValueError, match="'w'.*overlaps the buffer"):
        unpack(buf, lay, out={**out, "w": buf[:37 * 131 * 4].view(torch.float32).view(37, 131)})
    pack(ts, plan_layout(ts, alignment=128, compact_below=256), out=buf)  # an equal new layout
    assert checked.count("pack") == 5


def test_the_check_cache_is_bounded(monkeypatch):
    pack_module = importlib.import_module("weightfabric.kernels.pack")

    monkeypatch.setattr(pack_module._CHECKED, "size", 3)
    lay = plan_layout({"w": ((4,), torch.float32)})
    bufs = [torch.zeros(lay.nbytes, dtype=torch.uint8) for _ in range(5)]
    w = torch.arange(4.0)
    for b in bufs:
        pack({"w": w}, lay, out=b, backend="torch")
    assert len(pack_module._CHECKED) <= 3
    assert all(torch.equal(b[:16].view(torch.float32), w) for b in bufs)
