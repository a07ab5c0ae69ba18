"""Reading NICs, PCIe links, NUMA nodes and host memory from /sys and /proc.

Every path is taken relative to `sys_root` so that tests can point it at a fake
tree. What is read:

- ``/sys/class/infiniband/<dev>/ports/<p>/{rate,state,link_layer}``: RDMA NICs,
  InfiniBand or RoCE (``link_layer`` Ethernet); rate like ``400 Gb/sec (4X NDR)``.
- ``/sys/class/net/<if>/{speed,operstate}`` (speed in Mb/s, -1 when unknown) and
  the ``device`` link: plain TCP NICs. Interfaces without ``device`` (loopback,
  ifb, veth, bridges, bonds) are virtual and skipped, as are the netdevs of RDMA
  devices (listed under ``/sys/class/infiniband/<dev>/device/net``).
- ``device/numa_node`` of each NIC and ``/sys/bus/pci/devices/<bdf>/numa_node``
  of each GPU (-1 means the platform does not say).
- ``/sys/bus/pci/devices/<bdf>/{max_link_speed,max_link_width}``: PCIe links.
- ``/proc/meminfo``: ``MemTotal``.
"""

from __future__ import annotations

import re
from pathlib import Path

from weightfabric.topology.discover.base import PCIE_GT_PER_S_TO_GEN, NicInfo


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # missing, or EINVAL (speed of a down or virtual interface)
        return None


def _numa(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.lstrip("-").isdigit() and int(text) >= 0 else None


def host_memory(sys_root: Path) -> float | None:
    """Total host memory in bytes from ``/proc/meminfo``, or None."""
    text = _read(sys_root / "proc" / "meminfo") or ""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, flags=re.MULTILINE)
    return int(match.group(1)) * 1024.0 if match else None


def pci_numa_node(sys_root: Path, bdf: str) -> int | None:
    """NUMA node of PCI device `bdf` (``0000:1a:00.0``), or None when unknown."""
    return _numa(sys_root / "sys" / "bus" / "pci" / "devices" / bdf / "numa_node")


def pci_link(sys_root: Path, bdf: str) -> tuple[int, int] | None:
    """(generation, width) of the fastest link PCI device `bdf` supports, or None.

    (generation, width) of the fastest link PCI device `bdf` supports, or None (also for a
    width of 0).
    """
    device = sys_root / "sys" / "bus" / "pci" / "devices" / bdf
    speed, width = _read(device / "max_link_speed"), _read(device / "max_link_width")
    match = re.match(r"(\d+(?:\.\d+)?)\s*GT/s", speed or "")
    if not match or not (width or "").isdigit():
        return None
    gen = PCIE_GT_PER_S_TO_GEN.get(float(match.group(1)))
    if gen is None or width is None or int(width) < 1:
        return None
    return gen, int(width)


def _natural(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def rdma_nics(sys_root: Path) -> tuple[list[NicInfo], set[str], list[str]]:
    """RDMA ports, the netdev names they own, and notes."""
    root = sys_root / "sys" / "class" / "infiniband"
    nics: list[NicInfo] = []
    owned: set[str] = set()
    notes: list[str] = []
    devices = sorted((p for p in root.iterdir()), key=lambda p: _natural(p.name)) if root.is_dir() else []
    for dev in devices:
        net = dev / "device" / "net"
        if net.is_dir():
            owned.update(p.name for p in net.iterdir())
        ports = sorted((dev / "ports").iterdir(), key=lambda p: _natural(p.name)) \
            if (dev / "ports").is_dir() else []
        read = [(p.name, _read(p / "rate") or "", _read(p / "state") or "", _read(p / "link_layer") or "")
                for p in ports]
        active = [port for port in read if "ACTIVE" in port[2].upper()]
        if not active:
            notes.append(f"RDMA device {dev.name} has no ACTIVE port; skipped")
            continue
        numa = _numa(dev / "device" / "numa_node")
        for port, rate, _state, layer in active:
            match = re.match(r"(\d+(?:\.\d+)?)\s*Gb/sec", rate)
            label = dev.name if len(active) == 1 else f"{dev.name}:{port}"
            kind = "RoCE" if layer.lower() == "ethernet" else "InfiniBand"
            nics.append(NicInfo(name=label, kind="rdma", numa=numa, detail=f"{kind} {rate}".strip(),
                                bandwidth=float(match.group(1)) * 1e9 / 8 if match else None))
    return nics, owned, notes


def tcp_nics(sys_root: Path, skip: set[str]) -> tuple[list[NicInfo], list[str]]:
    """Physical (or virtio) network interfaces that are not RDMA netdevs, and notes."""
    root = sys_root / "sys" / "class" / "net"
    nics: list[NicInfo] = []
    virtual, down = [], []
    for entry in sorted(root.iterdir(), key=lambda p: _natural(p.name)) if root.is_dir() else []:
        name = entry.name
        if name == "lo" or name in skip:
            continue
        if not (entry / "device").exists():
            virtual.append(name)
            continue
        if (_read(entry / "operstate") or "").lower() == "down":
            down.append(name)
            continue
        speed = _read(entry / "speed")
        mbps = int(speed) if speed is not None and speed.lstrip("-").isdigit() else -1
        nics.append(NicInfo(name=name, kind="tcp", numa=_numa(entry / "device" / "numa_node"),
                            bandwidth=mbps * 1e6 / 8 if mbps > 0 else None,
                            detail=f"{mbps} Mb/s" if mbps > 0 else f"speed reads {speed or 'nothing'}"))
    notes = []
    if virtual:
        notes.append(f"skipped virtual interfaces (no device): {', '.join(virtual)}")
    if down:
        notes.append(f"skipped interfaces that are down: {', '.join(down)}")
    return nics, notes


def read_nics(sys_root: Path) -> tuple[list[NicInfo], list[str]]:
    """Every NIC worth describing: RDMA ports first, then TCP interfaces; and notes."""
    rdma, owned, notes = rdma_nics(sys_root)
    tcp, tcp_notes = tcp_nics(sys_root, owned)
    return rdma + tcp, notes + tcp_notes
