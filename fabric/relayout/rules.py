"""Engine layouts as data: how a reader rank's tensors derive from a published version.

A trainer publishes tensors under its own names and shapes (Hugging Face names,
unfused, fp32 or bf16, maybe sharded over its data-parallel ranks). An inference
engine holds other tensors: fused ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` =
[gate; up], split over its tensor-parallel ranks, experts stacked and split over
its expert-parallel ranks, vocabularies padded, weights cast or quantised to fp8.
An `EngineLayout` says, for every tensor of one engine rank, which published
tensors it is made of, as a list of `Rule`s:

* `Term`: one published tensor, or the ``index``-th entry of a stacked one, or a
  band of its rows (``rows``: the gate half of a stacked ``gate_up_proj``).
* `Split`: how a dimension is divided over ``parts`` ranks: ``even`` (the
  engines' and Megatron's rule: it must divide), ``chunk`` (``torch.chunk`` and
  FSDP2: 6 rows over 4 ranks are [2, 2, 2, 0]), ``tensor_split`` ([2, 2, 1, 1]) or
  explicit ``sizes``; in units of ``unit`` rows (attention heads), with units
  replicated when there are fewer than ranks (``replicate``: grouped-query kv
  heads at tp > kv heads); vocabularies padded to a multiple of ``pad_to`` first.
* `Rule`: a target tensor = the terms, each cut by the split, concatenated along
  ``cat_dim``; or, with several entries, one such concatenation per entry stacked
  along a new first dim (MoE experts), the entries cut by ``ep``; stored as
  ``dtype``, or as float8_e4m3fn with float32 block scales (``fp8_block``) in a
  second tensor named ``target`` with ``scale_suffix``. The split takes the rank's
  tensor-parallel index and ``ep`` its expert-parallel index (rank = ep_rank * tp +
  tp_rank); a ``flat`` rule cuts by the rank itself over all tp x ep ranks (vLLM's
  MoE layers, which fold tensor and data parallelism into one group).

`EngineLayout.bind` checks the layout against the published tensors' names,
shapes and dtypes (a typed error names the tensor and the rule that does not fit,
before any byte moves) and returns, for one rank, the target tensors' shapes and
the `Piece`s each is copied from. `derive_reference` is the plain-torch meaning of
a layout, from whole published tensors; the fabric's reader produces the same
bytes from reads of the publishers' shards (`fabric.relayout.derive`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from weightfabric.fabric.errors import LayoutError, LayoutMismatchError
from weightfabric.kernels.fp8 import check_block, quantize_fp8, scale_shape

SplitStyle = Literal["even", "chunk", "tensor_split", "sizes"]
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Split:
    """How one dimension of a tensor is divided over ``parts`` ranks.

    Attributes:
        dim: the dimension (0: rows, 1: columns) of each term, after `Term.index`.
        parts: the number of ranks.
        style: ``even`` (must divide: vLLM, SGLang, Megatron), ``chunk`` (``torch.chunk``,
            FSDP2's DTensor ``Shard``), ``tensor_split`` (near-equal, larger first) or
            ``sizes`` (explicit, in units).
        unit: rows (or columns) per indivisible unit, e.g. ``head_dim`` for heads.
        replicate: when the units are fewer than ``parts`` and divide them, rank ``r``
            gets unit ``r // (parts // units)`` (kv heads at tp > num_kv_heads).
        pad_to: pad the extent to a multiple of this first, then split it evenly; the
            padding is zeros in the target (vocab-parallel embeddings, vLLM: 64).
        sizes: with ``style="sizes"``, units per rank.
    """

    dim: int
    parts: int
    style: SplitStyle = "even"
    unit: int = 1
    replicate: bool = False
    pad_to: int | None = None
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise LayoutError(f"Split: dim must be 0 or 1, got {self.dim}")
        if not isinstance(self.parts, int) or self.parts < 1 or self.unit < 1:
            raise LayoutError(f"Split: parts and unit must be positive ints, got "
                              f"parts={self.parts!r} unit={self.unit!r}")
        if self.style not in ("even", "chunk", "tensor_split", "sizes"):
            raise LayoutError(f"Split: unknown style {self.style!r}")
        if (self.style == "sizes") != (self.sizes is not None):
            raise LayoutError("Split: style='sizes' goes with sizes=(...) and only with it")
        if self.sizes is not None and (len(self.sizes) != self.parts or min(self.sizes) < 0):
            raise LayoutError(f"Split: sizes {self.sizes} must be {self.parts} counts >= 0")
        if self.pad_to is not None and (self.pad_to < 1 or self.style != "even"):
            raise LayoutError("Split: pad_to is a positive int, with style='even'")

    def padded(self, extent: int) -> int:
        """The extent after padding (itself without ``pad_to``)."""
        if self.pad_to is None:
            return extent
        return -(-extent // self.pad_to) * self.pad_to

    def range(self, extent: int, rank: int) -> tuple[int, int]:
        """Rows (or columns) ``[start, stop)`` of ``extent`` that ``rank`` holds.

        With ``pad_to``, the range is in the padded extent; rows past ``extent`` are
        padding.

        Raises:
            LayoutError: the extent does not fit the split (why, in the message).
        """
        if not 0 <= rank < self.parts:
            raise LayoutError(f"rank {rank} outside 0..{self.parts - 1}")
        if self.pad_to is not None:
            padded = self.padded(extent)
            if padded % self.parts:
                raise LayoutError(f"{extent} padded to {padded} does not split evenly over "
                                  f"{self.parts} ranks")
            per = padded // self.parts
            return rank * per, (rank + 1) * per
        if extent % self.unit:
            raise LayoutError(f"extent {extent} is not a whole number of units of {self.unit}")
        units = extent // self.unit
        a, b = self._unit_range(units, rank)
        return a * self.unit, b * self.unit

    def _unit_range(self, units: int, rank: int) -> tuple[int, int]:
        parts = self.parts
        if self.style == "even":
            if units % parts == 0:
                per = units // parts
                return rank * per, (rank + 1) * per
            if self.replicate and units and parts % units == 0:
                u = rank // (parts // units)
                return u, u + 1
            hint = " or divide the ranks (replicate=True)" if self.replicate else ""
            raise LayoutError(f"{units} units do not split evenly over {parts} ranks{hint}")
        if self.style == "chunk":
            per = -(-units // parts)
            return min(rank * per, units), min((rank + 1) * per, units)
        if self.style == "tensor_split":
            base, extra = divmod(units, parts)
            start = rank * base + min(rank, extra)
            return start, start + base + (rank < extra)
        assert self.sizes is not None
        if sum(self.sizes) != units:
            raise LayoutError(f"sizes {self.sizes} sum to {sum(self.sizes)}, not {units} units")
        start = sum(self.sizes[:rank])
        return start, start + self.sizes[rank]


@dataclass(frozen=True)
class Term:
    """One published tensor, or part of one, that a rule reads.

    Attributes:
        name: the published tensor's name (an alias of a tied tensor works too).
        index: take this entry of its first dimension (one expert of a stacked tensor).
        rows: then only rows ``[a, b)`` of what is left (one half of a fused tensor).
    """

    name: str
    index: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Rule:
    """How one target tensor of an engine rank is made.

    Attributes:
        target: the target tensor's name in the engine.
        entries: one tuple of `Term`s per entry; a single entry is an ordinary tensor,
            several are stacked along a new first dimension (MoE experts).
        cat_dim: the terms of an entry are concatenated along this dim (after `split`).
        split: how every term is cut over the tensor-parallel ranks (None: whole).
        ep: how the entries are divided over expert-parallel ranks (None: all).
        dtype: the target's dtype (None: the published one); ignored with ``fp8_block``.
        fp8_block: quantise to float8_e4m3fn in blocks of this edge, with float32
            scales in the tensor ``target`` + `EngineLayout.scale_suffix`.
        stack: stack the entries even if there is one (a stack of one expert).
        flat: ``split`` and ``ep`` divide over all ``tp * ep`` ranks of the layout and
            take the rank itself (``ep_rank * tp + tp_rank``), not its tensor- and
            expert-parallel indices: vLLM's fused MoE layers, whose group spans the
            data-parallel engines' tensor-parallel ranks.
    """

    target: str
    entries: tuple[tuple[Term, ...], ...]
    cat_dim: int = 0
    split: Split | None = None
    ep: Split | None = None
    dtype: torch.dtype | None = None
    fp8_block: int | None = None
    stack: bool = False
    flat: bool = False

    def __post_init__(self) -> None:
        if not self.target or not self.entries or not all(self.entries):
            raise LayoutError(f"rule {self.target!r}: needs a target and at least one term")
        if self.cat_dim not in (0, 1):
            raise LayoutError(f"rule {self.target!r}: cat_dim must be 0 or 1")
        if self.ep is not None and (len(self.entries) < 2 and self.ep.parts > 1):
            raise LayoutError(f"rule {self.target!r}: ep splits stacked entries; it has one")
        if self.fp8_block is not None:
            try:
                check_block(self.fp8_block, f"rule {self.target!r}")
            except ValueError as exc:
                raise LayoutError(str(exc)) from None

    @property
    def stacked(self) -> bool:
        """Several entries, stacked along a new first dimension."""
        return self.stack or len(self.entries) > 1 or self.ep is not None

    def describe(self) -> str:
        """One line for error messages."""
        names = sorted({t.name for e in self.entries for t in e})
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
        return f"rule {self.target!r} <- [{shown}]"


@dataclass(frozen=True)
class Piece:
    """A block of one published tensor copied into a target tensor.

    Source: entry ``index`` (if set) of published tensor ``source``, its rows ``rows`` and
    columns ``cols`` (None for a 1-D tensor). Destination: stack entry ``entry`` (None when
    not stacked) of ``target``, at row ``row`` and column ``col``.
    """

    target: str
    source: str
    index: int | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    entry: int | None
    row: int
    col: int

    @property
    def shape(self) -> tuple[int, int]:
        """Rows and columns of the block (1 column for a 1-D source)."""
        c = self.cols[1] - self.cols[0] if self.cols is not None else 1
        return self.rows[1] - self.rows[0], c


@dataclass(frozen=True)
class Published:
    """A published tensor as a layout sees it: its logical shape and stored dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TargetTensor:
    """One tensor of a bound rank: its shape, dtype, and the pieces it is made of.

    ``scale`` is set for an fp8 target: the name and shape of its scales tensor;
    ``stage_dtype`` is the dtype the pieces are assembled in before quantising.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    padded: bool = False
    scale: tuple[str, tuple[int, ...]] | None = None
    fp8_block: int | None = None
    stage_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class BoundLayout:
    """An `EngineLayout` checked against a published version, for one rank."""

    layout: EngineLayout
    rank: int
    targets: tuple[TargetTensor, ...]

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor this rank holds (fp8 scales included)."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for t in self.targets:
            out[t.name] = (t.shape, t.dtype)
            if t.scale is not None:
                out[t.scale[0]] = (t.scale[1], torch.float32)
        return out

    def empty(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Fresh tensors of this rank's shapes and dtypes (e.g. an engine's parameters)."""
        return {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in self.tensor_specs().items()}

    @property
    def sources(self) -> set[str]:
        """The published tensors this rank reads."""
        return {p.source for t in self.targets for p in t.pieces}


@dataclass(frozen=True)
class EngineLayout:
    """A named list of `Rule`s: every tensor of an engine's rank, from published tensors.

    Attributes:
        name: a short name (``vllm-qwen2-tp2``); the derived replicas' model names use it.
        rules: one per target tensor.
        ranks: how many ranks the layout has (tp x ep); `bind` takes one of them.
        tp, ep: the tensor- and expert-parallel degrees (rank = ep_rank * tp + tp_rank).
        scale_suffix: fp8 targets' scales are named ``target + scale_suffix``.
        expects: (name, shape) of published tensors the layout was written for; `bind`
            rejects a version whose tensor of that name has another shape (rules alone
            name tensors, and would fit a model of other sizes). Empty: no check.
    """

    name: str
    rules: tuple[Rule, ...]
    tp: int = 1
    ep: int = 1
    scale_suffix: str = "_scale_inv"
    expects: tuple[tuple[str, tuple[int, ...]], ...] = ()
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or "@" in self.name or "/" in self.name:
            raise LayoutError(f"layout name {self.name!r}: give a non-empty name without @ or /")
        if self.tp < 1 or self.ep < 1:
            raise LayoutError(f"layout {self.name!r}: tp and ep must be >= 1")
        names = Counter(r.target for r in self.rules)
        names.update(r.target + self.scale_suffix for r in self.rules if r.fp8_block is not None)
        dup = [n for n, k in names.items() if k > 1]
        if dup:
            raise LayoutError(f"layout {self.name!r}: target names appear twice: {sorted(dup)}")
        for r in self.rules:
            self._check_parts(r)
        object.__setattr__(self, "key", f"{self.name}-{self._digest()}")

    @property
    def ranks(self) -> int:
        """Ranks of the layout: tp x ep."""
        return self.tp * self.ep

    def _check_parts(self, r: Rule) -> None:
        """A rule's splits divide over the layout's ranks: tp and ep (a flat rule: all)."""
        for what, s, parts in (("split", r.split, self.ranks if r.flat else self.tp),
                               ("ep", r.ep, self.ranks if r.flat else self.ep)):
            if s is not None and s.parts != parts:
                kind = "flat rule: tp x ep" if r.flat else ("tp" if what == "split" else "ep")
                raise LayoutError(f"layout {self.name!r}: {r.describe()}: its {what} is over "
                                  f"{s.parts} ranks; the layout has {parts} ({kind})")

    def _digest(self) -> str:
        wire: list[object] = [self.tp, self.ep, self.scale_suffix,
                              [_rule_wire(r) for r in self.rules]]
        if self.expects:  # keys of layouts without expectations unchanged
            wire.append([[n, list(s)] for n, s in self.expects])
        body = json.dumps(wire, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:10]

    def _check_expects(self, published: Mapping[str, Published],
                       aliases: Mapping[str, str]) -> None:
        for name, shape in self.expects:
            p = published.get(aliases.get(name, name))
            if p is None or tuple(p.shape) == tuple(shape):
                continue
            rule = next((r for r in self.rules for e in r.entries for t in e if t.name == name),
                        None)
            which = f"{rule.describe()}: " if rule is not None else ""
            raise LayoutMismatchError(f"layout {self.name!r}: {which}{name!r} is "
                                      f"{tuple(p.shape)} in the version; the layout was "
                                      f"written for {tuple(shape)} (another model's config?)")

    def derived_model(self, model: str, rank: int) -> str:
        """The hub's name for rank ``rank``'s derived replicas of ``model`` in this layout."""
        return f"{model}@{self.key}.r{rank}"

    def bind(self, published: Mapping[str, Published], rank: int, *,
             aliases: Mapping[str, str] | None = None) -> BoundLayout:
        """Check the layout against the published tensors and plan rank ``rank``.

        Args:
            published: name -> `Published` (logical shape, stored dtype).
            rank: the engine rank, ``0 <= rank < ranks``.
            aliases: published aliases (a tied tensor's second name -> the published name).

        Raises:
            LayoutMismatchError: a rule names a tensor the version lacks, or its shapes do
                not fit the rule (the message names the tensor and the rule).
            LayoutError: ``rank`` is out of range.
        """
        if not 0 <= rank < self.ranks:
            raise LayoutError(f"layout {self.name!r} has {self.ranks} ranks; rank {rank} is outside")
        tp_rank, ep_rank = rank % self.tp, rank // self.tp
        aliases = dict(aliases or {})
        self._check_expects(published, aliases)
        targets = tuple(_bind_rule(r, published, aliases, rank if r.flat else tp_rank,
                                   rank if r.flat else ep_rank, self.scale_suffix)
                        for r in self.rules)
        return BoundLayout(self, rank, targets)


def _rule_wire(r: Rule) -> list[object]:
    def split(s: Split | None) -> object:
        return None if s is None else [s.dim, s.parts, s.style, s.unit, s.replicate, s.pad_to,
                                       list(s.sizes or ())]
    wire = [r.target, [[[t.name, t.index, list(t.rows or ())] for t in e] for e in r.entries],
            r.cat_dim, split(r.split), split(r.ep), str(r.dtype), r.fp8_block, r.stacked]
    return wire + ["flat"] if r.flat else wire  # keys of layouts without flat rules unchanged


def _term_shape(term: Term, p: Published, rule: Rule) -> tuple[int, ...]:
    shape = p.shape
    if term.index is not None:
        if len(shape) < 2 or not 0 <= term.index < shape[0]:
            raise LayoutMismatchError(f"{rule.describe()}: {term.name!r} is {tuple(shape)}; "
                                      f"it has no entry {term.index} along dim 0")
        shape = shape[1:]
    if term.rows is not None:
        a, b = term.rows
        if not 0 <= a < b <= shape[0]:
            raise LayoutMismatchError(f"{rule.describe()}: rows [{a}, {b}) are outside "
                                      f"{term.name!r} of {tuple(shape)} rows")
        shape = (b - a, *shape[1:])
    if len(shape) not in (1, 2):
        raise LayoutMismatchError(f"{rule.describe()}: {term.name!r} is {len(shape)}-D "
                                  f"{tuple(p.shape)}; a term is 1-D or 2-D (use index=)")
    return tuple(shape)


def _bind_rule(rule: Rule, published: Mapping[str, Published], aliases: Mapping[str, str],
               tp_rank: int, ep_rank: int, scale_suffix: str) -> TargetTensor:
    entries = range(len(rule.entries))
    if rule.ep is not None:
        try:
            a, b = rule.ep.range(len(rule.entries), ep_rank)
        except LayoutError as exc:
            raise LayoutMismatchError(f"{rule.describe()}: expert split: {exc}") from None
        entries = range(a, b)
    pieces: list[Piece] = []
    shape: tuple[int, ...] | None = None
    dtypes: set[torch.dtype] = set()
    padded = False
    for k, e in enumerate(entries):
        entry_shape, entry_pieces, pad, kinds = _bind_entry(rule, rule.entries[e], published,
                                                            aliases, tp_rank)
        if shape is not None and entry_shape != shape:
            raise LayoutMismatchError(f"{rule.describe()}: stacked entries differ in shape "
                                      f"({shape} vs {entry_shape} at entry {e})")
        shape, padded = entry_shape, padded or pad
        dtypes |= kinds
        pieces += [Piece(p.target, p.source, p.index, p.rows, p.cols,
                         k if rule.stacked else None, p.row, p.col) for p in entry_pieces]
    if shape is None:  # this rank holds none of the entries: a stack of 0 of entry 0's shape
        shape, _, _, dtypes = _bind_entry(rule, rule.entries[0], published, aliases, tp_rank)
    if rule.stacked:
        shape = (len(entries), *shape)
    if len(dtypes) > 1:
        raise LayoutMismatchError(f"{rule.describe()}: its tensors are published as "
                                  f"{sorted(map(str, dtypes))}; give them one dtype")
    source_dtype = dtypes.pop() if dtypes else torch.float32
    if source_dtype == FP8:
        raise LayoutMismatchError(f"{rule.describe()}: the published tensors are fp8; layouts "
                                  "read fp8 versions with ReshardReader, not rules")
    if rule.fp8_block is None:
        return TargetTensor(rule.target, shape, rule.dtype or source_dtype, tuple(pieces), padded)
    if len(shape) - rule.stacked != 2:
        raise LayoutMismatchError(f"{rule.describe()}: fp8 targets are 2-D weights "
                                  f"(or stacks of them); this one is {shape}")
    grid = scale_shape(tuple(shape[-2:]), rule.fp8_block)
    scales = (rule.target + scale_suffix, (shape[0], *grid) if rule.stacked else grid)
    return TargetTensor(rule.target, shape, FP8, tuple(pieces), padded, scales, rule.fp8_block,
                        stage_dtype=rule.dtype or source_dtype)


def _bind_entry(rule: Rule, terms: Sequence[Term], published: Mapping[str, Published],
                aliases: Mapping[str, str], tp_rank: int
                ) -> tuple[tuple[int, ...], list[Piece], bool, set[torch.dtype]]:
    """One entry's shape, pieces (entry None), whether padded, and its terms' dtypes."""
    pieces, at, other, padded, dtypes = [], 0, None, False, set()
    dims = None
    for term in terms:
        source = aliases.get(term.name, term.name)
        if source not in published:
            raise LayoutMismatchError(f"{rule.describe()}: the version has no tensor "
                                      f"{term.name!r}")
        p = published[source]
        dtypes.add(p.dtype)
        shape = _term_shape(term, p, rule)
        if dims is not None and len(shape) != dims:
            raise LayoutMismatchError(f"{rule.describe()}: terms mix 1-D and 2-D tensors")
        dims = len(shape)
        rows, cols = shape[0], (shape[1] if len(shape) == 2 else None)
        r0, r1, c0, c1 = 0, rows, 0, cols or 1
        extent = [rows, cols or 1]
        if rule.split is not None:
            if rule.split.dim >= len(shape):
                raise LayoutMismatchError(f"{rule.describe()}: cannot split dim "
                                          f"{rule.split.dim} of 1-D {term.name!r}")
            try:
                a, b = rule.split.range(shape[rule.split.dim], tp_rank)
            except LayoutError as exc:
                raise LayoutMismatchError(f"{rule.describe()}: {term.name!r} {tuple(shape)}, "
                                          f"split {rule.split.style} over {rule.split.parts} "
                                          f"ranks along dim {rule.split.dim}: {exc}") from None
            real = shape[rule.split.dim]
            extent[rule.split.dim] = b - a
            padded = padded or b > real
            if rule.split.dim == 0:
                r0, r1 = min(a, real), min(b, real)
            else:
                c0, c1 = min(a, real), min(b, real)
        if rule.cat_dim >= len(shape):
            raise LayoutMismatchError(f"{rule.describe()}: cannot concatenate 1-D "
                                      f"{term.name!r} along dim {rule.cat_dim}")
        kept = extent[1 - rule.cat_dim] if len(shape) == 2 else None
        if other is not None and kept != other:
            raise LayoutMismatchError(f"{rule.describe()}: {term.name!r} {tuple(shape)} does "
                                      "not line up with the other terms to concatenate")
        other = kept
        base_row = term.rows[0] if term.rows is not None else 0
        if r1 > r0 and c1 > c0:
            pieces.append(Piece(rule.target, source, term.index, (base_row + r0, base_row + r1),
                                (c0, c1) if cols is not None else None, None,
                                at if rule.cat_dim == 0 else 0, at if rule.cat_dim == 1 else 0))
        at += extent[rule.cat_dim]
    assert dims is not None
    if dims == 1:
        out: tuple[int, ...] = (at,)
    else:
        out = (at, other) if rule.cat_dim == 0 else (other, at)  # type: ignore[assignment]
    return out, pieces, padded, dtypes


# --------------------------------------------------------------------- reference
def derive_reference(layout: EngineLayout, tensors: Mapping[str, torch.Tensor], rank: int, *,
                     aliases: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of ``layout``, from whole published tensors, in plain torch.

    The meaning of a layout, written for clarity: tests and small jobs use it; readers
    of the fabric produce the same bytes from the publishers' shards
    (`fabric.relayout.derive`).

    Raises:
        LayoutMismatchError, LayoutError: as `EngineLayout.bind`.
    """
    published = {n: Published(tuple(t.shape), t.dtype) for n, t in tensors.items()}
    bound = layout.bind(published, rank, aliases=aliases)
    out = {}
    for t in bound.targets:
        stage = torch.zeros(t.shape, dtype=t.stage_dtype or t.dtype)
        for p in t.pieces:
            assemble(stage, p, source_block(tensors[p.source], p))
        if t.scale is None:
            out[t.name] = stage
            continue
        assert t.fp8_block is not None
        q, s = quantize_stack(stage, t.fp8_block)
        out[t.name], out[t.scale[0]] = q, s
    return out


def source_block(tensor: torch.Tensor, p: Piece) -> torch.Tensor:
    """The block of a whole published tensor that piece ``p`` reads, as 2-D."""
    t = tensor[p.index] if p.index is not None else tensor
    t = t[p.rows[0]:p.rows[1]]
    return t[:, p.cols[0]:p.cols[1]] if p.cols is not None else t.reshape(-1, 1)


def assemble(target: torch.Tensor, p: Piece, block: torch.Tensor) -> None:
    """Write ``block`` (2-D, any dtype) where piece ``p`` goes in ``target`` (cast as needed)."""
    dst = target[p.entry] if p.entry is not None else target
    if dst.dim() == 1:
        dst[p.row:p.row + block.shape[0]].copy_(block.reshape(-1))
    else:
        dst[p.row:p.row + block.shape[0], p.col:p.col + block.shape[1]].copy_(block)


def quantize_stack(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise fp8 of a 2-D tensor, or of each entry of a stack of them."""
    if x.dim() == 2:
        return quantize_fp8(x, block=block)
    pairs = [quantize_fp8(e, block=block) for e in x]
    if not pairs:
        return (torch.empty(x.shape, dtype=FP8, device=x.device),
                torch.empty((0, *scale_shape(tuple(x.shape[1:]), block)), device=x.device))
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def identity_layout(shapes: Mapping[str, Sequence[int]], *, name: str = "identity",
                    dtype: torch.dtype | None = None) -> EngineLayout:
    """Every tensor as it is published (optionally cast): a plain unsharded reader.

    Args:
        shapes: the published tensors' names and shapes (a 3-D tensor is a stack).
        name: the layout's name.
        dtype: cast every tensor to this dtype.
    """
    def rule(n: str, shape: Sequence[int]) -> Rule:
        if len(shape) == 3:
            return Rule(n, tuple((Term(n, index=i),) for i in range(shape[0])), dtype=dtype,
                        stack=True)
        return Rule(n, ((Term(n),),), dtype=dtype)
    return EngineLayout(name, tuple(rule(n, s) for n, s in shapes.items()),
                        expects=tuple((n, tuple(s)) for n, s in shapes.items()))


__all__ = ["BoundLayout", "EngineLayout", "Piece", "Published", "Rule", "Split", "TargetTensor",
           "Term", "assemble", "derive_reference", "identity_layout", "quantize_stack",
           "source_block"]
