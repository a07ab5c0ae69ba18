"""A wire with a delay: Ethernet frames between two interfaces, each held for a fixed time.

Where the kernel has no ``sch_netem`` (`cluster_net.netem_missing`), `fabric bench
cluster` still emulates a WAN link's latency: the link's two routers are joined through a
namespace of its own whose two interfaces this process bridges, holding every frame for
the one-way ``delay`` before it passes it on, in order, both ways. TCP then sees the
link's real round trip (its windows, slow start and losses play out as over a long
link), while the rate is still shaped by the ``tbf`` on the routers' ends.

Frames are read and written with ``PACKET_VNET_HDR``: a segmentation-offloaded frame (up
to 64 KiB, checksum left to the hardware) passes as one, with its offload header, and
the kernel finishes it on the far side. One process per link, single-threaded: it costs
a few microseconds of CPU per frame (jumbo frames keep that to a few thousand a second
at the rates a 2-core host emulates). Frames that arrive while the process is behind
wait in the sockets' buffers (`SOCKET_BUFFER`); the delay is then longer, never shorter.

Run as ``python -m weightfabric.tools.bench.delay_line DEV_A DEV_B DELAY_S`` inside the
namespace that holds both interfaces; it prints ``ready`` once both are bound and runs
until killed (SIGTERM or SIGINT end it quietly).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
"""``<linux/socket.h>`` (Python 3.11's socket module does not name it)."""
PACKET_VNET_HDR = 15
"""``<linux/if_packet.h>``: frames carry a ``virtio_net_hdr`` (offloads) in both ways."""
MAX_FRAME = 65536 + 10
SOCKET_BUFFER = 32 << 20
"""Bytes each socket may hold (rate x delay at the emulated rates, with room)."""


def open_end(dev: str) -> socket.socket:
    """A non-blocking packet socket bound to ``dev``: all its frames, with offload headers."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    sock.bind((dev, 0))
    sock.setblocking(False)
    return sock


def run(dev_a: str, dev_b: str, delay: float) -> None:
    """Bridge ``dev_a`` and ``dev_b``, every frame held ``delay`` seconds. Never returns."""
    if not delay >= 0:
        raise ValueError(f"delay must be >= 0 seconds, got {delay}")
    a, b = open_end(dev_a), open_end(dev_b)
    # per direction: the socket frames arrive on, the one they leave by, those held
    lanes = {sock.fileno(): (sock, out, collections.deque[tuple[float, bytes]]())
             for sock, out in ((a, b), (b, a))}
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        due = min((held[0][0] for _, _, held in lanes.values() if held), default=now + 1.0)
        readable, _, _ = select.select(list(lanes), [], [], max(0.0, due - now))
        now = time.monotonic()
        for fd in readable:
            sock, _, held = lanes[fd]
            while True:
                try:
                    held.append((now + delay, sock.recv(MAX_FRAME)))
                except BlockingIOError:
                    break
        now = time.monotonic()
        for _, out, held in lanes.values():
            while held and held[0][0] <= now:
                # a full queue on the far side drops the frame, as a wire would
                with contextlib.suppress(OSError):
                    out.send(held.popleft()[1])


def main(argv: list[str] | None = None) -> int:
    """The command line: ``DEV_A DEV_B DELAY_S``; exits 2 on bad arguments."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m weightfabric.tools.bench.delay_line DEV_A DEV_B DELAY_S",
              file=sys.stderr)
        return 2
    try:
        delay = float(args[2])
    except ValueError:
        delay = -1.0
    if not delay >= 0:
        print(f"DELAY_S must be a number of seconds >= 0, got {args[2]!r}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        run(args[0], args[1], delay)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
