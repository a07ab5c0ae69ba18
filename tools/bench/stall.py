"""`fabric bench stall`: rollout stall per version, the fabric beside the naive plan.

The accounting of the papers (TensorHub, RLBoost, StreamRL): the total time rollout
workers spend fetching a version — time they cannot generate — in three settings,
each run twice on fresh processes: with the fabric's ranking, and with a hub that
names only the trainer as a source (every rollout pulls from the trainer: a
parameter server or a star broadcast).

- ``standalone``: `--rollouts` fresh rollouts fetch each version.
- ``elastic``: `--rollouts` rollouts hold each version; then `--joiners` new
  processes join and fetch it (their stall is what is counted).
- ``cross-dc``: `fabric bench crossdc` (two network namespaces joined by a shaped
  link; root only, skipped with the reason otherwise); counted: the remote rollouts.

On one machine the shared-memory copies of all readers share the memory bus
whatever the plan, so standalone and elastic differ less than on a cluster, where
the trainer's NIC is the star's bottleneck; the cross-dc row shows that case.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from weightfabric.tools.bench.launch import Agent, close_all
from weightfabric.tools.command import EXIT_OK, BadInput, Console, add_command
from weightfabric.topology.units import UnitError, parse_size

SEED = 7


def _cluster(plan: str, agents: list[Agent]) -> str:
    hub = Agent("hub")
    agents.append(hub)
    return hub.ask("hub", host="127.0.0.1", ranking="locality" if plan == "fabric"
                   else "origin")["url"]


def _join(url: str, name: str, chunk_size: int, agents: list[Agent]) -> Agent:
    agent = Agent(name)
    agents.append(agent)
    agent.ask("join", url=url, name=name, chunk_size=chunk_size)
    return agent


def _fetch_all(readers: list[Agent], version: int) -> float:
    """Fetch `version` on every reader at once; returns the summed fetch time."""
    for r in readers:
        r.send("fetch", version=version)
    replies = [r.reply(600) for r in readers]
    return sum(f["end"] - f["start"] for f in replies)


def run_local(scenario: str, plan: str, *, rollouts: int, joiners: int, size: int,
              chunk_size: int, versions: int) -> list[float]:
    """Per-version summed stall of one localhost scenario under one plan."""
    agents: list[Agent] = []
    try:
        url = _cluster(plan, agents)
        trainer = _join(url, "trainer", chunk_size, agents)
        holders = [_join(url, f"rollout-{i}", chunk_size, agents) for i in range(rollouts)]
        stalls = []
        for v in range(versions):
            version = trainer.ask("publish", size=size, seed=SEED, timeout=300)["version"]
            stall = _fetch_all(holders, version)
            if scenario == "elastic":
                fresh = [_join(url, f"joiner-{v}-{i}", chunk_size, agents) for i in range(joiners)]
                stall = _fetch_all(fresh, version)
            stalls.append(stall)
        return stalls
    finally:
        close_all(agents)


def bench_stall(*, rollouts: int, joiners: int, size: int, chunk_size: int,
                versions: int) -> dict[str, Any]:
    """Both plans in every setting; cross-dc only where network namespaces work."""
    from weightfabric.tools.bench import crossdc

    out: dict[str, Any] = {"rollouts": rollouts, "joiners": joiners, "size": size,
                           "versions": versions, "settings": {}}
    for scenario in ("standalone", "elastic"):
        out["settings"][scenario] = {
            plan: run_local(scenario, plan, rollouts=rollouts, joiners=joiners, size=size,
                            chunk_size=chunk_size, versions=versions)
            for plan in ("fabric", "origin")}
    reason = crossdc.unavailable()
    if reason is None:
        result = crossdc.bench_crossdc(remote=rollouts, size=size, chunk_size=chunk_size,
                                       rate_bps=125e6, rtt_s=0.02, versions=versions)
        out["settings"]["cross-dc"] = {
            plan: [sum(s for n, s in r["stall_seconds"].items() if "-b" in n)
                   for r in result[plan]["versions"]] for plan in ("fabric", "origin")}
    else:
        out["skipped"] = {"cross-dc": reason}
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench stall`."""
    p = add_command(
        subparsers, "stall", handler=_run,
        help="rollout stall per version: fabric vs every rollout pulling from the trainer",
        description=__doc__, examples=["fabric bench stall --rollouts 3 --joiners 2 --size 64MB"])
    p.add_argument("--rollouts", type=int, default=3, help="rollouts (default 3)")
    p.add_argument("--joiners", type=int, default=2, help="new rollouts in elastic (default 2)")
    p.add_argument("--size", default="64MB", help="model bytes (default 64MB)")
    p.add_argument("--chunk-size", default="4MiB", help="fetch chunk size (default 4MiB)")
    p.add_argument("--versions", type=int, default=2, help="versions per run (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run(args: argparse.Namespace) -> int:
    try:
        size, chunk = int(parse_size(args.size)), int(parse_size(args.chunk_size))
        if min(args.rollouts, args.joiners, args.versions) < 1 or chunk % 256:
            raise ValueError("--rollouts, --joiners, --versions must be >= 1 and "
                             "--chunk-size a multiple of 256")
    except (UnitError, ValueError) as exc:
        raise BadInput(exc) from exc
    console = Console(stderr=args.json)
    with console.status("running standalone, elastic and cross-dc, each twice..."):
        out = bench_stall(rollouts=args.rollouts, joiners=args.joiners, size=size,
                          chunk_size=chunk, versions=args.versions)
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    table = Table(title=f"summed rollout stall per version (s), {size / 1e6:.0f} MB",
                  title_justify="left")
    for column in ("setting", "version", "fabric", "every rollout from the trainer", "ratio"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for setting, plans in out["settings"].items():
        for v, (ours, naive) in enumerate(zip(plans["fabric"], plans["origin"], strict=True), 1):
            table.add_row(setting, str(v), f"{ours:.3f}", f"{naive:.3f}",
                          f"{naive / ours:.1f}x" if ours > 0 else "-")
    console.print(table)
    for setting, reason in out.get("skipped", {}).items():
        console.print(f"{setting} skipped: {reason}")
    return EXIT_OK
