"""A fabric worker in its own process: the ``worker`` role of `procs` (for tests).

Usage: ``procs.Proc(url, name, ...)``, or ``python tests/procs.py worker HUB_URL
WORKER_NAME [--read-delay S] [--read-timeout S] [--deadline S]`` (JSON lines on
stdin and stdout; ``python tests/fabric_process.py ...`` is the same).

Prints ``{"ready": true}`` once joined, then answers one JSON line per command:

- ``{"op": "publish", "seed": N, "mb": M}`` -> ``{"version": V}``: publishes the
  tensor set `tensor_set(N, M)` (snapshot).
- ``{"op": "fetch", "version": V, "verify": bool|null}`` -> fetch stats, plus
  ``"exact"``: whether the fetched tensors equal `tensor_set(seed, mb)` of the last
  ``expect`` command, or, when the command has ``"seeds": {"V": N, ...}`` and
  ``"mb": M``, `tensor_set(N, M)` for the version V it fetched (``"latest"`` too).
- ``{"op": "sync", "timeout": S}`` -> as ``fetch``: `ModelStore.sync`.
- ``{"op": "wait_replicated", "version": V, "replicas": K, "timeout": S}`` ->
  ``{"holders": [...]}``: `ModelStore.wait_replicated` (V null: the last published).
- ``{"op": "fetch_async", ...}`` (as ``fetch``) -> ``{"started": true}`` at once; then
  ``{"op": "result", "timeout": S}`` -> what ``fetch`` answers, once the fetch is done
  (commands in between are answered meanwhile).
- ``{"op": "reopen"}`` -> ``{}``: closes the store (cancelling a fetch in flight) and
  opens a new one.
- ``{"op": "expect", "seed": N, "mb": M}`` -> ``{}``: what fetches must reproduce.
- ``{"op": "retract", "version": V, "wait": S, "scribble": bool}`` ->
  ``{"version": V, "state": ...}``; V ``"spare"`` is the oldest version exposed in a
  buffer other than the active one (``{"version": null}`` and no retract if none).
  With ``scribble``, once the state is ``"done"`` the store reuses the memory at
  once, as contract 1 allows: the bytes of every buffer of V but the active one (and
  one a future will switch to) are overwritten and the buffer forgets V
  (``"scribbled"``: how many).
- ``{"op": "release", "version": V, "wait": S}`` -> ``{}``: `ModelStore.release`.
- ``{"op": "corrupt", "version": V}`` -> ``{"corrupted": bool}``: flips one byte in
  every chunk of the buffer holding V (default: the active version), if any.
- ``{"op": "held"}`` -> ``{"active": V, "buffers": [...]}``: the store's versions.
- ``{"op": "served"}`` -> ``{"bytes": N}``: bytes this worker served.
- ``{"op": "layout_fetch", "model": M, "config": C, "tp": T, "rank": R, "version": V}``
  -> ``{"version", "derived", "sources"}``: `Worker.layout_model` in `wf.vllm_layout`
  ``(C, tp=T)``, fetched (the store is kept, so its derived replicas stay served).
- ``{"op": "exit"}``.

Errors come back as ``{"error": "TypeName", "message": ..., "fabric": bool}``
(``fabric``: a `fabric.errors.FabricError`; otherwise ``"trace"`` holds the
traceback). `--read-delay` makes every read sleep first, and reads one chunk at a
time (`FetchOptions.read_bytes`), so a test can act while a fetch is in flight;
`--read-timeout` and `--deadline` set the fetches' `FetchOptions` (10 s, 120 s).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

import weightfabric as wf
from weightfabric.fabric.errors import FabricError
from weightfabric.fabric.fetch import FetchOptions, FetchStats
from weightfabric.fabric.store import FetchFuture, ModelStore

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


@functools.lru_cache(maxsize=8)
def cached_tensor_set(seed: int, mb: int) -> dict[str, torch.Tensor]:
    """`tensor_set`, kept for the next fetches that compare against it."""
    return tensor_set(seed, mb)


def matches(store: ModelStore, expected: dict[str, torch.Tensor] | None) -> bool:
    """Whether the store's tensors are exactly `expected`."""
    got = store.tensors
    return expected is not None and set(got) == set(expected) and all(
        torch.equal(got[n], expected[n]) for n in expected)


def corrupt(store: ModelStore, version: int | None) -> bool:
    """Flip one byte of every chunk of the buffer holding `version` (None: the active one)."""
    if version is None:
        buffers = [store.pool.active] if store.pool.active is not None else []
    else:
        buffers = [b for b in store.pool.buffers if b.version == version]
    for buffer in buffers:
        buffer.region.tensor[::CHUNK] ^= 0xFF
    return bool(buffers)


def scribble(store: ModelStore, version: int) -> int:
    """Reuse the memory of every buffer of `version` but the active one.

    As its owner may once the version is retracted: overwrite it and forget the
    version there.
    """
    count = 0
    with store._lock:
        for buffer in store.pool.buffers:
            if (buffer.version == version and buffer is not store.pool.active
                    and not buffer.pending):
                assert buffer.exposed is None, "scribbling a buffer still exposed"
                buffer.region.tensor.fill_(0xA5)
                buffer.version = None
                count += 1
    return count


def spare_version(store: ModelStore) -> int | None:
    """The oldest version older than the active one the store exposes complete in a buffer.

    Not one a fetch is filling, nor one a future will switch to: a newer version than the
    active one is one of those, also once its last chunk landed but before its fetch
    reserved the buffer (`ModelStore` marks it ``pending`` only then; retracting it there
    ended the fetch in flight).
    """
    active = store.version
    return min((b.version for b in store.pool.buffers
                if b is not store.pool.active and not b.pending and b.version is not None
                and active is not None and b.version < active
                and b.exposed is not None and b.exposed.progress.count
                == b.exposed.progress.num_chunks), default=None)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The worker's command line: hub URL, name and fetch options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("--read-delay", type=float, default=0.0)
    parser.add_argument("--read-timeout", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=120.0)
    return parser.parse_args(argv)


def slow_reads(worker: wf.Worker, delay: float) -> None:
    """Make every read of `worker` sleep `delay` s first."""
    original = worker.transports.transport_for

    def slow(source, **kwargs):
        transport = original(source, **kwargs)
        read = transport.read

        class Slow:
            name = transport.name
            leases_per_read = getattr(transport, "leases_per_read", 0)

            def read(self, *args, **kwargs):
                time.sleep(delay)
                return read(*args, **kwargs)

        if hasattr(transport, "hold"):  # and every read under a held lease
            def hold(self, *args, **kwargs):
                lease = transport.hold(*args, **kwargs)
                read_held = lease.read

                def slow_read(*args, **kwargs):
                    time.sleep(delay)
                    return read_held(*args, **kwargs)

                lease.read = slow_read
                return lease

            Slow.hold = hold  # type: ignore[attr-defined]
        return Slow()

    worker.transports.transport_for = slow  # type: ignore[method-assign]


class Session:
    """A worker's store and what the commands left behind.

    One ``op_*`` method per command.
    """

    def __init__(self, worker: wf.Worker, options: FetchOptions) -> None:
        self.worker, self.options = worker, options
        self.store = worker.model("bench", chunk_size=CHUNK)
        self.expected: dict[str, torch.Tensor] | None = None
        self.future: FetchFuture | None = None
        self.future_cmd: dict[str, Any] = {}
        self.layouts: list[Any] = []

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The reply to one command: its result, or the error it raised."""
        handler = getattr(self, f"op_{cmd['op']}", None)
        if handler is None:
            return {"error": "ValueError", "message": f"unknown op {cmd['op']!r}", "fabric": False}
        try:
            return handler(cmd)
        except Exception as exc:  # reported to the test, which decides
            out = {"error": type(exc).__name__, "message": str(exc),
                   "fabric": isinstance(exc, FabricError)}
            if not out["fabric"]:
                out["trace"] = traceback.format_exc()
            return out

    def op_publish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Publish `tensor_set(seed, mb)`; replies its version."""
        return {"version": self.store.publish(tensor_set(cmd["seed"], cmd["mb"]))}

    def op_wait_replicated(self, cmd: dict[str, Any]) -> dict[str, Any]:
        holders = self.store.wait_replicated(cmd.get("version"), replicas=cmd.get("replicas", 1),
                                             timeout=cmd.get("timeout", 60))
        return {"holders": holders}

    def op_sync(self, cmd: dict[str, Any]) -> dict[str, Any]:
        stats = self.store.sync(timeout=cmd.get("timeout", 30), verify=cmd.get("verify"),
                                options=self.options)
        return self.checked(stats, cmd)

    def op_expect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Set the tensors later fetches must reproduce."""
        self.expected = tensor_set(cmd["seed"], cmd["mb"])
        return {}

    def op_fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Fetch a version; replies the stats and whether the tensors are exact."""
        stats = self.store.fetch(cmd.get("version", "latest"), verify=cmd.get("verify"),
                                 options=self.options)
        return self.checked(stats, cmd)

    def op_fetch_async(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Start a fetch; its result comes with the ``result`` command."""
        if self.future is not None:
            raise ValueError("a fetch_async is still waiting for its result command")
        self.future = self.store.fetch_async(cmd.get("version", "latest"),
                                             verify=cmd.get("verify"), options=self.options)
        self.future_cmd = cmd
        return {"started": True}

    def op_result(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Wait for the ``fetch_async`` in flight; replies what ``fetch`` does."""
        future, self.future = self.future, None
        if future is None:
            raise ValueError("no fetch_async to wait for")
        return self.checked(future.result(timeout=cmd.get("timeout")), self.future_cmd)

    def checked(self, stats: FetchStats, cmd: dict[str, Any]) -> dict[str, Any]:
        """The stats of a fetch, and whether the store's tensors are what it should give."""
        out = stats.to_dict()
        seeds = cmd.get("seeds")
        if seeds is not None:
            seed = seeds.get(str(stats.version))
            self.expected = None if seed is None else cached_tensor_set(seed, cmd["mb"])
        out["exact"] = matches(self.store, self.expected)
        return out

    def op_retract(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Retract a version (or the spare one), optionally reusing its memory."""
        version = cmd["version"] if cmd["version"] != "spare" else spare_version(self.store)
        out: dict[str, Any] = {"version": version}
        if version is not None:
            out["state"] = self.store.retract(version, wait=cmd.get("wait", 30))
            if cmd.get("scribble") and out["state"] == "done":
                out["scribbled"] = scribble(self.store, version)
        return out

    def op_release(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Release a version (`ModelStore.release`)."""
        self.store.release(cmd["version"], wait=cmd.get("wait", 30))
        return {}

    def op_reopen(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Close the store (a fetch in flight is cancelled) and open a new one."""
        self.store.close()
        self.store = self.worker.model("bench", chunk_size=CHUNK)
        return {}

    def op_corrupt(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Flip one byte in every chunk of a version's buffer."""
        return {"corrupted": corrupt(self.store, cmd.get("version"))}

    def op_held(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The store's active version and the version of each buffer."""
        return {"active": self.store.version,
                "buffers": [b.version for b in self.store.pool.buffers]}

    def op_served(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Bytes this worker has served."""
        return {"bytes": self.worker.bytes_served}

    def op_layout_fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Fetch a version of ``model`` in `vllm_layout` ``(config, tp=...)``, rank ``rank``."""
        layout = wf.vllm_layout(cmd["config"], tp=cmd["tp"])
        store = self.worker.layout_model(cmd["model"], layout, rank=cmd["rank"],
                                         chunk_size=cmd.get("chunk_size", CHUNK))
        self.layouts.append(store)  # kept: its replicas live as long as this worker
        stats = store.fetch(cmd.get("version", "latest"))
        return {"version": stats.version, "derived": stats.derived, "sources": stats.sources}


def role(argv: list[str], commands: Iterator[dict[str, Any]],
         reply: Callable[[dict[str, Any]], None]) -> None:
    """The ``worker`` role of `procs`.

    Join as the worker `argv` names, then answer each command with one reply, until
    ``exit`` or the end of the commands.
    """
    args = parse_args(argv)
    worker = wf.join(args.url, worker=args.name)
    if args.read_delay:
        slow_reads(worker, args.read_delay)
    options = FetchOptions(read_timeout=args.read_timeout, deadline=args.deadline,
                           read_bytes=CHUNK if args.read_delay else FetchOptions.read_bytes)
    session = Session(worker, options)
    reply({"ready": True})
    for cmd in commands:
        reply(session.run(cmd))
    worker.close()


if __name__ == "__main__":
    import procs

    sys.exit(procs.main(["worker", *sys.argv[1:]]))
