"""The cluster graph: vertices, link tiers, rails, NVLink domains, WAN."""

from itertools import pairwise

import networkx as nx
import pytest
from paths import FIXTURES

from weightfabric.topology import load_cluster, loads_cluster, reference_cluster

EXAMPLE = FIXTURES / "clusters" / "contract-example.yaml"


@pytest.fixture(scope="module")
def example():
    return load_cluster(EXAMPLE).graph()


def kinds(g: nx.DiGraph) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, kind in g.nodes(data="kind"):
        out[kind] = out.get(kind, 0) + 1
    return out


def test_every_link_is_two_arcs_with_bandwidth_latency_and_tier(example):
    for a, b, data in example.edges(data=True):
        assert example.has_edge(b, a)
        assert example[b][a] == data
        assert data["bandwidth"] > 0 and data["latency"] >= 0
        assert data["tier"] in {"nvlink", "pcie", "nic", "network", "wan"}


def test_vertex_counts_match_the_description(example):
    counts = kinds(example)
    assert counts["gpu"] == 35 * 8
    assert counts["pcie"] == 35 * 8  # one PCIe port per GPU
    assert counts["nic"] == 35 * 8
    assert counts["host"] == 35
    # 17 per-node NVSwitches in dc-a, one shared switch for the rack-0 domain in dc-b
    assert counts["nvswitch"] == 17 + 1
    assert counts["spine"] == 2 and counts["wan"] == 2


def test_rails_pair_gpu_i_with_nic_i_on_a_dgx(example):
    for j in range(8):
        gpu, port = f"a-0/gpu{j}", f"a-0/pcie{j}"
        pcie = [v for v in example.successors(gpu) if example[gpu][v]["tier"] == "pcie"]
        assert pcie == [port]  # the GPU's one x16 port
        nics = {v for v in example.successors(port) if example.nodes[v]["kind"] == "nic"}
        assert nics == {f"a-0/nic{j}"}
        assert example[port][f"a-0/nic{j}"]["bandwidth"] == 64e9
        assert example.has_edge(port, "a-0/host") and not example.has_edge(gpu, "a-0/host")


def test_host_and_nic_traffic_of_a_gpu_share_its_pcie_port():
    g = reference_cluster("dgx-h100").graph()
    # the host and every NIC together feed GPU 3 over PCIe at one port's rate
    g.add_node("src")
    g.add_edge("src", "dgx/host", bandwidth=float("inf"))
    for k in range(8):
        g.add_edge("src", f"dgx/nic{k}", bandwidth=float("inf"))
    g.remove_node("dgx/nvswitch")
    assert nx.maximum_flow_value(g, "src", "dgx/gpu3", capacity="bandwidth") == \
        pytest.approx(64e9)
    # PCIe latency is split over the port's two sides: one PCIe latency per crossing
    lat = nx.shortest_path_length(g, "dgx/gpu3", "dgx/nic3", weight="latency")
    assert lat == pytest.approx(g["dgx/gpu3"]["dgx/pcie3"]["latency"] * 2)


def test_nic_links_carry_nic_bandwidth_and_latency(example):
    arc = example["a-0/nic3"]["dc-a/leaf0"]
    assert arc["bandwidth"] == 50e9 and arc["latency"] == 5e-6 and arc["tier"] == "nic"


def test_nvlink_domain_joins_nodes_over_one_switch(example):
    path = nx.shortest_path(example, "b-0/gpu0", "b-17/gpu5")
    assert path == ["b-0/gpu0", "nvdomain/rack-0", "b-17/gpu5"]
    assert example["b-0/gpu0"]["nvdomain/rack-0"]["bandwidth"] == 450e9


def test_nodes_without_a_shared_domain_cross_the_network(example):
    path = nx.shortest_path(example, "a-0/gpu0", "a-1/gpu0")
    tiers = [example[u][v]["tier"] for u, v in pairwise(path)]
    assert "nic" in tiers and "nvlink" not in tiers


def test_wan_joins_the_datacenters_once(example):
    assert example["dc-a/wan"]["dc-b/wan"]["bandwidth"] == 12.5e9
    assert example["dc-a/wan"]["dc-b/wan"]["latency"] == 0.02
    flow = nx.maximum_flow_value(example, "trainer/gpu0", "b-3/gpu0", capacity="bandwidth")
    assert flow == pytest.approx(12.5e9)


def test_max_flow_to_a_gpu_is_bounded_by_its_links():
    g = reference_cluster("4x-dgx-h100").graph()
    # from every GPU of node-0 into one GPU of node-1: its PCIe (64) + NVLink (450) ingress
    g.add_node("src")
    for j in range(8):
        g.add_edge("src", f"node-0/gpu{j}", bandwidth=float("inf"))
    flow = nx.maximum_flow_value(g, "src", "node-1/gpu0", capacity="bandwidth")
    assert flow == pytest.approx(8 * 50e9)  # all 8 rails of node-1 can feed it over NVLink
    g.remove_node("node-1/nvswitch")  # without NVLink: the GPU's one PCIe port
    flow = nx.maximum_flow_value(g, "src", "node-1/gpu0", capacity="bandwidth")
    assert flow == pytest.approx(64e9)


def test_oversubscription_shrinks_leaf_uplinks():
    g = reference_cluster("heterogeneous").graph()
    uplink = g["rollout-dc/leaf0"]["rollout-dc/spine"]
    assert uplink["bandwidth"] == pytest.approx(4 * 2 * 25e9 / 3.0)  # 4 nodes x 2 NICs / 3:1


def test_nvlink_groups_link_only_bridged_pairs():
    c = loads_cluster("""
version: 1
name: bridged
node_types:
  box:
    gpus: 4
    gpu: {model: A100-PCIe}
    nvlink: {bandwidth: 100GB/s, groups: [[0, 1], [2, 3]]}
    pcie: {bandwidth: 32GB/s}
datacenters:
  - name: dc
    nodes: [{name: n, type: box}]
""")
    g = c.graph()
    assert g.has_edge("n/gpu0", "n/gpu1") and g["n/gpu0"]["n/gpu1"]["tier"] == "nvlink"
    assert not g.has_edge("n/gpu0", "n/gpu2")
    assert "n/nvswitch" not in g


def test_cpu_only_localhost_has_a_host_and_a_nic():
    g = reference_cluster("localhost").graph()
    assert kinds(g) == {"host": 1, "nic": 1, "leaf": 1, "spine": 1}


def test_gpus_without_a_pcie_tier_are_refused_not_linked_at_no_bandwidth():
    # the loader requires pcie when gpus > 0; a NodeType built in code may lack it
    from weightfabric.topology.schema import (
        Cluster,
        Datacenter,
        GpuSpec,
        NicSpec,
        NodeGroup,
        NodeType,
    )

    t = NodeType(name="x", gpus=2, gpu=GpuSpec(model="H100"),
                 nics=NicSpec(count=2, bandwidth=50e9))
    cluster = Cluster(name="c", node_types={"x": t}, datacenters=(
        Datacenter(name="dc", nodes=(NodeGroup(name="n{i}", type="x", count=2),)),))
    with pytest.raises(ValueError, match="no pcie link"):
        cluster.graph()
