"""The holder side of delta reads: encoded chunks, computed once and kept for many readers.

A ``DELTA`` request (`fabric.transports.wire`) asks for chunks of a version encoded
against an older version the reader holds (`kernels.delta`). Many readers ask for the
same chunks against the same base (every rollout held the previous version), so each
encoding is computed once, by the first request that needs it while the others wait
for it, and kept in a cache bounded in bytes (least recently used first out). The
entries of a region are dropped when it, or the base they were encoded against, is
retracted: versions are immutable, so an entry stays right for as long as both are
exposed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from weightfabric.kernels.delta import encode_delta

DEFAULT_CACHE_BYTES = 256 << 20
"""Bytes of encoded chunks a read server keeps by default."""

_Key = tuple[str, str, int, int]  # region, base, chunk, word width


class DeltaCache:
    """Encoded chunks by (region, base, chunk, width), bounded in bytes; thread-safe.

    Args:
        max_bytes: the most bytes of encodings kept (0 keeps none: every request encodes).
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.encoded = 0
        """Chunks encoded (cache misses)."""
        self.hits = 0
        self._entries: OrderedDict[_Key, bytes] = OrderedDict()
        self._computing: dict[_Key, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, region: str, base: str, chunk: int, width: int,
            encode: Callable[[], bytes]) -> bytes:
        """The encoding of ``chunk``: cached, or ``encode()`` (once, however many ask at once)."""
        key = (region, base, chunk, width)
        while True:
            with self._lock:
                blob = self._entries.get(key)
                if blob is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return blob
                waiting = self._computing.get(key)
                if waiting is None:
                    done = self._computing[key] = threading.Event()
                    break
            waiting.wait()  # its encoder failed if nothing is cached then: try ourselves
        try:
            blob = encode()
            with self._lock:
                self.encoded += 1
                if len(blob) <= self.max_bytes:
                    self._entries[key] = blob
                    self.bytes += len(blob)
                    while self.bytes > self.max_bytes:
                        _, old = self._entries.popitem(last=False)
                        self.bytes -= len(old)
            return blob
        finally:
            with self._lock:
                del self._computing[key]
            done.set()

    def drop(self, name: str) -> None:
        """Forget every encoding of region ``name`` or against it as the base."""
        with self._lock:
            for key in [k for k in self._entries if name in (k[0], k[1])]:
                self.bytes -= len(self._entries.pop(key))


def encode_chunk(base: torch.Tensor, new: torch.Tensor, width: int) -> bytes:
    """``new`` encoded against ``base`` (equal byte lengths, any device) as wire bytes.

    The word width falls back to 1 byte when it does not divide the chunk (a short last
    chunk).
    """
    if new.numel() % width:
        width = 1
    blob = encode_delta(base, new, width)
    return blob.cpu().numpy().tobytes()


__all__ = ["DEFAULT_CACHE_BYTES", "DeltaCache", "encode_chunk"]
