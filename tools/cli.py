"""The `fabric` command line: one entry point, one module per command group.

Each command module in `COMMAND_MODULES` exposes ``register(subparsers)``, which
adds its sub-command(s) with `tools.command.add_command`; `main` parses the
arguments and runs the chosen handler through `tools.command.run` (exit codes,
error messages, Ctrl-C and closed pipes, in one place).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import weightfabric as wf
from weightfabric.tools.command import (  # noqa: F401 (re-exported: the exit codes' old home)
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    run,
)

COMMAND_MODULES = ["weightfabric.tools.demo_cmd", "weightfabric.tools.topo_cmd",
                   "weightfabric.tools.layout_cmd",
                   "weightfabric.tools.bench_cmd", "weightfabric.tools.hub_cmd"]


def build_parser() -> argparse.ArgumentParser:
    """The `fabric` parser with every command module's sub-commands."""
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="weightfabric: move every new version of the weights from the trainer to\n"
                    "every rollout worker, peer to peer, along the cluster's topology.",
        epilog="Run 'fabric COMMAND --help' for the options and an example of each command.\n"
               f"{EXIT_CODES_HELP}\n\n"
               "example:\n  fabric demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"weightfabric {wf.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `fabric` CLI; returns the process exit code (see `tools.command`)."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
