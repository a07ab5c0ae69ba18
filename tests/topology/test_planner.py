"""Planner: hand-checked optimal cases, invariants on random clusters, bad input."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checks import _cluster, check_exactly_once, check_plan, small_clusters

from weightfabric.topology import loads_cluster, reference_cluster
from weightfabric.topology.bounds import lower_bound
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import (
    HOST,
    NIC_LOOP,
    PLANES,
    TREE,
    EmptyTransferError,
    PlanError,
    UnknownDeviceError,
    UnreachableReaderError,
)
from weightfabric.topology.planner import default_endpoints, plan_broadcast, replan, side_planes
from weightfabric.topology.scenarios import run_scenario
from weightfabric.topology.simulator import MAX_CHUNKS, Vanish, simulate

GB = 10**9


def _run(layout, plan):
    return simulate(layout.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                    holders=plan.sources)


# --- hand-checked cases -------------------------------------------------------------

def test_chain_of_three_gpus_pipelines_at_link_rate():
    # three one-GPU machines, one 10 GB/s NIC each: the optimum is a pipelined chain
    # src -> r1 -> r2 at the NIC rate, one chunk behind per hop
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s, latency: 2us}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s, latency: 5us}\n",
                   "  - name: dc\n    network: {latency: 1us, nodes_per_leaf: 4}\n"
                   "    nodes: [{name: 'n{i}', type: box, count: 3}]\n")
    size = 10 * GB
    plan = plan_broadcast(lay, size, sources=["n0"], readers=["n1", "n2"])
    check_plan(plan, lay.graph)
    assert [(t.source, t.reader) for t in plan.transfers] == [
        ("n0/gpu0", "n1/gpu0"), ("n1/gpu0", "n2/gpu0")]
    result = _run(lay, plan)
    hop = 2e-6 + 5e-6 + 5e-6 + 2e-6  # pcie, nic, nic, pcie
    optimal = size / 10e9 + plan.chunk / 10e9 + 2 * hop
    assert result.makespan == pytest.approx(optimal, rel=1e-9)
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert bound.rate == pytest.approx(10e9)
    assert bound.seconds == pytest.approx(size / 10e9 + hop)
    assert bound.seconds <= result.makespan


def test_two_nodes_over_one_nic():
    lay = _cluster("  box:\n    gpus: 2\n    gpu: {model: X}\n    nvlink: {bandwidth: 100GB/s}\n"
                   "    pcie: {bandwidth: 20GB/s}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s, latency: 5us}\n",
                   "  - name: dc\n    nodes: [{name: 'n{i}', type: box, count: 2}]\n")
    size = 4 * GB
    plan = plan_broadcast(lay, size, sources=["n0/gpu0"], readers=["n1"])
    check_plan(plan, lay.graph)
    result = _run(lay, plan)
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert bound.rate == pytest.approx(10e9)  # the one NIC into n1
    assert bound.seconds == pytest.approx(size / 10e9 + 10e-6)
    # the NIC carries the version once; NVLink hands it on one chunk behind
    assert result.makespan == pytest.approx(size / 10e9 + plan.chunk / 100e9, rel=1e-3)
    assert result.makespan >= bound.seconds
    assert bound.seconds / result.makespan > 0.99


def test_two_datacenters_cross_the_wan_once():
    node = ("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
            "    nics: {count: 1, bandwidth: 50GB/s}\n")
    dcs = ("  - name: a\n    nodes: [{name: src, type: box}]\n"
           "  - name: b\n    nodes: [{name: 'b{i}', type: box, count: 3}]\n")
    wan = "wan:\n  - {between: [a, b], bandwidth: 1GB/s, latency: 10ms}\n"
    lay = _cluster(node, dcs, wan)
    size = 2 * GB
    plan = plan_broadcast(lay, size, sources=["src"], readers=["b0", "b1", "b2"])
    check_plan(plan, lay.graph)
    wan_transfers = [t for t in plan.transfers if "a/wan" in t.path]
    assert sum(t.nbytes for t in wan_transfers) == size
    result = _run(lay, plan)
    assert result.wan_bytes == pytest.approx(size)
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert bound.seconds == pytest.approx(size / 1e9 + 10e-3)
    assert bound.seconds <= result.makespan <= bound.seconds * 1.01


@pytest.mark.parametrize("name", ["dgx-h100", "4x-dgx-h100", "two-datacenters", "heterogeneous"])
def test_reference_clusters_plan_and_beat_nothing(name):
    cluster = reference_cluster(name)
    lay = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 140 * GB)
    check_plan(plan, lay.graph)
    result = _run(lay, plan)
    bound = lower_bound(lay, plan.sources, plan.needs)
    assert bound.seconds <= result.makespan * (1 + 1e-9)
    assert result.max_utilisation <= 1 + 1e-6
    for reader in plan.needs:
        check_exactly_once(result.delivered[reader], plan.needs[reader])


def test_several_sources_are_all_used():
    cluster = reference_cluster("4x-dgx-h100")
    plan = plan_broadcast(cluster, 8 * GB, sources=["node-0", "node-1"],
                          readers=["node-2", "node-3"])
    assert {t.source.split("/")[0] for t in plan.transfers if t.upstream is None} == \
        {"node-0", "node-1"}


def test_sharded_needs_read_only_their_ranges():
    cluster = reference_cluster("4x-dgx-h100")
    lay = Layout(cluster.graph())
    needs = {f"node-1/gpu{j}": [(j * GB, (j + 1) * GB)] for j in range(8)}
    plan = plan_broadcast(lay, 8 * GB, sources=["node-0"], needs=needs)
    check_plan(plan, lay.graph)


def test_replan_after_a_source_vanishes_keeps_what_readers_have():
    cluster = reference_cluster("4x-dgx-h100")
    lay = Layout(cluster.graph())
    plan = plan_broadcast(lay, 8 * GB, sources=["node-0", "node-1"], readers=["node-2", "node-3"])
    have = {f"node-2/gpu{j}": [(0, GB)] for j in range(8)}
    again = replan(plan, lay, lost=[f"node-1/gpu{j}" for j in range(8)], have=have)
    check_plan(again, lay.graph)
    assert not any(t.source.startswith("node-1/") for t in again.transfers)
    for reader in plan.needs:
        check_exactly_once(have.get(reader, []) + [(t.start, t.end) for t in again.fetches(reader)],
                           plan.needs[reader])


# --- bad input ----------------------------------------------------------------------

def test_bad_input_gives_clear_errors():
    cluster = reference_cluster("4x-dgx-h100")
    with pytest.raises(UnknownDeviceError, match="not a device or node"):
        plan_broadcast(cluster, GB, readers=["node-9/gpu0"])
    with pytest.raises(EmptyTransferError, match="positive"):
        plan_broadcast(cluster, 0)
    with pytest.raises(EmptyTransferError, match="no reader"):
        plan_broadcast(cluster, GB, sources=["node-0"], readers=["node-0/gpu1"])
    assert issubclass(UnreachableReaderError, ValueError)


def test_an_unknown_name_is_answered_with_names_that_exist():
    with pytest.raises(UnknownDeviceError) as info:
        plan_broadcast(reference_cluster("4x-dgx-h100"), GB, readers=["node-9"])
    assert "its nodes are node-0, node-1, node-2, node-3 (" in str(info.value)
    assert "topo show" not in str(info.value)
    with pytest.raises(UnknownDeviceError, match=r"node-0/gpu7, node-0/host \("):
        plan_broadcast(reference_cluster("4x-dgx-h100"), GB, readers=["node-0/gpu9"])
    with pytest.raises(UnknownDeviceError, match="a-6 and 24 more"):  # 32 nodes
        plan_broadcast(reference_cluster("two-datacenters"), GB, sources=["x"])


def test_roles_that_leave_no_reader_say_so_for_plan_and_simulate():
    local = reference_cluster("localhost")  # trainer and rollout: the one CPU node
    with pytest.raises(EmptyTransferError, match="roles name no rollout device besides the "
                                                 r"trainer \(localhost/host\); add `roles:`"):
        plan_broadcast(local, GB)
    with pytest.raises(EmptyTransferError, match="roles name no rollout device") as info:
        run_scenario(local, "standalone", GB)
    assert "--readers other than" not in str(info.value)
    no_roles = loads_cluster(f"version: 1\nname: t\nnode_types:\n{BOX}datacenters:\n{A_AND_B}")
    with pytest.raises(EmptyTransferError, match="roles name no rollout device"):
        plan_broadcast(no_roles, GB, sources=["a"])
    assert plan_broadcast(no_roles, GB, sources=["a"], readers=["b"]).readers == ["b/gpu0"]


def test_a_chunk_must_be_positive_and_cut_no_transfer_into_more_than_2_20_chunks():
    lay = _two_nodes()
    for chunk in (0, -1, float("inf"), float("nan")):
        with pytest.raises(PlanError, match="positive, finite number of bytes"):
            plan_broadcast(lay, GB, sources=["a"], readers=["b"], chunk=chunk)
    # 1 B chunks of 1 GB: a billion chunks, which the simulator would never get through
    with pytest.raises(PlanError, match=r"1,000,000,000 chunks.*at least 954 B"):
        plan_broadcast(lay, GB, sources=["a"], readers=["b"], chunk=1)
    assert plan_broadcast(lay, GB, sources=["a"], readers=["b"], chunk=954).chunk == 954


def test_the_chosen_chunk_keeps_within_2_20_chunks_per_transfer():
    lay = _two_nodes()
    plan = plan_broadcast(lay, 10**15, sources=["a"], readers=["b"])  # 1 PB: 256 MB is too small
    assert max(t.nbytes for t in plan.transfers) <= plan.chunk * MAX_CHUNKS


BOX = ("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
       "    nics: {count: 1, bandwidth: 50GB/s}\n")
A_AND_B = "  - name: dc\n    nodes: [{name: a, type: box}, {name: b, type: box}]\n"


def _two_nodes() -> Layout:
    return _cluster(BOX, A_AND_B)


def test_unreachable_reader_is_reported():
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
                   "    nics: {count: 1, bandwidth: 50GB/s}\n"
                   "  island:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n",
                   "  - name: dc\n    nodes: [{name: a, type: box}, {name: lone, type: island}]\n")
    with pytest.raises(UnreachableReaderError, match="no route"):
        plan_broadcast(lay, GB, sources=["a"], readers=["lone"])
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
                   "    nics: {count: 1, bandwidth: 50GB/s}\n",
                   "  - name: x\n    nodes: [{name: a, type: box}]\n"
                   "  - name: y\n    nodes: [{name: b, type: box}]\n")
    with pytest.raises(UnreachableReaderError, match="WAN link"):
        plan_broadcast(lay, GB, sources=["a"], readers=["b"])
    with pytest.raises(PlanError, match="held by no source"):
        plan_broadcast(lay, GB, sources={"a": [(0, GB // 2)]}, readers=["a"])


# --- random clusters ----------------------------------------------------------------

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(small_clusters(), st.integers(10**6, 10**10))
def test_random_plans_deliver_every_byte_once_and_never_beat_the_bound(case, size):
    lay, sources, readers = case
    if not readers:
        return
    plan = plan_broadcast(lay, size, sources=sources, readers=readers)
    check_plan(plan, lay.graph)
    result = _run(lay, plan)
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert result.makespan >= bound.seconds * (1 - 1e-9)
    assert result.max_utilisation <= 1 + 1e-6
    for reader in plan.needs:
        check_exactly_once(result.delivered[reader], plan.needs[reader])
    classes = lower_bound(lay, plan.sources, plan.needs, method="classes")
    assert classes.seconds <= bound.seconds * (1 + 1e-9)  # contraction stays a valid bound


# --- one machine: NVLink, host PCIe and NIC loopback in parallel ----------------------

def test_one_dgx_splits_the_bytes_over_nvlink_and_the_pcie_ports():
    cluster = reference_cluster("dgx-h100")
    lay = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 140 * GB)
    check_plan(plan, lay.graph)
    share = {p: 0 for p in PLANES}
    for (lo, hi), plane in zip(plan.stripes, plan.planes, strict=True):
        share[plane] += hi - lo
    # bytes in proportion to the per-GPU rates: NVLink 450, the x16 port 64 GB/s; the
    # NIC loopback would go through the same port, which the host plane already fills
    assert share[TREE] / plan.size == pytest.approx(450 / 514, abs=0.02)
    assert share[NIC_LOOP] == 0
    tiers = {p: {lay.graph.edges[a]["tier"] for t in plan.transfers if plan.planes[t.stripe] == p
                 for a in zip(t.path, t.path[1:], strict=False)} for p in (TREE, HOST)}
    assert tiers == {TREE: {"nvlink"}, HOST: {"pcie"}}
    result = _run(lay, plan)
    assert result.max_utilisation <= 1 + 1e-6
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert bound.rate == pytest.approx(514e9)  # NVLink 450 + the GPU's one x16 port
    # NVLink alone would give 450/514 = 0.88 of the bound
    assert bound.seconds / result.makespan > 0.95
    assert result.makespan == pytest.approx(plan.predicted_s, rel=0.01)


def test_nic_loopback_fills_what_the_host_plane_leaves_of_a_port():
    # a port twice as wide as the host uplink: the host plane gets 20 GB/s of it, the
    # NIC loopback the other 20 (capped by the 25 GB/s NIC)
    lay = _cluster("  box:\n    gpus: 4\n    gpu: {model: X}\n    nvlink: {bandwidth: 300GB/s}\n"
                   "    pcie: {bandwidth: 40GB/s}\n"
                   "    nics: {count: 4, bandwidth: 25GB/s}\n",
                   "  - name: dc\n    nodes: [{name: n, type: box}]\n")
    for a, b in list(lay.graph.edges):
        if {lay.kinds[a], lay.kinds[b]} == {"pcie", "host"}:
            lay.graph.edges[a, b]["bandwidth"] = 20e9
    rates = side_planes(lay, {"n/gpu0": [(0, GB)]}, {f"n/gpu{j}": [(0, GB)] for j in (1, 2, 3)},
                        GB)
    assert rates == {TREE: 300e9, HOST: 20e9, NIC_LOOP: 20e9}
    plan = plan_broadcast(lay, 4 * GB, sources=["n/gpu0"], readers=["n"])
    check_plan(plan, lay.graph)
    assert set(plan.planes) == {TREE, HOST, NIC_LOOP}
    result = _run(lay, plan)
    assert result.max_utilisation <= 1 + 1e-6


def test_one_machine_without_nics_or_nvswitch_uses_one_plane():
    lay = _cluster("  box:\n    gpus: 4\n    gpu: {model: X}\n    pcie: {bandwidth: 32GB/s}\n",
                   "  - name: dc\n    nodes: [{name: n, type: box}]\n")
    plan = plan_broadcast(lay, 4 * GB, sources=["n/gpu0"], readers=["n"])
    check_plan(plan, lay.graph)
    assert set(plan.planes) == {TREE}


def test_a_relay_of_the_loopback_chains_vanishing_is_routed_around():
    cluster = reference_cluster("dgx-h100")
    lay = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 16 * GB)

    def again(holders, missing):
        return plan_broadcast(lay, plan.size, sources=holders, needs=missing, chunk=plan.chunk,
                              stripes=plan.stripes, planes=plan.planes).transfers

    lost = ("dgx/gpu3",)
    result = simulate(lay.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                      holders=plan.sources, events=[Vanish(0.4 * plan.predicted_s, lost)],
                      replanner=again)
    assert result.max_utilisation <= 1 + 1e-6
    for reader in plan.needs:
        if reader not in lost:
            check_exactly_once(result.delivered[reader], plan.needs[reader])
    have = {r: [(0, plan.size // 3)] for r in plan.needs}
    partial = replan(plan, lay, lost=lost, have=have)
    check_plan(partial, lay.graph)


# --- oversubscribed leaves ----------------------------------------------------------

def test_oversubscribed_leaves_get_each_stripe_over_the_spine_once():
    from weightfabric.topology.synthetic import synthetic_cluster

    cluster = synthetic_cluster([15], oversubscription=3.0, nodes_per_leaf=4)
    lay = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 16 * GB)
    check_plan(plan, lay.graph)
    into: dict[str, int] = {}
    for t in plan.transfers:
        for a, b in zip(t.path, t.path[1:], strict=False):
            if a.endswith("/spine"):
                into[b] = into.get(b, 0) + t.nbytes
    # 16 machines, 4 leaves; the trainer's leaf reads it under the leaf
    assert sorted(into.values()) == [plan.size] * 3
    result = _run(lay, plan)
    assert result.max_utilisation <= 1 + 1e-6
    bound = lower_bound(lay, plan.sources, plan.needs)
    assert bound.seconds / result.makespan > 0.9


def _nic_streams(lay, plan):
    """Streams leaving each machine's NICs, and the most on any one NIC."""
    per_machine: dict[str, int] = {}
    per_nic: dict[str, int] = {}
    for t in plan.transfers:
        for a, b in zip(t.path, t.path[1:], strict=False):
            if lay.kinds.get(a) == "nic" and lay.kinds.get(b) == "leaf":
                per_machine[lay.machine_of[a]] = per_machine.get(lay.machine_of[a], 0) + 1
                per_nic[a] = per_nic.get(a, 0) + 1
    return per_machine, max(per_nic.values(), default=0)


@pytest.mark.parametrize("nodes, over, per_leaf", [
    (31, 3.0, 4), (127, 3.0, 4), (31, 3.0, 8), (127, 4.0, 16),
    (31, 1.0, 32),  # not a multiple of the 8 stripes
])
def test_every_machine_sends_at_most_one_stream_per_nic(nodes, over, per_leaf):
    from weightfabric.topology.synthetic import synthetic_cluster

    cluster = synthetic_cluster([nodes], oversubscription=over, nodes_per_leaf=per_leaf)
    lay = Layout(cluster.graph())
    sources, readers = default_endpoints(cluster, lay)
    plan = plan_broadcast(lay, 140 * GB, sources=sources, readers=readers)
    per_machine, per_nic = _nic_streams(lay, plan)
    assert max(per_machine.values()) <= 8 and per_nic == 1
    into: dict[str, int] = {}
    for t in plan.transfers:
        for a, b in zip(t.path, t.path[1:], strict=False):
            if a.endswith("/spine"):
                into[b] = into.get(b, 0) + t.nbytes
    assert set(into.values()) <= {plan.size}  # a leaf gets each byte over the spine once
    result = _run(lay, plan)
    assert result.max_utilisation <= 1 + 1e-6
    for reader in plan.needs:
        check_exactly_once(result.delivered[reader], plan.needs[reader])
    bound = lower_bound(lay, plan.sources, plan.needs)
    assert bound.seconds / result.makespan > 0.95
