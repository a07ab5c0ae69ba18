"""Delta encoding: round trips, the wire format, Triton vs torch, choice of kind, hostile blobs.

Round trips are hypothesis properties over every dtype the fabric moves; the Triton kernels run
in the interpreter and must give the torch backend's blobs byte for byte.
"""

from __future__ import annotations

import struct
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightfabric.kernels import delta
from weightfabric.kernels.delta import (
    HEADER,
    DeltaFormatError,
    changed_words,
    decode_delta,
    decode_delta_ref,
    decode_delta_triton,
    delta_info,
    encode_delta,
    encode_delta_ref,
    encode_delta_triton,
)

# every dtype the fabric moves, with bit patterns worth preserving: signed zeros, NaNs
# with payloads (quiet and signalling), infinities, extremes
SPECIALS = {
    torch.float32: [0, 0x80000000, 0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC12345, 0x7F800000],
    torch.float64: [0, 1 << 63, 0x7FF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001,
                    0xFFF800000000BEEF],
    torch.bfloat16: [0, 0x8000, 0x7FC0, 0x7FC1, 0x7F81, 0xFFC5, 0xFF80],
    torch.float16: [0, 0x8000, 0x7E00, 0x7E01, 0x7C01, 0xFE05, 0xFC00],
    torch.float8_e4m3fn: [0, 0x80, 0x7F, 0xFF, 0x7E],
    torch.float8_e5m2: [0, 0x80, 0x7E, 0x7D, 0xFF, 0x7C],
    torch.int8: [0, 0x80, 0xFF, 0x7F],
    torch.int16: [0, 0x8000, 0xFFFF],
    torch.int32: [0, 0x80000000, 0xFFFFFFFF],
    torch.int64: [0, 1 << 63, (1 << 64) - 1],
    torch.uint8: [0, 0xFF, 0x80],
}
DTYPES = list(SPECIALS)
INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(bits: int, width: int) -> int:
    half = 1 << (8 * width - 1)
    return (bits ^ half) - half


def versions(dtype: torch.dtype, numel: int, density: float, seed: int = 0,
             sign_flips: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base bytes, new bytes, changed mask) of a ``numel``-element tensor of ``dtype``.

    Base: normal-ish values with the dtype's special bit patterns sprinkled in. New: a
    ``density`` fraction of the elements changed, a ``sign_flips`` share of them by their
    sign bit alone (+0.0 -> -0.0, NaN -> -NaN), the others by random nonzero bits.
    """
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    it = INT_OF[width]
    if dtype.is_floating_point:
        x = (torch.randn(numel, generator=g) * 3).to(dtype)
    else:
        x = torch.randint(-100, 100, (numel,), generator=g).to(dtype)
    words = x.view(it).clone()
    specials = torch.tensor([_signed(b, width) for b in SPECIALS[dtype]], dtype=it)
    where = torch.rand(numel, generator=g) < 0.2
    words[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    changed = torch.zeros(numel, dtype=torch.bool)
    changed[torch.randperm(numel, generator=g)[:round(density * numel)]] = True
    k = int(changed.sum())
    bound = 1 << min(8 * width - 1, 62)
    flips = torch.randint(-bound, bound, (k,), generator=g, dtype=it) | 1  # never 0
    sign = torch.rand(k, generator=g) < sign_flips
    flips[sign] = _signed(1 << (8 * width - 1), width)
    new = words.clone()
    new[changed] ^= flips
    return words.view(torch.uint8), new.view(torch.uint8), changed


def _sizes(changed: torch.Tensor, width: int) -> dict[str, int]:
    """Payload sizes of the three kinds, computed from the definition."""
    pos = changed.nonzero().squeeze(1).tolist()
    gaps = [p - q - 1 for p, q in zip(pos, [-1, *pos], strict=False)]
    gb = 2 if max(gaps, default=0) < 65536 else 4
    n, c = changed.numel(), len(pos)
    return {"full": n * width, "gaps": c * (gb + width), "mask": -(-n // 8) + c * width}


def _expected_kind(changed: torch.Tensor, width: int) -> str:
    s = _sizes(changed, width)
    if not changed.any():
        return "gaps"
    kind = "gaps" if s["gaps"] <= s["mask"] else "mask"
    return "full" if s[kind] >= s["full"] else kind


def _check_round_trip(base, new, changed, width, encode, decode):
    blob = encode(base, new, width)
    info = delta_info(blob)
    count = int(changed.sum())
    assert info.count == count == changed_words(base, new, width)
    assert info.kind == _expected_kind(changed, width)
    assert info.wire_bytes == blob.numel() == HEADER.size + _sizes(changed, width)[info.kind]
    assert info.nbytes == base.numel() and info.width == width
    keep = base.clone()
    out = torch.full_like(base, 0xA5)
    decode(blob, base, out)
    assert torch.equal(out, new) and torch.equal(base, keep)  # bit-exact; base untouched
    inplace = base.clone()
    decode(blob, inplace, inplace)
    assert torch.equal(inplace, new)
    return blob


@st.composite
def cases(draw, max_numel=3000):
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.one_of(st.integers(0, 9), *[st.integers(10, max_numel)] * 3))
    density = draw(st.one_of(st.sampled_from([0.0, 1.0]), *[st.floats(0, 1), st.floats(0, 0.05)] * 2))
    seed = draw(st.integers(0, 2**31))
    return dtype, numel, density, seed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([8, 64, 1 << 20]))
def test_round_trip_torch(case, chunk_words):
    dtype, numel, density, seed = case
    base, new, changed = versions(dtype, numel, density, seed)
    width = torch.empty(0, dtype=dtype).element_size()
    with mock.patch.object(delta, "CHUNK_WORDS", chunk_words):  # the chunk loop, many steps
        _check_round_trip(base, new, changed, width,
                          lambda b, n, w: encode_delta(b, n, w, backend="torch"),
                          lambda x, b, o: decode_delta(x, b, o, backend="torch"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_numel=1500), st.sampled_from([16, 128, 1024]))
def test_round_trip_triton_matches_torch(case, block):
    dtype, numel, density, seed = case
    base, new, changed = versions(dtype, numel, density, seed)
    width = torch.empty(0, dtype=dtype).element_size()
    blob = _check_round_trip(base, new, changed, width,
                             lambda b, n, w: encode_delta_triton(b, n, w, block=block),
                             lambda x, b, o: decode_delta_triton(x, b, o, block=block))
    assert torch.equal(blob, encode_delta_ref(base, new, width))
    assert changed_words(base, new, width, backend="triton") == int(changed.sum())


def test_signed_zeros_and_nan_payloads_round_trip():
    base = torch.tensor([0.0, -0.0, float("nan"), 1.0, float("nan"), 2.0])
    bits = base.view(torch.int32).clone()
    bits[4] = 0x7FC00001  # a NaN with a payload
    new = bits.clone()
    new[0] = _signed(0x80000000, 4)  # +0.0 -> -0.0
    new[1] = 0                       # -0.0 -> +0.0
    new[2] = _signed(0xFFC00000, 4)  # NaN -> -NaN
    new[4] = 0x7FC00002              # another payload
    b8, n8 = bits.view(torch.uint8), new.view(torch.uint8)
    assert changed_words(b8, n8, 4) == 4  # all differ as bits, though == says otherwise
    for backend in ("torch", "triton"):
        blob = encode_delta(b8, n8, 4, backend=backend)
        out = torch.zeros_like(b8)
        decode_delta(blob, b8, out, backend=backend)
        assert torch.equal(out, n8)
    unchanged = encode_delta(b8, b8.clone(), 4)
    assert delta_info(unchanged).count == 0 and unchanged.numel() == HEADER.size


# ----------------------------------------------------------------------------- the format


def test_blobs_match_the_format_built_by_hand():
    base = torch.zeros(40, dtype=torch.int16)
    new = base.clone()
    new[1], new[4] = 0x1234, -2
    blob = encode_delta(base.view(torch.uint8), new.view(torch.uint8), 2)
    want = (struct.pack("<4sBBBBQQ", b"WFD1", 1, 2, 2, 0, 80, 2) + struct.pack("<HH", 1, 2)
            + struct.pack("<hh", 0x1234, -2))
    assert bytes(blob.tolist()) == want
    new[::3] = 7  # 14 of 40: MASK (5 + 28 bytes) beats GAPS (56) and FULL (80)
    blob = encode_delta(base.view(torch.uint8), new.view(torch.uint8), 2)
    bits = sum(1 << i for i in range(40) if i % 3 == 0 or i in (1, 4))
    count = 14 + 2
    want = (struct.pack("<4sBBBBQQ", b"WFD1", 2, 2, 0, 0, 80, count) + bits.to_bytes(5, "little")
            + b"".join(struct.pack("<h", int(v)) for v in new[new != 0]))
    assert bytes(blob.tolist()) == want
    new[:] = 9
    blob = encode_delta(base.view(torch.uint8), new.view(torch.uint8), 2)
    assert bytes(blob.tolist()) == struct.pack("<4sBBBBQQ", b"WFD1", 0, 2, 0, 0, 80, 40) + bytes(
        new.view(torch.uint8).tolist())


def test_decoder_accepts_wide_gaps_for_small_gaps():
    base = torch.arange(16, dtype=torch.uint8)
    blob = struct.pack("<4sBBBBQQ", b"WFD1", 1, 1, 4, 0, 16, 2) + struct.pack("<II", 3, 0) + b"\xaa\xbb"
    want = base.clone()
    want[3], want[4] = 0xAA, 0xBB
    for backend in ("torch", "triton"):
        out = torch.empty_like(base)
        decode_delta(torch.tensor(list(blob), dtype=torch.uint8), base, out, backend=backend)
        assert torch.equal(out, want)
    assert delta_info(blob).gap_bytes == 4 and delta_info(bytearray(blob)).count == 2


# ----------------------------------------------------------------------------- Triton vs torch


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("density,kind", [(0.0, "gaps"), (0.01, "gaps"), (0.3, "mask"),
                                          (1.0, "full")])
def test_triton_blobs_and_decodes_match_torch(width, density, kind):
    dtype = INT_OF[width]
    base, new, changed = versions(dtype, 3001, density, seed=width)  # not a multiple of blocks
    blob = encode_delta_ref(base, new, width)
    assert delta_info(blob).kind == kind
    assert torch.equal(encode_delta_triton(base, new, width, block=256), blob)
    for decode in (decode_delta_ref, lambda *a: decode_delta_triton(*a, block=256)):
        out = torch.zeros_like(base)
        decode(blob, base, out)
        assert torch.equal(out, new)
        inplace = base.clone()
        decode(blob, inplace, inplace)
        assert torch.equal(inplace, new)


def test_gaps_of_65536_or_more_take_four_bytes():
    base = torch.zeros(70000, dtype=torch.uint8)
    new = base.clone()
    new[3], new[69990] = 1, 2  # gap 69986
    blob = encode_delta_triton(base, new, 1, block=65536)
    assert torch.equal(blob, encode_delta_ref(base, new, 1))
    info = delta_info(blob)
    assert (info.kind, info.gap_bytes, info.wire_bytes) == ("gaps", 4, HEADER.size + 2 * 5)
    assert bytes(blob[HEADER.size:HEADER.size + 8].tolist()) == struct.pack("<II", 3, 69986)
    for decode in (decode_delta_ref, lambda *a: decode_delta_triton(*a, block=65536)):
        out = torch.ones_like(base)
        decode(blob, base, out)
        assert torch.equal(out, new)
    new[3] = 0  # the gap 69990 alone
    near = base.clone()
    near[65535] = 5  # the largest two-byte gap
    assert delta_info(encode_delta_ref(base, near, 1)).gap_bytes == 2
    near[65535], near[65536] = 0, 5
    assert delta_info(encode_delta_ref(base, near, 1)).gap_bytes == 4


def test_empty_and_one_word_chunks():
    for width in (1, 2, 4, 8):
        for n in (0, width):
            base = torch.zeros(n, dtype=torch.uint8)
            new = torch.full((n,), 3, dtype=torch.uint8)
            for backend in ("torch", "triton"):
                blob = encode_delta(base, new, width, backend=backend)
                out = torch.empty_like(base)
                decode_delta(blob, base, out, backend=backend)
                assert torch.equal(out, new)
                same = encode_delta(base, base.clone(), width, backend=backend)
                assert delta_info(same).kind == "gaps" and same.numel() == HEADER.size
            assert delta_info(blob).kind == ("full" if n else "gaps")


# ----------------------------------------------------------------------------- kind choice


@pytest.mark.parametrize("nwords,where,kind", [
    (1000, [5, 500], "gaps"),              # sparse: GAPS 6, MASK 127
    (1000, range(0, 1000, 3), "mask"),     # a third: GAPS 1002, MASK 459
    (1000, range(1000), "full"),           # everything
    (16, [0, 5], "mask"),                  # GAPS 6, MASK 4
    (32, [0, 5], "gaps"),                  # a tie: GAPS 6, MASK 6
    (2, [0], "full"),                      # MASK 2: not below FULL's 2
    (8, range(7), "full"),                 # MASK 8 = FULL 8
    (8, range(6), "mask"),                 # MASK 7 < FULL 8
    (4, [0, 3], "mask"),                   # GAPS 6, MASK 3, FULL 4
])
def test_encoder_picks_the_smallest_kind(nwords, where, kind):
    base = torch.zeros(nwords, dtype=torch.uint8)
    new = base.clone()
    new[list(where)] = 1
    changed = new != base
    assert _expected_kind(changed, 1) == kind
    for backend in ("torch", "triton"):
        blob = encode_delta(base, new, 1, backend=backend)
        assert delta_info(blob).kind == kind
        assert blob.numel() == HEADER.size + _sizes(changed, 1)[kind]


# ----------------------------------------------------------------------------- hostile blobs


def _valid(kind: str):
    if kind == "gaps":
        base, new, _ = versions(torch.int16, 101, 0.03, seed=7)
    else:
        base, new, _ = versions(torch.int16, 101, 0.4, seed=7)
    blob = encode_delta_ref(base, new, 2)
    assert delta_info(blob).kind == kind
    return blob, base


def _with(blob: torch.Tensor, **fields) -> torch.Tensor:
    names = ("magic", "kind", "width", "gap_bytes", "reserved", "nbytes", "count")
    values = dict(zip(names, HEADER.unpack(bytes(blob[:HEADER.size].tolist())), strict=True))
    values.update(fields)
    head = torch.tensor(list(HEADER.pack(*values.values())), dtype=torch.uint8)
    return torch.cat([head, blob[HEADER.size:]])


def _hostile(kind: str) -> list[tuple[str, torch.Tensor]]:
    blob, base = _valid(kind)
    h = HEADER.size
    cases = [
        ("empty", blob[:0]), ("short header", blob[:10]), ("bad magic", _with(blob, magic=b"WFD2")),
        ("kind 3", _with(blob, kind=3)), ("width 3", _with(blob, width=3)),
        ("width 4", _with(blob, width=4)), ("width 8", _with(blob, width=8)),
        ("reserved", _with(blob, reserved=1)), ("nbytes", _with(blob, nbytes=200)),
        ("huge nbytes", _with(blob, nbytes=2**64 - 1)),
        ("count > nwords", _with(blob, count=102)), ("huge count", _with(blob, count=2**64 - 1)),
        ("count + 1", _with(blob, count=delta_info(blob).count + 1)),
        ("truncated", blob[:-1]), ("extra byte", torch.cat([blob, blob[:1]])),
    ]
    if kind == "gaps":
        count = delta_info(blob).count
        gaps = blob[h:h + 2 * count].view(torch.int16).clone()
        last = blob.clone()
        last[h + 2 * (count - 1):h + 2 * count] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)
        first = blob.clone()  # one too many: the last position lands on word 101 of 0-100
        wide = int(gaps[0]) + 102 - int(gaps.sum()) - count
        first[h:h + 2] = torch.tensor(list(struct.pack("<H", wide)), dtype=torch.uint8)
        exact = blob.clone()  # the last position on word 100: valid
        exact[h:h + 2] = torch.tensor(list(struct.pack("<H", wide - 1)), dtype=torch.uint8)
        out = torch.empty_like(base)
        decode_delta_ref(exact, base, out)
        cases += [("gap_bytes 3", _with(blob, gap_bytes=3)), ("gap_bytes 0", _with(blob, gap_bytes=0)),
                  ("gap_bytes 4", _with(blob, gap_bytes=4)), ("gap past the end", last),
                  ("one word past the end", first), ("as mask", _with(blob, kind=2, gap_bytes=0))]
    else:
        flipped = blob.clone()
        flipped[h] ^= 1  # popcount off by one, same count
        padded = blob.clone()  # 101 words: bits 5-7 of the last of 13 bytes are padding
        padded[h + 12] |= 0x80
        swap = padded.clone()  # the same popcount, but a padding bit set
        low = int((blob[h:h + 13] != 0).nonzero()[0])
        byte = int(swap[h + low])
        swap[h + low] = byte & (byte - 1)
        cases += [("gap_bytes 2", _with(blob, gap_bytes=2)), ("popcount", flipped),
                  ("padding", padded), ("padding, same popcount", swap),
                  ("as gaps", _with(blob, kind=1, gap_bytes=2))]
    return cases


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["gaps", "mask"])
def test_hostile_blobs_raise_and_leave_out_untouched(kind, backend):
    _, base = _valid(kind)
    for name, blob in _hostile(kind):
        out = torch.full_like(base, 0x5A)
        with pytest.raises(DeltaFormatError):
            decode_delta(blob, base, out, backend=backend)
            pytest.fail(f"{name}: accepted")
        assert torch.all(out == 0x5A), name
        inplace = base.clone()
        with pytest.raises(DeltaFormatError):
            decode_delta(blob, inplace, inplace, backend=backend)
        assert torch.equal(inplace, base), name


def test_delta_info_rejects_malformed_headers():
    blob, _ = _valid("gaps")
    for bad in (blob[:5], _with(blob, magic=b"XXXX"), _with(blob, kind=9), blob[:-1]):
        with pytest.raises(DeltaFormatError):
            delta_info(bad)
    with pytest.raises(DeltaFormatError):
        delta_info(b"WFD1")


# ----------------------------------------------------------------------------- info, arguments


def test_delta_info_and_changed_words():
    base, new, changed = versions(torch.bfloat16, 1000, 0.02, seed=3)
    blob = encode_delta(base, new, 2)
    info = delta_info(blob)
    assert (info.kind, info.width, info.nbytes, info.count, info.nwords) == ("gaps", 2, 2000, 20, 1000)
    assert info.changed_fraction == 0.02 and info.wire_bytes == blob.numel() == 24 + 20 * 4
    assert delta_info(bytes(blob.tolist())) == info
    full = encode_delta(base, torch.zeros_like(new), 2)
    assert delta_info(full).kind == "full"
    assert delta_info(full).count == changed_words(base, torch.zeros_like(new), 2)
    assert changed_words(base, new, 2) == 20 == changed_words(base, new, 2, backend="triton")
    assert changed_words(base, new, 1) == int((base != new).sum())  # bytes: as many or more
    empty = torch.zeros(0, dtype=torch.uint8)
    assert delta_info(encode_delta(empty, empty, 4)).changed_fraction == 0.0


def test_bad_arguments():
    a = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="width must be one of"):
        encode_delta(a, a, 3)
    with pytest.raises(ValueError, match="does not divide"):
        encode_delta(a, a, 8)
    with pytest.raises(ValueError, match="bytes"):
        encode_delta(a, a[:8], 4)
    with pytest.raises(TypeError, match="uint8"):
        encode_delta(a.float(), a.float(), 4)
    with pytest.raises(ValueError, match="1-D"):
        encode_delta(a.view(3, 4), a.view(3, 4), 4)
    with pytest.raises(ValueError, match="multiples of the width"):
        changed_words(a[1:9], a[1:9], 4)
    with pytest.raises(ValueError, match="backend"):
        encode_delta(a, a, 4, backend="cuda")
    with pytest.raises(ValueError, match="block"):
        encode_delta_triton(a, a, 4, block=100)
    blob = encode_delta(a, a, 4)
    wide = torch.zeros(24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        decode_delta(blob, wide[:12], wide[4:16])
    with pytest.raises(ValueError, match="base has"):
        decode_delta(blob, a, a[:8])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_native_scan_encodes_as_the_reference(case):
    dtype, numel, density, seed = case
    base, new, _ = versions(dtype, numel, density, seed)
    width = torch.empty(0, dtype=dtype).element_size()
    native = delta._encode_native(base, new, width)
    if native is not None:  # sparse enough for it (and a C compiler here)
        assert torch.equal(native, encode_delta_ref(base, new, width))


def test_the_native_scan_takes_mask_when_a_wide_gap_makes_gaps_larger():
    base = torch.zeros(250_000, dtype=torch.uint8)
    new = base.clone()
    new[:180_000:20] = 1  # 9,000 changes (over 1/32 of the words), a gap of 70,000, one more
    new[-1] = 1
    native = delta._encode_native(base, new, 1)
    assert native is not None and delta_info(native).kind == "mask"
    assert torch.equal(native, encode_delta_ref(base, new, 1))
    dense = base.clone()
    dense[::10] = 1  # over 1/16 of the words: the torch path's
    assert delta._encode_native(base, dense, 1) is None
    assert torch.equal(encode_delta(base, dense, 1), encode_delta_ref(base, dense, 1))
