"""Helpers shared by the hub tests: fake clock, manifests, cleanup, a hub fed raw batches."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import zmq

import weightfabric as wf
from weightfabric.fabric.auth import load_credential
from weightfabric.fabric.hub_messages import BatchRequest
from weightfabric.fabric.manifest import Manifest, TensorSpec
from weightfabric.fabric.protocol import REQUEST, decode, encode
from weightfabric.fabric.zmq_util import hub_socket


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        """The current fake time."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds`."""
        self.now += seconds


def small_manifest(num_chunks: int = 4, chunk_size: int = 16, tag: str = "w") -> Manifest:
    """A manifest of two tensors spanning ``num_chunks`` chunks."""
    total = num_chunks * chunk_size
    half = total // 2
    tensors = (TensorSpec(f"{tag}.a", (half // 4,), "float32", half, 0),
               TensorSpec(f"{tag}.b", ((total - half) // 2,), "bfloat16", total - half, half))
    return Manifest(tensors, chunk_size, tuple(range(100, 100 + num_chunks)), total)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill and reap every child process (used in `finally`)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


class OffsetClock(FakeClock):
    """Real monotonic time plus an offset the test can jump forward (server deadlines work)."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def __call__(self) -> float:
        """Monotonic time plus the offset."""
        import time
        return time.monotonic() + self.now


def reader_address(worker, region: str, reader: str = "test-reader"):
    """``worker``'s read address with a capability to read ``region`` (``model/vN/sK``).

    Minted as the hub would, with the suite's deployment secret: for tests that read a
    worker's server directly, without a plan.
    """
    from dataclasses import replace

    from weightfabric.fabric.auth import capability, load_credential

    scope = region[:region.rindex("/s") + 2]
    return replace(worker.server.address,
                   cap=capability(load_credential().serve_key, scope, reader))


def capture_replies(server: Any, keep: Callable[[Any, bytes], None]) -> None:
    """Give `server`, a `HubServer` driven by hand, a socket that keeps its replies.

    Each whole reply it sends goes to ``keep(decoded envelope, raw frame)``.
    """
    from weightfabric.fabric.hub import server as server_module
    from weightfabric.fabric.protocol import decode

    class Sock:
        frames: list[bytes] = []

        def send(self, data: bytes, flags: int = 0) -> None:
            self.frames.append(data)
            if not flags & server_module._SNDMORE:
                _ident, raw, _auth = self.frames
                self.frames = []
                keep(decode(raw), raw)

    server._sock = Sock()


_batch_ids = itertools.count(1)


@contextlib.contextmanager
def hub_with_version() -> Iterator[tuple[wf.HubServer, zmq.Socket, Any]]:
    """``(server, sock, cred)``: an authenticated hub, v1 of "m" committed, a socket to it.

    Version 1 (8 chunks) is committed by worker "t"; ``cred`` is the tests' credential.
    """
    server = wf.serve("tcp://127.0.0.1:0")
    cred = load_credential()
    sock = hub_socket(server.url, max_message_size=1 << 24, hub_key=None)
    try:
        with wf.connect(server.url, worker="t", heartbeat=False, timeout=5,
                        location={"datacenter": "dc0", "node": "trainer"}) as t:
            v = t.begin_publish("m", small_manifest(8))
            t.commit("m", v)
            yield server, sock, cred
    finally:
        sock.close(0)
        server.stop()


def send_batch(sock: zmq.Socket, cred: Any, items: list[tuple[bytes, bytes]],
               *, signed: bool = True) -> Any:
    """The hub's answer (a `Message`) to ``items`` sent as a relay's batch, its MAC checked."""
    data = encode(REQUEST, next(_batch_ids), "relay", "batch", BatchRequest(items=items))
    auth, mac = cred.sign(data)
    sock.send_multipart([data, auth] if signed else [data])
    assert sock.poll(5000), "no answer to the batch"
    raw, sig = sock.recv_multipart()
    if signed:
        assert cred.check_reply(sig, mac, raw)
    return decode(raw)
