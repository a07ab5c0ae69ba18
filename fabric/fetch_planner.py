"""The fetch engine's planner, backed by the hub's plans.

Turns a `FetchPlan` (chunk ranges -> ranked worker names) into engine
`Assignment`s (chunks -> sources with read addresses), asks the hub to re-plan
the chunks still missing when sources fail, and reports verified chunks, a few times
per fetch (`FetchOptions.max_reports`), so that the hub knows what this partial
replica holds; readers chain through it between reports too (below).

Pipelining: a range's ``wait`` workers are partial replicas the hub ranks above
every source that already has the chunks (a peer that is fetching the same
version from nearer the origin). They come first: the read server of a partial
replica holds a read until the chunk arrives, so readers form chains instead of
all pulling from the origin, however seldom the upstream reports (the hub names it as a
``wait`` for every chunk it has not reported). Sources of the best locality tier are
striped; with partial replicas to wait for, only the nearest of those are.

Liveness: the hub tells a reader which sources of its fetch it dropped (a lease
that ran out, a holder that dropped the model), in progress reports and in the
worker's heartbeats; `lost` hands both to the engine, which abandons its reads
from them and re-plans their chunks at once.
"""

from __future__ import annotations

import logging

from weightfabric.fabric.client import FetchPlan, HubClient
from weightfabric.fabric.errors import HubError, NoSourceError
from weightfabric.fabric.fetch import Assignment, Source
from weightfabric.fabric.locality import Location, locality_tier
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.transports import SourceAddress

log = logging.getLogger(__name__)


class HubPlanner:
    """`FetchPlanner` for one hub fetch.

    Its reports are the engine's (`FetchOptions.max_reports`: a few per fetch, at chunk
    milestones, however long the fetch takes), but for the last: ``completes`` tells the
    engine that the store completes the fetch at the hub as soon as the engine returns,
    and ``complete_fetch`` records every chunk.
    """

    def __init__(self, hub: HubClient, plan: FetchPlan, *, me: Location) -> None:
        self.hub = hub
        self.current = plan
        self.me = me
        # The store completes the fetch at the hub as soon as the engine returns
        # (`fetch_chunks` leaves the chunks verified since its last report to
        # ``complete_fetch``), but for a copy of a version still being derived (no
        # checksums yet): that completes once the deriver committed, which can be long.
        self.completes = bool(plan.manifest.checksums)
        self._fresh = True
        self._lost: set[str] = set()  # sources the hub said it dropped, in progress reports
        self._reported: set[str] = set()  # sources this fetch reported corrupt (quarantined)

    def corrupt(self, worker: str, chunks: list[int]) -> None:
        """Report that ``worker`` sent ``chunks`` failing their checksum (it is quarantined).

        Best effort: the fetch re-reads them elsewhere whatever the hub answers.
        """
        plan = self.current
        self._reported.add(worker)
        try:
            self.hub.report_corrupt(plan.model, plan.version, worker, chunks, shard=plan.shard)
        except HubError as exc:
            log.warning("could not report %s's corrupt chunks of %s v%d to the hub: %s",
                        worker, plan.model, plan.version, exc)

    def plan(self, missing: list[int], failed: set[str]) -> list[Assignment]:
        """Sources for the `missing` chunks, never the workers in `failed`.

        None when the hub has no other holder (the engine then raises `FetchError` naming
        the failed sources, or the chunks that failed their checksum from the holders
        this fetch reported corrupt).

        Raises:
            NoSourceError: no live replica holds some chunks and none was excluded
                here (the hub's message says to wait for a holder).
            HubError: the hub refused the re-plan otherwise.
        """
        if not self._fresh or failed:
            try:
                self.current = self.hub.replan(self.current.fetch_id, chunks=missing,
                                               exclude=sorted(failed) or None)
            except NoSourceError:
                if not failed and not self._reported:
                    raise
                return []  # only holders this reader gave up on, or reported corrupt, are left
        self._fresh = False
        wanted = set(missing)
        out = []
        for r in self.current.ranges:
            chunks = tuple(c for c in range(r.start, r.stop) if c in wanted)
            waits = self._nearest([w for w in r.wait if w not in failed])
            names = [w for w in dict.fromkeys((*waits, *r.sources)) if w not in failed]
            sources = tuple(s for s in map(self._source, names) if s is not None)
            if chunks and sources:
                stripe = len(waits) if waits else self._best_tier(sources)
                out.append(Assignment(chunks, sources, max(1, stripe), window=r.window))
        return out

    @property
    def max_reports(self) -> int | None:
        """Milestone reports the hub asks of this fetch at most (None: the engine's own).

        The hub shares a budget of reports among a shard's fetches in flight
        (`fabric.hub.state_fetch.REPORT_BUDGET`): with thousands of readers at once, the
        later ones report only when they complete (or when held up, `IDLE_REPORT_S`).
        """
        return self.current.max_reports

    @property
    def planned(self) -> bool:
        """Whether the hub routes this fetch along the version's broadcast plan.

        Then each range names the one upstream of a stripe tree's part, and the engine
        keeps a read in flight for each.
        """
        return self.current.planned

    def report(self, chunks: list[int]) -> None:
        """Report verified `chunks` to the hub and note the sources it dropped."""
        out = self.hub.report_progress(self.current.fetch_id, chunks)
        self._lost.update(out.lost)

    def lost(self) -> set[str]:
        """Sources of this fetch the hub dropped.

        Sources of this fetch the hub dropped, as told in progress reports and in this
        worker's heartbeats (`HubClient.lost`).
        """
        return self._lost | self.hub.lost.get(self.current.fetch_id, set())

    def _source(self, worker: str) -> Source | None:
        plan = self.current
        info = plan.workers.get(worker)
        read = info.endpoints.get("read") if info else None
        if info is None or read is None:
            log.warning("plan names %s without a read endpoint; skipping it", worker)
            return None
        return Source(worker, SourceAddress.from_dict(read, cap=info.cap),
                      region_name(plan.model, plan.version, plan.shard))

    def _nearest(self, workers: list[str]) -> list[str]:
        """The workers of the best locality tier among `workers`.

        The workers of the best locality tier among `workers` (so a reader never stripes a
        remote partial replica beside a near one).
        """
        tiers = {w: locality_tier(self.me, self.current.workers[w].location)
                 for w in workers if w in self.current.workers}
        return [w for w in workers if tiers.get(w) == min(tiers.values())] if tiers else []

    def _best_tier(self, sources: tuple[Source, ...]) -> int:
        """How many sources share the best locality tier (they are striped over)."""
        tiers = [locality_tier(self.me, self.current.workers[s.worker].location)
                 for s in sources]
        return sum(1 for t in tiers if t == min(tiers))
