"""The cluster description as typed values.

A `Cluster` is what `topology.load_cluster` returns: node types (hardware of one
kind of machine), datacenters holding groups of nodes, WAN links between
datacenters, and optional role defaults. Quantities are stored in SI base units
(bytes/s, seconds, bytes); `Cluster.to_dict` writes them back with units so that
``load -> dump -> load`` gives an equal `Cluster`.

The YAML reference is in the README; `topology.loader` turns YAML into these
classes and reports errors with file and line.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightfabric.topology.units import format_bandwidth, format_latency, format_size

if TYPE_CHECKING:
    import networkx as nx

NIC_KINDS = ("rdma", "tcp")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A link tier inside a node: bandwidth per direction (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out: dict[str, Any] = {"bandwidth": format_bandwidth(self.bandwidth)}
        if self.latency:
            out["latency"] = format_latency(self.latency)
        return out


@dataclass(frozen=True, kw_only=True)
class NvlinkSpec(LinkSpec):
    """NVLink of each GPU.

    `groups` lists GPUs joined by NVLink (bridged pairs, say); None means every GPU of the
    node (or of its `nvlink_domain`) reaches every other through NVSwitch.
    """

    groups: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out = super().to_dict()
        if self.groups is not None:
            out["groups"] = [list(g) for g in self.groups]
        return out


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """The GPU model and its memory in bytes (None when not given)."""

    model: str
    memory: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out: dict[str, Any] = {"model": self.model}
        if self.memory is not None:
            out["memory"] = format_size(self.memory)
        return out


@dataclass(frozen=True, kw_only=True)
class NicSpec:
    """The node's network interfaces, all alike.

    NIC ``i`` serves GPUs ``i*gpus/count`` up to ``(i+1)*gpus/count - 1`` (rails);
    when there are more NICs than GPUs, GPU ``j`` is served by NICs
    ``j*count/gpus`` up to ``(j+1)*count/gpus - 1``.
    """

    count: int
    bandwidth: float
    kind: str = "rdma"
    latency: float = 0.0
    names: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out: dict[str, Any] = {"count": self.count, "bandwidth": format_bandwidth(self.bandwidth),
                               "kind": self.kind}
        if self.latency:
            out["latency"] = format_latency(self.latency)
        if self.names is not None:
            out["names"] = list(self.names)
        return out

    def rails(self, num_gpus: int) -> list[tuple[int, int]]:
        """The (gpu, nic) pairs that share a PCIe switch."""
        if num_gpus == 0:
            return []
        pairs = {(j, j * self.count // num_gpus) for j in range(num_gpus)}
        pairs |= {(i * num_gpus // self.count, i) for i in range(self.count)}
        return sorted(pairs)


@dataclass(frozen=True, kw_only=True)
class NumaSpec:
    """NUMA node of each GPU and each NIC (as discovery reads it from /sys)."""

    gpus: tuple[int, ...] = ()
    nics: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out: dict[str, Any] = {}
        if self.gpus:
            out["gpus"] = list(self.gpus)
        if self.nics:
            out["nics"] = list(self.nics)
        return out


@dataclass(frozen=True, kw_only=True)
class NodeType:
    """Hardware of one kind of machine."""

    name: str
    gpus: int
    gpu: GpuSpec | None = None
    nvlink: NvlinkSpec | None = None
    pcie: LinkSpec | None = None
    nics: NicSpec | None = None
    host_memory: float | None = None
    numa: NumaSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        """The node type as YAML data."""
        out: dict[str, Any] = {"gpus": self.gpus}
        for key in ("gpu", "nvlink", "pcie", "nics"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value.to_dict()
        if self.host_memory is not None:
            out["host_memory"] = format_size(self.host_memory)
        if self.numa is not None:
            out["numa"] = self.numa.to_dict()
        return out


@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine of the cluster."""

    name: str
    type: NodeType
    datacenter: str
    nvlink_domain: str | None = None


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """``count`` nodes of one type named by a pattern with ``{i}`` (or one node)."""

    name: str
    type: str
    count: int | None = None
    nvlink_domain: str | None = None

    def names(self) -> list[str]:
        """The names of the group's nodes."""
        if self.count is None:
            return [self.name]
        return [self.name.replace("{i}", str(i)) for i in range(self.count)]

    def to_dict(self) -> dict[str, Any]:
        """The group as YAML data."""
        out: dict[str, Any] = {"name": self.name, "type": self.type}
        if self.count is not None:
            out["count"] = self.count
        if self.nvlink_domain is not None:
            out["nvlink_domain"] = self.nvlink_domain
        return out


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """A datacenter's network between nodes.

    Each leaf switch serves `nodes_per_leaf` consecutive nodes; its uplink to the
    spine carries the sum of their NIC bandwidth divided by `oversubscription`
    (1.0 = non-blocking). `latency` is the switching latency added per hop.
    """

    oversubscription: float = 1.0
    latency: float = 0.0
    nodes_per_leaf: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data."""
        out: dict[str, Any] = {"oversubscription": self.oversubscription}
        if self.latency:
            out["latency"] = format_latency(self.latency)
        if self.nodes_per_leaf != 1:
            out["nodes_per_leaf"] = self.nodes_per_leaf
        return out


@dataclass(frozen=True, kw_only=True)
class Datacenter:
    """A datacenter: its node groups and network."""
    name: str
    nodes: tuple[NodeGroup, ...]
    network: NetworkSpec = field(default_factory=NetworkSpec)

    def to_dict(self) -> dict[str, Any]:
        """The datacenter as YAML data."""
        out: dict[str, Any] = {"name": self.name}
        if self.network != NetworkSpec():
            out["network"] = self.network.to_dict()
        out["nodes"] = [g.to_dict() for g in self.nodes]
        return out


@dataclass(frozen=True, kw_only=True)
class WanLink:
    """A link between two datacenters; bandwidth per direction."""

    between: tuple[str, str]
    bandwidth: float
    latency: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The link as YAML data."""
        out: dict[str, Any] = {"between": list(self.between),
                               "bandwidth": format_bandwidth(self.bandwidth)}
        if self.latency:
            out["latency"] = format_latency(self.latency)
        return out


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A validated cluster description. Build one with `topology.load_cluster`."""

    name: str
    node_types: dict[str, NodeType]
    datacenters: tuple[Datacenter, ...]
    wan: tuple[WanLink, ...] = ()
    roles: dict[str, tuple[str, ...]] = field(default_factory=dict)
    version: int = 1

    def nodes(self) -> list[Node]:
        """Every node, in file order, with its node-group pattern expanded."""
        return [
            Node(name=name, type=self.node_types[group.type], datacenter=dc.name,
                 nvlink_domain=group.nvlink_domain)
            for dc in self.datacenters for group in dc.nodes for name in group.names()
        ]

    def node(self, name: str) -> Node:
        """The node called `name`; KeyError if there is none."""
        for node in self.nodes():
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r} in cluster {self.name!r}")

    def role(self, role: str) -> list[Node]:
        """Nodes matching the names or globs given for `role` under ``roles:``."""
        patterns = self.roles.get(role, ())
        return [n for n in self.nodes() if any(fnmatch.fnmatchcase(n.name, p) for p in patterns)]

    def graph(self) -> nx.DiGraph:
        """The cluster as a `networkx.DiGraph`; see `topology.graph.build_graph`."""
        from weightfabric.topology.graph import build_graph

        return build_graph(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data in the YAML schema, with units; `load_cluster` reads it back equal."""
        out: dict[str, Any] = {
            "version": self.version,
            "name": self.name,
            "node_types": {name: t.to_dict() for name, t in self.node_types.items()},
            "datacenters": [dc.to_dict() for dc in self.datacenters],
        }
        if self.wan:
            out["wan"] = [w.to_dict() for w in self.wan]
        if self.roles:
            out["roles"] = {role: list(p) for role, p in self.roles.items()}
        return out

    def to_yaml(self) -> str:
        """The description as YAML text."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
