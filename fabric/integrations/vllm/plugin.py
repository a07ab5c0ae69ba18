"""vLLM plugin: registers the ``weightfabric`` weight-transfer backend in every vLLM process.

The project's ``vllm.general_plugins`` entry point names `register`; vLLM runs it in each
of its processes (API server, engine core, workers) before it builds a weight-transfer
engine, so ``weight_transfer_config={"backend": "weightfabric"}`` needs no import from
the user. The engine classes load lazily, when vLLM first builds one.
"""

from __future__ import annotations

BACKEND = "weightfabric"
"""The backend's name in ``WeightTransferConfig(backend=...)``."""
_MODULE = "weightfabric.fabric.integrations.vllm"


def register() -> None:
    """Register the worker and trainer engines with vLLM's factories (once per process)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, f"{_MODULE}.worker_engine",
                                                    "WeightfabricEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, f"{_MODULE}.trainer_engine",
                                                     "WeightfabricTrainerEngine")


__all__ = ["BACKEND", "register"]
