"""Quantities with explicit units, as written in cluster YAML.

Bandwidths are per direction and parse to bytes per second; latencies parse to
seconds; sizes parse to bytes. Decimal prefixes are powers of 1000 (``GB``), binary
prefixes powers of 1024 (``GiB``). Bits are lower-case ``b`` (``400Gbps``,
``400Gb/s``), bytes upper-case ``B`` (``50GB/s``). A bare number is rejected: the
unit is what makes a hand-written file unambiguous.

>>> parse_bandwidth("400Gbps")
50000000000.0
>>> parse_latency("2us")
2e-06
>>> format_size(parse_size("80GB"))
'80GB'
"""

from __future__ import annotations

import math
import re

_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_NUMBER = r"(?P<num>-?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|-?\.[0-9]+)"
_PREFIXES = r"(?P<prefix>Ki|Mi|Gi|Ti|Pi|K|k|M|G|T|P)?"

_BANDWIDTH = re.compile(rf"^{_NUMBER}\s*{_PREFIXES}(?P<unit>B/s|Bps|b/s|bps|bit/s)$")
_SIZE = re.compile(rf"^{_NUMBER}\s*{_PREFIXES}(?P<unit>B|b|bit)$")
_LATENCY = re.compile(rf"^{_NUMBER}\s*(?P<unit>ns|us|µs|ms|s)$")
# Divisors, not factors: 5 / 1e6 is the float nearest 5e-6, while 5 * 1e-6 is not.
_PER_SECOND = {"ns": 1e9, "us": 1e6, "µs": 1e6, "ms": 1e3, "s": 1.0}


class UnitError(ValueError):
    """A quantity string has no unit, an unknown unit, or a bad number."""


def _scale(match: re.Match[str]) -> float:
    prefix = match.group("prefix") or ""
    return _PREFIX["K" if prefix == "k" else prefix]


def parse_bandwidth(text: str | int | float) -> float:
    """Parse a bandwidth such as ``400Gbps``, ``50GB/s`` or ``12.5 GiB/s`` to bytes/s."""
    match = _BANDWIDTH.match(_text(text, "bandwidth", "50GB/s or 400Gbps"))
    if not match:
        raise UnitError(f"{text!r} is not a bandwidth; write e.g. 50GB/s, 400Gbps or 12.5GiB/s")
    value = float(match.group("num")) * _scale(match)
    return _finite(value if match.group("unit").startswith("B") else value / 8, text, "bandwidth")


def parse_size(text: str | int | float) -> float:
    """Parse a size such as ``80GB``, ``2TB`` or ``512MiB`` to bytes."""
    match = _SIZE.match(_text(text, "size", "80GB or 512MiB"))
    if not match:
        raise UnitError(f"{text!r} is not a size; write e.g. 80GB, 2TB or 512MiB")
    value = float(match.group("num")) * _scale(match)
    return _finite(value if match.group("unit") == "B" else value / 8, text, "size")


def parse_latency(text: str | int | float) -> float:
    """Parse a latency such as ``2us``, ``20ms`` or ``500ns`` to seconds."""
    match = _LATENCY.match(_text(text, "latency", "2us or 20ms"))
    if not match:
        raise UnitError(f"{text!r} is not a latency; write e.g. 500ns, 2us or 20ms")
    return _finite(float(match.group("num")) / _PER_SECOND[match.group("unit")], text, "latency")


def _finite(value: float, text: str | int | float, what: str) -> float:
    """`value`, unless it overflowed to infinity (``1e400GB``)."""
    if not math.isfinite(value):
        raise UnitError(f"{text!r} is too large to be a {what}; write a finite number")
    return value


def _text(value: str | int | float, what: str, example: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UnitError(f"expected a {what} string such as {example}, got {value!r}")
    if not isinstance(value, str):
        raise UnitError(f"{value!r} has no unit; write the {what} with its unit, e.g. {example}")
    return value.strip()


def _exact(value: float, units: list[tuple[str, float]], base: str) -> str:
    """Write `value` in the largest unit whose decimal form parses back exactly."""
    for name, factor in units:
        number = value / factor
        if abs(number) >= 1 and float(repr(number)) * factor == value:
            return f"{_trim(number)}{name}"
    return f"{_trim(value)}{base}"


def _trim(number: float) -> str:
    return str(int(number)) if number == int(number) and abs(number) < 1e16 else repr(number)


def format_bandwidth(bytes_per_s: float) -> str:
    """Inverse of `parse_bandwidth`: ``5e10`` → ``'50GB/s'`` (parses back exactly)."""
    return _exact(bytes_per_s, [("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)], "B/s")


def format_size(nbytes: float) -> str:
    """Inverse of `parse_size`: ``8e10`` → ``'80GB'`` (parses back exactly)."""
    return _exact(nbytes, [("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)], "B")


def format_latency(seconds: float) -> str:
    """Inverse of `parse_latency`: ``2e-6`` → ``'2us'`` (parses back exactly)."""
    if seconds == 0:
        return "0s"
    for name, per_second in [("s", 1.0), ("ms", 1e3), ("us", 1e6), ("ns", 1e9)]:
        number = seconds * per_second
        if abs(number) >= 1 and float(repr(number)) / per_second == seconds:
            return f"{_trim(number)}{name}"
    return f"{seconds!r}s"


def human_bandwidth(bytes_per_s: float) -> str:
    """Short, rounded bandwidth for tables and pictures: ``'450 GB/s'``."""
    for name, factor in [("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)]:
        if bytes_per_s >= factor:
            return f"{bytes_per_s / factor:.3g} {name}"
    return f"{bytes_per_s:.3g} B/s"
