"""Test-wide settings and the shared fixtures.

TRITON_INTERPRET must be set before any module with a `@triton.jit` kernel is
imported: the decorator reads it. Kernel tests then run on the CPU interpreter.

Fixtures:

- ``hub``: an in-process hub on loopback TCP (``wf.serve("tcp://127.0.0.1:0")``),
  started for the test and stopped after it; ``hub.url`` is its address. Options
  of `wf.serve` come from a marker: ``@pytest.mark.hub(lease_s=5.0)``.
- ``workers``: a factory of clients of that hub, all closed after the test:
  ``workers.join(name, **kw)`` is a `wf.join` (a `Worker`, with a read server),
  ``workers.connect(name=None, **kw)`` a `wf.connect` (a `HubClient`).

Multi-process tests start their children with `procs` (see its docstring).

Authentication: every hub, worker and client of the suite (child processes too)
signs with one deployment secret made for the run, in a private temporary
directory that ``WEIGHTFABRIC_SECRET_FILE`` names (removed at the end); the
user's own ``~/.config/weightfabric/secret`` is never touched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

_SECRET_DIR = Path(tempfile.mkdtemp(prefix="wf-test-secret-"))  # mode 0700
SECRET_FILE = _SECRET_DIR / "secret"
os.environ["WEIGHTFABRIC_SECRET_FILE"] = str(SECRET_FILE)
with os.fdopen(os.open(SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as _f:
    _f.write(secrets.token_hex(32) + "\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's deployment secret."""
    shutil.rmtree(_SECRET_DIR, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``hub`` marker (options of the ``hub`` fixture's `wf.serve`)."""
    config.addinivalue_line("markers", "hub(**options): options of the hub fixture's wf.serve "
                                       "(e.g. lease_s=5.0, state_dir=...)")


@pytest.fixture
def hub(request: pytest.FixtureRequest) -> Iterator[Any]:
    """An in-process hub on ``tcp://127.0.0.1:<free port>``, stopped after the test."""
    import weightfabric as wf

    marker = request.node.get_closest_marker("hub")
    server = wf.serve("tcp://127.0.0.1:0", **(marker.kwargs if marker else {}))
    try:
        yield server
    finally:
        server.stop()


class Workers:
    """Clients of one hub, each closed by `close_all` (the ``workers`` fixture's)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._open: list[Any] = []

    def join(self, name: str, **kwargs: Any) -> Any:
        """`wf.join` the hub as worker `name` (``timeout`` defaults to 10 s)."""
        import weightfabric as wf

        self._open.append(wf.join(self.url, worker=name, **kwargs))
        return self._open[-1]

    def connect(self, name: str | None = None, **kwargs: Any) -> Any:
        """`wf.connect` to the hub, as worker `name` if given (``timeout`` 10 s)."""
        import weightfabric as wf

        self._open.append(wf.connect(self.url, worker=name, **kwargs))
        return self._open[-1]

    def close_all(self) -> None:
        """Close every client, the last opened first, whatever each close raises."""
        while self._open:
            with contextlib.suppress(Exception):
                self._open.pop().close()


@pytest.fixture
def workers(hub: Any) -> Iterator[Workers]:
    """A factory of workers and clients of the ``hub`` fixture, closed after the test."""
    members = Workers(hub.url)
    try:
        yield members
    finally:
        members.close_all()


@pytest.fixture
def on_hosts(workers: Workers, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``join(name, host, **kwargs)``: a worker of the ``hub`` fixture on "host".

    Hosts are ``WEIGHTFABRIC_HOST_ID`` values: a worker's read server records the one
    it was created under, and a reader compares it with the one set last, so the
    worker joined last reads every worker joined on another host over the network.
    """
    def join(name: str, host: str, **kwargs: Any) -> Any:
        monkeypatch.setenv("WEIGHTFABRIC_HOST_ID", host)
        return workers.join(name, timeout=5, **kwargs)

    return join
