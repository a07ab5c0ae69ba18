"""The hub's small durable state: next version numbers and retention policies.

Written as JSON to ``STATE_DIR/hub-state.json`` atomically (temp file, fsync,
rename), before a reply that hands out a new version number leaves the hub, so
numbers stay monotonic across hub restarts.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from fabric.hub_records import RetentionPolicy

STATE_FILE = "hub-state.json"


def load_state(state_dir: Path) -> tuple[dict[str, int], dict[str, RetentionPolicy]]:
    """Read the counters and policies (empty when the file does not exist yet).

    Raises:
        ValueError: the file exists but is not a state file this hub wrote.
    """
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return {}, {}
    try:
        raw = json.loads(path.read_text())
        counters = {str(k): int(v) for k, v in raw["next_versions"].items()}
        policies = {str(k): RetentionPolicy(int(p["keep_last"]), int(p["min_replicas"]),
                                            {int(x) for x in p.get("pinned", ())})
                    for k, p in raw.get("policies", {}).items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a valid hub state file ({exc}); move it away to start "
                         "fresh (version numbers may then repeat)") from exc
    return counters, policies


def save_state(state_dir: Path, next_versions: dict[str, int],
               policies: dict[str, RetentionPolicy]) -> None:
    """Atomically replace the state file."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"next_versions": next_versions,
                       "policies": {k: p.to_wire() for k, p in policies.items()}}, indent=1)
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


__all__ = ["STATE_FILE", "load_state", "save_state"]
