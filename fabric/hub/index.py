"""The indexes `fabric.hub.state.HubState` keeps so an operation costs what it touches.

Every change to replicas, fetches, fetch sources and publishers goes through
`HubIndex`, so each index stays equal to what a full scan of the records finds
(`HubIndex.check` asserts that; the property test calls it after every step).
`HubIndex` also holds the work queues `fabric.hub.retention.settle` drains: the
models whose retention must be re-applied, delayed retracts, retracts whose last
reader may have left, and retired versions whose last replica went. It also keeps,
per shard of a version, a `ReplicaPool`: the replicas in the order they began, and
grouped by where their workers are, so that a plan with thousands of replicas looks at a
few dozen of them (`fabric.hub.routing.route`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from weightfabric.fabric.hub.records import (
    LIVE,
    PUBLISHING,
    RETIRED,
    RETRACTING,
    FetchRecord,
    ModelRecord,
    Replica,
    VersionRecord,
)

ReplicaKey = tuple[str, int, int, str]
"""``(model, version, shard, worker)``."""
PoolKey = tuple[str, int, int]
"""``(model, version, shard)``."""


class ReplicaPool:
    """The replicas of one shard of one version: when each began, and where each is.

    ``replicas[worker]`` is the worker's `Replica` (the one ``VersionRecord.replicas``
    holds). ``order[worker]`` grows with the order in which the replicas were added, as
    ``VersionRecord.replicas`` (a dict) orders them: a plan's waits follow it. ``members``
    (with ``pos``) samples a few replicas in O(1) each; ``near`` groups them by
    ``(datacenter, node)`` and ``datacenter``, filled lazily from ``fresh`` at plan time
    (`group`, given the workers' locations): a group may still list replicas removed since
    (``order`` says which are not), until it is rebuilt when those outnumber the members.
    `sample` takes the next few of a group in turn (a cursor per group).
    """

    def __init__(self) -> None:
        self.members: list[str] = []
        self.replicas: dict[str, Replica] = {}
        self.pos: dict[str, int] = {}
        self.order: dict[str, int] = {}
        self.added = 0
        self.fresh: list[str] = []
        self.near: dict[tuple[str, ...], list[str]] = {}
        self.cursor: dict[tuple[str, ...], int] = {}
        self.stale = 0

    def __len__(self) -> int:
        return len(self.members)

    def add(self, rep: Replica) -> None:
        """Replica ``rep`` was added (after every other, in ``order``)."""
        worker = rep.worker
        self.replicas[worker] = rep
        self.pos[worker] = len(self.members)
        self.members.append(worker)
        self.order[worker] = self.added
        self.added += 1
        self.fresh.append(worker)

    def remove(self, worker: str) -> None:
        """``worker``'s replica left."""
        i = self.pos.pop(worker)
        del self.replicas[worker]
        last = self.members.pop()
        if last != worker:
            self.members[i] = last
            self.pos[last] = i
        del self.order[worker]
        self.stale += 1

    def group(self, where: Any) -> None:
        """Group the replicas added since the last call by ``where(worker)``.

        ``where`` gives a worker's ``(datacenter, node)`` (None for a worker not registered).
        """
        if self.stale > len(self.members):
            self.near, self.fresh, self.stale = {}, list(self.members), 0
        for w in self.fresh:
            if w not in self.order:
                continue
            at = where(w)
            if at is None:
                continue
            dc, node = at
            self.near.setdefault((dc,), []).append(w)
            if node:
                self.near.setdefault((dc, node), []).append(w)
        self.fresh = []

    def sample(self, k: int, among: tuple[str, ...] = ()) -> list[str]:
        """Up to ``k`` replicas: of all (``among`` empty), or of the group ``among``.

        The next ``k`` after those the previous call took (round robin), so that
        successive plans look at different peers.
        """
        pool = self.near.get(among, []) if among else self.members
        if len(pool) <= k:
            picked = pool
        else:
            at = self.cursor.get(among, 0) % len(pool)
            self.cursor[among] = at + k
            picked = pool[at:at + k] + pool[:max(0, at + k - len(pool))]
        return [w for w in picked if w in self.order]


class HubIndex:
    """Indexes and work queues over the hub's records.

    Args:
        models: the hub's models (shared, read here).
        fetches: the hub's fetches in flight by id (shared, kept here).
    """

    def __init__(self, models: dict[str, ModelRecord], fetches: dict[str, FetchRecord]) -> None:
        self.models = models
        self.fetches = fetches
        self.load: Counter[str] = Counter()                          # source -> its readers
        self.held: dict[str, set[tuple[str, int, int]]] = {}         # worker -> (model, v, shard)
        self.publishing: dict[str, set[tuple[str, int]]] = {}        # worker -> publishing (m, v)
        self.own_fetches: dict[str, set[str]] = {}                    # worker -> its fetch ids
        self.reading: dict[str, set[str]] = {}                        # source -> fetch ids
        self.readers: dict[ReplicaKey, set[str]] = {}                 # replica -> fetch ids
        # Work queues for `fabric.hub.retention.settle`.
        self.pending_retracts: set[ReplicaKey] = set()
        self.delayed: set[ReplicaKey] = set()
        self.dirty_models: set[str] = set()
        self.gc: set[tuple[str, int]] = set()
        self.pools: dict[PoolKey, ReplicaPool] = {}                 # every version's shards

    def add_replica(self, v: VersionRecord, rep: Replica) -> None:
        """Add `rep` to `v`, replacing the worker's replica of that shard."""
        key = (rep.worker, rep.shard)
        if key in v.replicas:
            self.remove_replica(v, key)
        v.replicas[key] = rep
        v.reindex(rep)
        self.held.setdefault(rep.worker, set()).add((v.model, v.number, rep.shard))
        self.pools.setdefault((v.model, v.number, rep.shard), ReplicaPool()).add(rep)

    def remove_replica(self, v: VersionRecord, key: tuple[str, int]) -> None:
        """Remove the replica at `key` from `v` and from the indexes."""
        rep = v.replicas.pop(key)
        v.reindex(rep)
        pool = self.pools[(v.model, v.number, rep.shard)]
        pool.remove(rep.worker)
        if not pool:
            del self.pools[(v.model, v.number, rep.shard)]
        held = self.held.get(rep.worker)
        if held is not None:
            held.discard((v.model, v.number, rep.shard))
            if not held:
                del self.held[rep.worker]
        self.delayed.discard((v.model, v.number, rep.shard, rep.worker))
        if v.state == RETIRED and not v.replicas:
            self.gc.add((v.model, v.number))

    def set_status(self, v: VersionRecord, rep: Replica, status: str) -> None:
        """Set `rep`'s status; a retracting replica is queued for retract."""
        rep.status = status
        v.reindex(rep)
        if status == RETRACTING:
            self.pending_retracts.add((v.model, v.number, rep.shard, rep.worker))

    def add_fetch(self, f: FetchRecord) -> None:
        """Index the fetch `f`."""
        self.fetches[f.fetch_id] = f
        self.own_fetches.setdefault(f.worker, set()).add(f.fetch_id)

    def pop_fetch(self, fetch_id: str) -> FetchRecord | None:
        """Remove and return the fetch `fetch_id` (None if unknown)."""
        f = self.fetches.pop(fetch_id, None)
        if f is not None:
            self.set_sources(f, set())
            own = self.own_fetches.get(f.worker)
            if own is not None:
                own.discard(fetch_id)
                if not own:
                    del self.own_fetches[f.worker]
        return f

    def add_publisher(self, worker: str, v: VersionRecord) -> None:
        """Record that `worker` publishes `v`."""
        self.publishing.setdefault(worker, set()).add((v.model, v.number))

    def unpublish(self, v: VersionRecord) -> None:
        """``v`` left ``publishing``: forget it in the publishers' index."""
        for w, _ in v.publishers:
            pubs = self.publishing.get(w)
            if pubs is not None:
                pubs.discard((v.model, v.number))
                if not pubs:
                    del self.publishing[w]

    def set_sources(self, f: FetchRecord, sources: set[str]) -> None:
        """The workers fetch ``f`` may read from are now ``sources``."""
        for w in f.sources - sources:
            self.load[w] -= 1
            if self.load[w] <= 0:
                del self.load[w]
            _discard(self.reading, w, f.fetch_id)
            key = (f.model, f.version, f.shard, w)
            if _discard(self.readers, key, f.fetch_id):   # its last reader left
                m = self.models.get(f.model)
                v = m.versions.get(f.version) if m else None
                r = v.replicas.get((w, f.shard)) if v else None
                if r is not None and r.status == RETRACTING:
                    self.pending_retracts.add(key)
        fid = f.fetch_id
        for w in sources - f.sources:    # (a set made only for a new key)
            self.load[w] += 1
            ids = self.reading.get(w)
            if ids is None:
                self.reading[w] = {fid}
            else:
                ids.add(fid)
            key = (f.model, f.version, f.shard, w)
            ids = self.readers.get(key)
            if ids is None:
                self.readers[key] = {fid}
            else:
                ids.add(fid)
        f.sources = set(sources)

    def check(self, workers: dict[str, Any]) -> None:
        """Assert every index equals what a full scan finds and no work is left queued."""
        held: dict[str, set] = {}
        publishing: dict[str, set] = {}
        readers: dict[tuple, set] = {}
        pools: dict[PoolKey, list[str]] = {}
        for m in self.models.values():
            for n, v in m.versions.items():
                for (w, s), r in v.replicas.items():
                    held.setdefault(w, set()).add((m.name, n, s))
                    pools.setdefault((m.name, n, s), []).append(w)
                    assert self.pools[(m.name, n, s)].replicas.get(w) is r, (m.name, n, w, s)
                    assert (r.complete and r.status == LIVE) == (
                        w in v.complete_live.get(s, ())), (m.name, n, w, s)
                    if r.retract_delayed and r.status == LIVE:
                        assert (m.name, n, s, w) in self.delayed
                if v.state == PUBLISHING:
                    for w, _ in v.publishers:
                        publishing.setdefault(w, set()).add((m.name, n))
                assert all(w in workers for ws in v.complete_live.values() for w in ws)
        assert held == self.held, (held, self.held)
        assert pools.keys() == self.pools.keys(), (pools.keys(), self.pools.keys())
        for key, in_order in pools.items():   # the replicas, in the order they began
            pool = self.pools[key]
            assert sorted(pool.order, key=pool.order.__getitem__) == in_order, key
            assert sorted(pool.members) == sorted(in_order) == sorted(pool.replicas), key
            assert all(pool.members[i] == w for w, i in pool.pos.items()), key
        assert publishing == self.publishing, (publishing, self.publishing)
        own: dict[str, set] = {}
        for fid, f in self.fetches.items():
            own.setdefault(f.worker, set()).add(fid)
            for w in f.sources:
                readers.setdefault((f.model, f.version, f.shard, w), set()).add(fid)
        assert own == self.own_fetches
        assert readers == self.readers
        assert {k: len(v) for k, v in self.reading.items()} == dict(self.load)
        assert not self.pending_retracts and not self.gc and not self.dirty_models


def _discard(index: dict, key: Any, item: str) -> bool:
    """Remove ``item`` from ``index[key]``; True when that emptied (and removed) the set."""
    items = index.get(key)
    if items is None:
        return False
    items.discard(item)
    if not items:
        del index[key]
        return True
    return False


__all__ = ["HubIndex", "PoolKey", "ReplicaKey", "ReplicaPool"]
