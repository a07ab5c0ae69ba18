"""What the probes of `topology.discover` report, and the bandwidth tables they use.

Each probe (NVML, nvidia-smi, /sys) returns plain records defined here; the
assembler turns them into one validated `NodeType`. Bandwidths are bytes/s per
direction, sizes are bytes, as everywhere in `topology`.

NVLink bandwidth per link and direction, by compute capability (theoretical
signalling rate; NCCL's ``graph/topo.h`` models somewhat lower effective values):

=====  ==========================  ==================  =============================
 cc     GPUs                        GB/s per link/dir   source
=====  ==========================  ==================  =============================
 6.0    P100 (NVLink 1)             20                  P100 datasheet: 4 links, 160 GB/s bidirectional
 7.0    V100 (NVLink 2)             25                  V100 datasheet: 6 links, 300 GB/s bidirectional
 8.0    A100, A800, A30 (NVLink 3)  25                  A100 datasheet: 12 links, 600 GB/s bidirectional
 8.6    A40, RTX A6000, RTX 3090    14.0625             RTX A6000 datasheet: 4 links, 112.5 GB/s bidirectional
 9.0    H100, H200, H800 (NVLink 4) 25                  H100 datasheet: 18 links, 900 GB/s bidirectional
 10.0   B200, GB200 (NVLink 5)      50                  B200 datasheet: 18 links, 1.8 TB/s bidirectional
=====  ==========================  ==================  =============================

PCIe per direction for an x16 link, nominal (PCI-SIG signalling rate after
encoding, rounded): Gen3 16 GB/s, Gen4 32 GB/s, Gen5 64 GB/s, Gen6 128 GB/s;
halved per earlier generation and scaled linearly by link width.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

GB = 1e9

#: (major, minor) compute capability -> NVLink bandwidth per link per direction (bytes/s).
NVLINK_LINK_BANDWIDTH: dict[tuple[int, int], float] = {
    (6, 0): 20 * GB,
    (7, 0): 25 * GB,
    (8, 0): 25 * GB,
    (8, 6): 14.0625 * GB,
    (9, 0): 25 * GB,
    (10, 0): 50 * GB,
}
#: (major, minor) compute capability -> NVLink links per GPU (tells direct meshes from NVSwitch).
NVLINK_MAX_LINKS: dict[tuple[int, int], int] = {
    (6, 0): 4, (7, 0): 6, (8, 0): 12, (8, 6): 4, (9, 0): 18, (10, 0): 18,
}
#: Used when the GPU generation is not in the tables above.
DEFAULT_NVLINK_LINK_BANDWIDTH = 25 * GB
DEFAULT_NVLINK_MAX_LINKS = 18

#: Model-name patterns -> compute capability, for nvidia-smi versions without ``compute_cap``.
_MODEL_CC: list[tuple[re.Pattern[str], tuple[int, int]]] = [
    (re.compile(r"\b(GB|B)(100|200|300)\b"), (10, 0)),
    (re.compile(r"\b(GH200|H100|H200|H800|H20)\b"), (9, 0)),
    (re.compile(r"\b(A100|A800|A30)\b"), (8, 0)),
    (re.compile(r"\b(A40|A10|RTX A6000|RTX A5000|RTX 3090)\b"), (8, 6)),
    (re.compile(r"\bV100"), (7, 0)),
    (re.compile(r"\bP100"), (6, 0)),
]

#: Link speed in GT/s (as /sys writes it) -> PCIe generation.
PCIE_GT_PER_S_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}

#: Bandwidth assumed for a TCP interface whose speed the kernel does not report
#: (virtio NICs read -1): a common cloud VM baseline.
DEFAULT_TCP_BANDWIDTH = 10e9 / 8

#: A command runner: takes argv, returns stdout; raises OSError when the program is
#: missing and subprocess.CalledProcessError / TimeoutExpired when it fails.
Runner = Callable[[Sequence[str]], str]


def compute_capability_of(model: str) -> tuple[int, int] | None:
    """The compute capability guessed from a GPU model name, or None when unknown."""
    for pattern, cc in _MODEL_CC:
        if pattern.search(model):
            return cc
    return None


def nvlink_link_bandwidth(cc: tuple[int, int] | None) -> float | None:
    """Bandwidth per NVLink link per direction for `cc`; None when not in the table."""
    return NVLINK_LINK_BANDWIDTH.get(cc) if cc is not None else None


def pcie_bandwidth(gen: int, width: int) -> float:
    """Nominal PCIe bandwidth per direction (bytes/s): Gen5 x16 = 64 GB/s."""
    if gen < 1 or width < 1:
        raise ValueError(f"PCIe generation and width must be positive, got Gen{gen} x{width}")
    return 16 * GB * 2.0 ** (gen - 3) * width / 16


@dataclass(frozen=True, kw_only=True)
class GpuInfo:
    """One GPU as a probe saw it. Fields a probe could not read are None."""

    index: int
    model: str
    memory: float | None = None
    bus_id: str | None = None
    numa: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class NvlinkLinks:
    """NVLink connectivity: ``pairs[i][j]`` links usable from GPU i to GPU j (0 = none).

    ``via_switch`` is True when the links go through NVSwitch, where ``pairs[i][j]``
    is GPU i's number of switch links (every peer reached over all of them); False
    for direct links, where a GPU's links are split among its peers.
    """

    pairs: tuple[tuple[int, ...], ...]
    via_switch: bool


@dataclass(kw_only=True)
class GpuProbe:
    """What a GPU probe (NVML or nvidia-smi) found."""

    source: str
    gpus: list[GpuInfo]
    nvlink: NvlinkLinks | None = None
    notes: list[str] = field(default_factory=list)
    #: NIC names nvidia-smi lists in its topology matrix (for cross-checking /sys).
    nic_names: list[str] = field(default_factory=list)
    #: Per GPU, the NICs behind the same PCIe switch (PIX/PXB in ``nvidia-smi topo -m``).
    gpu_nics: list[list[str]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class NicInfo:
    """One network interface read from /sys."""

    name: str
    kind: str
    bandwidth: float | None
    numa: int | None = None
    detail: str = ""


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:1A:00.0`` (NVML, nvidia-smi) -> ``0000:1a:00.0`` (/sys/bus/pci/devices)."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]+):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])", text)
    if not match:
        raise ValueError(f"{bus_id!r} is not a PCI bus id such as 0000:1a:00.0")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"
