"""`NixlTransport`: one-sided READs across hosts with NVIDIA NIXL (UCX underneath).

Each worker runs one NIXL agent (`NixlEngine`), started lazily, when the ``rdma``
extra (``nixl-cu13``) is installed and the host has an RDMA device
(``/sys/class/infiniband``), unless ``WEIGHTFABRIC_NIXL=0`` or
``fabric.join(..., nixl=False)`` opts out; ``WEIGHTFABRIC_NIXL=1`` or ``nixl=True``
use it without an RDMA device too. Without one, UCX carries NIXL's READs over TCP
sockets, which on the machines measured was half as fast as the fabric's own TCP
reads at 2.5x their CPU (`docs/benchmarks.md`, "NIXL"), so it is not the default there. Its name is unique per process
(``wf-<worker>-<pid>-<random>``): a worker that restarts is a new agent, so nothing
a reader cached about the old one can be used for the new one.

Memory. The holder's read server registers each region it exposes with the agent
(host memory as ``DRAM``, GPU memory as ``VRAM``), once per buffer: a store reuses
its buffers across versions, and a registration is cached by address and size until
the store frees the buffer (`NixlEngine.forget`). A reader registers its
destination buffers the same way, on first use.

Metadata. NIXL peers need each other's agent metadata (connection info and the
remote keys of registered memory). A worker puts its own in the hub's rendezvous
store under ``nixl/<agent>`` whenever it registers new memory, prefixed by the number
of registrations made so far (its generation, 8 bytes); its registered read endpoint
names the agent. A reader loads a holder's metadata on first use, and again when a
lease's descriptor carries a newer generation than the one it loaded (memory
registered since). Endpoints come from the
hub, which drops a worker's when its lease ends, so a holder that left is never
asked; a reader also forgets an agent whose READ failed.

Reads. The read server's leases guard a NIXL READ exactly as they guard a
shared-memory copy: the reader takes a ``LEASE`` over TCP (capability checked,
chunks waited for, egress counted), whose answer carries the region's NIXL
descriptor (agent, address, device, memory kind); it READs ``[offset, offset +
granted)`` into its own registered buffer, then sends ``END``; without an
acknowledged ``END`` (the lease ran out and the holder may have reused the memory)
the bytes are discarded (`SourceLostError`). A READ that fails (``ERR``: the peer
died) or does not finish within the read's timeout is a `SourceLostError`; the
fetch engine reads those chunks elsewhere, as for any source.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from weightfabric.fabric.errors import ReadRefusedError, SourceLostError, TransportError
from weightfabric.fabric.transports import client
from weightfabric.fabric.transports.base import Landing, ReadAbort, SourceAddress

log = logging.getLogger(__name__)

NIXL_ENV = "WEIGHTFABRIC_NIXL"
PROGRESS_ENV = "WEIGHTFABRIC_NIXL_PROGRESS_US"
NIXL_KV_PREFIX = "nixl/"
"""Hub kv keys of agents' metadata: ``nixl/<agent>``."""
POLL_S = 0.0002
"""Seconds between looks at a READ in progress (it runs on NIXL's progress thread)."""
SLOW_POLL_S = 0.005
"""The same once a READ has taken longer than `SLOW_AFTER_S`."""
SLOW_AFTER_S = 0.05
GENERATION = struct.Struct("!Q")
PROGRESS_DELAY_US = 50
"""Microseconds NIXL's progress thread pauses between polls (``WEIGHTFABRIC_NIXL_PROGRESS_US``).

NIXL's Python agent sets 0: the thread spins, a core per process, which on a host
with few cores starves the readers it serves (`fabric bench fetch --transport nixl`,
2 readers on 2 cores: 1.3-1.5 GB/s spinning, 2.1-2.3 pausing 20-50 us)."""
RETRY_UNREACHABLE_S = 10.0
"""Seconds before an agent whose metadata could not be had is asked for again."""


def nixl_api() -> Any:
    """``nixl_cu13._api``, imported without its side effects on this process's logging.

    On import NIXL sends its ``nixl`` logger to stdout at INFO (which would corrupt the
    output of a program that speaks on stdout) and turns off `logging.raiseExceptions`;
    both are undone: its records go to the application's handlers, at WARNING unless
    ``NIXL_LOG_LEVEL`` says otherwise.
    """
    raise_exceptions = logging.raiseExceptions
    from nixl_cu13 import _api

    logging.raiseExceptions = raise_exceptions
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    return _api


def rdma_devices() -> list[str]:
    """The RDMA devices of this host (``/sys/class/infiniband``: InfiniBand, RoCE)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def nixl_missing(wanted: bool | None = None) -> str | None:
    """Why this process does not use NIXL (None when it does).

    ``wanted`` True: only whether it can (installed, loads, not turned off); None: the
    default as well (``WEIGHTFABRIC_NIXL=1``, or an RDMA device on this host).
    """
    mode = os.environ.get(NIXL_ENV, "auto").strip().lower()
    if mode in ("0", "off", "false", ""):
        return f"turned off with {NIXL_ENV}={os.environ.get(NIXL_ENV)}"
    if wanted is None and mode not in ("1", "on", "true") and not rdma_devices():
        return (f"no RDMA device here (/sys/class/infiniband is empty): UCX would carry NIXL "
                f"over TCP, slower than the fabric's own TCP reads; {NIXL_ENV}=1 or "
                "join(..., nixl=True) uses it anyway")
    try:
        nixl_api()
    except ImportError as exc:
        return f"nixl-cu13 is not installed (pip install 'weightfabric[rdma]'): {exc}"
    except Exception as exc:  # a broken install: its native libraries did not load
        return f"nixl-cu13 did not load: {type(exc).__name__}: {exc}"
    return None


_PACE_LOCK = threading.Lock()


def _paced(api: Any, make: Callable[[], Any]) -> Any:
    """``make()`` (a `nixl_agent`) with its progress thread pausing `PROGRESS_DELAY_US`."""
    real = api.nixlBind.nixlAgentConfig

    class Paced(real):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = max(int(value), int(os.environ.get(PROGRESS_ENV, PROGRESS_DELAY_US)))
            super().__setattr__(name, value)

    with _PACE_LOCK:
        api.nixlBind.nixlAgentConfig = Paced
        try:
            return make()
        finally:
            api.nixlBind.nixlAgentConfig = real


class NixlUnreachable(SourceLostError):
    """A holder's NIXL agent cannot be reached from here: read it over TCP instead."""


class NixlEngine:
    """A worker's NIXL agent: its registrations, the remote agents it knows, its READs.

    Thread-safe. The agent starts on first use.

    Args:
        worker: the worker's name (part of the agent's).
        publish: stores this agent's metadata where readers find it (the hub's kv).
        lookup: the metadata of a remote agent, by name (from the hub's kv).
    """

    def __init__(self, worker: str, *, publish: Callable[[str, bytes], None],
                 lookup: Callable[[str], bytes]) -> None:
        self.name = f"wf-{worker}-{os.getpid()}-{secrets.token_hex(4)}"
        self._publish, self._lookup = publish, lookup
        self._agent: Any = None
        self._registered: dict[tuple[int, int], Any] = {}  # (address, bytes) -> reg list
        self._remotes: dict[str, int] = {}  # agent name -> generation of its metadata loaded
        self._generation = 0  # registrations made
        self._unreachable: dict[str, tuple[float, str]] = {}  # name -> (when, why)
        self._lock = threading.RLock()

    @property
    def agent(self) -> Any:
        """The NIXL agent (started now if it was not)."""
        with self._lock:
            if self._agent is None:
                api = nixl_api()
                config = api.nixl_agent_config(
                    backends=["UCX"],
                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)  # reads from threads
                self._agent = _paced(api, lambda: api.nixl_agent(self.name, config))
                if "UCX" not in self._agent.backends:
                    raise TransportError("NIXL has no UCX backend here")
            return self._agent

    # --- registrations ----------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Register ``tensor``'s memory (flat, contiguous) once; its descriptor for readers.

        The descriptor: ``{"agent", "addr", "dev", "mem", "gen"}`` (``mem``: ``"DRAM"``
        or ``"VRAM"``; ``gen``: the registrations made so far). A new registration
        publishes this agent's metadata again.
        """
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        mem = "VRAM" if tensor.is_cuda else "DRAM"
        dev = tensor.get_device() if tensor.is_cuda else 0
        with self._lock:
            if key not in self._registered:
                agent = self.agent
                try:
                    self._registered[key] = agent.register_memory([(*key, dev, "")], mem)
                except Exception as exc:  # NIXL's own error types
                    raise TransportError(f"NIXL could not register {key[1]} bytes of {mem}: "
                                         f"{exc}") from exc
                self._generation += 1
                self._publish(self.name, GENERATION.pack(self._generation)
                              + agent.get_agent_metadata())
            return {"agent": self.name, "addr": key[0], "dev": dev, "mem": mem,
                    "gen": self._generation}

    def forget(self, tensor: torch.Tensor) -> None:
        """Deregister ``tensor``'s memory (before it is freed); nothing if it was not."""
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._lock:
            reg = self._registered.pop(key, None)
            if reg is not None and self._agent is not None:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)

    def _covering(self, tensor: torch.Tensor) -> None:
        """Register the storage ``tensor`` is a view of, if it is not yet."""
        storage = tensor.untyped_storage()
        base = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.register(base)

    # --- reads ------------------------------------------------------------------------

    def read(self, remote: dict[str, Any], offset: int, out: torch.Tensor, *,
             timeout: float, abort: ReadAbort | None = None,
             landing: Landing | None = None) -> None:
        """READ ``out.numel()`` bytes at ``offset`` of the remote region ``remote`` into ``out``.

        With `landing`, one READ per `Landing.step`, all posted at once and each piece told
        as soon as it and those before it are done.

        Raises:
            SourceLostError: the READ failed, timed out, or was aborted.
            TransportError: the descriptor is malformed.
        """
        try:
            agent_name, addr = str(remote["agent"]), int(remote["addr"])
            dev, mem, gen = int(remote["dev"]), str(remote["mem"]), int(remote["gen"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed NIXL descriptor {remote!r}") from exc
        if mem not in ("DRAM", "VRAM"):
            raise TransportError(f"NIXL descriptor of unknown memory {mem!r}")
        self._covering(out)
        local_dev = out.get_device() if out.is_cuda else 0
        local_mem = "VRAM" if out.is_cuda else "DRAM"
        self.remote(agent_name, generation=gen)
        agent = self.agent
        pieces = landing.pieces(out.numel()) if landing is not None else [(0, out.numel())]
        handles: list[Any] = []
        try:
            try:
                for lo, hi in pieces:
                    local = agent.get_xfer_descs([(out.data_ptr() + lo, hi - lo, local_dev)],
                                                 local_mem)
                    far = agent.get_xfer_descs([(addr + offset + lo, hi - lo, dev)], mem)
                    handles.append(agent.initialize_xfer("READ", local, far, agent_name))
                states = [agent.transfer(handle) for handle in handles]
            except Exception as exc:
                self.drop(agent_name)
                raise SourceLostError(f"NIXL READ from {agent_name} could not start: "
                                      f"{exc}") from exc
            start = time.monotonic()
            for handle, state, (_, hi) in zip(handles, states, pieces, strict=True):
                self._complete(agent, handle, state, agent_name, start + timeout, abort)
                if landing is not None:
                    landing.call(hi)
        finally:
            for handle in handles:  # refused while still in flight: leaked
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)

    def _complete(self, agent: Any, handle: Any, state: Any, peer: str, deadline: float,
                  abort: ReadAbort | None) -> None:
        """Wait for the posted ``handle``; SourceLostError unless it is DONE by `deadline`."""
        start = time.monotonic()
        while state == "PROC":
            now = time.monotonic()
            if now > deadline or (abort is not None and abort.aborted):
                raise SourceLostError(f"NIXL READ from {peer}: not done after "
                                      f"{now - start:.1f} s" + (" (aborted)" if abort is not None
                                                                and abort.aborted else ""))
            time.sleep(POLL_S if now - start < SLOW_AFTER_S else SLOW_POLL_S)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            self.drop(peer)
            raise SourceLostError(f"NIXL READ from {peer} failed ({state}): the peer "
                                  "is gone or its memory no longer registered")

    def remote(self, name: str, *, generation: int = 0) -> None:
        """Load remote agent ``name``'s metadata from the hub, unless it is loaded already.

        Loaded again when ``generation`` (a lease's) is newer than what was loaded.

        Raises:
            NixlUnreachable: no metadata for it (its worker left, or the hub restarted
                and it has not published since), or it did not load.
        """
        with self._lock:
            if self._remotes.get(name, -1) >= generation:
                return
            when, why = self._unreachable.get(name, (-RETRY_UNREACHABLE_S, ""))
            if time.monotonic() - when < RETRY_UNREACHABLE_S:
                raise NixlUnreachable(why)
        try:
            meta = self._lookup(name)
        except Exception as exc:
            why = f"no NIXL metadata for agent {name}: {exc}"
            with self._lock:
                self._unreachable[name] = (time.monotonic(), why)
            raise NixlUnreachable(why) from exc
        with self._lock:
            agent = self.agent
            try:
                (loaded_gen,) = GENERATION.unpack_from(meta)
                loaded = agent.add_remote_agent(meta[GENERATION.size:])
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            except Exception as exc:
                raise NixlUnreachable(f"NIXL metadata of {name} did not load: {exc}") from exc
            if loaded != name:
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(loaded)
                raise NixlUnreachable(f"the hub's NIXL metadata for {name} names {loaded}")
            self._remotes[name] = loaded_gen

    def drop(self, name: str) -> None:
        """Forget remote agent ``name`` (it left, or its READ failed)."""
        with self._lock:
            if self._remotes.pop(name, None) is not None and self._agent is not None:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)

    def close(self) -> None:
        """Deregister everything and drop the agent."""
        with self._lock:
            for name in list(self._remotes):
                self.drop(name)
            if self._agent is not None:
                for reg in self._registered.values():
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg)
            self._registered.clear()
            self._agent = None


class NixlTransport(client.ServerTransport):
    """Reads a remote holder's region with a NIXL READ under a lease of its read server."""

    name = "nixl"
    lands = True
    leases_per_read = 1

    def __init__(self, engine: NixlEngine) -> None:
        super().__init__()
        self.engine = engine

    def reachable(self, source: SourceAddress) -> str | None:
        """Why ``source``'s agent cannot be read from here (None: it can; loads it)."""
        try:
            self.engine.remote(source.nixl)
        except NixlUnreachable as exc:
            return str(exc)
        return None

    def read(self, source: SourceAddress, region: str, offset: int, out: torch.Tensor, *,
             timeout: float, prefix: bool = False, abort: ReadAbort | None = None,
             landing: Landing | None = None) -> int:
        """READ bytes of the holder's region into `out` (see `Transport.read`, `Landing`)."""
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("read into a contiguous uint8 tensor")
        with (self._pool.connection(source, abort) as conn,
              client.under_lease(conn, source, region, offset=offset, nbytes=out.numel(),
                                 timeout=timeout, prefix=prefix) as granted):
            if granted.nixl is None:
                raise ReadRefusedError(f"region {region!r} at {source.host}:{source.port} is "
                                       "not registered with NIXL; read it over tcp")
            self.engine.read(granted.nixl, offset, out[:granted.nbytes], timeout=timeout,
                             abort=abort, landing=landing)
        return granted.nbytes


__all__ = ["NIXL_ENV", "NIXL_KV_PREFIX", "NixlEngine", "rdma_devices", "NixlTransport", "NixlUnreachable", "nixl_missing"]
