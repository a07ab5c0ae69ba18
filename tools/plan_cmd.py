"""`fabric topo plan` and `fabric topo simulate`: broadcast plans and their simulation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from weightfabric.tools.command import EXIT_OK, Console, add_command, cannot_write
from weightfabric.topology import Cluster, ClusterConfigError, load_cluster
from weightfabric.topology.plan import Plan, PlanError, link_bytes
from weightfabric.topology.scenarios import (
    BASELINES,
    DEFAULT_STORAGE_BANDWIDTH,
    SCENARIOS,
    run_scenario,
)
from weightfabric.topology.units import UnitError, parse_bandwidth, parse_size

if TYPE_CHECKING:  # the planner's modules (networkx, numpy) load when a handler runs
    from weightfabric.topology.layout import Layout

BAD_INPUT = (ClusterConfigError, UnitError, PlanError)
"""Errors of the options or the cluster file: exit 2 with their message."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `fabric topo plan` and `fabric topo simulate` to `fabric topo`'s sub-parsers."""
    p = add_command(
        sub, "plan", help="plan a broadcast of one version", handler=plan_and_report, bad_input=BAD_INPUT,
        description="Plan who reads which bytes from whom (a forest of pipelined stripe "
                    "trees), check it against the max-flow lower bound and simulate it.\n"
                    "Sources and readers default to the YAML roles (trainer, rollout).",
        examples=["fabric topo plan topology/clusters/two-datacenters.yaml --size 140GB",
                  "fabric topo plan topology/clusters/two-datacenters.yaml --size 140GB "
                  "--draw plan.png",
                  "fabric topo plan c.yaml --size 1GB --sources node-0 --readers node-1/gpu3 "
                  "--json -o plan.json"])
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("--size", required=True, help="bytes of the version, e.g. 140GB")
    p.add_argument("--sources", nargs="+", help="devices or nodes holding the version")
    p.add_argument("--readers", nargs="+", help="devices or nodes that need it")
    p.add_argument("--chunk", help="pipelining chunk, e.g. 32MB (default: chosen)")
    p.add_argument("--json", action="store_true",
                   help="print JSON (keys: predicted_s, simulated_s, lower_bound_s, efficiency, "
                        "wan_bytes, plan_seconds, readers, transfers, stripes, chunk, depth, ...)")
    p.add_argument("-o", "--output", type=Path, help="write the full plan (every transfer) as JSON")
    p.add_argument("--draw", type=Path, metavar="PNG",
                   help="draw the plan over the cluster's picture: the links it uses, as wide "
                        "as the bytes they carry, and its trees' network hops")

    p = add_command(
        sub, "simulate", help="simulate a scenario: our plan against the baselines",
        handler=_simulate, bad_input=BAD_INPUT,
        description="Run a scenario with the flow-level simulator (max-min fair links, "
                    "pipelining, failures) for our plan and the baselines: star (every "
                    "reader pulls from the trainer), ring (a chain in rank order), storage "
                    "(push to a storage service, then pull).\nScenarios: "
                    + ", ".join(SCENARIOS) + ".",
        examples=["fabric topo simulate topology/clusters/two-datacenters.yaml "
                  "--scenario cross-dc --json"])
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("--scenario", required=True, choices=SCENARIOS,
                   help="standalone: the trainer to every rollout device; elastic: half the "
                        "rollout machines already hold it and serve the rest; cross-dc: rollout "
                        "devices outside the trainer's datacenter read across the WAN; "
                        "preemption: every fourth rollout machine dies at 40%% of the plan's time")
    p.add_argument("--size", default="140GB", help="bytes of the version (default 140GB)")
    p.add_argument("--storage-bandwidth", default=None,
                   help=f"storage service bandwidth (default {DEFAULT_STORAGE_BANDWIDTH / 1e9:g}GB/s)")
    p.add_argument("--baselines", nargs="+", choices=BASELINES, default=list(BASELINES),
                   help=f"baselines to simulate beside our plan (default: all: "
                        f"{' '.join(BASELINES)})")
    p.add_argument("--timeline", type=Path, help="write a PNG of our plan's aggregate rate")
    p.add_argument("--json", action="store_true",
                   help="print JSON (keys: scenario, ours_s, baselines, speedup, "
                        "lower_bound_s, efficiency, wan_bytes, ...)")


def plan_summary(plan: Plan, layout: Layout) -> dict[str, object]:
    """Plan, bound and simulation figures as plain data (the `--json` output)."""
    from weightfabric.topology.bounds import lower_bound
    from weightfabric.topology.simulator import simulate

    bound = lower_bound(layout, plan.sources, plan.needs)
    sim = simulate(layout.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                   holders=plan.sources)
    edges = layout.graph.edges
    wan = sum(n for key, n in link_bytes(plan.transfers).items() if edges[key]["tier"] == "wan")
    return {"predicted_s": plan.predicted_s, "simulated_s": sim.makespan,
            "lower_bound_s": bound.seconds, "efficiency": bound.seconds / plan.predicted_s,
            "simulated_efficiency": bound.seconds / sim.makespan, "wan_bytes": wan,
            "plan_seconds": plan.plan_seconds, "bound_seconds": bound.elapsed,
            "simulate_seconds": sim.wall_seconds, "readers": len(plan.needs),
            "sources": len(plan.sources), "transfers": len(plan.transfers),
            "stripes": len(plan.stripes), "chunk": plan.chunk, "depth": plan.depth(),
            "bound_method": bound.method}


def plan_and_report(args: argparse.Namespace) -> int:
    """`fabric topo plan`: plan, then print the figures, write ``-o`` and ``--draw``.

    Reads ``file, size, sources, readers, chunk, draw, output, json`` from `args` (also
    `fabric topo draw --plan`'s handler).
    """
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import plan_broadcast

    cluster = load_cluster(args.file)
    size = int(parse_size(args.size))
    chunk = int(parse_size(args.chunk)) if args.chunk is not None else None
    layout = Layout(cluster.graph())
    plan = plan_broadcast(cluster if not (args.sources and args.readers) else layout, size,
                          sources=args.sources, readers=args.readers, chunk=chunk)
    out = plan_summary(plan, layout)
    try:
        if args.draw:
            _draw(args.draw, cluster, plan, layout, out)
        if args.output:
            args.output.write_text(json.dumps(plan.to_dict()))
    except OSError as exc:
        raise cannot_write("the output", exc) from exc
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    console = Console()
    table = Table("figure", "value")
    for key, value in out.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    for path in (args.draw, args.output):
        if path:
            console.print(f"wrote {path}")
    return EXIT_OK


def _draw(path: Path, cluster: Cluster, plan: Plan, layout: Layout, out: dict) -> None:
    """The plan over the cluster's picture, titled with the figures of `plan_summary`."""
    from weightfabric.topology.draw import draw_plan

    figures = (f"simulated {out['simulated_s']:.3g} s · "
               f"lower bound {out['lower_bound_s']:.3g} s · efficiency {out['efficiency']:.3f} "
               f"(simulated {out['simulated_efficiency']:.3f})")
    draw_plan(cluster, plan, path, notes=(figures,), graph=layout.graph)


def _simulate(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.file)
    size = int(parse_size(args.size))
    bw = (parse_bandwidth(args.storage_bandwidth) if args.storage_bandwidth
          else DEFAULT_STORAGE_BANDWIDTH)
    result = run_scenario(cluster, args.scenario, size, storage_bandwidth=bw,
                          baselines_to_run=tuple(args.baselines))
    if args.timeline:
        try:
            _timeline(result.timeline, args.timeline, f"{cluster.name}: {args.scenario}")
        except OSError as exc:
            raise cannot_write(args.timeline, exc) from exc
    out = result.to_dict()
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    console = Console()
    console.print(f"[bold]{args.scenario}[/] on {cluster.name}: {result.readers} readers, "
                  f"lower bound {result.lower_bound_s:.4g} s, efficiency {result.efficiency:.3f}")
    table = Table("strategy", "stall (s)", "ours is faster by")
    table.add_row("ours", f"{result.ours_s:.4g}", "")
    for name, seconds in result.baselines.items():
        table.add_row(name, f"{seconds:.4g}", f"{result.speedup[name]:.1f}x")
    console.print(table)
    return EXIT_OK


def _timeline(points: list[tuple[float, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.step([t for t, _ in points], [r / 1e9 for _, r in points], where="post")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("aggregate rate (GB/s)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
