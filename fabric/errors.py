"""Typed exceptions raised by weightfabric.

Every error a user can cause is one of these, with a message that says what was
wrong and what to do about it. `ClusterConfigError` is defined in `topology`
(which must not import `fabric`) and re-exported here.
"""

from topology.errors import ClusterConfigError


class FabricError(Exception):
    """Base class of the fabric's own errors (hub, workers, transports)."""


__all__ = ["ClusterConfigError", "FabricError"]
