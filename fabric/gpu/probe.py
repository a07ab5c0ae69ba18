"""What GPU machinery this process can use, and why not: one function, never raises.

`probe` checks, in order, CUDA (torch sees a device and ``cuda.bindings``, which
the CUDA IPC transport calls, counts it too), NVSHMEM (``nvshmem4py`` and
``cuda.core`` import, ``cuda.core`` opens the device and the host library loads; a
full ``init`` is a collective, so it is left to the caller), peer access between
the visible GPUs, and whether an MPS control daemon is running. Each check carries
the reason when it fails, e.g. ``cuda.core.Device(0) raised
DynamicLibNotFoundError: ...``.
`missing` turns a probe into a pytest skip reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

NEEDS = ("cuda", "nvshmem", "peer", "mps")


@dataclass(frozen=True)
class Check:
    """One capability: usable or not, and why."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class GpuProbe:
    """The result of `probe`.

    Attributes:
        cuda: torch.cuda and cuda-bindings usable with at least one device.
        nvshmem: nvshmem4py and cuda.core importable, the host library loadable.
        peer: every pair of visible GPUs can access each other's memory.
        mps: an MPS control daemon is running.
        devices: UUIDs of the visible GPUs (normalised, see `normalise_uuid`).
    """

    cuda: Check
    nvshmem: Check
    peer: Check
    mps: Check
    devices: tuple[str, ...] = field(default=())

    def missing(self, *needs: str) -> str | None:
        """None when every capability in ``needs`` is usable, else the first reason."""
        for need in needs:
            if need not in NEEDS:
                raise ValueError(f"unknown GPU capability {need!r}; one of {NEEDS}")
            check: Check = getattr(self, need)
            if not check.ok:
                return f"{need}: {check.reason}"
        return None


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def normalise_uuid(uuid: object) -> str:
    """A GPU UUID as 32 lowercase hex digits (drops ``GPU-``/``MIG-`` and dashes).

    Accepts what torch (``get_device_properties(i).uuid``), cuda.core
    (``Device.uuid``), NVML and nvidia-smi print for the same device.

    Raises:
        ValueError: not 16 bytes of hex.
    """
    text = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.replace("-", "")
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return text


def _check_torch_cuda() -> tuple[str | None, tuple[str, ...]]:
    try:
        import torch

        if not torch.cuda.is_available():
            return (f"torch.cuda.is_available() is False (torch {torch.__version__}, built for "
                    f"CUDA {torch.version.cuda})"), ()
        count = torch.cuda.device_count()
        return None, tuple(normalise_uuid(torch.cuda.get_device_properties(i).uuid)
                           for i in range(count))
    except Exception as exc:  # noqa: BLE001 - a probe reports, never raises
        return f"torch.cuda raised {_describe(exc)}", ()


def _check_cuda_bindings() -> str | None:
    try:
        from cuda.bindings import runtime
    except Exception as exc:  # noqa: BLE001
        return f"import cuda.bindings raised {_describe(exc)} (install the gpu extra)"
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"cuda.bindings cudaGetDeviceCount raised {_describe(exc)}"
    if int(err) != 0:
        return f"cuda.bindings cudaGetDeviceCount failed: {err!r}"
    if count < 1:
        return "cuda.bindings sees no CUDA device"
    return None


def _check_cuda_core() -> str | None:
    try:
        from cuda.core import Device
    except Exception as exc:  # noqa: BLE001
        return f"import cuda.core raised {_describe(exc)} (install the gpu extra)"
    try:
        Device(0).uuid  # noqa: B018 - opens the driver
    except Exception as exc:  # noqa: BLE001
        return f"cuda.core.Device(0) raised {_describe(exc)}"
    return None


def _check_cuda() -> tuple[Check, tuple[str, ...]]:
    torch_problem, uuids = _check_torch_cuda()
    problems = [p for p in (torch_problem, _check_cuda_bindings()) if p]
    if problems:
        return Check(False, "; ".join(problems)), uuids
    return Check(True, f"{len(uuids)} device(s)"), uuids


def _check_nvshmem(cuda: Check) -> Check:
    try:
        import nvshmem.core as nvshmem
    except Exception as exc:  # noqa: BLE001
        return Check(False, f"import nvshmem.core raised {_describe(exc)} (install the gpu extra)")
    if not cuda.ok:
        return Check(False, f"nvshmem4py imports but needs CUDA ({cuda.reason})")
    core_problem = _check_cuda_core()
    if core_problem:
        return Check(False, core_problem)
    try:
        version = nvshmem.get_version()
    except Exception as exc:  # noqa: BLE001
        return Check(False, f"nvshmem.core.get_version() raised {_describe(exc)}")
    return Check(True, f"libnvshmem {version.libnvshmem_version}, nvshmem4py "
                       f"{version.nvshmem4py_version}")


def _check_peer(cuda: Check, count: int) -> Check:
    if not cuda.ok:
        return Check(False, f"needs CUDA ({cuda.reason})")
    if count < 2:
        return Check(False, f"{count} visible GPU: no peer to access")
    try:
        import torch

        bad = [(i, j) for i in range(count) for j in range(count)
               if i != j and not torch.cuda.can_device_access_peer(i, j)]
    except Exception as exc:  # noqa: BLE001
        return Check(False, f"torch.cuda.can_device_access_peer raised {_describe(exc)}")
    if bad:
        return Check(False, f"no peer access between devices {bad[:4]}")
    return Check(True, f"all {count} GPUs reach each other")


def _check_mps() -> Check:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if (pipe / "control").exists():
        return Check(True, f"control pipe at {pipe}")
    return Check(False, f"no MPS control daemon ({pipe}/control absent; start one with "
                        "`nvidia-cuda-mps-control -d`)")


def probe() -> GpuProbe:
    """Probe CUDA, NVSHMEM, peer access and MPS for this process. Never raises.

    Example:
        >>> p = probe()
        >>> p.missing("cuda") is None or p.missing("cuda").startswith("cuda: ")
        True
    """
    try:
        cuda, uuids = _check_cuda()
        return GpuProbe(cuda=cuda, nvshmem=_check_nvshmem(cuda), peer=_check_peer(cuda, len(uuids)),
                        mps=_check_mps(), devices=uuids)
    except Exception as exc:  # noqa: BLE001 - belt and braces: a probe must not raise
        fail = Check(False, f"probe raised {_describe(exc)}")
        return GpuProbe(cuda=fail, nvshmem=fail, peer=fail, mps=fail)
