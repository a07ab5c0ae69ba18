"""The rollout side: an elastic, preemption-proof pool of vLLM engines on the fabric.

::

    from weightfabric import rollout

    with rollout.Pool(hub_url, "policy", checkpoint=path) as pool:
        pool.launch(2)                                   # engines take the pool's version
        pool.submit([rollout.Request(prompt, max_tokens=256, group=g) for ...])
        for sample in pool.samples(count=batch):         # in completion order
            ...                                          # sample.tokens, .versions, .logprobs
        pool.update(new_version)                         # engines switch a few at a time

Engines may join (`Pool.launch`, or ``python -m weightfabric.rollout.engine`` on another
machine) and leave (preemption: SIGTERM or SIGKILL) at any time: the requests of an engine
that leaves continue on others from the tokens they had (token-level migration). Dispatch
is skew-aware (`dispatch`): the longest-predicted requests first, and running requests
move to engines that run dry. docs/rollout.md has the design.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on first use (an engine process needs none of it before vLLM)
    from weightfabric.rollout.dispatch import (
        ConstantPredictor,
        Dispatcher,
        EngineLoad,
        HistoryPredictor,
        LengthPredictor,
    )
    from weightfabric.rollout.pool import (
        EngineInfo,
        EngineRefusedError,
        EngineStartError,
        NoEngineError,
        Pool,
        RolloutError,
    )
    from weightfabric.rollout.samples import Request, Sample

_LAZY = {
    "ConstantPredictor": "dispatch", "Dispatcher": "dispatch", "EngineLoad": "dispatch",
    "HistoryPredictor": "dispatch", "LengthPredictor": "dispatch",
    "EngineInfo": "pool", "EngineRefusedError": "pool", "EngineStartError": "pool",
    "NoEngineError": "pool", "Pool": "pool", "RolloutError": "pool",
    "Request": "samples", "Sample": "samples",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConstantPredictor", "Dispatcher", "EngineInfo", "EngineLoad",
           "EngineRefusedError", "EngineStartError", "HistoryPredictor", "LengthPredictor",
           "NoEngineError", "Pool", "Request", "RolloutError", "Sample"]
