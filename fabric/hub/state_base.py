"""`HubStateBase`: the state a `HubState`'s parts share, declared once, and their common steps.

`HubState` (`fabric/hub/state.py`) is composed of parts, each in its own module: workers
and liveness (`state_workers.HubWorkers`), publishing and deriving
(`state_publish.HubPublishing`), restore and durability (`state_restore.HubRestoring`, over
publishing), fetching and plans (`state_fetch.HubFetching`), and retracts, retention,
rendezvous and queries (`state_queries.HubQueries`). They read and change one set of
attributes, which `HubState.__init__` sets (and documents); this class declares those
several parts use, so that each part type-checks on its own (an attribute one part alone
uses is declared in that part), and holds the steps several parts take: the lookups that
check a caller (`_worker`, `_model`, `_version`, `_resolve`, `_fetch`), retiring a version
(`_retire`), ending a fetch and aborting its group (`_end_fetch`, `_abort_group`), and
settling retention and retracts after a change (`_settle`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightfabric.fabric.errors import (
    DuplicateWorkerError,
    InvalidStateError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    UnknownWorkerError,
)
from weightfabric.fabric.hub.index import HubIndex
from weightfabric.fabric.hub.kv import KvStore
from weightfabric.fabric.hub.leases import Leases
from weightfabric.fabric.hub.persist import MAX_RETIRED_KEPT
from weightfabric.fabric.hub.planned import PlanRouter
from weightfabric.fabric.hub.records import (
    GROUP_ABORTED,
    GROUP_OPEN,
    RETIRED,
    RETRACTING,
    FetchGroup,
    FetchRecord,
    ModelRecord,
    VersionRanges,
    VersionRecord,
    WorkerRecord,
)
from weightfabric.fabric.hub.retention import settle
from weightfabric.fabric.locality import RankSources

if TYPE_CHECKING:
    from weightfabric.fabric.hub_messages import LocateReply

log = logging.getLogger(f"{__package__}.state")
"""The hub state's logger, whichever part logs (``weightfabric.fabric.hub.state``)."""


class HubStateBase:
    """The attributes of a `HubState` that its parts share (see `HubState.__init__`).

    And the steps several parts take (module docstring).
    """

    clock: Callable[[], float]
    lease_s: float
    asked_lease_s: float
    rank_sources: RankSources
    max_sources: int
    report_budget: int | None
    heartbeat_rate: float | None
    plan_routing: PlanRouter | None
    workers: dict[str, WorkerRecord]
    models: dict[str, ModelRecord]
    fetches: dict[str, FetchRecord]
    groups: OrderedDict[tuple[str, str], FetchGroup]
    next_versions: dict[str, int]
    seen: dict[str, VersionRanges]
    generation: int
    durable_generation: int
    _lease_now: float
    _lease_read: bool = False
    """The lease clock was read for the requests being answered (`answering_batch`)."""
    kv: KvStore
    _index: HubIndex
    _leases: Leases

    if TYPE_CHECKING:
        # Operations of one part that other parts (and the steps below) call.
        def expire(self) -> list[str]:
            """`state_workers.HubWorkers.expire`."""

        def latest(self, model: str) -> int | None:
            """`state_queries.HubQueries.latest`."""

        def locate(self, model: str, version: int | str, *, worker: str | None = None
                   ) -> LocateReply:
            """`state_queries.HubQueries.locate`."""

    # ------------------------------------------------------------------ lookups
    def _touch(self) -> None:
        self.generation += 1

    def _worker(self, worker: str, session: str) -> WorkerRecord:
        """The calling worker's record; its request renews its lease as a heartbeat would.

        Every operation a worker runs as itself (`hub_messages.RENEWS_LEASE`) comes here
        first: a worker that fetches or publishes is alive, so its client may skip the
        heartbeats that would only renew the lease (`fabric.client.heartbeat_due`).

        Raises:
            UnknownWorkerError: not registered, or its lease already expired.
            DuplicateWorkerError: the worker id belongs to another session.
        """
        if not self._lease_read:
            self.expire()      # read the lease clock: ``_lease_now`` is now
        rec = self.workers.get(worker)
        if rec is None:
            raise UnknownWorkerError(f"worker {worker!r} is not registered (or its lease "
                                     "expired); register it again")
        if rec.session != session:
            raise DuplicateWorkerError(f"worker id {worker!r} belongs to another client")
        rec.expires = self._lease_now + self.lease_s
        self._leases.renew(worker)
        return rec

    def _model(self, model: str) -> ModelRecord:
        m = self.models.get(model)
        if m is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise UnknownModelError(f"no model {model!r} on this hub (known: {known})")
        return m

    def _version(self, model: str, version: int) -> VersionRecord:
        m = self._model(model)
        v = m.versions.get(version) if isinstance(version, int) else None
        if v is None:
            raise UnknownVersionError(f"{model!r} has no version {version!r} "
                                      f"(latest: {self.latest(model)})")
        return v

    def _resolve(self, m: ModelRecord, version: int | str) -> int:
        if version == "latest":
            number = self.latest(m.name)
            if number is None:
                raise UnknownVersionError(f"{m.name!r} has no committed version with a live "
                                          "replica yet; wait for one (wait_version)")
            return number
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int or 'latest', got {version!r}")
        return version

    def _fetch(self, fetch_id: str, worker: str, session: str) -> FetchRecord:
        self._worker(worker, session)
        f = self.fetches.get(fetch_id)
        if f is None or f.done:
            raise UnknownFetchError(f"no fetch {fetch_id!r} in flight (completed, released, "
                                    "or its lease expired); begin a new fetch")
        if f.worker != worker:
            raise InvalidStateError(f"fetch {fetch_id!r} belongs to {f.worker!r}")
        return f

    # ------------------------------------------------------------ common changes
    def _retire(self, v: VersionRecord, reason: str) -> None:
        v.state, v.retire_reason = RETIRED, reason
        self._index.unpublish(v)
        m = self.models[v.model]
        m.publish_groups.pop(v.group or "", None)
        m.policy.pinned.discard(v.number)
        if not v.replicas:
            self._index.gc.add((v.model, v.number))
        m.retired_log[v.number] = reason
        while len(m.retired_log) > MAX_RETIRED_KEPT:
            del m.retired_log[next(iter(m.retired_log))]
        self.durable_generation += 1
        log.info("retired model=%s version=%d why=%s", v.model, v.number, reason)

    def _end_fetch(self, f: FetchRecord, *, keep_replica: bool, reason: str = "") -> None:
        f.done = True
        self._index.pop_fetch(f.fetch_id)
        m = self.models.get(f.model)
        v = m.versions.get(f.version) if m else None
        if not keep_replica and v is not None:
            rep = v.replicas.get((f.worker, f.shard))
            if rep is not None and not rep.complete:
                self._index.set_status(v, rep, RETRACTING)
        if f.group is not None:
            g = self.groups.get((f.model, f.group))
            if g is not None and g.state == GROUP_OPEN and not keep_replica:
                self._abort_group(g, reason or f"{f.worker} left")
        self._touch()

    def _abort_group(self, g: FetchGroup, reason: str) -> None:
        g.state, g.reason = GROUP_ABORTED, reason
        log.warning("fetch group aborted group=%s model=%s version=%d why=%s", g.key, g.model,
                    g.version, reason)
        for fid in list(g.members):
            f = self._index.pop_fetch(fid)
            if f is None:
                continue
            f.done = True
            v = self.models[f.model].versions.get(f.version)
            rep = v.replicas.get((f.worker, f.shard)) if v else None
            if v is not None and rep is not None and not rep.complete:
                self._index.set_status(v, rep, RETRACTING)

    def _settle(self) -> None:
        """Apply retention and finish what retracts may (`fabric.hub.retention.settle`)."""
        settle(self._index, self._retire)
        self._touch()

    def _check_indexes(self) -> None:
        """Assert every index equals what a full scan finds (tests call this)."""
        self._index.check(self.workers)
        self._leases.check(self.workers)


def _check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in 0..num_shards-1, got shard={shard} "
                         f"num_shards={num_shards}")
