"""Property test: random operation sequences against `HubState`, invariants after each step."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hub_helpers import FakeClock, small_manifest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from weightfabric.fabric.errors import HubError, InvalidStateError, NoSourceError, RetentionError
from weightfabric.fabric.hub.records import COMMITTED, LIVE, PUBLISHING, RETIRED
from weightfabric.fabric.hub.state import HubState
from weightfabric.fabric.hub_messages import (
    Holding,
    ManifestWire,
    PublishStateReply,
    RetractReply,
)
from weightfabric.fabric.locality import Location

WORKERS = [f"w{i}" for i in range(5)]
MODELS = ["policy", "critic"]
LEASE = 10.0
LOCATIONS = [Location("dc1", "n1"), Location("dc1", "n2"), Location("dc2", "n3")]


class HubMachine(RuleBasedStateMachine):
    """Drives publish/fetch/progress/complete/release/retract/retention/crash/restart."""

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock()
        self.hub = HubState(clock=self.clock, lease_s=LEASE, max_sources=2)
        self.issued: dict[str, list[int]] = {m: [] for m in MODELS}
        self.fetch_ids = itertools.count()
        self.group_members: dict[tuple[str, str], list[tuple[str, int, str, int]]] = {}
        self.group_ids = itertools.count()
        self.before: dict | None = None
        self.orphans: dict[tuple[str, int], float] = {}   # begun, reply "lost": claim from
        self.retired_ever: set[tuple[str, int]] = set()
        self.seen: set[tuple[str, int]] = set()
        for i, w in enumerate(WORKERS):
            self.hub.register(w, session=w, location=LOCATIONS[i % len(LOCATIONS)])
        for m in MODELS:
            v = self.hub.begin_publish(m, "w0", small_manifest(3, tag=m), session="w0").version
            self.hub.commit(m, v, "w0", session="w0")
            self.issued[m].append(v)

    # ---------------------------------------------------------------- helpers
    def _heartbeat(self, w: str) -> None:
        """A client's heartbeat: it claims the versions it knows it publishes."""
        mine = [(m.name, n) for m in self.hub.models.values() for n, v in m.versions.items()
                if v.state == PUBLISHING and any(pw == w for pw, _ in v.publishers)
                and (m.name, n) not in self.orphans]
        self.hub.heartbeat(w, session=w, publishing=mine)

    def _note_retired(self) -> None:
        """Record retired versions.

        A version that vanished was retired (only retired, unheld versions are forgotten).
        """
        now = {(m.name, n) for m in self.hub.models.values() for n in m.versions}
        self.retired_ever |= self.seen - now
        self.retired_ever |= {(m.name, n) for m in self.hub.models.values()
                              for n, v in m.versions.items() if v.state == RETIRED}
        self.seen = now

    def _holdings(self, w: str, old: HubState) -> list[Holding]:
        """What worker ``w``'s client would restore.

        Every live replica it holds (retired versions included: a holder may not have
        heard), except versions it never knew.
        """
        out = []
        for m in old.models.values():
            for v in m.versions.values():
                if (m.name, v.number) in self.orphans:
                    continue
                for (hw, s), r in v.replicas.items():
                    if hw != w or r.status != LIVE:
                        continue
                    fid = next((f.fetch_id for f in old.fetches.values() if f.worker == w
                                and f.model == m.name and f.version == v.number
                                and f.shard == s and not f.done and f.group is None), None)
                    out.append(Holding(
                        model=m.name, version=v.number, shard=s, num_shards=v.num_shards,
                        manifest=ManifestWire.of(v.manifests[s]),
                        state=COMMITTED if r.complete else PUBLISHING, complete=r.complete,
                        chunks=[i for i, h in enumerate(r.have) if h], fetch_id=fid,
                        publisher=(w, s) in v.publishers))
        return out

    def _counts(self) -> dict[tuple[str, int, int], int]:
        out = {}
        for name, m in self.hub.models.items():
            retained = self.hub.retained(name)
            for n, v in m.versions.items():
                if n in retained:
                    for s in range(v.num_shards):
                        out[(name, n, s)] = len(v.complete_replicas(s))
        return out

    def _guarded(self) -> None:
        """Remember replica counts: the step must not break retention."""
        self.before = self._counts()

    def _check_plan(self, plan: dict, reader: str) -> None:
        v = self.hub.models[plan.model].versions[plan.version]
        for rng in plan.ranges:
            assert rng.sources, "a range without sources"
            for w in rng.sources:
                assert w != reader and w in self.hub.workers
                rep = v.replicas[(w, plan.shard)]
                assert rep.status == LIVE
                for c in range(rng.start, rng.stop):
                    assert rep.complete or rep.have[c], f"{w} named for chunk {c} it lacks"
            for w in rng.wait:
                assert w != reader and w in self.hub.workers

    # ------------------------------------------------------------------ rules
    @rule(w=st.sampled_from(WORKERS), loc=st.sampled_from(LOCATIONS))
    def register(self, w: str, loc: Location) -> None:
        self._guarded()
        with contextlib.suppress(HubError):
            self.hub.register(w, session=w, location=loc)

    @rule()
    def heartbeat_all(self) -> None:
        self._guarded()
        for w in list(self.hub.workers):
            self._heartbeat(w)

    @rule(dt=st.floats(0, 1.5 * LEASE), victim=st.one_of(st.none(), st.sampled_from(WORKERS)),
          comes_back=st.booleans())
    def advance_clock(self, dt: float, victim: str | None, comes_back: bool) -> None:
        """Every worker but ``victim`` heartbeats, then time passes: the victim may expire.

        If it does and ``comes_back`` (a long pause, not a crash), it re-registers and
        restores what it held, as its client would.
        """
        self.before = None
        for w in sorted(set(self.hub.workers) - {victim}):
            self._heartbeat(w)
        held = self._holdings(victim, self.hub) if victim in self.hub.workers else []
        loc = self.hub.workers[victim].location if victim in self.hub.workers else None
        self.clock.advance(dt)
        dead = self.hub.expire()
        self._note_retired()
        if victim in dead and comes_back:
            self.hub.register(victim, session=victim, location=loc)
            self.hub.restore(victim, session=victim, holdings=held)

    @rule(dt=st.floats(0, 3 * LEASE))
    def hub_stalls(self, dt: float) -> None:
        """The hub reads no request for ``dt`` (its server forgives that much).

        Nobody is dropped, and orphans wait that much longer (their time is the lease
        clock).
        """
        self.clock.advance(dt)
        self.hub.forgive_stall(dt)
        assert self.hub.expire() == []

    @rule(dt=st.floats(0, 3 * LEASE))
    def hub_behind(self, dt: float) -> None:
        """The hub is behind its requests for ``dt`` (its server says so, then catches up).

        Nobody is dropped meanwhile, and orphans wait that much longer.
        """
        self.hub.backlogged(True)
        self.clock.advance(dt)
        assert self.hub.expire() == []
        self.hub.backlogged(False)
        assert self.hub.expire() == []

    @rule(m=st.sampled_from(MODELS), w=st.sampled_from(WORKERS))
    def publish_reply_lost(self, m: str, w: str) -> None:
        """begin_publish runs but its reply never reaches the client.

        begin_publish runs but its reply never reaches the client (e.g. a request retried
        across a hub restart): the version must end retired, never stuck.
        """
        self._guarded()
        try:
            v = self.hub.begin_publish(m, w, small_manifest(2, tag=m), session=w).version
        except HubError:
            return
        self.issued[m].append(v)
        self.orphans[(m, v)] = self.hub.lease_clock()

    @rule(w=st.sampled_from(WORKERS))
    def crash(self, w: str) -> None:
        """The worker dies and comes back at once, holding nothing."""
        self.before = None
        if w in self.hub.workers:
            loc = self.hub.workers[w].location
            self.hub.unregister(w, session=w)
            self.hub.register(w, session=w, location=loc)

    @rule(m=st.sampled_from(MODELS), w=st.sampled_from(WORKERS),
          commit=st.sampled_from([True, True, False]), chunks=st.integers(1, 4))
    def publish(self, m: str, w: str, commit: bool, chunks: int) -> None:
        self._guarded()
        try:
            v = self.hub.begin_publish(m, w, small_manifest(chunks, tag=m), session=w).version
        except HubError:
            return
        assert all(v > old for old in self.issued[m]), "version reused or not monotonic"
        self.issued[m].append(v)
        if commit:
            assert self.hub.commit(m, v, w, session=w).state == COMMITTED

    @rule(m=st.sampled_from(MODELS), ws=st.lists(st.sampled_from(WORKERS), min_size=2,
                                                   max_size=2, unique=True),
          commits=st.integers(0, 2))
    def group_publish(self, m: str, ws: list[str], commits: int) -> None:
        self._guarded()
        key = f"g{next(self.group_ids)}"
        versions = []
        try:
            for shard, w in enumerate(ws):
                versions.append(self.hub.begin_publish(m, w, small_manifest(2, tag=f"{m}{shard}"),
                                                       session=w, shard=shard, num_shards=2,
                                                       group=key).version)
        except HubError:
            return
        assert len(set(versions)) == 1
        assert all(versions[0] > old for old in self.issued[m])
        self.issued[m].append(versions[0])
        for i, w in enumerate(ws[:commits]):
            state = self.hub.commit(m, versions[0], w, session=w).state
            assert state == (COMMITTED if i == 1 else "publishing")

    @rule(data=st.data(), m=st.sampled_from(MODELS), w=st.sampled_from(WORKERS),
          shard=st.sampled_from([0, 0, 0, 1]))
    def begin_fetch(self, data, m: str, w: str, shard: int) -> None:
        self._guarded()
        version = data.draw(st.sampled_from(["latest"] * 4 + [99, *self.issued[m][-3:]]))
        try:
            plan = self.hub.begin_fetch(m, version, w, session=w,
                                        fetch_id=f"f{next(self.fetch_ids)}", shard=shard)
        except (HubError, ValueError):
            return
        self._check_plan(plan, w)

    @rule(m=st.sampled_from(MODELS), ws=st.lists(st.sampled_from(WORKERS), min_size=2,
                                                   max_size=2, unique=True))
    def group_fetch(self, m: str, ws: list[str]) -> None:
        self._guarded()
        key = f"fg{next(self.group_ids)}"
        for shard, w in enumerate(ws):
            try:
                plan = self.hub.begin_fetch(m, "latest", w, session=w, shard=shard, group=key,
                                            group_size=2, fetch_id=f"f{next(self.fetch_ids)}")
            except (HubError, ValueError):
                continue
            self._check_plan(plan, w)
            self.group_members.setdefault((m, key), []).append(
                (m, plan.version, w, shard))

    @rule(data=st.data())
    def progress(self, data) -> None:
        self._guarded()
        live = [f for f in self.hub.fetches.values() if not f.done]
        if not live:
            return
        f = data.draw(st.sampled_from(sorted(live, key=lambda f: f.fetch_id)))
        n = len(self.hub.models[f.model].versions[f.version].manifests[f.shard].checksums)
        chunks = data.draw(st.lists(st.integers(0, n - 1), max_size=n))
        self.hub.report_progress(f.fetch_id, f.worker, session=f.worker, chunks=chunks)
        if data.draw(st.booleans()):
            try:
                plan = self.hub.plan(f.fetch_id, f.worker, session=f.worker)
            except NoSourceError:
                return
            self._check_plan(plan, f.worker)

    @rule(data=st.data(), action=st.sampled_from(["complete", "release"]))
    def finish_fetch(self, data, action: str) -> None:
        self._guarded()
        live = [f for f in self.hub.fetches.values() if not f.done]
        if not live:
            return
        f = data.draw(st.sampled_from(sorted(live, key=lambda f: f.fetch_id)))
        if action == "release":
            self.hub.release(f.fetch_id, f.worker, session=f.worker)
            return
        out = self.hub.complete_fetch(f.fetch_id, f.worker, session=f.worker)
        if out.group == "committed":
            for m, v, w, s in self.group_members.get((f.model, f.group), []):
                assert self.hub.models[m].versions[v].replicas[(w, s)].complete

    @rule(data=st.data(), delay=st.booleans())
    def retract(self, data, delay: bool) -> None:
        self._guarded()
        held = sorted((m.name, n, w) for m in self.hub.models.values()
                      for n, v in m.versions.items() for (w, _s) in v.replicas)
        if not held:
            return
        m, n, w = data.draw(st.sampled_from(held))
        try:
            self.hub.retract(m, n, w, session=w, delay=delay)
        except RetentionError:
            assert not delay
            return
        self.hub.retract_status(m, n, w)

    @rule(m=st.sampled_from(MODELS), keep=st.integers(1, 3), mins=st.integers(0, 2))
    def set_retention(self, m: str, keep: int, mins: int) -> None:
        self._guarded()
        self.hub.set_retention(m, keep_last=keep, min_replicas=mins)

    @rule(data=st.data(), m=st.sampled_from(MODELS), pinned=st.booleans())
    def pin(self, data, m: str, pinned: bool) -> None:
        self._guarded()
        version = data.draw(st.sampled_from([99, *self.issued[m]]))
        with contextlib.suppress(HubError):
            self.hub.pin(m, version, pinned)

    @rule()
    def restart_hub(self) -> None:
        """New hub from its state dir (`HubState.durable`); live workers restore holdings."""
        self.before = None
        old = self.hub
        holdings = {w: self._holdings(w, old) for w in old.workers}
        self.hub = HubState(clock=self.clock, lease_s=LEASE, max_sources=2,
                            durable=old.durable())
        for key in self.orphans:         # their publish claim restarts with the hub
            self.orphans[key] = self.hub.lease_clock()
        for w, rec in old.workers.items():
            self.hub.register(w, session=w, location=rec.location)
            self.hub.restore(w, session=w, holdings=holdings[w])
        self.group_members.clear()

    # ------------------------------------------------------------- invariants
    @invariant()
    def orphans_are_retired_within_a_lease(self) -> None:
        for (m, n), since in self.orphans.items():
            v = self.hub.models[m].versions.get(n)
            assert v is None or v.state != COMMITTED, "nobody committed it"
            if v is not None and v.state == PUBLISHING:
                assert self.hub.lease_clock() < since + LEASE, f"{m} v{n} stuck in publishing"

    @invariant()
    def retired_versions_stay_retired(self) -> None:
        """Across lease loss and re-registration, and across hub restarts."""
        for m, n in self.retired_ever:
            v = self.hub.models[m].versions.get(n)
            assert v is None or v.state == RETIRED, f"{m} v{n} came back as {v.state}"
        self._note_retired()

    @invariant()
    def indexes_match_a_full_scan(self) -> None:
        """The incremental indexes (by worker, by replica, by model) never drift."""
        self.hub._check_indexes()

    @invariant()
    def latest_is_committed_with_live_complete_replica(self) -> None:
        for m in MODELS:
            n = self.hub.latest(m)
            if n is None:
                continue
            v = self.hub.models[m].versions[n]
            assert v.state == COMMITTED
            for s in range(v.num_shards):
                assert any(r.complete and r.status == LIVE and r.worker in self.hub.workers
                           and self.hub.workers[r.worker].expires > self.hub.lease_clock()
                           for r in v.replicas.values() if r.shard == s)

    @invariant()
    def counters_never_reuse_versions(self) -> None:
        for m, issued in self.issued.items():
            if issued:
                assert self.hub.next_versions.get(m, 1) > max(issued)

    @invariant()
    def replicas_belong_to_live_workers(self) -> None:
        for m in self.hub.models.values():
            for v in m.versions.values():
                for (w, _s) in v.replicas:
                    assert w in self.hub.workers

    @invariant()
    def retract_keeps_min_replicas(self) -> None:
        if self.before is None:
            return
        after = self._counts()
        for key, n_before in self.before.items():
            if key in after:
                need = min(n_before, self.hub.models[key[0]].policy.min_replicas)
                assert after[key] >= need, f"{key}: {n_before} -> {after[key]} replicas"

    @invariant()
    def fetches_keep_their_replicas(self) -> None:
        for f in self.hub.fetches.values():
            v = self.hub.models[f.model].versions.get(f.version)
            assert v is not None and (f.worker, f.shard) in v.replicas, f"{f} lost its replica"

    @invariant()
    def open_groups_have_no_complete_member(self) -> None:
        for (m, key), g in self.hub.groups.items():
            if g.state != "open":
                continue
            for mm, v, w, s in self.group_members.get((m, key), []):
                rep = self.hub.models[mm].versions.get(v)
                rep = rep.replicas.get((w, s)) if rep else None
                assert rep is None or not rep.complete, "group member complete before commit"


HubMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestHubStateMachine = HubMachine.TestCase


def test_a_delayed_retract_ends_the_workers_own_fetch_of_the_version():
    """w1 holds the only copy of shard 0 (so its retract is delayed) and is fetching shard 1.

    The retract ends that fetch, which used to outlive its replica (KeyError in plan and
    complete_fetch once the partial replica was dropped).
    """
    hub = HubState(clock=FakeClock(), lease_s=LEASE)
    for w in ("w0", "w1"):
        hub.register(w, session=w)
    for shard, w in enumerate(("w1", "w0")):
        v = hub.begin_publish("m", w, small_manifest(2, tag=f"m{shard}"), session=w,
                              shard=shard, num_shards=2, group="g").version
    for w in ("w1", "w0"):
        hub.commit("m", v, w, session=w)
    for shard, w in enumerate(("w0", "w1")):
        hub.begin_fetch("m", v, w, session=w, shard=shard, group="fg", group_size=2,
                        fetch_id=f"f{shard}")
    assert hub.retract("m", v, "w1", session="w1", delay=True) == RetractReply(state="delayed")
    replicas = hub.models["m"].versions[v].replicas
    assert "f1" not in hub.fetches and ("w1", 1) not in replicas  # nobody read it: gone
    assert replicas[("w1", 0)].retract_delayed and replicas[("w1", 0)].status == LIVE
    with pytest.raises(HubError):       # its group was aborted with it, as a plain retract does
        hub.complete_fetch("f0", "w0", session="w0")


def test_an_aborted_publish_retires_its_version_at_once_and_only_for_its_publisher():
    hub = HubState(clock=FakeClock(), lease_s=LEASE)
    for w in ("w0", "w1"):
        hub.register(w, session=w)
    v = hub.begin_publish("m", "w0", small_manifest(2), session="w0").version
    with pytest.raises(InvalidStateError, match="did not begin publishing"):
        hub.abort_publish("m", v, "w1", session="w1")
    assert hub.abort_publish("m", v, "w0", session="w0", reason="bad name") == PublishStateReply(state=RETIRED)
    assert hub.latest("m") is None
    assert "bad name" in hub.models["m"].retired_log[v]
    assert hub.abort_publish("m", v, "w0", session="w0") == PublishStateReply(state=RETIRED)  # a retry
    done = hub.begin_publish("m", "w0", small_manifest(2), session="w0").version
    hub.commit("m", done, "w0", session="w0")
    with pytest.raises(InvalidStateError, match="retract it instead"):
        hub.abort_publish("m", done, "w0", session="w0")
