"""Who holds and who needs which bytes: names resolved to devices, defaults from roles."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import (
    EmptyTransferError,
    Interval,
    PlanError,
    UnknownDeviceError,
    intersect,
    merge_intervals,
)
from weightfabric.topology.schema import Cluster

SourceSpec = Iterable[str] | Mapping[str, list[Interval] | None] | None
#: How many valid names an unknown-name error lists.
SHOWN_NAMES = 8


def resolve(layout: Layout, names: Iterable[str], what: str) -> list[str]:
    """Devices named by `names` (devices, or nodes meaning all their devices), in order."""
    out: list[str] = []
    for name in names:
        if layout.is_device(name):
            out.append(name)
        elif name in layout.machines:
            out.extend(layout.machines[name].devices)
        else:
            raise UnknownDeviceError(_unknown(layout, name, what))
    return list(dict.fromkeys(out))


def _unknown(layout: Layout, name: str, what: str) -> str:
    """Why `name` is not an endpoint, listing some that are.

    The devices of its node when the part before '/' is a node, else the nodes.
    """
    node = layout.machines.get(name.split("/")[0]) if "/" in name else None
    if node is not None:
        kind, valid = f"the devices of {node.name!r}", node.gpus + [node.host]
    else:
        kind, valid = "its nodes", list(layout.machines)
    cut = SHOWN_NAMES if len(valid) > SHOWN_NAMES + 1 else len(valid)  # never "and 1 more"
    shown = ", ".join(valid[:cut]) + (f" and {len(valid) - cut} more" if len(valid) > cut else "")
    example = valid[0].split("/")[0] if valid else "node"
    return (f"{what} {name!r} is not a device or node of this cluster; {kind} are {shown} "
            f"(a node means all its devices; a device is NODE/gpuJ or NODE/host, e.g. "
            f"{example + '/gpu0'!r})")


def default_endpoints(cluster: Cluster, layout: Layout) -> tuple[list[str], list[str]]:
    """Sources and readers from the YAML roles: trainer devices, rollout devices.

    When the roles overlap (one machine both trains and rolls out), the first
    trainer device is the source and every other rollout device a reader.

    Raises:
        EmptyTransferError: the roles leave no reader (no ``rollout`` role, or it
            names only the trainer's devices).
    """
    trainer, readers = _role_endpoints(cluster, layout)
    if not readers:
        raise EmptyTransferError(
            f"the cluster's roles name no rollout device besides the trainer "
            f"({', '.join(trainer)}); add `roles:` to the cluster file with `trainer:` and "
            f"`rollout:` nodes (or pass --sources and --readers to `fabric topo plan`)")
    return trainer, readers


def _role_endpoints(cluster: Cluster, layout: Layout) -> tuple[list[str], list[str]]:
    """`default_endpoints` without the check: the readers may be empty."""
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
    whole = [(0, size)]
    held: dict[str, list[Interval]] = {}
    if sources is None:
        sources = _role_endpoints(cluster, layout)[0]
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
        names = default_endpoints(cluster, layout)[1] if readers is None else readers
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
