"""Manifests: what the bytes of one shard of a version are.

A manifest lists `TensorSpec`s laid out in one flat byte space, the chunk size
the byte space is cut into, and one checksum per chunk (opaque integers computed
by the publisher; the hub only stores and compares them). Its fingerprint is a
stable hash of everything but the checksums' producer: two manifests with equal
fingerprints describe the same bytes.

Two optional lists describe how the bytes relate to the model the publisher holds:
``sharding`` (`ShardedTensor`: which slice of a larger logical tensor a tensor of
this shard is, e.g. an FSDP2 rank's rows) and ``aliases`` (names of tensors that share
storage with a published one, e.g. tied embeddings, published once). Both are left
out of the fingerprint and the wire form while empty, so manifests without them keep
the fingerprints they always had.
"""

from __future__ import annotations

import dataclasses
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
class ShardedTensor:
    """Tensor ``name`` of a shard is a slice of a larger logical tensor.

    It is the slice ``[start, start + local size)`` along ``dim`` of a tensor of
    ``global_shape``; the version's other shards hold the rest (with Shard(dim)
    DTensors, as ``torch.chunk`` cuts them: possibly nothing).

    Attributes:
        name: the tensor in this shard's manifest.
        dim: the dimension the logical tensor is cut along.
        global_shape: the logical tensor's shape.
        start: index along ``dim`` of this shard's first row.

    Raises:
        ValueError: an empty name, or a negative dim, start or size.
    """

    name: str
    dim: int
    global_shape: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ShardedTensor.name must not be empty")
        if self.dim < 0 or self.start < 0 or any(int(d) < 0 for d in self.global_shape):
            raise ValueError(f"sharded tensor {self.name!r}: dim, start and global_shape must be "
                             f">= 0, got dim={self.dim} start={self.start} "
                             f"global_shape={self.global_shape}")

    def check(self, local_shape: tuple[int, ...]) -> None:
        """Raise ValueError unless a tensor of ``local_shape`` fits this slice."""
        where = f"sharded tensor {self.name!r}"
        if not self.dim < len(self.global_shape) or len(local_shape) != len(self.global_shape):
            raise ValueError(f"{where}: dim {self.dim} of global shape {list(self.global_shape)} "
                             f"for a local shape {list(local_shape)}")
        others = [i for i in range(len(local_shape)) if i != self.dim]
        if any(local_shape[i] != self.global_shape[i] for i in others):
            raise ValueError(f"{where}: local shape {list(local_shape)} differs from the global "
                             f"shape {list(self.global_shape)} on another dim than {self.dim}")
        if self.start + local_shape[self.dim] > self.global_shape[self.dim]:
            raise ValueError(f"{where}: rows [{self.start}, {self.start + local_shape[self.dim]}) "
                             f"of dim {self.dim} lie past its global size "
                             f"{self.global_shape[self.dim]}")

    def to_wire(self) -> list[Any]:
        """``[name, dim, global_shape, start]`` (see `from_wire`)."""
        return [self.name, self.dim, list(self.global_shape), self.start]

    @classmethod
    def from_wire(cls, raw: Any) -> ShardedTensor:
        """Rebuild from `to_wire` output."""
        name, dim, global_shape, start = raw
        return cls(str(name), int(dim), tuple(int(d) for d in global_shape), int(start))


@dataclass(frozen=True)
class Manifest:
    """The layout of one shard of a version.

    Args:
        tensors: the tensors, in layout order.
        chunk_size: bytes per chunk (the last chunk may be shorter).
        checksums: one opaque integer per chunk, or empty when the publisher gives none.
        total_bytes: size of the flat byte space; defaults to the end of the last tensor.
        fingerprint: computed (any value given is replaced).
        sharding: tensors that are slices of larger logical ones (see `ShardedTensor`).
        aliases: ``(alias, published name)`` pairs: tensors that share the storage of
            a published one (tied weights), whose bytes are not repeated.

    Raises:
        ValueError: chunk_size < 1, overlapping or duplicate tensors, tensors past
            ``total_bytes``, a checksum count different from the chunk count, sharding
            of an unknown tensor or one that does not fit it, or an alias that is a
            tensor's name, repeats, or names no tensor.
    """

    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    checksums: tuple[int, ...] = ()
    total_bytes: int = -1
    fingerprint: str = field(default="", compare=False)
    sharding: tuple[ShardedTensor, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()

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
        object.__setattr__(self, "sharding", tuple(self.sharding))
        object.__setattr__(self, "aliases", tuple((str(a), str(n)) for a, n in self.aliases))
        self._check_sharding()
        self._check_aliases()
        object.__setattr__(self, "fingerprint", self._compute_fingerprint())

    def _check_sharding(self) -> None:
        shapes = {t.name: t.shape for t in self.tensors}
        seen: set[str] = set()
        for s in self.sharding:
            if s.name not in shapes:
                raise ValueError(f"sharding names {s.name!r}, which is no tensor of the manifest")
            if s.name in seen:
                raise ValueError(f"sharding lists tensor {s.name!r} twice")
            seen.add(s.name)
            s.check(shapes[s.name])

    def _check_aliases(self) -> None:
        names = {t.name for t in self.tensors}
        seen: set[str] = set()
        for alias, target in self.aliases:
            if not alias or alias in names:
                raise ValueError(f"alias {alias!r} must be a non-empty name that is no tensor "
                                 "of the manifest")
            if alias in seen:
                raise ValueError(f"alias {alias!r} appears twice")
            if target not in names:
                raise ValueError(f"alias {alias!r} names {target!r}, which is no tensor of the "
                                 "manifest")
            seen.add(alias)

    def sharding_of(self, name: str) -> ShardedTensor | None:
        """How tensor (or alias) ``name`` slices a logical tensor; None: it is whole."""
        target = self.alias_map().get(name, name)
        for s in self.sharding:
            if s.name == target:
                return s if target == name else dataclasses.replace(s, name=name)
        return None

    def alias_map(self) -> dict[str, str]:
        """Alias -> the published tensor whose bytes it shares."""
        return dict(self.aliases)

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

    def _extras(self) -> dict[str, Any]:
        """``sharding`` and ``aliases`` in wire form, each only when not empty."""
        extras: dict[str, Any] = {}
        if self.sharding:
            extras["sharding"] = [s.to_wire() for s in self.sharding]
        if self.aliases:
            extras["aliases"] = [list(a) for a in self.aliases]
        return extras

    def _compute_fingerprint(self) -> str:
        parts: list[Any] = [[t.to_wire() for t in self.tensors], self.chunk_size,
                            self.total_bytes, list(self.checksums)]
        extras = self._extras()
        if extras:  # absent when empty: older manifests keep their fingerprints
            parts.append(extras)
        body = json.dumps(parts, separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict (see `from_wire`); ``sharding``, ``aliases`` when set."""
        return {"tensors": [t.to_wire() for t in self.tensors], "chunk_size": self.chunk_size,
                "checksums": list(self.checksums), "total_bytes": self.total_bytes,
                **self._extras()}

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
                       int(raw.get("total_bytes", -1)),
                       sharding=tuple(ShardedTensor.from_wire(x)
                                      for x in raw.get("sharding", ())),
                       aliases=tuple((str(a), str(n)) for a, n in raw.get("aliases", ())))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed manifest: {exc!r}") from exc


__all__ = ["Manifest", "ShardedTensor", "TensorSpec"]
