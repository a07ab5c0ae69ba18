"""The hub's small durable state: what must survive a hub restart.

Written as JSON to ``STATE_DIR/hub-state.json`` atomically (temp file, fsync,
rename) before a reply that depends on it leaves the hub. Per model it keeps:

* ``next_versions``: the next version number (numbers stay monotonic);
* ``policies``: the retention policy;
* ``versions``: every version not retired yet, with its state, shard count and each
  shard's manifest fingerprint, so holders re-registering after a restart find it (a
  publishing version nobody comes back for is retired as orphaned), and one restoring
  a manifest other than the one published is refused;
* ``seen``: the version numbers handed out or restored, as ``[lo, hi)`` ranges:
  one not in ``versions`` was retired, so a holder restoring a version retired
  before the restart gets it back as retired, never as committed (files written
  before ``seen`` have ``known_below``: every number below it);
* ``retired``: the most recent retired versions with the reason (for status);
* ``kv``: the rendezvous keys with their owner and, for a ttl, its wall-clock deadline.

Soft state (replicas, fetches, leases) is not kept: workers re-register what they
hold.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightfabric.fabric.hub.kv import KvRecord
from weightfabric.fabric.hub.records import RetentionPolicy

STATE_FILE = "hub-state.json"
MAX_RETIRED_KEPT = 32


@dataclass
class DurableState:
    """What the state file holds (see the module docstring).

    ``versions`` is None when the file predates it (nothing is known about old
    versions then).
    """

    next_versions: dict[str, int] = field(default_factory=dict)
    policies: dict[str, RetentionPolicy] = field(default_factory=dict)
    versions: dict[str, dict[int, tuple[str, int, dict[int, str]]]] | None = None
    seen: dict[str, list[list[int]]] = field(default_factory=dict)
    retired: dict[str, dict[int, str]] = field(default_factory=dict)
    kv: dict[str, KvRecord] = field(default_factory=dict)


def load_state(state_dir: Path) -> DurableState:
    """Read the state file (an empty `DurableState` when it does not exist yet).

    Raises:
        ValueError: the file exists but is not a state file this hub wrote.
    """
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return DurableState(versions={})
    try:
        return parse_state(json.loads(path.read_text()))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}; move it away to start fresh (version numbers may "
                         "then repeat)") from exc


def parse_state(raw: dict[str, Any]) -> DurableState:
    """A `DurableState` from its JSON form (`state_json`).

    Raises:
        ValueError: ``raw`` is not that form.
    """
    try:
        out = DurableState(
            next_versions={str(k): int(v) for k, v in raw["next_versions"].items()},
            policies={str(k): RetentionPolicy(int(p["keep_last"]), int(p["min_replicas"]),
                                              {int(x) for x in p.get("pinned", ())})
                      for k, p in raw.get("policies", {}).items()})
        if "versions" in raw:
            out.versions = {str(m): {int(n): _version(v) for n, v in vs.items()}
                            for m, vs in raw["versions"].items()}
            out.seen = {str(m): [[1, int(n)]] for m, n in raw.get("known_below", {}).items()}
            out.seen.update({str(m): [[int(lo), int(hi)] for lo, hi in rs]
                             for m, rs in raw.get("seen", {}).items()})
            out.retired = {str(m): {int(n): str(r) for n, r in rs.items()}
                           for m, rs in raw.get("retired", {}).items()}
        out.kv = {str(k): (base64.b64decode(v, validate=True),
                           None if wall is None else float(wall),
                           None if owner is None else str(owner))
                  for k, (v, wall, owner) in raw.get("kv", {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a valid hub state ({exc!r})") from exc
    return out


def state_json(state: DurableState) -> dict[str, Any]:
    """``state`` as plain JSON data (`parse_state` reads it back)."""
    return {
        "next_versions": state.next_versions,
        "policies": {k: p.to_wire() for k, p in state.policies.items()},
        "versions": {m: {str(n): [st, shards, {str(s): f for s, f in sorted(fps.items())}]
                         for n, (st, shards, fps) in vs.items()}
                     for m, vs in (state.versions or {}).items()},
        "seen": state.seen,
        "retired": {m: {str(n): r for n, r in sorted(rs.items())[-MAX_RETIRED_KEPT:]}
                    for m, rs in state.retired.items()},
        "kv": {k: [base64.b64encode(v).decode(), wall, owner]
               for k, (v, wall, owner) in state.kv.items()},
    }


def _version(raw: list[Any]) -> tuple[str, int, dict[int, str]]:
    """A version's ``[state, shards, {shard: fingerprint}]``.

    Files written before the fingerprints have the first two items only.
    """
    state, shards, *rest = raw
    fingerprints = rest[0] if rest else {}
    return str(state), int(shards), {int(s): str(f) for s, f in fingerprints.items()}


def save_state(state_dir: Path, state: DurableState) -> None:
    """Atomically replace the state file."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    body = json.dumps(state_json(state), indent=1)
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".hub-state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, state_dir / STATE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["MAX_RETIRED_KEPT", "STATE_FILE", "DurableState", "load_state", "parse_state",
           "save_state", "state_json"]
