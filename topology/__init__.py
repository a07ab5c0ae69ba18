"""Cluster topology: YAML descriptions, their graph, and discovery of the local machine.

Public API:
    load_cluster(path) / loads_cluster(text)  -> Cluster (validated)
    Cluster.graph()                           -> networkx.DiGraph
    Cluster.to_yaml()                         -> YAML text that loads back equal
    reference_cluster(name), reference_clusters()
"""

from weightfabric.topology.errors import ClusterConfigError
from weightfabric.topology.loader import cluster_from_dict, load_cluster, loads_cluster
from weightfabric.topology.references import reference_cluster, reference_clusters
from weightfabric.topology.schema import Cluster, Node, NodeType

__all__ = [
    "Cluster",
    "ClusterConfigError",
    "Node",
    "NodeType",
    "cluster_from_dict",
    "load_cluster",
    "loads_cluster",
    "reference_cluster",
    "reference_clusters",
]
