"""`PinnedMappings`: a reader's mappings of holders' memory, each pinned at its holder.

Mapping another process's GPU allocation (CUDA IPC) costs far more than a lease,
so a reader keeps its mappings open between reads. CUDA leaves undefined what
happens when the exporter frees an allocation another process still has mapped,
and a holder frees memory after a retract, which only waits for leases. So every
mapping is pinned first: on a connection of its own, the reader asks the
holder's `ReadServer` to keep the leased region's memory referenced until that
connection closes (`Op.PIN`). When the holder retracts the region or closes, the
server says so on the connection; the reader then unmaps as soon as no read uses
the mapping and closes the connection, and the memory can go.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from weightfabric.fabric.errors import TransportError
from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import SourceAddress

log = logging.getLogger(__name__)

M = TypeVar("M")
POLL_S = 0.1  # how often the watcher looks for holders' unmap notices


@dataclass
class _Entry(Generic[M]):
    mapping: M
    pin: socket.socket
    users: int = 0
    stale: bool = False  # the holder asked for it to be unmapped


class PinnedMappings(Generic[M]):
    """Open mappings keyed by what they map, at most `capacity` of them idle.

    Open mappings keyed by what they map (e.g. an IPC handle), at most `capacity` of them
    idle, each with its pin connection.

    Args:
        unmap: closes a mapping (errors are logged; the pin is released anyway).
        capacity: idle mappings kept open; the least recently used go first.
    """

    def __init__(self, unmap: Callable[[M], None], *, capacity: int) -> None:
        self._unmap_fn = unmap
        self._capacity = capacity
        self._entries: OrderedDict[bytes, _Entry[M]] = OrderedDict()
        self._lock = threading.Lock()  # held while mapping and unmapping, too
        self._watcher: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def use(self, key: bytes, source: SourceAddress, region: str, open_mapping: Callable[[], M],
            *, timeout: float) -> Iterator[M]:
        """The open mapping under `key`.

        Without one, pins `region` at `source` and calls `open_mapping`. The caller must
        hold a lease on `region` meanwhile, so the region cannot be gone before the pin is
        in place.

        Raises:
            SourceLostError, ReadRefusedError: the pin failed (as `client.pin`).
            TransportError: this object is closed.
            Whatever `open_mapping` raises (the pin is released then).
        """
        with self._lock:
            if self._closed:
                raise TransportError("the mappings were closed")
            entry = self._entries.get(key)
            if entry is None:
                # The holder just granted a lease, so it answers at once: keep the
                # lock (which every read of this process takes) no longer than that.
                pin = client.pin(source, region, timeout=min(timeout, client.CONNECT_TIMEOUT))
                try:
                    entry = self._entries[key] = _Entry(open_mapping(), pin)
                except BaseException:
                    pin.close()
                    raise
                self._evict_idle()
                if self._watcher is None:
                    self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                     name="wf-ipc-pins")
                    self._watcher.start()
            self._entries.move_to_end(key)
            entry.users += 1
        try:
            yield entry.mapping
        finally:
            with self._lock:
                entry.users -= 1
                if entry.stale and entry.users == 0:
                    self._drop(key, entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Unmap everything and release every pin."""
        with self._lock:
            self._closed = True
            for key, entry in list(self._entries.items()):
                self._drop(key, entry)
            watcher = self._watcher
        if watcher is not None:
            watcher.join()

    def _evict_idle(self) -> None:
        idle = [(k, e) for k, e in self._entries.items() if e.users == 0]
        for key, entry in idle[:max(0, len(self._entries) - self._capacity)]:
            self._drop(key, entry)

    def _drop(self, key: bytes, entry: _Entry[M]) -> None:
        """Unmap `entry`, then release its pin (with the lock held)."""
        if self._entries.get(key) is not entry:
            return
        del self._entries[key]
        try:
            self._unmap_fn(entry.mapping)
        except Exception as exc:  # noqa: BLE001 - one bad unmap must not keep the pin
            log.warning("could not unmap a holder's memory: %s", exc)
        finally:
            entry.pin.close()

    def _watch(self) -> None:
        """Until nothing is mapped.

        Mark mappings whose holder sent its notice (or went away) stale, and drop those no
        read uses.
        """
        while True:
            with self._lock:
                if self._closed or not self._entries:
                    self._watcher = None
                    return
                pins = {e.pin.fileno(): (k, e) for k, e in self._entries.items() if not e.stale}
            poller = select.poll()  # no fd limit, unlike select.select
            for fd in pins:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(POLL_S * 1000)
            with self._lock:
                for fd, _ in ready:  # notices are never read: a pin stays readable
                    key, entry = pins[fd]
                    entry.stale = True
                    if entry.users == 0:
                        self._drop(key, entry)
