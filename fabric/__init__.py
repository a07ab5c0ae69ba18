"""weightfabric: a peer-to-peer weight fabric for LLM reinforcement learning.

`import fabric` is the public API. The fabric makes every version of a model's
weights look stored and fetchable while keeping no copy of its own: a hub tracks
which workers hold which version, and readers pull directly from those workers.

Taking part with data (trainer or rollout)::

    worker = fabric.join(url, worker="rollout-3", location={"datacenter": "dc1"})
    store = worker.model("policy")
    store.attach(model)                 # rollout: parameters move into the arena once
    stats = store.fetch("latest")       # pull from whoever holds it (checksummed across hosts)
    v = store.publish(model)            # trainer: expose a new version and commit it

The hub (control plane)::

    hub = fabric.serve("tcp://127.0.0.1:0", state_dir="hub-state")   # or `fabric hub serve`
    client = fabric.connect(hub.url)    # metadata only: status, latest, retention
"""

from fabric.client import FetchPlan, HubClient, PlanRange, SourceInfo, connect
from fabric.errors import (
    ArenaError,
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
    ReadRefusedError,
    RetentionError,
    SourceLostError,
    TransportError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    UnknownWorkerError,
)
from fabric.fetch import FetchError, FetchOptions, FetchStats
from fabric.hub_server import HubServer, serve
from fabric.hub_state import HubState
from fabric.locality import Location, SourceCandidate, rank_by_locality
from fabric.manifest import Manifest, TensorSpec
from fabric.store import FetchFuture, ModelStore
from fabric.worker import Worker, join

__version__ = "0.1.0"

__all__ = [
    "ArenaError",
    "BadRequestError",
    "ClusterConfigError",
    "DuplicateWorkerError",
    "FabricError",
    "FetchError",
    "FetchFuture",
    "FetchOptions",
    "FetchPlan",
    "FetchStats",
    "GroupAbortedError",
    "HubClient",
    "HubError",
    "HubServer",
    "HubState",
    "HubTimeoutError",
    "HubUnavailableError",
    "InvalidStateError",
    "Location",
    "Manifest",
    "ManifestMismatchError",
    "ModelStore",
    "NoSourceError",
    "PlanRange",
    "ProtocolError",
    "ReadRefusedError",
    "RetentionError",
    "SourceCandidate",
    "SourceInfo",
    "SourceLostError",
    "TensorSpec",
    "TransportError",
    "UnknownFetchError",
    "UnknownModelError",
    "UnknownVersionError",
    "UnknownWorkerError",
    "Worker",
    "connect",
    "join",
    "rank_by_locality",
    "serve",
    "__version__",
]
