"""`HubWorkers`: a `HubState`'s workers and their liveness.

Workers register, renew their lease with heartbeats (and hear the news that concerns
them: lost sources, retired versions, quarantined replicas), unregister, drop a model, and
report a peer's corrupt replica. Every operation first expires leases (`expire`) against
the lease clock (`lease_clock`), which stops while the hub stalls (`forgive_stall`); an
expired worker's replicas, fetches and publishes go (`_drop_worker`, `_drop_holdings`).
"""

from __future__ import annotations

import logging
import time

from weightfabric.fabric.errors import BadRequestError, DuplicateWorkerError
from weightfabric.fabric.hub.records import RETIRED, WorkerRecord
from weightfabric.fabric.hub.state_base import HubStateBase, log
from weightfabric.fabric.hub_messages import (
    DropReply,
    EmptyReply,
    Endpoints,
    HeartbeatReply,
    RegisterReply,
    ReportCorruptReply,
)
from weightfabric.fabric.locality import Location


class HubWorkers(HubStateBase):
    """The workers part of `HubState`: register, heartbeats, leases, the lease clock."""

    quarantined: dict[str, set[tuple[str, int, int]]]
    stall_after: float | None
    _stalled: float
    _last_read: float
    _behind_since: float | None
    heartbeat_rate: float | None

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
        if rec is None:
            self._fit_lease(len(self.workers) + 1)
        self.workers[worker] = WorkerRecord(worker, session, location or Location(),
                                            dict(endpoints or {}),
                                            self.lease_clock() + self.lease_s)
        self._leases.renew(worker)
        if rec is None:
            log.info("worker registered worker=%s location=%s", worker, location)
        self._touch()
        return RegisterReply(lease_s=self.lease_s)

    def _fit_lease(self, workers: int) -> None:
        """Lengthen the lease so that ``workers`` heartbeating every lease/3 stay in budget.

        With ``heartbeat_rate`` R, the lease is at least 3 x workers / R (10,000 workers at
        the default 1,000/s: 30 s). It never shortens while the hub runs, so leases still
        end in the order they were renewed (`Leases`); clients take the lease from the
        replies to their registration and heartbeats.
        """
        if self.heartbeat_rate is None:
            return
        wanted = 3.0 * workers / self.heartbeat_rate
        if wanted > self.lease_s:
            if int(wanted) > int(self.lease_s):     # a line per second of lease added
                log.info("lease now %.1f s for %d workers (heartbeats at most %g/s)",
                         wanted, workers, self.heartbeat_rate)
            self.lease_s = self._leases.lease_s = wanted

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
        self._worker(worker, session)     # renews the lease
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

        Returns the dropped workers' ids. Reads the lease clock (``_lease_now`` is then the
        time it said).
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
        now = self.clock() - self._stalled
        if self._behind_since is not None:    # stopped while the hub is behind (`backlogged`)
            now = min(now, self._behind_since)
        self._lease_now = max(self._lease_now, now)
        return self._lease_now

    def backlogged(self, behind: bool) -> None:
        """Stop the lease clock while the hub is ``behind`` the requests waiting for it.

        The server says so after each pass over its socket (`HubServer._drain`): behind when
        the pass ended with requests still waiting. Heartbeats may be among them, so no
        lease ends and no publish claim lapses for time the hub spent catching up; the
        clock goes on from where it stopped once a pass finds nothing waiting. (A hub that
        never catches up keeps dead workers as long.)
        """
        lease_now = self.clock() - self._stalled
        if behind:
            if self._behind_since is None:
                self._behind_since = lease_now
            return
        if self._behind_since is None:
            return
        behind_s = lease_now - self._behind_since
        self._stalled += max(0.0, behind_s)
        self._behind_since = None
        if behind_s > self.lease_s / 3 and self.workers:
            log.warning("hub was behind its requests for %.1f s; leases and publish claims "
                        "stopped as long", behind_s)

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
