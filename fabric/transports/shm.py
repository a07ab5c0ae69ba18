"""`ShmTransport`: read a region of a holder on the same host through `/dev/shm`."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from weightfabric.fabric.arena import ArenaError, Region
from weightfabric.fabric.errors import ReadRefusedError, SourceLostError
from weightfabric.fabric.transports import client, held
from weightfabric.fabric.transports.base import CopyFn, ReadAbort, SourceAddress

MAX_MAPPINGS = 16


class ShmTransport(client.ServerTransport):
    """Copies from the holder's mapped region under a lease from its `ReadServer`.

    The lease makes the copy a read in flight, so the holder's retract waits for
    it (contract 1); if the reader dies, the lease ends with its connection. The
    lease names the file the region lives in, so a holder that moves a version to
    another buffer is followed; the `MAX_MAPPINGS` most recently used files stay
    mapped (a holder's buffers are few and reused across versions).
    """

    name = "shm"

    def __init__(self) -> None:
        super().__init__()
        self._maps: OrderedDict[str, Region] = OrderedDict()
        self._lock = threading.Lock()

    def _mapping(self, path: str, end: int) -> Region:
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is not None and mapped.nbytes >= end:
                self._maps.move_to_end(path)
                return mapped
        try:
            mapped = Region.attach(path)
        except ArenaError as exc:
            raise SourceLostError(str(exc)) from exc
        if mapped.nbytes < end:
            mapped.close()
            raise SourceLostError(f"{path} holds {mapped.nbytes} bytes, the lease reaches {end}")
        with self._lock:
            old = self._maps.pop(path, None)
            self._maps[path] = mapped
            evicted = [self._maps.popitem(last=False)[1] for _ in range(len(self._maps) - MAX_MAPPINGS)]
        for region in [r for r in (old, *evicted) if r is not None]:
            region.close()  # the memory stays valid for copies still using it
        return mapped

    fuses_copy = True
    leases_per_read = 1

    def hold(self, source: SourceAddress, region: str, nbytes: int, *, timeout: float,
             abort: ReadAbort | None = None) -> held.HeldLease:
        """One lease on ``[0, nbytes)`` of the holder's region for many reads (`HeldLease`).

        Its reads copy from the mapped file with no round trip (``copy=`` as `read`).

        Raises:
            as `read`.
        """
        def reach(grant: client.HoldGrant, stack: ExitStack) -> held.SourceBytes:
            if not grant.shm_path:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} "
                                       "is not in shared memory; read it over tcp")
            mapped = self._mapping(grant.shm_path, nbytes).tensor
            return lambda lo, hi: mapped[lo:hi]

        return held.take(source, region, nbytes, timeout=timeout, abort=abort,
                         source_bytes=reach)

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None,
             copy: CopyFn | None = None) -> int:
        """Copy bytes from the holder's /dev/shm region into `out` (see `Transport.read`).

        With ``copy``, that function does the copy (`Transport.fuses_copy`).
        """
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("read into a contiguous uint8 tensor")
        with (self._pool.connection(source, abort) as conn,
              client.under_lease(conn, source, region, offset=offset, nbytes=out.numel(),
                                 timeout=timeout, prefix=prefix) as granted):
            if not granted.shm_path:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} "
                                       "is not in shared memory; read it over tcp")
            end = offset + granted.nbytes
            src = self._mapping(granted.shm_path, end).tensor[offset:end]
            if copy is None:
                out[:granted.nbytes].copy_(src)
            else:
                copy(out[:granted.nbytes], src)
        return granted.nbytes

    @contextmanager
    def mapped(self, source: SourceAddress, region: str, offset: int, nbytes: int,
               ranges: list[tuple[int, int]], *, timeout: float) -> Iterator[torch.Tensor]:
        """Lease bytes ``[offset, offset + nbytes)`` and yield the region's mapped bytes.

        For a reader that copies many blocks of one span (deriving a layout): one lease
        instead of one per block. The yielded tensor (uint8, the whole region as far as
        the span reaches: index it with region offsets) may be read only inside the block
        and only within the span; ``ranges`` declares the parts it copies (what the
        holder counts as served, `Flag.RANGES`).

        Raises:
            as `read`; SourceLostError: the lease was not held to the end (discard what
                was copied).
        """
        with (self._pool.connection(source, None) as conn,
              client.under_lease(conn, source, region, offset=offset, nbytes=nbytes,
                                 timeout=timeout, ranges=ranges) as granted):
            if not granted.shm_path:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} "
                                       "is not in shared memory; read it over tcp")
            yield self._mapping(granted.shm_path, offset + nbytes).tensor

    def close(self) -> None:
        """Close the connections and unmap every region."""
        super().close()
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mapped in maps:
            mapped.close()
