"""Who must vouch for what by when: worker leases and publish claims.

Owned by `fabric.hub.state.HubState`. A worker stays registered while it renews
its lease (register, heartbeat); a publishing version stays publishing while a
publisher claims it (begin_publish, commit, a heartbeat listing it). Both are
checked in deadline order, so `HubState.expire` costs what has expired.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator

from weightfabric.fabric.hub.records import PUBLISHING, ModelRecord, VersionRecord, WorkerRecord


class Leases:
    """Worker leases in expiry order and a heap of publish-claim deadlines.

    Args:
        clock: returns the current time in seconds (`HubState.lease_clock`).
        lease_s: how long a renewal or a claim lasts.
    """

    def __init__(self, clock: Callable[[], float], lease_s: float) -> None:
        self.clock = clock
        self.lease_s = lease_s
        self.order: OrderedDict[str, None] = OrderedDict()     # soonest expiry first
        self._claims: list[tuple[float, str, int]] = []        # heap: (deadline, model, v)

    def renew(self, worker: str) -> None:
        """The worker's lease was just extended: it now ends last."""
        self.order[worker] = None
        self.order.move_to_end(worker)

    def drop(self, worker: str) -> None:
        """Stop tracking `worker`'s lease."""
        self.order.pop(worker, None)

    def expired(self, workers: dict[str, WorkerRecord], now: float) -> list[str]:
        """The workers whose lease ended by ``now``."""
        dead = []
        for w in self.order:     # leases end in the order they were last renewed
            if workers[w].expires > now:
                break
            dead.append(w)
        return dead

    def claim(self, v: VersionRecord) -> None:
        """A publisher vouched for publishing version ``v``: renew its publish claim."""
        first = v.claimed_until == 0.0
        v.claimed_until = self.clock() + self.lease_s
        if first:        # one heap entry per version; `lapsed` re-queues renewed ones
            heapq.heappush(self._claims, (v.claimed_until, v.model, v.number))

    def lapsed(self, models: dict[str, ModelRecord], now: float) -> Iterator[VersionRecord]:
        """Publishing versions whose claim ran out by ``now`` (retire each as it comes)."""
        while self._claims and self._claims[0][0] <= now:
            _, model, number = heapq.heappop(self._claims)
            m = models.get(model)
            v = m.versions.get(number) if m else None
            if v is None or v.state != PUBLISHING:
                continue
            if v.claimed_until > now:                    # renewed since: check again later
                heapq.heappush(self._claims, (v.claimed_until, model, number))
                continue
            yield v

    def check(self, workers: dict[str, WorkerRecord]) -> None:
        """Assert the lease order lists exactly the workers, soonest expiry first."""
        expiries = [workers[w].expires for w in self.order]
        assert expiries == sorted(expiries) and set(self.order) == set(workers)


__all__ = ["Leases"]
