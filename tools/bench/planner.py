"""`fabric bench planner`: planner time and efficiency from 8 to 10,000+ GPUs.

Also the baselines' completion times in the scenarios (numbers go to
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time

from rich.table import Table

from weightfabric.tools.command import EXIT_OK, Console, add_command
from weightfabric.topology.references import reference_cluster, reference_clusters
from weightfabric.topology.scenarios import run_scenario
from weightfabric.topology.synthetic import synthetic_cluster

SIZE = 140 * 10**9  # a 70B model in bf16
SCALES = [[1], [4], [32], [128], [625, 625], [1250]]  # rollout nodes per datacenter
# oversubscribed leaves: (rollout nodes, oversubscription, nodes per leaf)
OVERSUBSCRIBED = [(31, 3.0, 4), (127, 3.0, 4), (31, 3.0, 8), (127, 4.0, 16)]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench planner`."""
    p = add_command(
        subparsers, "planner", help="broadcast planner: time, efficiency, baselines", handler=run,
        description="Plan, bound and simulate a 140 GB broadcast on every reference cluster\n"
                    "and on synthetic DGX H100 clusters from 8 to 10,000 GPUs; compare with\n"
                    "star, ring and storage baselines.",
        examples=["fabric bench planner --max-gpus 1024 --json"])
    p.add_argument("--max-gpus", type=int, default=10_000,
                   help="largest synthetic cluster to run (default 10000)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _scale_row(rollout_nodes: list[int]) -> dict[str, object]:
    from weightfabric.tools.plan_cmd import plan_summary
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import default_endpoints, plan_broadcast

    cluster = synthetic_cluster(rollout_nodes)
    started = time.perf_counter()
    layout = Layout(cluster.graph())
    graph_s = time.perf_counter() - started
    sources, readers = default_endpoints(cluster, layout)
    plan = plan_broadcast(layout, SIZE, sources=sources, readers=readers)
    row = plan_summary(plan, layout)
    row.update(gpus=sum(rollout_nodes) * 8, datacenters=len(rollout_nodes), graph_seconds=graph_s)
    return row


def _oversubscribed_row(nodes: int, over: float, per_leaf: int) -> dict[str, object]:
    """Leaf-aware trees against the same planner with leaf placement switched off."""
    from weightfabric.tools.plan_cmd import plan_summary
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import default_endpoints, plan_broadcast

    cluster = synthetic_cluster([nodes], oversubscription=over, nodes_per_leaf=per_leaf)
    layout = Layout(cluster.graph())
    sources, readers = default_endpoints(cluster, layout)
    row: dict[str, object] = {"gpus": nodes * 8, "oversubscription": over,
                              "nodes_per_leaf": per_leaf}
    for name, aware in (("leaf_aware", True), ("machine_order", False)):
        plan = plan_broadcast(layout, SIZE, sources=sources, readers=readers, leaf_aware=aware)
        summary = plan_summary(plan, layout)
        spine = sum(t.nbytes for t in plan.transfers
                    for a in zip(t.path, t.path[1:], strict=False) if a[0].endswith("/spine"))
        streams: dict[str, int] = {}  # streams leaving each machine's NICs
        for t in plan.transfers:
            for a, b in zip(t.path, t.path[1:], strict=False):
                if layout.kinds.get(a) == "nic" and layout.kinds.get(b) == "leaf":
                    streams[layout.machine_of[a]] = streams.get(layout.machine_of[a], 0) + 1
        row[name] = {"simulated_s": summary["simulated_s"],
                     "lower_bound_s": summary["lower_bound_s"],
                     "simulated_efficiency": summary["simulated_efficiency"],
                     "spine_bytes_per_s": spine / SIZE, "depth": summary["depth"],
                     "plan_seconds": summary["plan_seconds"],
                     "max_machine_streams": max(streams.values(), default=0)}
    return row


def run(args: argparse.Namespace) -> int:
    """Run `fabric bench planner`; returns the exit code."""
    from weightfabric.tools.plan_cmd import plan_summary
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import default_endpoints, plan_broadcast

    out: dict[str, object] = {"size": SIZE}
    refs: dict[str, dict[str, object]] = {}
    for name in reference_clusters():
        cluster = reference_cluster(name)
        layout = Layout(cluster.graph())
        sources, readers = default_endpoints(cluster, layout)
        if not readers:
            refs[name] = {"note": "one device: nothing to transfer"}
            continue
        plan = plan_broadcast(layout, SIZE, sources=sources, readers=readers)
        refs[name] = plan_summary(plan, layout)
    out["reference"] = refs
    out["scale"] = [_scale_row(n) for n in SCALES if sum(n) * 8 <= args.max_gpus]
    out["oversubscribed"] = [_oversubscribed_row(*c) for c in OVERSUBSCRIBED
                             if c[0] * 8 <= args.max_gpus]
    scen = {"standalone-256": run_scenario(synthetic_cluster([32]), "standalone", SIZE),
            "elastic-256": run_scenario(synthetic_cluster([32]), "elastic", SIZE),
            "preemption-256": run_scenario(synthetic_cluster([32]), "preemption", SIZE),
            "cross-dc-two-datacenters": run_scenario(reference_cluster("two-datacenters"),
                                                     "cross-dc", SIZE),
            "cross-dc-heterogeneous": run_scenario(reference_cluster("heterogeneous"),
                                                   "cross-dc", SIZE)}
    if args.max_gpus >= 10_000:
        scen["cross-dc-10k"] = run_scenario(synthetic_cluster([1, 1250]), "cross-dc", SIZE,
                                            baselines_to_run=("star",))
    out["scenarios"] = {k: v.to_dict() for k, v in scen.items()}
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    _print(out)
    return EXIT_OK


def _print(out: dict) -> None:
    console = Console()
    t = Table("reference cluster", "readers", "predicted s", "simulated s", "bound s",
              "efficiency", "sim. eff.", "WAN GB", "plan s", title="140 GB broadcast")
    for name, r in out["reference"].items():
        if "note" in r:
            t.add_row(name, "0", "", "", "", "", "", "", r["note"])
            continue
        t.add_row(name, str(r["readers"]), f"{r['predicted_s']:.4g}", f"{r['simulated_s']:.4g}",
                  f"{r['lower_bound_s']:.4g}", f"{r['efficiency']:.3f}",
                  f"{r['simulated_efficiency']:.3f}", f"{r['wan_bytes'] / 1e9:.4g}",
                  f"{r['plan_seconds']:.3f}")
    console.print(t)
    t = Table("GPUs", "DCs", "transfers", "depth", "plan s", "bound s (time)", "simulate s",
              "efficiency", "sim. eff.", title="synthetic DGX H100 clusters")
    for r in out["scale"]:
        t.add_row(str(r["gpus"]), str(r["datacenters"]), str(r["transfers"]), str(r["depth"]),
                  f"{r['plan_seconds']:.2f}", f"{r['bound_seconds']:.2f}",
                  f"{r['simulate_seconds']:.2f}", f"{r['efficiency']:.3f}",
                  f"{r['simulated_efficiency']:.3f}")
    console.print(t)
    t = Table("GPUs", "over.", "nodes/leaf", "leaf-aware s", "machine-order s", "bound s",
              "eff. (aware)", "eff. (order)", "spine/S (aware)", "spine/S (order)",
              "max streams/machine", title="oversubscribed leaves (simulated)")
    for r in out["oversubscribed"]:
        a, o = r["leaf_aware"], r["machine_order"]
        t.add_row(str(r["gpus"]), f"{r['oversubscription']:g}", str(r["nodes_per_leaf"]),
                  f"{a['simulated_s']:.4g}", f"{o['simulated_s']:.4g}",
                  f"{a['lower_bound_s']:.4g}", f"{a['simulated_efficiency']:.3f}",
                  f"{o['simulated_efficiency']:.3f}", f"{a['spine_bytes_per_s']:.1f}",
                  f"{o['spine_bytes_per_s']:.1f}", str(a["max_machine_streams"]))
    console.print(t)
    t = Table("scenario", "readers", "ours s", "star s", "ring s", "storage s", "vs star",
              "vs ring", "WAN/S", title="scenarios (stall until the last reader has it)")
    for name, r in out["scenarios"].items():
        b, sp = r["baselines"], r["speedup"]
        t.add_row(name, str(r["readers"]), f"{r['ours_s']:.4g}",
                  *(f"{b[k]:.4g}" if k in b else "-" for k in ("star", "ring", "storage")),
                  *(f"{sp[k]:.1f}x" if k in sp else "-" for k in ("star", "ring")),
                  f"{r['wan_bytes'] / out['size']:.3f}")
    console.print(t)
