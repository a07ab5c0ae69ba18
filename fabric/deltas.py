"""Delta fetches: when a reader asks its sources for deltas, and against what.

A reader that holds an older version whole (its active one) may ask a source for the
chunks of the new version encoded against it (`kernels.delta`, ``DELTA`` in
`fabric.transports.wire`): only the words that changed cross the link. The reader
decodes each chunk into its destination, verifies it against the published
checksums like any chunk, and becomes a full holder as usual. A source that does not
hold the base whole answers ``NO_BASE`` and is read in full for the rest of the
fetch; a chunk that failed its checksum once is read in full from then on.

When. `DeltaPolicy` decides per source, with a mode:

- ``"off"``: never.
- ``"on"``: from every source reached through the read server (TCP), on any host.
- ``"auto"`` (the default): from sources on another host, while the cost model says
  a delta is faster. Per byte delivered, a full read costs ``1 / link`` and a delta
  ``1 / encode + ratio / link + 1 / decode`` (``ratio``: wire bytes per byte
  delivered of the last deltas from that host). ``link`` is measured per source host
  on this reader's reads (full reads: bytes / seconds; delta reads: wire bytes over
  the seconds left once encoding and decoding are taken out); until a host has been
  measured, deltas are tried. On one host, shared memory copies at memory speed and
  always wins.

The environment variable ``WEIGHTFABRIC_DELTAS`` (``auto``, ``on``, ``off``) sets the
default mode of every fetch; ``FetchOptions.deltas`` sets it for one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from weightfabric.fabric.transports import SourceAddress, local_host_id

DELTAS_ENV = "WEIGHTFABRIC_DELTAS"
MODES = ("auto", "on", "off")
ENCODE_BPS = 1.0e9
"""Bytes per second a holder encodes (the CPU torch path; `fabric bench delta`)."""
DECODE_BPS = 4.0e9
"""Bytes per second this reader decodes until it has measured its own rate."""
FIRST_RATIO = 0.1
"""Wire bytes per byte delivered assumed of a host's deltas until one was measured."""
SMOOTHING = 0.5
"""Weight of a new measurement in the running estimates."""


def delta_mode(mode: str | None = None) -> str:
    """``mode``, else ``$WEIGHTFABRIC_DELTAS``, else ``"auto"``.

    Raises:
        ValueError: not one of `MODES`.
    """
    chosen = mode if mode is not None else (os.environ.get(DELTAS_ENV) or "auto")
    if chosen not in MODES:
        raise ValueError(f"deltas must be one of {', '.join(MODES)}, got {chosen!r}"
                         + ("" if mode is not None else f" (from ${DELTAS_ENV})"))
    return chosen


def word_width(dtypes: list[tuple[torch.dtype, int]]) -> int:
    """The word a model's deltas compare: the element size holding most of its bytes.

    ``dtypes``: (dtype, bytes) of each tensor. A delta is lossless at any width; the
    element size of the weights makes one changed weight one changed word.
    """
    by_size: dict[int, int] = {}
    for dtype, nbytes in dtypes:
        size = dtype.itemsize
        by_size[size] = by_size.get(size, 0) + nbytes
    best = max(by_size, key=lambda s: by_size[s], default=1)
    return best if best in (1, 2, 4, 8) else 1


@dataclass(frozen=True)
class DeltaBase:
    """What one fetch may ask for deltas against: a version this reader holds whole.

    Attributes:
        name: its region name (holders look it up among their own exposures).
        tensor: its bytes, laid out as the version fetched (may be the destination
            itself: a fetch in place decodes over it).
        width: the word width of the encodings (`word_width`).
        policy: decides per source, and learns from each read.
    """

    name: str
    tensor: torch.Tensor
    width: int
    policy: DeltaPolicy


class DeltaPolicy:
    """Whether to ask a source for deltas: a mode and a cost model fed by this reader's reads.

    One per store, so what it measured carries over to the next version. Thread-safe.

    Args:
        encode_bps: bytes per second a holder encodes.
    """

    def __init__(self, *, encode_bps: float = ENCODE_BPS) -> None:
        self.encode_bps = encode_bps
        self.decode_bps = DECODE_BPS
        self._link: dict[str, float] = {}   # source host -> bytes/s on the wire
        self._ratio: dict[str, float] = {}  # source host -> wire bytes / delivered bytes
        self._lock = threading.Lock()

    def use(self, mode: str, address: SourceAddress) -> bool:
        """Whether a read from ``address`` asks for deltas under ``mode``."""
        if mode == "off":
            return False
        if mode == "on":
            return True
        if address.host_id == local_host_id():
            return False
        with self._lock:
            link = self._link.get(address.host_id)
            ratio = self._ratio.get(address.host_id, FIRST_RATIO)
        if link is None:
            return True
        return 1 / self.encode_bps + ratio / link + 1 / self.decode_bps < 1 / link

    def observe(self, address: SourceAddress, *, delivered: int, wire: int, seconds: float,
                decode_seconds: float | None = None) -> None:
        """Learn from one read: ``decode_seconds`` given for a delta read, None for a full one."""
        if delivered <= 0 or seconds <= 0:
            return
        host = address.host_id
        with self._lock:
            if decode_seconds is None:
                link = wire / seconds
            else:
                if decode_seconds > 0:
                    self.decode_bps = _mix(self.decode_bps, delivered / decode_seconds)
                self._ratio[host] = _mix(self._ratio.get(host), wire / delivered)
                moving = seconds - decode_seconds - delivered / self.encode_bps
                if moving <= 0:
                    return  # the wire time is lost in the noise: a fast link, not measured
                link = wire / moving
            self._link[host] = _mix(self._link.get(host), link)

    def link_bps(self, host_id: str) -> float | None:
        """The measured wire rate from ``host_id`` (bytes/s), None before a read from it."""
        with self._lock:
            return self._link.get(host_id)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


__all__ = ["DELTAS_ENV", "MODES", "DeltaBase", "DeltaPolicy", "delta_mode", "word_width"]
