"""Typed exceptions raised by weightfabric.

Every error a user can cause is one of these, with a message that says what was
wrong and what to do about it. `ClusterConfigError` is defined in `topology`
(which must not import `fabric`) and re-exported here.
"""

from topology.errors import ClusterConfigError


class FabricError(Exception):
    """Base class of the fabric's own errors (hub, workers, transports)."""


class ArenaError(FabricError):
    """An arena region could not be created, attached or used."""


class TransportError(FabricError):
    """A read from a source failed."""


class SourceLostError(TransportError):
    """The source cannot be reached or dropped the connection: read elsewhere."""


class ReadRefusedError(TransportError):
    """The source answered but refused the read: unknown or retracted region,
    out-of-range bytes, or chunks that did not arrive in time."""


__all__ = [
    "ArenaError",
    "ClusterConfigError",
    "FabricError",
    "ReadRefusedError",
    "SourceLostError",
    "TransportError",
]
