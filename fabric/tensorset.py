"""Tensor sets as flat byte spaces: layouts, manifests, and the checks between them.

A model's tensors are laid out with `kernels.plan_layout` (large tensors aligned,
tiny ones compacted) in one arena region; the manifest published to the hub is
that layout plus a chunk size and one checksum per chunk.

Before that, a set is prepared (`prepare`): names lose the components wrappers add
(`normalize_name`), tensors sharing storage (tied weights) are laid out once and
named as aliases of the first (`split_aliases`), and floating-point tensors may be
stored in another dtype, cast as they are packed (`cast_map`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from weightfabric.fabric.errors import ManifestMismatchError, TensorSetError
from weightfabric.fabric.manifest import Manifest, ShardedTensor, TensorSpec
from weightfabric.kernels import PackLayout, Slot, chunk_checksums, plan_layout

DEFAULT_CHUNK_SIZE = 16 << 20
ALIGNMENT = 256
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""Name components wrappers insert anywhere: torch.compile, FSDP1, activation checkpointing."""
LEADING_WRAPPER = "module"
"""The component DDP (and DataParallel) put first."""
CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes `cast_map` casts, and may cast to."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype a `dtype_name` names (``bfloat16`` -> ``torch.bfloat16``), or None."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def named_tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a module, or a mapping, checked.

    Parameters and persistent buffers of a module (its state_dict names), or a mapping,
    checked by `check_tensor_set`.

    Raises:
        TensorSetError: not a module or a mapping of tensors, or not a set a store can
            hold (see `check_tensor_set`).
    """
    if isinstance(obj, nn.Module):
        tensors = dict(obj.state_dict(keep_vars=True).items())
    elif isinstance(obj, Mapping):
        tensors = dict(obj)
    else:
        raise TensorSetError(f"expected an nn.Module or a mapping of name -> tensor, got "
                             f"{type(obj).__name__}")
    return check_tensor_set(tensors)


def check_tensor_set(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` if they form a tensor set.

    One with a layout (a meta-device set has one, for sizing; a store refuses meta tensors
    when it takes them, `check_has_data`).

    Raises:
        TensorSetError: the set is empty, a name is not a non-empty string, or a value
            is not a tensor.
    """
    if not tensors:
        raise TensorSetError("an empty tensor set cannot be published or fetched: pass a "
                             "module with parameters or a non-empty mapping of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise TensorSetError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TensorSetError(f"expected an nn.Module or a mapping of name -> tensor; "
                                 f"{name!r} is a {type(t).__name__}")
    return tensors


def normalize_name(name: str) -> str:
    """``name`` without the components wrapper modules add.

    ``_orig_mod`` (torch.compile), ``_fsdp_wrapped_module`` (FSDP1) and
    ``_checkpoint_wrapped_module`` (activation checkpointing) are dropped wherever they
    are, ``module`` (DDP) only as the first component; a wrapper is a module, so the
    last component (the tensor's own name) always stays.

    Example:
        >>> normalize_name("module._orig_mod.layers.0._checkpoint_wrapped_module.w")
        'layers.0.w'
    """
    *path, leaf = name.split(".")
    path = [c for c in path if c not in WRAPPER_COMPONENTS]
    if path and path[0] == LEADING_WRAPPER:
        path = path[1:]
    return ".".join([*path, leaf])


def normalize_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` renamed by `normalize_name`, in the same order.

    Raises:
        TensorSetError: two names become the same one.
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in tensors.items():
        new = normalize_name(name)
        if new in out:
            raise TensorSetError(
                f"tensors {origin[new]!r} and {name!r} are both named {new!r} once wrapper "
                "components (module., _orig_mod., ...) are stripped; rename one, or pass "
                "normalize_names=False")
        out[new], origin[new] = t, name
    return out


def split_aliases(tensors: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], tuple[tuple[str, str], ...]]:
    """The tensors to lay out, and ``(alias, published name)`` for the others.

    Tensors with data that share it exactly (same address, shape, strides, dtype and
    device: tied weights) are laid out once, under the first name; each later one is
    an alias of it. Empty and meta tensors are never aliases.
    """
    first: dict[tuple[object, ...], str] = {}
    published: dict[str, torch.Tensor] = {}
    aliases: list[tuple[str, str]] = []
    for name, t in tensors.items():
        if t.is_meta or t.numel() == 0:
            published[name] = t
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key in first:
            aliases.append((name, first[key]))
        else:
            first[key] = name
            published[name] = t
    return published, tuple(aliases)


def cast_map(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
             ) -> dict[str, torch.dtype]:
    """Name -> ``dtype`` for each floating-point tensor to store in ``dtype``.

    float32, bfloat16 and float16 tensors of another dtype are cast (fp8, integer and
    other tensors keep theirs).

    Raises:
        TensorSetError: ``dtype`` is not float32, bfloat16 or float16, or a tensor's cast
            is one packing cannot do (only float32 <-> bfloat16 / float16).
    """
    if dtype is None:
        return {}
    if dtype not in CASTABLE:
        raise TensorSetError(f"dtype must be one of {', '.join(map(dtype_name, CASTABLE))}, "
                             f"got {dtype!r}")
    out: dict[str, torch.dtype] = {}
    for name, t in tensors.items():
        if t.dtype not in CASTABLE or t.dtype == dtype:
            continue
        if torch.float32 not in (t.dtype, dtype):
            raise TensorSetError(
                f"tensor {name!r} is {dtype_name(t.dtype)}: packing casts float32 to and from "
                f"bfloat16 / float16, not {dtype_name(t.dtype)} to {dtype_name(dtype)}; cast "
                "it yourself, or publish in float32")
        out[name] = dtype
    return out


@dataclass(frozen=True)
class PreparedSet:
    """A tensor set ready to pack: what `prepare` returns.

    Attributes:
        tensors: name -> tensor of every name, aliases included (as given).
        published: the tensors laid out (no aliases), in layout order of the input.
        aliases: ``(alias, published name)`` pairs.
        layout: the layout of ``published`` (cast dtypes in its slots).
        sharding: slices of larger tensors (DTensor shards), for the manifest.
    """

    tensors: dict[str, torch.Tensor]
    published: dict[str, torch.Tensor]
    aliases: tuple[tuple[str, str], ...]
    layout: PackLayout
    sharding: tuple[ShardedTensor, ...] = ()


def prepare(tensors: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
            sharding: tuple[ShardedTensor, ...] = ()) -> PreparedSet:
    """Split off aliases and lay the rest out, floating-point ones cast to ``dtype``.

    Raises:
        TensorSetError: an empty set, or a cast `cast_map` refuses.
    """
    published, aliases = split_aliases(tensors)
    layout = layout_of(published, cast=cast_map(published, dtype))
    return PreparedSet(tensors, published, aliases, layout, sharding)


def check_has_data(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` if every one has data to publish or attach.

    Raises:
        TensorSetError: a tensor is on the meta device.
    """
    for name, t in tensors.items():
        if t.is_meta:
            raise TensorSetError(f"tensor {name!r} is on the meta device and has no data; "
                                 "materialise the model (e.g. to_empty + load) first")
    return tensors


def layout_of(tensors: Mapping[str, torch.Tensor],
              cast: Mapping[str, torch.dtype] | None = None) -> PackLayout:
    """The byte layout of a tensor set.

    Bytes travel as they are, except for tensors named in ``cast`` (name -> the dtype
    stored, see `cast_map`), which packing casts. A set of only empty tensors spans one
    block of `ALIGNMENT` zero bytes (a region cannot be empty).

    Raises:
        TensorSetError: the set is empty.
    """
    if not tensors:
        raise TensorSetError("an empty tensor set cannot be published or fetched")
    layout = plan_layout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                         alignment=ALIGNMENT, cast=dict(cast or {}))
    if layout.nbytes == 0:  # only empty tensors (a rank's uneven DTensor shards): memory
        layout = PackLayout(layout.slots, ALIGNMENT, layout.alignment)  # needs a byte
    return layout


def check_chunk_size(chunk_size: int) -> int:
    """`chunk_size`, if it is a positive multiple of `ALIGNMENT` (else ValueError)."""
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % ALIGNMENT:
        raise ValueError(f"chunk_size must be a positive multiple of {ALIGNMENT}, got {chunk_size!r}")
    return chunk_size


def manifest_of(layout: PackLayout, buffer: torch.Tensor, chunk_size: int, *,
                checksums: list[int] | None = None,
                sharding: tuple[ShardedTensor, ...] = (),
                aliases: tuple[tuple[str, str], ...] = ()) -> Manifest:
    """The manifest of `buffer` (laid out by `layout`) with per-chunk checksums.

    ``checksums``: the buffer's, if already computed (e.g. while packing it).
    """
    if checksums is None:
        checksums = chunk_checksums(buffer[:layout.nbytes], chunk_size).tolist()
    return layout_manifest(layout, chunk_size, tuple(checksums), sharding=sharding,
                           aliases=aliases)


def layout_manifest(layout: PackLayout, chunk_size: int, checksums: tuple[int, ...] = (), *,
                    sharding: tuple[ShardedTensor, ...] = (),
                    aliases: tuple[tuple[str, str], ...] = ()) -> Manifest:
    """The manifest of bytes laid out by ``layout`` (no ``checksums``: not made yet)."""
    specs = tuple(TensorSpec(s.name, s.shape, dtype_name(s.dtype), s.nbytes, s.offset)
                  for s in layout)
    return Manifest(specs, chunk_size, checksums, layout.nbytes, sharding=sharding,
                    aliases=aliases)


def check_compatible(layout: PackLayout, manifest: Manifest, *, model: str, version: int,
                     aliases: Mapping[str, str] | None = None) -> None:
    """Raise `ManifestMismatchError` if the published bytes cannot land in `layout`.

    Raise `ManifestMismatchError` naming what differs when the published bytes cannot land
    in `layout` as they are (names, shapes, dtypes or offsets differ), or when the local
    set ties tensors (``aliases``: alias -> published name) other than the published one.
    """
    where = f"{model!r} v{version}"
    _check_same_ties(dict(aliases or {}), manifest.alias_map(), where)
    theirs = {t.name: t for t in manifest.tensors}
    for slot in layout:
        spec = theirs.pop(slot.name, None)
        if spec is None:
            raise ManifestMismatchError(f"{where} has no tensor {slot.name!r}; the local model "
                                        "expects it (different architecture?)")
        mine = (slot.shape, dtype_name(slot.dtype))
        if (spec.shape, spec.dtype) != mine:
            raise ManifestMismatchError(
                f"{where}: tensor {slot.name!r} is {spec.dtype}{list(spec.shape)} there, "
                f"{mine[1]}{list(mine[0])} here; reshape or cast the local model to match")
        if spec.offset != slot.offset:
            raise ManifestMismatchError(f"{where}: tensor {slot.name!r} lies at byte "
                                        f"{spec.offset} there, {slot.offset} here (tensor order "
                                        "differs); build the model with the same parameter order")
    if theirs:
        raise ManifestMismatchError(f"{where} has tensors the local model lacks: "
                                    f"{', '.join(sorted(theirs)[:5])}")
    if manifest.total_bytes != layout.nbytes:
        raise ManifestMismatchError(f"{where} spans {manifest.total_bytes} bytes, the local "
                                    f"layout {layout.nbytes}")


def _check_same_ties(mine: dict[str, str], theirs: dict[str, str], where: str) -> None:
    """Raise `ManifestMismatchError` unless both sides tie the same tensors."""
    for alias in sorted(set(mine) | set(theirs)):
        if mine.get(alias) == theirs.get(alias):
            continue
        if alias not in mine:
            raise ManifestMismatchError(
                f"{where} publishes {alias!r} once, as an alias of {theirs[alias]!r} (tied "
                "weights); the local model holds it as a tensor of its own: tie it to "
                f"{theirs[alias]!r} here too")
        if alias not in theirs:
            raise ManifestMismatchError(
                f"{where} publishes {alias!r} as a tensor of its own; the local model ties it "
                f"to {mine[alias]!r}: untie it here, or tie it in the publisher too")
        raise ManifestMismatchError(f"{where} ties {alias!r} to {theirs[alias]!r}, the local "
                                    f"model to {mine[alias]!r}")


def layout_from_manifest(manifest: Manifest) -> PackLayout:
    """The layout a reader without a local model uses: exactly the publisher's."""
    slots = tuple(Slot(t.name, t.shape, getattr(torch, t.dtype), getattr(torch, t.dtype),
                       t.offset, t.nbytes) for t in manifest.tensors)
    return PackLayout(slots, manifest.total_bytes, ALIGNMENT)


def views(layout: PackLayout, buffer: torch.Tensor,
          aliases: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Name -> tensor viewing its slot of `buffer`; each alias views its tensor's slot."""
    out = {s.name: buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
           for s in layout}
    for alias, name in (aliases or {}).items():
        out[alias] = out[name]
    return out
