"""`TcpTransport`: read a region from a `ReadServer` on any host."""

from __future__ import annotations

import threading

import torch

from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import Landing, ReadAbort, SourceAddress
from weightfabric.fabric.transports.wire import Op


class TcpTransport(client.ServerTransport):
    """Reads over TCP, receiving straight into the caller's buffer (`recv_into`).

    A CUDA destination receives into a pinned host buffer first (one per reading
    thread, grown to the largest read), then copies to the device.
    """

    name = "tcp"
    lands = True

    def __init__(self) -> None:
        super().__init__()
        self._bounce = threading.local()

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None,
             landing: Landing | None = None) -> int:
        """Read bytes from the holder over TCP into `out` (see `Transport.read`).

        With `landing`, each piece is told as it lands (a CUDA `out`: once copied there).
        """
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("read into a contiguous uint8 tensor")
        host = out if out.device.type == "cpu" else self._pinned(out.numel())
        if landing is not None and host is not out:
            landing = _through_bounce(landing, host, out)
        # numpy's stubs declare ndarray.__buffer__ only for Python 3.12+.
        view = memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]
        with self._pool.connection(source, abort) as conn:
            n = client.request(conn, source, Op.READ, region, offset=offset, nbytes=len(view),
                               timeout=timeout, prefix=prefix)
            client.check_grant(n, len(view), prefix)
            client.receive_into(conn, source, Op.READ, region, view[:n], landing)
        if host is not out and landing is None:
            out[:n].copy_(host[:n])  # synchronous: the bounce buffer is free again on return
        return n

    def _pinned(self, nbytes: int) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._bounce.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]


def _through_bounce(landing: Landing, host: torch.Tensor, out: torch.Tensor) -> Landing:
    """`landing` for bytes received into `host` that belong in `out`.

    Each piece is copied there (synchronously) before it is told.
    """
    done = 0

    def call(n: int) -> None:
        nonlocal done
        out[done:n].copy_(host[done:n])
        done = n
        landing.call(n)

    return Landing(landing.step, call)
