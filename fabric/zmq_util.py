"""One place that makes zmq sockets and turns hub URLs into zmq endpoints.

URLs: ``tcp://HOST:PORT`` (``PORT`` 0 or ``*`` binds a port the OS picks),
``curve://HOST:PORT`` (the same, the channel encrypted with zmq CURVE: see
`fabric.auth`) and ``memory://NAME`` (in-process, zmq ``inproc`` on the shared
context; for tests and single-process use).
"""

from __future__ import annotations

import zmq

from weightfabric.fabric.errors import HubUnavailableError


def context() -> zmq.Context:
    """The process-wide zmq context (``memory://`` needs both ends on the same one)."""
    return zmq.Context.instance()


def endpoint(url: str, *, bind: bool) -> str:
    """The zmq endpoint of a hub URL.

    Raises:
        HubUnavailableError: the URL has another scheme or no port.
    """
    if url.startswith("memory://") and len(url) > len("memory://"):
        return "inproc://weightfabric-" + url[len("memory://"):]
    if url.startswith("curve://"):
        url = "tcp://" + url[len("curve://"):]
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        if host and port in ("0", "*") and bind:
            return f"tcp://{host}:*"
        if host and port.isdigit() and 0 < int(port) <= 65535:  # zmq would use port % 65536
            return url
    raise HubUnavailableError(f"bad hub URL {url!r}: use tcp://HOST:PORT, curve://HOST:PORT or "
                              "memory://NAME")


def url_of(bound_endpoint: str, url: str) -> str:
    """The URL clients should use for a socket bound at ``bound_endpoint``."""
    if url.startswith("curve://"):
        return "curve://" + bound_endpoint[len("tcp://"):]
    return url if url.startswith("memory://") else bound_endpoint


def reconnects(url: str) -> bool:
    """Whether zmq reconnects a connection to ``url`` by itself (not ``memory://``: inproc)."""
    return not url.startswith("memory://")


def encrypted(url: str) -> bool:
    """Whether a hub URL asks for a CURVE-encrypted channel."""
    return url.startswith("curve://")


def make_socket(kind: int, *, max_message_size: int, hwm: int = 10_000) -> zmq.Socket:
    """A socket with the fabric's settings: no linger, bounded messages and queues."""
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    return sock


def hub_socket(url: str, *, max_message_size: int, hub_key: bytes | None) -> zmq.Socket:
    """A DEALER connected to the hub at ``url`` (``hub_key``: its CURVE key, for curve://).

    Raises:
        HubUnavailableError: a bad URL.
        ValueError: a ``curve://`` URL without ``hub_key``.
    """
    if encrypted(url) and not hub_key:
        raise ValueError(f"{url} is encrypted: its hub's key comes with its secret or a "
                         "token it issued")
    sock = make_socket(zmq.DEALER, max_message_size=max_message_size)
    try:
        if encrypted(url):
            sock.curve_serverkey = hub_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(endpoint(url, bind=False))
    except BaseException:
        sock.close(0)
        raise
    return sock


__all__ = ["context", "encrypted", "endpoint", "hub_socket", "make_socket", "reconnects",
           "url_of"]
