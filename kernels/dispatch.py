"""Kernel selection: Triton on CUDA tensors, the pure-torch reference elsewhere.

Every public kernel function takes ``backend: "triton" | "torch" | None``.
``None`` picks Triton when every tensor argument is on a CUDA device and torch
otherwise. ``"triton"`` on CPU tensors is allowed only under the Triton
interpreter (``TRITON_INTERPRET=1``, read when kernels are first imported), which
is how the CPU test-suite runs the kernels.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
BACKENDS: tuple[str, ...] = ("triton", "torch")

_log = logging.getLogger(__name__)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_backend(backend: str | None, *tensors: torch.Tensor, op: str = "kernel") -> Backend:
    """Resolve the backend for an operation on ``tensors``.

    Raises:
        ValueError: unknown backend name, or ``"triton"`` forced on CPU tensors
            outside interpreter mode, or tensors on different devices.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    on_cuda = bool(devices) and all(d.type == "cuda" for d in devices)
    if backend is None:
        chosen: Backend = "triton" if on_cuda else "torch"
        _log.debug("%s: backend %s picked for %s", op, chosen, devices)
        return chosen
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not on_cuda and not interpreting():
        raise ValueError(f"{op}: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 "
                         f"for CPU tensors (got {sorted(map(str, devices))})")
    return backend  # type: ignore[return-value]
