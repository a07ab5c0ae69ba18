"""Where each tensor of a set lives in one flat byte buffer.

`plan_layout` assigns every tensor an aligned byte offset: tensors of at least
``compact_below`` bytes each start on an ``alignment`` boundary, in the order
given; smaller ones are compacted after them, each on ``small_alignment`` (and at
least its element size), so thousands of tiny tensors (norms, biases) share a
few aligned blocks instead of each padding to ``alignment``. The data plane uses
the resulting `PackLayout` as the byte map of a manifest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weightfabric.kernels.segcopy import element_kind

TensorLike = torch.Tensor | tuple[tuple[int, ...], torch.dtype]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Slot:
    """One tensor's place in the buffer.

    Attributes:
        name: tensor name.
        shape: logical shape.
        dtype: dtype of the bytes stored in the buffer.
        source_dtype: dtype of the tensor handed to `pack` (differs when cast).
        offset: byte offset of the first element in the buffer.
        nbytes: bytes the tensor occupies (numel * element size of ``dtype``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PackLayout:
    """An ordered set of `Slot`s in a buffer of ``nbytes`` bytes.

    Validated on construction: offsets aligned to each slot's element size,
    slots inside the buffer, no two slots overlapping, names unique.
    """

    slots: tuple[Slot, ...]
    nbytes: int
    alignment: int = 256
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for i, s in enumerate(self.slots):
            if s.name in index:
                raise ValueError(f"layout: tensor name {s.name!r} appears twice")
            index[s.name] = i
            size = _itemsize(s.dtype)
            if s.nbytes != s.numel * size:
                raise ValueError(f"layout: tensor {s.name!r} has nbytes {s.nbytes}, expected "
                                 f"{s.numel} * {size}")
            if s.offset % size:
                raise ValueError(f"layout: tensor {s.name!r} offset {s.offset} is not a "
                                 f"multiple of its element size {size} (misaligned)")
            if s.offset < 0 or s.offset + s.nbytes > self.nbytes:
                raise ValueError(f"layout: tensor {s.name!r} bytes [{s.offset}, "
                                 f"{s.offset + s.nbytes}) lie outside the buffer of {self.nbytes}")
            element_kind(s.source_dtype, s.dtype, f"layout: tensor {s.name!r}")
        spans = sorted((s.offset, s.offset + s.nbytes, s.name) for s in self.slots if s.nbytes)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ValueError(f"layout: tensors {a!r} and {b!r} overlap in the buffer")
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self):
        return iter(self.slots)

    def __getitem__(self, name: str) -> Slot:
        try:
            return self.slots[self._index[name]]
        except KeyError:
            raise KeyError(f"layout has no tensor named {name!r}") from None

    @property
    def names(self) -> list[str]:
        """The slots' names, in layout order."""
        return [s.name for s in self.slots]

    def fingerprint(self) -> str:
        """Stable hex digest of names, shapes, dtypes, offsets and size."""
        h = hashlib.sha256(f"{self.nbytes}".encode())
        for s in self.slots:
            h.update(f"|{s.name}:{s.shape}:{s.dtype}:{s.source_dtype}:{s.offset}:{s.nbytes}".encode())
        return h.hexdigest()[:32]


def _meta(name: str, t: TensorLike) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    try:
        shape, dtype = t
        return tuple(int(d) for d in shape), dtype
    except (TypeError, ValueError):
        raise TypeError(f"layout: tensor {name!r} must be a tensor or (shape, dtype), "
                        f"got {type(t).__name__}") from None


def plan_layout(tensors: Mapping[str, TensorLike] | Iterable[tuple[str, TensorLike]], *,
                alignment: int = 256, compact_below: int = 4096, small_alignment: int = 16,
                cast: torch.dtype | Mapping[str, torch.dtype] | None = None) -> PackLayout:
    """Assign aligned offsets to a set of tensors.

    Args:
        tensors: name -> tensor (or ``(shape, dtype)``), in manifest order.
        alignment: byte alignment of tensors of ``compact_below`` bytes or more,
            and of the total size; a power of two.
        compact_below: tensors smaller than this many bytes are compacted.
        small_alignment: alignment of compacted tensors (raised to the element
            size where that is larger); a power of two.
        cast: packed dtype: one dtype applied to every floating tensor that can
            be cast to it (float32 -> bfloat16 / float16), or name -> dtype.

    Returns:
        The `PackLayout`: large tensors first in input order, then the small ones.

    Raises:
        ValueError: bad alignment, duplicate names.
        TypeError: unsupported dtype or cast.

    Example:
        >>> lay = plan_layout({"w": ((4, 4), torch.float32), "b": ((4,), torch.float32)})
        >>> [(s.name, s.offset) for s in lay], lay.nbytes
        ([('w', 0), ('b', 64)], 256)
    """
    for label, a in (("alignment", alignment), ("small_alignment", small_alignment)):
        if a < 1 or a & (a - 1):
            raise ValueError(f"layout: {label} must be a power of two, got {a}")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    # (name, shape, dtype in the buffer, dtype handed to pack, nbytes)
    Entry = tuple[str, tuple[int, ...], torch.dtype, torch.dtype, int]
    large: list[Entry] = []
    small: list[Entry] = []
    for name, t in items:
        shape, src_dtype = _meta(name, t)
        dst_dtype = src_dtype
        if isinstance(cast, Mapping):
            dst_dtype = cast.get(name, src_dtype)
        elif cast is not None and src_dtype.is_floating_point and (src_dtype, cast) in {
                (torch.float32, torch.bfloat16), (torch.float32, torch.float16)}:
            dst_dtype = cast
        element_kind(src_dtype, dst_dtype, f"layout: tensor {name!r}")
        n = 1
        for d in shape:
            n *= d
        nbytes = n * _itemsize(dst_dtype)
        (large if nbytes >= compact_below else small).append((name, shape, dst_dtype, src_dtype, nbytes))
    slots, cursor = [], 0
    for group, align in ((large, alignment), (small, small_alignment)):
        for name, shape, dtype, src_dtype, nbytes in group:
            cursor = _round_up(cursor, max(align, _itemsize(dtype)))
            slots.append(Slot(name, shape, dtype, src_dtype, cursor, nbytes))
            cursor += nbytes
    return PackLayout(tuple(slots), _round_up(cursor, alignment), alignment)
