"""Simulator: max-min sharing, pipelining, events, baselines, scenarios."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checks import _cluster, check_exactly_once, small_clusters

from weightfabric.topology import reference_cluster
from weightfabric.topology.baselines import storage_graph
from weightfabric.topology.bounds import lower_bound
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import PlanError, Transfer
from weightfabric.topology.planner import plan_broadcast
from weightfabric.topology.scenarios import run_scenario
from weightfabric.topology.simulator import Join, Vanish, simulate
from weightfabric.topology.synthetic import synthetic_cluster

GB = 10**9


def _replanner(lay, plan):
    def replan(holders, missing):
        return plan_broadcast(lay, plan.size, sources=holders, needs=missing, chunk=plan.chunk,
                              stripes=plan.stripes, planes=plan.planes).transfers
    return replan


def test_two_flows_share_a_link_fairly_then_the_survivor_speeds_up():
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s}\n",
                   "  - name: dc\n    nodes: [{name: 'n{i}', type: box, count: 3}]\n")
    path1 = lay.route("n0/gpu0", "n1/gpu0")
    path2 = lay.route("n0/gpu0", "n2/gpu0")
    flows = [Transfer("n1/gpu0", "n0/gpu0", 0, GB, 0, path1),
             Transfer("n2/gpu0", "n0/gpu0", 0, 2 * GB, 0, path2)]
    r = simulate(lay.graph, flows, chunk=GB, size=2 * GB)
    # 5 GB/s each until the first ends at 0.2 s, then 10 GB/s for the last 1 GB
    assert r.completion["n1/gpu0"] == pytest.approx(0.2)
    assert r.completion["n2/gpu0"] == pytest.approx(0.3)
    assert r.max_utilisation == pytest.approx(1.0)


def test_a_relay_never_overtakes_its_upstream_nor_forwards_what_has_not_arrived():
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s, latency: 2us}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s, latency: 5us}\n"
                   "  fat:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s, latency: 2us}\n"
                   "    nics: {count: 1, bandwidth: 40GB/s, latency: 5us}\n",
                   "  - name: dc\n    nodes: [{name: a, type: box}, {name: b, type: fat},"
                   " {name: c, type: fat}]\n")
    first = Transfer("b/gpu0", "a/gpu0", 0, GB, 0, lay.route("a/gpu0", "b/gpu0"))
    second = Transfer("c/gpu0", "b/gpu0", 0, GB, 0, lay.route("b/gpu0", "c/gpu0"), upstream=0)
    chunk, hop = 10**7, 14e-6  # PCIe port (2 us) + two NIC links (5 us each) + PCIe port
    r = simulate(lay.graph, [first, second], chunk=chunk, size=GB)
    # b gets it at 10 GB/s; c follows one chunk behind at b's rate (not its own
    # 40 GB/s), waits for b's last byte to land (0.1 s + one hop), then sends the
    # last chunk at 40 GB/s
    assert r.completion["b/gpu0"] == pytest.approx(0.1 + hop, rel=1e-9)
    assert r.completion["c/gpu0"] == pytest.approx(0.1 + hop + chunk / 40e9 + hop, rel=1e-9)


def test_a_port_fed_by_the_network_and_a_local_relay_never_beats_the_bound():
    # two 2-GPU machines without NVLink: each reader GPU gets one stripe over its NIC
    # and the other from its neighbour through the host, both through its x16 port
    lay = _cluster("  box:\n    gpus: 2\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s, latency: 2us}\n"
                   "    nics: {count: 2, bandwidth: 50GB/s, latency: 5us}\n",
                   "  - name: dc\n    nodes: [{name: 'n{i}', type: box, count: 2}]\n")
    plan = plan_broadcast(lay, 10**7, sources=["n0"], readers=["n1"])
    r = simulate(lay.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                 holders=plan.sources)
    bound = lower_bound(lay, plan.sources, plan.needs, method="exact")
    assert bound.rate == pytest.approx(64e9)
    assert r.makespan >= bound.seconds
    assert r.max_utilisation <= 1 + 1e-6


def test_host_and_nic_reads_into_one_gpu_share_its_pcie_port():
    # GPU 3 of a DGX reads 32 GB from host memory and 32 GB from GPU 0 looped through
    # their rail NICs: both cross GPU 3's one x16 port (64 GB/s), so together they
    # take 1 s, not the 0.5 s two separate 64 GB/s links would give
    lay = Layout(reference_cluster("dgx-h100").graph())
    m = lay.machines["dgx"]
    from_host = lay.route("dgx/host", "dgx/gpu3")
    looped = lay.to_nic(m, "dgx/gpu0", "dgx/nic0") + (m.leaf,) \
        + tuple(reversed(lay.to_nic(m, "dgx/gpu3", "dgx/nic3")))
    assert from_host[-2] == looped[-2] == "dgx/pcie3"
    flows = [Transfer("dgx/gpu3", "dgx/host", 0, 32 * GB, 0, from_host),
             Transfer("dgx/gpu3", "dgx/gpu0", 32 * GB, 64 * GB, 1, looped)]
    r = simulate(lay.graph, flows, chunk=GB, size=64 * GB)
    assert r.completion["dgx/gpu3"] == pytest.approx(1.0, rel=1e-4)
    assert r.max_utilisation == pytest.approx(1.0)


SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(small_clusters(), st.integers(10**7, 10**10), st.floats(0.05, 0.9), st.data())
def test_plans_stay_valid_after_sources_vanish(case, size, when, data):
    lay, sources, readers = case
    if not readers:
        return
    plan = plan_broadcast(lay, size, sources=sources, readers=readers)
    lost = data.draw(st.lists(st.sampled_from(sources + readers), max_size=3, unique=True))
    keep = sources[0]
    lost = [d for d in lost if d != keep]
    r = simulate(lay.graph, plan.transfers, chunk=plan.chunk, size=size, holders=plan.sources,
                 events=[Vanish(when * plan.predicted_s, tuple(lost))],
                 replanner=_replanner(lay, plan))
    assert r.max_utilisation <= 1 + 1e-6
    survivors = [x for x in plan.needs if x not in lost]
    for reader in survivors:
        check_exactly_once(r.delivered[reader], plan.needs[reader])
    if survivors:
        bound = lower_bound(lay, plan.sources, {x: plan.needs[x] for x in survivors})
        # the simulator groups events within a relative 1e-6 (its docstring), so a
        # re-planned run may land that far below the bound (seen: 2.5e-8)
        assert r.makespan >= bound.seconds * (1 - 1e-6)


def test_readers_joining_mid_broadcast_read_from_everyone_complete():
    cluster = reference_cluster("4x-dgx-h100")
    lay = Layout(cluster.graph())
    plan = plan_broadcast(lay, 8 * GB, sources=["node-0"], readers=["node-1", "node-2"])
    late = tuple(lay.machines["node-3"].devices)
    r = simulate(lay.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                 holders=plan.sources, events=[Join(plan.predicted_s * 2, late)],
                 replanner=_replanner(lay, plan))
    for reader in late:
        check_exactly_once(r.delivered[reader], [(0, plan.size)])
        assert r.completion[reader] > plan.predicted_s * 2
    with pytest.raises(RuntimeError, match="replanner"):
        simulate(lay.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                 events=[Join(0.0, late)])


def test_standalone_256_gpus_beats_star_and_ring():
    result = run_scenario(synthetic_cluster([32]), "standalone", 140 * GB,
                          baselines_to_run=("star", "ring"))
    assert result.readers == 256
    assert result.speedup["star"] >= 5 and result.speedup["ring"] >= 1.5
    assert result.efficiency <= 1 + 1e-9


def test_cross_dc_crosses_the_wan_once_and_scenarios_check_their_input():
    result = run_scenario(reference_cluster("two-datacenters"), "cross-dc", 14 * GB)
    assert result.wan_bytes == pytest.approx(14 * GB)
    assert result.speedup["star"] >= 10
    with pytest.raises(PlanError, match="another datacenter"):
        run_scenario(reference_cluster("4x-dgx-h100"), "cross-dc", GB)
    with pytest.raises(PlanError, match="unknown scenario"):
        run_scenario(reference_cluster("4x-dgx-h100"), "nope", GB)


@pytest.mark.parametrize("scenario", ["elastic", "preemption"])
def test_elastic_and_preemption_run_every_baseline(scenario):
    result = run_scenario(reference_cluster("4x-dgx-h100"), scenario, 14 * GB)
    assert set(result.baselines) == {"star", "ring", "storage"}
    assert result.ours_s >= result.lower_bound_s
    assert min(result.speedup.values()) > 1


def _one_flow():
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s}\n",
                   "  - name: dc\n    nodes: [{name: 'n{i}', type: box, count: 2}]\n")
    return lay, [Transfer("n1/gpu0", "n0/gpu0", 0, GB, 0, lay.route("n0/gpu0", "n1/gpu0"))]


@pytest.mark.parametrize("chunk", [0, -1, 1, 100])
def test_a_chunk_that_is_not_positive_or_far_too_small_is_a_plan_error(chunk):
    lay, flows = _one_flow()
    with pytest.raises(PlanError, match="chunk"):  # 0 and -1 used to loop forever
        simulate(lay.graph, flows, chunk=chunk, size=GB)


@pytest.mark.parametrize("bandwidth", [0.0, -25e9, float("inf"), float("nan")])
def test_a_storage_bandwidth_that_is_not_positive_and_finite_is_a_plan_error(bandwidth):
    lay, _ = _one_flow()
    graph = storage_graph(lay, "dc", bandwidth)
    flows = [Transfer("storage", "n0/gpu0", 0, GB, 0, lay.via_spine("n0/gpu0", None, "dc", "storage"))]
    with pytest.raises(PlanError, match="storage service's bandwidth"):  # -25e9 hung in _fill
        simulate(graph, flows, chunk=GB, size=GB)


def test_scenario_with_zero_storage_bandwidth_is_a_plan_error():
    with pytest.raises(PlanError, match="storage service's bandwidth"):
        run_scenario(reference_cluster("dgx-h100"), "standalone", GB, storage_bandwidth=0.0,
                     baselines_to_run=("storage",))
