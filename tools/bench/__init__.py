"""Benchmarks behind `fabric bench NAME`.

Every module of this package that defines ``register(subparsers)`` becomes a
sub-command of `fabric bench`; add a benchmark by adding a module.
"""
