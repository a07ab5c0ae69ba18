"""Discovery of the local machine.

The nvidia-smi parsers on captured real output, /sys readers on fake trees, a fake NVML, the
CPU-only path, this machine, and the CLI.

Fixtures in tests/fixtures/discover/, each the verbatim output of a real machine
(the command's output only, without the shell prompt around it):

- topo_h200_nv18_12nic.txt and query_gpu_h200.csv: an 8x H200 HGX node (NV18 through
  NVSwitch, 12 ConnectX NICs, NIC Legend). From github.com/fuhengwu2021/distributedai,
  file 2-gpu-hardware-networking-and-parallelism-strategies.md ("nvidia-smi topo -m"
  and "nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max
  --format=csv" sections).
- topo_a100_pcie_nv3_bridges.txt: 4x A100 PCIe joined in pairs by NVLink bridges
  (NV3), 4 mlx5 columns, NUMA nodes 0 and 8 (Princeton "Traverse"). From
  github.com/jdh4/della-gpu-A100, README.md ("Traverse for reference").
- topo_dgx1_v100_hybrid_mesh.txt: DGX-1 with 8x V100 in the hybrid cube mesh (NV1/NV2,
  not every pair linked), 4 mlx5 columns, old legend without NUMA Affinity. From
  github.com/microsoft/msccl-tools, tests/test_topologies.py (test_nvlink_only).
- topo_rtx4090_pcie_only.txt: 8x RTX 4090, PCIe only (SYS everywhere), NIC0/NIC1 without
  a legend. From https://github.com/NVIDIA/go-gpuallocator/issues/17 (first post).
- topo_h200_1gpu_vm.txt and discovered_h200_1gpu_vm.yaml: one H200 (143771 MiB) in a
  16-core Firecracker VM, no NVLink and no NIC column, the header underlined with the
  ANSI escapes nvidia-smi prints (ESC[4m ... ESC[0m), kept byte for byte; and what
  `fabric topo discover` wrote there (through NVML). Captured by `tools/gpu/session.sh
  quick` on a lent machine, 2026-11-26 (driver 580.159.04).

The --query-gpu CSVs for the A100, V100 and 4090 machines below are written for the
test (their sources publish only the matrix); the model names are as nvidia-smi prints them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from paths import FIXTURES as ALL_FIXTURES
from paths import ROOT

from weightfabric.topology import ClusterConfigError, load_cluster, loads_cluster
from weightfabric.topology.discover import (
    SmiParseError,
    discover,
    nvlink_groups,
    parse_query_gpu,
    parse_topo_matrix,
    pcie_bandwidth,
)
from weightfabric.topology.discover.base import normalize_bus_id
from weightfabric.topology.discover.smi import nvlink_from_counts, probe_smi
from weightfabric.topology.discover.sysfs import host_memory, pci_link, read_nics

FIXTURES = ALL_FIXTURES / "discover"


def gb(value: float) -> float:
    """`value` GB in bytes, exactly as the discovery rounds (whole bytes)."""
    return float(round(value * 1e9))


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- fake /sys trees and command runners ---------------------------------------------

def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def ib_device(root: Path, name: str, *, rate: str = "400 Gb/sec (4X NDR)", state: str = "4: ACTIVE",
              layer: str = "InfiniBand", numa: int = 0, netdevs: Sequence[str] = ()) -> None:
    base = f"sys/class/infiniband/{name}"
    write(root, f"{base}/ports/1/rate", rate)
    write(root, f"{base}/ports/1/state", state)
    write(root, f"{base}/ports/1/link_layer", layer)
    write(root, f"{base}/device/numa_node", str(numa))
    for dev in netdevs:
        (root / base / "device" / "net" / dev).mkdir(parents=True)


def net_iface(root: Path, name: str, *, speed: str | None = None, device: bool = True,
              numa: int | None = None, operstate: str = "up") -> None:
    base = root / "sys" / "class" / "net" / name
    base.mkdir(parents=True)
    write(root, f"sys/class/net/{name}/operstate", operstate)
    if speed is not None:
        write(root, f"sys/class/net/{name}/speed", speed)
    if device:
        (base / "device").mkdir()
        if numa is not None:
            write(root, f"sys/class/net/{name}/device/numa_node", str(numa))


def meminfo(root: Path, kib: int) -> None:
    write(root, "proc/meminfo", f"MemTotal:       {kib} kB\nMemFree:        1024 kB")


def smi_runner(query_csv: str, topo: str, *, old_driver: bool = False):
    """Replays nvidia-smi; `old_driver` rejects the compute_cap field like drivers before 510."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        if argv[1].startswith("--query-gpu"):
            if old_driver and "compute_cap" in argv[1]:
                raise subprocess.CalledProcessError(2, list(argv), "", 'Field "compute_cap" is not valid')
            return query_csv
        if list(argv[1:3]) == ["topo", "-m"]:
            return topo
        raise AssertionError(f"unexpected command {argv}")

    run.calls = calls  # type: ignore[attr-defined]
    return run


def no_smi(argv: Sequence[str]) -> str:
    raise FileNotFoundError(2, "No such file or directory", argv[0])


def query_csv(model: str, count: int, memory_mib: int, gen: int, width: int) -> str:
    header = "index, name, memory.total [MiB], pci.bus_id, pcie.link.gen.max, pcie.link.width.max"
    rows = [f"{i}, {model}, {memory_mib} MiB, 00000000:{0x18 + i:02X}:00.0, {gen}, {width}"
            for i in range(count)]
    return "\n".join([header, *rows]) + "\n"


TODAY = dt.date(2025, 1, 2)


# --- nvidia-smi topo -m on captured output -------------------------------------------

def test_topo_matrix_of_h200_node_has_nv18_everywhere_and_twelve_named_nics():
    m = parse_topo_matrix(fixture("topo_h200_nv18_12nic.txt"))
    assert m.gpus == tuple(f"GPU{i}" for i in range(8))
    assert m.nics == tuple(f"mlx5_{i}" for i in range(12))
    counts = m.nvlink_counts()
    assert all(counts[i][j] == (0 if i == j else 18) for i in range(8) for j in range(8))
    assert m.cpu_affinity == ("0-55,112-167",) * 4 + ("56-111,168-223",) * 4
    assert m.numa_affinity == (0, 0, 0, 0, 1, 1, 1, 1)
    assert m.path("GPU0", "mlx5_0") == "PXB"
    assert m.path("mlx5_1", "mlx5_2") == "PIX"
    assert m.path("GPU0", "mlx5_6") == "SYS"
    assert [m.nearest_nics(g) for g in range(8)] == [
        ["mlx5_0"], ["mlx5_3"], ["mlx5_4"], ["mlx5_5"], ["mlx5_6"], ["mlx5_9"], ["mlx5_10"], ["mlx5_11"]]


def test_topo_matrix_of_a100_pcie_has_bridged_pairs_and_numa_0_and_8():
    m = parse_topo_matrix(fixture("topo_a100_pcie_nv3_bridges.txt"))
    assert m.gpus == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert m.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert m.nvlink_counts() == [[0, 3, 0, 0], [3, 0, 0, 0], [0, 0, 0, 3], [0, 0, 3, 0]]
    assert m.numa_affinity == (0, 0, 8, 8)
    assert m.cpu_affinity == ("0-63", "0-63", "64-127", "64-127")
    assert m.path("GPU0", "GPU2") == "SYS"
    assert m.path("GPU2", "mlx5_2") == "NODE"
    assert m.nearest_nics(0) == []


def test_topo_matrix_of_dgx1_reads_the_old_legend_without_numa_column():
    m = parse_topo_matrix(fixture("topo_dgx1_v100_hybrid_mesh.txt"))
    assert len(m.gpus) == 8
    assert m.nics == ("mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3")  # column order as printed
    counts = m.nvlink_counts()
    assert counts[0] == [0, 1, 1, 2, 2, 0, 0, 0]
    assert counts[5] == [0, 2, 0, 0, 1, 0, 2, 1]
    assert all(sum(row) == 6 for row in counts)  # V100: 6 links per GPU, all direct
    assert counts == [list(col) for col in zip(*counts, strict=True)]  # symmetric
    assert m.numa_affinity == (None,) * 8
    assert m.cpu_affinity == ("0-19,40-59",) * 4 + ("20-39,60-79",) * 4
    assert m.nearest_nics(0) == ["mlx5_0"] and m.nearest_nics(7) == ["mlx5_3"]
    assert m.path("mlx5_0", "GPU2") == "PHB"


def test_topo_matrix_of_pcie_only_box_has_no_nvlink_and_keeps_nic_labels():
    m = parse_topo_matrix(fixture("topo_rtx4090_pcie_only.txt"))
    assert len(m.gpus) == 8 and m.nics == ("NIC0", "NIC1")
    assert not any(any(row) for row in m.nvlink_counts())
    assert m.path("GPU6", "NIC0") == "PHB" and m.path("NIC0", "NIC1") == "PIX"
    assert m.numa_affinity == (0,) * 4 + (1,) * 4
    assert nvlink_from_counts(m.nvlink_counts(), []) is None


def test_topo_matrix_of_one_h200_vm_reads_through_the_ansi_underlined_header():
    text = fixture("topo_h200_1gpu_vm.txt")
    assert text.startswith("\t\x1b[4mGPU0\t") and "GPU NUMA ID\x1b[0m\n" in text  # as captured
    m = parse_topo_matrix(text)
    assert m.gpus == ("GPU0",) and m.nics == ()
    assert m.cells == (("X",),)
    assert m.nvlink_counts() == [[0]]
    assert m.cpu_affinity == ("0-15",) and m.numa_affinity == (0,)
    assert m.path("GPU0", "GPU0") == "X" and m.nearest_nics(0) == []
    assert nvlink_from_counts(m.nvlink_counts(), []) is None


def test_switch_is_told_from_direct_links_by_the_link_count_of_the_generation():
    h200 = parse_query_gpu(fixture("query_gpu_h200.csv"))
    switched = nvlink_from_counts(parse_topo_matrix(fixture("topo_h200_nv18_12nic.txt")).nvlink_counts(), h200)
    assert switched is not None and switched.via_switch
    v100 = parse_query_gpu(query_csv("Tesla V100-SXM2-32GB", 8, 32768, 3, 16))
    direct = nvlink_from_counts(parse_topo_matrix(fixture("topo_dgx1_v100_hybrid_mesh.txt")).nvlink_counts(), v100)
    assert direct is not None and not direct.via_switch


@pytest.mark.parametrize("text, message", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "no GPU0"),
    ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\n", "no row for GPU1"),
    ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \nGPU1\tNV4\t X \t0-7\n", "1 cells for 2 devices"),
])
def test_unreadable_topo_output_raises_a_parse_error(text, message):
    with pytest.raises(SmiParseError, match=message):
        parse_topo_matrix(text)


def test_query_gpu_csv_of_h200_node():
    gpus = parse_query_gpu(fixture("query_gpu_h200.csv"))
    assert len(gpus) == 8 and [g.index for g in gpus] == list(range(8))
    assert {g.model for g in gpus} == {"NVIDIA H200"}
    assert gpus[0].memory == 143771 * 2**20
    assert (gpus[0].pcie_gen, gpus[0].pcie_width, gpus[0].bus_id) == (5, 16, None)
    assert gpus[0].compute_capability == (9, 0)  # from the model name: no compute_cap column


def test_query_gpu_reads_missing_values_and_compute_cap():
    text = ("index, name, memory.total [MiB], pci.bus_id, pcie.link.gen.max, compute_cap\n"
            "0, NVIDIA B200, 183359 MiB, 00000000:1B:00.0, [N/A], 10.0\n")
    (gpu,) = parse_query_gpu(text)
    assert gpu.pcie_gen is None and gpu.compute_capability == (10, 0)
    assert gpu.bus_id == "00000000:1B:00.0" and normalize_bus_id(gpu.bus_id) == "0000:1b:00.0"
    with pytest.raises(SmiParseError, match="no 'name' column"):
        parse_query_gpu("index, memory.total [MiB]\n0, 100 MiB\n")


# --- whole discovery through nvidia-smi ----------------------------------------------

def test_h200_node_through_nvidia_smi(tmp_path):
    compute = {0, 3, 4, 5, 6, 9, 10, 11}  # the NICs the matrix puts next to a GPU (PXB)
    for i in range(12):  # 8 compute NICs at NDR, 4 others at HDR
        ib_device(tmp_path, f"mlx5_{i}", rate="400 Gb/sec (4X NDR)" if i in compute else "200 Gb/sec (4X HDR)",
                  numa=0 if i < 6 else 1)
    net_iface(tmp_path, "eno1", speed="1000")
    meminfo(tmp_path, 2_113_540_000)  # ~2.16 TB
    run = smi_runner(fixture("query_gpu_h200.csv"), fixture("topo_h200_nv18_12nic.txt"), old_driver=True)
    found = discover(name="h200-0", sys_root=tmp_path, run=run, nvml=None, today=TODAY)

    node = found.cluster.node("h200-0").type
    assert node.gpus == 8 and node.gpu is not None and node.gpu.model == "H200"
    assert node.gpu.memory == gb(150.8)  # 143771 MiB, rounded to 0.1 GB
    assert node.nvlink is not None and node.nvlink.groups is None
    assert node.nvlink.bandwidth == gb(450)  # 18 links x 25 GB/s
    assert node.pcie is not None and node.pcie.bandwidth == gb(64)
    assert node.nics is not None and (node.nics.count, node.nics.kind) == (8, "rdma")
    assert node.nics.bandwidth == gb(50)
    assert node.nics.names == ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9",
                               "mlx5_10", "mlx5_11")
    assert node.numa is not None and node.numa.gpus == (0, 0, 0, 0, 1, 1, 1, 1)
    assert node.numa.nics == (0, 0, 0, 0, 1, 1, 1, 1)
    assert "NICs follow the GPUs' PCIe affinity (nvidia-smi topo -m): rails are aligned" in found.notes
    assert node.host_memory == gb(2164.3)
    assert found.sources[0] == "nvidia-smi"
    assert any("left out: mlx5_1, mlx5_2, mlx5_7, mlx5_8, eno1" in n for n in found.notes)
    assert any("18 links per GPU (through NVSwitch)" in n for n in found.notes)
    assert [c[1].startswith("--query-gpu") for c in run.calls] == [True, True, False]
    assert loads_cluster(found.to_yaml()) == found.cluster
    assert found.summary() == "1 node, 8 GPUs (H200), 8 NICs, 2.16 TB host memory"


def test_a100_bridged_pairs_become_nvlink_groups(tmp_path):
    meminfo(tmp_path, 512 * 2**20)
    for i in range(4):
        ib_device(tmp_path, f"mlx5_{i}", rate="100 Gb/sec (4X EDR)", numa=0 if i < 2 else 8)
    run = smi_runner(query_csv("NVIDIA A100-PCIE-40GB", 4, 40960, 4, 16),
                     fixture("topo_a100_pcie_nv3_bridges.txt"))
    found = discover(name="traverse", sys_root=tmp_path, run=run, nvml=None, today=TODAY)
    node = found.cluster.node("traverse").type
    assert node.nvlink is not None and node.nvlink.groups == ((0, 1), (2, 3))
    assert node.nvlink.bandwidth == gb(75)  # NV3 x 25 GB/s (NVLink 3)
    assert node.pcie is not None and node.pcie.bandwidth == gb(32)
    assert node.numa is not None and node.numa.gpus == (0, 0, 8, 8)
    assert node.nics is not None and node.nics.count == 4 and node.nics.bandwidth == gb(12.5)
    assert not any("PCIe affinity" in n for n in found.notes)  # NICs are NODE-distant: nothing to say
    written = yaml.safe_load(found.to_yaml())["node_types"]["4x-a100-pcie-40gb"]["nvlink"]
    assert written == {"bandwidth": "75GB/s", "latency": "2us", "groups": [[0, 1], [2, 3]]}
    assert loads_cluster(found.to_yaml()) == found.cluster


def test_dgx1_hybrid_mesh_keeps_two_quads_and_notes_the_cross_links(tmp_path):
    meminfo(tmp_path, 512 * 2**20)
    run = smi_runner(query_csv("Tesla V100-SXM2-32GB", 8, 32768, 3, 16),
                     fixture("topo_dgx1_v100_hybrid_mesh.txt"))
    found = discover(name="dgx1", sys_root=tmp_path, run=run, nvml=None, today=TODAY)
    node = found.cluster.node("dgx1").type
    assert node.nvlink is not None and node.nvlink.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert node.nvlink.bandwidth == gb(100)  # 4 links to quad peers x 25 GB/s
    assert node.pcie is not None and node.pcie.bandwidth == gb(16)
    assert any(n.endswith("0-4, 1-5, 2-6, 3-7") for n in found.notes)
    assert node.nics is None and any("nics omitted" in n for n in found.notes)
    assert any("not readable under /sys: mlx5_0, mlx5_1, mlx5_2, mlx5_3" in n for n in found.notes)
    assert loads_cluster(found.to_yaml()) == found.cluster


def test_dgx1_nic_order_against_pcie_affinity(tmp_path):
    for i in range(4):
        ib_device(tmp_path, f"mlx5_{i}", rate="100 Gb/sec (4X EDR)")
    run = smi_runner(query_csv("Tesla V100-SXM2-32GB", 8, 32768, 3, 16),
                     fixture("topo_dgx1_v100_hybrid_mesh.txt"))
    found = discover(name="dgx1", sys_root=tmp_path, run=run, nvml=None)
    # Rails give GPUs 2j, 2j+1 to NIC j of mlx5_0..3, the NIC the matrix shows at PIX: aligned.
    assert any(n.endswith("rails are aligned") for n in found.notes)
    (tmp_path / "sys/class/infiniband/mlx5_1").rename(tmp_path / "sys/class/infiniband/mlx5_9")
    swapped = discover(name="dgx1", sys_root=tmp_path, run=run, nvml=None)
    assert any(n.startswith("NIC order does not follow PCIe affinity") and "GPU2 is next to mlx5_1, not mlx5_2" in n
               for n in swapped.notes)


def test_pcie_only_box_has_no_nvlink(tmp_path):
    run = smi_runner(query_csv("NVIDIA GeForce RTX 4090", 8, 24564, 4, 16),
                     fixture("topo_rtx4090_pcie_only.txt"))
    found = discover(name="box", sys_root=tmp_path, run=run, nvml=None, today=TODAY)
    node = found.cluster.node("box").type
    assert node.gpus == 8 and node.nvlink is None
    assert node.numa is not None and node.numa.gpus == (0, 0, 0, 0, 1, 1, 1, 1)
    assert "nvlink" not in found.to_yaml()


def test_h200_vm_discovered_yaml_loads_and_nvidia_smi_gives_the_same_node(tmp_path):
    captured = load_cluster(FIXTURES / "discovered_h200_1gpu_vm.yaml")  # written through NVML
    node = captured.node("vm").type
    assert node.gpus == 1 and node.gpu is not None and node.gpu.model == "H200"
    assert node.gpu.memory == gb(150.8) and node.host_memory == gb(135.1)
    assert node.nvlink is None and node.pcie is not None and node.pcie.bandwidth == gb(64)
    assert node.nics is not None and (node.nics.count, node.nics.kind) == (1, "tcp")
    assert node.nics.bandwidth == gb(1.25) and node.nics.names == ("eth0",)
    assert loads_cluster(fixture("discovered_h200_1gpu_vm.yaml")) == captured

    # The same machine through nvidia-smi: its captured matrix, a --query-gpu CSV
    # written for the test (Gen5 x16), and /sys as the VM showed it.
    net_iface(tmp_path, "eth0", speed="-1")
    net_iface(tmp_path, "ifb0", device=False)
    net_iface(tmp_path, "ifb1", device=False)
    meminfo(tmp_path, 131_934_000)  # 135.1 GB
    run = smi_runner(query_csv("NVIDIA H200", 1, 143771, 5, 16), fixture("topo_h200_1gpu_vm.txt"))
    found = discover(name="vm", sys_root=tmp_path, run=run, nvml=None, today=TODAY)
    assert found.sources[0] == "nvidia-smi"
    # Only the NUMA section differs: the matrix says NUMA node 0, while NVML's path read
    # the GPU's node from /sys, where the VM gave none.
    smi_node = found.cluster.node("vm").type
    assert smi_node.numa is not None and smi_node.numa.gpus == (0,) and node.numa is None
    assert dataclasses.replace(smi_node, numa=None) == node
    assert found.cluster.roles == captured.roles and found.cluster.name == captured.name
    assert "skipped virtual interfaces (no device): ifb0, ifb1" in found.notes
    assert found.summary() == "1 node, 1 GPU (H200), 1 NIC, 135 GB host memory"


def test_topo_matrix_that_disagrees_with_query_is_not_used(tmp_path):
    run = smi_runner(query_csv("NVIDIA H100 80GB HBM3", 4, 81559, 5, 16),
                     fixture("topo_h200_nv18_12nic.txt"))
    probe = probe_smi(run, [])
    assert probe is not None and probe.nvlink is None and len(probe.gpus) == 4
    assert "shows 8 GPUs but --query-gpu 4" in probe.notes[0]


# --- nvidia-smi output that is odd: discovery degrades, with notes, and stays valid -----

TWO_H100 = "index, name\n0, NVIDIA H100\n1, NVIDIA H100\n"


def odd_smi(tmp_path, query: str, topo: str = "") -> tuple[object, list[str]]:
    """The node discovered from nvidia-smi printing `query` and `topo`; it must load back."""
    found = discover(name="n0", sys_root=tmp_path, run=smi_runner(query, topo), nvml=None,
                     today=TODAY)
    assert loads_cluster(found.to_yaml()) == found.cluster
    return found.cluster.node("n0").type, found.notes


def test_a_warning_line_before_the_csv_header_is_skipped(tmp_path):
    query = ("WARNING: infoROM is corrupted at gpu 0000:1A:00.0\n"
             "index, name, memory.total [MiB]\n0, NVIDIA H100, 81559 MiB\n")
    node, notes = odd_smi(tmp_path, query)
    assert node.gpus == 1 and node.gpu.memory == gb(85.5)
    assert any("not rows of its CSV: 'WARNING: infoROM is corrupted" in n for n in notes)


def test_query_output_without_a_header_gives_a_cpu_only_node_and_a_note(tmp_path):
    node, notes = odd_smi(tmp_path, "No devices were found\n")
    assert node.gpus == 0
    assert any("--query-gpu output not understood" in n for n in notes)


@pytest.mark.parametrize(("gen", "width"), [(0, 16), (5, 0), (99, 16)])
def test_a_pcie_link_that_cannot_be_is_taken_as_unknown(tmp_path, gen, width):
    query = ("index, name, pcie.link.gen.max, pcie.link.width.max\n"
             f"0, NVIDIA H100, {gen}, {width}\n")
    node, notes = odd_smi(tmp_path, query)
    assert node.pcie.bandwidth == gb(32)  # the assumed Gen4 x16
    assert "PCIe link of the GPUs unknown; assumed Gen4 x16" in notes


def test_a_non_numeric_index_and_a_short_bus_id_are_left_unknown(tmp_path):
    query = "index, name, pci.bus_id\nGPU-0, NVIDIA H100, 0000:1A:00\n1, NVIDIA H100, 0000:1B:00.0\n"
    gpus = parse_query_gpu(query, notes := [])
    assert [g.index for g in gpus] == [0, 1] and [g.bus_id for g in gpus] == [None, "0000:1B:00.0"]
    assert "not PCI bus ids ('0000:1A:00')" in notes[0]
    node, _ = odd_smi(tmp_path, query)
    assert node.gpus == 2


@pytest.mark.parametrize(("back", "expected"), [("SYS", None), ("NV2", gb(50))])
def test_an_asymmetric_nvlink_matrix_keeps_only_the_links_seen_both_ways(tmp_path, back, expected):
    topo = f"\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\t{back}\t X \n"
    node, notes = odd_smi(tmp_path, TWO_H100, topo)
    assert (node.nvlink.bandwidth if node.nvlink else None) == expected
    assert any("NVLink counts differ by direction between GPUs 0-1 (4 vs" in n for n in notes)


def test_gpus_that_do_not_make_a_valid_description_fall_back_to_cpu_only(tmp_path, monkeypatch):
    from weightfabric.topology.discover import assemble
    from weightfabric.topology.schema import LinkSpec

    monkeypatch.setattr(assemble, "_pcie_spec", lambda gpus, notes: LinkSpec(bandwidth=0.0))
    node, notes = odd_smi(tmp_path, TWO_H100)
    assert node.gpus == 0 and node.pcie is None
    assert any("do not make a valid description" in n and "CPU-only" in n for n in notes)


@pytest.mark.parametrize(("name", "words"), [
    ("x{i}", "placeholder"), ("a/b", "contains '/'"), ("", "non-empty name")])
def test_a_node_name_that_cannot_be_one_is_refused_up_front(tmp_path, name, words):
    with pytest.raises(ClusterConfigError, match=f"--name: not a usable node name: .*{words}"):
        discover(name=name, sys_root=tmp_path, run=no_smi, nvml=None)


# --- NVML through a stand-in module ----------------------------------------------------

class FakeNvml:
    """The subset of pynvml that discovery calls, over a described machine."""

    NVML_NVLINK_MAX_LINKS = 18

    class NVMLError(Exception):
        pass

    class _Struct:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def __init__(self, gpus, links, *, fail_init=False, cc=(9, 0)):
        self.gpus, self.links, self.fail_init, self.cc = gpus, links, fail_init, cc
        self.shut_down = False

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Struct(total=self.gpus[h]["memory"], free=0, used=0)

    def nvmlDeviceGetPciInfo(self, h):
        return self._Struct(busId=self.gpus[h]["bus"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.cc

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h]):
            raise self.NVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self._Struct(busId=self.links[h][link])


def test_nvml_h100_behind_nvswitch(tmp_path):
    buses = [f"00000000:{b:02X}:00.0" for b in (0x1A, 0x3A, 0x9A, 0xBA)]
    for k, bus in enumerate(buses):
        write(tmp_path, f"sys/bus/pci/devices/{normalize_bus_id(bus)}/numa_node", str(k // 2))
    switches = [f"00000000:{0x05 + s:02X}:00.0" for s in range(4)]
    nvml = FakeNvml([{"name": "NVIDIA H100 80GB HBM3", "memory": 85520809984, "bus": b} for b in buses],
                    [[switches[link % 4] for link in range(18)] for _ in buses])
    found = discover(name="hgx", sys_root=tmp_path, run=no_smi, nvml=nvml, today=TODAY)
    node = found.cluster.node("hgx").type
    assert found.sources[0] == "NVML" and nvml.shut_down
    assert node.gpus == 4 and node.gpu is not None and node.gpu.model == "H100 80GB HBM3"
    assert node.gpu.memory == gb(85.5)
    assert node.nvlink is not None and node.nvlink.bandwidth == gb(450) and node.nvlink.groups is None
    assert node.pcie is not None and node.pcie.bandwidth == gb(64)
    assert node.numa is not None and node.numa.gpus == (0, 0, 1, 1)
    assert loads_cluster(found.to_yaml()) == found.cluster


def test_nvml_direct_bridge_between_two_ampere_workstation_gpus(tmp_path):
    buses = ["00000000:01:00.0", "00000000:21:00.0"]
    nvml = FakeNvml([{"name": "NVIDIA RTX A6000", "memory": 51527024640, "bus": b} for b in buses],
                    [[buses[1]] * 4, [buses[0]] * 4], cc=(8, 6))
    node = discover(name="ws", sys_root=tmp_path, run=no_smi, nvml=nvml).cluster.node("ws").type
    assert node.nvlink is not None and node.nvlink.bandwidth == gb(56.25)  # 4 x 14.0625 GB/s
    assert node.nvlink.groups is None


def test_nvml_that_cannot_start_falls_back_to_nvidia_smi_then_cpu_only(tmp_path):
    nvml = FakeNvml([], [], fail_init=True)
    run = smi_runner(query_csv("NVIDIA GeForce RTX 4090", 8, 24564, 4, 16),
                     fixture("topo_rtx4090_pcie_only.txt"))
    assert discover(name="a", sys_root=tmp_path, run=run, nvml=nvml).sources[0] == "nvidia-smi"
    cpu = discover(name="b", sys_root=tmp_path, run=no_smi, nvml=nvml)
    assert cpu.sources[0] == "CPU-only" and cpu.cluster.node("b").type.gpus == 0
    assert cpu.notes[:2] == ["NVML could not start (NVML Shared Library Not Found)", "nvidia-smi not found"]


def test_nvml_failing_midway_and_broken_nvidia_smi_leave_notes(tmp_path):
    class Broken(FakeNvml):
        def nvmlDeviceGetName(self, h):
            raise self.NVMLError("GPU is lost")

    def failing_smi(argv: Sequence[str]) -> str:
        raise subprocess.CalledProcessError(
            9, list(argv), "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")

    nvml = Broken([{"name": "x", "memory": 1, "bus": "0000:01:00.0"}], [[]])
    found = discover(name="c", sys_root=tmp_path, run=failing_smi, nvml=nvml)
    assert found.notes[:2] == [
        "NVML failed while reading the GPUs (GPU is lost)",
        "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."]
    assert nvml.shut_down and found.cluster.node("c").type.gpus == 0


def test_nvidia_smi_without_gpus_gives_a_cpu_only_node(tmp_path):
    run = smi_runner("index, name, memory.total [MiB]\n", "")
    found = discover(name="d", sys_root=tmp_path, run=run, nvml=None)
    assert found.sources[0] == "CPU-only" and "nvidia-smi lists no GPU" in found.notes


# --- /sys and /proc ---------------------------------------------------------------------

def test_sys_nics_rdma_roce_tcp_and_what_is_skipped(tmp_path):
    ib_device(tmp_path, "mlx5_0", numa=1)
    ib_device(tmp_path, "mlx5_1", rate="200 Gb/sec (2X NDR)", layer="Ethernet",
              netdevs=["ens1f0np0"], numa=0)
    ib_device(tmp_path, "mlx5_2", state="1: DOWN")
    net_iface(tmp_path, "lo")
    net_iface(tmp_path, "ens1f0np0", speed="200000", numa=0)  # netdev of the RoCE port
    net_iface(tmp_path, "eth0", speed="25000", numa=1)
    net_iface(tmp_path, "eth1", speed="-1")
    net_iface(tmp_path, "eth2", speed="10000", operstate="down")
    net_iface(tmp_path, "ifb0", device=False)
    net_iface(tmp_path, "veth12ab", speed="10000", device=False)
    nics, notes = read_nics(tmp_path)
    got = {(n.name, n.kind, n.bandwidth, n.numa) for n in nics}
    assert got == {("mlx5_0", "rdma", gb(50), 1), ("mlx5_1", "rdma", gb(25), 0),
                   ("eth0", "tcp", gb(3.125), 1), ("eth1", "tcp", None, None)}
    assert [n.detail for n in nics if n.name.startswith("mlx5")] == [
        "InfiniBand 400 Gb/sec (4X NDR)", "RoCE 200 Gb/sec (2X NDR)"]
    assert "RDMA device mlx5_2 has no ACTIVE port; skipped" in notes
    assert "skipped virtual interfaces (no device): ifb0, veth12ab" in notes
    assert "skipped interfaces that are down: eth2" in notes


def test_pci_link_and_host_memory_from_sys(tmp_path):
    write(tmp_path, "sys/bus/pci/devices/0000:1a:00.0/max_link_speed", "32.0 GT/s PCIe")
    write(tmp_path, "sys/bus/pci/devices/0000:1a:00.0/max_link_width", "16")
    write(tmp_path, "sys/bus/pci/devices/0000:3a:00.0/max_link_speed", "Unknown")
    meminfo(tmp_path, 24684092)
    assert pci_link(tmp_path, "0000:1a:00.0") == (5, 16)
    assert pci_link(tmp_path, "0000:3a:00.0") is None
    assert host_memory(tmp_path) == 24684092 * 1024
    assert host_memory(tmp_path / "nowhere") is None


@pytest.mark.parametrize("gen, width, expected", [(3, 16, 16), (4, 16, 32), (5, 16, 64), (4, 8, 16),
                                                  (6, 16, 128), (1, 1, 0.25)])
def test_pcie_bandwidth_per_generation_and_width(gen, width, expected):
    assert pcie_bandwidth(gen, width) == gb(expected)


@pytest.mark.parametrize("pairs, groups", [
    ([[0, 1], [1, 0]], [[0, 1]]),
    ([[0, 0, 0], [0, 0, 2], [0, 2, 0]], [[1, 2]]),
    ([[0] * 3] * 3, []),
])
def test_nvlink_groups_are_disjoint_cliques(pairs, groups):
    assert nvlink_groups(pairs) == groups


# --- CPU-only, notes, YAML header -------------------------------------------------------

def test_cpu_only_machine_with_unknown_nic_speed(tmp_path):
    net_iface(tmp_path, "lo")
    net_iface(tmp_path, "eth0", speed="-1")
    net_iface(tmp_path, "ifb0", device=False)
    meminfo(tmp_path, 24684092)
    found = discover(name="vm", sys_root=tmp_path, run=no_smi, nvml=None, today=TODAY)
    node = found.cluster.node("vm").type
    assert node.gpus == 0 and node.gpu is None and node.pcie is None
    assert node.nics is not None and (node.nics.count, node.nics.kind) == (1, "tcp")
    assert node.nics.bandwidth == gb(1.25) and node.nics.names == ("eth0",)
    assert node.host_memory == gb(25.3)
    assert any(n.startswith("eth0: speed reads -1, speed unknown; assumed") for n in found.notes)
    text = found.to_yaml()
    assert text.startswith("# Generated by `fabric topo discover` on 2025-01-02.\n"
                           "# Sources: CPU-only, /sys/class/net, /proc/meminfo.\n"
                           "# Notes:\n#   - nvidia-smi not found\n")
    for note in found.notes:
        assert f"#   - {note}\n" in text
    assert loads_cluster(text) == found.cluster
    assert found.summary() == "1 node, 0 GPUs, 1 NIC, 25.3 GB host memory"


def test_machine_with_nothing_readable_is_still_valid(tmp_path):
    found = discover(name="bare", sys_root=tmp_path, run=no_smi, nvml=None)
    node = found.cluster.node("bare").type
    assert node.nics is None and node.host_memory is None
    assert loads_cluster(found.to_yaml()) == found.cluster
    assert found.summary() == "1 node, 0 GPUs, 0 NICs"


def test_discover_on_this_machine_loads_back():
    found = discover()
    assert loads_cluster(found.to_yaml()) == found.cluster
    (node,) = found.cluster.nodes()
    if shutil.which("nvidia-smi") is None:
        assert node.type.gpus == 0 and found.sources[0] == "CPU-only"
    assert found.summary().startswith("1 node, ")


def test_cli_discover_then_validate(tmp_path):
    out = tmp_path / "x.yaml"
    env = dict(os.environ)
    made = subprocess.run([sys.executable, "-m", "weightfabric.tools.cli", "topo", "discover", "-o", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert f"wrote {out}: 1 node" in made.stderr
    checked = subprocess.run([sys.executable, "-m", "weightfabric.tools.cli", "topo", "validate", str(out)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    assert "valid" in checked.stdout
