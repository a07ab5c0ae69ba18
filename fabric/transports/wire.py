"""The byte layout of the read protocol spoken between `ReadServer` and the transports.

Every request is a fixed header followed by the region name and the reader's
capability (`fabric.auth`: the hub's signed permission to read this version here;
empty when the holder checks none)::

    magic "WFR5" | op u8 | flags u8 | name_len u16 | offset u64 | nbytes u64 | timeout f32
    | cap_len u16

Every reply is a fixed header, then a UTF-8 message (errors) and a payload::

    status u8 | pad 3 | msg_len u32 | payload_len u64

A holder that checks capabilities answers ``FORBIDDEN`` to a request without a valid
one (none, forged, expired, or for another version), and to a ``LEASE`` past its
limit of leases per reader, before any work. A connection carries one request at a time, and the server bounds every wait on
the reader (between requests, for ``END``, for a reply to be taken: see
`fabric.transports.server`). Ops:

- ``READ``: wait (up to timeout) until the chunks covering ``[offset, offset+nbytes)``
  are present, then send those bytes as the payload. ``NOT_READY`` when they are not
  by then, or sooner when the region stalls (the server's ``stall_timeout``).
- ``LEASE``: the same wait; the payload is msgpack ``{shm_path, gpu, nbytes}``: where
  the reader copies the bytes from itself (the holder's `/dev/shm` file, or its GPU
  memory through the ``gpu`` descriptor), then it sends ``END``. The server counts
  the lease as a read in flight until ``END`` arrives or the connection drops; a
  lease held longer than the server's ``LEASE_HOLD`` is ended by dropping it.
- ``END``: ends the connection's lease; ``OK`` means the lease held until then, so
  the bytes the reader copied under it are whole. No ``OK`` (the connection was
  dropped: the lease ran out, or the server closed) means they may not be: discard
  them.
- ``DESCRIBE``: payload is msgpack ``{nbytes, chunk_size, num_chunks, present, shm_path, gpu}``
  (``gpu``: None for host memory, else a descriptor such as a CUDA IPC handle).
- ``BITMAP``: payload is one byte per chunk, 1 where the chunk is present.
- ``PIN``: the reader has mapped the region's memory (CUDA IPC) and keeps this
  connection open for as long as it does: the server keeps the memory referenced
  until the connection closes. Answered OK while the region is exposed, even if
  it is being retracted (else ``NOT_FOUND``); after the OK the connection takes no
  requests and carries one more reply at most: ``NOT_FOUND`` once the region is
  retracted or the server closes, the reader's cue to unmap it and close.

With the ``PREFIX`` flag, ``READ`` and ``LEASE`` wait only for the chunk at
``offset`` and grant the run of present chunks from there, up to ``nbytes``: a
partial replica serves what it has in one request. The granted length is the
``READ`` payload's length, and the ``LEASE`` payload's ``nbytes``.

``DELTA`` asks for whole chunks of a version as deltas against an older version the
reader holds (`kernels.delta`): the header's span starts at a chunk boundary; the
capability is followed by ``width u8 | count u8`` and ``count`` base region names
(``len u16 | name``, at most `MAX_BASES`), the reader's bases, best first. The holder
waits for the chunks as ``READ`` does (``PREFIX`` allowed), encodes each against the
first base it holds whole (or takes the encoding from its cache) and answers
``base u16 | chunks u32 | chunks x blob_len u32 | blobs``; ``NO_BASE`` when it holds
none of them (the reader then reads those chunks whole).

``HOLD`` is the lease of a whole fetch: one per reader, holder and version instead of
one ``LEASE``/``END`` per read. It leases the span ``[offset, offset+nbytes)`` at once,
present or not (it waits for nothing), and its payload is msgpack ``{shm_path, gpu,
nixl, nbytes, complete, hold}``: where the bytes are, whether every chunk is present
already, and the seconds the server keeps the lease without a request (its
``LEASE_HOLD``). Under it the reader copies present bytes of the span itself, with no
further round trip; ``WAIT`` (``PREFIX`` allowed) waits for chunks of the span as
``LEASE`` does and answers msgpack ``{nbytes}``, the bytes present from ``offset``; any
request restarts the hold. ``END`` ends it, its header's ``nbytes`` being the bytes the
reader copied (what the holder counts as served, at most the span). A reader trusts a
copy only if it finished within ``hold`` seconds of its last reply, less a margin, and
the connection was not closed meanwhile (`fabric.transports.held`).

With the ``RANGES`` flag (``LEASE`` only, not with ``PREFIX``) the capability is
followed by ``count u32`` and ``count`` pairs ``offset u64 | nbytes u64``
(at most `MAX_RANGES`), each inside ``[offset, offset+nbytes)`` of the header: the
bytes the reader will copy out of the leased span (a reader deriving a layout copies
many blocks under one lease). The holder counts those as served, not the span.
"""

from __future__ import annotations

import enum
import socket
import struct
import time

MAGIC = b"WFR5"  # WFR4 had no HOLD or WAIT; WFR3 no capability; WFR2 sent END without a reply
REQUEST = struct.Struct("!4sBBHQQfH")
REPLY = struct.Struct("!BxxxIQ")
MAX_NAME = 1024
RANGE_COUNT = struct.Struct("!I")
RANGE = struct.Struct("!QQ")
MAX_RANGES = 4096
"""Ranges one ``LEASE`` may declare (`Flag.RANGES`)."""
DELTA_ASK = struct.Struct("!BB")      # word width, number of bases
BASE_NAME = struct.Struct("!H")
DELTA_HEAD = struct.Struct("!HI")     # index of the base used, number of chunks
BLOB_LEN = struct.Struct("!I")
MAX_BASES = 4
"""Bases one ``DELTA`` request may name."""


class Op(enum.IntEnum):
    """Request operations."""
    READ = 1
    LEASE = 2
    END = 3
    DESCRIBE = 4
    BITMAP = 5
    PIN = 6
    DELTA = 7
    HOLD = 8
    WAIT = 9


class Flag(enum.IntFlag):
    """Request flags."""
    PREFIX = 1         # grant the present prefix of the range (see above)
    RANGES = 2         # LEASE: the request declares the ranges the reader copies


class Status(enum.IntEnum):
    """Reply statuses."""
    OK = 0
    NOT_FOUND = 1      # unknown or retracted region
    OUT_OF_RANGE = 2
    NOT_READY = 3      # the chunks did not arrive within the timeout, or the region stalled
    BAD_REQUEST = 4
    FORBIDDEN = 5      # no valid capability for the region, or too many leases
    NO_BASE = 6        # DELTA: none of the reader's bases is held here whole


def recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    """Receive exactly `nbytes`, as `recv_into_exact`."""
    buf = bytearray(nbytes)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; ConnectionError if the peer closes first.

    With `deadline` (a `time.monotonic` time), TimeoutError once it passed: the socket's
    timeout is set to the time left before each receive.
    """
    got = 0
    while got < len(view):
        try:
            if deadline is not None:
                sock.settimeout(max(deadline - time.monotonic(), 1e-6))
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise TimeoutError(f"timed out with {got} of {len(view)} bytes received") from None
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n
