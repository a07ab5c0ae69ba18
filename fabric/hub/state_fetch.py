"""`HubFetching`: how a `HubState` runs fetches and plans them.

A reader begins a fetch of one shard (`begin_fetch`: it becomes a partial replica), asks
for plans (`plan`: sources for each chunk range it lacks, ranked, or routed along a
version's broadcast plan, `fabric.hub.planned`), reports the chunks it holds
(`report_progress`) and completes (`complete_fetch`) or releases (`release`) the fetch.
Model-parallel readers fetch in a group whose replicas become complete together, or none
do (`_commit_group`, `group_status`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

from weightfabric.fabric.errors import (
    GroupAbortedError,
    InvalidStateError,
    ManifestMismatchError,
    NoSourceError,
    UnknownFetchError,
    UnknownVersionError,
)
from weightfabric.fabric.hub.index import ReplicaPool
from weightfabric.fabric.hub.node_plans import NodeKey, NodePlans
from weightfabric.fabric.hub.planned import PlanRouter, VersionPlan
from weightfabric.fabric.hub.records import (
    COMMITTED,
    GROUP_COMMITTED,
    GROUP_OPEN,
    LIVE,
    PUBLISHING,
    FetchGroup,
    FetchRecord,
    Replica,
    VersionRecord,
    WorkerRecord,
)
from weightfabric.fabric.hub.routing import missing_runs, route, runs
from weightfabric.fabric.hub.state_base import HubStateBase, _check_shard, log
from weightfabric.fabric.hub.status import fetch_traffic
from weightfabric.fabric.hub_messages import (
    CompleteReply,
    EmptyReply,
    GroupStatusReply,
    ManifestWire,
    PlanReply,
    PlanSource,
    ProgressReply,
)
from weightfabric.fabric.manifest import Manifest

MAX_FINISHED_GROUPS = 4096
REPORT_BUDGET = 2000
"""Progress reports a shard's fetches in flight are asked for in all (`HubState`'s
``report_budget``). A report costs the hub about 0.1-0.2 ms, so a shard's reports cost
it about half a CPU-second at most however many read it: up to 1,000 readers at once each
send the 2 an engine sends by default (`FetchOptions.max_reports`); of 10,000 at once the
first 1,000 to begin send 2, the next 1,000 one and the rest none, 3,000 in all
(docs/hub.md, "Progress and pipelining")."""


class HubFetching(HubStateBase):
    """The fetching part of `HubState`: begin, plan, report, complete or release a fetch."""

    recent_fetches: deque[dict[str, Any]]
    _node_plans: NodePlans
    _together = False

    @contextlib.contextmanager
    def answering_batch(self) -> Iterator[None]:
        """Answer a relay's batch: the requests inside come from one node, at one time.

        The lease clock is read once, here, not at each request; the fresh fetches begun
        inside, as those of the node's batches before, are planned together: a node's
        first reader of a shard is routed, its others wait on it
        (`fabric.hub.node_plans`). The hub's server answers each batch in one.
        """
        self.expire()
        self._together = self._lease_read = True
        try:
            yield
        finally:
            self._together = self._lease_read = False

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
            return self._plan(f)    # the caller is checked (and its lease renewed) above
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
        return self._plan(f, chunks=chunks, exclude=exclude, with_manifest=with_manifest)

    def _plan(self, f: FetchRecord, *, chunks: list[int] | None = None,
              exclude: list[str] | None = None, with_manifest: bool = True) -> PlanReply:
        """`plan` for fetch ``f``, its caller checked."""
        worker = f.worker
        v = self._version(f.model, f.version)
        manifest = v.manifests[f.shard]
        rep = v.replicas[(worker, f.shard)]
        need = (runs(_check_chunks(chunks, manifest.num_chunks)) if chunks is not None
                else missing_runs(rep.have))
        banned = set(exclude or ())
        planned = self._version_plan(f)
        pool = self._index.pools.get((f.model, f.version, f.shard))
        node = self._node_key(f, v, rep, planned, chunks, banned)
        first = self._node_plans.first(node, v, self.workers) if node is not None else None
        if first is not None:
            ranges, named = first.ranges, first.named
            missing: list[int] = []
        elif planned is not None:
            router, vp = planned
            ranges, named, missing = router.route(
                vp, v, f.shard, worker, need, banned=banned, workers=self.workers,
                load=self._index.load, rank_sources=self.rank_sources,
                max_sources=self.max_sources, now=self.clock(), pool=pool)
        else:
            ranges, named, missing = route(v, f.shard, worker, need, banned=banned,
                                           workers=self.workers, load=self._index.load,
                                           rank_sources=self.rank_sources,
                                           max_sources=self.max_sources,
                                           wait_only=_being_derived(v), pool=pool)
        if missing:
            raise NoSourceError(
                f"{f.model!r} v{f.version} shard {f.shard}: no live replica holds chunks "
                f"{_fmt_chunks(missing)}; wait for a holder to (re)register or fetch another version")
        if node is not None and first is None:
            self._node_plans.planned(node, worker, ranges)
        # Reads from an earlier plan may still be in flight: sources accumulate until the
        # reader narrows them (report_progress(sources=)), excludes them, or finishes.
        self._index.set_sources(f, (f.sources - banned) | named)
        if self._index.pending_retracts:          # an excluded retracting source may be done
            self._settle()
        return PlanReply(
            fetch_id=f.fetch_id, model=f.model, version=f.version, shard=f.shard,
            num_shards=v.num_shards, fingerprint=manifest.fingerprint, ranges=ranges,
            workers={w: _source(self.workers[w], v.replicas[(w, f.shard)])
                     for w in sorted(named)},
            manifest=_manifest_wire(manifest) if with_manifest else None,
            planned=planned is not None, max_reports=self._reports_wanted(v, f.shard, pool))

    def _node_key(self, f: FetchRecord, v: VersionRecord, rep: Replica,
                  planned: tuple[PlanRouter, VersionPlan] | None,
                  chunks: list[int] | None, banned: set[str]) -> NodeKey | None:
        """Fetch ``f``'s key in the node plans, when it may be planned with its node's.

        Fresh fetches in a relay's batch only: no chunks held, asked or excluded, no
        broadcast plan, not a derived version being made, a reader that named its node.
        """
        if (not self._together or planned is not None or chunks is not None or banned
                or rep.count or _being_derived(v)):
            return None
        where = self.workers[f.worker].location
        if not where.node:
            return None
        return f.model, f.version, f.shard, where.datacenter, where.node

    def _reports_wanted(self, v: VersionRecord, shard: int, pool: ReplicaPool | None
                        ) -> int | None:
        """The progress reports (before its last) a fetch of ``shard`` planned now may send.

        `report_budget` over the shard's fetches in flight (its partial replicas), this one
        included; None without a budget.
        """
        if self.report_budget is None:
            return None
        fetching = len(pool) - len(v.complete_live.get(shard, ())) if pool is not None else 1
        return self.report_budget // max(1, fetching)

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
        _add_runs(rep, _check_chunks(chunks, len(rep.have)))
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

    def _trim_groups(self) -> None:
        finished = [k for k, g in self.groups.items() if g.state != GROUP_OPEN]
        for k in finished[:max(0, len(finished) - MAX_FINISHED_GROUPS)]:
            del self.groups[k]


def _source(rec: WorkerRecord, rep: Replica) -> PlanSource:
    """How a plan names worker ``rec`` holding ``rep``."""
    return PlanSource(location=rec.location.to_wire(), endpoints=rec.endpoints,
                      complete=rep.complete)


def _being_derived(v: VersionRecord) -> bool:
    """A derived version its deriver is still making: readers may copy it as it fills.

    Its plans name the deriver as a partial replica to wait on; its copies complete only
    once it is committed, after the readers checked the checksums it committed.
    """
    return v.state == PUBLISHING and "@" in v.model


def _add_runs(rep: Replica, chunks: list[int]) -> None:
    """``rep.add_chunks(chunks)``, a run of consecutive chunks at a time.

    A fetch engine's report is a few runs of hundreds of chunks: their bytes are set in C,
    not one by one.
    """
    if len(chunks) < 16:
        rep.add_chunks(chunks)
        return
    lo, hi = chunks[0], chunks[-1] + 1
    one = hi - lo == len(chunks) and chunks == list(range(lo, hi))
    for a, b in [(lo, hi)] if one else runs(chunks):
        rep.count += (b - a) - rep.have.count(1, a, b)
        rep.have[a:b] = b"\x01" * (b - a)


_WIRE_KEPT: dict[int, tuple[Manifest, ManifestWire]] = {}
"""The wire form of the manifests planned last, by id: every reader of a version is sent
the same one (a checksum per chunk), built once. Replies are serialised, never changed."""


def _manifest_wire(manifest: Manifest) -> ManifestWire:
    kept = _WIRE_KEPT.get(id(manifest))
    if kept is not None and kept[0] is manifest:
        return kept[1]
    wire = ManifestWire.of(manifest)
    if len(_WIRE_KEPT) >= 8:
        _WIRE_KEPT.pop(next(iter(_WIRE_KEPT)))
    _WIRE_KEPT[id(manifest)] = (manifest, wire)
    return wire


def _check_chunks(chunks: list[int], num_chunks: int) -> list[int]:
    if not chunks:
        return []
    # one pass in C for the usual case (plain ints in range), the slow one to say what is not
    if set(map(type, chunks)) == {int} and min(chunks) >= 0 and max(chunks) < num_chunks:
        return list(chunks)
    bad = [c for c in chunks if isinstance(c, bool) or not isinstance(c, int)
           or not 0 <= c < num_chunks]
    if bad:
        raise ValueError(f"chunk indices out of range 0..{num_chunks - 1}: {bad[:8]}")
    return list(chunks)


def _fmt_chunks(chunks: list[int]) -> str:
    return ", ".join(map(str, chunks[:16])) + (" ..." if len(chunks) > 16 else "")
