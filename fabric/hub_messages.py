"""The hub's messages: one typed request and one typed reply per operation.

Both sides import this module: the client (`fabric.client`) builds the requests and
decodes the replies, the hub (`fabric.hub`) decodes the requests, once, with
msgspec's typed decoding, and answers replies. It is worker-side code: it never
imports `fabric.hub`, so a rollout process does not load the control plane.

Every request is a frozen `msgspec.Struct` that refuses unknown fields and names
its operation in ``op`` (the envelope's ``name``, `fabric.protocol`); `REQUESTS`
lists them all, by operation. A request's fields are the operation's arguments,
with their defaults; fields at their default are left off the wire. Replies are
frozen structs too; a few are shared by operations that answer the same shape.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from weightfabric.fabric.manifest import Manifest

# A worker's data-plane endpoints: opaque to the hub, passed through to readers.
Endpoints = dict[str, Any]
# A `Location` on the wire: ``{"datacenter", "node", "device"}`` (missing keys are "").
LocationWire = dict[str, str]
HoldingState = Literal["publishing", "committed"]


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every struct in a reply: fields are read as attributes."""


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """Base of every request; ``op`` is the operation's name on the wire."""

    op: ClassVar[str]


# --------------------------------------------------------------------- shared parts
class ManifestWire(Wire, frozen=True, kw_only=True):
    """A `Manifest` on the wire (`Manifest.to_wire`).

    Tensors as ``[name, shape, dtype, nbytes, offset]``; ``sharding`` as
    ``[name, dim, global_shape, start]`` and ``aliases`` as ``[alias, published name]``
    (both empty for most models).
    """

    tensors: list[tuple[str, list[int], str, int, int]]
    chunk_size: int
    checksums: list[int] = msgspec.field(default_factory=list)
    total_bytes: int = -1
    sharding: list[tuple[str, int, list[int], int]] = msgspec.field(default_factory=list)
    aliases: list[tuple[str, str]] = msgspec.field(default_factory=list)

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestWire:
        """The wire form of ``manifest``."""
        return cls(tensors=[(t.name, list(t.shape), t.dtype, t.nbytes, t.offset)
                            for t in manifest.tensors],
                   chunk_size=manifest.chunk_size, checksums=list(manifest.checksums),
                   total_bytes=manifest.total_bytes,
                   sharding=[(s.name, s.dim, list(s.global_shape), s.start)
                             for s in manifest.sharding],
                   aliases=list(manifest.aliases))

    def manifest(self) -> Manifest:
        """The `Manifest` this describes.

        Raises:
            ValueError: an invalid layout (see `Manifest`).
        """
        return Manifest.from_wire({"tensors": self.tensors, "chunk_size": self.chunk_size,
                                   "checksums": self.checksums,
                                   "total_bytes": self.total_bytes,
                                   "sharding": self.sharding, "aliases": self.aliases})


class Holding(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """One replica a worker holds, re-registered by `RestoreRequest` after a hub restart."""

    model: str
    version: int
    shard: int
    num_shards: int = 1
    manifest: ManifestWire
    state: HoldingState = "publishing"
    complete: bool = False
    publisher: bool = False
    fetch_id: str | None = None
    chunks: list[int] = msgspec.field(default_factory=list)
    group: str | None = None     # its fetch group (groups do not survive a restart)


class PlanRangeWire(Wire, frozen=True, kw_only=True, omit_defaults=True):
    """Chunks ``start..stop-1``: read from ``sources`` (best first) or wait on ``wait``."""

    start: int
    stop: int
    sources: list[str]
    wait: list[str]
    window: int = 0
    """Bytes to keep in flight along this range: the bandwidth-delay product of its planned
    path (planned rate x round trip), for a broadcast plan over links with a latency; 0:
    one read at a time is enough."""


class PlanSource(Wire, frozen=True, kw_only=True):
    """A worker a plan names."""

    location: LocationWire
    endpoints: Endpoints
    complete: bool
    cap: bytes = b""
    """The reader's capability to read this version from this worker (`fabric.auth`)."""


class Holder(Wire, frozen=True, kw_only=True):
    """A worker `LocateReply` names."""

    location: LocationWire
    endpoints: Endpoints
    cap: bytes = b""
    """The reader's capability to read this version from this worker (`fabric.auth`)."""


class LocateShard(Wire, frozen=True, kw_only=True):
    """One shard of a located version: its manifest and its holders, best first."""

    manifest: ManifestWire
    holders: list[str]


# ------------------------------------------------------------------------ replies
class Reply(Wire, frozen=True, kw_only=True):
    """Base of every reply."""


class EmptyReply(Reply, frozen=True, kw_only=True):
    """Done; nothing to tell (``unregister``, ``release``)."""


class PingReply(Reply, frozen=True, kw_only=True):
    """``ping``'s answer."""

    pong: bool = True


class RegisterReply(Reply, frozen=True, kw_only=True):
    """The lease the worker must renew (heartbeat every ``lease_s / 3``)."""

    lease_s: float


class HeartbeatReply(Reply, frozen=True, kw_only=True):
    """News for the worker.

    ``lost`` sources per fetch (replan those chunks), and ``retired`` versions it holds that
    left retention (it may retract them).
    """

    lease_s: float
    lost: dict[str, list[str]]
    retired: list[tuple[str, int]]
    quarantined: list[tuple[str, int, int]] = []
    """``(model, version, shard)`` replicas of this worker a reader found corrupt: the hub
    no longer lists them; the worker stops serving them and fetches them again."""


class DropReply(Reply, frozen=True, kw_only=True):
    """The versions whose replica the hub dropped."""

    dropped: list[int]


class RestoreReply(Reply, frozen=True, kw_only=True):
    """How many holdings were restored, and ``[model, version, shard, why]`` of each one refused."""

    restored: int
    rejected: list[tuple[str, int, int, str]]


class BeginPublishReply(Reply, frozen=True, kw_only=True):
    """The version number the hub assigned."""

    version: int


class DeriveReply(Reply, frozen=True, kw_only=True):
    """What to do about a derived version (``begin_derive``).

    ``derive``: this worker derives it (then commits, or aborts); ``wait``: ``by`` derives
    it now (None: its deriver has a lease to come back after a hub restart), ask again
    later; ``fetch``: it is committed, fetch it like any version. ``base``: with
    ``derive``, where the base version can be read (``locate``'s answer), if asked for.
    """

    action: Literal["derive", "wait", "fetch"]
    by: str | None
    base: LocateReply | None = None


class PublishStateReply(Reply, frozen=True, kw_only=True):
    """A version's state after ``commit`` or ``abort_publish``.

    A version's state after ``commit`` (``publishing`` while other shards are missing) or
    ``abort_publish`` (``retired``).
    """

    state: str


class PlanReply(Reply, frozen=True, kw_only=True):
    """A fetch plan (``begin_fetch``, ``plan``): see `HubState.plan`."""

    fetch_id: str
    model: str
    version: int
    shard: int
    num_shards: int
    fingerprint: str
    ranges: list[PlanRangeWire]
    workers: dict[str, PlanSource]
    manifest: ManifestWire | None = None    # left off when the reader kept it
    planned: bool = False
    """The ranges follow the version's broadcast plan (`fabric.hub.planned`): each names
    the one upstream of a stripe tree's part, all of which carry bytes at once."""
    max_reports: int | None = None
    """Progress reports at chunk milestones the hub asks of this fetch at most, before its
    last (the reader's `FetchOptions.max_reports` caps it too); None: the reader's own."""


class LocateReply(Reply, frozen=True, kw_only=True):
    """Where every shard of a committed version can be read whole: see `HubState.locate`."""

    model: str
    version: int
    num_shards: int
    shards: list[LocateShard]
    workers: dict[str, Holder]


class ProgressReply(Reply, frozen=True, kw_only=True):
    """Chunks the reader holds of ``num_chunks``; ``lost``: sources that died since."""

    have: int
    num_chunks: int
    lost: list[str]


class CompleteReply(Reply, frozen=True, kw_only=True):
    """Whether the replica is complete; its fetch group's state (None: no group)."""

    complete: bool
    group: str | None


class GroupStatusReply(Reply, frozen=True, kw_only=True):
    """A fetch group: ``open``, ``committed`` or ``aborted`` (``reason``)."""

    state: str
    version: int
    size: int
    done: int
    reason: str


class RetractReply(Reply, frozen=True, kw_only=True):
    """A retract's state: ``done``, ``retracting``, ``delayed`` or ``live``."""

    state: str


class PolicyReply(Reply, frozen=True, kw_only=True):
    """A model's retention policy (``set_retention``, ``pin``)."""

    keep_last: int
    min_replicas: int
    pinned: list[int]


class CommitWaitReply(Reply, frozen=True, kw_only=True):
    """A version's state after ``wait_commit``, and one shard's checksums once committed.

    ``state``: ``publishing`` (the wait ran out), ``committed`` or ``retired`` (``reason``
    says why); ``checksums``: the shard's, one per chunk, when committed.
    """

    state: str
    checksums: list[int] = []
    reason: str = ""


class VersionReply(Reply, frozen=True, kw_only=True):
    """A version number, or None (``latest``; ``wait_version`` that ran out)."""

    version: int | None


class KvPutReply(Reply, frozen=True, kw_only=True):
    """The stored value's size in bytes."""

    size: int


class BatchReply(Reply, frozen=True, kw_only=True):
    """The hub's answers to a ``batch``'s requests, in order: ``(reply, its auth frame)``."""

    items: list[tuple[bytes, bytes]]


class KvGetReply(Reply, frozen=True, kw_only=True):
    """The value, or None (absent, or the wait ran out)."""

    value: bytes | None


# The hub's status snapshot (`fabric.hub.status`): plain data for people and tools.
StatusReply = dict[str, Any]


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """An error reply's body; the envelope's ``name`` is the error's code."""

    message: str = ""


# ----------------------------------------------------------------------- requests
class PingRequest(Request, frozen=True, kw_only=True):
    """Is the hub there (``ping``)?"""

    op: ClassVar[str] = "ping"


class StatusRequest(Request, frozen=True, kw_only=True):
    """The hub's status snapshot (``status``)."""

    op: ClassVar[str] = "status"


class RegisterRequest(Request, frozen=True, kw_only=True):
    """Register a worker and start its lease."""

    op: ClassVar[str] = "register"
    worker: str
    location: LocationWire | None = None
    endpoints: Endpoints | None = None


class HeartbeatRequest(Request, frozen=True, kw_only=True):
    """Renew the lease.

    ``publishing``: the ``(model, version)`` pairs the worker knows it publishes
    (None: claim all, as older clients did).
    """

    op: ClassVar[str] = "heartbeat"
    worker: str
    publishing: list[tuple[str, int]] | None = None


class UnregisterRequest(Request, frozen=True, kw_only=True):
    """Leave now."""

    op: ClassVar[str] = "unregister"
    worker: str


class DropRequest(Request, frozen=True, kw_only=True):
    """Let go of everything the worker holds of ``model``."""

    op: ClassVar[str] = "drop"
    worker: str
    model: str


class ReportCorruptRequest(Request, frozen=True, kw_only=True):
    """Chunks of ``holder``'s replica failed their checksum at the reporting reader."""

    op: ClassVar[str] = "report_corrupt"
    worker: str
    model: str
    version: int
    shard: int = 0
    holder: str
    chunks: list[int]


class ReportCorruptReply(Reply, frozen=True, kw_only=True):
    """Whether the holder's replica was quarantined (False: it was not listed any more)."""

    quarantined: bool


class RestoreRequest(Request, frozen=True, kw_only=True):
    """Re-register what the worker holds after a hub restart."""

    op: ClassVar[str] = "restore"
    worker: str
    holdings: list[Holding]


class BeginPublishRequest(Request, frozen=True, kw_only=True):
    """Start publishing one shard of a new version."""

    op: ClassVar[str] = "begin_publish"
    worker: str
    model: str
    manifest: ManifestWire
    shard: int = 0
    num_shards: int = 1
    group: str | None = None


class BeginDeriveRequest(Request, frozen=True, kw_only=True):
    """Derive version ``version`` of ``model`` (``base@layout``) from the base's, or learn who does.

    ``manifest``: the derived bytes' layout, normally without checksums (`CommitRequest`
    brings them). ``with_base``: a ``derive`` answer says where the base can be read.
    """

    op: ClassVar[str] = "begin_derive"
    worker: str
    model: str
    version: int
    manifest: ManifestWire
    with_base: bool = False


class CommitRequest(Request, frozen=True, kw_only=True):
    """Commit the worker's shards of a publishing version.

    ``checksums``: a derived version's, one per chunk, when its manifest had none.
    """

    op: ClassVar[str] = "commit"
    worker: str
    model: str
    version: int
    checksums: list[int] | None = None


class AbortPublishRequest(Request, frozen=True, kw_only=True):
    """Abandon the worker's publish of a version still publishing."""

    op: ClassVar[str] = "abort_publish"
    worker: str
    model: str
    version: int
    reason: str = ""


class BeginFetchRequest(Request, frozen=True, kw_only=True):
    """Start (or resume, same ``fetch_id``) a fetch of one shard."""

    op: ClassVar[str] = "begin_fetch"
    worker: str
    model: str
    fetch_id: str
    version: int | str = "latest"
    shard: int = 0
    fingerprint: str | None = None
    group: str | None = None
    group_size: int = 1
    have: list[int] | None = None


class LocateRequest(Request, frozen=True, kw_only=True):
    """Where a committed version can be read whole (holders ranked for ``worker``)."""

    op: ClassVar[str] = "locate"
    model: str
    version: int | str = "latest"
    worker: str | None = None
    manifests_only: bool = False
    """Shards with no live holder are answered too (holders empty), not refused."""


class PlanRequest(Request, frozen=True, kw_only=True):
    """Replan a fetch (``chunks``: those to plan; ``exclude``: workers to avoid)."""

    op: ClassVar[str] = "plan"
    worker: str
    fetch_id: str
    chunks: list[int] | None = None
    exclude: list[str] | None = None
    with_manifest: bool = True


class ReportProgressRequest(Request, frozen=True, kw_only=True):
    """Chunks the reader now holds, verified (``sources``: the only ones it still reads)."""

    op: ClassVar[str] = "report_progress"
    worker: str
    fetch_id: str
    chunks: list[int] = msgspec.field(default_factory=list)
    sources: list[str] | None = None


class CompleteFetchRequest(Request, frozen=True, kw_only=True):
    """The reader holds every chunk; in a group, wait ``timeout`` s for the others."""

    op: ClassVar[str] = "complete_fetch"
    worker: str
    fetch_id: str
    timeout: float = 0.0
    traffic: dict[str, list[int]] | None = None
    """Source worker -> [bytes delivered, bytes on the wire] of this fetch (shown by
    `fabric hub status`)."""


class GroupStatusRequest(Request, frozen=True, kw_only=True):
    """A fetch group's state."""

    op: ClassVar[str] = "group_status"
    model: str
    group: str


class ReleaseRequest(Request, frozen=True, kw_only=True):
    """Abandon a fetch."""

    op: ClassVar[str] = "release"
    worker: str
    fetch_id: str


class RetractRequest(Request, frozen=True, kw_only=True):
    """Stop serving the worker's replicas of a version; wait ``timeout`` s for ``done``."""

    op: ClassVar[str] = "retract"
    worker: str
    model: str
    version: int
    delay: bool = False
    timeout: float = 0.0


class RetractStatusRequest(Request, frozen=True, kw_only=True):
    """A retract's state."""

    op: ClassVar[str] = "retract_status"
    worker: str
    model: str
    version: int


class SetRetentionRequest(Request, frozen=True, kw_only=True):
    """Change a model's retention policy (None: keep that part)."""

    op: ClassVar[str] = "set_retention"
    model: str
    keep_last: int | None = None
    min_replicas: int | None = None


class PinRequest(Request, frozen=True, kw_only=True):
    """Pin (or unpin) a version."""

    op: ClassVar[str] = "pin"
    model: str
    version: int
    pinned: bool = True


class LatestRequest(Request, frozen=True, kw_only=True):
    """The newest servable version of ``model``."""

    op: ClassVar[str] = "latest"
    model: str


class WaitCommitRequest(Request, frozen=True, kw_only=True):
    """Wait up to ``timeout`` s for version ``version`` of ``model`` to leave ``publishing``."""

    op: ClassVar[str] = "wait_commit"
    model: str
    version: int
    shard: int = 0
    timeout: float = 0.0


class WaitVersionRequest(Request, frozen=True, kw_only=True):
    """A version newer than ``after``, waiting up to ``timeout`` s."""

    op: ClassVar[str] = "wait_version"
    model: str
    after: int = 0
    timeout: float = 0.0


class KvPutRequest(Request, frozen=True, kw_only=True):
    """Store a small value under ``key`` (``ttl``: seconds it lives; None: ever)."""

    op: ClassVar[str] = "kv_put"
    key: str
    value: bytes
    ttl: float | None = None


class KvGetRequest(Request, frozen=True, kw_only=True):
    """The value under ``key``, waiting up to ``timeout`` s for it."""

    op: ClassVar[str] = "kv_get"
    key: str
    timeout: float = 0.0


class BatchRequest(Request, frozen=True, kw_only=True):
    """Several workers' requests in one message, as a node relay forwards them.

    ``items``: each request's ``(payload, auth frame)`` exactly as its worker signed it, or
    with an empty auth frame when the batch's signer vouches for it (a relay holding the
    same credential); the hub answers each as if it came alone (`fabric.relay`; vouched
    ones run as the signer and are answered unsigned). Only operations of
    `BATCHABLE` that answer at once may ride in a batch. Not an operation of `OPERATIONS`:
    the hub's server opens the envelope, the state never sees it.
    """

    op: ClassVar[str] = "batch"
    items: list[tuple[bytes, bytes]]


class NodeReader(msgspec.Struct, frozen=True, array_like=True):
    """One reader of a `BeginFetchesRequest`: its worker, session and fetch id."""

    worker: str
    session: str
    fetch_id: str


class BeginFetchesRequest(Request, frozen=True, kw_only=True):
    """A node's readers beginning fetches of the same shard, as one request of a batch.

    A node relay (`fabric.node_begins`) joins the fresh ``begin_fetch`` requests of its
    workers it vouches for that ask for the same version and shard; the hub begins each
    reader's fetch as ``begin_fetch`` would, and answers a `BeginFetchesReply`. Rides only
    in a batch, vouched for by its signer; not an operation of `OPERATIONS`.
    """

    op: ClassVar[str] = "begin_fetches"
    model: str
    readers: list[NodeReader]
    version: int | str = "latest"
    shard: int = 0
    fingerprint: str | None = None


class BeginFetchesReply(Reply, frozen=True, kw_only=True):
    """A `BeginFetchesRequest`'s answers, one per reader, in order.

    ``plans[i]``: reader i's plan, its manifest left off (``manifest``, sent once, is
    every plan's: its msgpack, spliced into each as the hub would have); else
    ``errors[i]``: the ``(code, message)`` of the error it would have got alone; neither:
    the reader's request must go alone (e.g. a planned reader that waits for its
    upstreams).
    """

    manifest: msgspec.Raw
    plans: list[PlanReply | None]
    errors: list[tuple[str, str] | None]


NO_MANIFEST = msgspec.Raw(msgspec.msgpack.encode(None))
"""`BeginFetchesReply.manifest` when no reader got a plan."""


ReplyType = type[Reply] | type[StatusReply]
_PAIRS: tuple[tuple[type[Request], ReplyType], ...] = (
    (PingRequest, PingReply),
    (StatusRequest, dict),
    (RegisterRequest, RegisterReply),
    (HeartbeatRequest, HeartbeatReply),
    (UnregisterRequest, EmptyReply),
    (DropRequest, DropReply),
    (ReportCorruptRequest, ReportCorruptReply),
    (RestoreRequest, RestoreReply),
    (BeginPublishRequest, BeginPublishReply),
    (BeginDeriveRequest, DeriveReply),
    (CommitRequest, PublishStateReply),
    (AbortPublishRequest, PublishStateReply),
    (BeginFetchRequest, PlanReply),
    (LocateRequest, LocateReply),
    (PlanRequest, PlanReply),
    (ReportProgressRequest, ProgressReply),
    (CompleteFetchRequest, CompleteReply),
    (GroupStatusRequest, GroupStatusReply),
    (ReleaseRequest, EmptyReply),
    (RetractRequest, RetractReply),
    (RetractStatusRequest, RetractReply),
    (SetRetentionRequest, PolicyReply),
    (PinRequest, PolicyReply),
    (LatestRequest, VersionReply),
    (WaitVersionRequest, VersionReply),
    (WaitCommitRequest, CommitWaitReply),
    (KvPutRequest, KvPutReply),
    (KvGetRequest, KvGetReply),
)
# Every operation: its request and its reply type.
OPERATIONS: dict[str, tuple[type[Request], ReplyType]] = {req.op: (req, reply)
                                                          for req, reply in _PAIRS}
# Operations of a registered worker (named by ``worker``, from its session) that renew its
# lease at the hub as a heartbeat does: a worker busy with these needs no heartbeat to stay
# alive (`fabric.client.heartbeat_due`). The hub renews in its check of the caller
# (`HubStateBase._worker`), before the operation can fail.
RENEWS_LEASE = frozenset({
    "register", "heartbeat", "drop", "report_corrupt", "restore", "begin_publish", "commit",
    "abort_publish", "begin_derive", "begin_fetch", "plan", "report_progress",
    "complete_fetch", "release", "retract"})

# Operations a `BatchRequest` may carry: those a hub answers at once (a ``complete_fetch``
# only without a ``timeout``: a fetch group's members wait for each other).
BATCHABLE = frozenset({
    "ping", "register", "heartbeat", "unregister", "begin_fetch", "plan", "report_progress",
    "complete_fetch", "release", "locate", "latest", "drop"})

__all__ = [
    "BATCHABLE", "OPERATIONS", "RENEWS_LEASE", "AbortPublishRequest", "BatchReply",
    "BatchRequest", "BeginDeriveRequest", "BeginFetchRequest", "BeginFetchesReply",
    "BeginFetchesRequest",
    "BeginPublishReply", "BeginPublishRequest", "CommitRequest", "CompleteFetchRequest",
    "CommitWaitReply", "CompleteReply", "DeriveReply", "DropReply", "DropRequest", "EmptyReply",
    "Endpoints", "ErrorBody", "GroupStatusReply",
    "GroupStatusRequest", "HeartbeatReply", "HeartbeatRequest", "Holder", "Holding",
    "HoldingState", "KvGetReply", "KvGetRequest", "KvPutReply", "KvPutRequest",
    "LatestRequest", "LocateReply", "LocateRequest", "LocateShard", "LocationWire",
    "ManifestWire", "NO_MANIFEST", "NodeReader", "PinRequest", "PingReply", "PingRequest", "PlanRangeWire",
    "PlanReply",
    "PlanRequest", "PlanSource", "PolicyReply", "ProgressReply", "PublishStateReply",
    "RegisterReply", "RegisterRequest", "ReleaseRequest", "Reply", "ReportCorruptReply",
    "ReportCorruptRequest", "ReportProgressRequest",
    "Request", "RestoreReply", "RestoreRequest", "RetractReply", "RetractRequest",
    "RetractStatusRequest", "SetRetentionRequest", "StatusReply", "StatusRequest",
    "UnregisterRequest", "VersionReply", "WaitCommitRequest", "WaitVersionRequest", "Wire",
]
