"""Derived versions (`HubState.begin_derive`): one deriver at a time, numbers from the base."""

from __future__ import annotations

import contextlib
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from hub_helpers import FakeClock, OffsetClock, small_manifest

import weightfabric as wf
from weightfabric.fabric.errors import (
    BadRequestError,
    GroupAbortedError,
    HubError,
    InvalidStateError,
    ManifestMismatchError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    WaitTimeoutError,
)
from weightfabric.fabric.hub.records import COMMITTED, PUBLISHING, RETIRED, ModelRecord
from weightfabric.fabric.hub.state import HubState, derived_base
from weightfabric.fabric.hub_messages import DeriveReply, Holding, ManifestWire
from weightfabric.fabric.manifest import Manifest

LEASE = 10.0
BASE = "policy"
D = "policy@vllm-tp2-3fa2c1d0.r1"


def bare(manifest: Manifest) -> Manifest:
    """``manifest`` without checksums (what a deriver begins with)."""
    return Manifest(manifest.tensors, manifest.chunk_size, (), manifest.total_bytes)


LAYOUT = bare(small_manifest(4, tag="derived"))
SUMS = [7, 8, 9, 10]
FINAL = Manifest(LAYOUT.tensors, LAYOUT.chunk_size, tuple(SUMS), LAYOUT.total_bytes)


class Hub:
    """A `HubState` on a fake clock; workers register with their own id as session."""

    def __init__(self, *workers: str) -> None:
        self.clock = FakeClock()
        self.s = HubState(clock=self.clock, lease_s=LEASE)
        for w in ("t", *workers):
            self.s.register(w, session=w)

    def publish(self, model: str = BASE, *, commit: bool = True) -> int:
        """The trainer ``t`` publishes (and commits) a version of ``model``."""
        v = self.s.begin_publish(model, "t", small_manifest(), session="t").version
        if commit:
            self.s.commit(model, v, "t", session="t")
        return v

    def derive(self, worker: str, version: int = 1, model: str = D,
               manifest: Manifest = LAYOUT) -> DeriveReply:
        out = self.s.begin_derive(model, version, worker, manifest, session=worker)
        self.s._check_indexes()
        return out

    def commit(self, worker: str, version: int = 1, checksums: list[int] | None = SUMS,
               model: str = D) -> str:
        state = self.s.commit(model, version, worker, session=worker, checksums=checksums).state
        self.s._check_indexes()
        return state

    def version(self, number: int = 1, model: str = D) -> Any:
        return self.s.models[model].versions.get(number)

    def keep_alive(self, *workers: str, seconds: float = LEASE + 1) -> None:
        """Let ``seconds`` pass in heartbeat steps that only ``workers`` take."""
        for _ in range(int(seconds // (LEASE / 4)) + 1):
            self.clock.advance(LEASE / 4)
            for w in workers:
                self.s.heartbeat(w, session=w)
        self.s._check_indexes()


def test_the_first_caller_derives_others_wait_then_fetch() -> None:
    h = Hub("a", "b", "c")
    v = h.publish()
    assert h.derive("a", v) == DeriveReply(action="derive", by=None)
    assert h.derive("b", v) == DeriveReply(action="wait", by="a")
    assert h.derive("a", v) == DeriveReply(action="derive", by=None)      # idempotent
    rec = h.version(v)
    assert rec.state == PUBLISHING and rec.num_shards == 1
    assert list(rec.publishers) == [("a", 0)] and list(rec.replicas) == [("a", 0)]
    assert h.commit("a", v) == COMMITTED
    assert h.derive("b", v) == DeriveReply(action="fetch", by=None)
    assert h.s.latest(D) == v
    plan = h.s.begin_fetch(D, v, "c", session="c", fetch_id="f")
    assert [r.sources for r in plan.ranges] == [["a"]]
    assert plan.manifest is not None and list(plan.manifest.checksums) == SUMS
    h.s._check_indexes()


def test_a_version_being_derived_is_copied_from_its_deriver_as_it_fills() -> None:
    """Readers may begin fetching it before the commit: they wait on the deriver."""
    h = Hub("a", "b", "c")
    v = h.publish()
    h.derive("a", v)
    assert h.s.commit_state(D, v).state == PUBLISHING
    plan = h.s.begin_fetch(D, v, "b", session="b", fetch_id="fb")
    assert [(r.start, r.stop, r.sources, r.wait) for r in plan.ranges] == [(0, 4, [], ["a"])]
    assert plan.manifest is not None and not plan.manifest.checksums      # none yet
    h.s.report_progress("fb", "b", session="b", chunks=[0, 1])
    later = h.s.begin_fetch(D, v, "c", session="c", fetch_id="fc")   # b has chunks 0, 1
    assert [(r.start, r.stop, r.sources) for r in later.ranges] == [(0, 2, ["b"]), (2, 4, [])]
    assert all("a" in r.wait for r in later.ranges if not r.sources)
    with pytest.raises(InvalidStateError, match="once it is committed"):
        h.s.complete_fetch("fb", "b", session="b")
    h.commit("a", v)
    done = h.s.commit_state(D, v)
    assert (done.state, done.checksums) == (COMMITTED, SUMS)
    assert h.s.complete_fetch("fb", "b", session="b").complete
    h.s._check_indexes()


def test_a_parked_wait_commit_answers_the_retire_even_of_a_forgotten_version() -> None:
    from weightfabric.fabric.hub.ops import Park, op_wait_commit
    from weightfabric.fabric.hub_messages import WaitCommitRequest

    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    park = op_wait_commit(h.s, "b", WaitCommitRequest(model=D, version=v, timeout=5))
    assert isinstance(park, Park) and park.check() is None
    h.s.abort_publish(D, v, "a", session="a", reason="no memory")
    assert park.check().state == RETIRED
    del h.s.models[D].versions[v]                    # collected while the reader waited
    out = park.on_timeout()
    assert out.state == RETIRED and "no version" in out.reason
    with pytest.raises(UnknownVersionError):        # asked afresh: unknown at once
        op_wait_commit(h.s, "b", WaitCommitRequest(model=D, version=v, timeout=5))


def test_a_plain_version_is_not_fetchable_before_its_commit() -> None:
    h = Hub("b")
    v = h.publish(commit=False)
    with pytest.raises(UnknownVersionError, match="publishing, not fetchable"):
        h.s.begin_fetch(BASE, v, "b", session="b", fetch_id="fb")


def test_commit_state_of_an_aborted_derive_says_why() -> None:
    h = Hub("a")
    v = h.publish()
    h.derive("a", v)
    h.s.abort_publish(D, v, "a", session="a", reason="out of memory")
    out = h.s.commit_state(D, v)
    assert out.state == RETIRED and "out of memory" in out.reason and not out.checksums


def test_replicas_of_a_derived_version_retract_freely() -> None:
    """min_replicas 0 by default: it can be derived again, so no retract waits for it."""
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    h.commit("a", v)
    h.s.begin_fetch(D, v, "b", session="b", fetch_id="fb")
    h.s.complete_fetch("fb", "b", session="b")
    assert h.s.models[D].policy.min_replicas == 0 and h.s.models[BASE].policy.min_replicas == 1
    assert v in h.s.retained(D)
    assert h.s.retract(D, v, "a", session="a").state == "done"
    assert h.s.retract(D, v, "b", session="b").state == "done"      # the last one too
    assert h.derive("a", v).action == "derive"                       # derived again
    h.s.set_retention(D, keep_last=2, min_replicas=1)               # an operator's choice
    assert h.s.models[D].policy.min_replicas == 1


def test_derived_numbers_are_the_base_numbers() -> None:
    h = Hub("a")
    h.s.set_retention(BASE, keep_last=3)
    v1, v2, v3 = h.publish(), h.publish(), h.publish()
    assert h.derive("a", v3).action == "derive"
    assert h.derive("a", v1).action == "derive"        # any committed base number, any order
    assert set(h.s.models[D].versions) == {v1, v3}
    assert h.s.next_versions[D] == v3 + 1
    assert v1 in h.s.seen[D] and v3 in h.s.seen[D] and v2 not in h.s.seen[D]


def test_names_and_base_versions_are_checked() -> None:
    h = Hub("a")
    v = h.publish()
    pending = h.publish(commit=False)
    with pytest.raises(BadRequestError, match="base@layout"):
        h.derive("a", v, model="policy")
    for name in ("@layout", "policy@"):
        with pytest.raises(BadRequestError, match="base@layout"):
            h.derive("a", v, model=name)
    for number in (0, -1):
        with pytest.raises(BadRequestError, match=">= 1"):
            h.derive("a", number)
    with pytest.raises(UnknownModelError, match="'critic'"):
        h.derive("a", v, model="critic@L")
    with pytest.raises(UnknownVersionError, match=r"'policy' v9 is absent"):
        h.derive("a", 9)
    with pytest.raises(UnknownVersionError, match=rf"'policy' v{pending} is publishing"):
        h.derive("a", pending)
    assert D not in h.s.models or not h.s.models[D].versions       # nothing was created


def test_begin_publish_of_a_name_with_at_is_refused() -> None:
    h = Hub()
    h.publish()
    with pytest.raises(BadRequestError, match="names with @ are derived layouts; use "
                                              "begin_derive"):
        h.s.begin_publish(D, "t", small_manifest(), session="t")
    assert derived_base(D) == BASE and derived_base("a@b@c") == "a"
    assert derived_base("policy") is None


def test_another_layout_under_the_same_name_is_a_mismatch() -> None:
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    with pytest.raises(ManifestMismatchError, match="layout key"):
        h.derive("b", v, manifest=bare(small_manifest(8, tag="derived")))
    h.commit("a", v)
    assert h.derive("b", v, manifest=FINAL).action == "fetch"
    with pytest.raises(ManifestMismatchError):          # its checksums differ
        h.derive("b", v, manifest=Manifest(LAYOUT.tensors, LAYOUT.chunk_size, (1, 2, 3, 4),
                                           LAYOUT.total_bytes))


def test_an_aborted_derive_is_derived_again_by_the_next_caller() -> None:
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    assert h.derive("b", v).by == "a"
    h.s.abort_publish(D, v, "a", session="a", reason="conversion failed")
    assert h.version(v).state == RETIRED and ("a", 0) in h.version(v).replicas
    assert h.derive("b", v) == DeriveReply(action="derive", by=None)
    rec = h.version(v)
    assert rec.state == PUBLISHING and list(rec.replicas) == [("b", 0)]
    assert (D, v, 0) not in h.s._index.held.get("a", set())
    assert v not in h.s.models[D].retired_log
    with pytest.raises(Exception, match="did not begin"):   # the old deriver's commit is refused
        h.commit("a", v)
    assert h.commit("b", v) == COMMITTED
    assert h.derive("a", v).action == "fetch"


def test_a_dead_deriver_is_replaced_after_its_lease() -> None:
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    assert h.derive("b", v).by == "a"
    h.keep_alive("t", "b")                   # a stops heartbeating: its lease ends
    assert "a" not in h.s.workers
    assert h.version(v) is None and v in h.s.seen[D]          # retired and forgotten
    assert h.derive("b", v) == DeriveReply(action="derive", by=None)
    assert h.commit("b", v) == COMMITTED


def test_a_derive_its_deriver_does_not_claim_is_orphaned() -> None:
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)                          # a's client never heard the reply
    for _ in range(5):
        h.clock.advance(LEASE / 4)
        for w in ("t", "a", "b"):
            h.s.heartbeat(w, session=w, publishing=[])
    assert "a" in h.s.workers and h.version(v).state == RETIRED
    assert "orphaned" in h.version(v).retire_reason
    assert h.derive("b", v).action == "derive"


def test_a_committed_version_retired_by_retention_is_derived_again() -> None:
    h = Hub("a", "b", "c", "r")
    v1, v2 = h.publish(), h.publish()
    h.s.set_retention(D, keep_last=1)
    h.derive("a", v1)
    h.commit("a", v1)
    h.s.begin_fetch(D, v1, "c", session="c", fetch_id="c1")
    h.s.complete_fetch("c1", "c", session="c")
    h.s.begin_fetch(D, v1, "r", session="r", fetch_id="r1")     # still fetching when...
    h.derive("a", v2)
    h.commit("a", v2)                                            # ...v1 leaves retention
    assert h.version(v1).state == RETIRED and len(h.version(v1).replicas) == 3
    h.s.set_retention(D, keep_last=2)
    assert h.derive("b", v1) == DeriveReply(action="derive", by=None)
    rec = h.version(v1)
    assert rec.state == PUBLISHING and list(rec.replicas) == [("b", 0)]
    with pytest.raises(UnknownFetchError):                       # the old fetch is over
        h.s.plan("r1", "r", session="r")
    assert not any((D, v1, 0) in h.s._index.held.get(w, set()) for w in "acr")
    assert h.commit("b", v1) == COMMITTED and h.s.latest(D) == v2
    h.s._check_indexes()


def test_commit_with_checksums_gives_the_manifest_its_checksums() -> None:
    h = Hub("a")
    v = h.publish()
    h.derive("a", v)
    begun = h.version(v).manifests[0]
    assert begun.checksums == ()
    with pytest.raises(BadRequestError, match="3 checksums .* 4 chunks"):
        h.commit("a", v, checksums=SUMS[:3])
    with pytest.raises(BadRequestError, match="64-bit ints"):
        h.commit("a", v, checksums=[1, 2, 3, 1 << 64])
    assert h.version(v).state == PUBLISHING and h.version(v).manifests[0] is begun
    assert h.commit("a", v) == COMMITTED
    now = h.version(v).manifests[0]
    assert now.checksums == tuple(SUMS) and now.tensors == begun.tensors
    assert now.fingerprint != begun.fingerprint
    assert h.s.snapshot()["models"][D]["versions"][0]["fingerprints"] == [now.fingerprint]
    assert h.commit("a", v) == COMMITTED                           # a retried commit
    with pytest.raises(BadRequestError, match="begun with checksums"):
        h.commit("a", v, checksums=[1, 2, 3, 4])


def test_checksums_at_commit_only_for_a_derived_version_begun_without() -> None:
    h = Hub("a")
    v = h.publish(commit=False)
    with pytest.raises(BadRequestError, match="only for derived versions"):
        h.s.commit(BASE, v, "t", session="t", checksums=[1, 2, 3, 4])
    assert h.version(v, BASE).state == PUBLISHING
    assert h.s.commit(BASE, v, "t", session="t").state == COMMITTED
    h.derive("a", v, manifest=small_manifest(4, tag="derived"))   # with checksums
    with pytest.raises(BadRequestError, match="begun with checksums"):
        h.commit("a", v)
    assert h.commit("a", v, checksums=None) == COMMITTED
    assert h.version(v).manifests[0].checksums == tuple(range(100, 104))
    v2 = h.publish()
    h.derive("a", v2)
    assert h.commit("a", v2, checksums=None) == COMMITTED          # no checksums at all
    with pytest.raises(BadRequestError, match="committed without checksums"):
        h.commit("a", v2)


def test_commit_of_a_retired_derive_is_refused() -> None:
    h = Hub("a")
    v = h.publish()
    h.derive("a", v)
    h.s.abort_publish(D, v, "a", session="a")
    with pytest.raises(GroupAbortedError):
        h.commit("a", v)


def test_restore_revives_a_derived_number_retired_before() -> None:
    h = Hub("a", "b")
    v1, v2 = h.publish(), h.publish()
    h.derive("a", v1)
    h.commit("a", v1)
    h.s.set_retention(D, keep_last=1)
    h.derive("a", v2)
    h.commit("a", v2)                      # v1 leaves retention
    h.s.set_retention(D, keep_last=2)
    assert h.derive("b", v2).action == "fetch"        # nothing changes
    durable = h.s.durable()
    assert v1 not in durable.versions[D] and durable.seen[D] == [[v1, v2 + 1]]
    after = HubState(clock=h.clock, lease_s=LEASE, durable=durable)
    after.register("a", session="a")
    manifest = ManifestWire.of(FINAL)
    got = after.restore("a", session="a", holdings=[
        Holding(model=D, version=n, shard=0, manifest=manifest, state="committed",
                complete=True, publisher=True) for n in (v1, v2)])
    assert got.restored == 2 and got.rejected == []
    assert after.models[D].versions[v1].state == COMMITTED and after.latest(D) == v2
    assert v1 not in after.models[D].retired_log
    after._check_indexes()


def test_restore_of_a_derive_in_progress_keeps_its_deriver() -> None:
    h = Hub("a", "b")
    v = h.publish()
    h.derive("a", v)
    after = HubState(clock=h.clock, lease_s=LEASE, durable=h.s.durable())
    for w in ("a", "b"):
        after.register(w, session=w)
    assert after.begin_derive(D, v, "b", LAYOUT, session="b").action == "wait"   # by None
    holding = Holding(model=D, version=v, shard=0, manifest=ManifestWire.of(LAYOUT),
                      publisher=True)
    assert after.restore("a", session="a", holdings=[holding]).restored == 1
    assert after.begin_derive(D, v, "b", LAYOUT, session="b").by == "a"
    assert after.commit(D, v, "a", session="a", checksums=SUMS).state == COMMITTED
    two = Holding(model=D, version=v, shard=0, num_shards=2, manifest=ManifestWire.of(LAYOUT))
    assert "1 shard" in after.restore("b", session="b", holdings=[two]).rejected[0][3]
    after._check_indexes()


# ------------------------------------------------------------- over the wire
def test_derive_through_a_hub_server(hub: Any, workers: Any) -> None:
    t, a, b, c = (workers.connect(w, timeout=5) for w in ("t", "a", "b", "c"))
    v = t.begin_publish(BASE, small_manifest())
    assert t.commit(BASE, v) == "committed"
    assert a.begin_derive(D, v, LAYOUT) == DeriveReply(action="derive", by=None)
    assert c.begin_derive(D, v, LAYOUT) == DeriveReply(action="wait", by="a")
    assert a.heartbeat().lost == {}                     # heartbeats claim the derive
    early = c.begin_fetch(D, v)                         # follows the deriver as it fills
    assert [(r.sources, r.wait) for r in early.ranges] == [((), ("a",))]
    with pytest.raises(WaitTimeoutError, match="not committed within"):
        c.wait_commit(D, v, timeout=0.05)
    assert a.commit(D, v, checksums=SUMS) == "committed"
    assert c.wait_commit(D, v, timeout=5) == SUMS
    assert list(c._holdings[(D, v, 0)].manifest.checksums) == SUMS   # what a restore sends
    assert c.complete_fetch(early.fetch_id).complete
    assert list(a._holdings[(D, v, 0)].manifest.checksums) == SUMS   # a restore sends them
    assert b.begin_derive(D, v, LAYOUT).action == "fetch"
    plan = b.begin_fetch(D, v)
    assert plan.manifest.checksums == tuple(SUMS)
    assert [set(r.sources) for r in plan.ranges] == [{"a", "c"}]
    assert b.complete_fetch(plan.fetch_id).complete
    where = b.locate(D, v)
    assert set(where["shards"][0]["holders"]) == {"a", "b", "c"}
    assert b.latest(D) == v
    with pytest.raises(BadRequestError, match="use begin_derive"):
        t.begin_publish(D, small_manifest())
    with pytest.raises(BadRequestError, match="only for derived"):
        t.commit(BASE, t.begin_publish(BASE, small_manifest()), checksums=[1, 2, 3, 4])


def test_a_derive_answer_says_where_the_base_is_read(hub: Any, workers: Any) -> None:
    """``with_base``: the deriver needs no locate of its own, capabilities included."""
    t, a, b = (workers.connect(w, timeout=5) for w in ("t", "a", "b"))
    v = t.begin_publish(BASE, small_manifest())
    t.commit(BASE, v)
    reply = a.begin_derive(D, v, LAYOUT, with_base=True)
    assert reply.action == "derive" and reply.base is not None
    assert (reply.base.model, reply.base.version) == (BASE, v)
    assert [sh.holders for sh in reply.base.shards] == [["t"]]
    assert reply.base.workers["t"].cap                      # readable as locate's answer is
    again = a.begin_derive(D, v, LAYOUT, with_base=True)    # its deriver asking again
    assert again.action == "derive" and again.base is not None
    other = b.begin_derive(D, v, LAYOUT, with_base=True)
    assert (other.action, other.by, other.base) == ("wait", "a", None)


def test_wait_commit_of_a_retired_derive_raises_its_reason(hub: Any, workers: Any) -> None:
    t, a, b = (workers.connect(w, timeout=5) for w in ("t", "a", "b"))
    v = t.begin_publish(BASE, small_manifest())
    t.commit(BASE, v)
    a.begin_derive(D, v, LAYOUT)
    a.abort_publish(D, v, reason="conversion failed")
    with pytest.raises(UnknownVersionError, match="retired.*conversion failed"):
        b.wait_commit(D, v, timeout=5)


def test_a_derived_version_retired_before_a_hub_restart_is_restored(tmp_path: Path) -> None:
    clock = OffsetClock()
    url = "memory://derive-restart"
    server = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
    try:
        t = wf.connect(url, worker="t", heartbeat=False, timeout=5)
        a = wf.connect(url, worker="a", heartbeat=False, timeout=5)
        v1 = t.begin_publish(BASE, small_manifest())
        t.commit(BASE, v1)
        v2 = t.begin_publish(BASE, small_manifest())
        t.commit(BASE, v2)
        a.set_retention(D, keep_last=1)
        for v in (v1, v2):
            assert a.begin_derive(D, v, LAYOUT).action == "derive"
            a.commit(D, v, checksums=SUMS)
        assert {x["version"]: x["state"] for x in a.status()["models"][D]["versions"]} == {
            v1: "retired", v2: "committed"}
        a.set_retention(D, keep_last=2)
        server.stop()
        server = wf.serve(url, state_dir=tmp_path, lease_s=LEASE, clock=clock)
        a.heartbeat()                        # a new hub epoch: a re-registers what it holds
        states = {x["version"]: x["state"] for x in a.status()["models"][D]["versions"]}
        assert states == {v1: "committed", v2: "committed"}
        t.close()
        a.close()
    finally:
        server.stop()


@pytest.mark.parametrize("seed", range(20))
def test_random_derives_keep_indexes_and_one_deriver(seed: int) -> None:
    """Derive, commit, abort, fetch, retract, retention and deaths in random order."""
    rng = random.Random(seed)
    names = ["a", "b", "c", "d"]
    h = Hub(*names)
    h.s.set_retention(BASE, keep_last=10)
    bases = [h.publish() for _ in range(3)]
    fids = itertools.count()
    for _ in range(150):
        w, n = rng.choice(names), rng.choice(bases)
        if w not in h.s.workers:
            h.s.register(w, session=w)
        op = rng.randrange(8)
        with contextlib.suppress(HubError):
            if op == 0:
                h.s.begin_derive(D, n, w, LAYOUT, session=w)
            elif op == 1:
                h.s.commit(D, n, w, session=w, checksums=rng.choice([SUMS, None]))
            elif op == 2:
                h.s.abort_publish(D, n, w, session=w)
            elif op == 3:
                fid = f"f{next(fids)}"
                h.s.begin_fetch(D, n, w, session=w, fetch_id=fid)
                if rng.random() < 0.5:
                    h.s.complete_fetch(fid, w, session=w)
            elif op == 4:
                h.s.retract(D, n, w, session=w, delay=rng.random() < 0.5)
            elif op == 5:
                h.s.set_retention(D, keep_last=rng.randint(1, 3))
            elif op == 6:
                h.clock.advance(LEASE / 3)
                for alive in rng.sample(["t", *names], 4):
                    if alive in h.s.workers:
                        h.s.heartbeat(alive, session=alive)
            else:
                h.s.drop(D, w, session=w)
        h.s._check_indexes()
        for v in h.s.models.get(D, ModelRecord(D)).versions.values():
            if v.state == PUBLISHING:
                assert len(v.publishers) == 1 and next(iter(v.publishers))[0] in h.s.workers
        h.s.expire()
        h.s._check_indexes()
