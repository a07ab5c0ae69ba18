"""`fabric bench ...`: benchmarks, one module each under `tools.bench`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from weightfabric.tools import bench as bench_package
from weightfabric.tools.command import add_group


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench` and every benchmark module's sub-command."""
    sub = add_group(
        subparsers, "bench", help="benchmarks (numbers go to docs/benchmarks.md)",
        description="Benchmarks of the fabric's parts, each beside the baseline users have "
                    "today.\nResults print as a table, or as JSON with --json; "
                    "'fabric bench BENCHMARK --help'\nsays what each measures.",
        examples=["fabric bench fetch --readers 4 --size 1GB --json",
                  "fabric bench planner --max-gpus 1024"],
        metavar="BENCHMARK")
    for info in sorted(pkgutil.iter_modules(bench_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"weightfabric.tools.bench.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
