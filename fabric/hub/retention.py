"""Retention and retract settling: which versions a model keeps, and what may go.

Pure functions over the hub's records and `fabric.hub.index.HubIndex`, called by
`fabric.hub.state.HubState`: `retained` applies a model's `RetentionPolicy`,
`blocks_retention` says whether a retract would drop a retained version below
``min_replicas``, and `settle` (run after every operation that changes replicas,
readers or policies) retires what left retention, starts delayed retracts that
may now go and drops retracting replicas no fetch may read from any more.
"""

from __future__ import annotations

from collections.abc import Callable

from weightfabric.fabric.hub.index import HubIndex
from weightfabric.fabric.hub.records import (
    COMMITTED,
    LIVE,
    RETIRED,
    RETRACTING,
    ModelRecord,
    Replica,
    VersionRecord,
)


def retained(m: ModelRecord) -> set[int]:
    """Version numbers the model's retention policy keeps."""
    committed = sorted(n for n, v in m.versions.items() if v.state == COMMITTED)
    return set(committed[-m.policy.keep_last:]) | (m.policy.pinned & set(committed))


def blocks_retention(m: ModelRecord, v: VersionRecord, r: Replica) -> bool:
    """Retracting ``r`` would leave a retained version ``v`` below ``min_replicas``."""
    if v.state != COMMITTED or not r.complete or r.status != LIVE:
        return False
    if v.number not in retained(m):
        return False
    others = [w for w in v.complete_live.get(r.shard, ())
              if w != r.worker and not v.replicas[(w, r.shard)].retract_delayed]
    return len(others) < m.policy.min_replicas


def held_by(v: VersionRecord, worker: str) -> list[Replica]:
    """The worker's replicas of a version (one per shard at most)."""
    return [v.replicas[(worker, s)] for s in range(v.num_shards) if (worker, s) in v.replicas]


def retract_state(v: VersionRecord, worker: str) -> str:
    """``"done" | "delayed" | "retracting" | "live"``: where the worker's retract of ``v`` is."""
    reps = held_by(v, worker)
    if not reps:
        return "done"
    if any(r.status == LIVE and r.retract_delayed for r in reps):
        return "delayed"
    return "retracting" if any(r.status == RETRACTING for r in reps) else "live"


def settle(index: HubIndex, retire: Callable[[VersionRecord, str], None]) -> None:
    """Apply retention, start delayed retracts that may now go, drop finished retracts.

    Incremental: retention runs for the models whose committed set or policy changed,
    delayed retracts are few, and only retracting replicas whose last reader just
    left (or that just started retracting) are looked at.
    """
    models = index.models
    for name in sorted(index.dirty_models):
        m = models.get(name)
        if m is None:
            continue
        keep = retained(m)
        for n, v in m.versions.items():
            if v.state == COMMITTED and n not in keep:
                retire(v, "out of retention")
    index.dirty_models.clear()
    for key in sorted(index.delayed):
        model, number, shard, worker = key
        m = models[model]
        v = m.versions[number]
        r = v.replicas[(worker, shard)]
        if r.status != LIVE or not r.retract_delayed:
            index.delayed.discard(key)
        elif not blocks_retention(m, v, r):
            index.delayed.discard(key)
            r.retract_delayed = False
            index.set_status(v, r, RETRACTING)
    while index.pending_retracts:
        model, number, shard, worker = key = index.pending_retracts.pop()
        pm = models.get(model)
        pv = pm.versions.get(number) if pm else None
        pr = pv.replicas.get((worker, shard)) if pv else None
        if pv is not None and pr is not None and pr.status == RETRACTING \
                and key not in index.readers:
            index.remove_replica(pv, (worker, shard))
    for model, number in index.gc:
        gm = models.get(model)
        gv = gm.versions.get(number) if gm else None
        if gm is not None and gv is not None and gv.state == RETIRED and not gv.replicas:
            del gm.versions[number]
    index.gc.clear()


__all__ = ["blocks_retention", "held_by", "retained", "retract_state", "settle"]
