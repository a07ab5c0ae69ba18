"""`CudaIpcTransport`: read a GPU region of a holder on the same node through CUDA IPC.

The holder exports the allocation under its region (`export_tensor`:
``cuMemGetAddressRange`` finds the ``cudaMalloc`` base, ``cudaIpcGetMemHandle``
gives a 64-byte handle) and exposes the region on its `ReadServer` with that
`IpcHandle` as the ``gpu`` descriptor. The reader maps each allocation once
(``cudaIpcOpenMemHandle`` with lazy peer access) and copies with torch on its
own stream under a lease. Devices are named by UUID, never by index: indices
differ between processes with different ``CUDA_VISIBLE_DEVICES``.

Limits: IPC handles cover ``cudaMalloc`` memory, not the VMM memory of PyTorch's
caching allocator with ``expandable_segments``; `allocate` gives buffers from
``cudaMalloc`` for that case (`fabric.gpu.region.DeviceRegion` uses it).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import msgpack
import torch

from weightfabric.fabric.errors import ReadRefusedError, SourceLostError
from weightfabric.fabric.gpu.probe import normalise_uuid
from weightfabric.fabric.transports import client, held
from weightfabric.fabric.transports.base import CopyFn, ReadAbort, SourceAddress
from weightfabric.fabric.transports.pinned import PinnedMappings

HANDLE_NBYTES = 64  # CUDA_IPC_HANDLE_SIZE
MAX_MAPPINGS = 16


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
        """The descriptor as plain data."""
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
        """The descriptor as msgpack bytes (`unpack` reads them)."""
        return msgpack.packb(self.to_dict())

    @classmethod
    def unpack(cls, raw: bytes) -> IpcHandle:
        """The descriptor `pack` gave (ValueError if malformed)."""
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


@cache
def visible_devices() -> frozenset[str]:
    """UUIDs of the CUDA devices this process sees (read once)."""
    return frozenset(device_uuid(i) for i in range(torch.cuda.device_count()))


def device_index(uuid: str) -> int:
    """Local index of the visible device with ``uuid``; LookupError if not visible."""
    want = normalise_uuid(uuid)
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == want:
            return i
    raise LookupError(f"GPU {want} is not visible in this process")


@contextmanager
def _on_device(index: int) -> Iterator[None]:
    """GPU ``index`` current in this thread for cuda-bindings calls, then the caller's again.

    cuda-bindings links its own CUDA runtime, whose current device is not torch's:
    ``cudaSetDevice`` binds the device's primary context (which driver calls need,
    and a fresh thread lacks); torch's guard restores the caller's device after.
    """
    from cuda.bindings import runtime

    with torch.cuda.device(index):
        _check(runtime.cudaSetDevice(index), "cudaSetDevice")
        yield


def export_tensor(tensor: torch.Tensor) -> IpcHandle:
    """An `IpcHandle` for a contiguous CUDA tensor (its allocation's base + offset)."""
    from cuda.bindings import driver, runtime

    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError("export_tensor: needs a contiguous CUDA tensor")
    ptr = tensor.data_ptr()
    with _on_device(tensor.device.index):
        base, _ = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        (handle,) = _check(runtime.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle")
    raw = ctypes.string_at(handle.getPtr(), HANDLE_NBYTES)
    return IpcHandle(raw, ptr - int(base), tensor.numel() * tensor.element_size(),
                     device_uuid(tensor.device))


class _DevicePointer:
    """A CUDA byte range torch can wrap (``__cuda_array_interface__`` v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def _wrap(memory: _DevicePointer, device: int, what: str) -> torch.Tensor:
    """A uint8 tensor over `memory` labelled ``cuda:device``, never a copy of it.

    Raises:
        RuntimeError: torch copied the bytes (releases whose ``as_tensor`` ignores the
            device index of ``__cuda_array_interface__`` memory copy it elsewhere).
    """
    ptr = memory.ptr
    tensor = torch.as_tensor(memory, device=f"cuda:{device}")
    if tensor.data_ptr() != ptr:
        raise RuntimeError(f"torch {torch.__version__} copied {what} to cuda:{device} instead "
                           "of wrapping it")
    return tensor


class _DeviceMemory(_DevicePointer):
    """A ``cudaMalloc`` allocation, freed with its last reference.

    Torch keeps the object of a tensor made from ``__cuda_array_interface__`` while the
    tensor's storage lives, so that is when the last view of it is gone.
    """

    def __init__(self, ptr: int, nbytes: int, device: int) -> None:
        super().__init__(ptr, nbytes)
        self.ptr, self.device = ptr, device

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            from cuda.bindings import runtime

            with _on_device(self.device):
                runtime.cudaFree(self.ptr)


def allocate(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` of GPU memory from ``cudaMalloc``, as a flat uint8 tensor.

    ``nbytes`` of GPU memory from ``cudaMalloc``, outside torch's caching allocator, as a
    flat uint8 tensor: memory `export_tensor` covers whatever torch's allocator is set to.
    Freed when the last tensor over it is gone.

    Raises:
        RuntimeError: ``cudaMalloc`` failed (out of memory after emptying torch's
            cache once), or torch copied the memory instead of wrapping it.
    """
    from cuda.bindings import runtime

    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    with _on_device(index):
        result = runtime.cudaMalloc(nbytes)
        if result[0] == runtime.cudaError_t.cudaErrorMemoryAllocation:
            torch.cuda.empty_cache()  # torch may be caching the memory we need
            result = runtime.cudaMalloc(nbytes)
        (ptr,) = _check(result, f"cudaMalloc of {nbytes} bytes on cuda:{index}")
    return _wrap(_DeviceMemory(int(ptr), nbytes, index), index, "a cudaMalloc buffer")


@dataclass
class _Mapping:
    base: int
    device: int


def open_handle(h: IpcHandle) -> _Mapping:
    """Map ``h``'s allocation into this process (on its device, found by UUID)."""
    from cuda.bindings import runtime

    index = device_index(h.device_uuid)
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), h.handle, HANDLE_NBYTES)
    with _on_device(index):
        (base,) = _check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle")
    return _Mapping(int(base), index)


def view(mapping: _Mapping, offset: int, nbytes: int, device: int | None = None) -> torch.Tensor:
    """A uint8 CUDA tensor over ``nbytes`` at ``offset`` of a mapped allocation.

    A uint8 CUDA tensor over ``nbytes`` at ``offset`` of a mapped allocation, labelled with
    ``device`` (default: the GPU the memory is on, where the handle was opened). Another
    GPU's kernels can load it only with peer access from that GPU to the memory's, which
    opening the handle on the memory's own GPU does not enable.

    Raises:
        RuntimeError: torch copied the bytes instead of labelling them (releases
            whose ``as_tensor`` ignores the device index of ``__cuda_array_interface__``
            memory copy it to another device).
    """
    return _wrap(_DevicePointer(mapping.base + offset, nbytes),
                 mapping.device if device is None else device,
                 "a mapped GPU range (read it on its own GPU: device=None)")


def close_mapping(mapping: _Mapping) -> None:
    """Close a mapped IPC handle on its device."""
    from cuda.bindings import runtime

    with _on_device(mapping.device):
        _check(runtime.cudaIpcCloseMemHandle(mapping.base), "cudaIpcCloseMemHandle")


class CudaIpcTransport(client.ServerTransport):
    """Reader side over CUDA IPC.

    Sources are `ReadServer`s on this node exposing GPU regions with an `IpcHandle` as their
    ``gpu`` descriptor.

    Every read takes a lease, whose answer carries the handle (so a holder that
    moved the region to another allocation is followed), maps the allocation once
    per process (mappings are keyed by handle, and pinned at the holder so it does
    not free an allocation still mapped here: `PinnedMappings`), copies on a side
    stream of the destination's device, waits for its event, and ends the lease. `hold`
    takes one lease for a fetch's reads instead, whose copies `stream_copy` launches
    without waiting. At most `MAX_MAPPINGS` idle mappings stay open, and those of
    retracted regions are closed within a moment. `leased` hands the mapped bytes to the
    caller instead.
    """

    name = "cuda_ipc"
    leases_per_read = 1

    def __init__(self) -> None:
        super().__init__()
        self._mappings: PinnedMappings[_Mapping] = PinnedMappings(close_mapping,
                                                                  capacity=MAX_MAPPINGS)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """This transport's copy stream on CUDA ``device`` (one per GPU)."""
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device.index)
            return stream

    @contextmanager
    def leased(self, source: SourceAddress, region: str, offset: int, nbytes: int, *,
               timeout: float, device: int | None = None, prefix: bool = False,
               abort: ReadAbort | None = None) -> Iterator[torch.Tensor]:
        """Bytes of a holder's GPU region, mapped here as a CUDA tensor under a lease.

        Bytes ``[offset, offset + nbytes)`` of a holder's GPU region, mapped into this
        process as a uint8 CUDA tensor, under a lease: valid inside the block, and the
        holder's retract waits for it. Kernels may read it directly (e.g.
        `fabric.relayout.direct.run_direct`); synchronise them before the block ends.
        ``device`` labels the tensor for a kernel on another GPU of this process (default:
        the GPU the bytes are on; see `view` for what that takes). With ``prefix`` the
        tensor covers the present prefix of the range, and ``abort`` cuts the wait for the
        lease short (see `Transport.read`).

        Raises:
            ReadRefusedError: not present in time, out of range, or not IPC-exported.
            SourceLostError: the holder vanished or its GPU is not visible here.
        """
        with (self._pool.connection(source, abort) as conn,
              client.under_lease(conn, source, region, offset=offset, nbytes=nbytes,
                                 timeout=timeout, prefix=prefix) as where):
            try:
                h = IpcHandle.from_dict(where.gpu or {})
            except ValueError as exc:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is "
                                       f"not exported over CUDA IPC: {exc}") from None
            with self._mappings.use(h.handle, source, region, lambda: _map(h),
                                    timeout=timeout) as mapped:
                yield view(mapped, h.offset + offset, where.nbytes, device)

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None) -> int:
        """Copy bytes from the holder's GPU memory into `out` (see `Transport.read`)."""
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("read into a contiguous uint8 tensor")
        with self.leased(source, region, offset, out.numel(), timeout=timeout,
                         prefix=prefix, abort=abort) as src:
            self._launch(None, None, out[:src.numel()], src).wait()
            return src.numel()

    def hold(self, source: SourceAddress, region: str, nbytes: int, *, timeout: float,
             abort: ReadAbort | None = None) -> held.HeldLease:
        """One lease on ``[0, nbytes)`` of the holder's GPU region for many reads.

        The allocation is mapped (or found mapped: mappings stay open across versions
        while the holder keeps the buffer) once for the lease; its reads copy on this
        transport's stream with no round trip to the holder (`HeldLease`).

        Raises:
            as `read`.
        """
        def reach(grant: client.HoldGrant, stack: ExitStack) -> held.SourceBytes:
            try:
                h = IpcHandle.from_dict(grant.gpu or {})
            except ValueError as exc:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is "
                                       f"not exported over CUDA IPC: {exc}") from None
            mapped = stack.enter_context(self._mappings.use(h.handle, source, region,
                                                            lambda: _map(h), timeout=timeout))
            return lambda lo, hi: view(mapped, h.offset + lo, hi - lo)

        return held.take(source, region, nbytes, timeout=timeout, abort=abort,
                         source_bytes=reach, copy=self.stream_copy(None, None))

    def stream_copy(self, kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                    then: Callable[[list[int]], None] | None) -> CopyFn:
        """A copy function that launches on this transport's stream (`base.StreamCopy`).

        Each call enqueues, after the destination's users, ``kernel(dst, src)`` (or
        ``dst.copy_(src)``) and the copy of what the kernel returned into pinned host
        memory, records an event, and returns at once: its `Pending.wait` waits for the
        event (no ``synchronize``) and hands ``then`` the checksums. A held lease launches
        all of a read's pieces before waiting for the first. Bytes on another GPU than the
        destination are copied by ``copy_`` (peer to peer) without the kernel, and ``then``
        is not called: the fetch checksums what landed itself.
        """
        return partial(self._launch, kernel, then)

    def _launch(self, kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                then: Callable[[list[int]], None] | None, dst: torch.Tensor,
                src: torch.Tensor) -> _OnStream:
        """One piece of `stream_copy`: launched, not waited for."""
        stream = self._stream(dst.device if dst.device.type == "cuda" else src.device)
        if dst.device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(dst.device))  # dst may be in use
        host = None
        with torch.cuda.stream(stream):
            if kernel is None or src.device != dst.device:  # across GPUs: a peer copy_,
                dst.copy_(src, non_blocking=True)  # no sums (the fetch checksums dst)
            else:
                sums = kernel(dst, src)
                host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
                host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return _OnStream(done, host, then)

    def close(self) -> None:
        """Close the connections and unmap every mapping."""
        super().close()
        self._mappings.close()


class _OnStream:
    """A copy launched on a stream (`CudaIpcTransport.stream_copy`), done once its event is."""

    def __init__(self, done: torch.cuda.Event, sums: torch.Tensor | None,
                 then: Callable[[list[int]], None] | None) -> None:
        self._done, self._sums, self._then = done, sums, then

    def wait(self) -> None:
        """Wait for the event, then hand the checksums (now in host memory) on."""
        self._done.synchronize()
        if self._then is not None and self._sums is not None:
            self._then(self._sums.tolist())


def _map(h: IpcHandle) -> _Mapping:
    try:
        return open_handle(h)
    except (LookupError, RuntimeError) as exc:
        raise SourceLostError(f"cannot map GPU {h.device_uuid}'s allocation: {exc}") from exc
