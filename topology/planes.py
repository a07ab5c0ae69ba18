"""How a version's bytes are cut into stripes, and the planes of a one-machine broadcast.

Across machines every stripe is a `TREE` (one per rail). Inside one NVSwitch
machine the bytes are also split over the links NVLink leaves idle: a PCIe
peer-to-peer chain through the host (`HOST`) and a GPUDirect NIC-loopback chain
through the leaf (`NIC_LOOP`), in proportion to their rates (`side_planes`).
"""

from __future__ import annotations

from weightfabric.topology.estimate import MIN_CHUNK
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import HOST, NIC_LOOP, TREE, Interval, covers


def cut_stripes(layout: Layout, size: int, need: dict[str, list[Interval]],
             held: dict[str, list[Interval]], weights: dict[str, float] | None = None
             ) -> tuple[list[Interval], list[str]]:
    """Stripe boundaries and the plane of each stripe.

    Stripe boundaries and the plane of each stripe (bytes per plane in proportion to
    `weights`, default the planes' rates).
    """
    machines = {layout.machine_of[d] for d in need}
    k = max((len(layout.machines[m].nics) for m in machines), default=1)
    single = {layout.machine_of[d] for d in list(need) + list(held)}
    cuts = [(TREE, size)]
    if len(single) == 1:  # one machine: one stripe per reader (scatter, then all-gather)
        k = len(need)
        cuts = _plane_cuts(size, weights or side_planes(layout, held, need, size))
    tree_end = cuts[0][1]
    k = max(1, min(k, tree_end))
    bounds = sorted({tree_end * i // k for i in range(k + 1)} | {end for _, end in cuts}
                    | {b for rs in held.values() for r in rs for b in r if 0 < b < size})
    stripes = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return stripes, [next(p for p, end in cuts if b <= end) for _, b in stripes]


def _plane_cuts(size: int, rates: dict[str, float]) -> list[tuple[str, int]]:
    """(plane, end byte) per plane.

    Bytes in proportion to each plane's rate, so that all planes finish together; planes
    that would get under one chunk are dropped.
    """
    total = sum(rates.values())
    cuts, end = [], 0
    for plane, rate in rates.items():
        share = int(size * rate / total)
        if plane != TREE and share < MIN_CHUNK:
            continue
        end += share
        cuts.append((plane, end))
    cuts[-1] = (cuts[-1][0], size)
    return cuts


def side_planes(layout: Layout, held: dict[str, list[Interval]],
                need: dict[str, list[Interval]], size: int) -> dict[str, float]:
    """Per-reader rate of each plane a one-machine broadcast can use in parallel.

    Args:
        layout (Layout): The indexed cluster.
        held, need (mapping device -> byte ranges): Holders and readers, all on one machine.
        size (int): Bytes of the version.

    Returns:
        dict: ``{TREE: NVLink rate}`` plus, where the graph has them, ``HOST`` (a chain holder
            -> reader -> reader ... over PCIe through the host's root complex) and ``NIC_LOOP``
            (a chain over each GPU's rail NIC and the leaf: GPUDirect RDMA loopback through the
            switch), each with what the planes before it leave of the links they share (a GPU's
            PCIe port carries both side planes), and only when that is more than nothing. Only
            ``{TREE: 1.0}`` when the machine has no NVSwitch joining all of them or no device
            holds every byte (the planes then bring nothing measurable).

    Notes:
        On an NVSwitch machine the NVLink scatter/all-gather gives each reader the NVLink
        bandwidth B_nv; the host and NIC planes reach every reader over links NVLink does
        not use, so splitting the bytes in proportion to the rates finishes at
        ``S / (B_nv + B_host + B_nic)`` instead of ``S / B_nv``. On a DGX H100 the host
        and NIC planes share each GPU's x16 port, so the host plane takes all 64 GB/s of
        it and the NIC plane is left out: 450 -> 514 GB/s per GPU. O(readers) edge
        look-ups.
    """
    devices = list(need) + list(held)
    m = layout.machine(devices[0])
    full = [h for h, r in held.items() if covers(r, 0, size)]
    if not full or m.nvswitch is None or not all(d in m.gpus for d in devices):
        return {TREE: 1.0}
    edges, src, readers = layout.graph.edges, full[0], list(need)
    rates = {TREE: min([edges[src, m.nvswitch]["bandwidth"]]
                       + [edges[m.nvswitch, r]["bandwidth"] for r in readers])}
    left: dict[tuple[str, str], float] = {}  # what the planes before left of each arc

    def take(arcs: set[tuple[str, str]]) -> float:
        rate = min(left.get(a, edges[a]["bandwidth"]) for a in arcs)
        for a in arcs:
            left[a] = left.get(a, edges[a]["bandwidth"]) - rate
        return rate

    chain = [src] + readers
    host = {a for d in chain for a in _arcs(layout.to_host(d))}
    host |= {(b, a) for a, b in host}
    if all(a in edges for a in host) and (rate := take(host)) > 0:
        rates[HOST] = rate
    nics = [n for n in map(layout.rail_nic, chain) if n]
    if m.leaf is not None and len(nics) == len(chain):  # every device has a rail NIC
        loop = {a for d, n in zip(chain, nics, strict=True)
                for a in _arcs(layout.to_nic(m, d, n) + (m.leaf,))}
        loop |= {(b, a) for a, b in loop}
        if all(a in edges for a in loop) and (rate := take(loop)) > 0:
            rates[NIC_LOOP] = rate
    return rates


def _arcs(path: tuple[str, ...]) -> list[tuple[str, str]]:
    return list(zip(path, path[1:], strict=False))


__all__ = ["cut_stripes", "side_planes"]
