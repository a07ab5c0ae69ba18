"""`fabric demo`: the main job, on an embedded local hub."""

from __future__ import annotations

import argparse
import json

from weightfabric.tools.command import EXIT_FAILED, EXIT_OK, BadInput, Console, add_command
from weightfabric.topology.units import UnitError, parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric demo`."""
    p = add_command(
        subparsers, "demo", help="trainer + rollouts exchanging real weights over the fabric",
        handler=_demo,
        description="Start a hub, a trainer and rollout processes on this machine (CPU).\n"
                    "The trainer runs a short RL loop on a small Llama-shaped model and\n"
                    "publishes a version every step; rollouts fetch it from each other,\n"
                    "generate, and send samples back. One rollout is killed mid-fetch (at\n"
                    "version 2, if there are 2 or more) and a new one joins (at version 3).\n"
                    "Ends with a summary and checks that every rollout's logits equal the\n"
                    "trainer's at every version; exits 1 if any check fails, 2 on bad options.",
        examples=["fabric demo", "fabric demo --workers 5 --steps 10 --size medium",
                  "fabric demo --json | jq .versions"])
    p.add_argument("--workers", type=int, default=3, help="rollouts at the start (default 3)")
    p.add_argument("--steps", type=int, default=6, help="training steps = versions (default 6)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium"],
                   help="model size: tiny ~0.1M, small ~3M, medium ~25M parameters "
                        "(default small)")
    p.add_argument("--chunk-size", help="transfer chunk size, a multiple of 256 bytes "
                                        "(default: about 1/16 of the model, at most 1MiB)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="the trainer's Adam learning rate (default 3e-3: the reward climbs, and "
                        "most bf16 values change per version; 3e-6 changes about 2-5 %%, as in "
                        "large RL runs, and the reward stays at chance)")
    p.add_argument("--no-kill", action="store_true", help="do not kill a rollout mid-fetch")
    p.add_argument("--no-join", action="store_true", help="do not add a rollout mid-run")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON (keys: ok, checks, seconds, versions, "
                        "rollouts, killed, joined, logits_match, errors); progress goes to "
                        "stderr")


def _demo(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from weightfabric.tools.demo.orchestrator import (
        Demo,
        DemoConfig,
        DemoFailure,
        default_chunk_size,
    )
    from weightfabric.tools.demo.report import print_summary

    try:  # only the options' errors are bad input: a ValueError of the run is a failure
        config = DemoConfig(workers=args.workers, steps=args.steps, size=args.size,
                            chunk_size=default_chunk_size(args.size) if args.chunk_size is None
                            else int(parse_size(args.chunk_size)),
                            kill_step=None if args.no_kill or args.steps < 2 or args.workers < 2
                            else 2,
                            join_step=None if args.no_join or args.steps < 3 else 3,
                            lr=args.lr)
    except (UnitError, ValueError) as exc:
        raise BadInput(exc) from exc
    console = Console(stderr=args.json)
    with Progress(TextColumn("[bold]demo"), BarColumn(), TextColumn("step {task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("steps", total=config.steps)
        demo = Demo(config, log=progress.console.log,
                    on_step=lambda step: progress.update(task, completed=step))
        try:
            out = demo.run()
        except DemoFailure as exc:
            progress.console.print(f"[bold red]demo failed:[/] {exc}")
            return EXIT_FAILED
    if args.json:
        print(json.dumps(out, indent=2))
        failed = [name for name, passed in out["checks"].items() if not passed]
        if failed:  # stdout is for the JSON; say on stderr what failed
            console.print(f"[bold red]demo failed its checks:[/] {', '.join(failed)}")
    else:
        print_summary(out, console)
    return EXIT_OK if out["ok"] else EXIT_FAILED
