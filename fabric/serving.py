"""The life of a server that serves on a thread of its own or the caller's (hub, relay)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, TypeVar

S = TypeVar("S", bound="Served")


class Served(ABC):
    """``start`` (a daemon thread), ``serve_forever`` (this thread) and ``stop``.

    A subclass calls `_init_serving` and implements ``_run(on_ready)``: bind (on failure set
    ``_error``), set ``_ready``, call ``on_ready(url)``, serve until ``_stop`` is set.
    """

    thread_name: ClassVar[str] = "fabric-server"

    def _init_serving(self) -> None:
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @abstractmethod
    def _run(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Bind, say so (``_ready``, ``on_ready``) or keep the failure (``_error``), serve."""

    def start(self: S, timeout: float = 10.0) -> S:
        """Bind and serve on a daemon thread; returns once bound (``self.url`` is set).

        Raises:
            HubUnavailableError: bad URL. zmq.ZMQError: the address is in use.
            TimeoutError: not bound within ``timeout`` seconds.
        """
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.thread_name} did not start within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve in the calling thread until `stop` (from another thread or a signal handler)."""
        self._run(on_ready)
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the sockets (what was in flight its clients retry)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["Served"]
