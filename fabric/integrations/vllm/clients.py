"""Clients that drive vLLM engines' four weight-update phases, raising the fabric's errors.

vLLM's trainer engines talk to inference engines through any object with four methods
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). These are such objects:

- `LLMClient`: an offline ``vllm.LLM`` in this process;
- `HTTPClient`: a ``vllm serve`` endpoint, over its HTTP routes (standard library only);
- `FanOut`: several of either, driven as one (each phase on every engine).

vLLM passes a worker's exception to the caller as text; a client finds the fabric error
named at its start (``UnknownVersionError: ...``) and raises that type again, so
``except wf.UnknownVersionError`` works across the process boundary. Anything else is
raised as vLLM raised it (`FabricError` over HTTP).
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from weightfabric.fabric import errors
from weightfabric.fabric.errors import FabricError

_T = TypeVar("_T")
_NAMED = re.compile(r"\b([A-Z][A-Za-z]*Error): (.*)", re.S)


def fabric_error(text: str) -> FabricError | None:
    """The fabric error whose ``"Type: message"`` appears in ``text``, or None."""
    for match in _NAMED.finditer(text):
        cls = getattr(errors, match.group(1), None)
        if isinstance(cls, type) and issubclass(cls, FabricError):
            message = match.group(2).strip().split("\n")[0]
            message = re.sub(r"', please check the stack trace.*$", "", message).rstrip("'\"")
            return cls(message)
    return None


@contextmanager
def typed_errors() -> Iterator[None]:
    """Raise a fabric error that an engine reported as text as its own type."""
    try:
        yield
    except FabricError:
        raise
    except Exception as exc:
        typed = fabric_error(str(exc))
        if typed is None:
            raise
        raise typed from exc


def switch(client: Any, version: int | str) -> None:
    """One update session on ``client``: start, ``update_weights({"version": ...})``, finish.

    ``finish_weight_update`` gets ``weight_version=str(version)`` for a number (for
    ``"latest"`` the engine keeps its version string). A failed update still ends the
    session (vLLM would refuse the next start otherwise), and its error is raised.
    """
    client.start_weight_update()
    try:
        client.update_weights({"version": version})
    except BaseException:
        with contextlib.suppress(Exception):  # vLLM may have closed it already
            client.finish_weight_update()
        raise
    client.finish_weight_update(weight_version=str(version) if isinstance(version, int)
                                else None)


class LLMClient:
    """The four phases on an offline ``vllm.LLM`` (started with the ``weightfabric`` backend)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join every worker of the engine to the fabric (`WeightfabricInitInfo` fields)."""
        with typed_errors():
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        """Begin an update session."""
        with typed_errors():
            self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Fetch and land a version: ``{"version": N}`` or ``{"version": "latest"}``."""
        with typed_errors():
            self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the session; vLLM records ``weight_version``."""
        with typed_errors():
            self.llm.finish_weight_update(weight_version=weight_version)


class HTTPClient:
    """The four phases on a ``vllm serve`` endpoint (``base_url``: ``http://host:8000``).

    Args:
        base_url: the server's address.
        timeout: seconds per request (an update waits for the whole fetch).
    """

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` as JSON to ``route``; the decoded reply.

        Raises:
            FabricError: the server answered with an error (its fabric type when it names one).
            HubUnavailableError: the server cannot be reached.
        """
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"{self.base_url}/{route}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        return self._send(request)

    def get(self, route: str) -> Any:
        """GET ``route``; the decoded reply (errors as `post`)."""
        return self._send(urllib.request.Request(f"{self.base_url}/{route}"))

    def _send(self, request: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise fabric_error(text) or FabricError(
                f"{request.full_url}: HTTP {exc.code}: {text[:500]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise errors.HubUnavailableError(f"{request.full_url}: {exc}") from None
        return json.loads(raw) if raw else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``POST /init_weight_transfer_engine``."""
        self.post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``POST /start_weight_update``."""
        self.post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``POST /update_weights``."""
        self.post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``."""
        self.post("finish_weight_update",
                  {} if weight_version is None else {"weight_version": weight_version})

    def weight_version(self) -> str | None:
        """``GET /weight_info``: the version string the server serves."""
        reply = self.get("weight_info")
        return None if reply is None else reply.get("weight_version")


class FanOut:
    """Several engines driven as one: each phase runs on every client.

    Args:
        clients: the engines' clients.
        concurrent: run each phase on all engines at once (they fetch together, each
            reading from the others as they fill); False: one after the other, so later
            engines read from earlier ones only.
    """

    def __init__(self, clients: Sequence[Any], *, concurrent: bool = True) -> None:
        if not clients:
            raise ValueError("FanOut needs at least one client")
        self.clients = list(clients)
        self.concurrent = concurrent

    def _each(self, call: Callable[[Any], _T]) -> list[_T]:
        if not self.concurrent or len(self.clients) == 1:
            return [call(c) for c in self.clients]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(call, c) for c in self.clients]
            return [f.result() for f in futures]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialise every engine."""
        self._each(lambda c: c.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        """Start a session on every engine."""
        self._each(lambda c: c.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Update every engine (the first error is raised once all returned)."""
        self._each(lambda c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the session on every engine."""
        self._each(lambda c: c.finish_weight_update(weight_version))


__all__ = ["FanOut", "HTTPClient", "LLMClient", "fabric_error", "switch", "typed_errors"]
