"""Manifests: what the bytes of one shard of a version are.

A manifest lists `TensorSpec`s laid out in one flat byte space, the chunk size
the byte space is cut into, and one checksum per chunk (opaque integers computed
by the publisher; the hub only stores and compares them). Its fingerprint is a
stable hash of everything but the checksums' producer: two manifests with equal
fingerprints describe the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in the flat byte space: name, shape, dtype name, size and byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorSpec.name must not be empty")
        if self.nbytes < 0 or self.offset < 0:
            raise ValueError(f"tensor {self.name!r}: nbytes and offset must be >= 0, "
                             f"got nbytes={self.nbytes} offset={self.offset}")
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")

    def to_wire(self) -> list[Any]:
        """``[name, shape, dtype, nbytes, offset]`` (see `from_wire`)."""
        return [self.name, list(self.shape), self.dtype, self.nbytes, self.offset]

    @classmethod
    def from_wire(cls, raw: Any) -> TensorSpec:
        """Rebuild a spec from `to_wire` output."""
        name, shape, dtype, nbytes, offset = raw
        return cls(str(name), tuple(int(d) for d in shape), str(dtype), int(nbytes), int(offset))


@dataclass(frozen=True)
class Manifest:
    """The layout of one shard of a version.

    Args:
        tensors: the tensors, in layout order.
        chunk_size: bytes per chunk (the last chunk may be shorter).
        checksums: one opaque integer per chunk, or empty when the publisher gives none.
        total_bytes: size of the flat byte space; defaults to the end of the last tensor.

    Raises:
        ValueError: chunk_size < 1, overlapping or duplicate tensors, tensors past
            ``total_bytes``, or a checksum count different from the chunk count.
    """

    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    checksums: tuple[int, ...] = ()
    total_bytes: int = -1
    fingerprint: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        if self.total_bytes < 0:
            object.__setattr__(self, "total_bytes", end)
        elif end > self.total_bytes:
            raise ValueError(f"tensors end at byte {end}, past total_bytes={self.total_bytes}")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names in a manifest must be unique")
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors if t.nbytes)
        for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:], strict=False):
            if s1 < e0:
                raise ValueError(f"tensors {n0!r} and {n1!r} overlap")
        if self.checksums and len(self.checksums) != self.num_chunks:
            raise ValueError(f"{len(self.checksums)} checksums for {self.num_chunks} chunks")
        object.__setattr__(self, "fingerprint", self._compute_fingerprint())

    @property
    def num_chunks(self) -> int:
        """How many chunks the byte space is cut into (at least 1)."""
        return max(1, -(-self.total_bytes // self.chunk_size))

    def chunk_bytes(self, index: int) -> tuple[int, int]:
        """Return ``(offset, nbytes)`` of chunk ``index``."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} out of range 0..{self.num_chunks - 1}")
        start = index * self.chunk_size
        return start, max(0, min(self.chunk_size, self.total_bytes - start))

    def _compute_fingerprint(self) -> str:
        body = json.dumps([[t.to_wire() for t in self.tensors], self.chunk_size,
                           self.total_bytes, list(self.checksums)], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict (see `from_wire`)."""
        return {"tensors": [t.to_wire() for t in self.tensors], "chunk_size": self.chunk_size,
                "checksums": list(self.checksums), "total_bytes": self.total_bytes}

    @classmethod
    def from_wire(cls, raw: Any) -> Manifest:
        """Rebuild a manifest from `to_wire` output.

        Raises:
            ValueError: the dict is malformed or describes an invalid layout.
        """
        if not isinstance(raw, dict):
            raise ValueError(f"manifest must be a map, got {type(raw).__name__}")
        try:
            return cls(tuple(TensorSpec.from_wire(t) for t in raw["tensors"]),
                       int(raw["chunk_size"]),
                       tuple(int(c) for c in raw.get("checksums", ())),
                       int(raw.get("total_bytes", -1)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed manifest: {exc!r}") from exc


__all__ = ["Manifest", "TensorSpec"]
