"""Counts and link tiers of a cluster, for `fabric topo show` and reports."""

from __future__ import annotations

from typing import Any

from weightfabric.topology.schema import Cluster


def summarize(cluster: Cluster) -> dict[str, Any]:
    """A JSON-ready summary: totals, per-datacenter counts, and bandwidth per link tier.

    Keys: ``name``, ``datacenters``, ``nodes``, ``gpus``, ``nics`` (totals),
    ``per_datacenter`` (list of {name, nodes, gpus, nics, oversubscription}),
    ``tiers`` ({tier: sorted distinct bandwidths in bytes/s}) and ``wan``
    (list of {between, bandwidth, latency}).
    """
    nodes = cluster.nodes()
    per_dc = []
    for dc in cluster.datacenters:
        members = [n for n in nodes if n.datacenter == dc.name]
        per_dc.append({
            "name": dc.name,
            "nodes": len(members),
            "gpus": sum(n.type.gpus for n in members),
            "nics": sum(n.type.nics.count for n in members if n.type.nics),
            "oversubscription": dc.network.oversubscription,
        })
    tiers: dict[str, set[float]] = {"nvlink": set(), "pcie": set(), "nic": set(), "wan": set()}
    for node in nodes:
        t = node.type
        if t.nvlink:
            tiers["nvlink"].add(t.nvlink.bandwidth)
        if t.pcie:
            tiers["pcie"].add(t.pcie.bandwidth)
        if t.nics:
            tiers["nic"].add(t.nics.bandwidth)
    tiers["wan"] = {w.bandwidth for w in cluster.wan}
    return {
        "name": cluster.name,
        "datacenters": len(cluster.datacenters),
        "nodes": len(nodes),
        "gpus": sum(d["gpus"] for d in per_dc),
        "nics": sum(d["nics"] for d in per_dc),
        "per_datacenter": per_dc,
        "tiers": {tier: sorted(values) for tier, values in tiers.items() if values},
        "wan": [{"between": list(w.between), "bandwidth": w.bandwidth, "latency": w.latency}
                for w in cluster.wan],
    }
