"""weightfabric: a peer-to-peer weight fabric for LLM reinforcement learning.

``import weightfabric as wf`` is the public API: `wf.join` (take part with data),
`wf.connect` (metadata only), `wf.serve` (run a hub), the model stores, the fetch
options and stats, and every error type. The fabric keeps no copy of the weights:
a hub tracks which workers hold which version, and readers pull from them::

    worker = wf.join(url, worker="rollout-3", location={"datacenter": "dc1"})
    store = worker.model("policy")
    store.attach(model)                 # rollout: parameters move into the arena once
    stats = store.sync(timeout=600)     # wait for a newer version and fetch it
    v = store.publish(model)            # trainer: expose a new version and commit it
    engine = worker.layout_model("policy", wf.vllm_layout(config, tp=2), rank=tp_rank)
    engine.sync(timeout=600)            # the same versions in an inference engine's layout

Subpackages: `weightfabric.fabric` (the library), `weightfabric.kernels` (Triton
kernels), `weightfabric.topology` (cluster YAML, planner, simulator) and
`weightfabric.tools` (the `fabric` command line, demo, benchmarks).
"""

from typing import TYPE_CHECKING

from weightfabric.fabric.client import FetchPlan, HubClient, PlanRange, SourceInfo, connect
from weightfabric.fabric.errors import (
    ArenaError,
    AuthenticationError,
    BadRequestError,
    ClusterConfigError,
    DuplicateWorkerError,
    FabricError,
    FetchError,
    ForbiddenError,
    GroupAbortedError,
    HubError,
    HubTimeoutError,
    HubUnavailableError,
    InvalidStateError,
    LayoutError,
    LayoutMismatchError,
    ManifestMismatchError,
    NoBaseError,
    NoSourceError,
    NotLeaderError,
    ProtocolError,
    ReadForbiddenError,
    ReadRefusedError,
    ReplicationTimeoutError,
    RetentionError,
    SourceLostError,
    StoreUnavailableError,
    TensorSetError,
    TransportError,
    UnknownFetchError,
    UnknownModelError,
    UnknownVersionError,
    UnknownWorkerError,
    ValueTooLargeError,
    WaitTimeoutError,
)
from weightfabric.fabric.fetch import FetchOptions, FetchStats
from weightfabric.fabric.locality import Location, SourceCandidate, rank_by_locality
from weightfabric.fabric.manifest import Manifest, ShardedTensor, TensorSpec
from weightfabric.fabric.relayout.engines import hf_layout, vllm_layout
from weightfabric.fabric.relayout.replica import LayoutFetchStats, LayoutStore
from weightfabric.fabric.relayout.rules import EngineLayout, Rule, Split, Term
from weightfabric.fabric.store import FetchFuture, ModelStore
from weightfabric.fabric.transports.tls import TlsConfig
from weightfabric.fabric.worker import Worker, join

if TYPE_CHECKING:
    from weightfabric.fabric.hub import HubServer, HubState, serve

__version__ = "0.2.0"

__all__ = [
    "ArenaError",
    "AuthenticationError",
    "BadRequestError",
    "ClusterConfigError",
    "DuplicateWorkerError",
    "EngineLayout",
    "FabricError",
    "FetchError",
    "FetchFuture",
    "ForbiddenError",
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
    "LayoutError",
    "LayoutFetchStats",
    "LayoutMismatchError",
    "LayoutStore",
    "Location",
    "Manifest",
    "ManifestMismatchError",
    "ModelStore",
    "NoSourceError",
    "NotLeaderError",
    "PlanRange",
    "ProtocolError",
    "ReadForbiddenError",
    "NoBaseError",
    "ReadRefusedError",
    "ReplicationTimeoutError",
    "RetentionError",
    "Rule",
    "ShardedTensor",
    "SourceCandidate",
    "SourceInfo",
    "SourceLostError",
    "StoreUnavailableError",
    "Split",
    "TensorSetError",
    "TlsConfig",
    "TensorSpec",
    "Term",
    "TransportError",
    "UnknownFetchError",
    "UnknownModelError",
    "UnknownVersionError",
    "UnknownWorkerError",
    "ValueTooLargeError",
    "WaitTimeoutError",
    "Worker",
    "connect",
    "hf_layout",
    "join",
    "rank_by_locality",
    "serve",
    "vllm_layout",
    "__version__",
]

_HUB = {"HubServer", "HubState", "serve"}


def __getattr__(name: str) -> object:
    if name in _HUB:  # the control plane, imported only by those who start a hub
        from weightfabric.fabric import hub

        return getattr(hub, name)
    if name == "vllm":  # the vLLM backend's helpers (vLLM itself loads only when used)
        import importlib

        return importlib.import_module("weightfabric.fabric.integrations.vllm")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
