"""Raw TCP over an emulated cluster: what its shaped links carry without the fabric.

::

    python -m weightfabric.tools.bench.cluster_raw CLUSTER '[["node-0", "node-1", 0.5], ...]'
        [--size 128MB]

Builds the cluster's namespaces as `fabric bench cluster` does (same default scale),
starts one receiver per destination node and one sender per flow ``[source node,
destination node, fraction of --size]``, all sending at once, and prints JSON: when each
destination had received all its bytes (seconds after the start), the slowest, and the
bytes each WAN link carried (frames, as `fabric bench cluster` counts them). Plain
sockets, no fabric: the ceiling `fabric bench cluster`'s efficiency is measured under.
Needs root, like `fabric bench cluster`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

RECEIVE = r"""
import selectors, socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conns = [server.accept()[0] for _ in range(int(sys.argv[2]))]
sel = selectors.DefaultSelector()
for c in conns:
    sel.register(c, selectors.EVENT_READ)
buf, left = bytearray(1 << 20), len(conns)
while left:
    for key, _ in sel.select():
        if key.fileobj.recv_into(buf) == 0:
            sel.unregister(key.fileobj)
            left -= 1
print(time.time(), flush=True)
"""
SEND = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
start, left, block = float(sys.argv[4]), int(sys.argv[3]), bytes(1 << 20)
time.sleep(max(0.0, start - time.time()))
while left > 0:
    conn.sendall(block[:min(left, len(block))])
    left -= len(block)
conn.close()
"""
PORT = 5555


def raw_flows(cluster: str, flows: list[tuple[str, str, float]], size: int) -> dict[str, object]:
    """Send the flows at once over the emulated `cluster`; when each destination was done."""
    from weightfabric.tools.bench.cluster import (
        DEFAULT_BUDGET,
        DEFAULT_CHUNK,
        auto_scale,
        load,
        roles,
    )
    from weightfabric.tools.bench.cluster_net import emulate, unavailable
    from weightfabric.topology.units import parse_bandwidth, parse_size

    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    loaded = load(cluster)
    trainer, readers = roles(loaded)
    scale = auto_scale(loaded, trainer, readers, size, int(parse_size(DEFAULT_CHUNK)),
                       parse_bandwidth(DEFAULT_BUDGET))  # the scale `fabric bench cluster` runs at
    with emulate(loaded, scale=scale, nodes=[trainer, *readers], prefix="wfraw") as net:
        receivers = {d: subprocess.Popen(
            [*net.exec_prefix(d), sys.executable, "-c", RECEIVE, str(PORT),
             str(sum(1 for _, to, _ in flows if to == d))], stdout=subprocess.PIPE, text=True)
            for d in sorted({to for _, to, _ in flows})}
        try:
            time.sleep(1.0)  # the receivers listen
            wan0 = net.wan_bytes()
            start = time.time() + 1.0
            senders = [subprocess.Popen([*net.exec_prefix(s), sys.executable, "-c", SEND,
                                         net.address(d), str(PORT), str(int(size * f)),
                                         str(start)]) for s, d, f in flows]
            done = {d: float(p.stdout.readline()) - start  # type: ignore[union-attr]
                    for d, p in receivers.items()}
            for sender in senders:
                sender.wait(60)
            wan1 = net.wan_bytes()
        finally:
            for receiver in receivers.values():
                receiver.kill()
    return {"cluster": cluster, "scale": scale, "bytes": size, "done_s": done,
            "max_s": max(done.values()), "wan_bytes": {k: wan1[k] - wan0[k] for k in wan1}}


def main(argv: list[str] | None = None) -> int:
    """The command line: the flows' JSON result on standard output."""
    from weightfabric.topology.units import parse_size

    parser = argparse.ArgumentParser(prog="python -m weightfabric.tools.bench.cluster_raw",
                                     description=__doc__.split("::")[0].strip())
    parser.add_argument("cluster", help="cluster YAML (path, or a reference cluster's name)")
    parser.add_argument("flows", help='JSON list of [source node, destination node, fraction]')
    parser.add_argument("--size", default="128MB", help="bytes a fraction of 1 sends")
    args = parser.parse_args(argv)
    flows = [(str(s), str(d), float(f)) for s, d, f in json.loads(args.flows)]
    print(json.dumps(raw_flows(args.cluster, flows, int(parse_size(args.size)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
