"""Which chunks of a replica are present, with waits that do not poll."""

from __future__ import annotations

import bisect
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


class SlotMarks:
    """Marks the chunks of a buffer as the tensors laid out in it are written.

    For a replica made piece by piece (a derived layout): `done` names tensors whose
    bytes are final, `written` a byte range that is; each chunk is marked once every
    tensor byte in it is (bytes reported twice count once). A chunk with no tensor
    bytes (alignment padding only) is marked at once. Thread-safe.

    Args:
        slots: ``(name, offset, nbytes)`` of every tensor in the buffer.
        chunk_size: bytes per chunk of ``progress``.
        progress: the replica's bitmap.
    """

    def __init__(self, slots: list[tuple[str, int, int]], chunk_size: int,
                 progress: ChunkProgress) -> None:
        self.chunk_size, self.progress = chunk_size, progress
        self._slots = {name: (offset, nbytes) for name, offset, nbytes in slots}
        self._left = [0] * progress.num_chunks     # tensor bytes not yet final, per chunk
        self._final: list[tuple[int, int]] = []    # sorted disjoint byte ranges reported
        self._lock = threading.Lock()
        for offset, nbytes in self._slots.values():
            for chunk, part in self._parts(offset, offset + nbytes):
                self._left[chunk] += part
        for chunk, left in enumerate(self._left):
            if not left:
                progress.mark(chunk)

    def done(self, names: list[str]) -> None:
        """The tensors ``names`` are final: mark the chunks they complete."""
        for name in names:
            offset, nbytes = self._slots.get(name, (0, 0))
            self.written(offset, nbytes)

    def written(self, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` (of tensors) are final: mark what they complete."""
        with self._lock:
            for lo, hi in self._add(offset, offset + nbytes):
                for chunk, part in self._parts(lo, hi):
                    self._left[chunk] -= part
                    if not self._left[chunk]:
                        self.progress.mark(chunk)

    def _add(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Add ``[lo, hi)`` to the reported ranges; return its parts not reported before."""
        if lo >= hi:
            return []
        final = self._final
        i = bisect.bisect_left(final, (lo, lo))
        if i and final[i - 1][1] >= lo:
            i -= 1
        j, new, at = i, [], lo
        while j < len(final) and final[j][0] <= hi:
            a, b = final[j]
            if a > at:
                new.append((at, a))
            at = max(at, b)
            j += 1
        if at < hi:
            new.append((at, hi))
        merged = (min(lo, final[i][0]) if i < j else lo, max(hi, final[j - 1][1]) if i < j else hi)
        final[i:j] = [merged]
        return new

    def _parts(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(chunk, bytes of ``[lo, hi)`` in it), for each chunk it touches."""
        size = self.chunk_size
        return [(c, min(hi, (c + 1) * size) - max(lo, c * size))
                for c in range(lo // size, (hi - 1) // size + 1)] if hi > lo else []
