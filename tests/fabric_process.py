"""A fabric worker in its own process, driven by JSON lines on stdin (for tests).

Usage: python tests/fabric_process.py HUB_URL WORKER_NAME [--read-delay S]

Prints ``{"ready": true}`` once joined, then answers one JSON line per command:

- ``{"op": "publish", "seed": N, "mb": M}`` -> ``{"version": V}``: publishes the
  tensor set `tensor_set(N, M)` (snapshot).
- ``{"op": "fetch", "version": V, "verify": bool|null}`` -> fetch stats, plus
  ``"exact"``: whether the fetched tensors equal `tensor_set(seed, mb)` of the last
  ``expect`` command.
- ``{"op": "expect", "seed": N, "mb": M}`` -> ``{}``: what fetches must reproduce.
- ``{"op": "retract", "version": V, "wait": S}`` -> ``{"state": ...}``.
- ``{"op": "corrupt"}`` -> ``{}``: flips one byte in every chunk of the active version.
- ``{"op": "served"}`` -> ``{"bytes": N}``: bytes this worker served.
- ``{"op": "exit"}``.

Errors come back as ``{"error": "TypeName", "message": ...}``. `--read-delay` makes
every read sleep first, and reads one chunk at a time (`FetchOptions.read_bytes`),
so a test can act while a fetch is in flight.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import fabric
from fabric.fetch import FetchOptions

CHUNK = 1 << 20


def tensor_set(seed: int, mb: int) -> dict[str, torch.Tensor]:
    """About `mb` MB of mixed-dtype tensors (large, odd-shaped and tiny), from `seed`."""
    g = torch.Generator().manual_seed(seed)
    per_layer = max(1, mb * (1 << 20) // 8)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(4):
        rows = max(1, per_layer // (4 * 1021))
        tensors[f"layers.{i}.w"] = torch.randn(rows, 1021, generator=g)          # fp32
        tensors[f"layers.{i}.b"] = torch.randn(1021, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.norm"] = torch.randn(7, generator=g).to(torch.float16)
        tensors[f"layers.{i}.idx"] = torch.randint(0, 1 << 40, (rows // 2 + 1, 3), generator=g)
    tensors["step"] = torch.tensor(seed)
    return tensors


def main() -> None:
    url, name = sys.argv[1], sys.argv[2]
    delay = float(sys.argv[sys.argv.index("--read-delay") + 1]) if "--read-delay" in sys.argv else 0
    worker = fabric.join(url, worker=name)
    if delay:
        original = worker.transport_for

        def slow(source, **kwargs):
            transport = original(source, **kwargs)
            read = transport.read

            class Slow:
                name = transport.name

                def read(self, *args, **kwargs):
                    time.sleep(delay)
                    return read(*args, **kwargs)

            return Slow()

        worker.transport_for = slow
    store = worker.model("bench", chunk_size=CHUNK)
    options = FetchOptions(read_timeout=10, deadline=120,
                           read_bytes=CHUNK if delay else FetchOptions.read_bytes)
    expected: dict[str, torch.Tensor] | None = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "exit":
                break
            if op == "publish":
                out = {"version": store.publish(tensor_set(cmd["seed"], cmd["mb"]))}
            elif op == "expect":
                expected = tensor_set(cmd["seed"], cmd["mb"])
                out = {}
            elif op == "fetch":
                stats = store.fetch(cmd.get("version", "latest"), verify=cmd.get("verify"),
                                    options=options)
                out = stats.to_dict()
                got = store.tensors
                out["exact"] = expected is not None and set(got) == set(expected) and all(
                    torch.equal(got[n], expected[n]) for n in expected)
            elif op == "retract":
                out = {"state": store.retract(cmd["version"], wait=cmd.get("wait", 30))}
            elif op == "corrupt":
                data = store._active.region.tensor
                data[::CHUNK] ^= 0xFF
                out = {}
            elif op == "served":
                out = {"bytes": worker.bytes_served}
            else:
                out = {"error": "ValueError", "message": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the test, which decides
            out = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(out), flush=True)
    worker.close()


if __name__ == "__main__":
    main()
