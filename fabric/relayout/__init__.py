"""Receive-path relayout: reading a version in another layout than it was published in.

Engine layouts (`rules`: `EngineLayout`, `Rule`, `Split`, `Term`; ready-made ones in
`engines`: `vllm_layout`, `hf_layout`) say how an inference engine rank's tensors
derive from the published ones; `derive` reads just the blocks a rank needs from
the publishers' shards; `replica.LayoutStore` (``worker.layout_model``) keeps the
result as a derived replica at the hub, so later readers of that layout copy it.

`ReshardReader` reads versions published in fp8 or by tensor-parallel ranks into
another tensor-parallel layout, band by band within a byte budget (`staging`);
`direct` executes the same plans from peer memory.
"""

from weightfabric.fabric.relayout.engines import hf_layout, vllm_layout
from weightfabric.fabric.relayout.reader import Resharding, ReshardReader, fetch_resharded
from weightfabric.fabric.relayout.replica import LayoutFetchStats, LayoutStore
from weightfabric.fabric.relayout.rules import (
    EngineLayout,
    Rule,
    Split,
    Term,
    derive_reference,
)

__all__ = ["EngineLayout", "LayoutFetchStats", "LayoutStore", "ReshardReader", "Resharding", "Rule",
           "Split", "Term", "derive_reference", "fetch_resharded", "hf_layout", "vllm_layout"]
