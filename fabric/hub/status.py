"""What `fabric hub status` shows: a plain-data view of a `HubState`.

Read-only; `fabric.hub.state.HubState.snapshot` calls `status_snapshot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightfabric.fabric.hub.records import LIVE, RETRACTING, FetchRecord

if TYPE_CHECKING:
    from weightfabric.fabric.hub.state import HubState

RECENT_FETCHES = 64
"""Completed fetches whose traffic the status shows."""
MAX_TRAFFIC_SOURCES = 64
"""Sources of one fetch's traffic kept (a reader's report is not trusted to be small)."""


def fetch_traffic(f: FetchRecord, traffic: dict[str, list[int]]) -> dict[str, Any]:
    """One completed fetch's traffic as the status shows it: per source and in all.

    ``traffic``: source -> [bytes delivered, bytes on the wire], as the reader reported it
    (at most `MAX_TRAFFIC_SOURCES` sources kept; what is not two counts >= 0 is dropped).
    """
    sources = {str(w): [int(v[0]), int(v[1])] for w, v in list(traffic.items())[:MAX_TRAFFIC_SOURCES]
               if len(v) == 2 and v[0] >= 0 and v[1] >= 0}
    return {"worker": f.worker, "model": f.model, "version": f.version, "shard": f.shard,
            "delivered": sum(v[0] for v in sources.values()),
            "wire": sum(v[1] for v in sources.values()), "sources": sources}


def status_snapshot(hub: HubState) -> dict[str, Any]:
    """Models (versions, replicas, retention), fetches in flight and workers, as plain data."""
    hub.expire()
    now = hub.lease_clock()
    models = {}
    for name, m in sorted(hub.models.items()):
        retained = hub.retained(name)
        versions = []
        for n, v in sorted(m.versions.items()):
            reps = list(v.replicas.values())
            versions.append({
                "version": n, "state": v.state, "num_shards": v.num_shards,
                "fingerprints": [v.manifests[s].fingerprint for s in sorted(v.manifests)],
                "full": sum(1 for r in reps if r.complete and r.status == LIVE),
                "partial": sum(1 for r in reps if not r.complete and r.status == LIVE),
                "retracting": sum(1 for r in reps if r.status == RETRACTING),
                "retained": n in retained, "pinned": n in m.policy.pinned,
                "reason": v.retire_reason})
        models[name] = {"latest": hub.latest(name), "policy": m.policy.to_wire(),
                        "next_version": hub.next_versions.get(name, 1),
                        "versions": versions,
                        "retired": [{"version": n, "reason": why}
                                    for n, why in sorted(m.retired_log.items())
                                    if n not in m.versions]}
    fetches = []
    for f in hub.fetches.values():
        rep = hub.models[f.model].versions[f.version].replicas.get((f.worker, f.shard))
        fetches.append({"fetch_id": f.fetch_id, "worker": f.worker, "model": f.model,
                        "version": f.version, "shard": f.shard,
                        "have": rep.count if rep else 0,
                        "num_chunks": len(rep.have) if rep else 0,
                        "sources": sorted(f.sources), "group": f.group})
    workers = [{"worker": w.worker_id, "location": w.location.to_wire(),
                "expires_in": round(w.expires - now, 3)}
               for w in sorted(hub.workers.values(), key=lambda w: w.expires)]
    plans = hub.plan_routing.summary() if hub.plan_routing is not None else []
    return {"lease_s": hub.lease_s, "lease_asked_s": hub.asked_lease_s,
            "heartbeat_rate": hub.heartbeat_rate, "models": models, "fetches": fetches,
            "recent_fetches": list(hub.recent_fetches), "workers": workers,
            "routing": "plan" if hub.plan_routing is not None else "ranked", "plans": plans}


__all__ = ["status_snapshot"]
