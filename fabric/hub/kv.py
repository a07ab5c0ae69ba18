"""The hub's rendezvous store: small values under flat keys, with optional ttls.

Owned by `fabric.hub.state.HubState` (``HubState.kv``), which wraps
`KvStore.put`/`KvStore.get` as the ``kv_put``/``kv_get`` operations. Each key also
records its owner, the first credential that wrote it (`fabric.hub.rights`). Expiry is
lazy: a heap of ttl deadlines is drained on every put and by the hub's timer, and
rebuilt from the live keys when overwrites leave it over twice their number. The keys
are part of the hub's records (`records`, `restore`): a ttl's deadline is kept in wall
time as well, so a key outlives a hub restart or failover until that deadline.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from weightfabric.fabric.errors import BadRequestError, ValueTooLargeError

MAX_KV_VALUE = 64 * 1024
MAX_KV_KEY = 256
MAX_KV_KEYS = 65_536


class KvItem(NamedTuple):
    """One key's value, deadline (the hub's clock and wall time; None: no ttl), owner."""

    value: bytes
    expires: float | None
    expires_wall: float | None
    owner: str | None


KvRecord = tuple[bytes, "float | None", "str | None"]
"""A key as the records keep it: value, wall-clock deadline (None: no ttl), owner."""


class KvStore:
    """Keys to `KvItem` (``expires`` None: kept as long as the records are).

    Args:
        clock: returns the current time in seconds (the hub's clock).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._items: dict[str, KvItem] = {}
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
        wall = None if ttl is None else time.time() + float(ttl)
        old = self._items.get(key)
        self._items[key] = KvItem(bytes(value), expires, wall, old.owner if old else None)
        if expires is not None:
            heapq.heappush(self._ttl, (expires, key))
            if len(self._ttl) > 2 * len(self._items) + 64:    # overwritten keys' old entries
                self._ttl = [(i.expires, k) for k, i in self._items.items()
                             if i.expires is not None]
                heapq.heapify(self._ttl)

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None when absent or expired; see `HubState.kv_get`."""
        _check_key(key)
        item = self._live(key)
        return item.value if item is not None else None

    def owner(self, key: str) -> str | None:
        """Who owns ``key`` (None: nobody, or the key is absent or expired)."""
        item = self._live(key)
        return item.owner if item is not None else None

    def claim(self, key: str, owner: str) -> bool:
        """Make ``owner`` the owner of ``key`` if it has none; whether that changed it."""
        item = self._live(key)
        if item is None or item.owner is not None:
            return False
        self._items[key] = item._replace(owner=owner)
        return True

    def records(self) -> dict[str, KvRecord]:
        """Every live key as the hub's records keep it."""
        self.expire()
        return {k: (i.value, i.expires_wall, i.owner) for k, i in self._items.items()}

    def restore(self, records: dict[str, KvRecord]) -> None:
        """Put back keys from the records; a key whose wall-clock deadline passed is dropped."""
        now = time.time()
        for key, (value, wall, owner) in records.items():
            if wall is not None and wall <= now:
                continue
            self.put(key, value, ttl=None if wall is None else wall - now)
            if owner is not None:
                self.claim(key, owner)
            if wall is not None:      # the deadline as kept, not as re-derived
                self._items[key] = self._items[key]._replace(expires_wall=wall)

    def _live(self, key: str) -> KvItem | None:
        _check_key(key)
        item = self._items.get(key)
        if item is not None and item.expires is not None and item.expires <= self.clock():
            self.expire()
            return None
        return item

    def expire(self) -> None:
        """Drop every key whose ttl ran out."""
        now = self.clock()
        while self._ttl and self._ttl[0][0] <= now:
            expires, key = heapq.heappop(self._ttl)
            item = self._items.get(key)
            if item is not None and item.expires == expires:
                del self._items[key]


def _check_key(key: str) -> None:
    if not key:
        raise ValueError("a rendezvous key must not be empty")
    if len(key.encode()) > MAX_KV_KEY:
        raise ValueTooLargeError(f"rendezvous key {key[:40]!r}... is over {MAX_KV_KEY} bytes")


__all__ = ["MAX_KV_KEY", "MAX_KV_KEYS", "MAX_KV_VALUE", "KvItem", "KvRecord", "KvStore"]
