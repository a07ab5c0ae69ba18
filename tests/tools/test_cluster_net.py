"""The emulated cluster network (`tools.bench.cluster_net`): namespaces built from YAML.

The plan tests run anywhere; the others need root and ``ip netns`` and are skipped
with the reason otherwise.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from weightfabric.tools.bench.cluster_net import (
    EmulatedCluster,
    _plan,
    _wan_next_hops,
    emulate,
    remove_leftovers,
    unavailable,
)
from weightfabric.topology import loads_cluster
from weightfabric.topology.schema import Cluster

REASON = unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")

NODE_TYPE = """
version: 1
name: {name}
node_types:
  box:
    gpus: 0
    nics: {{count: 2, bandwidth: 32MB/s, kind: tcp, latency: 5us}}
"""
ONE_DC = NODE_TYPE.format(name="one-dc") + """
datacenters:
  - name: dc
    nodes:
      - {name: "n-{i}", type: box, count: 3}
"""
THREE_DC = NODE_TYPE.format(name="three-dc") + """
datacenters:
  - name: dc-a
    nodes:
      - {name: "a-{i}", type: box, count: 2}
  - name: dc-b
    network: {oversubscription: 2.0, nodes_per_leaf: 2, latency: 2us}
    nodes:
      - {name: "b-{i}", type: box, count: 2}
  - name: dc-c
    nodes:
      - {name: c-0, type: box}
wan:
  - {between: [dc-a, dc-b], bandwidth: 10Gbps, latency: 10ms}
  - {between: [dc-b, dc-c], bandwidth: 10Gbps, latency: 10ms}
"""
PROBE = """
import socket, sys, threading, time
def count(conn):
    with conn:
        got = 0
        while data := conn.recv(1 << 16):
            got += len(data)
        conn.sendall(str(got).encode())
if sys.argv[1] == "serve":  # ADDRESS PORT: reply to each connection with the bytes it sent
    server = socket.create_server((sys.argv[2], int(sys.argv[3])))
    print("ready", flush=True)
    while True:
        threading.Thread(target=count, args=(server.accept()[0],), daemon=True).start()
for target in sys.argv[1:]:  # ADDRESS:PORT:BYTES
    address, port, size = target.split(":")
    start = time.perf_counter()
    with socket.create_connection((address, int(port)), timeout=10) as conn:
        conn.sendall(bytes(int(size)))
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(64) == size.encode(), target
    print(time.perf_counter() - start)
"""
PORT = 7400
_count = itertools.count()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A namespace prefix no other test or run uses; its leftovers removed after."""
    name = f"t{os.getpid() % 10000:04d}{next(_count) % 100:02d}"
    try:
        yield name
    finally:
        if REASON is None:
            remove_leftovers(name)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True,
                         text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


@contextmanager
def _servers(net: EmulatedCluster, script: Path) -> Iterator[None]:
    """A byte-counting TCP server on every node, at its address and `PORT`."""
    procs = [subprocess.Popen([*net.exec_prefix(n), sys.executable, str(script), "serve",
                               net.address(n), str(PORT)], stdout=subprocess.PIPE, text=True)
             for n in net.nodes]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _send(net: EmulatedCluster, script: Path, src: str, dst: str, size: int) -> float:
    """Send `size` bytes from `src` to `dst`'s server; the seconds it took."""
    out = subprocess.run([*net.exec_prefix(src), sys.executable, str(script),
                          f"{net.address(dst)}:{PORT}:{size}"],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return float(out)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def test_plan_addresses_leaves_and_rates_follow_the_yaml():
    cluster = loads_cluster(THREE_DC)
    plan = _plan(cluster, scale=0.5, nodes=None, prefix="wfc")
    assert {n: (e.namespace, e.address, e.leaf) for n, e in plan.nodes.items()} == {
        "a-0": ("wfc-d1n0", "10.1.1.2", 0), "a-1": ("wfc-d1n1", "10.1.2.2", 1),
        "b-0": ("wfc-d2n0", "10.2.1.2", 0), "b-1": ("wfc-d2n1", "10.2.1.3", 0),
        "c-0": ("wfc-d3n0", "10.3.1.2", 0)}
    assert plan.nodes["a-0"].rate == 2 * 32e6 * 0.5
    # one leaf namespace, in the oversubscribed datacenter; its uplink is half its NICs
    assert [ns for ns in plan.namespaces if "l" in ns.split("-")[1]] == ["wfc-d2l0"]
    uplink = next(v for v in plan.veths if v.b.ns == "wfc-d2l0" and v.b.dev == "spine")
    assert uplink.rate == 2 * 2 * 32e6 / 2.0 * 0.5
    wan = [v for v in plan.veths if v.wan]
    assert [(v.a.label, v.b.label, v.rate, v.delay) for v in wan] == [
        ("dc-a", "dc-b", 10e9 / 8 * 0.5, 0.01), ("dc-b", "dc-c", 10e9 / 8 * 0.5, 0.01)]
    # a subset keeps every address and makes only the namespaces it needs
    subset = _plan(cluster, scale=0.5, nodes=["b-1"], prefix="wfc")
    assert subset.nodes["b-1"].address == "10.2.1.3"
    assert sorted(subset.namespaces) == ["wfc-d1", "wfc-d2", "wfc-d2l0", "wfc-d2n1", "wfc-d3"]


def test_plan_rejects_bad_arguments():
    cluster = loads_cluster(ONE_DC)
    for kwargs, match in (({"scale": 0.0}, "scale"), ({"nodes": ["x"]}, "no such nodes"),
                          ({"prefix": "Bad-prefix"}, "prefix")):
        with pytest.raises(ValueError, match=match):
            _plan(cluster, **{"scale": 1.0, "nodes": None, "prefix": "wfc", **kwargs})


def _triangle(ab: str, bc: str, ac: str | None) -> Cluster:
    links = [("dc-a", "dc-b", ab), ("dc-b", "dc-c", bc)] + ([("dc-a", "dc-c", ac)] if ac else [])
    wan = "".join(f"  - {{between: [{a}, {b}], bandwidth: {bw}}}\n" for a, b, bw in links)
    dcs = "".join(f"  - name: {dc}\n    nodes:\n      - {{name: {dc}-0, type: box}}\n"
                  for dc in ("dc-a", "dc-b", "dc-c", "dc-d"))
    return loads_cluster(NODE_TYPE.format(name="tri") + f"datacenters:\n{dcs}wan:\n{wan}")


def test_routers_take_the_direct_wan_link_else_the_widest_path():
    # a-c direct although narrow; b reaches c directly; d has no link at all
    hops = _wan_next_hops(_triangle("10Gbps", "10Gbps", "1Gbps"))
    assert hops[("dc-a", "dc-c")] == 2 and hops[("dc-c", "dc-a")] == 2
    assert not any("dc-d" in pair for pair in hops)
    # no a-c link: a goes through b, and c back through b
    hops = _wan_next_hops(_triangle("10Gbps", "1Gbps", None))
    assert hops[("dc-a", "dc-c")] == 0 and hops[("dc-b", "dc-c")] == 1
    assert hops[("dc-c", "dc-a")] == 1


@needs_netns
def test_every_node_reaches_every_other_and_wan_counters_see_only_wan_traffic(prefix, probe):
    cluster = loads_cluster(THREE_DC)
    with emulate(cluster, scale=1.0, prefix=prefix) as net, _servers(net, probe):
        assert set(net.nodes) == {"a-0", "a-1", "b-0", "b-1", "c-0"}
        assert net.shaping["qdisc"] in ("tbf", "netem") and "delay_emulated" in net.shaping
        for src in net.nodes:
            targets = [f"{net.address(dst)}:{PORT}:1000" for dst in net.nodes if dst != src]
            subprocess.run([*net.exec_prefix(src), sys.executable, str(probe), *targets],
                           check=True, capture_output=True, timeout=30)
        size = 1 << 20
        before = net.wan_bytes()
        assert set(before) == {"dc-a->dc-b", "dc-b->dc-a", "dc-b->dc-c", "dc-c->dc-b"}
        _send(net, probe, "a-0", "a-1", size)  # inside dc-a
        _send(net, probe, "b-0", "b-1", size)  # inside dc-b's leaf
        inside = net.wan_bytes()
        assert all(inside[k] - before[k] < 10_000 for k in before), (before, inside)
        _send(net, probe, "a-0", "c-0", size)  # routed through dc-b
        after = net.wan_bytes()
        for key in ("dc-a->dc-b", "dc-b->dc-c"):
            assert size <= after[key] - inside[key] < 1.2 * size, (key, inside, after)
        assert after["dc-c->dc-b"] - inside["dc-c->dc-b"] < 0.2 * size
        links = net.link_bytes()
        assert links["a-0->dc-a/leaf0"] > 2 * size and set(after) < set(links)
    assert _namespaces(prefix) == []


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["a", "b", "soon"], ["a", "b", "-1"],
                                  ["a", "b", "nan"]])
def test_the_delay_line_refuses_bad_arguments_before_it_opens_anything(argv, capsys):
    from weightfabric.tools.bench.delay_line import main as delay_line

    assert delay_line(argv) == 2
    assert "DELAY_S" in capsys.readouterr().err


@needs_netns
def test_wan_latencies_hold_with_netem_or_the_delay_line(prefix, probe):
    # the probe connects, sends and waits for the count: two round trips at least
    with emulate(loads_cluster(THREE_DC), scale=1.0, prefix=prefix, delay_line=True,
                 congestion="reno") as net, _servers(net, probe):
        assert net.shaping["delay_emulated"] and net.shaping["congestion"] == "reno"
        assert net.shaping["qdisc"] == "netem" or "delay line" in net.shaping["why"]
        before = net.wan_bytes()
        to_b = _send(net, probe, "a-0", "b-0", 200_000)     # one 10 ms WAN link
        to_c = _send(net, probe, "a-0", "c-0", 200_000)     # two, through dc-b
        after = net.wan_bytes()
        lines = _namespaces(prefix)
    assert to_b >= 2 * 2 * 0.010 and to_c >= 2 * 2 * 0.020, (to_b, to_c)
    # the counters still see what crosses each link, on the routers' ends
    assert after["dc-a->dc-b"] - before["dc-a->dc-b"] >= 2 * 200_000
    assert after["dc-b->dc-c"] - before["dc-b->dc-c"] >= 200_000
    assert net.shaping["qdisc"] == "netem" or {f"{prefix}-w0", f"{prefix}-w1"} <= set(lines)
    assert _namespaces(prefix) == []
    assert "delay_line" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                              text=True).stdout


@needs_netns
def test_a_node_link_holds_its_scaled_rate(prefix, probe):
    # 2 NICs x 32 MB/s x 1/8 = 8 MB/s: 4 MB take about half a second
    with emulate(loads_cluster(ONE_DC), scale=1 / 8, prefix=prefix) as net, _servers(net, probe):
        assert net.nodes["n-0"].rate == 8e6
        drops0, retrans0 = net.drops(), net.retransmits()
        seconds = _send(net, probe, "n-0", "n-1", 4_000_000)
        drops, retrans, links = net.drops(), net.retransmits(), net.link_bytes()
    assert 0.3 < seconds < 1.5, seconds
    # the diagnostics, keyed as the links and the nodes. n-0's own queue drops without a
    # retransmission (TCP sends a packet its host dropped as new); every data packet a
    # forwarding queue drops is sent again by n-0 (the ACKs flow the other way)
    assert set(drops) == set(links) and set(retrans) == set(net.nodes)
    assert retrans["n-0"] - retrans0["n-0"] >= drops["dc/leaf1->n-1"] - drops0["dc/leaf1->n-1"]


@needs_netns
def test_a_congestion_control_namespaces_may_not_use_is_refused_before_anything_is_built(
        prefix):
    with pytest.raises(ValueError, match="not allowed in network namespaces"), \
            emulate(loads_cluster(ONE_DC), scale=1.0, prefix=prefix, congestion="nosuch"):
        pass
    assert _namespaces(prefix) == []


@needs_netns
def test_nothing_is_left_after_an_error_inside_the_block(prefix):
    with pytest.raises(KeyError, match="n-9"), emulate(
            loads_cluster(ONE_DC), scale=1.0, nodes=["n-0", "n-2"], prefix=prefix) as net:
        assert len(_namespaces(prefix)) == 3
        net.address("n-9")
    assert _namespaces(prefix) == []


@needs_netns
def test_remove_leftovers_deletes_only_its_prefix(prefix):
    others = f"{prefix}x"  # a longer prefix: its namespaces are not ours
    names = [f"{prefix}-d1", f"{prefix}-d1n0", f"{others}-d1"]
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True)
        assert sorted(remove_leftovers(prefix)) == names[:2]
        assert _namespaces(prefix) == [] and _namespaces(others) == [names[2]]
    finally:
        remove_leftovers(others)


@needs_netns
def test_a_failing_command_names_itself_and_cleans_up(prefix, monkeypatch):
    from weightfabric.tools.bench import cluster_net

    monkeypatch.setattr(cluster_net, "qdisc", lambda rate, delay, netem, queue: ["nosuchqdisc"])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)tc -n .* -batch - failed.*nosuchqdisc"), \
            emulate(loads_cluster(ONE_DC), scale=1.0, prefix=prefix):
        pass
    assert _namespaces(prefix) == [] and time.monotonic() - start < 5
