"""Start and drive `tools.bench.agent` processes (JSON lines over stdin/stdout).

Each `Agent` is a separate OS process (optionally behind a command prefix such as
``ip netns exec NS``). Its stderr goes to a temporary file whose tail is quoted
when the process fails, so a live progress display stays readable.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weightfabric.tools.command import EXIT_FAILED, EXIT_OK, Console

ROOT = Path(__file__).resolve().parents[2]


class AgentError(RuntimeError):
    """A child process failed, answered with an error, or did not answer in time."""


class Agent:
    """One `tools.bench.agent` child process.

    Args:
        name: for messages.
        prefix: command run before the interpreter (e.g. ``["ip", "netns", "exec", "ns"]``).
        env: extra environment variables.
        on_progress: called with (name, done, total) for the child's progress lines.
        ready_timeout: wait this long for the child's ready line; None: do not wait
            (call ``reply`` later, e.g. after starting several children).
    """

    def __init__(self, name: str, *, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None,
                 ready_timeout: float | None = 60.0) -> None:
        self.name = name
        self._on_progress = on_progress
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [*prefix, "env", *(f"{k}={v}" for k, v in (env or {}).items()),
             sys.executable, "-m", "weightfabric.tools.bench.agent"],
            cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True).start()
        if ready_timeout is not None:
            self.reply(ready_timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # stray output of a library
            if "progress" in msg:
                if self._on_progress is not None:
                    self._on_progress(self.name, *msg["progress"])
                continue
            self._replies.put(msg)
        self._replies.put(None)

    def send(self, op: str, **args: Any) -> None:
        """Send a command without waiting for its answer (see `reply`)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise AgentError(f"{self.name} is gone ({exc}){self._tail()}") from exc

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next answer.

        Raises:
            AgentError: an error answer, the process exited, or `timeout` passed.
        """
        try:
            msg = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AgentError(f"{self.name} did not answer within {timeout:g} s"
                             f"{self._tail()}") from None
        if msg is None:
            self._replies.put(None)
            raise AgentError(f"{self.name} exited with code {self.proc.wait(5)}{self._tail()}")
        if "error" in msg:
            raise AgentError(f"{self.name}: {msg['error']}: {msg['message']}{self._tail()}")
        return msg

    def ask(self, op: str, *, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Send a command and wait for its answer."""
        self.send(op, **args)
        return self.reply(timeout)

    def _tail(self, nbytes: int = 2000) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            text = self._stderr.read()[-nbytes:].strip()
            if text:
                return f"\n--- {self.name} stderr ---\n{text}"
        return ""

    def request_exit(self) -> None:
        """Ask the process to exit (see `close`)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()

    def close(self, timeout: float = 15.0) -> None:
        """Ask the process to exit; kill it when it does not in time."""
        self.request_exit()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


def close_all(agents: Sequence[Agent], timeout: float = 15.0) -> None:
    """Ask every agent to exit, readers first (reverse start order), then wait for each.

    Whichever is still running after `timeout` s is killed.
    """
    for agent in reversed(agents):
        agent.request_exit()
    for agent in reversed(agents):
        with contextlib.suppress(Exception):
            agent.close(timeout)


def print_result(result: dict[str, Any], *, as_json: bool,
                 table: Callable[[dict[str, Any], Console], None]) -> int:
    """Stamp the date, print `result` as JSON or with `table`; exit 1 unless verified."""
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        table(result, Console())
    return EXIT_OK if result["verified"] else EXIT_FAILED
