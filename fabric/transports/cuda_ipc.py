"""`CudaIpcTransport`: read a GPU region of a holder on the same node through CUDA IPC.

The holder exports the allocation under its region (`export_tensor`:
``cuMemGetAddressRange`` finds the ``cudaMalloc`` base, ``cudaIpcGetMemHandle``
gives a 64-byte handle) and serves an `IpcHandle` in the ``gpu`` descriptor of
its `GpuReadServer`. The reader opens the handle once per (source, region)
(``cudaIpcOpenMemHandle`` with lazy peer access), caches the mapping, and for
every read takes a lease, copies with torch on its own stream, waits for the
copy, and ends the lease. Devices are named by UUID, never by index: indices
differ between processes with different ``CUDA_VISIBLE_DEVICES``.

Limits: IPC handles cover ``cudaMalloc`` memory; PyTorch's caching allocator with
``expandable_segments`` uses VMM memory, which needs POSIX-fd handles instead.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from fabric.errors import ReadRefusedError, SourceLostError
from fabric.gpu.probe import normalise_uuid
from fabric.transports import client
from fabric.transports.base import SourceAddress
from fabric.transports.wire import Op

HANDLE_NBYTES = 64  # CUDA_IPC_HANDLE_SIZE


@dataclass(frozen=True)
class IpcHandle:
    """What a reader needs to map a holder's region: handle, offset in it, size, device."""

    handle: bytes
    offset: int
    nbytes: int
    device_uuid: str

    def __post_init__(self) -> None:
        if len(self.handle) != HANDLE_NBYTES:
            raise ValueError(f"CUDA IPC handle must be {HANDLE_NBYTES} bytes, got {len(self.handle)}")
        if self.offset < 0 or self.nbytes <= 0:
            raise ValueError(f"bad IPC range: offset {self.offset}, nbytes {self.nbytes}")
        object.__setattr__(self, "device_uuid", normalise_uuid(self.device_uuid))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "cuda_ipc", "handle": self.handle, "offset": self.offset,
                "nbytes": self.nbytes, "device_uuid": self.device_uuid}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IpcHandle:
        """Raises ValueError on anything that is not an IPC descriptor."""
        if not isinstance(data, dict) or data.get("kind") != "cuda_ipc":
            raise ValueError(f"not a CUDA IPC descriptor: {data!r:.200}")
        try:
            return cls(bytes(data["handle"]), int(data["offset"]), int(data["nbytes"]),
                       str(data["device_uuid"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed CUDA IPC descriptor: {exc}") from None

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict())

    @classmethod
    def unpack(cls, raw: bytes) -> IpcHandle:
        try:
            data = msgpack.unpackb(raw)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is malformed input
            raise ValueError(f"CUDA IPC descriptor is not msgpack: {exc}") from None
        return cls.from_dict(data)


def _check(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return tuple(rest)


def device_uuid(device: torch.device | int) -> str:
    """Normalised UUID of a local CUDA device."""
    return normalise_uuid(torch.cuda.get_device_properties(device).uuid)


def device_index(uuid: str) -> int:
    """Local index of the visible device with ``uuid``; LookupError if not visible."""
    want = normalise_uuid(uuid)
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == want:
            return i
    raise LookupError(f"GPU {want} is not visible in this process")


def export_tensor(tensor: torch.Tensor) -> IpcHandle:
    """An `IpcHandle` for a contiguous CUDA tensor (its allocation's base + offset)."""
    from cuda.bindings import driver, runtime

    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError("export_tensor: needs a contiguous CUDA tensor")
    ptr = tensor.data_ptr()
    base, _ = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    (handle,) = _check(runtime.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle")
    raw = ctypes.string_at(handle.getPtr(), HANDLE_NBYTES)
    return IpcHandle(raw, ptr - int(base), tensor.numel() * tensor.element_size(),
                     device_uuid(tensor.device))


class _DevicePointer:
    """A CUDA byte range torch can wrap (``__cuda_array_interface__`` v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


@dataclass
class _Mapping:
    base: int
    tensor: torch.Tensor


def open_handle(h: IpcHandle) -> _Mapping:
    """Map ``h`` into this process (on its device, found by UUID)."""
    from cuda.bindings import runtime

    index = device_index(h.device_uuid)
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), h.handle, HANDLE_NBYTES)
    with torch.cuda.device(index):
        (base,) = _check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle")
        tensor = torch.as_tensor(_DevicePointer(int(base) + h.offset, h.nbytes), device=f"cuda:{index}")
    return _Mapping(int(base), tensor)


def close_mapping(mapping: _Mapping) -> None:
    from cuda.bindings import runtime

    _check(runtime.cudaIpcCloseMemHandle(mapping.base), "cudaIpcCloseMemHandle")


class CudaIpcTransport(client.ServerTransport):
    """Reader side over CUDA IPC; sources are `GpuReadServer`s on this node."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[tuple[str, int, str], _Mapping] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def describe_gpu(self, source: SourceAddress, region: str, *, timeout: float) -> dict[str, Any]:
        """The region's raw DESCRIBE answer, ``gpu`` descriptor included."""
        with self._pool.connection(source) as conn:
            n = client.request(conn, source, Op.DESCRIBE, region, timeout=timeout)
            return msgpack.unpackb(client.receive_payload(conn, source, n))

    def _mapping(self, source: SourceAddress, region: str, timeout: float) -> _Mapping:
        key = (source.host, source.port, region)
        with self._lock:
            mapped = self._maps.get(key)
        if mapped is not None:
            return mapped
        info = self.describe_gpu(source, region, timeout=timeout)
        try:
            handle = IpcHandle.from_dict(info.get("gpu", {}))
        except ValueError as exc:
            raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is not "
                                   f"exported over CUDA IPC: {exc}") from None
        try:
            mapped = open_handle(handle)
        except (LookupError, RuntimeError) as exc:
            raise SourceLostError(f"cannot map region {region!r}: {exc}") from exc
        with self._lock:
            if key in self._maps:  # another thread won the race
                close_mapping(mapped)
                return self._maps[key]
            self._maps[key] = mapped
            return mapped

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            return self._streams.setdefault(device.index, torch.cuda.Stream(device))

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float) -> None:
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cuda":
            raise ValueError("read into a contiguous uint8 CUDA tensor")
        mapped = self._mapping(source, region, timeout)
        n = out.numel()
        with self._pool.connection(source) as conn:
            client.lease(conn, source, region, offset=offset, nbytes=n, timeout=timeout)
            try:
                stream = self._stream(out.device)
                stream.wait_stream(torch.cuda.current_stream(out.device))  # out may be in use
                with torch.cuda.stream(stream):
                    out.copy_(mapped.tensor[offset:offset + n], non_blocking=True)
                stream.synchronize()
            finally:
                client.request(conn, source, Op.END, region, timeout=timeout)

    def forget(self, source: SourceAddress, region: str) -> None:
        """Unmap a region (after its holder retracted it)."""
        with self._lock:
            mapped = self._maps.pop((source.host, source.port, region), None)
        if mapped is not None:
            close_mapping(mapped)

    def close(self) -> None:
        super().close()
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mapped in maps:
            close_mapping(mapped)
