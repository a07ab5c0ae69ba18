"""Optional TLS on read-server connections, for links that cross untrusted networks.

Mutual TLS with the cluster's own CA: every worker presents its certificate and
accepts only peers whose certificate that CA signed (host names are not checked:
workers are addressed by IP, and capabilities decide what a peer may read). A
holder started with TLS says so in the read endpoint it registers
(`SourceAddress.tls`), and readers then wrap their connections to it. One TLS
identity per process: `wf.join(..., tls=...)` installs it for the process's readers
(`use_for_reads`).
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from weightfabric.fabric.errors import TransportError

HANDSHAKE_S = 10.0
"""Seconds a holder waits for a new connection's TLS handshake."""


@dataclass(frozen=True)
class TlsConfig:
    """A worker's certificate and key (PEM), and the CA that signed every worker's."""

    cert: str | Path
    key: str | Path
    ca: str | Path

    def server_context(self) -> ssl.SSLContext:
        """The context a read server wraps accepted connections with.

        Raises:
            ValueError: a file is missing or not a matching certificate and key.
        """
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """The context readers wrap their connections with (see `server_context`)."""
        ctx = self._context(ssl.Purpose.SERVER_AUTH)
        ctx.check_hostname = False
        return ctx

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(purpose, cafile=str(self.ca))
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"TLS: cannot load {self.cert}, {self.key} and CA {self.ca}: "
                             f"{exc}") from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


_client: ssl.SSLContext | None = None
_lock = threading.Lock()


def use_for_reads(config: TlsConfig | None) -> None:
    """Install ``config`` as this process's TLS identity for reads (None: remove it)."""
    global _client
    ctx = config.client_context() if config is not None else None
    with _lock:
        _client = ctx


def client_context() -> ssl.SSLContext:
    """The process's TLS context for reads.

    Raises:
        TransportError: none was installed (the holder requires TLS).
    """
    with _lock:
        ctx = _client
    if ctx is None:
        raise TransportError("the holder serves over TLS only: join with "
                             "tls=TlsConfig(cert, key, ca) signed by the cluster's CA")
    return ctx


__all__ = ["HANDSHAKE_S", "TlsConfig", "client_context", "use_for_reads"]
