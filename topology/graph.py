"""A cluster as a directed, capacitated graph.

Vertices (``kind`` attribute), named so they are unique in the cluster:

==============  =====================  ===============================================
kind            name                   what
==============  =====================  ===============================================
``gpu``         ``{node}/gpu{j}``      GPU j of a node
``pcie``        ``{node}/pcie{j}``     the PCIe switch GPU j sits behind, seen from its
                                       x16 port: GPU j reaches the host and its rail NICs
                                       only through it
``host``        ``{node}/host``        the node's host memory (the endpoint of CPU workers)
``nic``         ``{node}/nic{k}``      NIC k of a node
``nvswitch``    ``{node}/nvswitch``    the NVSwitch of a node (or ``nvdomain/{domain}``
                                       shared by the nodes of one ``nvlink_domain``)
``leaf``        ``{dc}/leaf{k}``       a datacenter leaf switch (``nodes_per_leaf`` nodes)
``spine``       ``{dc}/spine``         the datacenter's spine
``wan``         ``{dc}/wan``           the datacenter's WAN gateway
==============  =====================  ===============================================

Every physical link becomes two arcs, one per direction, with ``bandwidth``
(bytes/s, per direction), ``latency`` (seconds) and ``tier`` (``nvlink``, ``pcie``,
``nic``, ``network``, ``wan``). Vertex attributes: ``kind``, ``node`` and
``datacenter`` where they apply, ``index`` for GPUs, PCIe ports and NICs, ``gpu`` for
PCIe ports, ``numa`` where known.

Edges:
- GPU <-> NVSwitch at the NVLink bandwidth (or GPU <-> GPU within ``nvlink.groups``);
- GPU <-> its PCIe port at the PCIe bandwidth: the GPU's one x16 link, so its traffic
  to the host and to its NICs share it (per direction);
- PCIe port <-> host (the switch's uplink) and PCIe port <-> each NIC of the GPU's
  rail at the PCIe bandwidth; a NIC of a node without GPUs links to the host
  directly. PCIe latency is split evenly between the port's two sides, so that
  GPU -> NIC, GPU -> host and NIC -> host each cost one PCIe latency;
- NIC <-> leaf at the NIC bandwidth and latency;
- leaf <-> spine at (sum of the leaf's NIC bandwidth) / oversubscription;
- spine <-> WAN gateway at the sum of the datacenter's WAN bandwidth (never the
  bottleneck), and gateway <-> gateway at the WAN link's bandwidth and latency.
"""

from __future__ import annotations

import networkx as nx

from weightfabric.topology.schema import Cluster, Node


def gpu_vertex(node: str, index: int) -> str:
    """The vertex of GPU `index` of `node`."""
    return f"{node}/gpu{index}"


def nic_vertex(node: str, index: int) -> str:
    """The vertex of NIC `index` of `node`."""
    return f"{node}/nic{index}"


def pcie_vertex(node: str, index: int) -> str:
    """The vertex of PCIe port `index` of `node`."""
    return f"{node}/pcie{index}"


def host_vertex(node: str) -> str:
    """The host vertex of `node`."""
    return f"{node}/host"


def _link(g: nx.DiGraph, a: str, b: str, *, bandwidth: float, latency: float, tier: str) -> None:
    g.add_edge(a, b, bandwidth=bandwidth, latency=latency, tier=tier)
    g.add_edge(b, a, bandwidth=bandwidth, latency=latency, tier=tier)


def _port_bandwidth(node: Node) -> float:
    """The PCIe bandwidth of each GPU port of `node`.

    The PCIe bandwidth of each GPU port of `node` (the schema requires a pcie tier when a
    node type has GPUs; the loader checks it).
    """
    t = node.type
    if t.pcie is None:
        raise ValueError(f"node {node.name!r}: node type {t.name!r} has {t.gpus} GPUs "
                         "but no pcie link")
    return t.pcie.bandwidth


def _add_node(g: nx.DiGraph, node: Node, leaf: str) -> float:
    """Add one machine's vertices and links; return its total NIC bandwidth."""
    t = node.type
    common = {"node": node.name, "datacenter": node.datacenter}
    host = host_vertex(node.name)
    g.add_node(host, kind="host", memory=t.host_memory, **common)
    pcie_bw = t.pcie.bandwidth if t.pcie else None
    pcie_lat = t.pcie.latency if t.pcie else 0.0
    port_bw = _port_bandwidth(node) if t.gpus else 0.0  # each GPU's PCIe port
    gpu_numa = t.numa.gpus if t.numa else ()
    nic_numa = t.numa.nics if t.numa else ()

    half = pcie_lat / 2
    for j in range(t.gpus):
        gpu, port = gpu_vertex(node.name, j), pcie_vertex(node.name, j)
        numa = gpu_numa[j] if gpu_numa else None
        g.add_node(gpu, kind="gpu", index=j, model=t.gpu.model if t.gpu else None,
                   memory=t.gpu.memory if t.gpu else None, numa=numa, **common)
        g.add_node(port, kind="pcie", index=j, gpu=gpu, numa=numa, **common)
        _link(g, gpu, port, bandwidth=port_bw, latency=half, tier="pcie")
        _link(g, port, host, bandwidth=port_bw, latency=half, tier="pcie")

    if t.nvlink is not None:
        nv = t.nvlink
        if nv.groups is not None:
            for group in nv.groups:
                for a in group:
                    for b in group:
                        if a < b:
                            _link(g, gpu_vertex(node.name, a), gpu_vertex(node.name, b),
                                  bandwidth=nv.bandwidth, latency=nv.latency, tier="nvlink")
        else:
            switch = (f"nvdomain/{node.nvlink_domain}" if node.nvlink_domain
                      else f"{node.name}/nvswitch")
            g.add_node(switch, kind="nvswitch", domain=node.nvlink_domain,
                       **({} if node.nvlink_domain else common))
            for j in range(t.gpus):
                _link(g, gpu_vertex(node.name, j), switch, bandwidth=nv.bandwidth,
                      latency=nv.latency, tier="nvlink")

    if t.nics is None:
        return 0.0
    nics = t.nics
    for k in range(nics.count):
        nic = nic_vertex(node.name, k)
        g.add_node(nic, kind="nic", index=k, nic_kind=nics.kind,
                   device=nics.names[k] if nics.names else None,
                   numa=nic_numa[k] if nic_numa else None, **common)
        if not t.gpus:
            _link(g, nic, host, bandwidth=pcie_bw or nics.bandwidth, latency=pcie_lat,
                  tier="pcie")
        _link(g, nic, leaf, bandwidth=nics.bandwidth, latency=nics.latency, tier="nic")
    for j, k in nics.rails(t.gpus):
        _link(g, pcie_vertex(node.name, j), nic_vertex(node.name, k), bandwidth=port_bw,
              latency=half, tier="pcie")
    return nics.count * nics.bandwidth


def build_graph(cluster: Cluster) -> nx.DiGraph:
    """Build the `networkx.DiGraph` of `cluster` (see the module docstring)."""
    g = nx.DiGraph(name=cluster.name)
    nodes_by_dc: dict[str, list[Node]] = {dc.name: [] for dc in cluster.datacenters}
    for node in cluster.nodes():
        nodes_by_dc[node.datacenter].append(node)

    for dc in cluster.datacenters:
        net = dc.network
        spine = f"{dc.name}/spine"
        g.add_node(spine, kind="spine", datacenter=dc.name)
        members = nodes_by_dc[dc.name]
        for first in range(0, len(members), net.nodes_per_leaf):
            leaf = f"{dc.name}/leaf{first // net.nodes_per_leaf}"
            g.add_node(leaf, kind="leaf", datacenter=dc.name)
            uplink = sum(_add_node(g, node, leaf)
                         for node in members[first:first + net.nodes_per_leaf])
            if uplink > 0:
                _link(g, leaf, spine, bandwidth=uplink / net.oversubscription,
                      latency=net.latency, tier="network")
            else:  # no NICs under this leaf: nothing can cross it
                g.remove_node(leaf)

    for link in cluster.wan:
        for name in link.between:
            gateway = f"{name}/wan"
            if gateway not in g:
                g.add_node(gateway, kind="wan", datacenter=name)
                total = sum(w.bandwidth for w in cluster.wan if name in w.between)
                _link(g, gateway, f"{name}/spine", bandwidth=total, latency=0.0, tier="network")
        a, b = (f"{name}/wan" for name in link.between)
        _link(g, a, b, bandwidth=link.bandwidth, latency=link.latency, tier="wan")
    return g
