"""Large synthetic clusters for benchmarks and scenarios (DGX H100 building blocks)."""

from __future__ import annotations

from typing import Any

from weightfabric.topology.loader import cluster_from_dict
from weightfabric.topology.schema import Cluster

DGX_H100: dict[str, Any] = {
    "gpus": 8,
    "gpu": {"model": "H100-SXM", "memory": "80GB"},
    "nvlink": {"bandwidth": "450GB/s", "latency": "2us"},
    "pcie": {"bandwidth": "64GB/s", "latency": "2us"},
    "nics": {"count": 8, "bandwidth": "400Gbps", "kind": "rdma", "latency": "5us"},
    "host_memory": "2TB",
}


def synthetic_cluster(rollout_nodes: list[int], *, trainer_nodes: int = 1,
                      wan: str = "100Gbps", wan_latency: str = "20ms",
                      oversubscription: float = 1.0, nodes_per_leaf: int = 32) -> Cluster:
    """A cluster of DGX H100 nodes.

    `trainer_nodes` trainers in the first datacenter, ``rollout_nodes[i]`` rollout nodes in
    datacenter ``i``, a WAN link from the first datacenter to each other one.

    Args:
        rollout_nodes (list of int): Rollout node count per datacenter (``[32]``: one
            datacenter, 256 GPUs).
        trainer_nodes (int): Trainer nodes, in the first datacenter.
        wan, wan_latency (str): WAN link bandwidth and one-way latency.
        oversubscription (float): Leaf-to-spine oversubscription in every datacenter.
        nodes_per_leaf (int): Nodes under each leaf switch.

    Returns:
        Cluster: With roles ``trainer`` and ``rollout`` set.

    Raises:
        ValueError: No datacenter, or a negative node count.
    """
    if not rollout_nodes or min(rollout_nodes) < 0 or trainer_nodes < 1:
        raise ValueError("give at least one datacenter, node counts >= 0, trainer_nodes >= 1")
    dcs = []
    for i, count in enumerate(rollout_nodes):
        groups = [{"name": "trainer-{i}", "type": "dgx", "count": trainer_nodes}] if i == 0 else []
        if count:
            groups.append({"name": f"r{i}-{{i}}", "type": "dgx", "count": count})
        dcs.append({"name": f"dc{i}", "network": {"oversubscription": oversubscription,
                                                  "latency": "1us",
                                                  "nodes_per_leaf": nodes_per_leaf},
                    "nodes": groups})
    data: dict[str, Any] = {
        "version": 1, "name": f"synthetic-{sum(rollout_nodes) * 8}",
        "node_types": {"dgx": DGX_H100}, "datacenters": dcs,
        "roles": {"trainer": ["trainer-*"],
                  "rollout": [f"r{i}-*" for i, c in enumerate(rollout_nodes) if c]},
    }
    if len(rollout_nodes) > 1:
        data["wan"] = [{"between": ["dc0", f"dc{i}"], "bandwidth": wan, "latency": wan_latency}
                       for i in range(1, len(rollout_nodes))]
    return cluster_from_dict(data, source="<synthetic>")
