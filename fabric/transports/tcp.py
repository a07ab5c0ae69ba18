"""`TcpTransport`: read a region from a `ReadServer` on any host."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from weightfabric.fabric.errors import TransportError
from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import ReadAbort, SourceAddress
from weightfabric.fabric.transports.wire import BLOB_LEN, DELTA_HEAD, Op


@dataclass(frozen=True)
class DeltaReply:
    """A holder's answer to a delta read: the base it used and one blob per chunk."""

    base: str
    blobs: list[memoryview]
    wire_bytes: int

    @classmethod
    def parse(cls, payload: bytearray, bases: list[str], most: int, region: str) -> DeltaReply:
        """Split a ``DELTA`` payload; `TransportError` if it is malformed."""
        def bad(why: str) -> TransportError:
            return TransportError(f"DELTA of {region!r}: malformed reply: {why}")

        if len(payload) < DELTA_HEAD.size:
            raise bad("shorter than its header")
        index, count = DELTA_HEAD.unpack_from(payload)
        if index >= len(bases) or not 0 < count <= most:
            raise bad(f"base {index} of {len(bases)}, {count} chunks of at most {most}")
        at = DELTA_HEAD.size + count * BLOB_LEN.size
        if len(payload) < at:
            raise bad("shorter than its blob lengths")
        view = memoryview(payload)
        blobs = []
        for i in range(count):
            (length,) = BLOB_LEN.unpack_from(payload, DELTA_HEAD.size + i * BLOB_LEN.size)
            blobs.append(view[at:at + length])
            at += length
        if at != len(payload):
            raise bad(f"blob lengths add up to {at} bytes, the payload has {len(payload)}")
        return cls(bases[index], blobs, len(payload))


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

    def read_delta(self, source: SourceAddress, region: str, offset: int, nbytes: int, *,
                   chunk_size: int, width: int, bases: list[str], timeout: float,
                   prefix: bool = False, abort: ReadAbort | None = None) -> DeltaReply:
        """The chunks of ``[offset, offset + nbytes)`` encoded against one of ``bases``.

        ``offset`` is a chunk boundary; the span's chunks (with `prefix`, the run the
        holder has from the first) come back as one blob each (`kernels.delta`).

        Raises:
            NoBaseError: the holder holds none of ``bases`` whole.
            SourceLostError, ReadRefusedError: as `read`.
            TransportError: the reply is malformed (not whole chunks, sizes that do not add up).
        """
        chunks = -(-nbytes // chunk_size)
        with self._pool.connection(source, abort) as conn:
            n = client.request(conn, source, Op.DELTA, region, offset=offset, nbytes=nbytes,
                               timeout=timeout, prefix=prefix, delta=(width, bases))
            # no blob is larger than its chunk whole, plus a header
            if n > DELTA_HEAD.size + chunks * (BLOB_LEN.size + 64) + nbytes:
                raise TransportError(f"DELTA of {region!r}: a reply of {n} bytes for "
                                     f"{nbytes} bytes of chunks")
            payload = bytearray(n)
            client.receive_into(conn, source, Op.DELTA, region, memoryview(payload))
        return DeltaReply.parse(payload, bases, chunks, region)

    def _pinned(self, nbytes: int) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._bounce.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]
