"""`fabric bench cluster`: the data plane on a cluster emulated from YAML (root only)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from timeouts import hard_timeout

from weightfabric.tools.bench import cluster as bench
from weightfabric.tools.bench.cluster_net import remove_leftovers, unavailable
from weightfabric.tools.bench.launch import AgentError
from weightfabric.topology import loads_cluster

REASON = unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")

TINY = """
version: 1
name: tiny
node_types:
  box:
    gpus: 0
    nics: {count: 1, bandwidth: 400Mbps, kind: tcp, latency: 5us}
datacenters:
  - name: dc-a
    nodes:
      - {name: trainer, type: box}
      - {name: a-0, type: box}
  - name: dc-b
    nodes:
      - {name: b-0, type: box}
wan:
  - {between: [dc-a, dc-b], bandwidth: 200Mbps, latency: 10ms}
roles:
  trainer: [trainer]
  rollout: ["a-*", "b-*"]
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


@pytest.fixture
def prefix():
    name = f"wfb{os.getpid() % 10000}"
    yield name
    if REASON is None:
        remove_leftovers(name)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def test_the_emulated_cluster_is_the_yaml_scaled_with_latencies_only_where_emulated():
    cluster = loads_cluster(TINY)
    scaled = bench.emulated(cluster, 0.5, latency=False)
    box, small = cluster.node_types["box"], scaled.node_types["box"]
    assert small.nics.bandwidth == pytest.approx(box.nics.bandwidth * 0.5)
    assert small.nics.latency == 0 and scaled.wan[0].latency == 0
    assert scaled.wan[0].bandwidth == pytest.approx(cluster.wan[0].bandwidth * 0.5)
    assert bench.emulated(cluster, 0.5, latency=True).wan[0].latency == pytest.approx(0.01)
    assert bench.roles(cluster) == ("trainer", ["a-0", "b-0"])
    # the default scale: the readers together receive the budget at the lower bound ...
    size, chunk, budget = 128 << 20, 1 << 20, 30e6
    scale = bench.auto_scale(cluster, "trainer", ["a-0", "b-0"], size, chunk, budget)
    bound = bench.model(bench.emulated(cluster, scale, latency=False), "trainer",
                        ["a-0", "b-0"], size, chunk)["lower_bound_s"]
    assert 2 * size / bound == pytest.approx(budget, rel=1e-6)
    # ... unless that bound would be short: then it lasts MIN_BOUND_S
    scale = bench.auto_scale(cluster, "trainer", ["a-0", "b-0"], 8 << 20, chunk, budget)
    bound = bench.model(bench.emulated(cluster, scale, latency=False), "trainer",
                        ["a-0", "b-0"], 8 << 20, chunk)["lower_bound_s"]
    assert bound == pytest.approx(bench.MIN_BOUND_S, rel=1e-6)


def test_a_cluster_without_a_second_node_or_a_trainer_is_refused():
    one = TINY.replace('rollout: ["a-*", "b-*"]', "rollout: [trainer]")
    with pytest.raises(ValueError, match="no rollout node besides the trainer"):
        bench.roles(loads_cluster(one))
    with pytest.raises(ValueError, match="names no trainer"):
        bench.roles(loads_cluster(TINY.replace("trainer: [trainer]", "trainer: []")))
    with pytest.raises(ValueError, match="unknown routing"):
        bench.bench_cluster("tiny", scale=1.0, budget=1e8, size=1 << 20, chunk=1 << 20,
                            routings=["nope"], versions=2, start_bound=1.0)


def test_without_root_it_says_why_and_exits_0(monkeypatch, capsys):
    from weightfabric.tools.bench import cluster_net
    from weightfabric.tools.cli import main

    monkeypatch.setattr(cluster_net, "unavailable", lambda: "needs root (ip netns add, tc)")
    assert main(["bench", "cluster", "relay-wan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "needs root (ip netns add, tc)"}


@needs_netns
def test_every_routing_delivers_bit_exact_and_leaves_nothing_behind(tiny, prefix):
    # the WAN's 10 ms are real: netem where the kernel has it, else the delay line
    with hard_timeout(300):   # a stuck process still unwinds: processes, namespaces
        out = bench.bench_cluster(tiny, scale=1.0, budget=1e8, size=4 << 20, chunk=256 << 10,
                                  routings=["plan", "star"], versions=2, start_bound=1.0,
                                  prefix=prefix, delay_line=True)
    assert out["verified"] and set(out["runs"]) == {"plan", "star"}
    assert out["shaping"]["delay_emulated"]
    for run in out["runs"].values():
        assert run["verified"] and run["measured_s"] > 0
        # at most a little above 1: each shaper lets 10 ms of its rate through at once,
        # a few percent of a version this small
        assert 0 < run["efficiency"] < 1.3
        # one reader across the WAN: each version crosses it once, whatever the routing
        assert run["wan_bytes"]["dc-a->dc-b"] >= out["bytes"]
        assert run["wan_bytes"]["dc-a->dc-b"] < 1.1 * out["bytes"]
    assert list(out["runs"]["plan"]["routed_around"].values()) == [[]]   # v2: none
    assert out["runs"]["star"]["predicted_s"] > 0
    plan = out["runs"]["plan"]
    # the bound and the prediction count the WAN's round trip (the scaled YAML keeps it),
    # and b-0, across the WAN, paid a round trip at least for its hub call and its read
    assert plan["lower_bound_s"] > 2 * 0.010 and plan["predicted_s"] > 2 * 0.010
    assert plan["reader_s"]["b-0"] >= 2 * 2 * 0.010
    # a relay's first forward is on the record, within the version's time
    assert all(0 <= t <= plan["measured_s"] for t in plan["first_forward_s"].values())
    assert _namespaces(prefix) == []


@needs_netns
def test_raw_tcp_over_the_emulation_runs_near_the_shaped_rate(tiny):
    from weightfabric.tools.bench.cluster_raw import raw_flows

    with hard_timeout(120):
        out = raw_flows(tiny, [("trainer", "a-0", 0.5), ("b-0", "a-0", 0.5),
                               ("trainer", "b-0", 1.0)], 4 << 20)
    rate = 400e6 / 8 * out["scale"]  # a-0's NIC; b-0's WAN link is half of it
    assert out["done_s"]["a-0"] > 0.8 * (4 << 20) / rate  # shaped: never much faster
    assert out["max_s"] == pytest.approx(out["done_s"]["b-0"], abs=0.01)
    assert out["max_s"] > 0.8 * (4 << 20) / (rate / 2)
    assert _namespaces("wfraw") == []


@needs_netns
def test_a_failing_process_leaves_no_namespace(tiny, prefix, monkeypatch):
    def fail(*args, **kwargs):
        assert _namespaces(prefix)          # built, then a process fails
        raise AgentError("trainer exited with 1")
    monkeypatch.setattr(bench, "run_routing", fail)
    with pytest.raises(AgentError):
        bench.bench_cluster(tiny, scale=1.0, budget=1e8, size=1 << 20, chunk=256 << 10,
                            routings=["plan"], versions=2, start_bound=1.0, prefix=prefix)
    assert _namespaces(prefix) == []
