"""`fabric bench crossdc`: two emulated datacenters joined by a shaped WAN link.

Two network namespaces (``wf-dca``, ``wf-dcb``) are joined by a veth pair whose
both ends are shaped with ``tc netem`` (``--rate``, ``--rtt``: half the RTT is added
in each direction), or with ``tbf`` (the rate only) on a kernel without ``sch_netem``
(`cluster_net.qdisc` shapes both this link and those of `cluster_net.emulate`). dc-a runs the hub, the trainer and one rollout; dc-b runs
``--remote`` rollouts. Every process is started with ``ip netns exec`` and a
``WEIGHTFABRIC_HOST_ID`` of its datacenter, so processes of one datacenter share
memory and the WAN is crossed over TCP.

Two plans, each on fresh processes:

- ``fabric``: the hub's locality ranking (rollouts register their datacenter): one
  copy should cross the WAN, then fan out inside dc-b.
- ``origin``: a hub that names only the trainer as a source (what a parameter
  server or a broadcast from the trainer does): every remote rollout crosses it.

With ``--delta``, the trainer publishes as a mixed-precision trainer does (fp32
master weights moved by an Adam-sized step of ``--lr``, published as bf16:
`agent.TrainingSteps`) and the two plans, both ranked by locality, are:

- ``delta``: readers that hold the previous version ask for deltas (``auto``,
  `fabric.deltas`): the WAN carries the words that changed.
- ``full``: the same with deltas off: every version crosses whole.

Per version: the WAN bytes (veth counters, both directions, control traffic
included) and each rollout's stall (its fetch time). Needs root and ``ip netns``;
only touches the namespaces and veth it creates, and removes them on every exit.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from weightfabric.tools.bench.cluster_net import (
    link_stats,
    netem_missing,
    qdisc,
    sh,
    sigterm_unwinds,
    skipped,
    unavailable,
)
from weightfabric.tools.bench.launch import Agent, AgentError, close_all, print_result
from weightfabric.tools.command import EXIT_OK, Console, add_command
from weightfabric.topology.units import parse_bandwidth, parse_latency, parse_size

NAMESPACES = {"dc-a": "wf-dca", "dc-b": "wf-dcb"}
VETH = {"dc-a": "wf-wan-a", "dc-b": "wf-wan-b"}
ADDRESS = {"dc-a": "10.99.0.1", "dc-b": "10.99.0.2"}
SEED = 99
PLANS = ("fabric", "origin")
DELTA_PLANS = ("delta", "full")
"""With ``--delta``: the first plan's figures are compared with the second's."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench crossdc`."""
    p = add_command(
        subparsers, "crossdc", help="emulated cross-datacenter fetch: WAN bytes and stall (root)",
        handler=_run, bad_input=(ValueError,), failures=(AgentError,),
        description="Two network namespaces joined by a tc-shaped veth WAN; trainer and one\n"
                    "rollout in dc-a, --remote rollouts in dc-b. Compares the fabric's\n"
                    "locality plan with every remote rollout pulling from the trainer: WAN\n"
                    "bytes per version and each rollout's stall. Needs root and ip netns;\n"
                    "without them it prints why and exits 0. Exits 1 if a rollout's bytes\n"
                    "differ from the trainer's or a process fails, 2 on bad options.",
        examples=["sudo fabric bench crossdc --delta --remote 2 --size 256MB --versions 3",
                  "sudo fabric bench crossdc --remote 3 --size 64MB --rate 1Gbit/s "
                  "--rtt 20ms --json"])
    p.add_argument("--remote", type=int, default=3, help="rollouts in dc-b (default 3)")
    p.add_argument("--size", default="64MB", help="model bytes (default 64MB)")
    p.add_argument("--chunk-size", default="4MiB", help="fetch chunk size (default 4MiB)")
    p.add_argument("--rate", default="1Gbit/s", help="WAN rate per direction (default 1Gbit/s)")
    p.add_argument("--rtt", default="20ms", help="WAN round-trip time (default 20ms)")
    p.add_argument("--versions", type=int, default=2, help="versions per plan (default 2)")
    p.add_argument("--delta", action="store_true",
                   help="publish training steps and compare delta fetches with full ones")
    p.add_argument("--lr", type=float, default=1e-6,
                   help="with --delta: the step size of the fp32 master weights (default 1e-6)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _netns(dc: str) -> list[str]:
    return ["ip", "netns", "exec", NAMESPACES[dc]]


@contextlib.contextmanager
def wan(*, rate_bps: float, rtt_s: float) -> Iterator[dict[str, Any]]:
    """Create the two namespaces and the shaped veth between them; remove them after.

    Yields what was shaped: ``{"qdisc", "rate_bytes_per_s", "rtt_emulated"}``. Each end
    gets `cluster_net.qdisc`: ``netem`` (half the RTT + the rate); on a kernel without
    ``sch_netem``, ``tbf`` (the rate only), and it says the delay is not emulated.
    """
    remove_wan()  # leftovers of a run that was killed
    try:
        for ns in NAMESPACES.values():
            sh("ip", "netns", "add", ns)
        # both ends are created inside the namespaces: nothing appears on the host
        sh("ip", "link", "add", VETH["dc-a"], "netns", NAMESPACES["dc-a"], "type", "veth",
           "peer", "name", VETH["dc-b"], "netns", NAMESPACES["dc-b"])
        no_netem = netem_missing(NAMESPACES["dc-a"])
        shaped = {"qdisc": "tbf" if no_netem else "netem", "rate_bytes_per_s": rate_bps,
                  "rtt_emulated": rtt_s > 0 and not no_netem}
        for dc, ns in NAMESPACES.items():
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ADDRESS[dc]}/24", "dev", VETH[dc])
            sh("ip", "-n", ns, "link", "set", VETH[dc], "up")
            sh("tc", "-n", ns, "qdisc", "add", "dev", VETH[dc], "root",
               *qdisc(rate_bps, rtt_s / 2, netem=not no_netem))
        yield shaped
    finally:
        remove_wan()


def remove_wan() -> None:
    """Delete this benchmark's namespaces (their veth goes with them)."""
    for ns in NAMESPACES.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def wan_counters() -> tuple[int, int]:
    """(bytes dc-a -> dc-b, bytes dc-b -> dc-a) sent over the veth so far."""
    return link_stats(NAMESPACES["dc-a"])[VETH["dc-a"]]


def run_plan(plan: str, *, remote: int, size: int, chunk_size: int, versions: int,
             on_phase: Callable[[str], None],
             on_progress: Callable[[str, int, int], None] | None,
             lr: float | None = None) -> dict[str, Any]:
    """One plan (``fabric``, ``origin``, ``delta`` or ``full``) on fresh processes.

    The processes run inside the namespaces; with ``lr``, the trainer publishes training
    steps (`agent.TrainingSteps`).
    """
    deltas = {"delta": "auto", "full": "off"}.get(plan, "auto")
    agents: list[Agent] = []

    def start(name: str, dc: str) -> Agent:
        agent = Agent(name, prefix=_netns(dc), env={"WEIGHTFABRIC_HOST_ID": dc},
                      on_progress=on_progress, ready_timeout=None)
        agents.append(agent)
        return agent

    try:
        on_phase(f"{plan}: start processes")
        hub = start("hub", "dc-a")
        hub.reply(120)
        url = hub.ask("hub", host=ADDRESS["dc-a"],
                      ranking="origin" if plan == "origin" else "locality")["url"]
        placed = [("trainer", "dc-a"), ("rollout-a0", "dc-a"),
                  *((f"rollout-b{i}", "dc-b") for i in range(remote))]
        workers = {name: (start(name, dc), dc) for name, dc in placed}
        for agent, dc in workers.values():
            agent.reply(120)
            agent.ask("join", url=url, name=agent.name, location={"datacenter": dc},
                      host=ADDRESS[dc], chunk_size=chunk_size)
        trainer = workers["trainer"][0]
        rollouts = [a for name, (a, _) in workers.items() if name != "trainer"]
        rounds = []
        for v in range(versions):
            on_phase(f"{plan}: v{v + 1} publish")
            pub = trainer.ask("publish", size=size, seed=SEED, timeout=300,
                              **({} if lr is None else {"lr": lr}))
            served = int(trainer.ask("served")["bytes"])
            tx0, rx0 = wan_counters()
            on_phase(f"{plan}: v{v + 1} fetch")
            for r in rollouts:
                r.send("fetch", version=pub["version"], options={"deltas": deltas})
            fetched = {r.name: r.reply(600) for r in rollouts}
            tx1, rx1 = wan_counters()
            want = trainer.ask("digest", timeout=120)["sha256"]
            exact = all(r.ask("digest", timeout=120)["sha256"] == want for r in rollouts)
            model_bytes = int(pub["bytes"])
            rounds.append({
                "version": pub["version"], "bytes": model_bytes, "verified": exact,
                "wan_bytes": (tx1 - tx0) + (rx1 - rx0), "wan_bytes_a_to_b": tx1 - tx0,
                "wan_copies": (tx1 - tx0) / model_bytes,
                "trainer_egress_bytes": int(trainer.ask("served")["bytes"]) - served,
                "stall_seconds": {n: f["end"] - f["start"] for n, f in fetched.items()},
                "changed_fraction": pub.get("changed_fraction"),
                "wire_bytes": {n: f["wire_bytes"] for n, f in fetched.items()},
                "delta_chunks": {n: f["delta_chunks"] for n, f in fetched.items()},
                "sources": {n: f["sources"] for n, f in fetched.items()},
            })
    finally:
        close_all(agents)
    # the first version has no base to take deltas against: compare the later ones
    steady = rounds[1:] if lr is not None and len(rounds) > 1 else rounds
    remote_stalls = [s for r in steady for n, s in r["stall_seconds"].items() if "-b" in n]
    return {"plan": plan, "versions": rounds,
            "verified": all(r["verified"] for r in rounds),
            "wan_bytes_per_version": sum(r["wan_bytes"] for r in steady) / len(steady),
            "wan_copies_per_version": sum(r["wan_copies"] for r in steady) / len(steady),
            "max_remote_stall_seconds": max(remote_stalls),
            "mean_remote_stall_seconds": sum(remote_stalls) / len(remote_stalls)}


def bench_crossdc(*, remote: int, size: int, chunk_size: int, rate_bps: float, rtt_s: float,
                  versions: int, on_phase: Callable[[str], None] = lambda name: None,
                  on_progress: Callable[[str, int, int], None] | None = None,
                  lr: float | None = None) -> dict[str, Any]:
    """Both plans over one emulated WAN. See the module docstring.

    With ``lr`` (``--delta``) the plans are ``delta`` and ``full``, and the figures of
    each plan leave out its first version (no reader holds a base yet).

    Raises:
        ValueError: bad arguments.  RuntimeError: the benchmark cannot run here.
        AgentError: a process failed or timed out.
    """
    if remote < 1 or versions < 1:
        raise ValueError("--remote and --versions must be >= 1")
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    from weightfabric.fabric.arena import remove_stale_regions

    result: dict[str, Any] = {"remote": remote, "size": size, "chunk_size": chunk_size,
                              "rate_bytes_per_s": rate_bps, "rtt_s": rtt_s, "lr": lr}
    plans = PLANS if lr is None else DELTA_PLANS
    try:
        with wan(rate_bps=rate_bps, rtt_s=rtt_s) as shaped:
            result["wan"] = shaped
            for plan in plans:
                result[plan] = run_plan(plan, remote=remote, size=size, chunk_size=chunk_size,
                                        versions=versions, on_phase=on_phase,
                                        on_progress=on_progress, lr=lr)
    finally:
        remove_stale_regions()
    result["plans"] = list(plans)
    fab, org = result[plans[0]], result[plans[1]]
    result["verified"] = fab["verified"] and org["verified"]
    result["wan_bytes_ratio"] = org["wan_bytes_per_version"] / fab["wan_bytes_per_version"]
    result["stall_ratio"] = org["max_remote_stall_seconds"] / fab["max_remote_stall_seconds"]
    return result


def _run(args: argparse.Namespace) -> int:
    size, chunk = int(parse_size(args.size)), int(parse_size(args.chunk_size))
    rate, rtt = parse_bandwidth(args.rate), parse_latency(args.rtt)
    if skipped("fabric bench crossdc", as_json=args.json):
        return EXIT_OK
    console = Console(stderr=True)
    columns = (TextColumn("{task.description:<24}"), BarColumn(), TaskProgressColumn(),
               TimeElapsedColumn())
    with sigterm_unwinds(), Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        phase = progress.add_task("", total=None)
        bars: dict[str, TaskID] = {}

        def on_progress(name: str, done: int, total: int) -> None:
            if name not in bars:
                bars[name] = progress.add_task(name, total=total)
            progress.update(bars[name], completed=done)

        def on_phase(name: str) -> None:
            progress.update(phase, description=name)
            for task in bars.values():
                progress.update(task, completed=0)

        result = bench_crossdc(remote=args.remote, size=size, chunk_size=chunk,
                               rate_bps=rate, rtt_s=rtt, versions=args.versions,
                               on_phase=on_phase, on_progress=on_progress,
                               lr=args.lr if args.delta else None)
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench crossdc: {r['remote']} rollouts in dc-b, "
                        f"{r['size'] / 1e6:g} MB, WAN {r['rate_bytes_per_s'] * 8 / 1e9:g} Gbit/s, "
                        f"RTT {r['rtt_s'] * 1e3:g} ms")
    for col in ("plan", "WAN MB / version", "copies over WAN", "max remote stall s",
                "mean remote stall s", "bit-exact"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for plan in r["plans"]:
        p = r[plan]
        table.add_row(plan, f"{p['wan_bytes_per_version'] / 1e6:.1f}",
                      f"{p['wan_copies_per_version']:.2f}",
                      f"{p['max_remote_stall_seconds']:.2f}",
                      f"{p['mean_remote_stall_seconds']:.2f}",
                      "yes" if p["verified"] else "[red]NO[/red]")
    console.print(table)
    if not r["wan"]["rtt_emulated"] and r["rtt_s"] > 0:
        console.print(f"[yellow]note:[/yellow] this kernel has no sch_netem: the WAN is "
                      f"rate-limited with {r['wan']['qdisc']}, its {r['rtt_s'] * 1e3:g} ms RTT "
                      "is not emulated")
    first, second = r["plans"]
    console.print(f"{second} / {first}: WAN bytes {r['wan_bytes_ratio']:.2f}x, "
                  f"max remote stall {r['stall_ratio']:.2f}x")
