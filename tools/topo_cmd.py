"""`fabric topo ...`: validate, show, draw and discover cluster descriptions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.table import Table

from weightfabric.tools.command import (
    EXIT_OK,
    BadInput,
    Console,
    add_command,
    add_group,
    cannot_write,
)
from weightfabric.topology import ClusterConfigError, load_cluster
from weightfabric.topology.summary import summarize
from weightfabric.topology.units import human_bandwidth

BAD_CLUSTER = (ClusterConfigError,)
"""Errors that mean a bad cluster file: exit 2 with their 'file:line: field: ...'."""
PLAN_SIZE = "140GB"
"""The version `fabric topo draw --plan` plans a broadcast of, unless --size says."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric topo` and its sub-commands (plan and simulate from `tools.plan_cmd`)."""
    sub = add_group(
        subparsers, "topo",
        help="cluster descriptions: validate, show, draw, discover, plan, simulate",
        description="Work with cluster YAML files (see the README's YAML reference): check and "
                    "summarise them, draw them, describe this machine, plan and simulate a "
                    "broadcast of a version over them.\nRun 'fabric topo SUBCOMMAND --help' "
                    "for each one's options.",
        examples=["fabric topo validate topology/clusters/dgx-h100.yaml",
                  "fabric topo plan topology/clusters/two-datacenters.yaml --size 140GB "
                  "--draw plan.png"])

    p = add_command(sub, "validate", help="check a cluster YAML file", handler=_validate,
                    bad_input=BAD_CLUSTER,
                    description="Check a cluster YAML file against the schema.\n\n"
                                "Exit 0 when it is valid; exit 2 and print "
                                "'file:line: field: what is wrong' when it is not.",
                    examples=["fabric topo validate topology/clusters/dgx-h100.yaml"])
    p.add_argument("file", type=Path, help="cluster YAML file")

    p = add_command(sub, "show", help="summarise a cluster", handler=_show,
                    bad_input=BAD_CLUSTER,
                    description="Print counts of datacenters, nodes, GPUs and NICs and the "
                                "bandwidth of each link tier.",
                    examples=["fabric topo show topology/clusters/two-datacenters.yaml",
                              "fabric topo show cluster.yaml --json | jq .gpus"])
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("--json", action="store_true",
                   help="print JSON (keys: datacenters, nodes, gpus, nics, per_datacenter, tiers, wan)")

    from weightfabric.tools import plan_cmd  # plan, simulate; `draw --plan`

    p = add_command(sub, "draw", help="draw a cluster, or a broadcast plan over it, to a PNG",
                    handler=_draw, bad_input=plan_cmd.BAD_INPUT,
                    description="Draw datacenters, nodes, GPUs, NICs and link tiers.\n\n"
                                "With --plan, plan a broadcast first (as 'fabric topo plan "
                                "--draw' does, printing the same figures) and draw it over the "
                                "faded cluster: each stripe's tree in its own colour, the links "
                                "as wide as the bytes they carry, the WAN lines labelled with "
                                "their bytes.",
                    examples=["fabric topo draw topology/clusters/two-datacenters.yaml "
                              "-o two-dc.png",
                              "fabric topo draw topology/clusters/two-datacenters.yaml --plan "
                              "-o plan.png",
                              "fabric topo draw c.yaml --plan --size 14GB --sources trainer "
                              "--readers b-0 b-1 -o plan.png"])
    p.add_argument("file", type=Path, help="cluster YAML file")
    p.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    p.add_argument("--plan", action="store_true",
                   help="plan a broadcast of --size bytes from --sources to --readers (default: "
                        "the YAML roles, trainer -> rollouts) and draw it over the cluster, one "
                        "colour per stripe, e.g. 'fabric topo draw c.yaml --plan -o plan.png'")
    p.add_argument("--size", help=f"with --plan: bytes of the version (default {PLAN_SIZE})")
    p.add_argument("--sources", nargs="+", help="with --plan: devices or nodes holding the version")
    p.add_argument("--readers", nargs="+", help="with --plan: devices or nodes that need it")

    p = add_command(sub, "discover", help="describe this machine as cluster YAML",
                    handler=_discover,
                    description="Read the local machine (GPUs through NVML or nvidia-smi, "
                                "NVLink peers, NUMA affinity, NICs from /sys, host memory) "
                                "and write a cluster YAML with one node. Works without GPUs.",
                    examples=["fabric topo discover -o local.yaml && "
                              "fabric topo validate local.yaml"])
    p.add_argument("-o", "--output", type=Path, help="file to write (default: standard output)")
    p.add_argument("--name", help="node name (default: this host's name)")
    plan_cmd.register(sub)


def _validate(args: argparse.Namespace) -> int:
    s = summarize(load_cluster(args.file))
    print(f"{args.file}: valid: {_counts(s)}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    s = summarize(load_cluster(args.file))
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

    if args.plan:
        return _draw_plan(args)
    given = [f"--{name}" for name in ("size", "sources", "readers") if getattr(args, name)]
    if given:
        raise BadInput(f"{', '.join(given)}: only with --plan (add --plan to draw a "
                       "broadcast plan over the cluster)")
    cluster = load_cluster(args.file)
    try:
        draw_cluster(cluster, args.output)
    except OSError as exc:
        raise cannot_write(args.output, exc) from exc
    print(f"wrote {args.output}")
    return EXIT_OK


def _draw_plan(args: argparse.Namespace) -> int:
    """`fabric topo plan FILE --size S [--sources ...] [--readers ...] --draw OUTPUT`."""
    from weightfabric.tools import plan_cmd

    return plan_cmd.plan_and_report(argparse.Namespace(
        file=args.file, size=args.size or PLAN_SIZE, sources=args.sources, readers=args.readers,
        chunk=None, json=False, output=None, draw=args.output))


def _discover(args: argparse.Namespace) -> int:
    from weightfabric.topology.discover import discover

    try:
        found = discover(name=args.name)
    except (ClusterConfigError, ValueError) as exc:  # e.g. a --name that is no node name
        raise BadInput(exc) from exc
    text = found.to_yaml()
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        args.output.write_text(text)
    except OSError as exc:
        raise cannot_write(args.output, exc) from exc
    print(f"wrote {args.output}: {found.summary()}", file=sys.stderr)
    return EXIT_OK
