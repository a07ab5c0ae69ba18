"""An index of a cluster graph for planning: machines, rails, switches and routes.

`Layout` reads a graph built by `topology.graph.build_graph` once (O(V + E)) and
then answers, in O(path length), the route a read takes between two devices:
NVLink (direct or through the NVSwitch) inside a node or NVLink domain, PCIe
through the host otherwise (``GPU -> its PCIe port -> host -> PCIe port -> GPU``),
and between nodes ``device -> [PCIe port ->] NIC -> leaf [-> spine [-> WAN
gateways] -> spine] -> leaf -> NIC [-> PCIe port] -> device``. A device reaches a
NIC that is not on its own rail through an NVLink peer on that rail (NCCL's PXN)
or through the host. Between datacenters a route takes the WAN gateways it is
given (a WAN tree's path, `wan_trees`), else the fewest WAN hops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from weightfabric.topology.wan import WanTree, datacenter_graph, wan_trees

DEVICE_KINDS = ("gpu", "host")


@dataclass
class Machine:
    """One node of the cluster as the planner sees it."""

    name: str
    datacenter: str
    host: str
    gpus: list[str] = field(default_factory=list)
    nics: list[str] = field(default_factory=list)
    ports: dict[str, str] = field(default_factory=dict)  # GPU -> its PCIe port
    leaf: str | None = None
    nvswitch: str | None = None
    rail_gpu: dict[int, str] = field(default_factory=dict)  # NIC index -> GPU on its rail

    @property
    def devices(self) -> list[str]:
        """Endpoints that can hold bytes: the GPUs, or the host when there are none."""
        return self.gpus if self.gpus else [self.host]


class Layout:
    """Machines, datacenters and routes of a cluster graph (see the module docstring)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self.machines: dict[str, Machine] = {}
        self.machine_of: dict[str, str] = {}
        kinds = nx.get_node_attributes(graph, "kind")
        for v, kind in kinds.items():
            if kind == "host":
                data = graph.nodes[v]
                self.machines[data["node"]] = Machine(data["node"], data["datacenter"], v)
        for v, kind in kinds.items():
            data = graph.nodes[v]
            if kind not in ("gpu", "nic", "pcie"):
                continue
            m = self.machines[data["node"]]
            if kind == "pcie":
                m.ports[data["gpu"]] = v
            else:
                (m.gpus if kind == "gpu" else m.nics).append(v)
            self.machine_of[v] = m.name
        for m in self.machines.values():
            self.machine_of[m.host] = m.name
            m.gpus.sort(key=lambda g: graph.nodes[g]["index"])
            m.nics.sort(key=lambda n: graph.nodes[n]["index"])
            for k, nic in enumerate(m.nics):
                for u in graph.successors(nic):
                    if kinds[u] == "leaf":
                        m.leaf = u
                    elif kinds[u] == "pcie" and k not in m.rail_gpu:
                        m.rail_gpu[k] = graph.nodes[u]["gpu"]
            for g in m.gpus[:1]:
                for u in graph.successors(g):
                    if kinds[u] == "nvswitch":
                        m.nvswitch = u
        self.kinds = kinds
        self.uplink: dict[str, float] = {}    # leaf -> bandwidth to the spine
        self.downlink: dict[str, float] = {}  # leaf -> sum of its NICs' bandwidth
        for u, v, bw in graph.edges(data="bandwidth"):
            if kinds.get(u) == "leaf" and kinds.get(v) == "spine":
                self.uplink[u] = bw
            elif kinds.get(u) == "nic" and kinds.get(v) == "leaf":
                self.downlink[v] = self.downlink.get(v, 0.0) + bw
        gateways = [v for v, k in kinds.items() if k == "wan"]
        self._wan = graph.subgraph(gateways).copy()
        self.wan = datacenter_graph(self._wan)  # datacenters and their WAN links
        self._wan_trees: dict[tuple[frozenset[str], frozenset[str], int], list[WanTree]] = {}

    # --- devices ------------------------------------------------------------------
    def is_device(self, v: str) -> bool:
        """Whether vertex `v` is a device."""
        return self.kinds.get(v) in DEVICE_KINDS

    def machine(self, device: str) -> Machine:
        """The machine of `device`."""
        return self.machines[self.machine_of[device]]

    def datacenter(self, device: str) -> str:
        """The datacenter of `device`."""
        return self.machine(device).datacenter

    def rail_nic(self, device: str) -> str | None:
        """The NIC on `device`'s own rail (behind its PCIe port), or None."""
        m = self.machine(device)
        port = m.ports.get(device)
        for k, g in m.rail_gpu.items():
            if g == device and port is not None and self.graph.has_edge(port, m.nics[k]):
                return m.nics[k]
        return None

    def to_host(self, device: str) -> tuple[str, ...]:
        """Vertices from `device` up to its host memory (through its PCIe port)."""
        m = self.machine(device)
        port = m.ports.get(device)
        if device == m.host:
            return (device,)
        return (device, port, m.host) if port is not None else (device, m.host)

    def rail_of(self, device: str) -> int:
        """The NIC index on the device's rail (0 for hosts and rail-less GPUs)."""
        m = self.machine(device)
        for k, g in m.rail_gpu.items():
            if g == device:
                return k
        return 0

    def oversubscribed(self, leaf: str | None) -> bool:
        """True when `leaf` has less bandwidth to the spine than its NICs have to it."""
        if leaf is None or leaf not in self.uplink:
            return False
        return self.uplink[leaf] < self.downlink.get(leaf, 0.0) * (1 - 1e-9)

    # --- routes -------------------------------------------------------------------
    def route(self, src: str, dst: str, *, egress: int | None = None,
              ingress: int | None = None, wan: tuple[str, ...] | None = None
              ) -> tuple[str, ...] | None:
        """Vertices from device `src` to device `dst`, or None when there is no route.

        `egress` / `ingress` pick the NIC index used to leave `src`'s node and to
        enter `dst`'s node (default: each device's own rail); `wan` the WAN gateways
        from `src`'s datacenter to `dst`'s (default: the fewest hops).
        """
        g = self.graph
        if g.has_edge(src, dst):
            return (src, dst)
        ms, md = self.machine(src), self.machine(dst)
        if ms.nvswitch is not None and ms.nvswitch == md.nvswitch and src in ms.gpus \
                and dst in md.gpus:
            return (src, ms.nvswitch, dst)
        if ms is md:
            return dedupe(self.to_host(src) + tuple(reversed(self.to_host(dst))))
        if not ms.nics or not md.nics or ms.leaf is None or md.leaf is None:
            return None
        nic_s = ms.nics[(self.rail_of(src) if egress is None else egress) % len(ms.nics)]
        nic_d = md.nics[(self.rail_of(dst) if ingress is None else ingress) % len(md.nics)]
        middle = self._network(ms, md, wan)
        if middle is None:
            return None
        return dedupe(self.to_nic(ms, src, nic_s) + (ms.leaf,) + middle + (md.leaf,)
                       + tuple(reversed(self.to_nic(md, dst, nic_d))))

    def via_spine(self, src: str | None, dst: str | None, dc: str,
                  vertex: str) -> tuple[str, ...] | None:
        """Route between a device and `vertex` hanging off datacenter `dc`'s spine.

        Route between a device and `vertex` hanging off datacenter `dc`'s spine (a storage
        service, say): ``src -> ... -> spine -> vertex`` when `src` is given, else ``vertex
        -> spine -> ... -> dst``.
        """
        device = src if src is not None else dst
        if device is None:
            raise ValueError("via_spine: give the source or the destination device")
        m = self.machine(device)
        if not m.nics or m.leaf is None:
            return None
        spine = f"{dc}/spine"
        if m.datacenter == dc:
            middle: tuple[str, ...] = (spine,)
        else:
            fake = Machine("", dc, "", leaf=spine)
            network = self._network(m, fake)
            if network is None:
                return None
            middle = network[:-1] + (spine,)
        half = self.to_nic(m, device, m.nics[self.rail_of(device) % len(m.nics)])
        out = half + (m.leaf,) + middle + (vertex,)
        return dedupe(out if src is not None else tuple(reversed(out)))

    def to_nic(self, m: Machine, device: str, nic: str) -> tuple[str, ...]:
        """Vertices from `device` of machine `m` to its `nic`.

        Through the device's PCIe port on the NIC's rail, else over NVLink to the rail's
        GPU, else through the host.
        """
        g = self.graph
        port = m.ports.get(device)
        if port is not None and g.has_edge(port, nic):
            return (device, port, nic)
        if g.has_edge(device, nic):  # a host that links to the NIC directly
            return (device, nic)
        rail = self.rail_gpu_of_nic(m, nic)
        if rail is not None and m.nvswitch is not None and device in m.gpus:
            return (device, m.nvswitch, rail, m.ports[rail], nic)
        if rail is not None and g.has_edge(device, rail):
            return (device, rail, m.ports[rail], nic)
        down = (m.ports[rail],) if rail is not None else ()
        return dedupe(self.to_host(device) + down + (nic,))

    def rail_gpu_of_nic(self, m: Machine, nic: str) -> str | None:
        """The GPU on NIC `nic`'s rail in `m`, if any."""
        return m.rail_gpu.get(m.nics.index(nic))

    def _network(self, ms: Machine, md: Machine,
                 wan: tuple[str, ...] | None = None) -> tuple[str, ...] | None:
        if ms.leaf == md.leaf:
            return ()
        sa, sb = f"{ms.datacenter}/spine", f"{md.datacenter}/spine"
        if ms.datacenter == md.datacenter:
            return (sa,)
        wa, wb = f"{ms.datacenter}/wan", f"{md.datacenter}/wan"
        if wan is not None:
            assert wan[0] == wa and wan[-1] == wb, (wan, wa, wb)
            return (sa, *wan, sb)
        if wa not in self._wan or wb not in self._wan:
            return None
        try:
            hops = nx.shortest_path(self._wan, wa, wb)
        except nx.NetworkXNoPath:
            return None
        return (sa, *hops, sb)

    def wan_trees(self, roots: set[str], needed: set[str], *, most: int) -> list[WanTree]:
        """Trees over the datacenters that carry a stripe from `roots` to `needed`.

        Their widths add up to the WAN's broadcast rate (`topology.wan.wan_trees`), up to
        `most` trees; computed once per (roots, needed, most).
        """
        key = (frozenset(roots), frozenset(needed), most)
        if key not in self._wan_trees:
            self._wan_trees[key] = wan_trees(self.wan, roots, needed, most=most)
        return self._wan_trees[key]


def dedupe(path: tuple[str, ...]) -> tuple[str, ...]:
    """`path` without consecutive repeats (a device that is its own host, say)."""
    out: list[str] = []
    for v in path:
        if not out or out[-1] != v:
            out.append(v)
    return tuple(out)
