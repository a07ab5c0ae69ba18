"""`TcpTransport`: read a region from a `ReadServer` on any host."""

from __future__ import annotations

import threading

import torch

from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import ReadAbort, SourceAddress
from weightfabric.fabric.transports.wire import Op


class TcpTransport(client.ServerTransport):
    """Reads over TCP, receiving straight into the caller's buffer (`recv_into`).

    A CUDA destination receives into a pinned host buffer first (one per reading
    thread, grown to the largest read), then copies to the device.
    """

    name = "tcp"

    def __init__(self) -> None:
        super().__init__()
        self._bounce = threading.local()

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None) -> int:
        """Read bytes from the holder over TCP into `out` (see `Transport.read`)."""
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("read into a contiguous uint8 tensor")
        host = out if out.device.type == "cpu" else self._pinned(out.numel())
        # numpy's stubs declare ndarray.__buffer__ only for Python 3.12+.
        view = memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]
        with self._pool.connection(source, abort) as conn:
            n = client.request(conn, source, Op.READ, region, offset=offset, nbytes=len(view),
                               timeout=timeout, prefix=prefix)
            client.check_grant(n, len(view), prefix)
            client.receive_into(conn, source, Op.READ, region, view[:n])
        if host is not out:
            out[:n].copy_(host[:n])  # synchronous: the bounce buffer is free again on return
        return n

    def _pinned(self, nbytes: int) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._bounce.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]
