"""The texts of a cluster picture: counts, bandwidths, latencies, sizes, networks."""

from __future__ import annotations

from weightfabric.topology.schema import Datacenter, NodeType
from weightfabric.topology.units import human_bandwidth


def cpu_label(t: NodeType) -> str:
    """The label of a node type without GPUs."""
    return "CPU only" + (f" · {size_text(t.host_memory)} memory" if t.host_memory else "")


def plural(n: int, word: str) -> str:
    """``n word``, with the word in the plural unless n is 1."""
    return f"{n:,} {word}{'s' * (n != 1)}"


def network_label(dc: Datacenter) -> str:
    """The label of a datacenter's network."""
    net = dc.network
    parts = ["leaf/spine network"]
    if net.oversubscription == 1:
        parts.append("non-blocking")
    else:
        parts.append(f"{net.oversubscription:g}:1 oversubscribed")
    if net.nodes_per_leaf != 1:
        parts.append(f"{net.nodes_per_leaf} nodes per leaf")
    if net.latency:
        parts.append(f"{latency_text(net.latency)} per hop")
    return " · ".join(parts)


def wan_label(bandwidth: float, latency: float) -> list[str]:
    """The lines of a WAN link's label."""
    lines = ["WAN", nic_bandwidth(bandwidth)]
    if latency:
        lines.append(latency_text(latency))
    return lines


def nic_bandwidth(bytes_per_s: float) -> str:
    """Bandwidth in bytes and, as network links are sold, in bits: '50 GB/s (400 Gb/s)'."""
    bits = bytes_per_s * 8
    for name, factor in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6)):
        if bits >= factor:
            return f"{human_bandwidth(bytes_per_s)} ({bits / factor:.3g} {name})"
    return human_bandwidth(bytes_per_s)


def latency_text(seconds: float) -> str:
    """`seconds` in s, ms or µs (empty for 0)."""
    if not seconds:
        return ""
    for name, factor in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {name}"
    return f"{seconds / 1e-9:.3g} ns"


def size_text(nbytes: float) -> str:
    """`nbytes` in TB, GB, MB or B."""
    for name, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= factor:
            return f"{nbytes / factor:.3g} {name}"
    return f"{nbytes:.3g} B"


__all__ = ["cpu_label", "latency_text", "network_label", "nic_bandwidth", "plural", "size_text",
           "wan_label"]
