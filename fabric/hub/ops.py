"""The hub's operations as the wire names them: the registry and the handlers.

`OPS` maps each operation to its request type (`fabric.hub_messages`) and its
handler. The server decodes a request's body into that type (msgspec's typed
decoding: a missing, unknown or mistyped field is refused there, once) and calls
the handler with ``(state, session, request)``; what is left here are the checks
a type cannot say (finite waits, manifests, chunk ranges). A handler returns a
reply, or a `Park` when the answer must wait (long-polls): the server re-runs
``check`` whenever the state changes and answers ``on_timeout()`` at the deadline.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from weightfabric.fabric.errors import BadRequestError, UnknownModelError, UnknownVersionError
from weightfabric.fabric.hub.records import PUBLISHING, RETIRED
from weightfabric.fabric.hub.state import HubState, check_manifest_size
from weightfabric.fabric.hub_messages import (
    AbortPublishRequest,
    BeginDeriveRequest,
    BeginFetchRequest,
    BeginPublishRequest,
    CommitRequest,
    CommitWaitReply,
    CompleteFetchRequest,
    CompleteReply,
    DropRequest,
    GroupStatusRequest,
    HeartbeatRequest,
    KvGetReply,
    KvGetRequest,
    KvPutRequest,
    LatestRequest,
    LocateRequest,
    ManifestWire,
    PingReply,
    PingRequest,
    PinRequest,
    PlanRequest,
    RegisterRequest,
    ReleaseRequest,
    Reply,
    ReportCorruptRequest,
    ReportProgressRequest,
    Request,
    RestoreRequest,
    RetractReply,
    RetractRequest,
    RetractStatusRequest,
    SetRetentionRequest,
    StatusReply,
    StatusRequest,
    UnregisterRequest,
    VersionReply,
    WaitCommitRequest,
    WaitVersionRequest,
)
from weightfabric.fabric.locality import Location
from weightfabric.fabric.manifest import Manifest

MAX_WAIT_S = 300.0

R = TypeVar("R", bound=Request)
Answer = Reply | StatusReply


@dataclass
class Park:
    """A reply that waits: ``check()`` returns the reply once ready, else None.

    A version wait names its ``model`` and ``after``: it can be ready only once
    ``latest(model) > after``, so the server looks at it only then (`latest_of`), not at
    every state change.
    """

    check: Callable[[], Reply | None]
    timeout: float
    on_timeout: Callable[[], Reply]
    model: str | None = None
    after: int = 0


@dataclass(frozen=True)
class Op(Generic[R]):
    """One operation: the type its request body decodes to, and its handler."""

    request: type[R]
    handler: Callable[[HubState, str, R], Answer | Park]


def parse_manifest(wire: ManifestWire, what: str = "bad manifest") -> Manifest:
    """A wire manifest, checked (layout and `MAX_CHUNKS`).

    Raises:
        BadRequestError: an invalid layout, or too many chunks.
    """
    try:
        manifest = wire.manifest()
        check_manifest_size(manifest)
    except ValueError as exc:
        raise BadRequestError(f"{what}: {exc}") from exc
    return manifest


def _wait(timeout: float) -> float:
    """A long poll's wait in seconds, clamped to 0..`MAX_WAIT_S`.

    Raises:
        BadRequestError: NaN or infinite (it could never be answered).
    """
    if not math.isfinite(timeout):
        raise BadRequestError(f"argument 'timeout' must be a finite number of seconds, got "
                              f"{timeout}; pass at most {MAX_WAIT_S:g}")
    return min(max(timeout, 0.0), MAX_WAIT_S)


def op_register(s: HubState, session: str, a: RegisterRequest) -> Answer:
    return s.register(a.worker, session=session, location=Location.from_wire(a.location),
                      endpoints=a.endpoints)


def op_heartbeat(s: HubState, session: str, a: HeartbeatRequest) -> Answer:
    return s.heartbeat(a.worker, session=session, publishing=a.publishing)


def op_unregister(s: HubState, session: str, a: UnregisterRequest) -> Answer:
    return s.unregister(a.worker, session=session)


def op_drop(s: HubState, session: str, a: DropRequest) -> Answer:
    return s.drop(a.model, a.worker, session=session)


def op_report_corrupt(s: HubState, session: str, a: ReportCorruptRequest) -> Answer:
    return s.report_corrupt(a.model, a.version, a.shard, a.holder, a.worker, session=session,
                            chunks=a.chunks)


def op_restore(s: HubState, session: str, a: RestoreRequest) -> Answer:
    return s.restore(a.worker, session=session, holdings=a.holdings)


def op_begin_publish(s: HubState, session: str, a: BeginPublishRequest) -> Answer:
    return s.begin_publish(a.model, a.worker, parse_manifest(a.manifest), session=session,
                           shard=a.shard, num_shards=a.num_shards, group=a.group)


def op_commit(s: HubState, session: str, a: CommitRequest) -> Answer:
    return s.commit(a.model, a.version, a.worker, session=session, checksums=a.checksums)


def op_begin_derive(s: HubState, session: str, a: BeginDeriveRequest) -> Answer:
    return s.begin_derive(a.model, a.version, a.worker, parse_manifest(a.manifest),
                          session=session, with_base=a.with_base)


def op_abort_publish(s: HubState, session: str, a: AbortPublishRequest) -> Answer:
    return s.abort_publish(a.model, a.version, a.worker, session=session, reason=a.reason)


def op_begin_fetch(s: HubState, session: str, a: BeginFetchRequest) -> Answer | Park:
    reply = s.begin_fetch(a.model, a.version, a.worker, session=session, fetch_id=a.fetch_id,
                          shard=a.shard, fingerprint=a.fingerprint, group=a.group,
                          group_size=a.group_size, have=a.have)
    router, fetch_id, worker = s.plan_routing, reply.fetch_id, a.worker
    if router is None or router.start_bound_s <= 0 or not s.unstarted_upstreams(fetch_id):
        return reply

    # A planned reader whose upstreams have not begun their fetches waits for them, at
    # most the router's bound; then it is routed around those still missing.
    def check() -> Reply | None:
        if s.unstarted_upstreams(fetch_id):
            return None
        return s.plan(fetch_id, worker, session=session)
    return Park(check, router.start_bound_s, lambda: s.plan(fetch_id, worker, session=session))


def op_locate(s: HubState, session: str, a: LocateRequest) -> Answer:
    return s.locate(a.model, a.version, worker=a.worker, manifests_only=a.manifests_only)


def op_plan(s: HubState, session: str, a: PlanRequest) -> Answer:
    return s.plan(a.fetch_id, a.worker, session=session, chunks=a.chunks, exclude=a.exclude,
                  with_manifest=a.with_manifest)


def op_report_progress(s: HubState, session: str, a: ReportProgressRequest) -> Answer:
    return s.report_progress(a.fetch_id, a.worker, session=session, chunks=a.chunks,
                             sources=a.sources)


def op_complete_fetch(s: HubState, session: str, a: CompleteFetchRequest) -> Answer | Park:
    rec = s.fetches.get(a.fetch_id)
    out = s.complete_fetch(a.fetch_id, a.worker, session=session, traffic=a.traffic)
    timeout = _wait(a.timeout)
    if out.group != "open" or timeout <= 0 or rec is None or rec.group is None:
        return out
    model, group = rec.model, rec.group

    def check() -> CompleteReply | None:
        g = s.group_status(model, group)
        return None if g.state == "open" else CompleteReply(complete=g.state == "committed",
                                                            group=g.state)
    return Park(check, timeout, lambda: out)


def op_group_status(s: HubState, session: str, a: GroupStatusRequest) -> Answer:
    return s.group_status(a.model, a.group)


def op_release(s: HubState, session: str, a: ReleaseRequest) -> Answer:
    return s.release(a.fetch_id, a.worker, session=session)


def op_retract(s: HubState, session: str, a: RetractRequest) -> Answer | Park:
    model, version, worker = a.model, a.version, a.worker
    out = s.retract(model, version, worker, session=session, delay=a.delay)
    timeout = _wait(a.timeout)
    if out.state == "done" or timeout <= 0:
        return out

    def check() -> RetractReply | None:
        st = s.retract_status(model, version, worker)
        return st if st.state == "done" else None
    return Park(check, timeout, lambda: s.retract_status(model, version, worker))


def op_retract_status(s: HubState, session: str, a: RetractStatusRequest) -> Answer:
    return s.retract_status(a.model, a.version, a.worker)


def op_set_retention(s: HubState, session: str, a: SetRetentionRequest) -> Answer:
    try:
        return s.set_retention(a.model, keep_last=a.keep_last, min_replicas=a.min_replicas)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc


def op_pin(s: HubState, session: str, a: PinRequest) -> Answer:
    return s.pin(a.model, a.version, a.pinned)


def op_latest(s: HubState, session: str, a: LatestRequest) -> Answer:
    return VersionReply(version=s.latest(a.model))


def op_wait_version(s: HubState, session: str, a: WaitVersionRequest) -> Answer | Park:
    model, after = a.model, a.after

    def check() -> VersionReply | None:
        v = latest_of(s, model)
        return VersionReply(version=v) if v is not None and v > after else None
    ready = check()
    timeout = _wait(a.timeout)
    if ready is not None or timeout <= 0:
        return ready or VersionReply(version=None)
    return Park(check, timeout, lambda: VersionReply(version=None), model=model, after=after)


_LATEST: weakref.WeakKeyDictionary[HubState, tuple[int, dict[str, int | None]]] = \
    weakref.WeakKeyDictionary()


def latest_of(s: HubState, model: str) -> int | None:
    """``s.latest(model)``, computed once per state generation.

    Thousands of readers parked in ``wait_version`` (`ModelStore.sync`) share one answer
    per model: the server asks it once per model whenever the state changed (its
    `_wake_parked`) and wakes only the waits it answers. An answer kept for a generation
    is what ``latest`` says then.
    """
    kept = _LATEST.get(s)
    if kept is None or kept[0] != s.generation:
        kept = _LATEST[s] = (s.generation, {})
    if model not in kept[1]:
        kept[1][model] = s.latest(model)
    return kept[1][model]


def op_wait_commit(s: HubState, session: str, a: WaitCommitRequest) -> Answer | Park:
    model, version, shard = a.model, a.version, a.shard
    first = s.commit_state(model, version, shard)   # unknown ones raise here, at once

    def state() -> CommitWaitReply:
        try:
            return s.commit_state(model, version, shard)
        except (UnknownModelError, UnknownVersionError) as exc:  # forgotten while parked
            return CommitWaitReply(state=RETIRED, reason=str(exc))

    def check() -> Reply | None:
        out = state()
        return None if out.state == PUBLISHING else out
    timeout = _wait(a.timeout)
    if first.state != PUBLISHING or timeout <= 0:
        return first
    return Park(check, timeout, state)


def op_kv_put(s: HubState, session: str, a: KvPutRequest) -> Answer:
    return s.kv_put(a.key, a.value, ttl=a.ttl)


def op_kv_get(s: HubState, session: str, a: KvGetRequest) -> Answer | Park:
    key = a.key

    def check() -> KvGetReply | None:
        value = s.kv_get(key)
        return None if value is None else KvGetReply(value=value)
    ready = check()
    timeout = _wait(a.timeout)
    if ready is not None or timeout <= 0:
        return ready or KvGetReply(value=None)
    return Park(check, timeout, lambda: KvGetReply(value=None))


def op_status(s: HubState, session: str, a: StatusRequest) -> Answer:
    return s.snapshot()


def op_ping(s: HubState, session: str, a: PingRequest) -> Answer:
    return PingReply()


def _op(request: type[R], handler: Callable[[HubState, str, R], Answer | Park]) -> Op[Any]:
    return Op(request, handler)


# Every operation the hub serves, by its wire name (`Request.op`).
OPS: dict[str, Op[Any]] = {op.request.op: op for op in (
    _op(PingRequest, op_ping),
    _op(StatusRequest, op_status),
    _op(RegisterRequest, op_register),
    _op(HeartbeatRequest, op_heartbeat),
    _op(UnregisterRequest, op_unregister),
    _op(DropRequest, op_drop),
    _op(ReportCorruptRequest, op_report_corrupt),
    _op(RestoreRequest, op_restore),
    _op(BeginPublishRequest, op_begin_publish),
    _op(BeginDeriveRequest, op_begin_derive),
    _op(CommitRequest, op_commit),
    _op(AbortPublishRequest, op_abort_publish),
    _op(BeginFetchRequest, op_begin_fetch),
    _op(LocateRequest, op_locate),
    _op(PlanRequest, op_plan),
    _op(ReportProgressRequest, op_report_progress),
    _op(CompleteFetchRequest, op_complete_fetch),
    _op(GroupStatusRequest, op_group_status),
    _op(ReleaseRequest, op_release),
    _op(RetractRequest, op_retract),
    _op(RetractStatusRequest, op_retract_status),
    _op(SetRetentionRequest, op_set_retention),
    _op(PinRequest, op_pin),
    _op(LatestRequest, op_latest),
    _op(WaitVersionRequest, op_wait_version),
    _op(WaitCommitRequest, op_wait_commit),
    _op(KvPutRequest, op_kv_put),
    _op(KvGetRequest, op_kv_get),
)}

# Operations that change nothing a retry could see twice: the hub does not keep their
# replies for retries (a retried one runs again and answers from the current state).
READ_ONLY = frozenset({"group_status", "kv_get", "latest", "locate", "ping", "retract_status",
                       "status", "wait_commit", "wait_version"})

__all__ = ["MAX_WAIT_S", "OPS", "READ_ONLY", "Op", "Park", "latest_of", "parse_manifest"]
