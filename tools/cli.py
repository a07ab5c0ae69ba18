"""The `fabric` command line: one entry point, one module per command group.

Each command module in `COMMAND_MODULES` exposes ``register(subparsers)``, which
adds its sub-command(s) and sets ``handler`` (a function of the parsed args that
returns the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import weightfabric as wf

COMMAND_MODULES = ["weightfabric.tools.demo_cmd", "weightfabric.tools.topo_cmd", "weightfabric.tools.bench_cmd", "weightfabric.tools.hub_cmd"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="weightfabric: move every new version of the weights from the trainer to\n"
                    "every rollout worker, peer to peer, along the cluster's topology.",
        epilog="Run 'fabric COMMAND --help' for the options and an example of each command.\n"
               "Exit codes: 0 success, 1 a check or the run failed, 2 bad input,\n"
               "130 interrupted (Ctrl-C).\n\n"
               "example:\n  fabric demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"weightfabric {wf.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `fabric` CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
