"""Broadcast planner: a forest of pipelined stripe trees across WAN, network and NVLink.

Algorithm
---------
The version's bytes are cut into ``K`` stripes (``K`` = the largest NIC count of a
reading machine, so every rail carries one stripe). Each stripe is distributed by
its own tree, built in three levels:

1. **Datacenters.** A maximum-bottleneck (widest-path) tree over the WAN gateways,
   grown from the datacenters holding the stripe (`Layout.wan_tree`). Every other
   datacenter with readers gets one parent and one *entry machine*; each stripe
   crosses the WAN once into it, so a remote datacenter receives exactly S bytes
   over the WAN per version.
2. **Machines inside a datacenter.** The SplitStream / rail-aligned construction:
   reading machine ``i`` is *interior* in tree ``i mod K`` with fan-out ``K`` and a
   leaf in the others. A machine then sends at most ``K`` stripe-streams (its K
   NICs, one stream each) and receives ``K`` (one per NIC): stripe ``k`` lands on
   NIC ``k mod nics`` and its GPU (rail-aligned ingress), and an interior machine
   sends on all of its rails in parallel. Holder machines are the roots with one
   slot per tree (all their rails in use across the K trees; with several holders
   every tree has several roots, so a joining reader stripes over all of them);
   entry machines are roots of their datacenter. Trees are built breadth first,
   so they are ``O(log_K N)`` machines deep. When a tree runs out of slots (fewer
   machines than stripes) the leaf with the most unused NIC egress (a machine interior in a tree that
   had slots to spare) is promoted.
   Under oversubscribed leaves the construction is applied one level up
   (`_Builder._by_leaf`): each leaf gets each stripe over the spine once, on an
   entry machine that fans it out under the leaf, with a per-leaf budget of K
   cross-leaf streams over all trees.
3. **Inside a machine.** The landing device forwards the stripe to the machine's
   other readers: one hop over NVSwitch (star) or, without a switch, a chain over
   PCIe / NVLink pairs (each device forwards each byte once). A broadcast within
   one NVSwitch machine also uses the links NVLink leaves idle: the bytes are split
   over planes (`side_planes`: NVSwitch all-gather, a PCIe peer-to-peer chain
   through the host, a GPUDirect NIC-loopback chain through the leaf) in proportion
   to their rates, then re-cut once so that all planes finish together.

Every tree edge is a `Transfer` whose ``upstream`` is the transfer that feeds its
source, so a fetch engine (and `topology.simulator`) pipelines chunks down the
tree: time ~ S/(K·B) + depth·chunk/B. The chunk size minimises
``(k + D - 1)(alpha + S_stripe/(k·B))``: ``k* = sqrt((D-1)·S_stripe/(alpha·B))``.
Readers that need only parts of the bytes (sharded layouts, or what is left after
a failure) are placed in the trees of the stripes they need and read only those
ranges; `replan` uses this to route around vanished sources, keeping what every
reader already has.

Complexity: O(V + E) to index the graph, then O(R·K·h) for R readers, K stripes
and routes of h ≤ 12 hops; predicted times are an equal-share estimate in
O(transfers·h). No max-flow, arborescence or shortest-path search runs per reader
(a 10,000-GPU plan takes a few seconds; see docs/benchmarks.md). Leaf-aware
placement adds O(leaves·machines-per-leaf) per stripe; the one-machine planes plan
twice (O(readers²) transfers at most).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping

import networkx as nx

from topology.layout import Layout, Machine, dedupe
from topology.plan import (
    HOST,
    NIC_LOOP,
    TREE,
    EmptyTransferError,
    Interval,
    Plan,
    PlanError,
    Transfer,
    UnknownDeviceError,
    UnreachableReaderError,
    covers,
    intersect,
    merge_intervals,
)
from topology.schema import Cluster

HOP_OVERHEAD = 10e-6   # seconds of fixed cost per chunk and hop (request, completion)
MIN_CHUNK = 1 << 20
MAX_CHUNK = 256 << 20

SourceSpec = Iterable[str] | Mapping[str, list[Interval] | None] | None


def plan_broadcast(cluster: Cluster | nx.DiGraph | Layout, size: int, *,
                   sources: SourceSpec = None, readers: Iterable[str] | None = None,
                   needs: Mapping[str, list[Interval]] | None = None,
                   chunk: int | None = None, stripes: list[Interval] | None = None,
                   planes: list[str] | None = None, leaf_aware: bool = True) -> Plan:
    """Plan how every reader gets the bytes it needs of a version of `size` bytes.

    Parameters
    ----------
    cluster : Cluster, networkx.DiGraph or Layout
        The cluster (its graph is built), a graph from `Cluster.graph()`, or a
        `Layout` of one (reuse it when planning repeatedly).
    size : int
        Bytes of the version.
    sources : iterable of names, or mapping name -> byte ranges (None = all)
        Devices (``node/gpu3``, ``node/host``) or nodes (all their devices) that
        hold the version. Default: the devices of the YAML's ``trainer`` role.
    readers : iterable of names
        Devices or nodes that need all the bytes. Default: the ``rollout`` role's
        devices that are not sources.
    needs : mapping reader -> byte ranges
        Instead of `readers`: what each reader needs (sharded layouts, re-plans).
    chunk : int
        Pipelining unit in bytes; default from the pipelining optimum.
    stripes : list of (start, end)
        Stripe boundaries to reuse (a re-plan keeps the original plan's).
    planes : list of str
        With `stripes`: the plane of each stripe (`Plan.planes`; default all `TREE`).
    leaf_aware : bool
        Place tree children leaf by leaf under oversubscribed leaves (default);
        False builds the trees in machine order (for comparison).

    Returns
    -------
    Plan
        Transfers (upstream first), stripes, chunk and predicted times per reader.

    Raises
    ------
    EmptyTransferError
        `size` is not positive, or there are no readers.
    UnknownDeviceError
        A name is neither a device nor a node of the cluster.
    UnreachableReaderError
        A reader has no route from any holder of some bytes it needs.
    PlanError
        Some bytes are held by no source, or a reader is also a full source.

    Notes
    -----
    See the module docstring for the algorithm and its complexity.

    Examples
    --------
    >>> from topology import reference_cluster
    >>> plan = plan_broadcast(reference_cluster("4x-dgx-h100"), 140 * 10**9)
    >>> len(plan.readers), round(plan.predicted_s, 2)
    (24, 0.35)
    """
    started = time.perf_counter()
    layout = _layout(cluster)
    held, need = _endpoints(cluster, layout, int(size), sources, readers, needs)
    rebalance = stripes is None
    if stripes is None:
        stripes, planes = _stripes(layout, int(size), need, held)
    planes = list(planes or [])
    if planes and len(planes) != len(stripes):
        raise PlanError(f"{len(planes)} planes for {len(stripes)} stripes; pass one per stripe")
    plan = _build(layout, int(size), held, need, stripes, planes, chunk, leaf_aware)
    if rebalance and any(p != TREE for p in planes):
        # second pass: move bytes off the planes that finish late (deep chains lag)
        stripes, planes = _rebalance(layout, plan, need, held)
        plan = _build(layout, int(size), held, need, stripes, planes, chunk, leaf_aware)
    plan.plan_seconds = time.perf_counter() - started
    return plan


def _build(layout: Layout, size: int, held: dict[str, list[Interval]],
           need: dict[str, list[Interval]], stripes: list[Interval], planes: list[str],
           chunk: int | None, leaf_aware: bool = True) -> Plan:
    transfers = _Builder(layout, held, need, stripes, planes, leaf_aware).build()
    plan = Plan(size=size, chunk=0, stripes=list(stripes), transfers=transfers,
                sources=held, needs=need, planes=planes)
    rates = share_rates(layout.graph, transfers)
    plan.chunk = int(chunk) if chunk else choose_chunk(plan, rates)
    plan.predicted = predict(layout.graph, transfers, plan.chunk, rates)
    return plan


def _rebalance(layout: Layout, plan: Plan, need: dict[str, list[Interval]],
               held: dict[str, list[Interval]]) -> tuple[list[Interval], list[str]]:
    """Re-cut the planes so that they finish together, given each one's fixed lag.

    Plane p with b_p bytes finishing at T_p has rate R_p = b_p / (T_p - L_p); its lag
    L_p (pipeline fill, latency) is taken from the first pass's prediction as
    T_p - b_p / R_p with R_p from `side_planes`. All finish at
    T* = (S + sum R_p L_p) / sum R_p when b_p = R_p (T* - L_p).
    """
    rates = side_planes(layout, held, need, plan.size)
    ends = _ends(layout.graph, plan.transfers, plan.chunk)
    finish: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for s, (lo, hi) in enumerate(plan.stripes):
        nbytes[plan.planes[s]] += hi - lo
    for t, end in zip(plan.transfers, ends, strict=True):
        p = plan.planes[t.stripe]
        finish[p] = max(finish[p], end)
    rates = {p: r for p, r in rates.items() if p in finish}
    lag = {p: max(0.0, finish[p] - nbytes[p] / r) for p, r in rates.items()}
    target = (plan.size + sum(r * lag[p] for p, r in rates.items())) / sum(rates.values())
    share = {p: max(0.0, r * (target - lag[p])) for p, r in rates.items()}
    return _stripes(layout, plan.size, need, held, share)


def replan(plan: Plan, cluster: Cluster | nx.DiGraph | Layout, *, lost: Iterable[str],
           have: Mapping[str, list[Interval]] | None = None) -> Plan:
    """Plan the bytes still missing after the devices in `lost` vanished.

    Parameters
    ----------
    plan : Plan
        The plan being executed.
    cluster : Cluster, networkx.DiGraph or Layout
        The same cluster.
    lost : iterable of str
        Devices that are gone (sources or readers); they neither serve nor need.
    have : mapping reader -> byte ranges
        What each reader already holds (default: nothing).

    Returns
    -------
    Plan
        Transfers for the missing ranges only, over the surviving holders (original
        sources and readers that are complete), with the original stripes.

    Raises
    ------
    PlanError
        Some missing bytes are held by no surviving source.
    """
    gone = set(lost)
    have = dict(have or {})
    holders = {d: r for d, r in plan.sources.items() if d not in gone}
    missing: dict[str, list[Interval]] = {}
    for reader, ranges in plan.needs.items():
        if reader in gone:
            continue
        got = merge_intervals(have.get(reader, []))
        rest = _subtract(ranges, got)
        if rest:
            missing[reader] = rest
        else:
            holders[reader] = merge_intervals(got + holders.get(reader, []))
    if not missing:
        return Plan(size=plan.size, chunk=plan.chunk, stripes=plan.stripes, transfers=[],
                    sources=holders, needs={}, planes=plan.planes)
    return plan_broadcast(cluster, plan.size, sources=holders, needs=missing,
                          chunk=plan.chunk, stripes=plan.stripes, planes=plan.planes)


# --- inputs -----------------------------------------------------------------------

def _layout(cluster: Cluster | nx.DiGraph | Layout) -> Layout:
    if isinstance(cluster, Layout):
        return cluster
    if isinstance(cluster, Cluster):
        return Layout(cluster.graph())
    return Layout(cluster)


def resolve(layout: Layout, names: Iterable[str], what: str) -> list[str]:
    """Devices named by `names` (devices, or nodes meaning all their devices), in order."""
    out: list[str] = []
    for name in names:
        if layout.is_device(name):
            out.append(name)
        elif name in layout.machines:
            out.extend(layout.machines[name].devices)
        else:
            example = next(iter(layout.machines), "node")
            raise UnknownDeviceError(
                f"{what} {name!r} is not a device or node of this cluster; name a node "
                f"(e.g. {example!r}) or a device (e.g. {example + '/gpu0'!r} or "
                f"{example + '/host'!r}); 'fabric topo show FILE' lists them")
    return list(dict.fromkeys(out))


def default_endpoints(cluster: Cluster, layout: Layout) -> tuple[list[str], list[str]]:
    """Sources and readers from the YAML roles: trainer devices, rollout devices.

    When the roles overlap (one machine both trains and rolls out), the first
    trainer device is the source and every other rollout device a reader.
    """
    trainer = resolve(layout, [n.name for n in cluster.role("trainer")], "trainer")
    rollout = resolve(layout, [n.name for n in cluster.role("rollout")], "rollout")
    if not trainer:
        trainer = layout.machines[next(iter(layout.machines))].devices[:1]
    readers = [d for d in rollout if d not in set(trainer)]
    if not readers:
        trainer = trainer[:1]
        readers = [d for d in rollout if d != trainer[0]]
    return trainer, readers


def _endpoints(cluster, layout: Layout, size: int, sources: SourceSpec,
               readers: Iterable[str] | None, needs: Mapping[str, list[Interval]] | None
               ) -> tuple[dict[str, list[Interval]], dict[str, list[Interval]]]:
    if size <= 0:
        raise EmptyTransferError(f"size must be a positive number of bytes, got {size}; "
                                 "pass the version's size, e.g. --size 140GB")
    if (sources is None or (readers is None and needs is None)) \
            and not isinstance(cluster, Cluster):
        raise PlanError("sources and readers have no default without a Cluster (roles); "
                        "pass them explicitly")
    defaults = default_endpoints(cluster, layout) if isinstance(cluster, Cluster) else None
    whole = [(0, size)]
    held: dict[str, list[Interval]] = {}
    if sources is None:
        sources = defaults[0]
    if isinstance(sources, Mapping):
        for name, ranges in sources.items():
            for dev in resolve(layout, [name], "source"):
                held[dev] = merge_intervals(intersect(list(ranges), 0, size)) \
                    if ranges is not None else whole
    else:
        held = {dev: whole for dev in resolve(layout, sources, "source")}
    if not held:
        raise PlanError("no sources: name the devices that hold the version (--sources)")
    if needs is not None:
        need = {}
        for name, ranges in needs.items():
            for dev in resolve(layout, [name], "reader"):
                need[dev] = merge_intervals(intersect(list(ranges), 0, size))
    else:
        names = defaults[1] if readers is None else readers
        need = {dev: whole for dev in resolve(layout, names, "reader")}
    for dev, ranges in list(need.items()):
        ranges = _subtract(ranges, held.get(dev, []))
        if ranges:
            need[dev] = ranges
        else:
            del need[dev]
    if not need:
        raise EmptyTransferError("no reader needs any bytes the sources do not already "
                                 "hold; pass --readers other than the sources")
    return held, need


def _subtract(ranges: list[Interval], remove: list[Interval]) -> list[Interval]:
    out = []
    remove = merge_intervals(remove)
    for lo, hi in merge_intervals(ranges):
        cur = lo
        for a, b in remove:
            if b <= cur or a >= hi:
                continue
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if cur < hi:
            out.append((cur, hi))
    return out


def _stripes(layout: Layout, size: int, need: dict[str, list[Interval]],
             held: dict[str, list[Interval]], weights: dict[str, float] | None = None
             ) -> tuple[list[Interval], list[str]]:
    """Stripe boundaries and the plane of each stripe (bytes per plane in proportion
    to `weights`, default the planes' rates)."""
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
    """(plane, end byte) per plane: bytes in proportion to each plane's rate, so that
    all planes finish together; planes that would get under one chunk are dropped."""
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

    Parameters
    ----------
    layout : Layout
        The indexed cluster.
    held, need : mapping device -> byte ranges
        Holders and readers, all on one machine.
    size : int
        Bytes of the version.

    Returns
    -------
    dict
        ``{TREE: NVLink rate}`` plus, where the graph has them, ``HOST`` (a chain
        holder -> reader -> reader ... over PCIe through the host's root complex) and
        ``NIC_LOOP`` (a chain over each GPU's rail NIC and the leaf: GPUDirect RDMA
        loopback through the switch). Only
        ``{TREE: 1.0}`` when the machine has no NVSwitch joining all of them or no
        device holds every byte (the planes then bring nothing measurable).

    Notes
    -----
    On an NVSwitch machine the NVLink scatter/all-gather gives each reader the NVLink
    bandwidth B_nv; the host and NIC planes reach every reader over links NVLink does
    not use, so splitting the bytes in proportion to the rates finishes at
    ``S / (B_nv + B_host + B_nic)`` instead of ``S / B_nv`` (DGX H100: 450 -> 564 GB/s
    per GPU in the graph's model). O(readers) edge look-ups.
    """
    devices = list(need) + list(held)
    m = layout.machine(devices[0])
    full = [h for h, r in held.items() if covers(r, 0, size)]
    if not full or m.nvswitch is None or not all(d in m.gpus for d in devices):
        return {TREE: 1.0}
    edges, src, readers = layout.graph.edges, full[0], list(need)
    rates = {TREE: min([edges[src, m.nvswitch]["bandwidth"]]
                       + [edges[m.nvswitch, r]["bandwidth"] for r in readers])}
    host = [a for d in [src] + readers for a in ((d, m.host), (m.host, d))]
    if all(a in edges for a in host):
        rates[HOST] = min(edges[a]["bandwidth"] for a in host)
    nics = [layout.rail_nic(d) for d in [src] + readers]
    if m.leaf is not None and all(nics):
        arcs = [a for d, n in zip([src] + readers, nics, strict=True)
                for a in ((d, n), (n, m.leaf), (m.leaf, n), (n, d))]
        if all(a in edges for a in arcs):
            rates[NIC_LOOP] = min(edges[a]["bandwidth"] for a in arcs)
    return rates


# --- the forest -------------------------------------------------------------------

class _Builder:
    """Builds the transfers of every stripe tree (see the module docstring)."""

    def __init__(self, layout: Layout, held: dict[str, list[Interval]],
                 need: dict[str, list[Interval]], stripes: list[Interval],
                 planes: list[str], leaf_aware: bool = True) -> None:
        self.layout, self.held, self.need, self.stripes = layout, held, need, stripes
        self.planes, self.leaf_aware = planes, leaf_aware
        self.k = len(stripes)
        self.transfers: list[Transfer] = []
        self.incoming: dict[tuple[str, int], int] = {}
        self.egress_load: dict[str, list[int]] = {}
        self.home: dict[str, int] = {}  # the tree a machine is interior in
        self.leaf_budget: dict[str | None, int] = {}  # cross-leaf streams a leaf may send
        order = {m: i for i, m in enumerate(layout.machines)}
        self.order = order

    def build(self) -> list[Transfer]:
        for s, (lo, hi) in enumerate(self.stripes):
            holders = [d for d, r in self.held.items() if covers(r, lo, hi)]
            if not holders:
                raise PlanError(f"bytes [{lo}, {hi}) are held by no source; add a source "
                                "that holds them")
            plane = self.planes[s] if self.planes else TREE
            if plane == TREE or not self._side_plane(s, lo, hi, holders, plane):
                self._stripe(s, lo, hi, holders)
        return self.transfers

    def _side_plane(self, s: int, lo: int, hi: int, holders: list[str], plane: str) -> bool:
        """Stripe `s` over the host or the NIC loopback of one machine; False (and
        nothing added) when that plane does not fit these holders and readers."""
        lay, edges = self.layout, self.layout.graph.edges
        readers = [d for d, r in self.need.items() if intersect(r, lo, hi)]
        if not readers:
            return True
        m = lay.machine(readers[0])
        local = [h for h in holders if lay.machine_of[h] == m.name]
        if any(lay.machine_of[r] != m.name for r in readers) or not local:
            return False
        # a chain (each link carries the stripe once); relays need all of it to forward
        if any(not covers(self.need[r], lo, hi) for r in readers):
            return False
        if plane == HOST:  # PCIe peer-to-peer through the root complex
            src = next((h for h in local if (h, m.host) in edges), None)
            if src is None or any((m.host, r) not in edges or (r, m.host) not in edges
                                  for r in readers):
                return False
            hops = [(m.host,)] * len(readers)
        else:  # NIC_LOOP: GPUDirect RDMA out of one rail NIC, back in through the next
            src = next((h for h in local if lay.rail_nic(h)), None)
            if src is None or m.leaf is None or not all(lay.rail_nic(r) for r in readers):
                return False
            hops = [(m.leaf,)] * len(readers)
        prev = src
        for r, middle in zip(sorted(readers, key=lay.rail_of), hops, strict=True):
            if plane == NIC_LOOP:
                middle = (lay.rail_nic(prev), *middle, lay.rail_nic(r))
            self._add(s, prev, r, path=dedupe((prev, *middle, r)))
            prev = r
        return True

    # one stripe
    def _stripe(self, s: int, lo: int, hi: int, holders: list[str]) -> None:
        lay = self.layout
        readers = [d for d, r in self.need.items() if intersect(r, lo, hi)]
        if not readers:
            return
        by_machine: dict[str, list[str]] = defaultdict(list)
        for d in readers:
            by_machine[lay.machine_of[d]].append(d)
        holder_machines: dict[str, list[str]] = defaultdict(list)
        for d in holders:
            holder_machines[lay.machine_of[d]].append(d)
        dcs: dict[str, list[str]] = defaultdict(list)
        for m in sorted(by_machine, key=self.order.__getitem__):
            dcs[lay.machines[m].datacenter].append(m)
        roots = {lay.machines[m].datacenter for m in holder_machines}
        parents = lay.wan_tree(roots, set(dcs))
        for dc in dcs:
            if dc not in roots and dc not in parents:
                raise UnreachableReaderError(
                    f"readers in datacenter {dc!r} (e.g. {by_machine[dcs[dc][0]][0]!r}) "
                    f"cannot be reached from any source of bytes [{lo}, {hi}); add a WAN "
                    "link to that datacenter or a source inside it")
        children: dict[str, list[str]] = defaultdict(list)
        for dc, p in parents.items():
            children[p].append(dc)
        entry_slot: dict[str, list[list]] = {}
        queue = deque(sorted(roots))
        while queue:
            dc = queue.popleft()
            self._datacenter(s, dc, dcs.get(dc, []), holder_machines, by_machine,
                             children.get(dc, []), entry_slot)
            queue.extend(children.get(dc, []))

    def _datacenter(self, s: int, dc: str, machines: list[str],
                    holder_machines: dict[str, list[str]], by_machine: dict[str, list[str]],
                    exports: list[str], entry_slot: dict[str, list[list]]) -> None:
        lay = self.layout
        slots: deque[list] = deque()  # [machine, free slots, next egress, devices holding]
        if dc in entry_slot:
            slots.extend(entry_slot[dc])
            entry = entry_slot[dc][0][0]
        else:
            entry = None
            for m, devs in sorted(holder_machines.items(), key=lambda kv: self.order[kv[0]]):
                if lay.machines[m].datacenter == dc:
                    slots.append([m, 1, s, devs])
        # readers sharing a machine with a holder (or the entry) are served inside it
        inner = [m for m in machines if m in holder_machines or m == entry]
        for m in inner:
            if m != entry:
                self._inside(s, m, by_machine[m], holder_machines[m])
        rest = [m for m in machines if m not in inner]
        if self.leaf_aware and any(lay.oversubscribed(lay.machines[m].leaf) for m in rest):
            self._by_leaf(s, rest, slots, exports, by_machine, entry_slot)
            return
        for i, m in enumerate(rest):
            self.home.setdefault(m, i % self.k)
        designated = [m for i, m in enumerate(rest) if i % self.k == s % self.k]
        others = [m for m in rest if m not in set(designated)]
        if others:
            shift = (s * max(1, len(others) // self.k)) % len(others)
            others = others[shift:] + others[:shift]
        spare: deque[str] = deque()
        order = [(m, True) for m in designated] + [(dc2, None) for dc2 in exports] \
            + [(m, False) for m in others]
        roots = list(slots)
        for item, interior in order:
            if not slots:
                if spare:  # promote the leaf with the most unused NIC egress
                    m = min(spare, key=lambda x: self._committed(x, s))
                    spare.remove(m)
                    slots.append([m, self.k, s, by_machine[m]])
                else:  # overload the roots rather than fail
                    slots.extend([r[0], 1, r[2], r[3]] for r in roots)
            slot = slots[0]
            parent, senders = slot[0], slot[3]
            egress = self._egress(parent, slot[2])
            slot[1] -= 1
            slot[2] += 1
            if slot[1] == 0:
                slots.popleft()
            sender = self._sender(parent, egress, senders, s)
            if interior is None:  # a child datacenter: its entry machine
                target = self._entry(item, by_machine)
                self._land(s, sender, target, by_machine[target], egress)
                entry_slot[item] = [[target, 1, s, by_machine[target]]]
                continue
            self._land(s, sender, item, by_machine[item], egress)
            if interior:
                slots.append([item, self.k, s, by_machine[item]])
            else:
                spare.append(item)

    def _by_leaf(self, s: int, rest: list[str], slots: deque[list], exports: list[str],
                 by_machine: dict[str, list[str]], entry_slot: dict[str, list[list]]) -> None:
        """Stripe `s` into the machines `rest` of an oversubscribed datacenter.

        The SplitStream construction one level up. Each leaf receives the stripe
        once over the spine, on an *entry* machine, and fans it out under the leaf
        (a breadth-first tree of fan-out K, rotated with the stripe so that every
        machine relays about once); a leaf under a holder reads the holder's stream
        without crossing the spine. Relaying under a leaf of L machines costs
        (L-1)·K of the leaf's K·L NIC streams, so each leaf has a budget of K
        cross-leaf streams over all trees. The leaf-level trees are built breadth
        first: when no slot is left, the leaf that has the stripe and the most
        budget left gets min(K, budget) slots, spread over its machines by NIC
        egress committed. A leaf's uplink then carries each stripe in at most once
        and at most about K streams out (S in, S out: the least possible without a
        holder under it), and every machine sends about K streams, one per NIC.
        """
        lay = self.layout
        groups: dict[str | None, list[str]] = defaultdict(list)
        for m in rest:
            groups[lay.machines[m].leaf].append(m)
        for leaf in groups:
            self.leaf_budget.setdefault(leaf, self.k)
        rooted = [lf for lf in groups if any(lay.machines[r[0]].leaf == lf for r in slots)]
        free = [lf for lf in groups if lf not in rooted]
        if free:
            shift = (s * max(1, len(free) // self.k)) % len(free)
            free = free[shift:] + free[:shift]
        roots, have = list(slots), []
        for leaf in rooted + free:
            members = self._leaf_order(groups[leaf], s)
            parent, egress, senders = self._cross(s, slots, roots, have, rooted, groups,
                                                  by_machine, leaf)
            head = members[0]
            self._land(s, self._sender(parent, egress, senders, s), head, by_machine[head],
                       egress)
            local: deque[list] = deque([[head, self.k, s, by_machine[head]]])
            for m in members[1:]:  # breadth first under the leaf, fan-out K
                parent, egress, senders = self._use(local, leaf)
                self._land(s, self._sender(parent, egress, senders, s), m, by_machine[m],
                           egress)
                local.append([m, self.k, s, by_machine[m]])
            have.append(leaf)
        for dc in exports:
            parent, egress, senders = self._cross(s, slots, roots, have, rooted, groups,
                                                  by_machine, None)
            target = self._entry(dc, by_machine)
            self._land(s, self._sender(parent, egress, senders, s), target, by_machine[target],
                       egress)
            entry_slot[dc] = [[target, 1, s, by_machine[target]]]

    def _cross(self, s: int, slots: deque[list], roots: list[list], have: list,
               rooted: list, groups: dict[str | None, list[str]], by_machine: dict[str, list[str]],
               leaf: str | None) -> tuple[str, int, list[str]]:
        """A slot to send stripe `s` into `leaf` (see `_by_leaf`); one under `leaf`
        first, else promote the leaf in `have` with the most budget, else overload
        the roots."""
        lay = self.layout
        if not any(lay.machines[x[0]].leaf == leaf for x in slots) and not slots:
            if have:
                best = max(have, key=lambda lf: (self.leaf_budget[lf], -have.index(lf)))
                have.remove(best)
                # a leaf under a holder is the only one with the stripe at first in every
                # tree: keep one stream of its budget for each later tree
                reserve = self.k - 1 - s if best in rooted else 0
                grant = min(self.k, max(1, self.leaf_budget[best] - reserve))
                slots.extend(self._leaf_slots(groups[best], s, by_machine, grant))
            else:
                slots.extend([r[0], 1, r[2], r[3]] for r in roots)
        parent, egress, senders = self._use(slots, leaf)
        source_leaf = lay.machines[parent].leaf
        if source_leaf != leaf and source_leaf in self.leaf_budget:
            self.leaf_budget[source_leaf] -= 1
        return parent, egress, senders

    def _use(self, slots: deque[list], leaf: str | None) -> tuple[str, int, list[str]]:
        """Use one slot, preferring one under `leaf`: (parent, egress NIC, devices)."""
        lay = self.layout
        slot = next((x for x in slots if lay.machines[x[0]].leaf == leaf), slots[0])
        egress = self._egress(slot[0], slot[2])
        slot[1] -= 1
        slot[2] += 1
        if slot[1] == 0:
            slots.remove(slot)
        return slot[0], egress, slot[3]

    def _leaf_order(self, members: list[str], s: int) -> list[str]:
        """`members` rotated for stripe `s` so that the relays under a leaf change
        from tree to tree (the first is the entry)."""
        shift = (s * max(1, len(members) // self.k)) % len(members)
        return members[shift:] + members[:shift]

    def _leaf_slots(self, members: list[str], s: int, by_machine: dict[str, list[str]],
                    count: int) -> list[list]:
        """`count` one-stream slots over `members`, least NIC egress committed first
        (used so far, plus what it will relay under the leaf in later trees)."""
        load = {m: sum(self.egress_load.get(m, ())) for m in members}
        for later in range(s + 1, self.k):
            left = len(members) - 1
            for m in self._leaf_order(members, later):  # breadth first, fan-out K
                load[m] += min(self.k, left)
                left -= min(self.k, left)
                if not left:
                    break
        out = []
        for _ in range(count):
            m = min(members, key=load.__getitem__)
            load[m] += 1
            out.append([m, 1, s, by_machine[m]])
        return out

    def _committed(self, machine: str, s: int) -> int:
        """NIC streams `machine` sends: used so far, plus K if it is still to be
        interior in a later tree."""
        later = self.home.get(machine, -1) > s
        return sum(self.egress_load.get(machine, ())) + (self.k if later else 0)

    def _egress(self, machine: str, preferred: int) -> int:
        """The least used NIC of `machine` so far (ties: from `preferred` on)."""
        n = max(1, len(self.layout.machines[machine].nics))
        load = self.egress_load.setdefault(machine, [0] * n)
        rail = min(range(n), key=lambda r: (load[r], (r - preferred) % n))
        load[rail] += 1
        return rail

    def _entry(self, dc: str, by_machine: dict[str, list[str]]) -> str:
        lay = self.layout
        return min((m for m in by_machine if lay.machines[m].datacenter == dc),
                   key=self.order.__getitem__)

    def _sender(self, machine: str, egress: int, devices: list[str], s: int) -> str:
        m = self.layout.machines[machine]
        if m.nics:
            rail = m.rail_gpu.get(egress % len(m.nics))
            if rail in devices:
                return rail
        return devices[egress % len(devices)]

    def _land(self, s: int, sender: str, machine: str, devices: list[str], egress: int) -> str:
        """Transfer stripe `s` from `sender` into `machine`, then fan it out inside."""
        m = self.layout.machines[machine]
        ingress = s % len(m.nics) if m.nics else 0
        rail = m.rail_gpu.get(ingress) if m.nics else None
        landing = rail if rail in devices else devices[s % len(devices)]
        self._add(s, sender, landing, egress=egress, ingress=ingress)
        self._fan_out(s, m, landing, [d for d in devices if d != landing])
        return landing

    def _inside(self, s: int, machine: str, devices: list[str], holders: list[str]) -> None:
        m = self.layout.machines[machine]
        if not self._switched(m, devices + holders):  # one chain along NVLink/PCIe
            order = self._chain(holders[0], devices)
            self._add(s, holders[0], order[0])
            self._fan_out(s, m, order[0], order[1:])
            return
        landing = devices[s % len(devices)]
        rail = self.layout.rail_of(landing)
        source = next((h for h in holders if self.layout.rail_of(h) == rail), holders[0])
        self._add(s, source, landing)
        self._fan_out(s, m, landing, [d for d in devices if d != landing])

    @staticmethod
    def _switched(m: Machine, devices: list[str]) -> bool:
        return m.nvswitch is not None and all(d in m.gpus for d in devices)

    def _chain(self, start: str, devices: list[str]) -> list[str]:
        """`devices` ordered greedily so that consecutive ones share a direct link."""
        g, left, order, cur = self.layout.graph, list(devices), [], start
        while left:
            nxt = next((d for d in left if g.has_edge(cur, d)), left[0])
            left.remove(nxt)
            order.append(nxt)
            cur = nxt
        return order

    def _fan_out(self, s: int, m: Machine, landing: str, others: list[str]) -> None:
        if not others:
            return
        if self._switched(m, others + [landing]):
            for d in others:
                self._add(s, landing, d)
            return
        prev = landing
        for d in self._chain(landing, others):
            self._add(s, prev, d)
            prev = d

    def _add(self, s: int, source: str, reader: str, *, egress: int | None = None,
             ingress: int | None = None, path: tuple[str, ...] | None = None) -> None:
        lo, hi = self.stripes[s]
        if path is None:
            path = self.layout.route(source, reader, egress=egress, ingress=ingress)
        if path is None:
            raise UnreachableReaderError(
                f"reader {reader!r} has no route from {source!r} (no NIC, leaf or WAN link "
                "joins their machines); give its machine a NIC or add a source next to it")
        up = self.incoming.get((source, s))
        depth = self.transfers[up].depth + 1 if up is not None else 1
        first = None
        for a, b in intersect(self.need[reader], lo, hi):
            self.transfers.append(Transfer(reader=reader, source=source, start=a, end=b,
                                           stripe=s, path=path, upstream=up, depth=depth))
            first = len(self.transfers) - 1 if first is None else first
        if first is not None:
            self.incoming[(reader, s)] = len(self.transfers) - 1


# --- timing estimates --------------------------------------------------------------

def share_rates(graph: nx.DiGraph, transfers: list[Transfer]) -> list[float]:
    """Each transfer's rate if every arc were shared equally by all transfers on it,
    capped by the rate of its upstream (a relay cannot forward faster than it gets)."""
    count: dict[tuple[str, str], int] = defaultdict(int)
    for t in transfers:
        for arc in zip(t.path, t.path[1:], strict=False):
            count[arc] += 1
    edges = graph.edges
    rates = []
    for t in transfers:
        r = min(edges[a]["bandwidth"] / count[a] for a in zip(t.path, t.path[1:], strict=False))
        if t.upstream is not None:
            r = min(r, rates[t.upstream])
        rates.append(r)
    return rates


def path_latency(graph: nx.DiGraph, path: tuple[str, ...]) -> float:
    edges = graph.edges
    return sum(edges[a]["latency"] for a in zip(path, path[1:], strict=False))


def choose_chunk(plan: Plan, rates: list[float]) -> int:
    """The chunk minimising (k + D - 1)(alpha + S_stripe/(k B)) for the plan's depth D."""
    depth = plan.depth()
    stripe = max(b - a for a, b in plan.stripes)
    rate = min(rates, default=1.0)
    if depth <= 1:
        return int(max(MIN_CHUNK, min(MAX_CHUNK, stripe)))
    k = math.sqrt((depth - 1) * stripe / (HOP_OVERHEAD * rate))
    return int(max(MIN_CHUNK, min(MAX_CHUNK, stripe / max(k, 1.0))))


def predict(graph: nx.DiGraph, transfers: list[Transfer], chunk: int,
            rates: list[float] | None = None) -> dict[str, float]:
    """Predicted completion time of each reader under the equal-share estimate."""
    done: dict[str, float] = defaultdict(float)
    for t, end in zip(transfers, _ends(graph, transfers, chunk, rates), strict=True):
        done[t.reader] = max(done[t.reader], end)
    return dict(done)


def _ends(graph: nx.DiGraph, transfers: list[Transfer], chunk: int,
          rates: list[float] | None = None) -> list[float]:
    """Predicted time each transfer's last byte lands."""
    rates = rates if rates is not None else share_rates(graph, transfers)
    start = [0.0] * len(transfers)
    ends = []
    for i, t in enumerate(transfers):
        if t.upstream is not None:
            u = transfers[t.upstream]
            lag = min(chunk, t.nbytes)
            start[i] = start[t.upstream] + lag / rates[t.upstream] \
                + path_latency(graph, u.path) + HOP_OVERHEAD
        ends.append(start[i] + t.nbytes / rates[i] + path_latency(graph, t.path))
    return ends
