"""Worker processes for the multi-process data-plane tests.

`Proc` drives one `tests/fabric_process.py` worker over JSON lines; `running_cluster`
starts an in-process hub and hands out such workers, and tears everything down after
(processes closed or killed, arena files of dead ones removed, none of them left).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import fabric_process
from paths import ROOT, TESTS, child_env
from timeouts import hard_timeout

import weightfabric as wf
from weightfabric.fabric.arena import PREFIX, SHM_DIR, remove_stale_regions


class Proc:
    """A `tests/fabric_process.py` worker process.

    Args:
        url, name: the hub and the worker id.
        read_delay: seconds every read sleeps first (`--read-delay`).
        args: more command-line arguments for the process.
        env: more environment variables (e.g. ``WEIGHTFABRIC_HOST_ID``).
        wait: wait for the process's ``ready`` line here; else call `wait_ready`.
        fork: fork it from a `multiprocessing` forkserver that has imported torch and
            the fabric (tens of milliseconds instead of seconds for the imports) and
            talk over a pipe, instead of running ``python tests/fabric_process.py``
            and talking over stdin and stdout.
    """

    def __init__(self, url: str, name: str, *, read_delay: float = 0.0,
                 args: list[str] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True, fork: bool = False) -> None:
        argv = [url, name, *(["--read-delay", str(read_delay)] if read_delay else []),
                *(args or [])]
        self.name = name
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._process: _Launched = (_Forked(argv, env or {}) if fork
                                    else _Executed(argv, env or {}))
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.exitcode() is None

    def wait_ready(self, timeout: float = 60) -> None:
        reply = self.next_reply(timeout)
        assert reply == {"ready": True}, f"{self.name} did not start: {reply}"

    def _pump(self) -> None:
        for line in self._process.lines():
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def next_reply(self, timeout: float) -> dict[str, Any]:
        """The next reply as it came (an error reply included).

        Raises:
            AssertionError: none within `timeout` s, or the process exited.
        """
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name} did not answer within {timeout} s") from None
        assert reply is not None, f"{self.name} exited (code {self._process.exitcode()})"
        return reply

    def send(self, op: str, **args: Any) -> None:
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
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no clean-up in the process) and reap."""
        if self.alive:
            self._process.kill()
        self._process.wait(30)

    def close(self, timeout: float = 30) -> bool:
        """Ask the process to exit; kill it if it does not within `timeout` s.
        Returns True when it exited by itself, with status 0."""
        if self.alive:
            with contextlib.suppress(OSError):
                self.send("exit")
            self._process.wait(timeout)
        clean = self._process.exitcode() == 0
        self.kill()
        return clean


class _Launched(Protocol):
    """How a `Proc` runs and talks to its process."""

    pid: int

    def lines(self) -> Iterator[str]: ...
    def write(self, line: str) -> None: ...
    def exitcode(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float) -> None: ...


class _Executed:
    """``python tests/fabric_process.py ARGV``, JSON lines on stdin and stdout."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "fabric_process.py"), *argv], cwd=ROOT,
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=child_env(**env))
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
_FORKSERVER.set_forkserver_preload(["fabric_process"])


@contextmanager
def _forkserver_path() -> Iterator[None]:
    """tests/ on PYTHONPATH while the forkserver may start: it
    inherits this environment, and Python 3.11 ignores the sys.path multiprocessing
    hands it, so its preload of `fabric_process` would fail silently (and every
    child would import torch itself, taking seconds)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS),
                                                *([old] if old else [])])
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


class _Forked:
    """`fabric_process.forked` forked from the forkserver, JSON lines over a pipe."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.conn, theirs = _FORKSERVER.Pipe()
        self.process = _FORKSERVER.Process(target=fabric_process.forked,
                                           args=(argv, env, theirs), daemon=True)
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
    return [p for p in SHM_DIR.glob(f"{PREFIX}-*") if int(p.name.split("-")[1]) in pids]


@contextmanager
def running_cluster(*, lease_s: float = 2.0, limit: int = 300
                    ) -> Iterator[tuple[wf.HubServer, Callable[..., Proc]]]:
    """A hub (short leases) and a factory of worker processes (`Proc` arguments), all
    torn down after; fails if an arena file of one of them is left in /dev/shm."""
    hub = wf.serve("tcp://127.0.0.1:0", lease_s=lease_s)
    procs: list[Proc] = []

    def spawn(name: str, *, wait: bool = True, **kw: Any) -> Proc:
        procs.append(Proc(hub.url, name, wait=False, **kw))  # killed in `finally` if it fails
        if wait:
            procs[-1].wait_ready()
        return procs[-1]

    try:
        with hard_timeout(limit):  # the whole test, whatever happens
            yield hub, spawn
    finally:
        for p in procs:
            p.close()
        hub.stop()
        remove_stale_regions()
    leftovers = arena_files_of({p.pid for p in procs})
    assert not leftovers, f"arena files left behind: {leftovers}"
