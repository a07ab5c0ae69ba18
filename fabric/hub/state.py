"""The hub's state machine: pure Python, no I/O, an injectable clock.

`HubState` holds per model the versions (numbers assigned here, monotonic and
never reused), their manifests and replicas, the fetches in flight and the
retention policy; its methods are the hub's operations. A derived model
(``base@layout``, `begin_derive`) is the exception: its numbers are its base's,
and a retired one may be derived again. The server
(`fabric.hub.server`) only decodes requests, calls these methods and parks
long-polls; tests drive this class directly.

Its parts, each owned by `HubState`: `fabric.hub.index` (incremental indexes and
work queues), `fabric.hub.leases` (worker leases, publish claims),
`fabric.hub.retention` (retention, retract settling), `fabric.hub.routing` (a
plan's sources), `fabric.hub.kv` (rendezvous store), `fabric.hub.status`
(status snapshot); records are in `fabric.hub.records`.

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
which stops while the hub stalls); the server also calls `expire` on a timer. An
expired worker's replicas leave every plan and its fetches end; fetches that could
read from it learn so in their next heartbeat.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from weightfabric.fabric.errors import (
    BadRequestError,
    DuplicateWorkerError,
    GroupAbortedError,
    InvalidStateError,
    ManifestMismatchError,
    NoSourceError,
    RetentionError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    UnknownWorkerError,
)
from weightfabric.fabric.hub.index import HubIndex
from weightfabric.fabric.hub.kv import MAX_KV_KEY, MAX_KV_KEYS, MAX_KV_VALUE, KvStore
from weightfabric.fabric.hub.leases import Leases
from weightfabric.fabric.hub.persist import MAX_RETIRED_KEPT, DurableState
from weightfabric.fabric.hub.planned import PlanRouter, VersionPlan
from weightfabric.fabric.hub.records import (
    COMMITTED,
    GROUP_ABORTED,
    GROUP_COMMITTED,
    GROUP_OPEN,
    LIVE,
    PUBLISHING,
    RETIRED,
    RETRACTING,
    FetchGroup,
    FetchRecord,
    ModelRecord,
    Replica,
    RetentionPolicy,
    VersionRanges,
    VersionRecord,
    WorkerRecord,
)
from weightfabric.fabric.hub.retention import (
    blocks_retention,
    held_by,
    retained,
    retract_state,
    settle,
)
from weightfabric.fabric.hub.routing import holders, missing_runs, route, runs
from weightfabric.fabric.hub.status import RECENT_FETCHES, fetch_traffic, status_snapshot
from weightfabric.fabric.hub_messages import (
    BeginPublishReply,
    CommitWaitReply,
    CompleteReply,
    DeriveReply,
    DropReply,
    EmptyReply,
    Endpoints,
    GroupStatusReply,
    HeartbeatReply,
    Holder,
    Holding,
    KvPutReply,
    LocateReply,
    LocateShard,
    ManifestWire,
    PlanReply,
    PlanSource,
    PolicyReply,
    ProgressReply,
    PublishStateReply,
    RegisterReply,
    ReportCorruptReply,
    RestoreReply,
    RetractReply,
    StatusReply,
)
from weightfabric.fabric.locality import Location, RankSources, rank_by_locality
from weightfabric.fabric.manifest import Manifest

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0
MAX_FINISHED_GROUPS = 4096
MAX_CHUNKS = 1 << 20    # per manifest: 4 TB in 4 MiB chunks; the hub keeps a byte per chunk


class HubState:
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
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 lease_s: float = DEFAULT_LEASE_S, rank_sources: RankSources = rank_by_locality,
                 max_sources: int = 4, next_versions: dict[str, int] | None = None,
                 policies: dict[str, RetentionPolicy] | None = None,
                 durable: DurableState | None = None, stall_after: float | None = None,
                 plan_routing: PlanRouter | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.clock = clock
        self.lease_s = float(lease_s)
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
        self.quarantined: dict[str, set[tuple[str, int, int]]] = {}
        """Per holder, replicas readers found corrupt that its next heartbeat hears of."""
        self._index = HubIndex(self.models, self.fetches)
        self.stall_after = stall_after
        self._stalled, self._lease_now = 0.0, -math.inf   # see `lease_clock`
        self._last_read = time.monotonic()                # real time: a stall is real
        self._leases = Leases(self.lease_clock, self.lease_s)
        for name, policy in {**durable.policies, **(policies or {})}.items():
            self.models[name] = ModelRecord(name, policy)
        for name, reasons in durable.retired.items():
            self.models.setdefault(name, ModelRecord.named(name)).retired_log.update(reasons)
        for name, versions in (durable.versions or {}).items():
            m = self.models.setdefault(name, ModelRecord.named(name))
            for n, (state, num_shards) in versions.items():
                v = VersionRecord(name, n, num_shards, state=state)
                m.versions[n] = v
                self.seen.setdefault(name, VersionRanges()).add(n)
                if state == PUBLISHING:     # its publisher must come back within a lease
                    self._leases.claim(v)

    @property
    def load(self) -> Counter[str]:
        """Per source worker, the fetches in flight that may read from it."""
        return self._index.load

    # ----------------------------------------------------------------- workers
    def register(self, worker: str, *, session: str, location: Location | None = None,
                 endpoints: Endpoints | None = None) -> RegisterReply:
        """Register (or refresh) a worker and start its lease.

        Raises:
            DuplicateWorkerError: a live worker with this id belongs to another session.
            ValueError: an empty worker id.
        """
        self.expire()
        if not worker:
            raise ValueError("worker id must not be empty")
        rec = self.workers.get(worker)
        if rec is not None and rec.session != session:
            raise DuplicateWorkerError(
                f"worker id {worker!r} is already registered by another live client "
                f"(lease ends in {rec.expires - self.lease_clock():.1f} s); pick a unique "
                "worker id")
        self.workers[worker] = WorkerRecord(worker, session, location or Location(),
                                            dict(endpoints or {}),
                                            self.lease_clock() + self.lease_s)
        self._leases.renew(worker)
        if rec is None:
            log.info("worker registered worker=%s location=%s", worker, location)
        self._touch()
        return RegisterReply(lease_s=self.lease_s)

    def heartbeat(self, worker: str, *, session: str,
                  publishing: list[tuple[str, int]] | None = None) -> HeartbeatReply:
        """Renew a worker's lease; returns news for it.

        Args:
            publishing: ``[(model, version)]`` the worker knows it is publishing; only
                those keep their publish claim (a version it began but never heard of —
                its reply was lost — is then retired as orphaned after a lease). None:
                every version it publishes is claimed (older clients).

        Returns:
            ``lease_s``, ``lost`` (``{fetch_id: [workers]}``), ``retired`` (``[(model,
            version)]``): sources that died under the worker's fetches (re-plan those chunks), and
            versions it holds that left retention (it may retract them).

        Raises:
            UnknownWorkerError: not registered, or the lease already expired.
        """
        rec = self._worker(worker, session)
        rec.expires = self.lease_clock() + self.lease_s
        self._leases.renew(worker)
        claimed = (self._index.publishing.get(worker, set()) if publishing is None
                   else {(str(m), int(n)) for m, n in publishing}
                   & self._index.publishing.get(worker, set()))
        for model, number in claimed:
            self._leases.claim(self.models[model].versions[number])
        lost: dict[str, list[str]] = {}
        for fid in self._index.own_fetches.get(worker, ()):
            f = self.fetches[fid]
            if f.lost:
                lost[fid] = sorted(f.lost)
                f.lost.clear()
        retired = sorted({(m, n) for m, n, _ in self._index.held.get(worker, ())
                          if self.models[m].versions[n].state == RETIRED})
        quarantined = sorted(self.quarantined.pop(worker, set()))
        return HeartbeatReply(lease_s=self.lease_s, lost=lost, retired=retired,
                              quarantined=quarantined)

    def unregister(self, worker: str, *, session: str) -> EmptyReply:
        """Remove a worker now, as if its lease expired."""
        self._worker(worker, session)
        self._drop_worker(worker, "unregistered")
        self._settle()
        return EmptyReply()

    def drop(self, model: str, worker: str, *, session: str) -> DropReply:
        """The worker lets go of everything it holds of ``model`` (its memory is going away).

        Its replicas and fetches of that model go at once, as if it were lost (fetch groups
        abort, readers learn it, versions it was publishing retire); retention is not
        consulted.

        Returns:
            ``dropped``: the versions whose replica was dropped.

        Raises:
            UnknownWorkerError: not registered, or the lease already expired.
            DuplicateWorkerError: the worker id belongs to another client.
        """
        self._worker(worker, session)
        log.info("worker dropped model=%s worker=%s", model, worker)
        dropped = self._drop_holdings(worker, f"dropped {model!r}", model)
        self._settle()
        return DropReply(dropped=dropped)

    def report_corrupt(self, model: str, version: int, shard: int, holder: str, worker: str, *,
                       session: str, chunks: list[int]) -> ReportCorruptReply:
        """A reader found ``chunks`` of ``holder``'s replica failing their checksum.

        The replica is quarantined: the hub stops listing it (plans, ``latest``, retention
        counts), fetches reading from it learn that it is lost, and the holder hears it in
        its next heartbeat (``quarantined``), stops serving it and fetches it again. The
        reader re-reads the chunks elsewhere either way.

        Returns:
            ``quarantined``: False (nothing changed) when the hub no longer listed that
            replica, or when it is the shard's last complete one.

        Raises:
            UnknownWorkerError: the reporter is not registered.
            UnknownModelError, UnknownVersionError: no such model or version.
            BadRequestError: a worker reporting itself.
        """
        self._worker(worker, session)
        if holder == worker:
            raise BadRequestError(f"{worker!r} reported its own replica of {model!r} v{version}; "
                                  "a worker re-fetches what it finds corrupt")
        v = self._version(model, version)
        rep = v.replicas.get((holder, shard))
        others = [w for w in v.complete_live.get(shard, ()) if w != holder]
        if rep is None or not rep.complete or not others:
            # the last complete replica stays listed: readers keep failing on its bad chunks
            # (a FetchError naming them), and one report cannot take a version from everyone
            return ReportCorruptReply(quarantined=False)
        log.warning("quarantined %s v%d shard %d of %s: chunks %s failed their checksum at %s",
                    model, version, shard, holder, chunks[:8], worker)
        for fid in list(self._index.reading.get(holder, ())):
            f = self.fetches[fid]
            if f.model == model and f.version == version:
                self._index.set_sources(f, f.sources - {holder})
                f.lost.add(holder)
        self._index.remove_replica(v, (holder, shard))
        self.quarantined.setdefault(holder, set()).add((model, version, shard))
        self._settle()
        return ReportCorruptReply(quarantined=True)

    def expire(self) -> list[str]:
        """Drop every worker whose lease ended (and rendezvous keys whose ttl ran out).

        Returns the dropped workers' ids.
        """
        self.kv.expire()
        now = self.lease_clock()
        dead = self._leases.expired(self.workers, now)
        for w in dead:
            self._drop_worker(w, "lease expired")
        orphans = False
        for v in self._leases.lapsed(self.models, now):
            self._retire(v, f"orphaned: no publisher claimed it for {self.lease_s:g} s (its "
                            "begin_publish reply was lost, e.g. retried across a hub restart, "
                            "or no publisher came back after one); publish again")
            orphans = True
        if dead or orphans:
            self._settle()
        return dead

    def lease_clock(self) -> float:
        """The time leases and publish claims run on.

        The clock, less the time the hub was stalled (`forgive_stall`); never earlier than
        it said before. With ``stall_after``, a reading that comes more than that after the
        previous one ends a stall first.
        """
        if self.stall_after is not None:
            real = time.monotonic()
            if real - self._last_read > self.stall_after:
                self.forgive_stall(real - self._last_read)
            self._last_read = real
        self._lease_now = max(self._lease_now, self.clock() - self._stalled)
        return self._lease_now

    def forgive_stall(self, stalled_s: float) -> None:
        """Stop the lease clock for the ``stalled_s`` s the hub looked at no lease.

        The hub looked at no lease for ``stalled_s`` s (its process was paused, or one
        request took that long), so heartbeats may be waiting unread: stop the lease clock
        for that time, so that nobody is dropped, nor a version retired, for time the hub
        did not listen. (A hub that stalls over and over keeps dead workers as long.)
        """
        self._stalled += stalled_s
        if self.workers:
            log.warning("hub stalled for %.1f s; leases and publish claims stopped as long",
                        stalled_s)

    # ----------------------------------------------------------------- publish
    def begin_publish(self, model: str, worker: str, manifest: Manifest, *, session: str,
                      shard: int = 0, num_shards: int = 1, group: str | None = None
                      ) -> BeginPublishReply:
        """Start publishing one shard of a new version; the hub assigns the number.

        Model-parallel publishers pass the same ``group`` key and ``num_shards``: the
        first call creates the version, the others join it.

        Returns:
            The ``version`` number.

        Raises:
            BadRequestError: a name with ``@`` (a derived layout: `begin_derive`).
            ManifestMismatchError: another publisher of this shard sent another manifest.
            InvalidStateError: the group's version is no longer publishing, or the shard
                numbers do not fit.
        """
        self._worker(worker, session)
        if "@" in model:
            raise BadRequestError(f"cannot publish {model!r}: names with @ are derived layouts; "
                                  "use begin_derive")
        _check_shard(shard, num_shards)
        check_manifest_size(manifest)
        m = self.models.setdefault(model, ModelRecord.named(model))
        v = None
        if group is not None and group in m.publish_groups:
            v = m.versions.get(m.publish_groups[group])
            if v is None or v.state != PUBLISHING:
                raise InvalidStateError(f"publish group {group!r} of {model!r} is no longer "
                                        "publishing; use a new group key")
            if v.num_shards != num_shards:
                raise InvalidStateError(f"publish group {group!r} has {v.num_shards} shards, "
                                        f"this call says {num_shards}")
        if v is None:
            number = max(self.next_versions.get(model, 1), 1)
            self.next_versions[model] = number + 1
            self.seen.setdefault(model, VersionRanges()).add(number)
            self.durable_generation += 1
            v = VersionRecord(model, number, num_shards, group=group)
            m.versions[number] = v
            if group is not None:
                m.publish_groups[group] = number
        self._add_publisher(v, worker, shard, manifest)
        log.info("begin publish model=%s version=%d shard=%d worker=%s", model, v.number, shard,
                 worker)
        self._touch()
        return BeginPublishReply(version=v.number)

    def _add_publisher(self, v: VersionRecord, worker: str, shard: int,
                       manifest: Manifest) -> None:
        """``worker`` publishes ``shard`` of ``v``: its manifest, claim and (empty) replica."""
        self._set_manifest(v, shard, manifest)
        v.publishers[(worker, shard)] = False
        self._index.add_publisher(worker, v)
        self._leases.claim(v)
        self._index.add_replica(v, Replica(worker, shard, bytearray(manifest.num_chunks)))

    def commit(self, model: str, version: int, worker: str, *, session: str,
               checksums: list[int] | None = None) -> PublishStateReply:
        """Commit the worker's shards of a publishing version.

        The version becomes committed (and may become `latest`) once every shard has a
        committed publisher; until then its state stays ``publishing``.

        Args:
            checksums: for a derived version (`begin_derive`) begun without checksums: one
                per chunk, computed while deriving; its manifest gets them.

        Returns:
            ``state``: ``"publishing"`` or ``"committed"``.

        Raises:
            InvalidStateError: the worker is not a publisher of this version.
            GroupAbortedError: the version was retired (a publisher of the group was lost).
            BadRequestError: ``checksums`` for a version that is not derived, or whose
                manifest has checksums already, or not one per chunk.
        """
        self._worker(worker, session)
        v = self._version(model, version)
        if v.state == RETIRED:
            raise GroupAbortedError(f"{model!r} v{version} was retired ({v.retire_reason}); "
                                    "publish again")
        mine = [k for k in v.publishers if k[0] == worker]
        if not mine:
            raise InvalidStateError(f"{worker!r} did not begin publishing {model!r} v{version}")
        if checksums is not None:
            self._add_checksums(v, checksums)
        if v.state == PUBLISHING:
            self._leases.claim(v)
        for key in mine:
            v.publishers[key] = True
            rep = v.replicas.get(key)
            if rep is not None:
                rep.fill()
        self._commit_if_every_shard_committed(v, worker)
        self._settle()
        return PublishStateReply(state=v.state)

    def abort_publish(self, model: str, version: int, worker: str, *, session: str,
                      reason: str = "") -> PublishStateReply:
        """Abandon the worker's publish of a version that is still publishing.

        A publisher whose local step failed after the hub assigned the number (a region
        its read server refused, say) calls this so the version retires at once instead
        of staying ``publishing`` while its heartbeats keep claiming it. A model-parallel
        version retires as a whole (all or none).

        Returns:
            ``state``: ``"retired"``.

        Raises:
            InvalidStateError: the worker is not a publisher of this version, or the
                version is committed already (retract it instead).
        """
        self._worker(worker, session)
        v = self._version(model, version)
        if not any(k[0] == worker for k in v.publishers):
            raise InvalidStateError(f"{worker!r} did not begin publishing {model!r} v{version}")
        if v.state == PUBLISHING:
            self._retire(v, f"publisher {worker} aborted: {reason or 'no reason given'}")
            self._settle()      # a version without replicas goes now
        elif v.state != RETIRED:
            raise InvalidStateError(f"{model!r} v{version} is {v.state}, not publishing: "
                                    "retract it instead")
        return PublishStateReply(state=v.state)

    def _commit_if_every_shard_committed(self, v: VersionRecord, worker: str) -> None:
        """A publishing version whose every shard has a committed publisher commits."""
        if v.state != PUBLISHING or not all(
                any(done for (_, s), done in v.publishers.items() if s == shard)
                for shard in range(v.num_shards)):
            return
        v.state = COMMITTED
        self._index.unpublish(v)
        for rep in v.replicas.values():
            if v.publishers.get((rep.worker, rep.shard)):
                rep.complete = True
                v.reindex(rep)
        self.models[v.model].publish_groups.pop(v.group or "", None)
        self._index.dirty_models.add(v.model)
        self.durable_generation += 1
        log.info("committed model=%s version=%d worker=%s", v.model, v.number, worker)

    # ------------------------------------------------------------------ derive
    def begin_derive(self, model: str, version: int, worker: str, manifest: Manifest, *,
                     session: str, with_base: bool = False) -> DeriveReply:
        """Derive version ``version`` of ``model`` (``base@layout``), or learn who does.

        A derived version holds the base model's version ``version`` converted to a layout
        the name encodes; its number is the base's (not assigned here) and one worker at a
        time derives it. The deriver publishes it as a one-shard version (publish claim,
        `commit` with the checksums it computed, `abort_publish`); a deriver that dies or
        aborts leaves it retired, and the next caller derives it again.

        Returns:
            ``action``: ``"derive"`` (absent, retired, or committed with no live holder
            left: this worker derives it now; again for the worker already deriving it), ``"wait"`` (``by`` derives it, or None: a
            deriver may come back after a hub restart; ask again later), ``"fetch"``
            (committed: fetch it like any version).

            With ``with_base``, a ``"derive"`` answer also says where the base version can be
            read (`locate`'s answer for this worker: one hub call fewer for the deriver).

        Raises:
            BadRequestError: ``model`` is not ``base@layout``, or ``version`` < 1.
            UnknownModelError, UnknownVersionError: the base version is not committed.
            NoSourceError: with ``with_base``, a shard of the base has no complete live
                replica (nothing changed).
            ManifestMismatchError: ``manifest`` lays the bytes out otherwise than the
                version's deriver did.
            ValueError: a manifest over `MAX_CHUNKS` chunks.
        """
        self._worker(worker, session)
        base = derived_base(model)
        if base is None:
            raise BadRequestError(f"{model!r} is not a derived model name: derived model names "
                                  "are base@layout (e.g. 'policy@vllm-tp2.r1')")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise BadRequestError(f"version must be an int >= 1, got {version!r}")
        self._check_base(base, version)
        check_manifest_size(manifest)
        m = self.models.setdefault(model, ModelRecord.named(model))
        v = m.versions.get(version)
        if v is not None and v.state == COMMITTED and not v.servable():
            self._retire(v, "no live holder left: derived again")  # its holders all left
        if v is not None and v.state != RETIRED:
            answer = self._derive_answer(v, worker, manifest)
            if answer.action == "derive" and with_base:
                return DeriveReply(action="derive", by=None,
                                   base=self.locate(base, version, worker=worker))
            return answer
        where = self.locate(base, version, worker=worker) if with_base else None
        if v is not None:
            self._forget_version(v)
        v = VersionRecord(model, version, 1)
        m.versions[version] = v
        m.retired_log.pop(version, None)
        self.next_versions[model] = max(self.next_versions.get(model, 1), version + 1)
        self.seen.setdefault(model, VersionRanges()).add(version)
        self.durable_generation += 1
        self._add_publisher(v, worker, 0, manifest)
        log.info("begin derive model=%s version=%d worker=%s", model, version, worker)
        self._settle()
        return DeriveReply(action="derive", by=None, base=where)

    def commit_state(self, model: str, version: int, shard: int = 0) -> CommitWaitReply:
        """A version's state, and ``shard``'s checksums once it is committed (`wait_commit`).

        Raises:
            UnknownModelError, UnknownVersionError: no such model or version.
            ValueError: no such shard.
        """
        v = self._version(model, version)
        _check_shard(shard, v.num_shards)
        if v.state != COMMITTED:
            return CommitWaitReply(state=v.state, reason=v.retire_reason or "")
        manifest = v.manifests.get(shard)
        return CommitWaitReply(state=v.state,
                               checksums=list(manifest.checksums) if manifest else [])

    def _derive_answer(self, v: VersionRecord, worker: str, manifest: Manifest) -> DeriveReply:
        """`begin_derive`'s answer for a derived version that is publishing or committed.

        Raises:
            ManifestMismatchError: ``manifest`` lays the bytes out otherwise than ``v``.
        """
        _check_layout(v, manifest)
        if v.state == COMMITTED:
            return DeriveReply(action="fetch", by=None)
        deriver = next((w for w, _ in v.publishers), None)
        if deriver != worker:
            return DeriveReply(action="wait", by=deriver)
        self._leases.claim(v)           # its deriver asks again: idempotent
        return DeriveReply(action="derive", by=None)

    def _check_base(self, base: str, number: int) -> None:
        """Refuse to derive from a base version that is not committed.

        Raises:
            UnknownModelError, UnknownVersionError: no such base model, or its version
                ``number`` is absent, publishing or retired.
        """
        if base not in self.models:
            known = ", ".join(sorted(n for n in self.models if "@" not in n))
            raise UnknownModelError(f"no base model {base!r} on this hub to derive from "
                                    f"(known: {known or 'none'})")
        v = self.models[base].versions.get(number)
        if v is None or v.state != COMMITTED:
            raise UnknownVersionError(
                f"base model {base!r} v{number} is {v.state if v else 'absent'}, not committed; "
                "derive only from a committed version")

    def _forget_version(self, v: VersionRecord) -> None:
        """Remove retired ``v`` now, with its replicas and fetches, to reuse its number.

        Its fetches end (their groups abort) and its remaining holders' replicas go (the
        bytes of a derived version are the same whoever derives them again).
        """
        for fid in [fid for w, _ in v.replicas for fid in self._index.own_fetches.get(w, ())]:
            f = self.fetches.get(fid)
            if f is not None and (f.model, f.version) == (v.model, v.number):
                self._end_fetch(f, keep_replica=False, reason=f"{v.model!r} v{v.number} is "
                                                              "derived again")
        for key in list(v.replicas):
            self._index.remove_replica(v, key)
        self._index.gc.discard((v.model, v.number))
        del self.models[v.model].versions[v.number]

    def _add_checksums(self, v: VersionRecord, checksums: list[int]) -> None:
        """Give derived version ``v`` the checksums its deriver computed (`commit`).

        Raises:
            BadRequestError: ``v`` is not derived, its manifest had checksums (other ones,
                or ``v`` is still publishing), or they are not one int per chunk.
            InvalidStateError: ``v`` has no manifest (restored without its deriver).
        """
        if derived_base(v.model) is None:
            raise BadRequestError(f"checksums at commit are only for derived versions "
                                  f"(begin_derive); {v.model!r} carries them in its manifest")
        manifest = v.manifests.get(0)
        if manifest is None:
            raise InvalidStateError(f"{v.model!r} v{v.number} has no manifest here")
        bad = [c for c in checksums if isinstance(c, bool) or not isinstance(c, int)
               or not -(1 << 63) <= c < 1 << 64]
        if bad:
            raise BadRequestError(f"checksums must be 64-bit ints, got {bad[:4]}")
        new = tuple(checksums)
        if manifest.checksums:
            if v.state == COMMITTED and manifest.checksums == new:
                return          # a commit retried after its reply was lost
            raise BadRequestError(f"{v.model!r} v{v.number} was begun with checksums in its "
                                  "manifest; commit it without checksums")
        if v.state != PUBLISHING:
            raise BadRequestError(f"{v.model!r} v{v.number} is {v.state} without checksums; "
                                  "they can only come with its first commit")
        if len(new) != manifest.num_chunks:
            raise BadRequestError(f"{len(new)} checksums for {v.model!r} v{v.number}, whose "
                                  f"manifest has {manifest.num_chunks} chunks: one per chunk")
        v.manifests[0] = Manifest(manifest.tensors, manifest.chunk_size, new,
                                  manifest.total_bytes)

    # ------------------------------------------------------------------- fetch
    def begin_fetch(self, model: str, version: int | str, worker: str, *, session: str,
                    fetch_id: str, shard: int = 0, fingerprint: str | None = None,
                    group: str | None = None, group_size: int = 1,
                    have: list[int] | None = None) -> PlanReply:
        """Start (or resume) a fetch of one shard; the reader becomes a partial replica.

        Args:
            version: a number or ``"latest"`` (a group resolves it once for all members).
            fetch_id: chosen by the client, unique; calling again with it resumes.
            fingerprint: the manifest fingerprint the reader expects, if it knows it.
            group, group_size: model-parallel readers fetching together (all or none).
            have: chunks the reader already holds (resume after a hub restart).

        Returns:
            The plan, see `plan`.

        Raises:
            UnknownModelError, UnknownVersionError: nothing to fetch.
            ManifestMismatchError: ``fingerprint`` differs from the version's manifest.
            NoSourceError: some chunks have no live source.
            InvalidStateError: the fetch id is another worker's, or this worker already
                fetches (or holds) this version and shard.
            GroupAbortedError: the fetch group is aborted or committed already (a retired
                version is an UnknownVersionError).
            ValueError: no such shard.
        """
        self._worker(worker, session)
        if fetch_id in self.fetches:
            f = self.fetches[fetch_id]
            if f.worker != worker:
                raise InvalidStateError(f"fetch id {fetch_id!r} belongs to {f.worker!r}")
            return self.plan(fetch_id, worker, session=session)
        m = self._model(model)
        g = None
        if group is not None:
            g = self.groups.get((model, group))
            if g is not None and g.state != GROUP_OPEN:
                raise GroupAbortedError(f"fetch group {group!r} is already {g.state}"
                                        f"{': ' + g.reason if g.reason else ''}; use a new key")
            if g is not None and g.size != group_size:
                raise InvalidStateError(f"fetch group {group!r} has size {g.size}, "
                                        f"this call says {group_size}")
            if g is not None and len(g.members) >= g.size:
                raise InvalidStateError(f"fetch group {group!r} already has {g.size} members")
        number = g.version if g is not None else self._resolve(m, version)
        v = self._version(model, number)
        if v.state != COMMITTED and not _being_derived(v):
            raise UnknownVersionError(f"{model!r} v{number} is {v.state}, not fetchable")
        _check_shard(shard, v.num_shards)
        manifest = v.manifests.get(shard)
        if manifest is None:     # restored after a hub restart without this shard's holders
            raise NoSourceError(f"{model!r} v{number} shard {shard}: no live replica holds it "
                                "(its holders did not come back after a hub restart)")
        if fingerprint is not None and fingerprint != manifest.fingerprint:
            raise ManifestMismatchError(
                f"{model!r} v{number} shard {shard} has manifest {manifest.fingerprint}, the "
                f"reader expects {fingerprint}: tensor names, shapes, dtypes or chunking differ")
        rep = v.replicas.get((worker, shard))
        for fid in self._index.own_fetches.get(worker, ()):
            other = self.fetches[fid]
            if (other.model, other.version, other.shard) == (model, number, shard):
                raise InvalidStateError(
                    f"{worker!r} is already fetching {model!r} v{number} shard {shard} as "
                    f"fetch {fid!r}; resume it with fetch_id={fid!r} or release it first")
        if rep is not None and not rep.complete and rep.status != LIVE:
            # The partial replica of a fetch that ended (failed, released, retracted), kept
            # retracting while peers' fetches still name this worker: this fetch starts a
            # new one (the worker exposes it anew; its read server drains the old one).
            self._index.remove_replica(v, (worker, shard))
            rep = None
        if rep is not None and (rep.complete or rep.status != LIVE):
            raise InvalidStateError(f"{worker!r} already holds {model!r} v{number} shard {shard}"
                                    + (" (retracting)" if rep.status != LIVE else ""))
        have = _check_chunks(have or [], manifest.num_chunks)   # check before any change
        if group is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if rep is None:
            rep = Replica(worker, shard, bytearray(manifest.num_chunks))
            self._index.add_replica(v, rep)
        if have:
            rep.add_chunks(have)
        if group is not None and g is None:
            g = FetchGroup(group, model, number, group_size)
            self.groups[(model, group)] = g
            self._trim_groups()
        f = FetchRecord(fetch_id, model, number, shard, worker, group=group)
        self._index.add_fetch(f)
        if g is not None:
            g.members[fetch_id] = False
        if self.plan_routing is not None and not _being_derived(v):
            self.plan_routing.begin(v, shard, worker, workers=self.workers, now=self.clock())
        self._touch()
        try:
            return self.plan(fetch_id, worker, session=session)
        except NoSourceError:
            self._end_fetch(f, keep_replica=False)
            self._settle()
            raise

    def plan(self, fetch_id: str, worker: str, *, session: str,
             chunks: list[int] | None = None, exclude: list[str] | None = None,
             with_manifest: bool = True) -> PlanReply:
        """(Re)plan a fetch: ranked sources for each chunk range the reader still needs.

        Args:
            chunks: the chunks to plan (default: those the reader has not reported).
            exclude: workers the reader failed to read from; not named again in this plan.
            with_manifest: include the manifest (a reader that kept it from `begin_fetch`
                asks without: it is one checksum per chunk, megabytes for a big shard).

        Returns:
            A `PlanReply`: ``fetch_id, model, version, shard, num_shards, manifest,
            fingerprint, ranges`` (each ``start, stop, sources, wait``) and ``workers``
            (each ``location, endpoints, complete``); ``manifest`` only
            ``with_manifest``. Chunks
            ``start..stop-1`` can be read from any of ``sources`` (best first; each has
            them now); ``wait`` names partial replicas ranked better than every source
            that do not have them yet and began fetching before this reader (so waits
            never form a cycle; advisory: wait on their progress or read a source).

        Raises:
            NoSourceError: no live source holds some of the chunks.
        """
        f = self._fetch(fetch_id, worker, session)
        v = self._version(f.model, f.version)
        manifest = v.manifests[f.shard]
        rep = v.replicas[(worker, f.shard)]
        need = (runs(_check_chunks(chunks, manifest.num_chunks)) if chunks is not None
                else missing_runs(rep.have))
        banned = set(exclude or ())
        planned = self._version_plan(f)
        if planned is not None:
            router, vp = planned
            ranges, named, missing = router.route(
                vp, v, f.shard, worker, need, banned=banned, workers=self.workers,
                load=self._index.load, rank_sources=self.rank_sources,
                max_sources=self.max_sources, now=self.clock())
        else:
            ranges, named, missing = route(v, f.shard, worker, need, banned=banned,
                                           workers=self.workers, load=self._index.load,
                                           rank_sources=self.rank_sources,
                                           max_sources=self.max_sources,
                                           wait_only=_being_derived(v))
        if missing:
            raise NoSourceError(
                f"{f.model!r} v{f.version} shard {f.shard}: no live replica holds chunks "
                f"{_fmt_chunks(missing)}; wait for a holder to (re)register or fetch another version")
        # Reads from an earlier plan may still be in flight: sources accumulate until the
        # reader narrows them (report_progress(sources=)), excludes them, or finishes.
        self._index.set_sources(f, (f.sources - banned) | named)
        if self._index.pending_retracts:          # an excluded retracting source may be done
            self._settle()
        return PlanReply(
            fetch_id=f.fetch_id, model=f.model, version=f.version, shard=f.shard,
            num_shards=v.num_shards, fingerprint=manifest.fingerprint, ranges=ranges,
            workers={w: PlanSource(location=self.workers[w].location.to_wire(),
                                   endpoints=self.workers[w].endpoints,
                                   complete=v.replicas[(w, f.shard)].complete)
                     for w in sorted(named)},
            manifest=ManifestWire.of(manifest) if with_manifest else None,
            planned=planned is not None)

    def _version_plan(self, f: FetchRecord) -> tuple[PlanRouter, VersionPlan] | None:
        """The plan router and broadcast plan routing fetch ``f``, when its reader is planned."""
        router = self.plan_routing
        vp = router.plan_of(f.model, f.version, f.shard) if router is not None else None
        return (router, vp) if router is not None and vp is not None \
            and f.worker in vp.readers else None

    def unstarted_upstreams(self, fetch_id: str) -> list[str]:
        """The planned upstreams of a fetch that are live but have not begun theirs.

        A planned reader waits for them in ``begin_fetch`` (`fabric.hub.planned`); empty
        for a fetch routed by ranking.
        """
        f = self.fetches.get(fetch_id)
        planned = self._version_plan(f) if f is not None else None
        if f is None or planned is None:
            return []
        router, vp = planned
        return router.waits_for(vp, self._version(f.model, f.version), f.shard, f.worker,
                                self.workers)

    def report_progress(self, fetch_id: str, worker: str, *, session: str,
                        chunks: list[int], sources: list[str] | None = None
                        ) -> ProgressReply:
        """Record chunks the reader now holds (verified); others may read them from it.

        Args:
            chunks: newly held chunk indices.
            sources: if given, the only workers the reader may still read from (lets
                their retracts finish sooner).

        Returns:
            ``have`` (chunks held), ``num_chunks``, ``lost`` (workers): ``lost``: sources
            of this fetch that died since last told (re-plan the chunks you miss).
        """
        f = self._fetch(fetch_id, worker, session)
        v = self._version(f.model, f.version)
        rep = v.replicas[(worker, f.shard)]
        rep.add_chunks(_check_chunks(chunks, len(rep.have)))
        if sources is not None:
            self._index.set_sources(f, set(sources) & f.sources)
        lost = sorted(f.lost)
        f.lost.clear()
        self._settle()
        return ProgressReply(have=rep.count, num_chunks=len(rep.have), lost=lost)

    def complete_fetch(self, fetch_id: str, worker: str, *, session: str,
                       traffic: dict[str, list[int]] | None = None) -> CompleteReply:
        """The reader holds every chunk, verified: it becomes a complete replica.

        In a fetch group the replicas become complete only when every member completed.
        ``traffic`` (source -> [bytes delivered, bytes on the wire]) joins `recent_fetches`.

        Returns:
            ``complete`` (bool), ``group``: None, ``"open"``, ``"committed"`` or ``"aborted"``
            (``"aborted"``: this completion found a member gone and aborted the group).

        Raises:
            UnknownFetchError: the fetch is over, e.g. its group was aborted earlier.
        """
        f = self._fetch(fetch_id, worker, session)
        v = self._version(f.model, f.version)
        if v.state == PUBLISHING:
            raise InvalidStateError(f"{f.model!r} v{f.version} is {v.state}: a copy of a "
                                    "version still being derived completes once it is "
                                    "committed (wait_commit, then check its checksums)")
        rep = v.replicas[(worker, f.shard)]
        rep.fill()
        if traffic is not None:
            self.recent_fetches.append(fetch_traffic(f, traffic))
        if f.group is None:
            rep.complete = True
            v.reindex(rep)
            self._end_fetch(f, keep_replica=True)
            self._settle()
            return CompleteReply(complete=True, group=None)
        g = self.groups[(f.model, f.group)]
        g.members[fetch_id] = True
        f.done = True
        self._index.set_sources(f, set())
        if len(g.members) == g.size and all(g.members.values()):
            self._commit_group(g, v)
        self._settle()
        return CompleteReply(complete=g.state == GROUP_COMMITTED, group=g.state)

    def _commit_group(self, g: FetchGroup, v: VersionRecord) -> None:
        """Commit group `g`, every member of which completed.

        Their replicas become complete together, or, if one no longer holds a live replica,
        the group aborts (all or none).
        """
        members = [self.fetches.get(fid) for fid in g.members]
        reps = [None if f is None else v.replicas.get((f.worker, f.shard)) for f in members]
        if any(r is None or r.status != LIVE for r in reps):
            self._abort_group(g, "a member's replica was retracted or lost before the group "
                                 "committed")
            return
        g.state = GROUP_COMMITTED
        for f, rep in zip(members, reps, strict=True):
            # A missing fetch gives rep None, and every rep was checked live above.
            assert f is not None and rep is not None, "checked above: every member has a replica"
            self._index.pop_fetch(f.fetch_id)
            rep.complete = True
            v.reindex(rep)
        log.info("fetch group committed group=%s model=%s version=%d", g.key, g.model, g.version)

    def group_status(self, model: str, group: str) -> GroupStatusReply:
        """A fetch group's ``state, version, size, done, reason``."""
        self.expire()
        g = self.groups.get((model, group))
        if g is None:
            raise UnknownFetchError(f"no fetch group {group!r} for {model!r}")
        return GroupStatusReply(state=g.state, version=g.version, size=g.size,
                                done=sum(g.members.values()), reason=g.reason)

    def release(self, fetch_id: str, worker: str, *, session: str) -> EmptyReply:
        """Abandon a fetch: its partial replica stops being routed (a group aborts)."""
        f = self._fetch(fetch_id, worker, session)
        self._end_fetch(f, keep_replica=False, reason=f"{worker} released its fetch")
        self._settle()
        return EmptyReply()

    # ----------------------------------------------------------------- retract
    def retract(self, model: str, version: int, worker: str, *, session: str,
                delay: bool = False) -> RetractReply:
        """Stop routing reads to the worker's replicas of a version.

        Returns:
            ``state``: ``done`` — no read may be in
            flight, the holder may overwrite; ``retracting`` — waiting for fetches that may
            read from it (see `retract_status`); ``delayed`` — still routed until another
            replica lets retention hold.

        Raises:
            UnknownVersionError: the worker holds no replica of this version.
            RetentionError: the retract would drop a retained version below
                ``min_replicas`` and ``delay`` is false.
        """
        self._worker(worker, session)
        v = self._version(model, version)
        reps = held_by(v, worker)
        if not reps:
            raise UnknownVersionError(f"{worker!r} holds no replica of {model!r} v{version}")
        blocked = any(blocks_retention(self.models[model], v, r) for r in reps)
        if blocked and not delay:
            policy = self.models[model].policy
            raise RetentionError(
                f"retracting {worker!r}'s replica of {model!r} v{version} would leave fewer "
                f"than min_replicas={policy.min_replicas} live copies of a retained version; "
                "retract with delay (waits for another replica), unpin it, or lower keep_last")
        # Its fetches of the version end now, delayed or not: their replicas are not
        # complete (they never hold retention up), and a fetch must keep its replica.
        for fid in list(self._index.own_fetches.get(worker, ())):
            f = self.fetches[fid]      # a done one is a group member waiting for the others
            if f.model == model and f.version == version:
                self._end_fetch(f, keep_replica=False, reason=f"{worker} retracted")
        reps = [r for r in held_by(v, worker) if r.status == LIVE]
        if blocked:
            for r in reps:
                r.retract_delayed = True
                self._index.delayed.add((model, version, r.shard, worker))
            self._settle()  # the ended fetches' replicas go once no reader is left
            return RetractReply(state="delayed")
        for r in reps:
            r.retract_delayed = False
            self._index.delayed.discard((model, version, r.shard, worker))
            self._index.set_status(v, r, RETRACTING)
        self._settle()
        return RetractReply(state=retract_state(v, worker))

    def retract_status(self, model: str, version: int, worker: str) -> RetractReply:
        """A retract's ``state``: ``done``, ``retracting``, ``delayed`` or ``live``."""
        self.expire()
        m = self.models.get(model)
        v = m.versions.get(version) if m else None
        if v is None:
            return RetractReply(state="done")
        return RetractReply(state=retract_state(v, worker))

    # --------------------------------------------------------------- retention
    def set_retention(self, model: str, *, keep_last: int | None = None,
                      min_replicas: int | None = None) -> PolicyReply:
        """Change a model's retention policy (creates the model if new)."""
        m = self.models.setdefault(model, ModelRecord.named(model))
        policy = RetentionPolicy(keep_last if keep_last is not None else m.policy.keep_last,
                                 min_replicas if min_replicas is not None
                                 else m.policy.min_replicas, set(m.policy.pinned))
        m.policy = policy
        self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._settle()
        return _policy_reply(policy)

    def pin(self, model: str, version: int, pinned: bool = True) -> PolicyReply:
        """Pin (retain regardless of ``keep_last``) or unpin a committed version."""
        v = self._version(model, version)
        policy = self.models[model].policy
        if pinned:
            if v.state == RETIRED:
                raise InvalidStateError(f"{model!r} v{version} is retired; it cannot be pinned")
            policy.pinned.add(version)
        else:
            policy.pinned.discard(version)
        self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._settle()
        return _policy_reply(policy)

    # --------------------------------------------------------------- rendezvous
    def kv_put(self, key: str, value: bytes, *, ttl: float | None = None) -> KvPutReply:
        """Store a small value under ``key`` (last writer wins); soft state.

        Args:
            key: 1..`MAX_KV_KEY` bytes of UTF-8; one flat namespace per hub (use prefixes
                such as ``"job-7/nvshmem-uid"``).
            value: at most `MAX_KV_VALUE` bytes.
            ttl: seconds until the key vanishes (None: until the hub stops).

        Returns:
            The value's ``size`` in bytes.

        Raises:
            ValueTooLargeError: the key or value is over its limit, or the hub already
                holds `MAX_KV_KEYS` keys.
            BadRequestError: a ``ttl`` that is not a finite number > 0 (NaN, inf).
            ValueError: empty key.
        """
        self.kv.put(key, value, ttl=ttl)
        self._touch()
        return KvPutReply(size=len(value))

    def kv_get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None when it is absent (or its ttl ran out).

        Raises:
            ValueTooLargeError: the key is over `MAX_KV_KEY` bytes.
            ValueError: empty key.
        """
        return self.kv.get(key)

    # ------------------------------------------------------------------ queries
    def latest(self, model: str) -> int | None:
        """The newest committed version with a complete live replica of every shard."""
        self.expire()
        m = self.models.get(model)
        if m is None:
            return None
        for number in sorted(m.versions, reverse=True):
            if m.versions[number].servable():
                return number
        return None

    def locate(self, model: str, version: int | str, *, worker: str | None = None
               ) -> LocateReply:
        """Where every shard of a committed version can be read whole.

        Where every shard of a committed version can be read whole, for a reader that does
        not become a replica (it transforms the bytes as it reads them, e.g. to another
        tensor-parallel layout). Read-only: nothing is recorded, so a holder may retract
        meanwhile; its read server then refuses, and the reader tries the next.

        Returns:
            ``model, version, num_shards, shards`` (each ``manifest, holders``) and
            ``workers`` (each ``location, endpoints``); holders ranked for ``worker``'s location.

        Raises:
            UnknownModelError, UnknownVersionError: nothing committed to read.
            NoSourceError: some shard has no complete live replica.
        """
        self.expire()
        m = self._model(model)
        v = self._version(model, self._resolve(m, version))
        if v.state != COMMITTED:
            raise UnknownVersionError(f"{model!r} v{v.number} is {v.state}, not committed")
        reader = self.workers[worker].location if worker in self.workers else Location()
        shards: list[LocateShard] = []
        for k in range(v.num_shards):
            ranked = holders(v, k, reader, workers=self.workers, load=self._index.load,
                             rank_sources=self.rank_sources)
            if not ranked:
                raise NoSourceError(f"{model!r} v{v.number} shard {k}: no complete live replica")
            shards.append(LocateShard(manifest=ManifestWire.of(v.manifests[k]), holders=ranked))
        named = sorted({w for sh in shards for w in sh.holders})
        return LocateReply(model=model, version=v.number, num_shards=v.num_shards,
                           shards=shards,
                           workers={w: Holder(location=self.workers[w].location.to_wire(),
                                              endpoints=self.workers[w].endpoints)
                                    for w in named})

    def retained(self, model: str) -> set[int]:
        """Version numbers the model's retention policy keeps."""
        return retained(self.models[model])

    def snapshot(self) -> StatusReply:
        """Everything `fabric hub status` shows, as plain data (`fabric.hub.status`)."""
        return status_snapshot(self)

    # ----------------------------------------------------------------- restore
    def restore(self, worker: str, *, session: str, holdings: list[Holding]) -> RestoreReply:
        """Re-register what a worker holds after a hub restart (soft state).

        Every holding is checked before anything changes (`parse_holding`); then each
        is restored, or rejected when it does not fit what the hub knows. A holding of
        a fetch group, not complete, is rejected: groups do not survive a restart.

        Returns:
            How many were ``restored``, and ``[(model, version, shard, why)]`` of each
            ``rejected``.

        Raises:
            BadRequestError: a malformed holding (nothing changed).
        """
        self._worker(worker, session)
        parsed = [(h, parse_holding(h)) for h in holdings]
        restored, rejected = 0, []
        try:
            for h, manifest in parsed:
                try:
                    self._restore_one(worker, h, manifest)
                    restored += 1
                except (ManifestMismatchError, InvalidStateError, ValueError) as exc:
                    rejected.append((h.model, h.version, h.shard, str(exc)))
        finally:        # even a bug half-way leaves retention and retracts settled
            self._settle()
        return RestoreReply(restored=restored, rejected=rejected)

    def _restore_one(self, worker: str, h: Holding, manifest: Manifest) -> None:
        model, number, shard, num_shards = h.model, h.version, h.shard, h.num_shards
        _check_shard(shard, num_shards)
        if h.group is not None and not h.complete:
            raise InvalidStateError(f"it was fetched in fetch group {h.group!r}, and fetch "
                                    "groups do not survive a hub restart; begin a new group")
        derived = derived_base(model) is not None
        if derived and num_shards != 1:
            raise InvalidStateError(f"a derived version has 1 shard, holder says {num_shards}")
        m = self.models.setdefault(model, ModelRecord.named(model))
        if number >= self.next_versions.get(model, 1):
            self.next_versions[model] = number + 1
            self.durable_generation += 1
        v = m.versions.get(number)
        seen = self.seen.setdefault(model, VersionRanges())
        if v is None and number in seen and not derived:
            # Retired earlier (in this run, or before a restart with a state dir): it stays
            # retired; the holder hears so in its heartbeat news and may retract.
            v = VersionRecord(model, number, num_shards, state=RETIRED, retire_reason=(
                m.retired_log.get(number) or "retired before the hub restarted"))
            m.versions[number] = v
        elif v is None:
            state = COMMITTED if h.state == COMMITTED else PUBLISHING
            v = VersionRecord(model, number, num_shards, state=state)
            m.versions[number] = v
            m.retired_log.pop(number, None)     # a derived version derived again
            seen.add(number)
            self.durable_generation += 1
            if state == PUBLISHING:
                self._leases.claim(v)
        if v.num_shards != num_shards:
            raise InvalidStateError(f"v{number} has {v.num_shards} shards, holder says {num_shards}")
        if (derived and h.publisher and v.state == PUBLISHING
                and any(w != worker for w, _ in v.publishers)):
            raise InvalidStateError(f"v{number} is derived again by another worker now; "
                                    "begin_derive to learn whether to fetch it")
        if v.state == PUBLISHING and h.state == COMMITTED:
            v.state = COMMITTED
            self._index.unpublish(v)
            self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._set_manifest(v, shard, manifest)
        rep = Replica(worker, shard, bytearray(manifest.num_chunks))
        committed_shard = h.publisher and h.complete
        if h.complete and v.state == COMMITTED:
            rep.fill()
            rep.complete = True
        elif committed_shard:       # this shard committed, the version waits for others
            rep.fill()
        else:
            rep.add_chunks(h.chunks)
        self._index.add_replica(v, rep)
        if h.publisher and v.state == PUBLISHING:
            v.publishers[(worker, shard)] = committed_shard
            self._index.add_publisher(worker, v)
            self._leases.claim(v)
            self._commit_if_every_shard_committed(v, worker)
        fid = h.fetch_id
        if fid and not rep.complete and v.state == COMMITTED and fid not in self.fetches:
            self._index.add_fetch(FetchRecord(fid, model, number, shard, worker))

    # ---------------------------------------------------------------- internals
    def _touch(self) -> None:
        self.generation += 1

    def _worker(self, worker: str, session: str) -> WorkerRecord:
        self.expire()
        rec = self.workers.get(worker)
        if rec is None:
            raise UnknownWorkerError(f"worker {worker!r} is not registered (or its lease "
                                     "expired); register it again")
        if rec.session != session:
            raise DuplicateWorkerError(f"worker id {worker!r} belongs to another client")
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

    def _set_manifest(self, v: VersionRecord, shard: int, manifest: Manifest) -> None:
        old = v.manifests.get(shard)
        if old is not None and old.fingerprint != manifest.fingerprint:
            raise ManifestMismatchError(
                f"{v.model!r} v{v.number} shard {shard} was published with manifest "
                f"{old.fingerprint}, this one is {manifest.fingerprint}")
        v.manifests.setdefault(shard, manifest)

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

    def durable(self) -> DurableState:
        """What a state dir must keep so a restarted hub goes on (`fabric.hub.persist`)."""
        return DurableState(
            next_versions=dict(self.next_versions),
            policies={n: m.policy for n, m in self.models.items()},
            versions={n: {k: (v.state, v.num_shards) for k, v in m.versions.items()
                          if v.state != RETIRED} for n, m in self.models.items()},
            seen={n: r.to_wire() for n, r in self.seen.items()},
            retired={n: dict(m.retired_log) for n, m in self.models.items() if m.retired_log})

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

    def _drop_worker(self, worker: str, why: str) -> None:
        level = logging.INFO if why == "unregistered" else logging.WARNING
        log.log(level, "worker dropped worker=%s why=%s", worker, why)
        self.workers.pop(worker, None)
        self._leases.drop(worker)
        self._drop_holdings(worker, why)

    def _drop_holdings(self, worker: str, why: str, model: str | None = None) -> list[int]:
        """The worker lost its replicas and fetches (of ``model``, or all).

        Its fetches end (their groups abort), readers of it learn it, the versions it was
        publishing retire. Retention is not consulted. Returns the versions whose replica
        went.
        """
        def mine(name: str) -> bool:
            return model is None or name == model
        for fid in list(self._index.own_fetches.get(worker, ())):
            f = self.fetches.get(fid)
            if f is not None and mine(f.model):
                self._end_fetch(f, keep_replica=False, reason=f"{worker}: {why}")
        for fid in list(self._index.reading.get(worker, ())):
            f = self.fetches[fid]
            if mine(f.model):
                self._index.set_sources(f, f.sources - {worker})
                f.lost.add(worker)
        dropped = set()
        for name, number, shard in list(self._index.held.get(worker, ())):
            if mine(name):
                self._index.remove_replica(self.models[name].versions[number], (worker, shard))
                dropped.add(number)
        for name, number in list(self._index.publishing.get(worker, ())):
            if mine(name):
                self._retire(self.models[name].versions[number],
                             f"publisher {worker} lost ({why})")
        self._touch()
        return sorted(dropped)

    def _settle(self) -> None:
        """Apply retention and finish what retracts may (`fabric.hub.retention.settle`)."""
        settle(self._index, self._retire)
        self._touch()

    def _check_indexes(self) -> None:
        """Assert every index equals what a full scan finds (tests call this)."""
        self._index.check(self.workers)
        self._leases.check(self.workers)

    def _trim_groups(self) -> None:
        finished = [k for k, g in self.groups.items() if g.state != GROUP_OPEN]
        for k in finished[:max(0, len(finished) - MAX_FINISHED_GROUPS)]:
            del self.groups[k]


def check_manifest_size(manifest: Manifest) -> None:
    """Refuse a manifest of more than `MAX_CHUNKS` chunks.

    Refuse a manifest of more than `MAX_CHUNKS` chunks (the hub's work per replica, plan and
    progress report grows with the chunk count).

    Raises:
        ValueError: too many chunks; the message suggests a chunk size that fits.
    """
    if manifest.num_chunks > MAX_CHUNKS:
        fits = 1 << max(0, -(-manifest.total_bytes // MAX_CHUNKS) - 1).bit_length()
        raise ValueError(f"manifest has {manifest.num_chunks} chunks, over the hub's limit of "
                         f"{MAX_CHUNKS} per manifest; publish with a larger chunk_size "
                         f"(at least {fits} bytes for {manifest.total_bytes} bytes)")


def parse_holding(h: Holding) -> Manifest:
    """A `restore` holding's manifest, after every check its types cannot say.

    Raises:
        BadRequestError: a bad manifest, version < 1, or chunk indices out of range.
    """
    try:
        manifest = h.manifest.manifest()
        check_manifest_size(manifest)
    except ValueError as exc:
        raise BadRequestError(f"bad manifest in holding: {exc}") from exc
    if h.version < 1:
        raise BadRequestError(f"holding version must be >= 1, got {h.version}")
    bad = [c for c in h.chunks if not 0 <= c < manifest.num_chunks]
    if bad:
        raise BadRequestError(f"holding chunk indices out of range 0..{manifest.num_chunks - 1}:"
                              f" {bad[:8]}")
    return manifest


def _being_derived(v: VersionRecord) -> bool:
    """A derived version its deriver is still making: readers may copy it as it fills.

    Its plans name the deriver as a partial replica to wait on; its copies complete only
    once it is committed, after the readers checked the checksums it committed.
    """
    return v.state == PUBLISHING and "@" in v.model


def derived_base(model: str) -> str | None:
    """The base model of a derived model name (``"policy@vllm-tp2.r1"`` -> ``"policy"``).

    None for a plain name (no ``@``).

    Raises:
        BadRequestError: a derived name with an empty base or layout.
    """
    base, at, layout = model.partition("@")
    if not at:
        return None
    if not base or not layout:
        raise BadRequestError(f"bad derived model name {model!r}: derived model names are "
                              "base@layout, both parts non-empty")
    return base


def _check_layout(v: VersionRecord, manifest: Manifest) -> None:
    """Refuse a manifest that lays a derived version's bytes out otherwise than its own.

    Checksums are compared only where both have them (a deriver computes them late).

    Raises:
        ManifestMismatchError: tensors, chunking, size or checksums differ.
    """
    own = v.manifests.get(0)
    if own is None:
        return
    same = ((own.tensors, own.chunk_size, own.total_bytes)
            == (manifest.tensors, manifest.chunk_size, manifest.total_bytes))
    if same and (not own.checksums or not manifest.checksums
                 or own.checksums == manifest.checksums):
        return
    raise ManifestMismatchError(
        f"{v.model!r} v{v.number} is derived with manifest {own.fingerprint}, this one is "
        f"{manifest.fingerprint}: the layout key must name the layout")


def _policy_reply(policy: RetentionPolicy) -> PolicyReply:
    return PolicyReply(keep_last=policy.keep_last, min_replicas=policy.min_replicas,
                       pinned=sorted(policy.pinned))


def _check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in 0..num_shards-1, got shard={shard} "
                         f"num_shards={num_shards}")


def _check_chunks(chunks: list[int], num_chunks: int) -> list[int]:
    bad = [c for c in chunks if isinstance(c, bool) or not isinstance(c, int)
           or not 0 <= c < num_chunks]
    if bad:
        raise ValueError(f"chunk indices out of range 0..{num_chunks - 1}: {bad[:8]}")
    return list(chunks)


def _fmt_chunks(chunks: list[int]) -> str:
    return ", ".join(map(str, chunks[:16])) + (" ..." if len(chunks) > 16 else "")


__all__ = ["DEFAULT_LEASE_S", "MAX_CHUNKS", "MAX_KV_KEY", "MAX_KV_KEYS", "MAX_KV_VALUE",
           "HubState", "check_manifest_size", "derived_base", "parse_holding"]
