"""`StoreState`: the state a `ModelStore`'s parts share, declared once.

`ModelStore` (`fabric/store.py`) is composed of three parts, each in its own module:
its buffers and the versions they hold (`store_buffers.StoreBuffers`), publishing
(`store_publish.StorePublishing`) and fetching (`store_fetch.StoreFetching`). They read
and change one set of attributes, which `ModelStore.__init__` sets (and documents); this
class only declares them, so that each part type-checks on its own. Every part takes the
same lock, ``_lock`` (a re-entrant one), around what it changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from weightfabric.fabric.buffer_pool import BufferPool
from weightfabric.fabric.client import HubClient
from weightfabric.fabric.errors import FabricError
from weightfabric.fabric.manifest import ShardedTensor
from weightfabric.fabric.transports.server import ReadServer
from weightfabric.kernels import PackLayout

if TYPE_CHECKING:
    from weightfabric.fabric.gpu.nvshmem_arena import NvshmemRuntime

log = logging.getLogger(f"{__package__}.store")
"""The store's logger, whichever part logs (``weightfabric.fabric.store``)."""


class StoreState:
    """The attributes of a `ModelStore` that its parts share (see `ModelStore.__init__`).

    And `version`, which every part reads.
    """

    model: str
    hub: HubClient
    server: ReadServer
    shard: int
    num_shards: int
    chunk_size: int
    device: torch.device
    nvshmem: NvshmemRuntime | None
    buffers: int
    prepare_spare: bool
    layout: PackLayout | None
    aliases: dict[str, str]
    sharding: tuple[ShardedTensor, ...]
    pool: BufferPool
    _attached: dict[str, torch.Tensor] | None
    _closed: bool
    _lock: threading.RLock

    @property
    def version(self) -> int | None:
        """The version the store's tensors hold now (None before the first one)."""
        active = self.pool.active
        return active.version if active else None

    def _check_open(self) -> None:
        """Raises: FabricError: the store is closed."""
        if self._closed:
            raise FabricError(f"model {self.model!r}: the store is closed; open another "
                              "with worker.model(...)")


def quietly(fn: Callable[..., object], *args: object) -> None:
    """Call ``fn(*args)``; log what it raises instead of raising (cleanup after a failure)."""
    try:
        fn(*args)
    except Exception as exc:  # cleanup after a failure must not hide the failure
        log.warning("cleanup %s failed: %s", getattr(fn, "__name__", fn), exc)
