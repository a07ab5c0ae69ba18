"""One protocol for every child process of the multi-process tests.

A child runs a named *role* (`ROLES`): a function ``role(args, commands, reply)`` of
its command-line arguments (strings), an iterator of the parent's commands (dicts,
``{"op": NAME, ...}``) and a function sending one reply (a dict). Both directions
are JSON lines: over stdin/stdout for ``python tests/procs.py ROLE ARGS...``
(`Child`), or over a pipe for a child forked from a forkserver that has already
imported torch and the fabric (``Child(..., fork=True)``: milliseconds, not seconds).
Rules of every role:

- the first reply says it is ready (``{"ready": ...}``, with what the parent needs,
  e.g. a port); replies naming ``"shm_path"`` tell the parent a /dev/shm file to
  remove if the child is killed;
- one reply per command; ``{"op": "exit"}`` or the end of the commands ends it;
- an exception that escapes the role is sent as ``{"error": TYPE, "message": ...,
  "trace": ...}`` and the child exits 1.

The parent side: `Child` (start, `ask`/`send`/`reply`/`next_reply` with timeouts,
`pause`/`resume`, `kill`, `close`), and `children`, a context manager that hands out
children under one hard time limit and, whatever happens, closes or kills every one
and removes the /dev/shm files the killed ones leave. `running_cluster` adds an
in-process hub; `Proc` is a fabric worker (`fabric_process`).

Example::

    with children(limit=60) as spawn:
        holder = spawn("holder", 4096, 1024, "--partial")
        port = holder.ready["port"]
        holder.ask("mark", chunk=2)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from paths import ROOT, TESTS, child_env
from timeouts import hard_timeout

if TYPE_CHECKING:
    import weightfabric as wf

ROLES: dict[str, str] = {
    "worker": "fabric_process:role",     # a fabric worker with a model store
    "holder": "holder_process:role",     # a ReadServer exposing a /dev/shm region
    "publisher": "hub_child:publisher",  # hub clients: publish, read, hold versions
    "reader": "hub_child:reader",
    "hub-holder": "hub_child:holder",
    "fsdp-trainer": "fsdp_process:role",  # an FSDP2 rank (gloo) publishing its shards
}
"""Role name -> ``module:function`` (modules in tests/)."""

Commands = Iterator[dict[str, Any]]
Reply = Callable[[dict[str, Any]], None]


# --- the child's side ----------------------------------------------------------------------


def role_function(role: str) -> Callable[[list[str], Commands, Reply], None]:
    """The function running `role`."""
    module, _, function = ROLES[role].partition(":")
    return getattr(importlib.import_module(module), function)


def serve_role(role: str, args: list[str], lines: Iterable[str],
               emit: Callable[[str], None]) -> int:
    """Run `role` on JSON `lines`, replies through `emit`; returns the exit status."""
    def commands() -> Commands:
        for line in lines:
            if line.strip():
                cmd = json.loads(line)
                if cmd.get("op") == "exit":
                    return
                yield cmd

    try:
        role_function(role)(args, commands(), lambda reply: emit(json.dumps(reply)))
    except Exception as exc:  # the parent's next reply says what happened
        emit(json.dumps({"error": type(exc).__name__, "message": str(exc),
                         "trace": traceback.format_exc()}))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python tests/procs.py ROLE ARGS...``: JSON lines on stdin and stdout."""
    role, *args = sys.argv[1:] if argv is None else argv
    return serve_role(role, args, sys.stdin, lambda line: print(line, flush=True))


def _forked(role: str, args: list[str], env: dict[str, str], conn: Connection) -> None:
    """`serve_role` in a process forked by the forkserver: JSON lines over `conn`."""
    os.environ.update(env)

    def lines() -> Iterator[str]:
        while True:
            try:
                yield conn.recv()
            except EOFError:
                return

    sys.exit(serve_role(role, args, lines(), conn.send))


# --- the parent's side ---------------------------------------------------------------------


class Child:
    """A child process running `role` (see the module docstring).

    Args:
        role: a name in `ROLES`.
        args: its command-line arguments (turned into strings).
        name: for messages (default: the role).
        env: more environment variables (e.g. ``WEIGHTFABRIC_HOST_ID``).
        fork: fork it from the forkserver (fast) instead of running a new interpreter.
        wait: wait here for its ready reply (`ready`); else call `wait_ready`.
    """

    def __init__(self, role: str, *args: object, name: str | None = None,
                 env: dict[str, str] | None = None, fork: bool = False,
                 wait: bool = True) -> None:
        role_function(role)  # an unknown role fails here, not in the child
        self.name = name or role
        self.ready: dict[str, Any] = {}
        self.shm_paths: set[Path] = set()
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        argv = [str(a) for a in args]
        self._process: _Launched = (_Forked(role, argv, env or {}) if fork
                                    else _Executed(role, argv, env or {}))
        threading.Thread(target=self._pump, name=f"pump-{self.name}", daemon=True).start()
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the child is still running."""
        return self._process.exitcode() is None

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        """Wait for the ready reply; returns it (also kept as `ready`)."""
        reply = self.next_reply(timeout)
        assert "ready" in reply, f"{self.name} did not start: {reply}"
        self.ready = reply
        return reply

    def _pump(self) -> None:
        for line in self._process.lines():
            reply = json.loads(line)
            if "shm_path" in reply:
                self.shm_paths.add(Path(reply["shm_path"]))
            self._replies.put(reply)
        self._replies.put(None)

    def next_reply(self, timeout: float) -> dict[str, Any]:
        """The next reply as it came (an error reply included).

        Raises:
            AssertionError: none within `timeout` s, or the child exited.
        """
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name} did not answer within {timeout} s") from None
        if reply is None:
            self._replies.put(None)  # every later call says so too
            raise AssertionError(f"{self.name} exited (code {self._process.exitcode()})")
        return reply

    def send(self, op: str, **args: Any) -> None:
        """Send a command; its reply comes later (`reply`, `next_reply`)."""
        self._process.write(json.dumps({"op": op, **args}))

    def ask(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Send a command and return its reply, which must not be an error."""
        self.send(op, **args)
        return self.reply(timeout)

    def reply(self, timeout: float = 120) -> dict[str, Any]:
        """The next reply, which must not be an error."""
        reply = self.next_reply(timeout)
        assert "error" not in reply, f"{self.name}: {reply}"
        return reply

    def pause(self) -> None:
        """SIGSTOP: the process freezes (threads, leases, sockets) until `resume`."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused child."""
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no clean-up in the child), reap it, and remove its /dev/shm files.

        Those are the files it named and the arena files its pid created, which it
        cannot remove any more.
        """
        if self.alive:
            self._process.kill()
        self._process.wait(30)
        self.remove_shm_files()

    def remove_shm_files(self) -> None:
        """Remove the /dev/shm files of this child (call once it is dead)."""
        for path in [*self.shm_paths, *arena_files_of({self.pid})]:
            path.unlink(missing_ok=True)

    def close(self, timeout: float = 30) -> bool:
        """Ask the child to exit; kill it if it does not within `timeout` s.

        Returns:
            True when it exited by itself, with status 0.
        """
        if self.alive:
            with contextlib.suppress(OSError, ValueError):
                self.send("exit")
            self._process.wait(timeout)
        clean = self._process.exitcode() == 0
        if not clean:
            self.kill()
        return clean


class Proc(Child):
    """A fabric worker (`fabric_process`, role ``worker``) of the hub at `url`.

    Args:
        url, name: the hub and the worker id.
        read_delay: seconds every read sleeps first (``--read-delay``).
        args: more command-line arguments (``--read-timeout``, ``--deadline``).
        env, wait, fork: as for `Child`.
    """

    def __init__(self, url: str, name: str, *, read_delay: float = 0.0,
                 args: list[str] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True, fork: bool = False) -> None:
        super().__init__("worker", url, name,
                         *(["--read-delay", str(read_delay)] if read_delay else []),
                         *(args or []), name=name, env=env, fork=fork, wait=wait)


@contextmanager
def children(limit: int = 300, make: Callable[..., Child] = Child
             ) -> Iterator[Callable[..., Child]]:
    """Hand out children (``spawn(*args, **options)`` of `make`, `Child` by default) for `limit` s.

    The test must end within `limit` s; then every child is closed (killed if it does
    not exit, and all of them if the test failed) and the /dev/shm files of the
    killed ones are removed.
    """
    started: list[Child] = []

    def spawn(*args: Any, wait: bool = True, **kwargs: Any) -> Child:
        started.append(make(*args, wait=False, **kwargs))  # cleaned up if it fails
        if wait:
            started[-1].wait_ready()
        return started[-1]

    failed = True
    try:
        with hard_timeout(limit):  # the whole test, whatever happens
            yield spawn
        failed = False
    finally:
        for child in reversed(started):
            if failed:
                child.kill()
            else:
                child.close()


class _Launched(Protocol):
    """How a `Child` runs and talks to its process."""

    pid: int

    def lines(self) -> Iterator[str]: ...
    def write(self, line: str) -> None: ...
    def exitcode(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float) -> None: ...


class _Executed:
    """``python tests/procs.py ROLE ARGS``, JSON lines on stdin and stdout."""

    def __init__(self, role: str, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "procs.py"), role, *args], cwd=ROOT,
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(**env))
        self.pid = self.proc.pid

    def lines(self) -> Iterator[str]:
        assert self.proc.stdout is not None
        yield from self.proc.stdout

    def write(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)


_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["procs", "fabric_process"])


@contextmanager
def _forkserver_path() -> Iterator[None]:
    """Put tests/ on PYTHONPATH while the forkserver may start.

    The forkserver inherits this environment, and Python 3.11 ignores the sys.path multiprocessing
    hands it, so its preload of the role modules would fail silently (and every
    child would import torch itself, taking seconds).
    """
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), *([old] if old else [])])
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


class _Forked:
    """`_forked` forked from the forkserver, JSON lines over a pipe."""

    def __init__(self, role: str, args: list[str], env: dict[str, str]) -> None:
        self.conn, theirs = _FORKSERVER.Pipe()
        self.process = _FORKSERVER.Process(target=_forked, args=(role, args, env, theirs),
                                           daemon=True)
        with _forkserver_path():
            self.process.start()
        theirs.close()  # so that `lines` ends when the process does
        assert self.process.pid is not None
        self.pid = self.process.pid
        self._send_lock = threading.Lock()

    def lines(self) -> Iterator[str]:
        while True:
            try:
                yield self.conn.recv()
            except (EOFError, OSError):
                return

    def write(self, line: str) -> None:
        with self._send_lock:
            self.conn.send(line)

    def exitcode(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float) -> None:
        self.process.join(timeout)


def arena_files_of(pids: set[int]) -> list[Path]:
    """Arena files in /dev/shm whose names say one of `pids` created them."""
    from weightfabric.fabric.arena import PREFIX, SHM_DIR

    return [p for p in SHM_DIR.glob(f"{PREFIX}-*") if int(p.name.split("-")[1]) in pids]


@contextmanager
def running_cluster(*, lease_s: float = 2.0, limit: int = 300
                    ) -> Iterator[tuple[wf.HubServer, Callable[..., Proc]]]:
    """A hub (short leases) and a factory of worker processes (`Proc` arguments).

    All are torn down after; fails if an arena file of one of them is left in /dev/shm.
    """
    import weightfabric as wf
    from weightfabric.fabric.arena import remove_stale_regions

    hub = wf.serve("tcp://127.0.0.1:0", lease_s=lease_s)
    procs: list[Proc] = []

    def make(name: str, **kw: Any) -> Proc:
        procs.append(Proc(hub.url, name, **kw))
        return procs[-1]

    try:
        with children(limit, make) as spawn:
            yield hub, spawn
    finally:
        hub.stop()
        remove_stale_regions()
    leftovers = arena_files_of({p.pid for p in procs})
    assert not leftovers, f"arena files left behind: {leftovers}"


if __name__ == "__main__":
    sys.exit(main())
