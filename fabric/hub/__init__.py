"""The hub: the control plane, everything only the hub process runs.

`serve` starts one in this process (`fabric hub serve` from the shell);
`HubServer` is its socket loop, `HubState` its in-memory state.
"""

from weightfabric.fabric.hub.server import HubServer, serve
from weightfabric.fabric.hub.state import HubState

__all__ = ["HubServer", "HubState", "serve"]
