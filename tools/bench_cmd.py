"""`fabric bench ...`: benchmarks, one module each under `tools.bench`."""

from __future__ import annotations

import argparse
import importlib

from weightfabric.tools.command import add_group

BENCHMARKS = ("cluster", "crossdc", "delta", "e2e", "failover", "fetch", "hub", "kernels",
              "layouts", "planner", "reshard", "rollout", "stall", "tls", "vllm")
"""The modules of `tools.bench` that define ``register(subparsers)``, in help order.

Only these are imported to build the parser (the package's other modules, e.g. the
agents the benchmarks start, import torch); each imports nothing heavy before its
handler runs, so that ``fabric bench NAME --help`` answers at once.
"""


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
    for name in BENCHMARKS:
        importlib.import_module(f"weightfabric.tools.bench.{name}").register(sub)
