"""The hub's operations as the wire names them: argument checks and dispatch.

Each handler takes ``(state, session, args)`` and returns a reply body, or a
`Park` when the answer must wait (long-polls): the server re-runs ``check``
whenever the state changes and answers ``on_timeout()`` at the deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightfabric.fabric.errors import BadRequestError
from weightfabric.fabric.hub.state import HubState, check_manifest_size
from weightfabric.fabric.locality import Location
from weightfabric.fabric.manifest import Manifest

MAX_WAIT_S = 300.0


@dataclass
class Park:
    """A reply that waits: ``check()`` returns the body once ready, else None."""

    check: Callable[[], dict[str, Any] | None]
    timeout: float
    on_timeout: Callable[[], dict[str, Any]]


_MISSING = object()


def _arg(args: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any = _MISSING
         ) -> Any:
    value = args.get(key, default)
    if value is _MISSING:
        raise BadRequestError(f"missing argument {key!r}")
    if value is None and default is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequestError(f"argument {key!r} must be {kinds}, got a bool")
    if not isinstance(value, kinds):
        raise BadRequestError(f"argument {key!r} must be {kinds}, got {type(value).__name__}")
    return value


def _ints(args: dict[str, Any], key: str) -> list[int] | None:
    value = _arg(args, key, list, None)
    if value is not None and not all(isinstance(c, int) and not isinstance(c, bool)
                                     for c in value):
        raise BadRequestError(f"argument {key!r} must be a list of ints")
    return value


def _strs(args: dict[str, Any], key: str) -> list[str] | None:
    value = _arg(args, key, list, None)
    if value is not None and not all(isinstance(c, str) for c in value):
        raise BadRequestError(f"argument {key!r} must be a list of strings")
    return value


def _manifest(args: dict[str, Any]) -> Manifest:
    return _parse_manifest(_arg(args, "manifest", dict), "bad manifest")


def _parse_manifest(raw: Any, what: str) -> Manifest:
    """A wire manifest, checked (fields and `MAX_CHUNKS`).

    Raises:
        BadRequestError: malformed, or too many chunks.
    """
    try:
        manifest = Manifest.from_wire(raw)
        check_manifest_size(manifest)
    except ValueError as exc:
        raise BadRequestError(f"{what}: {exc}") from exc
    return manifest


def _wait(args: dict[str, Any]) -> float:
    """A long poll's wait in seconds, clamped to 0..`MAX_WAIT_S`.

    Raises:
        BadRequestError: not a number, or NaN / infinite (it could never be answered).
    """
    timeout = float(_arg(args, "timeout", (int, float), 0.0))
    if not math.isfinite(timeout):
        raise BadRequestError(f"argument 'timeout' must be a finite number of seconds, got "
                              f"{timeout}; pass at most {MAX_WAIT_S:g}")
    return min(max(timeout, 0.0), MAX_WAIT_S)


def _worker(args: dict[str, Any]) -> str:
    return _arg(args, "worker", str)


def op_register(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    try:
        loc = Location.from_wire(a.get("location"))
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc
    return s.register(_worker(a), session=session, location=loc,
                      endpoints=_arg(a, "endpoints", dict, None))


def op_heartbeat(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    publishing = _arg(a, "publishing", list, None)
    if publishing is not None and not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], int) and not isinstance(p[1], bool) for p in publishing):
        raise BadRequestError("argument 'publishing' must be a list of [model, version]")
    return s.heartbeat(_worker(a), session=session, publishing=publishing)


def op_unregister(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.unregister(_worker(a), session=session)


def op_drop(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.drop(_arg(a, "model", str), _worker(a), session=session)


def op_restore(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    holdings = [_holding(h) for h in _arg(a, "holdings", list)]
    return s.restore(_worker(a), session=session, holdings=holdings)


_HOLDING_STATES = ("publishing", "committed")


def _holding(h: Any) -> dict[str, Any]:
    """One ``restore`` holding, every field type-checked (nothing changes on a bad one).

    Raises:
        BadRequestError: not a map, a field of the wrong type, a bad manifest, an
            unknown state, or chunk indices out of range.
    """
    if not isinstance(h, dict):
        raise BadRequestError("each holding must be a map")
    manifest = _parse_manifest(h.get("manifest"), "bad manifest in holding")
    out = {"model": _arg(h, "model", str), "version": _arg(h, "version", int),
           "shard": _arg(h, "shard", int), "num_shards": _arg(h, "num_shards", int, 1),
           "manifest": manifest, "state": _arg(h, "state", str, "publishing"),
           "complete": _arg(h, "complete", bool, False),
           "publisher": _arg(h, "publisher", bool, False),
           "fetch_id": _arg(h, "fetch_id", str, None), "chunks": _ints(h, "chunks") or [],
           "group": _arg(h, "group", str, None)}
    if out["state"] not in _HOLDING_STATES:
        raise BadRequestError(f"holding state must be one of {_HOLDING_STATES}, "
                              f"got {out['state']!r}")
    if out["version"] < 1:
        raise BadRequestError(f"holding version must be >= 1, got {out['version']}")
    bad = [c for c in out["chunks"] if not 0 <= c < manifest.num_chunks]
    if bad:
        raise BadRequestError(f"holding chunk indices out of range 0..{manifest.num_chunks - 1}:"
                              f" {bad[:8]}")
    return out


def op_begin_publish(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.begin_publish(_arg(a, "model", str), _worker(a), _manifest(a), session=session,
                           shard=_arg(a, "shard", int, 0), num_shards=_arg(a, "num_shards", int, 1),
                           group=_arg(a, "group", str, None))


def op_commit(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.commit(_arg(a, "model", str), _arg(a, "version", int), _worker(a), session=session)


def op_abort_publish(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.abort_publish(_arg(a, "model", str), _arg(a, "version", int), _worker(a),
                           session=session, reason=_arg(a, "reason", str, ""))


def op_begin_fetch(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.begin_fetch(_arg(a, "model", str), _arg(a, "version", (int, str), "latest"),
                         _worker(a), session=session, fetch_id=_arg(a, "fetch_id", str),
                         shard=_arg(a, "shard", int, 0),
                         fingerprint=_arg(a, "fingerprint", str, None),
                         group=_arg(a, "group", str, None),
                         group_size=_arg(a, "group_size", int, 1), have=_ints(a, "have"))


def op_locate(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.locate(_arg(a, "model", str), _arg(a, "version", (int, str), "latest"),
                    worker=_arg(a, "worker", str, None))


def op_plan(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.plan(_arg(a, "fetch_id", str), _worker(a), session=session,
                  chunks=_ints(a, "chunks"), exclude=_strs(a, "exclude"),
                  with_manifest=_arg(a, "with_manifest", bool, True))


def op_report_progress(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.report_progress(_arg(a, "fetch_id", str), _worker(a), session=session,
                             chunks=_ints(a, "chunks") or [], sources=_strs(a, "sources"))


def op_complete_fetch(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any] | Park:
    fetch_id = _arg(a, "fetch_id", str)
    rec = s.fetches.get(fetch_id)
    out = s.complete_fetch(fetch_id, _worker(a), session=session)
    timeout = _wait(a)
    if out["group"] != "open" or timeout <= 0 or rec is None or rec.group is None:
        return out
    model, group = rec.model, rec.group

    def check() -> dict[str, Any] | None:
        g = s.group_status(model, group)
        return None if g["state"] == "open" else {"complete": g["state"] == "committed",
                                                  "group": g["state"]}
    return Park(check, timeout, lambda: out)


def op_group_status(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.group_status(_arg(a, "model", str), _arg(a, "group", str))


def op_release(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.release(_arg(a, "fetch_id", str), _worker(a), session=session)


def op_retract(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any] | Park:
    model, version, worker = _arg(a, "model", str), _arg(a, "version", int), _worker(a)
    out = s.retract(model, version, worker, session=session,
                    delay=bool(_arg(a, "delay", bool, False)))
    timeout = _wait(a)
    if out["state"] == "done" or timeout <= 0:
        return out

    def check() -> dict[str, Any] | None:
        st = s.retract_status(model, version, worker)
        return st if st["state"] == "done" else None
    return Park(check, timeout, lambda: s.retract_status(model, version, worker))


def op_retract_status(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.retract_status(_arg(a, "model", str), _arg(a, "version", int), _worker(a))


def op_set_retention(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    try:
        return s.set_retention(_arg(a, "model", str), keep_last=_arg(a, "keep_last", int, None),
                               min_replicas=_arg(a, "min_replicas", int, None))
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc


def op_pin(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.pin(_arg(a, "model", str), _arg(a, "version", int),
                 bool(_arg(a, "pinned", bool, True)))


def op_latest(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return {"version": s.latest(_arg(a, "model", str))}


def op_wait_version(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any] | Park:
    model, after = _arg(a, "model", str), _arg(a, "after", int, 0)

    def check() -> dict[str, Any] | None:
        v = s.latest(model)
        return {"version": v} if v is not None and v > after else None
    ready = check()
    timeout = _wait(a)
    if ready is not None or timeout <= 0:
        return ready or {"version": None}
    return Park(check, timeout, lambda: {"version": None})


def op_kv_put(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    ttl = _arg(a, "ttl", (int, float), None)
    return s.kv_put(_arg(a, "key", str), _arg(a, "value", bytes),
                    ttl=None if ttl is None else float(ttl))


def op_kv_get(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any] | Park:
    key = _arg(a, "key", str)

    def check() -> dict[str, Any] | None:
        value = s.kv_get(key)
        return None if value is None else {"value": value}
    ready = check()
    timeout = _wait(a)
    if ready is not None or timeout <= 0:
        return ready or {"value": None}
    return Park(check, timeout, lambda: {"value": None})


def op_status(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return s.snapshot()


def op_ping(s: HubState, session: str, a: dict[str, Any]) -> dict[str, Any]:
    return {"pong": True}


OPS: dict[str, Callable[[HubState, str, dict[str, Any]], dict[str, Any] | Park]] = {
    name[3:]: fn for name, fn in globals().items() if name.startswith("op_")
}

# Operations that change nothing a retry could see twice: the hub does not keep their
# replies for retries (a retried one runs again and answers from the current state).
READ_ONLY = frozenset({"group_status", "kv_get", "latest", "locate", "ping", "retract_status",
                       "status", "wait_version"})

__all__ = ["MAX_WAIT_S", "OPS", "READ_ONLY", "Park"]
