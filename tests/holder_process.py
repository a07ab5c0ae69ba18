"""A holder worker for transport tests, run as a separate process.

Usage: python tests/holder_process.py NBYTES CHUNK_SIZE [--partial]

Creates a /dev/shm region filled with a known pattern (see `pattern`), exposes it
as region "v1" on a ReadServer, prints ``READY <port> <shm_path>`` and then obeys
commands on stdin, one per line: ``mark K`` (chunk K becomes present),
``retract`` (prints ``RETRACTED <True|False>``), ``served`` (prints the bytes
served), ``exit``.
"""

import sys

import torch

from weightfabric.fabric.arena import Region
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer


def pattern(nbytes: int) -> torch.Tensor:
    """Bytes that differ at every position modulo 251 (a prime), so shifts show."""
    return (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8)


def main() -> None:
    nbytes, chunk_size = int(sys.argv[1]), int(sys.argv[2])
    partial = "--partial" in sys.argv
    region = Region.create("test-holder", nbytes)
    region.tensor.copy_(pattern(nbytes))
    num_chunks = -(-nbytes // chunk_size)
    progress = ChunkProgress(num_chunks, complete=not partial)
    server = ReadServer()
    server.expose("v1", region.tensor, chunk_size=chunk_size, progress=progress,
                  shm_path=str(region.path))
    print(f"READY {server.address.port} {region.path}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "mark":
            progress.mark(int(cmd[1]))
        elif cmd[0] == "retract":
            print(f"RETRACTED {server.retract('v1', timeout=float(cmd[1]))}", flush=True)
        elif cmd[0] == "served":
            print(f"SERVED {server.bytes_served}", flush=True)
        elif cmd[0] == "exit":
            break
    server.close()
    region.close()


if __name__ == "__main__":
    main()
