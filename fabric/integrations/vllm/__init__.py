"""weightfabric as a vLLM weight-transfer backend (``backend="weightfabric"``).

vLLM engines started with ``weight_transfer_config={"backend": "weightfabric"}`` (offline
``LLM(..., weight_transfer_config=WeightTransferConfig(backend="weightfabric"))``, or
``vllm serve --weight-transfer-config '{"backend": "weightfabric"}'``) take each version
from the fabric: every worker fetches its own TP shard of it from whoever holds it and
lands it in the engine's parameters (`worker_engine`). The project's ``vllm.general_plugins``
entry point registers the backend in every vLLM process (`plugin`).

Two ways to drive it:

- vLLM's trainer-engine API: ``WeightTransferTrainerFactory.trainer_init(TrainerInitInfo(
  hub=url, rank=0), client=..., source=...)`` then ``send_weights()`` each step
  (`trainer_engine`);
- two calls in any loop that publishes with the fabric itself::

      wf.vllm.connect(llm, hub=url, model="policy")    # once
      wf.vllm.update(llm, version)                     # every step (or "latest")

Nothing here imports vLLM until it is used; ``import weightfabric`` never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightfabric.fabric.integrations.vllm.clients import (
    FanOut,
    HTTPClient,
    LLMClient,
    fabric_error,
    switch,
    typed_errors,
)
from weightfabric.fabric.integrations.vllm.plugin import BACKEND

if TYPE_CHECKING:
    from weightfabric.fabric.integrations.vllm.trainer_engine import (
        TrainerInitInfo,
        WeightfabricTrainerEngine,
    )
    from weightfabric.fabric.integrations.vllm.worker_engine import (
        UpdateRecord,
        WeightfabricEngine,
        WeightfabricInitInfo,
    )


_LAZY = {
    "TrainerInitInfo": "trainer_engine", "WeightfabricTrainerEngine": "trainer_engine",
    "UpdateRecord": "worker_engine", "WeightfabricEngine": "worker_engine",
    "WeightfabricInitInfo": "worker_engine",
}


def connect(llm: Any, hub: str, model: str = "policy", **options: Any) -> None:
    """Join every worker of a vLLM engine to the fabric (``init_weight_transfer_engine``).

    Args:
        llm: an offline ``vllm.LLM`` started with the ``weightfabric`` backend, or a
            client (`HTTPClient` for ``vllm serve``, `FanOut` for several).
        hub: the hub's URL.
        model: the published model's name.
        options: more `WeightfabricInitInfo` fields (``token``, ``load``, ``in_place``,
            ``verify``, ``deltas``, ``timeout``, ``host``, ``location``, ``engine``).

    Raises:
        HubUnavailableError, AuthenticationError, BadRequestError, LayoutMismatchError.
    """
    _client(llm).init_weight_transfer_engine({"hub": hub, "model": model, **options})


def update(llm: Any, version: int | str = "latest") -> None:
    """Switch a connected engine to ``version``: start, update, finish (`clients.switch`).

    Every worker fetches its shard of the version and lands it; on any error the engine
    keeps the weights it had, and the error is raised as its fabric type.

    Raises:
        BadRequestError: ``version`` is not an ``int > 0`` or ``"latest"``.
        UnknownVersionError, HubUnavailableError, LayoutMismatchError, FetchError.
    """
    switch(_client(llm), version)


def _client(llm: Any) -> Any:
    """``llm`` itself if it is a client, else an `LLMClient` of the offline engine."""
    return llm if isinstance(llm, LLMClient | HTTPClient | FanOut) else LLMClient(llm)


def __getattr__(name: str) -> object:
    if name in _LAZY:  # these import vLLM
        import importlib

        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKEND", "FanOut", "HTTPClient", "LLMClient", "TrainerInitInfo", "UpdateRecord",
           "WeightfabricEngine", "WeightfabricInitInfo", "WeightfabricTrainerEngine", "connect",
           "fabric_error", "switch", "typed_errors", "update"]
