"""NVSHMEM unique-id bootstrap through a rendezvous (the hub's key-value store).

PE 0 creates the 128-byte unique id (``nvshmem.core.get_unique_id()``) and puts it
under a key; every other PE gets it (bounded wait) and rebuilds the id object.
The value is msgpack ``{"magic", "uid", "nranks", "session"}``, so a PE that reads
a stale id of another job or size gets a clear error instead of a hung ``init``.
The rendezvous is anything with ``put(key, bytes)`` / ``get(key, timeout)``:
`HubRendezvous` goes through the hub every worker already talks to;
`MemoryRendezvous` is one in a process (threads, a single PE, tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from weightfabric.fabric.errors import HubTimeoutError

if TYPE_CHECKING:
    from weightfabric.fabric.client import HubClient

UID_NBYTES = 128  # sizeof(nvshmemx_uniqueid_v1): int32 version + 124 bytes
MAGIC = "weightfabric-nvshmem-uid/1"


class Rendezvous(Protocol):
    """A small key-value store every PE of a job can reach."""

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwriting)."""

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s; TimeoutError if it never came."""


class MemoryRendezvous:
    """`Rendezvous` in one process's memory."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` and wake the waiters."""
        with self._cond:
            self._values[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        """The value under `key`, waiting up to `timeout` s (TimeoutError after)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._values:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rendezvous: no value for {key!r} after {timeout:g} s")
                self._cond.wait(left)
            return self._values[key]


class HubRendezvous:
    """`Rendezvous` through the hub's key-value store (`HubClient.kv_put` / `kv_get`).

    Args:
        client: an open hub client (e.g. ``worker.hub``).
        ttl: seconds a put value lives on the hub (None: while the hub runs).
    """

    def __init__(self, client: HubClient, *, ttl: float | None = 600.0) -> None:
        self.client = client
        self.ttl = ttl

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` at the hub, for `ttl` s."""
        self.client.kv_put(key, value, ttl=self.ttl)

    def get(self, key: str, timeout: float) -> bytes:
        """The value under `key` at the hub, waiting up to `timeout` s (TimeoutError after)."""
        try:
            return self.client.kv_get(key, timeout=timeout)
        except HubTimeoutError as exc:
            raise TimeoutError(str(exc)) from exc


def encode_uid(raw: bytes, *, nranks: int, session: str) -> bytes:
    """The rendezvous value for a unique id of ``raw`` bytes."""
    if len(raw) != UID_NBYTES:
        raise ValueError(f"nvshmem unique id must be {UID_NBYTES} bytes, got {len(raw)}")
    return msgpack.packb({"magic": MAGIC, "uid": bytes(raw), "nranks": nranks, "session": session})


def decode_uid(value: bytes, *, nranks: int, session: str) -> bytes:
    """The unique id bytes from a rendezvous value, checked against this job.

    Raises:
        ValueError: not a unique id, or one for another session or job size.
    """
    try:
        msg = msgpack.unpackb(value)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is malformed input
        raise ValueError(f"rendezvous value is not msgpack: {exc}") from None
    if not isinstance(msg, dict) or msg.get("magic") != MAGIC:
        raise ValueError("rendezvous value is not a weightfabric nvshmem unique id")
    if msg.get("session") != session or msg.get("nranks") != nranks:
        raise ValueError(f"unique id is for session {msg.get('session')!r} with "
                         f"{msg.get('nranks')} PEs; this PE joins {session!r} with {nranks} "
                         "(a stale id from an earlier job? use a fresh session key)")
    raw = msg.get("uid")
    if not isinstance(raw, bytes) or len(raw) != UID_NBYTES:
        raise ValueError(f"unique id must be {UID_NBYTES} bytes")
    return raw


def exchange_unique_id(rendezvous: Rendezvous, *, session: str, rank: int, nranks: int,
                       create: Callable[[], bytes], timeout: float = 60.0) -> bytes:
    """Distribute PE 0's unique id: PE 0 calls ``create`` and puts it; the others get it.

    Returns:
        The id's bytes on every PE.

    Raises:
        ValueError: bad rank, or a malformed or foreign id.
        TimeoutError: PE 0 did not publish within ``timeout`` s.
    """
    if not 0 <= rank < nranks:
        raise ValueError(f"rank {rank} outside 0..{nranks - 1}")
    key = f"nvshmem-uid/{session}"
    if rank == 0:
        raw = create()
        rendezvous.put(key, encode_uid(raw, nranks=nranks, session=session))
        return raw
    return decode_uid(rendezvous.get(key, timeout), nranks=nranks, session=session)


def uid_to_bytes(uid: Any) -> bytes:
    """The 128 bytes of an ``nvshmem.bindings.uniqueid`` (its numpy ``_data`` record)."""
    raw = uid._data.tobytes()
    if len(raw) != UID_NBYTES:
        raise ValueError(f"unique id has {len(raw)} bytes, expected {UID_NBYTES}")
    return raw


def uid_from_bytes(raw: bytes) -> Any:
    """An ``nvshmem.bindings.uniqueid`` holding ``raw`` (needs nvshmem4py, not a GPU)."""
    import numpy as np
    from nvshmem import bindings

    if len(raw) != UID_NBYTES:
        raise ValueError(f"unique id must be {UID_NBYTES} bytes, got {len(raw)}")
    uid = bindings.uniqueid()
    uid._data.view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
    return uid
