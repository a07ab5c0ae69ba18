"""weightfabric: a peer-to-peer weight fabric for LLM reinforcement learning.

`import fabric` is the public API. The fabric makes every version of a model's
weights look stored and fetchable while keeping no copy of its own: a hub tracks
which workers hold which version, and readers pull directly from those workers.

Control plane (the hub)::

    hub = fabric.serve("tcp://127.0.0.1:0", state_dir="hub-state")   # or `fabric hub serve`
    client = fabric.connect(hub.url, worker="rollout-3", location={"datacenter": "dc1"})
    plan = client.begin_fetch("policy", "latest")
"""

from fabric.client import FetchPlan, HubClient, PlanRange, SourceInfo, connect
from fabric.errors import (
    BadRequestError,
    ClusterConfigError,
    DuplicateWorkerError,
    FabricError,
    GroupAbortedError,
    HubError,
    HubTimeoutError,
    HubUnavailableError,
    InvalidStateError,
    ManifestMismatchError,
    NoSourceError,
    ProtocolError,
    RetentionError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    UnknownWorkerError,
)
from fabric.hub_server import HubServer, serve
from fabric.hub_state import HubState
from fabric.locality import Location, SourceCandidate, rank_by_locality
from fabric.manifest import Manifest, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "BadRequestError", "ClusterConfigError", "DuplicateWorkerError", "FabricError", "FetchPlan",
    "GroupAbortedError", "HubClient", "HubError", "HubServer", "HubState", "HubTimeoutError",
    "HubUnavailableError", "InvalidStateError", "Location", "Manifest", "ManifestMismatchError",
    "NoSourceError", "PlanRange", "ProtocolError", "RetentionError", "SourceCandidate",
    "SourceInfo", "TensorSpec", "UnknownFetchError", "UnknownModelError", "UnknownVersionError",
    "UnknownWorkerError", "__version__", "connect", "rank_by_locality", "serve",
]
