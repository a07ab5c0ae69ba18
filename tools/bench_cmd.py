"""`fabric bench ...`: benchmarks, one module each under `tools.bench`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import tools.bench


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks (numbers go to docs/benchmarks.md)",
        description="Benchmarks of the fabric's parts, each beside the baseline users have "
                    "today. Results print as a table, or as JSON with --json.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for info in sorted(pkgutil.iter_modules(tools.bench.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"tools.bench.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
