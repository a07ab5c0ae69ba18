"""Where the hub's durable records live, behind one interface.

`HubState` (`fabric.hub.state`) keeps every record in memory and runs the operations;
soft records (replicas, fetches, leases) live only there, because their authority is
the workers (they re-register what they hold with a hub that does not know them).
What a hub restart must not lose is a `DurableState` (`fabric.hub.persist`): version
counters, the versions and their states, retention and pins, and what was retired. A
`RecordStore` loads it when a hub starts (or becomes the leader) and saves it before a
reply that depends on it leaves the hub.

Backends:

* `MemoryRecords`: nothing kept (a hub without ``--state-dir``);
* `DirRecords`: one JSON file in a state dir, replaced atomically (``--state-dir``);
* `fabric.hub.etcd_records.EtcdRecords`: an etcd cluster several hubs share
  (``--store etcd://...``), written in transactions that apply only while the writing
  hub leads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from weightfabric.fabric.hub.persist import DurableState, load_state, save_state


class RecordStore(Protocol):
    """Loads and saves a hub's `DurableState`."""

    @property
    def describe(self) -> str:
        """Where the records live, for logs and `fabric hub status`."""
        ...

    def load(self) -> DurableState:
        """Everything saved so far (an empty state the first time).

        Raises:
            ValueError: the store holds something this hub did not write.
            StoreUnavailableError: the store cannot be read now.
        """
        ...

    def save(self, state: DurableState) -> None:
        """Replace what is saved with ``state`` (all or nothing).

        Raises:
            StoreUnavailableError: nothing was saved (the store does not answer).
            NotLeaderError: nothing was saved: another hub leads now.
        """
        ...

    def close(self) -> None:
        """Release connections (idempotent)."""
        ...


class MemoryRecords:
    """Keeps nothing.

    Version numbers start again at 1 after a restart, unless holders bring back the
    ones they hold.
    """

    describe = "memory (nothing kept across restarts)"

    def load(self) -> DurableState:
        """An empty state."""
        return DurableState()

    def save(self, state: DurableState) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do."""


class DirRecords:
    """A state dir: ``hub-state.json`` replaced atomically at each change.

    Raises:
        ValueError: the directory cannot be created or written (checked here, not at the
            first version).
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"state dir {self.state_dir}: cannot create it: "
                             f"{exc.strerror}") from exc
        if not os.access(self.state_dir, os.W_OK | os.X_OK):
            raise ValueError(f"state dir {self.state_dir}: not writable")

    @property
    def describe(self) -> str:
        """The state dir."""
        return f"state dir {self.state_dir}"

    def load(self) -> DurableState:
        """The state file's content (`fabric.hub.persist.load_state`)."""
        return load_state(self.state_dir)

    def save(self, state: DurableState) -> None:
        """Replace the state file."""
        save_state(self.state_dir, state)

    def close(self) -> None:
        """Nothing to do."""


__all__ = ["DirRecords", "MemoryRecords", "RecordStore"]
