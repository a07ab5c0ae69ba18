import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightfabric.topology.units import (
    UnitError,
    format_bandwidth,
    format_latency,
    format_size,
    parse_bandwidth,
    parse_latency,
    parse_size,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("400Gbps", 50e9), ("400Gb/s", 50e9), ("50GB/s", 50e9), ("450GB/s", 450e9),
    ("25Gbps", 3.125e9), ("1GiB/s", 2**30), ("12.5 GB/s", 12.5e9), ("100Mbps", 12.5e6),
    ("10kB/s", 1e4), ("1.5TB/s", 1.5e12),
])
def test_parse_bandwidth_reads_bits_and_bytes(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("text", "expected"), [
    ("2us", 2e-6), ("2µs", 2e-6), ("20ms", 0.02), ("500ns", 5e-7), ("1s", 1.0), ("0s", 0.0),
])
def test_parse_latency(text, expected):
    assert parse_latency(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("text", "expected"), [
    ("80GB", 80e9), ("2TB", 2e12), ("512MiB", 512 * 2**20), ("1B", 1.0), ("8Gb", 1e9),
])
def test_parse_size(text, expected):
    assert parse_size(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", ["450", 450, "450GB", "fast", "2 parsecs", "", True, None, [1]])
def test_parse_bandwidth_rejects_missing_or_wrong_units(bad):
    with pytest.raises(UnitError):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["2", 2, "2GB", "2 minutes"])
def test_parse_latency_rejects_missing_or_wrong_units(bad):
    with pytest.raises(UnitError):
        parse_latency(bad)


def test_bare_number_error_names_an_example_unit():
    with pytest.raises(UnitError, match="400Gbps"):
        parse_bandwidth(450)


positive = st.floats(min_value=1e-3, max_value=1e18, allow_nan=False, allow_infinity=False)


@given(positive)
def test_bandwidth_format_parses_back_exactly(value):
    assert parse_bandwidth(format_bandwidth(value)) == value


@given(positive)
def test_size_format_parses_back_exactly(value):
    assert parse_size(format_size(value)) == value


@given(st.floats(min_value=1e-12, max_value=1e4, allow_nan=False))
def test_latency_format_parses_back_exactly(value):
    assert parse_latency(format_latency(value)) == value


def test_format_picks_readable_units():
    assert format_bandwidth(50e9) == "50GB/s"
    assert format_size(2e12) == "2TB"
    assert format_latency(2e-6) == "2us"
    assert format_latency(0.02) == "20ms"


@pytest.mark.parametrize(("parse", "text"), [
    (parse_size, "1e400GB"), (parse_size, "1e308PB"), (parse_bandwidth, "1e400GB/s"),
    (parse_bandwidth, "-1e309Gbps"), (parse_latency, "1e400s"), (parse_latency, "1e309ms"),
])
def test_values_that_overflow_to_infinity_are_rejected(parse, text):
    with pytest.raises(UnitError, match="too large"):
        parse(text)
