"""The transport interface: how a reader pulls bytes of a region a peer exposes.

Lifecycle. The holder exposes a region (a flat ``uint8`` tensor) under a name,
with a chunk size and a `ChunkProgress` when it is still filling it; readers then
read ``(region, offset, nbytes)`` into a local buffer, waiting (bounded) for the
chunks a partial replica does not have yet, and can query the holder's progress.
Before the holder reuses the memory it retracts the region, which waits for the
reads in flight to finish.

On CPU the holder side of both transports is one `ReadServer` per worker; the
reader side is `TcpTransport` (any host) or `ShmTransport` (same host: copies
straight from the holder's `/dev/shm` file). GPU transports implement the same
reader interface.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch

HOST_ID_ENV = "WEIGHTFABRIC_HOST_ID"


def local_host_id() -> str:
    """Identifies this machine: equal ids share /dev/shm (readers use shm, else tcp).

    Hostname + boot id, unless the environment variable ``WEIGHTFABRIC_HOST_ID`` is
    set (read at each call): processes given different ids read each other over
    TCP even on one machine, e.g. in network namespaces emulating datacenters.
    """
    return os.environ.get(HOST_ID_ENV) or _machine_id()


@cache
def _machine_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}:{boot}"


@dataclass(frozen=True)
class SourceAddress:
    """Where a holder's `ReadServer` listens, which machine it runs on, and the reader's pass.

    ``tls``: the holder serves over TLS only (`fabric.transports.tls`). ``nixl``: the
    name of the holder's NIXL agent, when it has one (`fabric.transports.nixl`). ``cap``
    is the capability the hub gave this reader to read one version there (it travels
    with every request; not part of the address: equal addresses compare equal).
    """

    host: str
    port: int
    host_id: str
    tls: bool = False
    nixl: str = field(default="", compare=False)
    cap: bytes = field(default=b"", compare=False, repr=False)

    def to_dict(self) -> dict[str, object]:
        """The address as plain data, without the capability (`from_dict` reads it back)."""
        out: dict[str, object] = {"host": self.host, "port": self.port, "host_id": self.host_id}
        if self.tls:
            out["tls"] = True
        if self.nixl:
            out["nixl"] = self.nixl
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], cap: bytes = b"") -> SourceAddress:
        """The address `to_dict` gave, with the capability to read there."""
        return cls(host=str(data["host"]), port=int(data["port"]), host_id=str(data["host_id"]),
                   tls=bool(data.get("tls", False)), nixl=str(data.get("nixl") or ""), cap=cap)


@dataclass(frozen=True)
class RegionInfo:
    """What a holder says about one exposed region."""

    nbytes: int
    chunk_size: int
    num_chunks: int
    present: int
    shm_path: str | None
    gpu: dict[str, Any] | None = None
    """How to reach the bytes in GPU memory (``{"kind": "cuda_ipc" | "nvshmem", ...}``);
    None for host memory."""


class ReadAbort:
    """Cuts reads short from another thread.

    A read given one registers the sockets it talks to the source on (`watch`);
    `abort` shuts them down, so the read raises `SourceLostError` at once instead of
    waiting out its timeout, and a read that registers afterwards fails at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._aborted = False

    @property
    def aborted(self) -> bool:
        """Whether `abort` was called."""
        return self._aborted

    def abort(self) -> None:
        """Shut down the watched sockets; later `watch` calls refuse."""
        with self._lock:
            self._aborted = True
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def watch(self, sock: socket.socket) -> bool:
        """Shut `sock` down on `abort`; False (not watched) if already aborted."""
        with self._lock:
            if not self._aborted:
                self._sockets.add(sock)
            return not self._aborted

    def unwatch(self, sock: socket.socket) -> bool:
        """Stop watching `sock`.

        True if `abort` came while it was watched (it may be shut down: do not reuse it).
        """
        with self._lock:
            self._sockets.discard(sock)
            return self._aborted


class Pending(Protocol):
    """A copy a device is still doing (`CopyFn`): its bytes are final once `wait` returns."""

    def wait(self) -> None:
        """Block until the copy is done (and hand on what it computed, where it does)."""


CopyFn = Callable[[torch.Tensor, torch.Tensor], Pending | None]
"""(dst, src): copy ``src`` into ``dst`` (same length; uint8, contiguous) and return None,
or start the copy on a device and return its `Pending` (a held lease launches all of a
read's pieces before it waits for the first: `fabric.transports.held`)."""

StreamCopy = Callable[[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                       Callable[[list[int]], None] | None], CopyFn]
"""A transport's ``stream_copy(kernel, then)`` method, where its held leases copy on a device
stream (CUDA IPC): the `CopyFn` that launches ``kernel(dst, src)``
(a copy that returns the chunks' checksums, e.g. `kernels.copy_with_checksums`; None: a
plain copy) on the transport's own stream, after the destination's users, and whose
`Pending.wait` waits for it by event and hands ``then`` the checksums (where it ran the
kernel: a copy it could not fuse leaves the checking to the fetch)."""


@dataclass(frozen=True)
class Landing:
    """How a read tells its caller that bytes have landed, before the read returns.

    A transport that `Transport.lands` calls ``call(n)`` once the first ``n`` bytes of
    `out` are final (received, copied, and for a lease, copied while it held), each
    time at least `step` more have landed and at the end; ``n`` only grows. The fetch
    engine verifies and marks each chunk there, so that a relay serves chunk k to its
    own readers while chunk k + 1 of the same read is still on its way. A copy
    function (``copy=``) is then called once per `step` (chunk-aligned pieces, in
    order). What ``call`` raises ends the read.
    """

    step: int
    call: Callable[[int], None]

    def pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` of each piece of `nbytes` to land in turn (one when `step` covers it)."""
        step = max(1, self.step)
        return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)] or [(0, 0)]


class Transport(ABC):
    """Reader side of a transport. Implementations are thread-safe."""

    name: str = "abstract"
    fuses_copy: bool = False
    """Whether `read` takes ``copy=``: a function that does its one copy into `out`
    (e.g. one that checksums the bytes as they pass, `kernels.copy_with_checksums`)."""
    lands: bool = False
    """Whether `read` (and a held lease's read) takes ``landing=`` (`Landing`): it reports
    bytes as they land instead of only when it returns."""
    leases_per_read: int = 0
    """Lease round trips one `read` takes from the holder (``LEASE``: 1; a plain request
    that carries the bytes: 0). Transports with a ``hold`` method (`fabric.transports.held`)
    take one lease per holder and fetch instead, when the fetch engine uses it."""

    @abstractmethod
    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None) -> int:
        """Copy ``out.numel()`` bytes at `offset` of the source's `region` into `out`.

        `out` is a contiguous ``uint8`` tensor. Waits at most `timeout` seconds for
        chunks a partial source does not have yet. With `prefix`, waits only for the
        chunk at `offset` and copies the run of chunks present from there (at least
        that one, at most ``out.numel()`` bytes) to the front of `out`. With `abort`,
        another thread can cut the read short (`ReadAbort`); once the call returns
        or raises, it writes nothing more into `out`.

        Returns:
            The bytes copied: ``out.numel()`` unless `prefix`.

        Raises:
            SourceLostError: the source is unreachable or vanished mid-read, or the
                read was aborted.
            ReadRefusedError: the source refused (see the message).
        """

    @abstractmethod
    def describe(self, source: SourceAddress, region: str, *, timeout: float) -> RegionInfo:
        """Size, chunking and progress of a region."""

    @abstractmethod
    def progress(self, source: SourceAddress, region: str, *, timeout: float) -> bytes:
        """The source's chunk bitmap for `region` (one byte per chunk, 1 = present)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and mappings."""
