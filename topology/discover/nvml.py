"""Reading GPUs through NVML (the ``pynvml`` module of the nvidia-ml-py package).

Per GPU: name, memory, PCI bus id, maximum PCIe generation and width, compute
capability. Per NVLink link (up to ``NVML_NVLINK_MAX_LINKS``): whether it is
active and the PCI bus id of the far end. A far end that is another GPU is a
direct link; anything else (an NVSwitch, PCI class 0x068000) is a switch link.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

from weightfabric.topology.discover.base import GpuInfo, GpuProbe, NvlinkLinks, normalize_bus_id

_NVML_FEATURE_ENABLED = 1


def load_nvml() -> ModuleType | None:
    """The ``pynvml`` module when nvidia-ml-py is installed, else None."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_nvml(nvml: Any, notes: list[str]) -> GpuProbe | None:
    """GPUs and NVLink links from an NVML module; None (and a note) when NVML fails.

    Args:
        nvml: the ``pynvml`` module, or an object with the same functions (tests).
        notes: where to say why NVML could not be used.
    """
    error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error as exc:
        notes.append(f"NVML could not start ({exc})")
        return None
    try:
        return _read(nvml, error)
    except (error, ValueError) as exc:  # ValueError: a bus id that is not one
        notes.append(f"NVML failed while reading the GPUs ({exc})")
        return None
    finally:
        with contextlib.suppress(error):
            nvml.nvmlShutdown()


def _optional(error: type[BaseException], fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except error:
        return None


def _read(nvml: Any, error: type[BaseException]) -> GpuProbe:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    gpus = []
    for index, handle in enumerate(handles):
        cc = _optional(error, nvml.nvmlDeviceGetCudaComputeCapability, handle)
        gpus.append(GpuInfo(
            index=index,
            model=_text(nvml.nvmlDeviceGetName(handle)),
            memory=float(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            bus_id=normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
            pcie_gen=_optional(error, nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            pcie_width=_optional(error, nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
            compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
        ))
    probe = GpuProbe(source="NVML", gpus=gpus)
    probe.nvlink = _nvlink(nvml, error, handles, gpus)
    return probe


def _nvlink(nvml: Any, error: type[BaseException], handles: list[Any],
            gpus: list[GpuInfo]) -> NvlinkLinks | None:
    n = len(gpus)
    index_of = {gpu.bus_id: k for k, gpu in enumerate(gpus)}
    direct = [[0] * n for _ in range(n)]
    switch = [0] * n
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for i, handle in enumerate(handles):
        for link in range(max_links):
            state = _optional(error, nvml.nvmlDeviceGetNvLinkState, handle, link)
            if state != _NVML_FEATURE_ENABLED:
                continue
            remote = _optional(error, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            peer = index_of.get(normalize_bus_id(_text(remote.busId))) if remote else None
            if peer is None:
                switch[i] += 1
            elif peer != i:
                direct[i][peer] += 1
    if not any(switch) and not any(any(row) for row in direct):
        return None
    pairs = tuple(tuple(direct[i][j] + (min(switch[i], switch[j]) if i != j and switch[i] and switch[j]
                                        else 0) for j in range(n)) for i in range(n))
    return NvlinkLinks(pairs=pairs, via_switch=any(switch))
