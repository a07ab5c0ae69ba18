"""Broadcast planner: a forest of pipelined stripe trees across WAN, network and NVLink.

Algorithm
---------
The version's bytes are cut into ``K`` stripes (``K`` = the largest NIC count of a
reading machine, so every rail carries one stripe). Each stripe is distributed by
its own tree, built in three levels:

1. **Datacenters.** Trees over the datacenters whose widths add up to the WAN's
   max-flow from the datacenters holding the stripe (`topology.wan`, via
   `Layout.wan_trees`): where the direct link into a datacenter is slower than what a
   relay through a third one adds, one tree cannot reach the max-flow, several can.
   Each stripe is cut into *parts*, one per tree, in proportion to the trees' widths,
   at multiples of ``wan_align`` bytes; in each part's tree every other datacenter with
   readers has one parent, from which that part crosses the WAN once into its *entry
   machine* (the same machine for every part), so a remote datacenter receives exactly
   S bytes over the WAN per version and each byte crosses each WAN link at most once.
   A datacenter's tree of machines (level 2) is built once per stripe and carries every
   part. A single-path WAN (two datacenters, a star) gives one tree: the widest.
2. **Machines inside a datacenter.** The SplitStream / rail-aligned construction,
   two levels deep (`topology.forest`): machines are grouped by leaf switch where
   the leaves are oversubscribed (else the datacenter is one group); each group
   gets each stripe once, on a head machine, from another group (so each stripe
   crosses the spine into a leaf once), then fans it out inside. Stripe ``k`` lands
   on NIC ``k mod nics`` and its GPU (rail-aligned ingress, one stream per NIC),
   and how many streams each machine (and group) forwards in each tree is a quota
   from `topology.fanout.FanOut`: over all K trees a machine sends at most one
   stream per NIC, each tree taking a contiguous run of the machines' capacity, so
   a machine relays in one or two trees with fan-out up to K and the trees are
   ``O(log_K N)`` deep. Holder machines are the roots with one slot per tree (all
   their rails in use across the K trees; with several holders every tree has
   several roots, so a joining reader stripes over all of them); entry machines are
   roots of their datacenter. Only when a datacenter lacks the capacity (a root
   datacenter exporting to many others) does a machine send more, one stream at a
   time to whoever has the most left.
3. **Inside a machine.** The landing device forwards the stripe to the machine's
   other readers: one hop over NVSwitch (star) or, without a switch, a chain over
   PCIe / NVLink pairs (each device forwards each byte once). A broadcast within
   one NVSwitch machine also uses the links NVLink leaves idle: the bytes are split
   over planes (`topology.planes.side_planes`: NVSwitch all-gather, a PCIe peer-to-peer chain
   through the host, a GPUDirect NIC-loopback chain through the leaf; the last two
   share each GPU's PCIe port) in proportion to their rates, then re-cut once so
   that all planes finish together.

Every tree edge is a `Transfer` whose ``upstream`` is the transfer that feeds its
source, so a fetch engine (and `topology.simulator`) pipelines chunks down the
tree: time ~ S/(K·B) + depth·chunk/B. The chunk size minimises
``(k + D - 1)(alpha + S_stripe/(k·B))``: ``k* = sqrt((D-1)·S_stripe/(alpha·B))``.
Readers that need only parts of the bytes (sharded layouts, or what is left after
a failure) are placed in the trees of the stripes they need and read only those
ranges; `replan` uses this to route around vanished sources, keeping what every
reader already has.

Complexity: O(V + E) to index the graph, then O(R·K·P·h) for R readers, K stripes,
P WAN trees (1 on a single-path WAN, at most ``wan_paths``) and routes of h ≤ 15 hops. The
predicted times (`topology.estimate.predict`) cost O(transfers·h) numpy work per event of
the fluid model (10-30 events), or one simulation where pipelining dominates. No
max-flow, arborescence or shortest-path search runs per reader (a 10,000-GPU plan takes
a few seconds; see docs/benchmarks.md). The quotas add
O(machines) per stripe and datacenter; the WAN trees O(D) max-flows per step on the
graph of D datacenters, once per plan; the one-machine planes plan twice
(O(readers²) transfers at most).

Modules: this one holds the entry points (`plan_broadcast`, `replan`);
`topology.endpoints` resolves sources and readers, `topology.planes` cuts the
stripes (and a one-machine broadcast's planes), `topology.wan` packs the WAN trees,
`topology.forest` builds the stripe trees with the quotas of `topology.fanout`, `topology.intranode` the hops
inside a machine, `topology.estimate` picks the chunk (equal-share rates) and predicts the
times (`topology.fluid`, or `topology.simulator`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

import networkx as nx

from weightfabric.topology.endpoints import (
    SourceSpec,
    default_endpoints,
    endpoints,
    resolve,
    subtract,
)
from weightfabric.topology.estimate import (
    HOP_OVERHEAD,
    MAX_CHUNK,
    MIN_CHUNK,
    choose_chunk,
    finish_times,
    path_latency,
    predict,
    share_rates,
)
from weightfabric.topology.forest import ForestBuilder
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import TREE, Interval, Plan, PlanError, merge_intervals
from weightfabric.topology.planes import cut_stripes, side_planes
from weightfabric.topology.schema import Cluster
from weightfabric.topology.simulator import check_chunk, min_chunk

WAN_PATHS = 4  # the most WAN trees a stripe is split over
WAN_ALIGN = 4096  # where a stripe's parts on different WAN trees may start

__all__ = ["HOP_OVERHEAD", "MAX_CHUNK", "MIN_CHUNK", "WAN_ALIGN", "WAN_PATHS", "SourceSpec",
           "choose_chunk", "default_endpoints", "path_latency", "plan_broadcast", "predict",
           "replan", "resolve", "share_rates", "side_planes"]


def plan_broadcast(cluster: Cluster | nx.DiGraph | Layout, size: int, *,
                   sources: SourceSpec = None, readers: Iterable[str] | None = None,
                   needs: Mapping[str, list[Interval]] | None = None,
                   chunk: int | None = None, stripes: list[Interval] | None = None,
                   planes: list[str] | None = None, leaf_aware: bool = True,
                   wan_paths: int = WAN_PATHS, wan_align: int = WAN_ALIGN,
                   predict_times: bool = True) -> Plan:
    """Plan how every reader gets the bytes it needs of a version of `size` bytes.

    Args:
        cluster (Cluster, networkx.DiGraph or Layout): The cluster (its graph is built), a graph
            from `Cluster.graph()`, or a `Layout` of one (reuse it when planning repeatedly).
        size (int): Bytes of the version.
        sources (iterable of names, or mapping name -> byte ranges (None = all)): Devices
            (``node/gpu3``, ``node/host``) or nodes (all their devices) that hold the version.
            Default: the devices of the YAML's ``trainer`` role.
        readers (iterable of names): Devices or nodes that need all the bytes. Default: the
            ``rollout`` role's devices that are not sources.
        needs (mapping reader -> byte ranges): Instead of `readers`: what each reader needs
            (sharded layouts, re-plans).
        chunk (int): Pipelining unit in bytes; default from the pipelining optimum. At least one
            byte, and large enough that no transfer has more than
            `topology.simulator.MAX_CHUNKS` (2**20) chunks.
        stripes (list of (start, end)): Stripe boundaries to reuse (a re-plan keeps the original
            plan's).
        planes (list of str): With `stripes`: the plane of each stripe (`Plan.planes`; default
            all `TREE`).
        leaf_aware (bool): Group machines by leaf under oversubscribed leaves, each leaf getting
            each stripe over the spine once (default); False treats a datacenter's machines as
            one group, in machine order (for comparison).
        wan_paths (int): The most WAN trees a stripe is split over (1: one widest tree, as
            before 2026-11; see `topology.wan`).
        wan_align (int): The parts of a stripe that take different WAN trees start at
            multiples of this many bytes (so that they map onto chunks of that size).
        predict_times (bool): Predict each reader's time (`topology.estimate.predict`:
            up to a simulation of the plan). False leaves `Plan.predicted` empty, for a
            caller on a broadcast's critical path that predicts later if asked (the hub).

    Returns:
        Plan: Transfers (upstream first), stripes, chunk and predicted times per reader.

    Raises:
        EmptyTransferError: `size` is not positive, or there are no readers.
        UnknownDeviceError: A name is neither a device nor a node of the cluster.
        UnreachableReaderError: A reader has no route from any holder of some bytes it needs.
        PlanError: Some bytes are held by no source, a reader is also a full source, `chunk`
            is not positive or cuts a transfer into more than 2**20 chunks, or `wan_paths` or
            `wan_align` is below 1.

    Notes:
        See the module docstring for the algorithm and its complexity.

    Examples:
        >>> from topology import reference_cluster
        >>> plan = plan_broadcast(reference_cluster("4x-dgx-h100"), 140 * 10**9)
        >>> len(plan.readers), round(plan.predicted_s, 2)
        (24, 0.35)
    """
    started = time.perf_counter()
    if wan_paths < 1 or wan_align < 1:
        raise PlanError(f"wan_paths and wan_align must be at least 1, got {wan_paths} and "
                        f"{wan_align}")
    wan = {"wan_paths": int(wan_paths), "align": int(wan_align)}
    layout = _layout(cluster)
    held, need = endpoints(cluster, layout, int(size), sources, readers, needs)
    rebalance = stripes is None
    if stripes is None:
        stripes, planes = cut_stripes(layout, int(size), need, held)
    planes = list(planes or [])
    if planes and len(planes) != len(stripes):
        raise PlanError(f"{len(planes)} planes for {len(stripes)} stripes; pass one per stripe")
    plan = _build(layout, int(size), held, need, stripes, planes, chunk, leaf_aware, **wan)
    if rebalance and any(p != TREE for p in planes):
        # second pass: move bytes off the planes that finish late (deep chains lag)
        stripes, planes = _rebalance(layout, plan, need, held)
        plan = _build(layout, int(size), held, need, stripes, planes, chunk, leaf_aware, **wan)
    if predict_times:
        prediction = predict(layout.graph, plan.transfers, chunk=plan.chunk, size=plan.size)
        plan.predicted, plan.predicted_by = prediction.completion, prediction.method
    plan.plan_seconds = time.perf_counter() - started
    return plan


def _build(layout: Layout, size: int, held: dict[str, list[Interval]],
           need: dict[str, list[Interval]], stripes: list[Interval], planes: list[str],
           chunk: int | None, leaf_aware: bool = True, *, wan_paths: int = WAN_PATHS,
           align: int = WAN_ALIGN) -> Plan:
    transfers = ForestBuilder(layout, held, need, stripes, planes, leaf_aware,
                              wan_paths=wan_paths, align=align).build()
    plan = Plan(size=size, chunk=0, stripes=list(stripes), transfers=transfers,
                sources=held, needs=need, planes=planes)
    if chunk is not None:
        check_chunk(chunk, transfers)
        plan.chunk = int(chunk)
    else:
        rates = share_rates(layout.graph, transfers)
        largest = max((t.nbytes for t in transfers), default=0)
        plan.chunk = max(choose_chunk(plan, rates), min_chunk(largest))
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
    ends = finish_times(layout.graph, plan.transfers, plan.chunk)
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
    return cut_stripes(layout, plan.size, need, held, share)


def replan(plan: Plan, cluster: Cluster | nx.DiGraph | Layout, *, lost: Iterable[str],
           have: Mapping[str, list[Interval]] | None = None) -> Plan:
    """Plan the bytes still missing after the devices in `lost` vanished.

    Args:
        plan (Plan): The plan being executed.
        cluster (Cluster, networkx.DiGraph or Layout): The same cluster.
        lost (iterable of str): Devices that are gone (sources or readers); they neither serve
            nor need.
        have (mapping reader -> byte ranges): What each reader already holds (default: nothing).

    Returns:
        Plan: Transfers for the missing ranges only, over the surviving holders (original
            sources and readers that are complete), with the original stripes.

    Raises:
        PlanError: Some missing bytes are held by no surviving source.
    """
    gone = set(lost)
    have = dict(have or {})
    holders = {d: r for d, r in plan.sources.items() if d not in gone}
    missing: dict[str, list[Interval]] = {}
    for reader, ranges in plan.needs.items():
        if reader in gone:
            continue
        got = merge_intervals(have.get(reader, []))
        rest = subtract(ranges, got)
        if rest:
            missing[reader] = rest
        else:
            holders[reader] = merge_intervals(got + holders.get(reader, []))
    if not missing:
        return Plan(size=plan.size, chunk=plan.chunk, stripes=plan.stripes, transfers=[],
                    sources=holders, needs={}, planes=plan.planes)
    return plan_broadcast(cluster, plan.size, sources=holders, needs=missing,
                          chunk=plan.chunk, stripes=plan.stripes, planes=plan.planes)


def _layout(cluster: Cluster | nx.DiGraph | Layout) -> Layout:
    if isinstance(cluster, Layout):
        return cluster
    if isinstance(cluster, Cluster):
        return Layout(cluster.graph())
    return Layout(cluster)
