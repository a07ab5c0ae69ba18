"""Tensor sets as flat byte spaces: layouts, manifests, and the checks between them.

A model's tensors are laid out with `kernels.plan_layout` (large tensors aligned,
tiny ones compacted) in one arena region; the manifest published to the hub is
that layout plus a chunk size and one checksum per chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from weightfabric.fabric.errors import ManifestMismatchError, TensorSetError
from weightfabric.fabric.manifest import Manifest, TensorSpec
from weightfabric.kernels import PackLayout, Slot, chunk_checksums, plan_layout

DEFAULT_CHUNK_SIZE = 16 << 20
ALIGNMENT = 256


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


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


def layout_of(tensors: Mapping[str, torch.Tensor]) -> PackLayout:
    """The byte layout of a tensor set (no casts: bytes travel as they are).

    Raises:
        TensorSetError: the set is empty.
    """
    if not tensors:
        raise TensorSetError("an empty tensor set cannot be published or fetched")
    return plan_layout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                       alignment=ALIGNMENT)


def check_chunk_size(chunk_size: int) -> int:
    """`chunk_size`, if it is a positive multiple of `ALIGNMENT` (else ValueError)."""
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % ALIGNMENT:
        raise ValueError(f"chunk_size must be a positive multiple of {ALIGNMENT}, got {chunk_size!r}")
    return chunk_size


def manifest_of(layout: PackLayout, buffer: torch.Tensor, chunk_size: int) -> Manifest:
    """The manifest of `buffer` (laid out by `layout`) with per-chunk checksums."""
    checksums = chunk_checksums(buffer[:layout.nbytes], chunk_size).tolist()
    return layout_manifest(layout, chunk_size, tuple(checksums))


def layout_manifest(layout: PackLayout, chunk_size: int,
                    checksums: tuple[int, ...] = ()) -> Manifest:
    """The manifest of bytes laid out by ``layout`` (without checksums: not made yet)."""
    specs = tuple(TensorSpec(s.name, s.shape, dtype_name(s.dtype), s.nbytes, s.offset)
                  for s in layout)
    return Manifest(specs, chunk_size, checksums, layout.nbytes)


def check_compatible(layout: PackLayout, manifest: Manifest, *, model: str, version: int) -> None:
    """Raise `ManifestMismatchError` if the published bytes cannot land in `layout`.

    Raise `ManifestMismatchError` naming what differs when the published bytes cannot land
    in `layout` as they are (names, shapes, dtypes or offsets differ).
    """
    where = f"{model!r} v{version}"
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


def layout_from_manifest(manifest: Manifest) -> PackLayout:
    """The layout a reader without a local model uses: exactly the publisher's."""
    slots = tuple(Slot(t.name, t.shape, getattr(torch, t.dtype), getattr(torch, t.dtype),
                       t.offset, t.nbytes) for t in manifest.tensors)
    return PackLayout(slots, manifest.total_bytes, ALIGNMENT)


def views(layout: PackLayout, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name -> tensor viewing its slot of `buffer`."""
    return {s.name: buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
            for s in layout}
