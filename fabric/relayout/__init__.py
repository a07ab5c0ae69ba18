"""Receive-path relayout: reading a version published in another layout.

`ReshardReader` plans bands of the holders' shards within a byte budget
(`staging`), reads them through the worker's transports and runs the kernels
into the reader's tensors; `direct` executes the same plans from peer memory.
"""

from weightfabric.fabric.relayout.reader import Resharding, ReshardReader, fetch_resharded

__all__ = ["ReshardReader", "Resharding", "fetch_resharded"]
