"""weightfabric: a peer-to-peer weight fabric for LLM reinforcement learning.

`import fabric` is the public API. The fabric makes every version of a model's
weights look stored and fetchable while keeping no copy of its own: a hub tracks
which workers hold which version, and readers pull directly from those workers.
"""

from fabric.errors import ClusterConfigError, FabricError

__version__ = "0.1.0"

__all__ = ["ClusterConfigError", "FabricError", "__version__"]
