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

Importing it loads only the error types, locations and manifests; every other name
loads its module (and torch, for most) on first use, so that a process, or a
`fabric` command, that moves no tensors starts at once.

Subpackages: `weightfabric.fabric` (the library), `weightfabric.kernels` (Triton
kernels), `weightfabric.topology` (cluster YAML, planner, simulator) and
`weightfabric.tools` (the `fabric` command line, demo, benchmarks).
"""

import importlib
from typing import TYPE_CHECKING

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
from weightfabric.fabric.locality import Location, SourceCandidate, rank_by_locality
from weightfabric.fabric.manifest import Manifest, ShardedTensor, TensorSpec

if TYPE_CHECKING:  # imported on first use, by `__getattr__` (`_LAZY`)
    from weightfabric.fabric.client import FetchPlan, HubClient, PlanRange, SourceInfo, connect
    from weightfabric.fabric.fetch import FetchOptions, FetchStats
    from weightfabric.fabric.hub import HubServer, HubState, serve
    from weightfabric.fabric.relayout.engines import hf_layout, vllm_layout
    from weightfabric.fabric.relayout.replica import LayoutFetchStats, LayoutStore
    from weightfabric.fabric.relayout.rules import EngineLayout, Rule, Split, Term
    from weightfabric.fabric.store import FetchFuture, ModelStore
    from weightfabric.fabric.transports.tls import TlsConfig
    from weightfabric.fabric.worker import Worker, join

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

# The rest of `__all__`, each imported from its module on first use (PEP 562), so
# that ``import weightfabric`` (and with it every `fabric` command that moves no
# tensors) loads neither torch, Triton, the kernels and transports they pull, nor
# the hub client's zmq and msgspec. The errors, locations and manifests above are
# light. "vllm" is a module: the vLLM backend's helpers (vLLM itself loads only
# when they are used).
_LAZY = {
    "FetchPlan": "weightfabric.fabric.client",
    "HubClient": "weightfabric.fabric.client",
    "PlanRange": "weightfabric.fabric.client",
    "SourceInfo": "weightfabric.fabric.client",
    "connect": "weightfabric.fabric.client",
    "FetchOptions": "weightfabric.fabric.fetch",
    "FetchStats": "weightfabric.fabric.fetch",
    "HubServer": "weightfabric.fabric.hub",  # the control plane: only a hub's process
    "HubState": "weightfabric.fabric.hub",
    "serve": "weightfabric.fabric.hub",
    "hf_layout": "weightfabric.fabric.relayout.engines",
    "vllm_layout": "weightfabric.fabric.relayout.engines",
    "LayoutFetchStats": "weightfabric.fabric.relayout.replica",
    "LayoutStore": "weightfabric.fabric.relayout.replica",
    "EngineLayout": "weightfabric.fabric.relayout.rules",
    "Rule": "weightfabric.fabric.relayout.rules",
    "Split": "weightfabric.fabric.relayout.rules",
    "Term": "weightfabric.fabric.relayout.rules",
    "FetchFuture": "weightfabric.fabric.store",
    "ModelStore": "weightfabric.fabric.store",
    "TlsConfig": "weightfabric.fabric.transports.tls",
    "Worker": "weightfabric.fabric.worker",
    "join": "weightfabric.fabric.worker",
    "vllm": "weightfabric.fabric.integrations.vllm",
}


def __getattr__(name: str) -> object:
    """A `_LAZY` name: import its module, keep the value here, return it (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == "vllm" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """This module's names, the lazy ones included (as if imported eagerly)."""
    return sorted(set(globals()) | set(__all__))
