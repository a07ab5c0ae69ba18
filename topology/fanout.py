"""Fan-out quotas: how many streams each sender forwards in each stripe's tree.

A machine with ``n`` NICs can send ``n`` streams at the NIC rate, in total over all
the stripe trees it relays in; a leaf switch can send out over the spine what its
machines have left after serving one another. `FanOut` hands each stripe the
streams it needs from such senders so that none goes over its total:

    senders  a:8  b:8  c:8  d:8        (capacity, streams over all stripes)
    stripe 0 [a a a a a a a a b b b]   11 streams: a 8, b 3
    stripe 1 [b b b b b c c c c c c]   11 streams: b 5, c 6
    stripe 2 [c c d d d]                5 streams: c 2, d 3

Each stripe takes a contiguous run of the senders' capacity, starting where the
previous stripe stopped (McNaughton's wrap-around rule), so a sender is interior in
one or two trees with a large fan-out (shallow trees) and the loads are exact, not
greedy. Where the senders have more than the stripes need, a stripe that the
sender at the cut cannot serve whole may start at the next one that can (a split
adds a hop), skipping up to that spare capacity. Only when the stripes need more than the senders have does a sender go
over: one stream at a time to the sender with the most left.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # a sender's name (a machine, a group of machines)


class FanOut(Generic[K]):
    """Per-stripe fan-out quotas over a fixed list of senders (see the module docstring).

    Args:
        names: the senders, in the order their capacity is handed out.
        capacity: streams each sender may send over all stripes (missing: 0).
    """

    def __init__(self, names: Sequence[K], capacity: Mapping[K, int]) -> None:
        self.names: list[K] = list(names)
        self.left: dict[K, int] = {n: int(capacity.get(n, 0)) for n in names}
        self.pos = 0

    def charge(self, name: K, streams: int) -> None:
        """Count `streams` that `name` sends outside `take` (a root's fixed share)."""
        self.left[name] = self.left.get(name, 0) - streams

    def total(self, eligible: Sequence[K]) -> int:
        """Streams the `eligible` senders have left."""
        return sum(self.left.get(x, 0) for x in eligible)

    def take(self, demand: int, eligible: Sequence[K], *, spill: Sequence[K] = (),
             slack: int = 0) -> dict[K, int]:
        """`demand` streams from the `eligible` senders: name -> streams (> 0 only).

        Contiguous from where the last call stopped, each sender up to what it has
        left. Senders that cannot take all of it are skipped (a split adds a hop)
        while what they have left adds up to no more than `slack`, the capacity the
        caller expects to go unused. Beyond everyone's capacity, one stream at a time
        to the sender of `eligible` or `spill` with the most left (it goes over; ties:
        the first listed). Empty when nobody is eligible.
        """
        out: dict[K, int] = {}
        allowed = set(eligible)
        n, i = len(self.names), self.pos
        skipped = 0
        for step in range(n if slack > 0 else 0):
            name = self.names[(i + step) % n]
            left = self.left[name] if name in allowed else 0
            if left >= demand:
                i = (i + step) % n
                break
            skipped += left
            if skipped > slack:
                break
        for _ in range(n):
            if demand <= 0:
                break
            name = self.names[i]
            if self.left[name] > 0 and name in allowed:
                k = min(self.left[name], demand)
                out[name] = out.get(name, 0) + k
                self.left[name] -= k
                demand -= k
                if self.left[name] > 0:
                    break
            i = (i + 1) % n
        self.pos = i
        if demand <= 0:
            return out
        heap = [(-self.left.get(x, 0), j, x)
                for j, x in enumerate(dict.fromkeys([*eligible, *spill]))]
        heapq.heapify(heap)
        while demand > 0 and heap:
            _, j, name = heapq.heappop(heap)
            out[name] = out.get(name, 0) + 1
            self.left[name] = self.left.get(name, 0) - 1
            demand -= 1
            heapq.heappush(heap, (-self.left[name], j, name))
        return out


__all__ = ["FanOut"]
