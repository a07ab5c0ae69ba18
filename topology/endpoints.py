"""Who holds and who needs which bytes: names resolved to devices, defaults from roles."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from topology.layout import Layout
from topology.plan import (
    EmptyTransferError,
    Interval,
    PlanError,
    UnknownDeviceError,
    intersect,
    merge_intervals,
)
from topology.schema import Cluster

SourceSpec = Iterable[str] | Mapping[str, list[Interval] | None] | None



def resolve(layout: Layout, names: Iterable[str], what: str) -> list[str]:
    """Devices named by `names` (devices, or nodes meaning all their devices), in order."""
    out: list[str] = []
    for name in names:
        if layout.is_device(name):
            out.append(name)
        elif name in layout.machines:
            out.extend(layout.machines[name].devices)
        else:
            example = next(iter(layout.machines), "node")
            raise UnknownDeviceError(
                f"{what} {name!r} is not a device or node of this cluster; name a node "
                f"(e.g. {example!r}) or a device (e.g. {example + '/gpu0'!r} or "
                f"{example + '/host'!r}); 'fabric topo show FILE' lists them")
    return list(dict.fromkeys(out))


def default_endpoints(cluster: Cluster, layout: Layout) -> tuple[list[str], list[str]]:
    """Sources and readers from the YAML roles: trainer devices, rollout devices.

    When the roles overlap (one machine both trains and rolls out), the first
    trainer device is the source and every other rollout device a reader.
    """
    trainer = resolve(layout, [n.name for n in cluster.role("trainer")], "trainer")
    rollout = resolve(layout, [n.name for n in cluster.role("rollout")], "rollout")
    if not trainer:
        trainer = layout.machines[next(iter(layout.machines))].devices[:1]
    readers = [d for d in rollout if d not in set(trainer)]
    if not readers:
        trainer = trainer[:1]
        readers = [d for d in rollout if d != trainer[0]]
    return trainer, readers


def endpoints(cluster, layout: Layout, size: int, sources: SourceSpec,
               readers: Iterable[str] | None, needs: Mapping[str, list[Interval]] | None
               ) -> tuple[dict[str, list[Interval]], dict[str, list[Interval]]]:
    """(held, need): the byte ranges each source device holds and each reader still needs."""
    if size <= 0:
        raise EmptyTransferError(f"size must be a positive number of bytes, got {size}; "
                                 "pass the version's size, e.g. --size 140GB")
    if (sources is None or (readers is None and needs is None)) \
            and not isinstance(cluster, Cluster):
        raise PlanError("sources and readers have no default without a Cluster (roles); "
                        "pass them explicitly")
    defaults = default_endpoints(cluster, layout) if isinstance(cluster, Cluster) else None
    whole = [(0, size)]
    held: dict[str, list[Interval]] = {}
    if sources is None:
        sources = defaults[0]
    if isinstance(sources, Mapping):
        for name, ranges in sources.items():
            for dev in resolve(layout, [name], "source"):
                held[dev] = merge_intervals(intersect(list(ranges), 0, size)) \
                    if ranges is not None else whole
    else:
        held = {dev: whole for dev in resolve(layout, sources, "source")}
    if not held:
        raise PlanError("no sources: name the devices that hold the version (--sources)")
    if needs is not None:
        need = {}
        for name, ranges in needs.items():
            for dev in resolve(layout, [name], "reader"):
                need[dev] = merge_intervals(intersect(list(ranges), 0, size))
    else:
        names = defaults[1] if readers is None else readers
        need = {dev: whole for dev in resolve(layout, names, "reader")}
    for dev, ranges in list(need.items()):
        ranges = subtract(ranges, held.get(dev, []))
        if ranges:
            need[dev] = ranges
        else:
            del need[dev]
    if not need:
        raise EmptyTransferError("no reader needs any bytes the sources do not already "
                                 "hold; pass --readers other than the sources")
    return held, need


def subtract(ranges: list[Interval], remove: list[Interval]) -> list[Interval]:
    """`ranges` without the bytes in `remove`."""
    out = []
    remove = merge_intervals(remove)
    for lo, hi in merge_intervals(ranges):
        cur = lo
        for a, b in remove:
            if b <= cur or a >= hi:
                continue
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if cur < hi:
            out.append((cur, hi))
    return out


__all__ = ["SourceSpec", "default_endpoints", "endpoints", "resolve", "subtract"]
