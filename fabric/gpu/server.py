"""`GpuReadServer`: the holder side for GPU regions (CUDA IPC, NVSHMEM).

Bytes of a GPU region never cross this server: readers map them (CUDA IPC) or
read them one-sidedly (NVSHMEM). The server speaks the CPU read protocol
(`fabric.transports.wire`) for what must stay two-sided: ``DESCRIBE`` (size,
chunking, progress, plus a ``gpu`` descriptor: the IPC handle or the NVSHMEM PE),
``BITMAP``, and ``LEASE``/``END``, which make a reader's copy a read in flight so
`retract` waits for it (the immutability contract). ``READ`` is refused.

It reuses `ReadServer`'s connection handling, leases and retract by overriding
`expose` and `_handle`; a ``describe_extra`` hook in `ReadServer` would make this
subclass smaller (see docs/gpu.md).
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import torch

from fabric.progress import ChunkProgress
from fabric.transports.server import ReadServer, _Exposed
from fabric.transports.wire import MAX_NAME, Op, Status


class _Extent:
    """Stands in for the bytes of a GPU region: only its length is used."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


class GpuReadServer(ReadServer):
    """`ReadServer` for regions in GPU memory, described by a ``gpu`` descriptor."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self._gpu: dict[str, dict[str, Any]] = {}

    def expose_gpu(self, name: str, nbytes: int, descriptor: dict[str, Any], *, chunk_size: int,
                   progress: ChunkProgress | None = None) -> None:
        """Serve a GPU region of ``nbytes`` described by ``descriptor`` (msgpack-able).

        Raises:
            ValueError: bad size, chunk size or progress, or ``name`` already exposed.
        """
        if nbytes <= 0 or chunk_size <= 0:
            raise ValueError(f"region {name!r}: nbytes and chunk_size must be positive")
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"region name longer than {MAX_NAME} bytes")
        num_chunks = -(-nbytes // chunk_size)
        if progress is None:
            progress = ChunkProgress(num_chunks, complete=True)
        elif progress.num_chunks != num_chunks:
            raise ValueError(f"region {name!r}: progress has {progress.num_chunks} chunks, the "
                             f"region {num_chunks}")
        msgpack.packb(descriptor)  # fail here, not in a reader's DESCRIBE
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} is already exposed; retract it first")
            self._regions[name] = _Exposed(_Extent(nbytes), chunk_size, progress, None)  # type: ignore[arg-type]
            self._gpu[name] = dict(descriptor)

    def expose(self, name: str, tensor: torch.Tensor, **kwargs: Any) -> None:
        raise ValueError("GpuReadServer serves GPU regions: use expose_gpu")

    def retract(self, name: str, *, timeout: float = 30.0) -> bool:
        done = super().retract(name, timeout=timeout)
        if done:
            with self._lock:
                self._gpu.pop(name, None)
        return done

    def _handle(self, conn: socket.socket, op: int, name: str, offset: int, nbytes: int,
                timeout: float) -> _Exposed | None:
        if op == Op.READ:
            self._reply(conn, Status.BAD_REQUEST, f"region {name!r} is in GPU memory; read it "
                                                  "with the cuda_ipc or nvshmem transport")
            return None
        if op != Op.DESCRIBE:
            return super()._handle(conn, op, name, offset, nbytes, timeout)
        region = self._begin(name)
        if region is None:
            self._reply(conn, Status.NOT_FOUND, f"no region {name!r} is exposed here")
            return None
        try:
            with self._lock:
                gpu = self._gpu.get(name, {})
            info = {"nbytes": len(region.data), "chunk_size": region.chunk_size,
                    "num_chunks": region.progress.num_chunks, "present": region.progress.count,
                    "shm_path": None, "gpu": gpu}
            self._reply(conn, Status.OK, payload=msgpack.packb(info))
        finally:
            self._end(region)
        return None
