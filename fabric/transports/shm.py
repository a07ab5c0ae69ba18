"""`ShmTransport`: read a region of a holder on the same host through `/dev/shm`."""

from __future__ import annotations

import threading

import torch

from fabric.arena import ArenaError, Region
from fabric.errors import ReadRefusedError, SourceLostError
from fabric.transports import client
from fabric.transports.base import RegionInfo, SourceAddress, Transport
from fabric.transports.wire import Op


class ShmTransport(Transport):
    """Copies from the holder's mapped region under a lease from its `ReadServer`.

    The lease makes the copy a read in flight, so the holder's retract waits for
    it (contract 1); if the reader dies, the lease ends with its connection.
    """

    name = "shm"

    def __init__(self) -> None:
        self._pool = client.ConnectionPool()
        self._maps: dict[tuple[str, int, str], Region] = {}
        self._lock = threading.Lock()

    def _mapping(self, source: SourceAddress, region: str, timeout: float) -> Region:
        key = (source.host, source.port, region)
        with self._lock:
            mapped = self._maps.get(key)
        if mapped is not None:
            return mapped
        info = self.describe(source, region, timeout=timeout)
        if info.shm_path is None:
            raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} "
                                   "is not in shared memory; read it over tcp")
        try:
            mapped = Region.attach(info.shm_path, info.nbytes)
        except ArenaError as exc:
            raise SourceLostError(str(exc)) from exc
        with self._lock:
            return self._maps.setdefault(key, mapped)

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float) -> None:
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read into a contiguous uint8 CPU tensor")
        mapped = self._mapping(source, region, timeout)
        with self._pool.connection(source) as conn:
            client.request(conn, source, Op.LEASE, region, offset=offset, nbytes=out.numel(),
                           timeout=timeout)
            try:
                out.copy_(mapped.tensor[offset:offset + out.numel()])
            finally:
                client.request(conn, source, Op.END, region, timeout=timeout)

    def describe(self, source: SourceAddress, region: str, *, timeout: float) -> RegionInfo:
        return client.describe(self._pool, source, region, timeout)

    def progress(self, source: SourceAddress, region: str, *, timeout: float) -> bytes:
        return client.bitmap(self._pool, source, region, timeout)

    def forget(self, source: SourceAddress, region: str) -> None:
        """Drop the mapping of a region (after its holder retracted it)."""
        with self._lock:
            mapped = self._maps.pop((source.host, source.port, region), None)
        if mapped is not None:
            mapped.close()

    def close(self) -> None:
        self._pool.close()
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mapped in maps:
            mapped.close()
