"""Resharding planner: which 2-D rectangles to copy from which source shard.

A logical tensor is 2-D ``[rows, cols]`` (a 1-D tensor of ``n`` is ``[n, 1]``).
A layout says, for each of its ``tp`` ranks, which global rectangles the rank
holds and where they sit in its local shard (`Piece`), and names one *owner*
for every element (`owned`: a partition of the tensor, so replicated data is
read once; a replicated source is striped over its ranks). Planning intersects
every destination piece with every owned source piece; each non-empty
intersection is a `Segment` (a strided 2-D copy). Pure Python, no tensors.

Layouts: `Replicated`, `Sharded` (dim 0 or 1, even or explicit uneven sizes),
`FusedQKV` (grouped-query attention; kv heads replicated when tp > num_kv_heads),
`FusedGateUp`, `VocabParallel` (rows padded to a multiple of ``pad_to``, then
split evenly; padding rows are never read or written).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """Global rows ``[r0, r1)`` x cols ``[c0, c1)`` held by ``rank`` at local ``(lr, lc)``."""

    rank: int
    r0: int
    r1: int
    c0: int
    c1: int
    lr: int = 0
    lc: int = 0


@dataclass(frozen=True)
class Segment:
    """Copy ``rows x cols`` from src shard ``src_rank`` at (src_row, src_col) to dst."""

    src_rank: int
    src_row: int
    src_col: int
    dst_rank: int
    dst_row: int
    dst_col: int
    rows: int
    cols: int


def _shape2(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 1:
        return int(shape[0]), 1
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    raise ValueError(f"reshard: tensor shape must be 1-D or 2-D, got {tuple(shape)}")


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` near-equal sizes, larger ones first (like torch.tensor_split)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _starts(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass(frozen=True)
class Layout(ABC):
    """Base class: how a 2-D tensor is spread over ``tp`` ranks."""

    tp: int

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"{type(self).__name__}: tp must be a positive int, got {self.tp!r}")

    @abstractmethod
    def shard_shape(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Rows and columns rank `rank` holds of a tensor of `shape`."""

    @abstractmethod
    def pieces(self, shape: Sequence[int], rank: int) -> list[Piece]:
        """Where rank `rank`'s shard lies in the full tensor."""

    def owned(self, shape: Sequence[int]) -> list[Piece]:
        """A partition of the tensor: every element once, from one rank."""
        return [p for r in range(self.tp) for p in self.pieces(shape, r)]


@dataclass(frozen=True)
class Replicated(Layout):
    """Every rank holds the whole tensor; as a source, rows are striped over ranks."""

    tp: int = 1

    def shard_shape(self, shape, rank):
        """The whole tensor's rows and columns: every rank holds it."""
        return _shape2(shape)

    def pieces(self, shape, rank):
        """The whole tensor, on rank `rank`."""
        rows, cols = _shape2(shape)
        return [Piece(rank, 0, rows, 0, cols, 0, 0)]

    def owned(self, shape):
        """Rows striped over the ranks."""
        rows, cols = _shape2(shape)
        starts, sizes = _starts(split_sizes(rows, self.tp)), split_sizes(rows, self.tp)
        return [Piece(r, s, s + n, 0, cols, s, 0) for r, (s, n) in enumerate(zip(starts, sizes, strict=True)) if n]


@dataclass(frozen=True)
class Sharded(Layout):
    """Split along ``dim`` (0 or 1) over ``tp`` ranks; ``sizes`` for uneven splits."""

    dim: int = 0
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim not in (0, 1):
            raise ValueError(f"Sharded: dim must be 0 or 1, got {self.dim}")
        if self.sizes is not None and (len(self.sizes) != self.tp or any(
                not isinstance(n, int) or n < 0 for n in self.sizes)):
            raise ValueError(f"Sharded: sizes {self.sizes} must be {self.tp} non-negative ints")

    def _sizes(self, shape) -> list[int]:
        extent = _shape2(shape)[self.dim]
        if self.sizes is None:
            return split_sizes(extent, self.tp)
        if sum(self.sizes) != extent:
            raise ValueError(f"Sharded: sizes {self.sizes} sum to {sum(self.sizes)}, but dim "
                             f"{self.dim} of shape {tuple(shape)} is {extent}")
        return list(self.sizes)

    def shard_shape(self, shape, rank):
        """Rows and columns rank `rank` holds (see `Layout.shard_shape`)."""
        rows, cols = _shape2(shape)
        n = self._sizes(shape)[rank]
        return (n, cols) if self.dim == 0 else (rows, n)

    def pieces(self, shape, rank):
        """Where rank `rank`'s shard lies in the full tensor."""
        rows, cols = _shape2(shape)
        sizes = self._sizes(shape)
        s, n = _starts(sizes)[rank], sizes[rank]
        if not n:
            return []
        return [Piece(rank, s, s + n, 0, cols)] if self.dim == 0 else [Piece(rank, 0, rows, s, s + n)]


@dataclass(frozen=True)
class FusedQKV(Layout):
    """Rows ``[Q heads | K heads | V heads] x head_dim``; rank r holds its Q, K, V heads stacked.

    Needs ``num_heads % tp == 0`` and either ``num_kv_heads % tp == 0`` or
    ``tp % num_kv_heads == 0`` (then each kv head is replicated on tp/num_kv_heads ranks).
    """

    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        nh, nkv, tp = self.num_heads, self.num_kv_heads, self.tp
        if min(nh, nkv, self.head_dim) < 1 or nh % nkv:
            raise ValueError(f"FusedQKV: bad heads (num_heads={nh}, num_kv_heads={nkv}, "
                             f"head_dim={self.head_dim})")
        if nh % tp or (nkv % tp and tp % nkv):
            raise ValueError(f"FusedQKV: tp={tp} must divide num_heads={nh} and divide or be a "
                             f"multiple of num_kv_heads={nkv}")

    def _check(self, shape) -> tuple[int, int]:
        rows, cols = _shape2(shape)
        want = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if rows != want:
            raise ValueError(f"FusedQKV: shape {tuple(shape)} needs {want} rows")
        return rows, cols

    def _kv_heads(self, rank: int) -> tuple[int, int]:
        if self.num_kv_heads >= self.tp:
            per = self.num_kv_heads // self.tp
            return rank * per, per
        return rank // (self.tp // self.num_kv_heads), 1

    def shard_shape(self, shape, rank):
        """Rows and columns rank `rank` holds (see `Layout.shard_shape`)."""
        _, cols = self._check(shape)
        return ((self.num_heads // self.tp + 2 * self._kv_heads(rank)[1]) * self.head_dim, cols)

    def pieces(self, shape, rank):
        """Where rank `rank`'s q, k and v heads lie in the full tensor."""
        _, cols = self._check(shape)
        hd, nq = self.head_dim, self.num_heads // self.tp
        kv0, nkv = self._kv_heads(rank)
        k_base, v_base = self.num_heads * hd, (self.num_heads + self.num_kv_heads) * hd
        q = Piece(rank, rank * nq * hd, (rank + 1) * nq * hd, 0, cols, 0, 0)
        k = Piece(rank, k_base + kv0 * hd, k_base + (kv0 + nkv) * hd, 0, cols, nq * hd, 0)
        v = Piece(rank, v_base + kv0 * hd, v_base + (kv0 + nkv) * hd, 0, cols, (nq + nkv) * hd, 0)
        return [q, k, v]

    def owned(self, shape):
        """A partition of the tensor; a kv head on several ranks comes from the first."""
        seen: set[tuple[int, int]] = set()
        out = []
        for r in range(self.tp):
            for p in self.pieces(shape, r):
                if (p.r0, p.r1) not in seen:  # a replicated kv head: first holder owns it
                    seen.add((p.r0, p.r1))
                    out.append(p)
        return out


@dataclass(frozen=True)
class FusedGateUp(Layout):
    """Rows ``[gate (I) | up (I)]``; rank r holds ``[gate_r | up_r]``, I split like `split_sizes`."""

    def shard_shape(self, shape, rank):
        """Rows and columns rank `rank` holds (see `Layout.shard_shape`)."""
        rows, cols = _shape2(shape)
        if rows % 2:
            raise ValueError(f"FusedGateUp: shape {tuple(shape)} needs an even number of rows")
        return (2 * split_sizes(rows // 2, self.tp)[rank], cols)

    def pieces(self, shape, rank):
        """Where rank `rank`'s gate and up rows lie in the full tensor."""
        rows, cols = _shape2(shape)
        self.shard_shape(shape, rank)
        inter = rows // 2
        sizes = split_sizes(inter, self.tp)
        s, n = _starts(sizes)[rank], sizes[rank]
        if not n:
            return []
        return [Piece(rank, s, s + n, 0, cols, 0, 0), Piece(rank, inter + s, inter + s + n, 0, cols, n, 0)]


@dataclass(frozen=True)
class VocabParallel(Layout):
    """Vocabulary rows padded to a multiple of ``pad_to``, then split evenly over ranks.

    Every shard has ``ceil(padded / tp)`` rows; rows past the real vocabulary are
    padding, never read or written by a reshard.
    """

    pad_to: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.pad_to, int) or self.pad_to < 1:
            raise ValueError(f"VocabParallel: pad_to must be a positive int, got {self.pad_to!r}")

    def _per_rank(self, rows: int) -> int:
        padded = -(-rows // self.pad_to) * self.pad_to
        return -(-padded // self.tp)

    def shard_shape(self, shape, rank):
        """Rows and columns rank `rank` holds (see `Layout.shard_shape`)."""
        rows, cols = _shape2(shape)
        return (self._per_rank(rows), cols)

    def pieces(self, shape, rank):
        """Where rank `rank`'s rows lie in the full tensor."""
        rows, cols = _shape2(shape)
        per = self._per_rank(rows)
        r0, r1 = rank * per, min((rank + 1) * per, rows)
        return [Piece(rank, r0, r1, 0, cols, 0, 0)] if r1 > r0 else []


@dataclass(frozen=True)
class ReshardPlan:
    """Segments moving a tensor of ``shape`` from layout ``src`` to ``dst``.

    Validated: segments inside their shards, and no two segments writing the
    same element of a destination shard.
    """

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    src_shapes: tuple[tuple[int, int], ...] = field(init=False)
    dst_shapes: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "src_shapes", tuple(self.src.shard_shape(self.shape, r)
                                                     for r in range(self.src.tp)))
        object.__setattr__(self, "dst_shapes", tuple(self.dst.shard_shape(self.shape, r)
                                                     for r in range(self.dst.tp)))
        by_dst: dict[int, list[Segment]] = {}
        for i, s in enumerate(self.segments):
            for side, rank, r, c, shapes in (("source", s.src_rank, s.src_row, s.src_col, self.src_shapes),
                                             ("destination", s.dst_rank, s.dst_row, s.dst_col, self.dst_shapes)):
                if not 0 <= rank < len(shapes):
                    raise ValueError(f"reshard segment {i}: {side} rank {rank} out of range")
                rows, cols = shapes[rank]
                if s.rows < 1 or s.cols < 1 or r < 0 or c < 0 or r + s.rows > rows or c + s.cols > cols:
                    raise ValueError(f"reshard segment {i}: {s.rows}x{s.cols} at ({r}, {c}) lies "
                                     f"outside {side} shard {rank} of shape {shapes[rank]}")
            by_dst.setdefault(s.dst_rank, []).append(s)
        for rank, segs in by_dst.items():
            segs = sorted(segs, key=lambda s: (s.dst_row, s.dst_col))
            for i, a in enumerate(segs):
                for b in segs[i + 1:]:
                    if b.dst_row >= a.dst_row + a.rows:
                        break
                    if b.dst_col < a.dst_col + a.cols and a.dst_col < b.dst_col + b.cols:
                        raise ValueError(f"reshard: segments {a} and {b} overlap in destination "
                                         f"shard {rank}")

    @property
    def num_elements(self) -> int:
        """Elements copied by the whole plan."""
        return sum(s.rows * s.cols for s in self.segments)


def plan_reshard(src: Layout, dst: Layout, shape: Sequence[int]) -> ReshardPlan:
    """Plan the copy of a tensor of ``shape`` from layout ``src`` to layout ``dst``.

    Returns:
        A `ReshardPlan`; its segments fill every destination piece exactly once,
        reading each element from the rank that owns it in ``src``.

    Raises:
        ValueError: a layout does not fit the shape (e.g. heads that don't divide).

    Example:
        >>> plan = plan_reshard(Sharded(tp=2, dim=0), Sharded(tp=1, dim=0), (4, 3))
        >>> [(s.src_rank, s.dst_row, s.rows) for s in plan.segments]
        [(0, 0, 2), (1, 2, 2)]
    """
    shape = tuple(int(d) for d in shape)
    _shape2(shape)
    owned = src.owned(shape)
    segments = []
    for d in range(dst.tp):
        for want in dst.pieces(shape, d):
            for have in owned:
                r0, r1 = max(want.r0, have.r0), min(want.r1, have.r1)
                c0, c1 = max(want.c0, have.c0), min(want.c1, have.c1)
                if r0 < r1 and c0 < c1:
                    segments.append(Segment(
                        have.rank, have.lr + r0 - have.r0, have.lc + c0 - have.c0,
                        d, want.lr + r0 - want.r0, want.lc + c0 - want.c0, r1 - r0, c1 - c0))
    return ReshardPlan(src, dst, shape, tuple(segments))
