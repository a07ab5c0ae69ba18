"""`TcpTransport`: read a region from a `ReadServer` on any host."""

from __future__ import annotations

import torch

from fabric.errors import SourceLostError, TransportError
from fabric.transports import client
from fabric.transports.base import SourceAddress
from fabric.transports.wire import Op, recv_into_exact


class TcpTransport(client.ServerTransport):
    """Reads over TCP, receiving straight into the caller's buffer (`recv_into`)."""

    name = "tcp"

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float) -> None:
        view = _byte_view(out)
        with self._pool.connection(source) as conn:
            n = client.request(conn, source, Op.READ, region, offset=offset, nbytes=len(view),
                               timeout=timeout)
            if n != len(view):
                raise TransportError(f"source sent {n} bytes for a read of {len(view)}")
            try:
                recv_into_exact(conn, view)
            except (OSError, ConnectionError) as exc:
                raise SourceLostError(f"source {source.host}:{source.port} vanished while "
                                      f"sending {region!r}: {exc}") from exc



def _byte_view(out: torch.Tensor) -> memoryview:
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("read into a contiguous uint8 CPU tensor")
    return memoryview(out.numpy()).cast("B")
