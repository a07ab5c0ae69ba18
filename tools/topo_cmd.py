"""`fabric topo ...`: validate, show, draw and discover cluster descriptions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from weightfabric.topology import ClusterConfigError, load_cluster
from weightfabric.topology.summary import summarize
from weightfabric.topology.units import human_bandwidth

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    topo = subparsers.add_parser(
        "topo", help="cluster descriptions: validate, show, draw, discover, plan, simulate",
        description="Work with cluster YAML files (see the README's YAML reference): check and "
                    "summarise them, draw them, describe this machine, plan and simulate a "
                    "broadcast of a version over them.",
        epilog="examples:\n  fabric topo validate topology/clusters/dgx-h100.yaml\n"
               "  fabric topo plan topology/clusters/two-datacenters.yaml --size 140GB "
               "--draw plan.png\n\nRun 'fabric topo SUBCOMMAND --help' for each one's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = topo.add_subparsers(dest="topo_command", metavar="SUBCOMMAND", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("validate", help="check a cluster YAML file", formatter_class=raw,
                       description="Check a cluster YAML file against the schema.\n\n"
                                   "Exit 0 when it is valid; exit 2 and print "
                                   "'file:line: field: what is wrong' when it is not.",
                       epilog="example:\n  fabric topo validate topology/clusters/dgx-h100.yaml")
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.set_defaults(handler=_validate)

    p = sub.add_parser("show", help="summarise a cluster", formatter_class=raw,
                       description="Print counts of datacenters, nodes, GPUs and NICs and the "
                                   "bandwidth of each link tier.",
                       epilog="examples:\n  fabric topo show topology/clusters/two-datacenters.yaml\n"
                              "  fabric topo show cluster.yaml --json | jq .gpus")
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("--json", action="store_true",
                   help="print JSON (keys: datacenters, nodes, gpus, nics, per_datacenter, tiers, wan)")
    p.set_defaults(handler=_show)

    p = sub.add_parser("draw", help="draw a cluster to a PNG", formatter_class=raw,
                       description="Draw datacenters, nodes, GPUs, NICs and link tiers.",
                       epilog="example:\n  fabric topo draw topology/clusters/two-datacenters.yaml "
                              "-o two-dc.png")
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    p.set_defaults(handler=_draw)

    p = sub.add_parser("discover", help="describe this machine as cluster YAML", formatter_class=raw,
                       description="Read the local machine (GPUs through NVML or nvidia-smi, "
                                   "NVLink peers, NUMA affinity, NICs from /sys, host memory) "
                                   "and write a cluster YAML with one node. Works without GPUs.",
                       epilog="example:\n  fabric topo discover -o local.yaml && "
                              "fabric topo validate local.yaml")
    p.add_argument("-o", "--output", type=Path, help="file to write (default: standard output)")
    p.add_argument("--name", help="node name (default: this host's name)")
    p.set_defaults(handler=_discover)
    from weightfabric.tools import plan_cmd  # plan, simulate
    plan_cmd.register(sub)


def _load(path: Path):
    try:
        return load_cluster(path)
    except ClusterConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _validate(args: argparse.Namespace) -> int:
    cluster = _load(args.file)
    if cluster is None:
        return EXIT_BAD_INPUT
    s = summarize(cluster)
    print(f"{args.file}: valid: {_counts(s)}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    cluster = _load(args.file)
    if cluster is None:
        return EXIT_BAD_INPUT
    s = summarize(cluster)
    if args.json:
        print(json.dumps(s, indent=2))
        return EXIT_OK
    console = Console()
    console.print(f"[bold]{s['name']}[/]: {_counts(s)}")
    table = Table("datacenter", "nodes", "GPUs", "NICs", "oversubscription")
    for dc in s["per_datacenter"]:
        table.add_row(dc["name"], str(dc["nodes"]), str(dc["gpus"]), str(dc["nics"]),
                      f"{dc['oversubscription']:g}:1")
    console.print(table)
    tiers = Table("link tier", "bandwidth per direction")
    for tier, values in s["tiers"].items():
        tiers.add_row(tier, ", ".join(human_bandwidth(v) for v in values))
    console.print(tiers)
    for w in s["wan"]:
        console.print(f"WAN {w['between'][0]} <-> {w['between'][1]}: "
                      f"{human_bandwidth(w['bandwidth'])}, {w['latency'] * 1e3:g} ms")
    return EXIT_OK


def _counts(s: dict) -> str:
    """'1 datacenter, 2 nodes, 16 GPUs, 16 NICs' from a `summarize` dict."""
    return ", ".join(f"{s[key]} {word}{'' if s[key] == 1 else 's'}" for key, word in (
        ("datacenters", "datacenter"), ("nodes", "node"), ("gpus", "GPU"), ("nics", "NIC")))


def _draw(args: argparse.Namespace) -> int:
    from weightfabric.topology.draw import draw_cluster

    cluster = _load(args.file)
    if cluster is None:
        return EXIT_BAD_INPUT
    try:
        draw_cluster(cluster, args.output)
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.output}")
    return EXIT_OK


def _discover(args: argparse.Namespace) -> int:
    from weightfabric.topology.discover import discover

    try:
        found = discover(name=args.name)
    except (ClusterConfigError, ValueError) as exc:  # e.g. a --name that is no node name
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = found.to_yaml()
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        args.output.write_text(text)
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.output}: {found.summary()}", file=sys.stderr)
    return EXIT_OK
