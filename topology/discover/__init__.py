"""Discovery of the local machine.

`discover()` reads GPUs, NVLink, PCIe, NUMA, NICs and host memory and returns a validated
one-node `Cluster` (what `fabric topo discover` writes).

Sources, in order of preference: NVML (``pynvml`` from nvidia-ml-py) when it imports
and initialises; otherwise ``nvidia-smi --query-gpu`` and ``nvidia-smi topo -m``;
otherwise the node is CPU-only. NICs, NUMA nodes and PCIe links come from /sys,
host memory from /proc/meminfo. Modules: `base` (records and bandwidth tables),
`nvml`, `smi`, `sysfs` (one per source) and `assemble` (building the cluster).
"""

from weightfabric.topology.discover.assemble import Discovered, discover, nvlink_groups, run_command
from weightfabric.topology.discover.base import GpuInfo, NicInfo, NvlinkLinks, pcie_bandwidth
from weightfabric.topology.discover.smi import (
    SmiParseError,
    TopoMatrix,
    parse_query_gpu,
    parse_topo_matrix,
)

__all__ = [
    "Discovered",
    "GpuInfo",
    "NicInfo",
    "NvlinkLinks",
    "SmiParseError",
    "TopoMatrix",
    "discover",
    "nvlink_groups",
    "parse_query_gpu",
    "parse_topo_matrix",
    "pcie_bandwidth",
    "run_command",
]
