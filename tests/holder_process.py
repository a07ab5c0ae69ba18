"""A holder for the transport tests: the ``holder`` role of `procs`.

Usage: ``procs.Child("holder", NBYTES, CHUNK_SIZE[, "--partial"])``, or
``python tests/procs.py holder NBYTES CHUNK_SIZE [--partial]`` (JSON lines).

Creates a /dev/shm region filled with `pattern`, exposes it as region "v1" on a
ReadServer (complete, or with no chunk present with ``--partial``) and replies
``{"ready": true, "port": P, "shm_path": PATH}``; then answers, one reply each:

- ``{"op": "mark", "chunk": K}`` -> ``{}``: chunk K becomes present;
- ``{"op": "retract", "timeout": S}`` -> ``{"retracted": bool}``;
- ``{"op": "served"}`` -> ``{"bytes": N}``: bytes served so far;
- ``{"op": "exit"}``: closes the server and removes the region.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def pattern(nbytes: int) -> torch.Tensor:
    """Bytes that differ at every position modulo 251 (a prime), so shifts show."""
    return (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8)


def role(argv: list[str], commands: Iterator[dict[str, Any]],
         reply: Callable[[dict[str, Any]], None]) -> None:
    """The ``holder`` role (see the module docstring)."""
    from weightfabric.fabric.arena import Region
    from weightfabric.fabric.progress import ChunkProgress
    from weightfabric.fabric.transports import ReadServer

    nbytes, chunk_size = int(argv[0]), int(argv[1])
    region = Region.create("test-holder", nbytes)
    region.tensor.copy_(pattern(nbytes))
    progress = ChunkProgress(-(-nbytes // chunk_size), complete="--partial" not in argv)
    server = ReadServer()
    try:
        server.expose("v1", region.tensor, chunk_size=chunk_size, progress=progress,
                      shm_path=str(region.path))
        reply({"ready": True, "port": server.address.port, "shm_path": str(region.path)})
        for cmd in commands:
            if cmd["op"] == "mark":
                progress.mark(cmd["chunk"])
                reply({})
            elif cmd["op"] == "retract":
                reply({"retracted": server.retract("v1", timeout=cmd["timeout"])})
            elif cmd["op"] == "served":
                reply({"bytes": server.bytes_served})
            else:
                reply({"error": "ValueError", "message": f"unknown op {cmd['op']!r}"})
    finally:
        server.close()
        region.close()


if __name__ == "__main__":
    import sys

    import procs

    sys.exit(procs.main(["holder", *sys.argv[1:]]))
