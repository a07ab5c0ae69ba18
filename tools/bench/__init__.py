"""Benchmarks behind `fabric bench NAME`.

Each module listed in `tools.bench_cmd.BENCHMARKS` defines ``register(subparsers)``
and becomes a sub-command of `fabric bench`; add a benchmark by adding a module and
its name there. Such a module imports nothing heavy (torch, the kernels, the
transports, networkx) at its top: its handler does, so that `fabric bench --help`
stays fast (tests/tools/test_cli_imports.py checks both).
"""
