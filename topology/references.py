"""Reference cluster descriptions shipped with the package (``topology/clusters``)."""

from __future__ import annotations

from pathlib import Path

from weightfabric.topology.loader import load_cluster
from weightfabric.topology.schema import Cluster

CLUSTERS_DIR = Path(__file__).parent / "clusters"


def reference_clusters() -> dict[str, Path]:
    """Name (file stem) to path of every shipped reference cluster."""
    return {p.stem: p for p in sorted(CLUSTERS_DIR.glob("*.yaml"))}


def reference_cluster(name: str) -> Cluster:
    """Load a shipped reference cluster by name, e.g. ``reference_cluster("dgx-h100")``."""
    paths = reference_clusters()
    if name not in paths:
        raise KeyError(f"no reference cluster {name!r}; shipped: {', '.join(paths)}")
    return load_cluster(paths[name])
