"""Which chunks of a replica are present, with waits that do not poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ChunkProgress:
    """A chunk bitmap of one replica plus a condition to wait on.

    The holder marks chunks as it writes them (after the bytes are in place);
    readers wait for the chunks they need. A complete replica is created with
    ``complete=True``.
    """

    def __init__(self, num_chunks: int, *, complete: bool = False) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        self.num_chunks = num_chunks
        self._present = bytearray([1 if complete else 0] * num_chunks)
        self._count = num_chunks if complete else 0
        self._cond = threading.Condition()
        self._last_mark = time.monotonic()

    def mark(self, chunk: int) -> None:
        """Record that `chunk` is present and wake the readers waiting for it."""
        with self._cond:
            if not self._present[chunk]:
                self._present[chunk] = 1
                self._count += 1
                self._last_mark = time.monotonic()
                self._cond.notify_all()

    def has(self, first: int, last: int) -> bool:
        """True when every chunk in ``first..last`` (inclusive) is present."""
        return all(self._present[first:last + 1])

    def present_through(self, first: int, last: int) -> int:
        """The last chunk of the run of present chunks from `first`, at most `last`.

        The last chunk of the run of present chunks from `first`, at most `last` (``first -
        1`` when `first` is missing).
        """
        with self._cond:
            gap = self._present.find(0, first, last + 1)
        return last if gap < 0 else gap - 1

    def wait(self, first: int, last: int, timeout: float,
             abort: Callable[[], bool] | None = None, *, stall: float | None = None) -> bool:
        """Wait until chunks ``first..last`` are present.

        False on timeout, as soon as ``abort()`` is true after a `wake`, or once no chunk
        has been marked for ``stall`` seconds (see `idle`).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.has(first, last):
                if abort is not None and abort():
                    return False
                now = time.monotonic()
                remaining = deadline - now
                if stall is not None:
                    remaining = min(remaining, self._last_mark + stall - now)
                if not remaining > 0:  # NaN too: never a busy loop
                    return False
                self._cond.wait(min(remaining, threading.TIMEOUT_MAX))
        return True

    def idle(self) -> float:
        """Seconds since a chunk was last marked (since creation before the first)."""
        with self._cond:
            return time.monotonic() - self._last_mark

    def wake(self) -> None:
        """Wake every waiter so it checks its ``abort`` (call after making it true)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def complete(self) -> bool:
        """Whether every chunk is present."""
        return self._count == self.num_chunks

    @property
    def count(self) -> int:
        """How many chunks are present."""
        return self._count

    def bitmap(self) -> bytes:
        """One byte per chunk, 1 when present."""
        with self._cond:
            return bytes(self._present)
