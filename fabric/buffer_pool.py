"""`BufferPool`: the arena buffers of one model store and the rules for reusing them.

A store holds one to `MAX_BUFFERS` buffers, each the size of the model's byte space.
One is *active* (the attached tensors are views of it); the others are spares, older
versions kept for readers, or versions fetched for a future not switched to yet. The
pool decides which buffer holds which version, which may be reused, and when a spare
is worth preparing; the store does the hub and read-server calls around it (retract,
expose). The pool is not thread-safe: its store calls it under the store's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from weightfabric.fabric.errors import FabricError
from weightfabric.fabric.transports.server import Exposure

MAX_BUFFERS = 4
PREPARED_BUFFERS = 2
"""A prepared spare tops the pool up to this many buffers (active + spare), never more."""


class BufferRegion(Protocol):
    """What the pool needs of a buffer's memory (`Region`, `DeviceRegion`, `SymmetricBuffer`)."""

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer's bytes, a flat uint8 tensor."""
        ...

    def close(self) -> None:
        """Free the buffer's memory."""
        ...


@dataclass(eq=False)
class Buffer:
    """One buffer and what the store knows about it."""

    region: BufferRegion
    version: int | None = None
    """The version it holds (or is being filled with); None: nothing usable."""
    exposed: Exposure | None = None
    """Its exposure on the read server while peers may read it."""
    pending: bool = False
    """Filled by a fetch whose `FetchFuture.result` has not switched to it yet: reserved,
    not reused or released, until then or until a newer version is active."""
    releasing: bool = False
    """`ModelStore.release` is retracting it: not reused meanwhile."""


class BufferPool:
    """The buffers of one store: which is active, which may be reused, which is spare.

    Args:
        model: the model's name, for error messages.
        limit: the most buffers the pool holds at once.
    """

    def __init__(self, model: str, *, limit: int = MAX_BUFFERS) -> None:
        if not 1 <= limit <= MAX_BUFFERS:
            raise ValueError(f"model {model!r}: a pool holds 1..{MAX_BUFFERS} buffers, not {limit}")
        self.model = model
        self.limit = limit
        self._buffers: list[Buffer] = []
        self._active: Buffer | None = None

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every buffer, oldest allocation first."""
        return tuple(self._buffers)

    @property
    def active(self) -> Buffer | None:
        """The buffer the store's tensors use now (None before the first)."""
        return self._active

    @property
    def full(self) -> bool:
        """True when no more buffers may be added."""
        return len(self._buffers) >= self.limit

    def __len__(self) -> int:
        return len(self._buffers)

    def __contains__(self, buffer: object) -> bool:
        return buffer in self._buffers

    # --- membership ------------------------------------------------------------------

    def add(self, region: BufferRegion) -> Buffer:
        """A new buffer over ``region``, holding no version.

        Raises:
            FabricError: the pool holds `limit` buffers already (the region is not taken).
        """
        if self.full:
            raise self._full()
        buffer = Buffer(region)
        self._buffers.append(buffer)
        return buffer

    def remove(self, buffer: Buffer) -> None:
        """Take ``buffer`` out of the pool and close its region (also if it was out already)."""
        if buffer in self._buffers:
            self._buffers.remove(buffer)
        if buffer is self._active:
            self._active = None
        buffer.region.close()

    def clear(self) -> list[Buffer]:
        """Take every buffer out (without closing them); returns them, for the caller to close."""
        buffers, self._buffers, self._active = self._buffers, [], None
        return buffers

    # --- versions --------------------------------------------------------------------

    def find(self, version: int | None) -> Buffer | None:
        """The first buffer holding ``version`` (active or not); never one holding nothing."""
        if version is None:
            return None
        return next((b for b in self._buffers if b.version == version), None)

    def reserve(self, version: int) -> Buffer | None:
        """Reserve a non-active buffer that holds ``version``, if there is one.

        A buffer other than the active one that holds ``version`` (kept, e.g. pinned) and is
        not being released, now reserved for a future; None if there is none.
        """
        for buffer in self._buffers:
            if (version is not None and buffer.version == version
                    and buffer is not self._active and not buffer.releasing):
                buffer.pending = True
                return buffer
        return None

    def activate(self, buffer: Buffer) -> None:
        """Make ``buffer`` active (an attach's buffer may hold no version yet).

        Fetched buffers of older versions lose their reservation: a superseded future must
        not pin memory.

        Raises:
            FabricError: ``buffer`` is not in the pool.
        """
        if buffer not in self._buffers:
            raise FabricError(f"model {self.model!r}: that buffer was freed; fetch again")
        self._active = buffer
        buffer.pending = False
        for other in self._buffers:
            if (other.pending and other.version is not None and buffer.version is not None
                    and other.version < buffer.version):
                other.pending = False

    def switch(self, buffer: Buffer, version: int | None) -> None:
        """Make ``buffer``, which a fetch filled with ``version`` and reserved, active.

        Raises:
            FabricError: ``version`` is unknown (None), the buffer was released or reused
                meanwhile, or a newer version became active first (no longer reserved).
        """
        if version is None:
            raise FabricError(f"model {self.model!r}: a buffer holding no known version cannot "
                              "become active; fetch a version first")
        if buffer not in self._buffers or buffer.version != version:
            raise FabricError(f"model {self.model!r} v{version}: its buffer was released or "
                              "reused before result() was called; fetch it again")
        if not buffer.pending:
            active = self._active.version if self._active else None
            raise FabricError(f"model {self.model!r} v{version}: a newer version (v{active}) "
                              "became active before result() was called, so its buffer is no "
                              "longer reserved; fetch it again")
        self.activate(buffer)

    def forget(self, buffer: Buffer) -> None:
        """``buffer`` no longer holds a usable version (a fetch failed, or it is reused)."""
        buffer.version, buffer.pending = None, False

    # --- reuse -----------------------------------------------------------------------

    def reusable(self) -> list[Buffer]:
        """Buffers a new version may take, in the order to try them.

        Neither active, reserved nor being released; unused ones first, then the oldest
        versions (the caller still has to retract those).
        """
        return sorted((b for b in self._buffers
                       if b is not self._active and not b.pending and not b.releasing),
                      key=lambda b: -1 if b.version is None else b.version)

    def take(self, reclaim: Callable[[Buffer], bool],
             allocate: Callable[[], BufferRegion]) -> Buffer:
        """A buffer for a new version.

        The first of `reusable` that ``reclaim`` frees (it returns True once no reader needs
        the buffer; it may `remove` it), else a new one over ``allocate()``. The buffer
        returned holds no version.

        Raises:
            FabricError: nothing could be reclaimed and the pool is full.
        """
        for buffer in self.reusable():
            if reclaim(buffer):
                self.forget(buffer)
                return buffer
        if self.full:
            raise self._full()
        return self.add(allocate())

    def _full(self) -> FabricError:
        return FabricError(f"model {self.model!r}: all {self.limit} buffers hold versions "
                           "readers still need or fetches whose result() was not called "
                           "yet; retract or release one, or call result(), first")

    def unused(self) -> list[Buffer]:
        """Spares: buffers other than the active one that hold no version."""
        return [b for b in self._buffers if b is not self._active and b.version is None]

    def wants_spare(self) -> bool:
        """True when a prepared spare should be added now.

        The pool holds fewer than `PREPARED_BUFFERS` buffers and none unused.
        """
        return len(self._buffers) < min(PREPARED_BUFFERS, self.limit) and not self.unused()


__all__ = ["MAX_BUFFERS", "PREPARED_BUFFERS", "Buffer", "BufferPool", "BufferRegion"]
