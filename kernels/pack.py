"""Pack many tensors into one flat byte buffer, and unpack them back.

Layout rules: the buffer is a 1-D ``torch.uint8`` tensor of at least
``layout.nbytes`` bytes; tensor ``name`` occupies ``buffer[slot.offset :
slot.offset + slot.nbytes]`` as a dense row-major array of ``slot.dtype``.
Sources (for `pack`) and destinations (for `unpack`) may have any strides.
dtype rules: a tensor handed to `pack` must have ``slot.source_dtype``; the
buffer holds ``slot.dtype`` (float32 -> bfloat16 / float16 casts round to
nearest even). `unpack` writes into ``out`` tensors of any dtype the buffer's
dtype can be copied or cast to (equal, or bfloat16 / float16 -> float32).

On the Triton backend the whole set moves in one kernel launch (see
`kernels.segcopy`); the torch reference does a per-tensor ``copy_``.

Host cost per call: the checks of a call (names, shapes, dtypes, buffer, overlaps) depend
only on the layout object and each tensor's address, dtype, shape and strides, so a
call whose key (those properties) was checked before skips them, and reuses the
kernel tables built for that key (`_CHECKED`, a `kernels.segcopy.CheckCache`): a
repeated pack of the same tensors costs the host the key and the launch, not a view
and a check per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightfabric.kernels import packsum
from weightfabric.kernels.checksum import ChunkSums, check_chunking, chunk_checksums
from weightfabric.kernels.dispatch import choose_backend
from weightfabric.kernels.layout import PackLayout, Slot
from weightfabric.kernels.segcopy import (
    DEFAULT_BLOCK,
    CheckCache,
    Checked,
    Segment,
    element_kind,
    launch_table,
    segment_table,
)

_CHECKED = CheckCache()
"""Pack and unpack calls whose checks passed (`kernels.segcopy.CheckCache`)."""


def _call_key(what: str, tensors: Mapping[str, torch.Tensor], layout: PackLayout,
              buffer: torch.Tensor) -> tuple | None:
    """What the checks of a call depend on; None where it cannot be taken (they will fail).

    Every tensor's address, dtype, shape and strides (its span and its match with the
    slot), the buffer's too and its device; the layout by identity (held by the entry);
    the number of tensors (a key is only checked with every slot's name present, so an
    equal count means no extra names). Devices of the tensors are not in it:
    `choose_backend` checks them on every call.
    """
    try:
        return (what, id(layout), len(tensors), buffer.data_ptr(), buffer.dtype, buffer.shape,
                buffer.stride(), buffer.device,
                *((t.data_ptr(), t.dtype, t.shape, t.stride())
                  for t in (tensors[s.name] for s in layout)))
    except (KeyError, AttributeError, TypeError):
        return None


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def _check_buffer(buffer: torch.Tensor, layout: PackLayout, what: str) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
        got = buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise TypeError(f"{what}: buffer must be a torch.uint8 tensor, got {got}")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{what}: buffer must be 1-D and contiguous, got shape "
                         f"{tuple(buffer.shape)} strides {buffer.stride()}")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"{what}: buffer has {buffer.numel()} bytes, layout needs {layout.nbytes}")
    widest = max((s.dtype.itemsize for s in layout), default=1)
    if buffer.data_ptr() % widest:
        raise ValueError(f"{what}: buffer address {buffer.data_ptr():#x} is not aligned to "
                         f"{widest} bytes (misaligned)")


def _check_tensors(tensors: Mapping[str, torch.Tensor], layout: PackLayout, what: str,
                   *, exact_dtype: bool) -> None:
    names = set(layout.names)
    missing = [n for n in layout.names if n not in tensors]
    extra = [n for n in tensors if n not in names]
    if missing or extra:
        raise ValueError(f"{what}: tensors do not match the layout (missing {missing}, "
                         f"unexpected {extra})")
    for s in layout:
        t = tensors[s.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensor {s.name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != s.shape:
            raise ValueError(f"{what}: tensor {s.name!r} has shape {tuple(t.shape)}, layout says "
                             f"{s.shape}")
        if exact_dtype and t.dtype != s.source_dtype:
            raise TypeError(f"{what}: tensor {s.name!r} has dtype {t.dtype}, layout says "
                            f"{s.source_dtype}")
        if not exact_dtype:
            element_kind(s.dtype, t.dtype, f"{what}: tensor {s.name!r}")


def _view(buffer: torch.Tensor, s: Slot) -> torch.Tensor:
    return buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)


def pack_ref(tensors: Mapping[str, torch.Tensor], layout: PackLayout,
             buffer: torch.Tensor) -> torch.Tensor:
    """Torch reference of `pack`: a ``copy_`` per tensor into its buffer view.

    The copy casts and follows the source's strides as it goes: no temporary, whatever
    the tensor's dtype or layout.
    """
    for s in layout:
        _view(buffer, s).copy_(tensors[s.name])
    return buffer


def unpack_ref(buffer: torch.Tensor, layout: PackLayout,
               out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Torch reference of `unpack`: a ``copy_`` per tensor from its buffer view."""
    for s in layout:
        out[s.name].copy_(_view(buffer, s))
    return dict(out)


def pack(tensors: Mapping[str, torch.Tensor], layout: PackLayout, *,
         out: torch.Tensor | None = None, backend: str | None = None,
         block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Copy (and cast) every tensor into its slot of one flat byte buffer.

    Args:
        tensors: name -> tensor for every slot of ``layout`` (any strides).
        layout: from `plan_layout`.
        out: destination buffer (uint8, 1-D, contiguous, >= ``layout.nbytes``);
            allocated (zero-filled padding) on the tensors' device when None.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Returns:
        The buffer.

    Raises:
        ValueError: names, shapes or buffer size differ from the layout, the
            buffer is misaligned, or a source overlaps the buffer.
        TypeError: a tensor's dtype differs from ``slot.source_dtype``.
    """
    out, checked = _pack_target(tensors, layout, out)
    if choose_backend(backend, out, *tensors.values(), op="pack") == "torch":
        return pack_ref(tensors, layout, out)
    if len(layout):
        def build() -> tuple[torch.Tensor, int, int]:
            segments: list[Segment] = [(tensors[s.name], _view(out, s)) for s in layout]
            kinds = [element_kind(s.source_dtype, s.dtype) for s in layout]
            return segment_table(segments, kinds, block)

        launch_table(out.device, *checked.table(("pack", block), build), block=block)
    return out


def _pack_target(tensors: Mapping[str, torch.Tensor], layout: PackLayout,
                 out: torch.Tensor | None) -> tuple[torch.Tensor, Checked]:
    """`pack`'s checks (skipped for a key checked before); ``out``, or a zeroed buffer."""
    if out is not None:
        key = _call_key("pack", tensors, layout, out)
        hit = _CHECKED.get(key, layout)
        if hit is not None:
            return out, hit
    _check_tensors(tensors, layout, "pack", exact_dtype=True)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if out is None:
        out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    _check_buffer(out, layout, "pack")
    span = _span(out)
    for s in layout:
        if _overlaps(_span(tensors[s.name]), span):
            raise ValueError(f"pack: tensor {s.name!r} overlaps the output buffer")
    return out, _CHECKED.remember(_call_key("pack", tensors, layout, out), layout)


def pack_with_checksums(tensors: Mapping[str, torch.Tensor], layout: PackLayout,
                        out: torch.Tensor, chunk_size: int, *,
                        backend: str | None = None) -> torch.Tensor:
    """`pack` into ``out``, and return ``chunk_checksums(out[:layout.nbytes], chunk_size)``.

    On CPU tensors with the compiled checksum loop (`kernels.native`), every tensor that
    is contiguous, of its slot's dtype and 4-byte aligned is copied by that loop, which
    checksums the bytes as they pass (read once, not twice); the others (casts, strided
    views) are copied by ``copy_`` and checksummed with the padding afterwards. On CUDA
    tensors (and with ``backend="triton"``) one Triton kernel (`kernels.packsum`) copies
    every contiguous tensor of its slot's dtype into the buffer and checksums the whole
    buffer, padding included, in the same pass; strided and cast tensors are written by
    the segment copy first (queued before it). A ``chunk_size`` whose largest
    power-of-two divisor is under `packsum.MIN_TILE` bytes, and ``backend="torch"``:
    pack, then checksum.

    Raises:
        As `pack` and `chunk_checksums`.
    """
    out, checked = _pack_target(tensors, layout, out)
    chosen = choose_backend(backend, out, *tensors.values(), op="pack_with_checksums")
    if chosen == "triton":
        check_chunking(out[:layout.nbytes], chunk_size)  # chunk_checksums' errors, before writing
        tile = packsum.tile_for(chunk_size)
        if tile is not None:
            fused = checked.table(("packsum", tile, DEFAULT_BLOCK), lambda: packsum.plan(
                tensors, layout, out, tile, DEFAULT_BLOCK))
            return packsum.launch(fused, out, layout.nbytes, chunk_size, DEFAULT_BLOCK)
    if chosen == "triton" or backend is not None:
        pack(tensors, layout, out=out, backend=chosen)
        return chunk_checksums(out[:layout.nbytes], chunk_size, backend=chosen)
    sums = ChunkSums(layout.nbytes, chunk_size)
    for s in layout:
        t = tensors[s.name]
        fused = (t.dtype == s.dtype and t.is_contiguous()
                 and sums.copy(s.offset, out[s.offset:s.offset + s.nbytes],
                               t.reshape(-1).view(torch.uint8)))
        if not fused:
            _view(out, s).copy_(t)
    return sums.finish(out[:layout.nbytes])


def unpack(buffer: torch.Tensor, layout: PackLayout, *,
           out: Mapping[str, torch.Tensor] | None = None, backend: str | None = None,
           block: int = DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """Copy every slot of ``buffer`` into its tensor (casting to the tensor's dtype).

    Args:
        buffer: uint8, 1-D, contiguous, at least ``layout.nbytes`` bytes.
        layout: the layout the buffer was packed with.
        out: name -> destination tensor (any strides, non-overlapping); new
            contiguous tensors of ``slot.dtype`` when None.
        backend: ``"triton"``, ``"torch"`` or None (Triton on CUDA tensors).

    Returns:
        name -> tensor, in layout order.

    Raises:
        ValueError: names, shapes or sizes differ from the layout, the buffer is
            misaligned, destinations overlap each other or the buffer.
        TypeError: a destination dtype the slot's dtype cannot be cast to.
    """
    if out is None:
        _check_buffer(buffer, layout, "unpack")
        out = {s.name: torch.empty(s.shape, dtype=s.dtype, device=buffer.device) for s in layout}
    checked = _unpack_checked(buffer, layout, out)
    if choose_backend(backend, buffer, *out.values(), op="unpack") == "torch":
        return unpack_ref(buffer, layout, out)
    dst = out
    if len(layout):
        def build() -> tuple[torch.Tensor, int, int]:
            segments: list[Segment] = [(_view(buffer, s), dst[s.name]) for s in layout]
            kinds = [element_kind(s.dtype, dst[s.name].dtype) for s in layout]
            return segment_table(segments, kinds, block)

        launch_table(buffer.device, *checked.table(("unpack", block), build), block=block)
    return {s.name: out[s.name] for s in layout}


def _unpack_checked(buffer: torch.Tensor, layout: PackLayout,
                    out: Mapping[str, torch.Tensor]) -> Checked:
    """`unpack`'s checks, skipped for a key checked before."""
    key = _call_key("unpack", out, layout, buffer)
    hit = _CHECKED.get(key, layout)
    if hit is not None:
        return hit
    _check_buffer(buffer, layout, "unpack")
    _check_tensors(out, layout, "unpack", exact_dtype=False)
    spans = sorted((*_span(out[s.name]), s.name) for s in layout)
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:], strict=False):
        if _overlaps((a0, a1), (b0, b1)):
            raise ValueError(f"unpack: destination tensors {a!r} and {b!r} overlap")
    buf_span = _span(buffer)
    for a0, a1, a in spans:
        if _overlaps((a0, a1), buf_span):
            raise ValueError(f"unpack: destination tensor {a!r} overlaps the buffer")
    return _CHECKED.remember(key, layout)
