"""What the planner hands to a fetch engine: transfers, stripes, predicted times.

A `Plan` is a forest written as a flat list of `Transfer` objects. Transfer ``i``
says: device ``reader`` reads bytes ``[start, end)`` of the version from device
``source`` along ``path``. When the source is itself a reader of the same plan
(a relay), ``upstream`` is the index of the transfer that brings those bytes to
it; the fetch engine then reads each chunk once the source's progress counter
shows it (pipelining). ``upstream`` is None when the source already holds the
bytes. Transfers are listed so that a transfer's upstream always comes first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Interval = tuple[int, int]
Link = tuple[str, str]  # a physical link: its two vertices, sorted

TREE = "tree"          # network trees, then NVSwitch / NVLink fan-out inside machines
HOST = "host"          # holder -> host memory over PCIe -> every reader over PCIe
NIC_LOOP = "nic-loop"  # a chain GPU -> its NIC -> leaf -> next GPU's NIC -> GPU (RDMA loopback)
PLANES = (TREE, HOST, NIC_LOOP)


class PlanError(ValueError):
    """A broadcast cannot be planned as asked; the message says what to change."""


class UnknownDeviceError(PlanError):
    """A source or reader names a device or node that is not in the cluster."""


class EmptyTransferError(PlanError):
    """The size is zero or negative, or there is nothing to read."""


class UnreachableReaderError(PlanError):
    """A reader has no path from any device holding some of the bytes it needs."""


@dataclass(frozen=True)
class Transfer:
    """One read: `reader` copies bytes ``[start, end)`` from `source` along `path`."""

    reader: str
    source: str
    start: int
    end: int
    stripe: int
    path: tuple[str, ...]
    upstream: int | None = None
    depth: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes moved."""
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """The transfer as plain data."""
        return {"reader": self.reader, "source": self.source, "start": self.start,
                "end": self.end, "stripe": self.stripe, "path": list(self.path),
                "upstream": self.upstream, "depth": self.depth}


@dataclass
class Plan:
    """A broadcast forest and what the planner expects of it.

    Attributes:
        size, chunk (int): Bytes of the version, and the pipelining unit a relay forwards at
            once.
        stripes (list of (start, end)): The byte ranges each distributed by its own tree.
        transfers (list of Transfer): Every read, upstream first.
        sources (dict): Device -> byte ranges it held when the plan was made.
        needs (dict): Reader -> byte ranges it must receive.
        predicted (dict): Reader -> predicted completion time in seconds, as the flow-level
            simulator gives it (`topology.estimate.predict`: the fluid model of
            `topology.fluid`, or the simulator itself where pipelining dominates).
        predicted_by (str): The model that gave `predicted`: ``"fluid"`` or ``"simulator"``.
        plan_seconds (float): Time taken to plan, the prediction included.
        planes (list of str): The plane each stripe travels on (`TREE`, `HOST` or `NIC_LOOP`;
            see `topology.planner`); empty means every stripe is a `TREE`.
    """

    size: int
    chunk: int
    stripes: list[Interval]
    transfers: list[Transfer]
    sources: dict[str, list[Interval]]
    needs: dict[str, list[Interval]]
    predicted: dict[str, float] = field(default_factory=dict)
    plan_seconds: float = 0.0
    planes: list[str] = field(default_factory=list)
    predicted_by: str = ""

    @property
    def readers(self) -> list[str]:
        """The readers, in `needs` order."""
        return list(self.needs)

    @property
    def predicted_s(self) -> float:
        """Predicted completion time of the last reader."""
        return max(self.predicted.values(), default=0.0)

    def fetches(self, reader: str) -> list[Transfer]:
        """The transfers `reader` executes (what a fetch engine asks for)."""
        return [t for t in self.transfers if t.reader == reader]

    def depth(self) -> int:
        """Depth of the deepest transfer."""
        return max((t.depth for t in self.transfers), default=0)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data."""
        return {"size": self.size, "chunk": self.chunk,
                "stripes": [list(s) for s in self.stripes],
                "sources": {d: [list(r) for r in rs] for d, rs in self.sources.items()},
                "needs": {d: [list(r) for r in rs] for d, rs in self.needs.items()},
                "transfers": [t.to_dict() for t in self.transfers],
                "planes": list(self.planes), "predicted": self.predicted,
                "predicted_by": self.predicted_by}


def link_bytes(transfers: Iterable[Transfer]) -> Counter[Link]:
    """Bytes the transfers send over each link, both directions summed.

    A link is keyed by its two vertices, sorted (``("a/nic0", "a/pcie0")``); every
    hop of a transfer's path adds the transfer's bytes to its link.
    """
    out: Counter[Link] = Counter()
    for t in transfers:
        for u, v in zip(t.path, t.path[1:], strict=False):
            out[link(u, v)] += t.nbytes
    return out


def link(u: str, v: str) -> Link:
    """The link between vertices `u` and `v`, whichever way it is crossed."""
    return (u, v) if u < v else (v, u)


def merge_intervals(intervals: list[Interval]) -> list[Interval]:
    """Sorted union of half-open intervals (empty ones dropped)."""
    out: list[Interval] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def intersect(intervals: list[Interval], lo: int, hi: int) -> list[Interval]:
    """The parts of `intervals` inside ``[lo, hi)``."""
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def covers(intervals: list[Interval], lo: int, hi: int) -> bool:
    """True when the union of `intervals` contains ``[lo, hi)``."""
    return sum(b - a for a, b in intersect(merge_intervals(intervals), lo, hi)) == hi - lo
