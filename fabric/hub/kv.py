"""The hub's rendezvous store: small values under flat keys, with optional ttls.

Soft state owned by `fabric.hub.state.HubState` (``HubState.kv``), which wraps
`KvStore.put`/`KvStore.get` as the ``kv_put``/``kv_get`` operations. Expiry is
lazy: a heap of ttl deadlines is drained on every put and by the hub's timer, and
rebuilt from the live keys when overwrites leave it over twice their number.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from weightfabric.fabric.errors import BadRequestError, ValueTooLargeError

MAX_KV_VALUE = 64 * 1024
MAX_KV_KEY = 256
MAX_KV_KEYS = 65_536


class KvStore:
    """Keys to ``(value, expires)`` (``expires`` None: kept until the hub stops).

    Args:
        clock: returns the current time in seconds (the hub's clock).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._items: dict[str, tuple[bytes, float | None]] = {}
        self._ttl: list[tuple[float, str]] = []    # heap: (expires, key)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        """Store ``value`` under ``key`` (last writer wins); see `HubState.kv_put`."""
        self.expire()
        _check_key(key)
        if len(value) > MAX_KV_VALUE:
            raise ValueTooLargeError(f"value for key {key!r} is {len(value)} bytes, over the "
                                     f"{MAX_KV_VALUE}-byte limit; the rendezvous store is for "
                                     "small handshakes (ids, addresses), not data")
        if ttl is not None and not 0 < ttl < math.inf:     # refuses NaN too
            raise BadRequestError(f"ttl must be a finite number of seconds > 0, or None (kept "
                                  f"while the hub runs), got {ttl}")
        if key not in self._items and len(self._items) >= MAX_KV_KEYS:
            raise ValueTooLargeError(f"the hub already holds {MAX_KV_KEYS} rendezvous keys; "
                                     "use a ttl so old keys vanish")
        expires = None if ttl is None else self.clock() + float(ttl)
        self._items[key] = (bytes(value), expires)
        if expires is not None:
            heapq.heappush(self._ttl, (expires, key))
            if len(self._ttl) > 2 * len(self._items) + 64:    # overwritten keys' old entries
                self._ttl = [(e, k) for k, (_, e) in self._items.items() if e is not None]
                heapq.heapify(self._ttl)

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None when absent or expired; see `HubState.kv_get`."""
        _check_key(key)
        item = self._items.get(key)
        if item is None:
            return None
        if item[1] is not None and item[1] <= self.clock():
            self.expire()
            return None
        return item[0]

    def expire(self) -> None:
        """Drop every key whose ttl ran out."""
        now = self.clock()
        while self._ttl and self._ttl[0][0] <= now:
            expires, key = heapq.heappop(self._ttl)
            item = self._items.get(key)
            if item is not None and item[1] == expires:
                del self._items[key]


def _check_key(key: str) -> None:
    if not key:
        raise ValueError("a rendezvous key must not be empty")
    if len(key.encode()) > MAX_KV_KEY:
        raise ValueTooLargeError(f"rendezvous key {key[:40]!r}... is over {MAX_KV_KEY} bytes")


__all__ = ["MAX_KV_KEY", "MAX_KV_KEYS", "MAX_KV_VALUE", "KvStore"]
