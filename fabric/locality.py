"""Where a worker sits, and the default ranking of read sources by locality.

The hub ranks candidate sources with a `RankSources` function. The default,
`rank_by_locality`, prefers the same node, then the same datacenter, then
anything else; ties go to the least-loaded source (fewest fetches reading from
it), then complete replicas before partial ones, then worker id, so plans are
deterministic. A topology planner
can replace it: pass ``rank_sources=`` to `HubState` / `fabric.serve`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Location:
    """A worker's place: datacenter, node and device names ('' when unknown)."""

    datacenter: str = ""
    node: str = ""
    device: str = ""

    def to_wire(self) -> dict[str, str]:
        """``{"datacenter", "node", "device"}`` (see `from_wire`)."""
        return {"datacenter": self.datacenter, "node": self.node, "device": self.device}

    @classmethod
    def from_wire(cls, raw: Any) -> Location:
        """Build from a dict (missing keys are ''), None, or a Location."""
        if raw is None:
            return cls()
        if isinstance(raw, Location):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"location must be a map with datacenter/node/device, got {raw!r}")
        return cls(str(raw.get("datacenter", "")), str(raw.get("node", "")),
                   str(raw.get("device", "")))


@dataclass(frozen=True)
class SourceCandidate:
    """A replica the hub could name as a source, with what a ranking needs."""

    worker: str
    location: Location
    complete: bool
    load: int


RankSources = Callable[[Location, Sequence[SourceCandidate]], list[SourceCandidate]]
"""Contract: return the candidates (a subset is allowed, never new ones) best first."""


def locality_tier(reader: Location, source: Location) -> int:
    """0 same node, 1 same datacenter, 2 elsewhere (unknown names never match)."""
    same_dc = bool(reader.datacenter) and reader.datacenter == source.datacenter
    if reader.node and reader.node == source.node and (same_dc or not reader.datacenter):
        return 0
    return 1 if same_dc else 2


def rank_by_locality(reader: Location, candidates: Sequence[SourceCandidate]
                     ) -> list[SourceCandidate]:
    """Rank by (locality tier, load, complete first, worker id)."""
    return sorted(candidates, key=lambda c: (locality_tier(reader, c.location), c.load,
                                             not c.complete, c.worker))


__all__ = ["Location", "RankSources", "SourceCandidate", "locality_tier", "rank_by_locality"]
