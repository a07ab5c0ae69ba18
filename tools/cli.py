"""The `fabric` command line: one entry point, one module per command group.

Each command module in `COMMANDS` exposes ``register(subparsers)``, which adds
its sub-command(s) with `tools.command.add_command`; `main` parses the arguments
and runs the chosen handler through `tools.command.run` (exit codes, error
messages, Ctrl-C and closed pipes, in one place).

Start-up is kept short (docs/performance.md, "CLI start-up"): registering a command
imports nothing heavy (torch, the kernels, networkx: each handler imports what it
needs when it runs), and `main` registers only the command it runs, when the
arguments name one, so that e.g. `fabric hub status` does not even load the
benchmarks' modules. tests/tools/test_cli_imports.py checks both.
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

COMMANDS = {"demo": "weightfabric.tools.demo_cmd", "topo": "weightfabric.tools.topo_cmd",
            "layout": "weightfabric.tools.layout_cmd", "bench": "weightfabric.tools.bench_cmd",
            "hub": "weightfabric.tools.hub_cmd"}
"""Each command, in help order, and the module that registers it (and its sub-commands)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `fabric` parser with every command module's sub-commands.

    Args:
        command: a key of `COMMANDS` to register that command alone (what running it
            needs); None registers them all (``fabric --help`` lists them).
    """
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
    for name, module in COMMANDS.items():
        if command in (None, name):
            importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `fabric` CLI; returns the process exit code (see `tools.command`)."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args and args[0] in COMMANDS else None  # else: the full parser's error
    return run(build_parser(command).parse_args(args))


if __name__ == "__main__":
    sys.exit(main())
