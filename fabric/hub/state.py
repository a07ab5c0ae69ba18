"""The hub's state machine: pure Python, no I/O, an injectable clock.

`HubState` holds per model the versions (numbers assigned here, monotonic and
never reused), their manifests and replicas, the fetches in flight and the
retention policy; its methods are the hub's operations. A derived model
(``base@layout``, `begin_derive`) is the exception: its numbers are its base's,
and a retired one may be derived again. The server
(`fabric.hub.server`) only decodes requests, calls these methods and parks
long-polls; tests drive this class directly.

Its operations are in parts, a module each, mixed into `HubState` over
`fabric.hub.state_base.HubStateBase` (the attributes they share, declared once, and the
steps several parts take): `fabric.hub.state_workers` (register, heartbeats, liveness:
`expire`, the lease clock), `fabric.hub.state_publish` (publishing and deriving, manifest
checks), `fabric.hub.state_restore` (`restore` after a hub restart, `durable`),
`fabric.hub.state_fetch` (fetches, plans, fetch groups) and `fabric.hub.state_queries`
(retracts, retention, rendezvous, `latest`, `locate`); this module keeps the constructor,
`load` and `snapshot`.

What it owns, a module each: `fabric.hub.index` (incremental indexes and
work queues), `fabric.hub.leases` (worker leases, publish claims),
`fabric.hub.retention` (retention, retract settling), `fabric.hub.routing` (a
plan's sources), `fabric.hub.kv` (rendezvous store), `fabric.hub.status`
(status snapshot); records are in `fabric.hub.records`. What must outlive the process
(`durable`) the server saves through a `fabric.hub.record_store.RecordStore` (memory, a
state dir, or etcd) before it replies; a new `HubState` starts from what one loaded.

Invariants (checked by ``tests/fabric/hub/test_hub_state_machine.py`` after every step):

* version numbers of a model only grow and are never handed out twice (derived models
  take their base's numbers instead);
* `latest` is a committed version whose every shard has a live, complete,
  routable replica held by a worker with a valid lease;
* a plan names only live workers' routable replicas that have the chunk
  (a partial replica only for chunks it reported), never the reader itself;
* a retract never drops a retained version below ``min_replicas``;
* a fetch group's replicas all become complete together, or none do;
* a publishing version nobody claims for a lease is retired (orphaned), and a retired
  version never becomes publishing or committed again (lease loss, hub restart), but
  for a derived version derived again (`begin_derive`, or restored by a holder);
* every index (by worker, by replica, lease order) equals a full scan (`_check_indexes`;
  the indexes live in `fabric.hub.index`, leases and publish claims in `fabric.hub.leases`).

Liveness: every operation first expires leases against the lease clock (`lease_clock`,
which stops while the hub stalls or is behind its requests, `backlogged`); the server
also calls `expire` on a timer. An expired worker's replicas leave every plan and its
fetches end; fetches that could read from it learn so in their next heartbeat.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from weightfabric.fabric.hub.index import HubIndex
from weightfabric.fabric.hub.kv import MAX_KV_KEY, MAX_KV_KEYS, MAX_KV_VALUE, KvStore
from weightfabric.fabric.hub.leases import Leases
from weightfabric.fabric.hub.node_plans import NodePlans
from weightfabric.fabric.hub.persist import DurableState
from weightfabric.fabric.hub.planned import PlanRouter
from weightfabric.fabric.hub.records import (
    PUBLISHING,
    FetchGroup,
    FetchRecord,
    ModelRecord,
    RetentionPolicy,
    VersionRanges,
    VersionRecord,
    WorkerRecord,
)
from weightfabric.fabric.hub.state_fetch import MAX_FINISHED_GROUPS as MAX_FINISHED_GROUPS
from weightfabric.fabric.hub.state_fetch import REPORT_BUDGET as REPORT_BUDGET
from weightfabric.fabric.hub.state_fetch import HubFetching
from weightfabric.fabric.hub.state_publish import (
    MAX_CHUNKS,
    HubPublishing,
    check_manifest_size,
    derived_base,
)
from weightfabric.fabric.hub.state_queries import HubQueries
from weightfabric.fabric.hub.state_restore import HubRestoring, parse_holding
from weightfabric.fabric.hub.state_workers import HubWorkers
from weightfabric.fabric.hub.status import RECENT_FETCHES, status_snapshot
from weightfabric.fabric.hub_messages import StatusReply
from weightfabric.fabric.locality import RankSources, rank_by_locality

DEFAULT_LEASE_S = 10.0
HEARTBEAT_RATE = 1000.0
"""Heartbeats per second a hub's leases ask for at most (``heartbeat_rate``): a
heartbeat costs the hub process about 0.3 ms on the dev VM (its I/O included), so 1,000/s
is under a third of a core. Up to 3,333 workers keep the default 10 s lease; 10,000 get 30 s."""


class HubState(HubWorkers, HubRestoring, HubPublishing, HubFetching, HubQueries):
    """All the hub knows, and its operations.

    Args:
        clock: returns the current time in seconds (monotonic); tests inject a fake.
        lease_s: how long a heartbeat keeps a worker (and its replicas and fetches) alive.
        rank_sources: orders candidate sources for a reader (see `fabric.locality`).
        max_sources: sources named per chunk range in a plan.
        next_versions: per model, the next version number to hand out (from a state dir).
        policies: per model, retention policies restored from a state dir.
        durable: everything a state dir kept (`fabric.hub.persist`); its counters and
            policies are used where ``next_versions`` / ``policies`` do not say otherwise.
        stall_after: for a caller that reads `lease_clock` often (the server's loop, every
            `TICK_S`): real seconds between two readings beyond which the hub counts as
            stalled (`forgive_stall`). None: never.
        plan_routing: plans each version's broadcast over a cluster and routes its planned
            readers along it (`fabric.hub.planned`); None: every plan is ranked.
        report_budget: progress reports the fetches of one shard in flight are asked for
            in all, at most (each plan says ``max_reports``: this over the fetches in flight,
            `fabric.hub.state_fetch`); None: as many as the readers send.
        heartbeat_rate: heartbeats per second the workers' leases ask for in all, at most:
            the lease grows beyond ``lease_s`` to 3 x workers / this (`HEARTBEAT_RATE` by
            default; None: ``lease_s`` however many register).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 lease_s: float = DEFAULT_LEASE_S, rank_sources: RankSources = rank_by_locality,
                 max_sources: int = 4, next_versions: dict[str, int] | None = None,
                 policies: dict[str, RetentionPolicy] | None = None,
                 durable: DurableState | None = None, stall_after: float | None = None,
                 plan_routing: PlanRouter | None = None,
                 report_budget: int | None = REPORT_BUDGET,
                 heartbeat_rate: float | None = HEARTBEAT_RATE) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if report_budget is not None and report_budget < 0:
            raise ValueError(f"report_budget must be >= 0, got {report_budget}")
        if heartbeat_rate is not None and not heartbeat_rate > 0:
            raise ValueError(f"heartbeat_rate must be > 0, got {heartbeat_rate}")
        self.report_budget = report_budget
        self.heartbeat_rate = heartbeat_rate
        self.clock = clock
        self.lease_s = float(lease_s)
        self.asked_lease_s = self.lease_s      # `lease_s` grows beyond it (`heartbeat_rate`)
        self.rank_sources = rank_sources
        self.plan_routing = plan_routing
        self.max_sources = max(1, int(max_sources))
        self.workers: dict[str, WorkerRecord] = {}
        self.models: dict[str, ModelRecord] = {}
        self.fetches: dict[str, FetchRecord] = {}
        self.recent_fetches: deque[dict[str, Any]] = deque(maxlen=RECENT_FETCHES)
        """The last completed fetches' traffic (`fabric hub status`)."""
        self.groups: OrderedDict[tuple[str, str], FetchGroup] = OrderedDict()
        durable = durable or DurableState()
        self.next_versions: dict[str, int] = {**durable.next_versions, **(next_versions or {})}
        # Per model, every version number this hub has handed out or heard of (with a
        # state dir, also before restarts): one of those missing from `versions` was retired.
        self.seen = {m: VersionRanges(r) for m, r in durable.seen.items()}
        self.generation = 0
        self.durable_generation = 0
        self.kv = KvStore(clock)
        self.kv.restore(durable.kv)
        self.quarantined: dict[str, set[tuple[str, int, int]]] = {}
        """Per holder, replicas readers found corrupt that its next heartbeat hears of."""
        self._index = HubIndex(self.models, self.fetches)
        self._node_plans = NodePlans()       # a node's first reader's plan (relay batches)
        self.stall_after = stall_after
        self._stalled, self._lease_now = 0.0, -math.inf   # see `lease_clock`
        self._behind_since: float | None = None            # see `backlogged`
        self._last_read = time.monotonic()                # real time: a stall is real
        self._leases = Leases(self.lease_clock, self.lease_s)
        for name, policy in {**durable.policies, **(policies or {})}.items():
            self.models[name] = ModelRecord(name, policy)
        for name, reasons in durable.retired.items():
            self.models.setdefault(name, ModelRecord.named(name)).retired_log.update(reasons)
        for name, versions in (durable.versions or {}).items():
            m = self.models.setdefault(name, ModelRecord.named(name))
            for n, (state, num_shards, fingerprints) in versions.items():
                v = VersionRecord(name, n, num_shards, state=state, recorded=dict(fingerprints))
                m.versions[n] = v
                self.seen.setdefault(name, VersionRanges()).add(n)
                if state == PUBLISHING:     # its publisher must come back within a lease
                    self._leases.claim(v)

    @property
    def load(self) -> Counter[str]:
        """Per source worker, the fetches in flight that may read from it."""
        return self._index.load

    def snapshot(self) -> StatusReply:
        """Everything `fabric hub status` shows, as plain data (`fabric.hub.status`)."""
        return status_snapshot(self)


__all__ = ["DEFAULT_LEASE_S", "HEARTBEAT_RATE", "MAX_CHUNKS", "MAX_KV_KEY", "MAX_KV_KEYS",
           "MAX_KV_VALUE", "REPORT_BUDGET", "HubState", "check_manifest_size", "derived_base",
           "parse_holding"]
