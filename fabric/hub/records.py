"""The records the hub keeps: workers, versions, replicas, fetches, groups, policies.

Plain mutable dataclasses owned by `fabric.hub.state.HubState`; nothing here does
I/O or enforces rules (that is `HubState`'s job).

Version lifecycle::

    begin_publish ──> PUBLISHING ──(every shard committed)──> COMMITTED
    (begin_derive)        │                                      │
     (a publisher lost, its group aborted,             (out of retention)
      or no publisher claimed it for a lease)                    │
                          └──────────────> RETIRED <─────────────┘

A derived version (``base@layout``) that is retired may be derived again: a new
record replaces it (`HubState.begin_derive`).

Replica lifecycle: ``live`` (routable; a partial one only for the chunks it has)
──retract──> ``retracting`` (not routable; removed once no fetch in flight may
read from it). A retract that would break retention may be ``delayed``: the replica
stays live until another complete replica exists.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from weightfabric.fabric.locality import Location
from weightfabric.fabric.manifest import Manifest

PUBLISHING, COMMITTED, RETIRED = "publishing", "committed", "retired"
LIVE, RETRACTING = "live", "retracting"
GROUP_OPEN, GROUP_COMMITTED, GROUP_ABORTED = "open", "committed", "aborted"


@dataclass
class WorkerRecord:
    """A registered worker and its lease."""

    worker_id: str
    session: str
    location: Location
    endpoints: dict[str, Any]
    expires: float


@dataclass
class Replica:
    """One worker's copy of one shard of a version (``have[i]`` is 1 when chunk i is present)."""

    worker: str
    shard: int
    have: bytearray
    count: int = 0
    complete: bool = False
    status: str = LIVE
    retract_delayed: bool = False

    def add_chunks(self, chunks: list[int]) -> None:
        """Mark `chunks` as held."""
        for c in chunks:
            if not self.have[c]:
                self.have[c] = 1
                self.count += 1

    def fill(self) -> None:
        """Mark every chunk as held."""
        self.have[:] = b"\x01" * len(self.have)
        self.count = len(self.have)


@dataclass
class VersionRecord:
    """One version of a model: state, per-shard manifests, publishers and replicas."""

    model: str
    number: int
    num_shards: int
    state: str = PUBLISHING
    manifests: dict[int, Manifest] = field(default_factory=dict)
    recorded: dict[int, str] = field(default_factory=dict)
    """Per shard, the manifest fingerprint the hub's records kept (a state dir, etcd):
    until a manifest is known again, a holder restoring another one is refused."""
    publishers: dict[tuple[str, int], bool] = field(default_factory=dict)
    replicas: dict[tuple[str, int], Replica] = field(default_factory=dict)
    group: str | None = None
    retire_reason: str = ""
    claimed_until: float = 0.0
    """While publishing: a publisher must claim the version (begin_publish, commit, or a
    heartbeat listing it) before this time, else it is retired as orphaned."""
    complete_live: dict[int, set[str]] = field(default_factory=dict)
    """Index: per shard, the workers whose replica is complete and live (`reindex`)."""

    def fingerprints(self) -> dict[int, str]:
        """Per shard, the fingerprint of its manifest (or, before one is known, the recorded)."""
        return {**self.recorded, **{s: m.fingerprint for s, m in self.manifests.items()}}

    def reindex(self, rep: Replica) -> None:
        """Update `complete_live` after ``rep`` was added or changed.

        Update `complete_live` after ``rep`` was added or its ``complete``/``status``
        changed (the hub calls this after every such change).
        """
        workers = self.complete_live.setdefault(rep.shard, set())
        if (rep.complete and rep.status == LIVE
                and self.replicas.get((rep.worker, rep.shard)) is rep):
            workers.add(rep.worker)
        else:
            workers.discard(rep.worker)

    def complete_replicas(self, shard: int) -> list[Replica]:
        """Routable complete replicas of a shard (O(their number), via the index)."""
        return [self.replicas[(w, shard)] for w in sorted(self.complete_live.get(shard, ()))]

    def servable(self) -> bool:
        """Committed, and every shard has at least one routable complete replica."""
        return self.state == COMMITTED and all(
            self.complete_live.get(s) for s in range(self.num_shards))


@dataclass
class FetchRecord:
    """A reader's fetch in flight: also the lease that keeps its sources immutable."""

    fetch_id: str
    model: str
    version: int
    shard: int
    worker: str
    sources: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    group: str | None = None
    done: bool = False


@dataclass
class FetchGroup:
    """Model-parallel readers fetching one version together: all commit or none."""

    key: str
    model: str
    version: int
    size: int
    members: dict[str, bool] = field(default_factory=dict)
    state: str = GROUP_OPEN
    reason: str = ""


@dataclass
class RetentionPolicy:
    """Per-model retention.

    The last ``keep_last`` committed versions plus pinned ones are retained; a retract may
    not drop a retained version below ``min_replicas``.
    """

    keep_last: int = 2
    min_replicas: int = 1
    pinned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")

    def to_wire(self) -> dict[str, Any]:
        """The policy as wire data."""
        return {"keep_last": self.keep_last, "min_replicas": self.min_replicas,
                "pinned": sorted(self.pinned)}


class VersionRanges:
    """A set of version numbers kept as sorted, disjoint, half-open ranges ``[lo, hi)``.

    The hub's record of which numbers of a model it has seen: numbers are handed out
    in order, and a restart adds the (few, mostly adjacent) numbers holders restore,
    so a handful of ranges covers them.
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        self._ranges: list[list[int]] = []
        for lo, hi in sorted((int(lo), int(hi)) for lo, hi in ranges):
            if lo >= hi:
                continue
            if self._ranges and lo <= self._ranges[-1][1]:
                self._ranges[-1][1] = max(self._ranges[-1][1], hi)
            else:
                self._ranges.append([lo, hi])

    def _find(self, n: int) -> int:
        """Index of the range whose start is the largest <= n (-1 if none)."""
        return bisect_right(self._ranges, [n, float("inf")]) - 1

    def __contains__(self, n: int) -> bool:
        i = self._find(n)
        return i >= 0 and n < self._ranges[i][1]

    def add(self, n: int) -> None:
        """Add one number, merging with the ranges it touches."""
        if n in self:
            return
        i = self._find(n)
        if i >= 0 and self._ranges[i][1] == n:          # extends range i
            self._ranges[i][1] = n + 1
        else:
            i += 1
            self._ranges.insert(i, [n, n + 1])
        if i + 1 < len(self._ranges) and self._ranges[i + 1][0] == self._ranges[i][1]:
            self._ranges[i][1] = self._ranges.pop(i + 1)[1]

    def to_wire(self) -> list[list[int]]:
        """The ranges as ``[start, stop]`` lists."""
        return [list(r) for r in self._ranges]


@dataclass
class ModelRecord:
    """Everything the hub knows about one model name."""

    name: str
    policy: RetentionPolicy = field(default_factory=RetentionPolicy)
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    publish_groups: dict[str, int] = field(default_factory=dict)
    retired_log: dict[int, str] = field(default_factory=dict)
    """Recently retired version numbers and why (newest last, bounded), for status."""

    @classmethod
    def named(cls, name: str) -> ModelRecord:
        """A model the hub has not seen, with its default retention.

        A derived model (``base@layout``) keeps no minimum of replicas (``min_replicas``
        0): its versions can be derived again from the base, so a reader reusing a buffer
        never waits for another replica of the version it held.
        """
        return cls(name, RetentionPolicy(min_replicas=0) if "@" in name else RetentionPolicy())
