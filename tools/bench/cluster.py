"""`fabric bench cluster`: the real data plane on a cluster emulated from its YAML.

`tools.bench.cluster_net.emulate` builds the cluster's network in namespaces (one per
node, a node's NICs as one link of their summed rate, oversubscribed leaves and WAN
links shaped with ``tc``; all bandwidths x ``scale``). One process per node runs a
host-memory store (``WEIGHTFABRIC_HOST_ID`` = the node, so every read crosses the
emulated network over TCP): the first node of the YAML's ``trainer`` role publishes,
every other ``rollout`` node fetches; the hub runs in the trainer's namespace. The
slowest rate a read may have before its source is failed over (1 MiB/s,
`fabric.transports.client.MIN_RATE`) is scaled like the links.

Each routing runs on fresh processes over the same namespaces, in one invocation:

- ``plan``: the hub plans each version's broadcast on the emulated cluster
  (`fabric.hub.planned`) and routes readers along the forest;
- ``ranked``: the hub ranks each reader's sources by widest path on the cluster
  (`fabric.hub.ranking`; readers chain through partial replicas);
- ``star``: every reader reads from the trainer.

The first version is a warm-up (buffers, connections; a worker's first fetch of a
model is never planned); the later ones are measured, each once every process has
settled (the spare buffers its store prepares in the background are ready). Per
measured version:

- ``measured_s``: from the moment the version is committed (every fetch is sent then)
  until the last reader holds it, verified by its checksums and bit-exact
  against the trainer (sha256);
- ``lower_bound_s``: `topology.bounds.lower_bound` on the emulated cluster (the YAML
  scaled, one host-memory reader per node; latencies kept only where they are
  emulated: by ``netem``, or with ``--delay-line`` by a delay line on each WAN link,
  `tools.bench.delay_line`), ``efficiency`` = ``lower_bound_s / measured_s``;
- ``predicted_s``: `topology.simulator.simulate` of the hub's plan (``plan``) or of the
  star (``star``) on the same graph; the ranked routing has no plan to simulate;
- ``wan_bytes``: bytes sent over each WAN link per direction (veth counters; Ethernet
  frames, control traffic and TCP retransmissions included);
- ``drops`` and ``retransmitted`` (the last measured version; diagnostics): packets each
  shaped link's queue dropped, per direction, and TCP segments each node retransmitted
  (each at most the MTU less 52 bytes of headers), where not 0: a retransmission
  crosses every link up to the queue that dropped it again.

A routing's figures are the median over its measured versions. Needs root and
iproute2; without them it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from weightfabric.tools.bench.cluster_net import emulate, sigterm_unwinds, skipped, unavailable
from weightfabric.tools.bench.launch import Agent, AgentError, close_all, print_result
from weightfabric.tools.command import EXIT_OK, Console, add_command
from weightfabric.topology.schema import Cluster, NodeType
from weightfabric.topology.units import parse_bandwidth, parse_size

ROUTINGS = ("plan", "ranked", "star")
HUB_RANKING = {"plan": "plan", "ranked": "ranked", "star": "origin"}
SEED = 24
PREFIX = "wfc"
MAX_NODES = 32
MIN_BOUND_S = 4.0
"""The default scale keeps the lower bound at least this long (`auto_scale`)."""
DEFAULT_BUDGET = "300MB/s"
"""What this host's processes can move in all, with the default ``--scale``."""
DEFAULT_CHUNK = "1MiB"
"""The fetch chunk size by default (``--chunk-size``)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench cluster`."""
    p = add_command(
        subparsers, "cluster", handler=_run, bad_input=(ValueError, KeyError),
        failures=(AgentError,),
        help="a cluster YAML emulated in network namespaces: time to version vs the bound "
             "(root)",
        description="Builds the cluster's network in namespaces (tc-shaped NIC, leaf and WAN\n"
                    "links, bandwidths x --scale), one host-memory worker per node, and\n"
                    "times each routing (plan: the planner's forest run by the hub; ranked:\n"
                    "widest-path ranking; star: all from the trainer) from commit to every\n"
                    "reader holding the version, against the max-flow lower bound and the\n"
                    "simulator's prediction, with the WAN bytes per link. Needs root and ip\n"
                    "netns; without them it prints why and exits 0. Exits 1 if a reader's\n"
                    "bytes differ or a process fails, 2 on bad options.",
        examples=["sudo fabric bench cluster topology/clusters/relay-wan.yaml --json",
                  "sudo fabric bench cluster topology/clusters/three-datacenters.yaml "
                  "--size 32MB --routing plan,ranked --timeline /tmp/tl.png"])
    p.add_argument("cluster", help="cluster YAML (path, or a reference cluster's name)")
    p.add_argument("--scale", type=float, default=None,
                   help="factor on every bandwidth (default: so that the readers together "
                        f"receive about --budget at the lower bound, and the bound is at "
                        f"least {MIN_BOUND_S:g} s)")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help="with the default --scale: what this host's processes can move in "
                        "all (default 300MB/s)")
    p.add_argument("--size", default="128MB", help="model bytes (default 128MB)")
    p.add_argument("--chunk-size", default=DEFAULT_CHUNK,
                   help=f"fetch chunk size (default {DEFAULT_CHUNK})")
    p.add_argument("--routing", default=",".join(ROUTINGS),
                   help="comma-separated routings to run (default plan,ranked,star)")
    p.add_argument("--versions", type=int, default=3,
                   help="versions per routing, the first a warm-up (default 3)")
    p.add_argument("--start-bound", type=float, default=5.0,
                   help="plan routing: seconds a reader waits for its planned upstreams to "
                        "begin (default 5: dozens of processes on a few cores begin their "
                        "fetches up to seconds apart; the hub's own default is 2)")
    p.add_argument("--timeline", help="write each routing's timeline PNG here (the routing's "
                                      "name is added before the suffix): each reader's bytes "
                                      "against time, its planned finish, and when it first "
                                      "forwarded a chunk to another reader (a triangle)")
    p.add_argument("--delay-line", action="store_true",
                   help="where the kernel has no netem, delay each WAN link by its latency "
                        "with a userspace delay line (a process per link, a few "
                        "microseconds of CPU per frame: lower --budget to leave the host "
                        "room); the hub then plans with the latencies, windows included")
    p.add_argument("--congestion", help="TCP congestion control in every namespace, e.g. "
                                        "cubic or bbr (default: the host's, named in the "
                                        "JSON's shaping)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ------------------------------------------------------------------ the cluster
def load(name: str) -> Cluster:
    """A cluster YAML by path, or a reference cluster by name."""
    from weightfabric.topology import load_cluster, reference_clusters

    path = Path(name)
    if not path.exists() and name in reference_clusters():
        path = reference_clusters()[name]
    return load_cluster(path)


def roles(cluster: Cluster) -> tuple[str, list[str]]:
    """The trainer node (the first of the ``trainer`` role) and the reader nodes.

    Raises:
        ValueError: no trainer, no reader on another node, or too many nodes to emulate.
    """
    trainers = cluster.role("trainer")
    if not trainers:
        raise ValueError(f"cluster {cluster.name!r} names no trainer node (roles: trainer)")
    trainer = trainers[0].name
    readers = [n.name for n in cluster.role("rollout") if n.name != trainer]
    if not readers:
        raise ValueError(f"cluster {cluster.name!r} has no rollout node besides the trainer "
                         f"{trainer!r}: nothing crosses a network to emulate")
    if len(readers) + 1 > MAX_NODES:
        raise ValueError(f"cluster {cluster.name!r} has {len(readers) + 1} nodes to emulate; "
                         f"this benchmark runs one process per node, at most {MAX_NODES}")
    return trainer, readers


def emulated(cluster: Cluster, scale: float, *, latency: bool) -> Cluster:
    """``cluster`` as emulated: every bandwidth x ``scale``; latencies only with ``latency``."""
    def link(spec: Any) -> Any:
        if spec is None:
            return None
        return dataclasses.replace(spec, bandwidth=spec.bandwidth * scale,
                                   latency=spec.latency if latency else 0.0)

    def node_type(t: NodeType) -> NodeType:
        return dataclasses.replace(t, nvlink=link(t.nvlink), pcie=link(t.pcie), nics=link(t.nics))

    return dataclasses.replace(
        cluster, name=f"{cluster.name}-x{scale:g}",
        node_types={k: node_type(t) for k, t in cluster.node_types.items()},
        datacenters=tuple(dataclasses.replace(dc, network=dataclasses.replace(
            dc.network, latency=dc.network.latency if latency else 0.0))
            for dc in cluster.datacenters),
        wan=tuple(link(w) for w in cluster.wan))


def model(cluster: Cluster, trainer: str, readers: list[str], size: int, chunk: int
          ) -> dict[str, Any]:
    """Bound, plan and simulations of one version on ``cluster`` (already scaled).

    The plan is the one the hub makes (`fabric.hub.planned`: ``size`` rounded up to whole
    chunks, the trainer's and readers' host vertices, ``chunk`` as the pipelining unit).
    """
    from weightfabric.topology.baselines import star
    from weightfabric.topology.bounds import lower_bound
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import plan_broadcast
    from weightfabric.topology.simulator import simulate

    layout = Layout(cluster.graph())
    planned = math.ceil(size / chunk) * chunk
    source, needs = f"{trainer}/host", {f"{r}/host": [(0, planned)] for r in readers}
    plan = plan_broadcast(layout, planned, sources=[source], readers=list(needs), chunk=chunk)
    bound = lower_bound(layout, [source], needs)
    sim = simulate(layout.graph, plan.transfers, chunk=chunk, size=planned)
    star_sim = simulate(layout.graph, star(layout, [source], needs), chunk=chunk, size=planned)
    return {"lower_bound_s": bound.seconds, "plan": plan,
            "predicted": {"plan": sim.makespan, "star": star_sim.makespan, "ranked": None},
            "finish": {"plan": sim.completion, "star": star_sim.completion},
            "wan_bytes_planned": sim.wan_bytes}


def auto_scale(cluster: Cluster, trainer: str, readers: list[str], size: int, chunk: int,
               budget: float) -> float:
    """The scale at which the readers receive ``budget`` bytes/s in all, at the bound.

    Lower where that bound would be under `MIN_BOUND_S`: a fetch's fixed start (a few
    hub calls and a first chunk per hop, about 0.2 s on a busy 2-core host) would weigh
    on a bound of one second.
    """
    at_one = model(emulated(cluster, 1.0, latency=False), trainer, readers, size, chunk)
    bound = at_one["lower_bound_s"]
    return min(budget * bound / (len(readers) * size), bound / MIN_BOUND_S)


# -------------------------------------------------------------------- the run
def run_routing(routing: str, net: Any, yaml_path: str, *, trainer: str, readers: list[str],
                dc_of: dict[str, str], size: int, chunk: int, versions: int,
                start_bound: float, on_phase: Callable[[str], None],
                on_progress: Callable[[str, int, int], None] | None) -> dict[str, Any]:
    """One routing on fresh processes over the emulated network ``net``.

    A read's slowest acceptable rate (`transports.client.MIN_RATE`, 1 MiB/s) is scaled
    with the links, as every other rate is.
    """
    from weightfabric.fabric.transports.client import MIN_RATE, MIN_RATE_ENV  # (torch)

    agents: list[Agent] = []
    min_rate = max(1.0, MIN_RATE * net.shaping["scale"])

    def start(name: str) -> Agent:
        agent = Agent(name, prefix=net.exec_prefix(trainer if name == "hub" else name),
                      env={"WEIGHTFABRIC_HOST_ID": name, MIN_RATE_ENV: f"{min_rate:g}"},
                      on_progress=on_progress, ready_timeout=None)
        agents.append(agent)
        return agent

    try:
        on_phase(f"{routing}: start {len(readers) + 2} processes")
        hub = start("hub")
        workers = {name: start(name) for name in (trainer, *readers)}
        hub.reply(120)
        url = hub.ask("hub", host=net.address(trainer), ranking=HUB_RANKING[routing],
                      cluster=yaml_path, start_bound_s=start_bound, origin=trainer)["url"]
        for agent in workers.values():
            agent.reply(120)
        for name, agent in workers.items():
            agent.ask("join", url=url, name=name, host=net.address(name), chunk_size=chunk,
                      location={"datacenter": dc_of[name], "node": name, "device": "host"})
        rounds = []
        for v in range(versions):
            on_phase(f"{routing}: v{v + 1} settle")
            for agent in workers.values():   # the buffers a store prepares in the background
                agent.send("settle")
            for agent in workers.values():
                agent.reply(300)
            on_phase(f"{routing}: v{v + 1} publish")
            pub = workers[trainer].ask("publish", size=size, seed=SEED, timeout=300)
            on_phase(f"{routing}: v{v + 1} fetch" + (" (warm-up)" if v == 0 else ""))
            wan0, drops0, retrans0 = net.wan_bytes(), net.drops(), net.retransmits()
            t0 = time.time()
            for r in readers:
                workers[r].send("fetch", version=pub["version"], samples=True,
                                options={"deltas": "off"})
            fetched = {r: workers[r].reply(600) for r in readers}
            wan1, drops1, retrans1 = net.wan_bytes(), net.drops(), net.retransmits()
            want = workers[trainer].ask("digest", timeout=120)["sha256"]
            exact = all(workers[r].ask("digest", timeout=120)["sha256"] == want
                        for r in readers)
            forwarded = {r: workers[r].ask("forwarded", version=pub["version"])["first"]
                         for r in readers}
            rounds.append({
                "version": pub["version"], "bytes": int(pub["bytes"]), "verified": exact,
                "measured_s": max(f["end"] for f in fetched.values()) - t0,
                "wan_bytes": {k: wan1[k] - wan0[k] for k in wan1},
                "drops": {k: n - drops0[k] for k, n in drops1.items() if n > drops0[k]},
                "retransmitted": {k: n - retrans0[k] for k, n in retrans1.items()
                                  if n > retrans0[k]},
                "reader_s": {r: f["end"] - t0 for r, f in fetched.items()},
                "samples": {r: [(t - t0, n) for t, n in f["samples"]] for r, f in fetched.items()},
                "first_forward_s": {r: t - t0 for r, t in forwarded.items() if t is not None},
                "sources": {r: f["sources"] for r, f in fetched.items()},
                "streams": {r: f["streams"] for r, f in fetched.items()},
                "reread": {r: {"chunks": f["chunks_reread"], "failed": f["failed_sources"]}
                           for r, f in fetched.items()
                           if f["chunks_reread"] or f["failed_sources"]}})
        if routing == "plan":
            plans = hub.ask("plans")["plans"]
            rounds[-1]["routed_around"] = {p["version"]: p["routed_around"] for p in plans}
    finally:
        close_all(agents)
    return {"versions": rounds}


def bench_cluster(name: str, *, scale: float | None, budget: float, size: int, chunk: int,
                  routings: list[str], versions: int, start_bound: float,
                  timeline: str | None = None, prefix: str = PREFIX, delay_line: bool = False,
                  congestion: str | None = None,
                  on_phase: Callable[[str], None] = lambda name: None,
                  on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Every routing in ``routings`` over one emulated cluster. See the module docstring.

    ``prefix`` names the namespaces (`cluster_net.emulate`); a run removes them however it
    ends.

    Raises:
        ValueError: bad arguments.  RuntimeError: the benchmark cannot run here.
        AgentError: a process failed or timed out.
    """
    if versions < 2:
        raise ValueError("--versions must be >= 2 (the first is a warm-up)")
    bad = [r for r in routings if r not in ROUTINGS]
    if bad or not routings:
        raise ValueError(f"unknown routing {bad or routings}: choose from {', '.join(ROUTINGS)}")
    cluster = load(name)
    trainer, readers = roles(cluster)
    if scale is None:
        scale = auto_scale(cluster, trainer, readers, size, chunk, budget)
    if not scale > 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    from weightfabric.fabric.arena import remove_stale_regions

    dc_of = {n.name: n.datacenter for n in cluster.nodes()}
    result: dict[str, Any] = {"cluster": cluster.name, "scale": scale, "bytes": size,
                              "chunk_size": chunk, "trainer": trainer, "readers": readers,
                              "runs": {}}
    on_phase("build the namespaces")
    try:
        with emulate(cluster, scale=scale, nodes=[trainer, *readers], prefix=prefix,
                     delay_line=delay_line, congestion=congestion) as net, \
                tempfile.TemporaryDirectory(prefix="wf-cluster-") as tmp:
            result["shaping"] = net.shaping
            scaled = emulated(cluster, scale, latency=bool(net.shaping.get("delay_emulated")))
            yaml_path = str(Path(tmp) / "cluster.yaml")
            Path(yaml_path).write_text(scaled.to_yaml())
            runs = {r: run_routing(r, net, yaml_path, trainer=trainer, readers=readers,
                                   dc_of=dc_of, size=size, chunk=chunk, versions=versions,
                                   start_bound=start_bound, on_phase=on_phase,
                                   on_progress=on_progress) for r in routings}
    finally:
        remove_stale_regions()
    size_published = runs[routings[0]]["versions"][0]["bytes"]
    result["bytes"] = size_published
    m = model(scaled, trainer, readers, size_published, chunk)
    for routing, run in runs.items():
        measured = run["versions"][1:]
        seconds = statistics.median(r["measured_s"] for r in measured)
        wan = {k: statistics.median(r["wan_bytes"][k] for r in measured)
               for k in measured[0]["wan_bytes"]}
        predicted = m["predicted"][routing]
        result["runs"][routing] = {
            "measured_s": seconds, "lower_bound_s": m["lower_bound_s"],
            "efficiency": m["lower_bound_s"] / seconds, "predicted_s": predicted,
            "predicted_vs_measured": predicted / seconds if predicted else None,
            "wan_bytes": wan, "verified": all(r["verified"] for r in run["versions"]),
            "measured_s_per_version": [r["measured_s"] for r in measured],
            "reader_s": measured[-1]["reader_s"],
            "first_forward_s": measured[-1]["first_forward_s"],
            "streams": measured[-1]["streams"],
            "drops": measured[-1]["drops"],
            "retransmitted": measured[-1]["retransmitted"],
            "reread": [r["reread"] for r in measured],
            **({"routed_around": run["versions"][-1]["routed_around"]}
               if "routed_around" in run["versions"][-1] else {})}
        if timeline:
            result["runs"][routing]["timeline"] = str(_timeline(
                timeline, routing, measured[-1], m, dc_of, size_published, scale))
    result["verified"] = all(r["verified"] for r in result["runs"].values())
    return result


def _timeline(path: str, routing: str, last: dict[str, Any], m: dict[str, Any],
              dc_of: dict[str, str], size: int, scale: float) -> Path:
    from weightfabric.tools.bench.cluster_plot import draw_timeline

    out = Path(path)
    out = out.with_name(f"{out.stem}-{routing}{out.suffix or '.png'}")
    chunk = m["plan"].chunk
    progress = {r: [(t, min(size, n * chunk)) for t, n in s] or [(0.0, 0)]
                for r, s in last["samples"].items()}
    finish = {r.split("/")[0]: t for r, t in m["finish"].get(routing, {}).items()}
    return draw_timeline(progress, {r: finish[r] for r in progress if r in finish}, size=size,
                         path=out, lower_bound=m["lower_bound_s"],
                         forwards=last["first_forward_s"],
                         group={r: dc_of[r] for r in progress},
                         title=f"{routing} routing, v{last['version']}, scale {scale:.3g}")


# ------------------------------------------------------------------ the command
def _run(args: argparse.Namespace) -> int:
    size, chunk = int(parse_size(args.size)), int(parse_size(args.chunk_size))
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if skipped("fabric bench cluster", as_json=args.json):
        return EXIT_OK
    console = Console(stderr=True)
    with sigterm_unwinds(), console.status("") as status:
        result = bench_cluster(
            args.cluster, scale=args.scale, budget=parse_bandwidth(args.budget), size=size,
            chunk=chunk, routings=routings, versions=args.versions,
            start_bound=args.start_bound, timeline=args.timeline, delay_line=args.delay_line,
            congestion=args.congestion,
            on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench cluster: {r['cluster']}, {r['bytes'] / 1e6:g} MB, "
                        f"{len(r['readers'])} readers, bandwidths x {r['scale']:.3g}")
    for col in ("routing", "measured s", "lower bound s", "efficiency", "predicted s",
                "WAN MB (per link, direction)", "bit-exact"):
        table.add_column(col, justify="left" if col in ("routing", "WAN MB (per link, "
                                                                    "direction)") else "right")
    for routing, run in r["runs"].items():
        wan = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in run["wan_bytes"].items() if v > 1e5)
        table.add_row(routing, f"{run['measured_s']:.2f}", f"{run['lower_bound_s']:.2f}",
                      f"{run['efficiency']:.2f}",
                      "-" if run["predicted_s"] is None else f"{run['predicted_s']:.2f}",
                      wan or "-", "yes" if run["verified"] else "[red]NO[/red]")
    console.print(table)
    if not r["shaping"].get("delay_emulated"):
        console.print(f"[yellow]note:[/yellow] latencies are not emulated "
                      f"({r['shaping'].get('why', 'no netem')}); the bound and the "
                      "prediction leave them out too")
