"""The GPU data plane: probe, NVSHMEM bootstrap and arenas.

Importing this package needs neither cuda-python nor nvshmem4py; the functions
that use them import them when called (install the ``gpu`` extra).
"""

from weightfabric.fabric.gpu.nvshmem_arena import (
    AllocationRegistry,
    NvshmemRuntime,
    SymmetricProgress,
    SymmetricRegion,
    attach_views,
)
from weightfabric.fabric.gpu.probe import Check, GpuProbe, normalise_uuid, probe
from weightfabric.fabric.gpu.uid import (
    HubRendezvous,
    MemoryRendezvous,
    Rendezvous,
    exchange_unique_id,
)

__all__ = [
    "AllocationRegistry",
    "Check",
    "GpuProbe",
    "HubRendezvous",
    "MemoryRendezvous",
    "NvshmemRuntime",
    "Rendezvous",
    "SymmetricProgress",
    "SymmetricRegion",
    "attach_views",
    "exchange_unique_id",
    "normalise_uuid",
    "probe",
]
