"""Reading GPUs through the ``nvidia-smi`` command line.

Two outputs are parsed: ``nvidia-smi --query-gpu=... --format=csv`` (one row per
GPU, columns named by its header) and ``nvidia-smi topo -m`` (the connection
matrix). The matrix legend: ``X`` self, ``NV#`` a bonded set of # NVLinks,
``PIX`` at most one PCIe bridge, ``PXB`` several bridges, ``PHB`` through a PCIe
host bridge, ``NODE`` across host bridges within a NUMA node, ``SYS`` across
NUMA nodes (``SOC`` in old drivers). NIC columns are named by device
(``mlx5_0``) in old drivers, or ``NIC0`` with a "NIC Legend" below in new ones.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
from dataclasses import dataclass, replace

from weightfabric.topology.discover.base import (
    DEFAULT_NVLINK_MAX_LINKS,
    NVLINK_MAX_LINKS,
    GpuInfo,
    GpuProbe,
    NvlinkLinks,
    Runner,
    compute_capability_of,
    normalize_bus_id,
)

QUERY_FIELDS = ("index", "name", "memory.total", "pci.bus_id", "pcie.link.gen.max",
                "pcie.link.width.max", "compute_cap")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NV = re.compile(r"^NV(\d+)$")
_TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}
_MEMORY_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


class SmiParseError(ValueError):
    """nvidia-smi printed something this parser does not understand."""


@dataclass(frozen=True, kw_only=True)
class TopoMatrix:
    """``nvidia-smi topo -m`` as data.

    ``gpus`` and ``nics`` are the device labels in column order (NICs resolved
    through the NIC Legend when there is one); ``cells[a][b]`` is the connection
    type from device a to device b over all devices (GPUs first); ``cpu_affinity``
    and ``numa_affinity`` are per GPU (None where the cell is empty or N/A).
    """

    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]
    cpu_affinity: tuple[str | None, ...]
    numa_affinity: tuple[int | None, ...]

    def nvlink_counts(self) -> list[list[int]]:
        """Number of bonded NVLinks between each pair of GPUs (0 where none)."""
        n = len(self.gpus)
        counts = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                match = _NV.match(self.cells[i][j])
                if match:
                    counts[i][j] = int(match.group(1))
        return counts

    def path(self, a: str, b: str) -> str:
        """The connection type between two devices given by label (``GPU0``, ``mlx5_1``)."""
        labels = self.gpus + self.nics
        return self.cells[labels.index(a)][labels.index(b)]

    def nearest_nics(self, gpu: int) -> list[str]:
        """NICs behind the same PCIe switch as GPU `gpu` (PIX or PXB)."""
        row = self.cells[gpu]
        n = len(self.gpus)
        return [nic for k, nic in enumerate(self.nics) if row[n + k] in ("PIX", "PXB")]


def _split(line: str) -> list[str]:
    if "\t" in line:
        return [cell.strip() for cell in line.split("\t")]
    return [cell.strip() for cell in re.split(r"\s{2,}", line.strip())]


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of ``nvidia-smi topo -m``.

    Raises:
        SmiParseError: there is no ``GPU0`` header, or a row does not match it.
    """
    lines = [_ANSI.sub("", line.rstrip("\n")) for line in text.splitlines()]
    header_at = next((k for k, line in enumerate(lines) if "GPU0" in _split(line)), None)
    if header_at is None:
        raise SmiParseError("no GPU0 column in the `nvidia-smi topo -m` output")
    header = [cell for cell in _split(lines[header_at]) if cell]
    labels = [cell for cell in header if cell not in _TRAILING]
    legend = {m.group(1): m.group(2) for m in
              (re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line) for line in lines[header_at:]) if m}

    rows: dict[str, list[str]] = {}
    trailing: dict[str, list[str]] = {}
    for line in lines[header_at + 1:]:
        if not line.strip() or line.strip().startswith("Legend"):
            break
        cells = _split(line)
        label, rest = cells[0], cells[1:]
        if label not in labels:
            raise SmiParseError(f"row {label!r} of `nvidia-smi topo -m` is not a column of its header")
        if len(rest) < len(labels):
            raise SmiParseError(f"row {label!r} has {len(rest)} cells for {len(labels)} devices")
        rows[label] = rest[:len(labels)]
        trailing[label] = rest[len(labels):]
    missing = [label for label in labels if label not in rows]
    if missing:
        raise SmiParseError(f"no row for {', '.join(missing)} in the `nvidia-smi topo -m` output")

    gpus = tuple(label for label in labels if re.fullmatch(r"GPU\d+", label))
    nics = tuple(label for label in labels if label not in gpus)
    order = gpus + nics
    cpu, numa = [], []
    for gpu in gpus:
        extra = trailing[gpu]
        cpu.append(extra[0] if extra and extra[0] and extra[0].lower() not in _MISSING else None)
        value = extra[1] if len(extra) > 1 else ""
        numa.append(int(value) if value.isdigit() else None)
    return TopoMatrix(
        gpus=gpus,
        nics=tuple(legend.get(nic, nic) for nic in nics),
        cells=tuple(tuple(rows[a][labels.index(b)] for b in order) for a in order),
        cpu_affinity=tuple(cpu),
        numa_affinity=tuple(numa),
    )


def parse_query_gpu(text: str, notes: list[str] | None = None) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=<fields> --format=csv`` (with its header line).

    Any subset of `QUERY_FIELDS` may be present; ``name`` is required. Missing
    values (``[N/A]``, ``[Not Supported]``) become None, and so do a PCIe generation
    or width below 1 and a bus id that is not one; a non-numeric index becomes the
    row's position. Lines that are not rows of the CSV (a driver warning such as
    ``WARNING: infoROM is corrupted`` before the header, a row of the wrong length)
    are skipped, saying so in `notes`.

    Raises:
        SmiParseError: no header with a ``name`` column.
    """
    rows = [row for row in csv.reader(io.StringIO(text), skipinitialspace=True) if row]
    if not rows:
        return []
    header_at = next((k for k, row in enumerate(rows) if "name" in _columns(row)), None)
    if header_at is None:
        raise SmiParseError(f"the --query-gpu output has no 'name' column: {rows[0]}")
    header, columns = rows[header_at], _columns(rows[header_at])
    skipped = rows[:header_at] + [row for row in rows[header_at + 1:] if len(row) != len(columns)]
    if skipped and notes is not None:
        notes.append("skipped lines of the nvidia-smi --query-gpu output that are not rows of its "
                     "CSV: " + "; ".join(repr(", ".join(row)) for row in skipped))
    gpus: list[GpuInfo] = []
    bad_bus_ids: list[str] = []
    for row in rows[header_at + 1:]:
        if len(row) != len(columns):
            continue
        values = {col: (None if cell.strip().lower() in _MISSING else cell.strip())
                  for col, cell in zip(columns, row, strict=True)}
        model = values["name"] or "unknown-gpu"
        cc = values.get("compute_cap")
        index = values.get("index")
        gpus.append(GpuInfo(
            index=int(index) if index is not None and index.isdigit() else len(gpus),
            model=model,
            memory=_memory(values.get("memory.total"), header[columns.index("memory.total")]
                           if "memory.total" in columns else ""),
            bus_id=_bus_id(values.get("pci.bus_id"), bad_bus_ids),
            pcie_gen=_positive(values.get("pcie.link.gen.max")),
            pcie_width=_positive(values.get("pcie.link.width.max")),
            compute_capability=_cc(cc) if cc else compute_capability_of(model),
        ))
    if bad_bus_ids and notes is not None:
        notes.append(f"nvidia-smi gave bus ids that are not PCI bus ids ({', '.join(bad_bus_ids)}); "
                     "NUMA node and PCIe link not read from /sys for those GPUs")
    return gpus


def _columns(row: list[str]) -> list[str]:
    """Column names of a header row, without units: ``memory.total [MiB]`` -> ``memory.total``."""
    return [re.sub(r"\s*\[.*\]$", "", cell.strip()) for cell in row]


def _bus_id(value: str | None, bad: list[str]) -> str | None:
    """`value` when it is a PCI bus id, else None, adding it to `bad`.

    `value` when it is a PCI bus id, else None, adding it to `bad` (``0000:1A:00`` lacks the
    function).
    """
    try:
        return value if value is None or normalize_bus_id(value) else None
    except ValueError:
        bad.append(repr(value))
        return None


def _first_line(text: object) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def _cc(text: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _positive(value: str | None) -> int | None:
    """A whole number >= 1, else None (nvidia-smi prints 0 for a link it cannot read)."""
    return int(value) if value is not None and value.isdigit() and int(value) >= 1 else None


def _memory(value: str | None, header: str) -> float | None:
    """``143771 MiB`` (unit in the value, or in the header as ``memory.total [MiB]``)."""
    if value is None:
        return None
    match = re.fullmatch(r"([\d.]+)\s*([KMG]i?B|B)?", value, flags=re.IGNORECASE)
    if not match:
        return None
    bracket = re.search(r"\[(\w+)\]", header)
    unit = match.group(2) or (bracket.group(1) if bracket else "MiB")
    return float(match.group(1)) * _MEMORY_UNITS.get(unit.lower(), 2**20)


def nvlink_from_counts(counts: list[list[int]], gpus: list[GpuInfo]) -> NvlinkLinks | None:
    """NVLink connectivity from the NV# cells; None when no pair has NVLink.

    The matrix shows NV18 between every pair of H100s behind NVSwitch, but NV1/NV2
    between directly wired V100s. A GPU whose NV# cells add up to more links than
    its generation has (18 for H100, 6 for V100) must be behind a switch.
    """
    if not any(any(row) for row in counts):
        return None
    via_switch = False
    for i, row in enumerate(counts):
        cc = gpus[i].compute_capability if i < len(gpus) else None
        limit = NVLINK_MAX_LINKS.get(cc, DEFAULT_NVLINK_MAX_LINKS) if cc else DEFAULT_NVLINK_MAX_LINKS
        if sum(row) > limit:
            via_switch = True
    return NvlinkLinks(pairs=tuple(tuple(row) for row in counts), via_switch=via_switch)


def probe_smi(run: Runner, notes: list[str]) -> GpuProbe | None:
    """GPUs, NVLink and NUMA affinity from nvidia-smi.

    None (and a note) when it is missing or fails.
    """
    text, failure = None, ""
    for fields in (QUERY_FIELDS, QUERY_FIELDS[:-1]):  # old drivers lack compute_cap
        try:
            text = run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv"])
            break
        except OSError:
            notes.append("nvidia-smi not found")
            return None
        except subprocess.TimeoutExpired:
            notes.append("nvidia-smi timed out")
            return None
        except subprocess.CalledProcessError as exc:
            failure = _first_line(exc.stdout) or _first_line(exc.stderr) or f"exit {exc.returncode}"
    if text is None:
        notes.append(f"nvidia-smi failed: {failure}")
        return None
    try:
        probe = GpuProbe(source="nvidia-smi", gpus=parse_query_gpu(text, notes))
    except SmiParseError as exc:
        notes.append(f"nvidia-smi --query-gpu output not understood ({exc}); GPUs not described")
        return None
    if not probe.gpus:
        return probe
    try:
        matrix = parse_topo_matrix(run(["nvidia-smi", "topo", "-m"]))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired, SmiParseError) as exc:
        probe.notes.append(f"`nvidia-smi topo -m` unusable ({exc}); NVLink not described")
        return probe
    if len(matrix.gpus) != len(probe.gpus):
        probe.notes.append(f"`nvidia-smi topo -m` shows {len(matrix.gpus)} GPUs but --query-gpu "
                           f"{len(probe.gpus)}; NVLink not described")
        return probe
    probe.gpus = [gpu if gpu.numa is not None else replace(gpu, numa=matrix.numa_affinity[k])
                  for k, gpu in enumerate(probe.gpus)]
    probe.nvlink = nvlink_from_counts(matrix.nvlink_counts(), probe.gpus)
    probe.nic_names = [nic for nic in matrix.nics if not re.fullmatch(r"NIC\d+", nic)]
    if probe.nic_names:
        probe.gpu_nics = [matrix.nearest_nics(g) for g in range(len(matrix.gpus))]
    return probe

