"""Predicted times (`Plan.predicted`) against the flow-level simulator.

A plan's predicted makespan, and each reader's predicted completion (as a share of the
makespan), stay within 10 % of what `topology.simulator.simulate` gives for the same
plan: on every shipped cluster (far closer there), for the hub's plans of small
versions in fixed chunks, and on random WANs of three or four datacenters. The fluid
model reproduces the simulator's hand-checked cases exactly, and the simulator itself
gives the prediction where pipelining dominates.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checks import _cluster

from weightfabric.topology import reference_cluster
from weightfabric.topology.agreement import agreement, random_case, shipped_cases
from weightfabric.topology.estimate import (
    FLUID,
    PIPELINE_SHARE,
    SIMULATOR,
    finish_times,
    path_latency,
    predict,
)
from weightfabric.topology.fluid import fluid_times
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import Transfer
from weightfabric.topology.planner import plan_broadcast, replan
from weightfabric.topology.simulator import simulate

GB = 10**9
TOLERANCE = 0.10   # the promise, on any plan
SHIPPED = 0.02     # on the shipped clusters (measured: 0.1 % at most)
SHIPPED_CASES = shipped_cases()


@pytest.mark.parametrize("name", sorted(SHIPPED_CASES))
def test_shipped_clusters_predict_the_simulated_time(name):
    case = SHIPPED_CASES[name]
    plan = case.plan()
    got = agreement(plan, case.layout)
    assert got.error <= SHIPPED, (plan.predicted_s, got.simulated_s)
    assert got.reader_error <= SHIPPED
    assert set(plan.predicted) == set(plan.needs)


@pytest.mark.parametrize(("size", "chunk"), [(128 << 20, 1 << 20), (2 << 30, 16 << 20)])
@pytest.mark.parametrize("name", ["relay-beats-direct", "oversubscribed-ring",
                                  "three-datacenters", "heterogeneous"])
def test_the_hubs_plans_of_host_readers_predict_the_simulated_time(name, size, chunk):
    # as fabric/hub/planned.py plans: host vertices, the manifest's chunk size
    layout = Layout(reference_cluster(name).graph())
    trainer, *others = layout.machines
    plan = plan_broadcast(layout, size, sources=[f"{trainer}/host"],
                          readers=[f"{m}/host" for m in others], chunk=chunk)
    got = agreement(plan, layout)
    assert got.error <= TOLERANCE and got.reader_error <= TOLERANCE, got


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_random_wans_predict_the_simulated_time(rng):
    case = random_case(rng)
    got = agreement(case.plan(), case.layout)
    assert got.error <= TOLERANCE, (case.label, got)
    assert got.reader_error <= TOLERANCE, (case.label, got)


def test_wan_trees_sharing_a_link_are_predicted_as_simulated():
    # two WAN trees share train-dc -> near-dc: the one that finishes first leaves its
    # share to the other, which equal shares miss (45 % too long)
    cluster = reference_cluster("relay-beats-direct")
    layout = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 140 * GB)
    simulated = simulate(layout.graph, plan.transfers, chunk=plan.chunk, size=plan.size)
    equal_share = max(finish_times(layout.graph, plan.transfers, plan.chunk))
    assert equal_share > 1.4 * simulated.makespan
    assert plan.predicted_by == FLUID
    assert plan.predicted_s == pytest.approx(simulated.makespan, rel=0.002)
    for reader, seconds in simulated.completion.items():
        assert plan.predicted[reader] == pytest.approx(seconds, rel=0.002)


def test_the_fluid_model_gives_the_simulators_hand_checked_times():
    lay = _cluster("  box:\n    gpus: 1\n    gpu: {model: X}\n    pcie: {bandwidth: 64GB/s}\n"
                   "    nics: {count: 1, bandwidth: 10GB/s}\n",
                   "  - name: dc\n    nodes: [{name: 'n{i}', type: box, count: 3}]\n")
    flows = [Transfer("n1/gpu0", "n0/gpu0", 0, GB, 0, lay.route("n0/gpu0", "n1/gpu0")),
             Transfer("n2/gpu0", "n0/gpu0", 0, 2 * GB, 0, lay.route("n0/gpu0", "n2/gpu0"))]
    # 5 GB/s each until the first ends at 0.2 s, then 10 GB/s for the last 1 GB
    assert fluid_times(lay.graph, flows, GB).completion(flows) == pytest.approx(
        {"n1/gpu0": 0.2, "n2/gpu0": 0.3}, rel=1e-9)

    lay = _cluster("  slow:\n    gpus: 0\n    nics: {count: 1, bandwidth: 10GB/s, latency: 5us}\n"
                   "  fast:\n    gpus: 0\n    nics: {count: 1, bandwidth: 40GB/s, latency: 5us}\n",
                   "  - name: dc\n    nodes: [{name: a, type: slow}, {name: b, type: fast},"
                   " {name: c, type: fast}]\n")
    chain = [Transfer("b/host", "a/host", 0, GB, 0, lay.route("a/host", "b/host")),
             Transfer("c/host", "b/host", 0, GB, 0, lay.route("b/host", "c/host"), upstream=0)]
    chunk, hop = 10**7, path_latency(lay.graph, chain[0].path)
    # c trails b by a chunk at b's 10 GB/s, and sends the last one at its own 40 GB/s
    # once b's last byte is in
    times = fluid_times(lay.graph, chain, chunk)
    assert times.completion(chain) == pytest.approx(
        {"b/host": 0.1 + hop, "c/host": 0.1 + hop + chunk / 40e9 + hop}, rel=1e-9)
    assert times.completion(chain) == pytest.approx(
        simulate(lay.graph, chain, chunk=chunk, size=GB).completion, rel=1e-9)


def test_where_pipelining_dominates_the_simulator_predicts():
    layout = Layout(reference_cluster("three-datacenters").graph())
    trainer, *others = layout.machines
    sources, readers = [f"{trainer}/host"], [f"{m}/host" for m in others]
    plan = plan_broadcast(layout, 128 << 20, sources=sources, readers=readers, chunk=1 << 20)
    assert fluid_times(layout.graph, plan.transfers, plan.chunk).pipeline_share > PIPELINE_SHARE
    assert plan.predicted_by == SIMULATOR
    assert plan.predicted == simulate(layout.graph, plan.transfers, chunk=plan.chunk,
                                      size=plan.size).completion
    many = plan_broadcast(layout, 140 * GB, sources=sources, readers=readers, chunk=16 << 20)
    prediction = predict(layout.graph, many.transfers, chunk=many.chunk, size=many.size)
    assert prediction.method == FLUID and prediction.pipeline_share <= PIPELINE_SHARE
    assert prediction.completion == many.predicted


def test_a_replan_predicts_what_is_left():
    cluster = reference_cluster("oversubscribed-ring")
    layout = Layout(cluster.graph())
    plan = plan_broadcast(cluster, 20 * GB)
    again = replan(plan, layout, lost=["a-0/host"],
                   have={r: [(0, 10 * GB)] for r in plan.needs})
    got = agreement(again, layout)
    assert again.predicted_by and got.error <= TOLERANCE
    assert again.predicted_s < plan.predicted_s
