"""What a datacenter's grid shows: its boxes (collapsed when large), counts and roles."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from weightfabric.topology.draw.labels import plural
from weightfabric.topology.draw.style import MAX_CELLS, MAX_FULL_NODES, SHOWN_PER_GROUP
from weightfabric.topology.schema import Cluster, Datacenter, NodeGroup, NodeType


@dataclass(frozen=True)
class Cell:
    """One box of a datacenter's grid: a node, or a box standing for `hidden` nodes."""

    label: str
    type: NodeType | None  # None for the box folding several node groups
    domain: str | None = None
    hidden: int = 0
    detail: str = ""
    folds: tuple[tuple[NodeGroup, int], ...] = ()  # node groups hidden here, from which index

    def members(self) -> list[str]:
        """The nodes a "+N more" box stands for (none for a node's own box)."""
        return [node_name(g, i) for g, first in self.folds for i in range(first, group_size(g))]


def group_size(group: NodeGroup) -> int:
    """How many nodes `group` stands for."""
    return group.count if group.count is not None else 1


def node_name(group: NodeGroup, i: int) -> str:
    """The name of node `i` of `group`."""
    return group.name.replace("{i}", str(i)) if group.count is not None else group.name


def grid_cells(cluster: Cluster, dc: Datacenter) -> list[Cell]:
    """The boxes of a datacenter's grid, collapsed when the datacenter is large."""
    full = sum(group_size(g) for g in dc.nodes) <= MAX_FULL_NODES
    cells: list[Cell] = []
    for k, g in enumerate(dc.nodes):
        t = cluster.node_types[g.type]
        n = group_size(g)
        shown = n if full else min(n, SHOWN_PER_GROUP)
        group_cells = [Cell(node_name(g, i), t, g.nvlink_domain) for i in range(shown)]
        if shown < n:
            detail = f"{node_name(g, shown)} … {node_name(g, n - 1)}"
            group_cells.append(Cell(f"+{n - shown:,} more", t, g.nvlink_domain,
                                     hidden=n - shown, detail=detail, folds=((g, shown),)))
        last = k == len(dc.nodes) - 1
        if len(cells) + len(group_cells) > MAX_CELLS - (0 if last else 1):
            rest = dc.nodes[k:]
            nodes = sum(group_size(r) for r in rest)
            gpus = sum(group_size(r) * cluster.node_types[r.type].gpus for r in rest)
            cells.append(Cell(f"+{nodes:,} more", None, hidden=nodes,
                               detail=f"{plural(len(rest), 'node group')} · {plural(gpus, 'GPU')}",
                               folds=tuple((r, 0) for r in rest)))
            break
        cells.extend(group_cells)
    return cells


def dc_totals(cluster: Cluster, dc: Datacenter) -> tuple[int, int, int]:
    """(nodes, GPUs, NICs) of a datacenter, without expanding its node groups."""
    nodes = gpus = nics = 0
    for g in dc.nodes:
        t = cluster.node_types[g.type]
        n = group_size(g)
        nodes += n
        gpus += n * t.gpus
        nics += n * (t.nics.count if t.nics else 0)
    return nodes, gpus, nics


def roles_tag(cluster: Cluster, name: str) -> tuple[str, bool]:
    """The roles of node `name` as shown beside it, and whether it is a trainer."""
    roles = [role for role, patterns in cluster.roles.items()
             if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
    return ("" if roles == [name] else ", ".join(roles)), "trainer" in roles


__all__ = ["Cell", "dc_totals", "grid_cells", "group_size", "node_name", "roles_tag"]
