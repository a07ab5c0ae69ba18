"""What `import weightfabric` and the `fabric` commands that move no tensors load.

They start in well under a second (docs/performance.md, "CLI start-up") because
they import neither torch nor Triton, the kernels, the transports or networkx:
the package's heavy names load on first use, and each command's handler imports
what it needs when it runs. These tests check what each loads, in fresh processes,
without timing anything.
"""

from __future__ import annotations

import ast
import json
import select
import signal
import subprocess
import sys

import pytest
from paths import ROOT, child_env
from timeouts import hard_timeout

import weightfabric as wf
from weightfabric.tools.bench_cmd import BENCHMARKS
from weightfabric.tools.cli import COMMANDS, main

HEAVY = ("torch", "triton", "numpy", "networkx", "matplotlib", "weightfabric.kernels",
         "weightfabric.fabric.transports")
"""Packages whose import costs seconds (torch) or a good part of the budget."""

PROBE = f"""
import json, sys
def loaded(names):
    return sorted(n for n in names if n in sys.modules)
def report(code):
    sys.stdout.flush()
    print("\\nLOADED " + json.dumps(loaded({HEAVY!r} + ("weightfabric.tools.bench",))))
    sys.exit(code)
"""
"""Run before a child's code: ``report(code)`` prints what of `HEAVY` it loaded, then exits."""

CLUSTER = str(ROOT / "topology" / "clusters" / "two-datacenters.yaml")


@pytest.fixture(autouse=True)
def _time_limit():
    with hard_timeout(120):
        yield


def run_child(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `code` (after `PROBE`) in a fresh interpreter; returns it and what it loaded."""
    out = subprocess.run([sys.executable, "-c", PROBE + code], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=child_env(COLUMNS="120"))
    return out, _loaded(out.stdout, out.stderr)


def _loaded(stdout: str, stderr: str) -> list[str]:
    lines = [line for line in stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"the child reported nothing:\n{stdout}\n{stderr}"
    return json.loads(lines[-1].removeprefix("LOADED "))


def cli(*argv: str) -> str:
    """Child code: run ``fabric ARGV``, then report."""
    return f"from weightfabric.tools.cli import main\nreport(main({list(argv)!r}))"


# ------------------------------------------------------------------ the package


def test_import_weightfabric_loads_nothing_heavy() -> None:
    out, loaded = run_child("import weightfabric\nreport(0)")
    assert out.returncode == 0, out.stderr
    assert loaded == []


def test_every_public_name_resolves_to_its_module_s_object_and_is_listed() -> None:
    code = """
import importlib
import weightfabric as wf
assert set(wf.__all__) <= set(dir(wf)), set(wf.__all__) - set(dir(wf))  # before any is loaded
for name in wf.__all__:
    value = getattr(wf, name)
    if name in wf._LAZY:
        assert value is getattr(importlib.import_module(wf._LAZY[name]), name), name
assert set(wf.__all__) <= set(dir(wf))
from weightfabric import FetchOptions, ModelStore, join, serve  # from-imports resolve too
assert ModelStore is wf.ModelStore and join is wf.join and serve is wf.fabric.hub.serve
assert FetchOptions is importlib.import_module("weightfabric.fabric.fetch").FetchOptions
assert not hasattr(wf, "no_such_name")
report(0)
"""
    out, loaded = run_child(code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in loaded  # the names did load their modules


def test_the_lazy_names_are_the_ones_type_checkers_see() -> None:
    tree = ast.parse((ROOT / "__init__.py").read_text())
    [block] = [node for node in tree.body if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    seen = {alias.asname or alias.name for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == set(wf._LAZY) - {"vllm"}  # vllm: a module, typed as such
    assert seen <= set(wf.__all__)


# ------------------------------------------------------------------ the parser


def _help_paths() -> list[list[str]]:
    """Every command and sub-command of `fabric`, as the words that name it."""
    import argparse

    from weightfabric.tools.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])

    return list(walk(build_parser(), []))


def test_every_help_loads_nothing_heavy() -> None:
    paths = _help_paths()
    assert ["bench", "kernels"] in paths and ["hub", "token"] in paths and ["topo", "show"] in paths
    code = f"""
import contextlib, io
from weightfabric.tools.cli import build_parser, main
build_parser()
for path in {paths!r}:
    with contextlib.redirect_stdout(io.StringIO()) as text:
        try:
            main([*path, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, (path, exc.code)
    assert "usage: fabric" in text.getvalue(), path
report(0)
"""
    out, loaded = run_child(code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert loaded == ["weightfabric.tools.bench"]  # the benchmarks' modules, light ones


def test_benchmarks_lists_every_bench_module_that_registers_a_command() -> None:
    registering = sorted(
        path.stem for path in (ROOT / "tools" / "bench").glob("*.py")
        if any(isinstance(node, ast.FunctionDef) and node.name == "register"
               for node in ast.parse(path.read_text()).body))
    assert sorted(BENCHMARKS) == registering


def test_an_unknown_command_still_gets_the_full_list(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["hbu", "status"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'hbu'" in err and all(f"'{name}'" in err for name in COMMANDS)


# ------------------------------------------------------------------ light commands


@pytest.mark.parametrize("argv", [["topo", "validate", CLUSTER], ["topo", "show", CLUSTER],
                                  ["topo", "show", CLUSTER, "--json"],
                                  ["hub", "token", "--role", "read", "--name", "rollouts"]],
                         ids=["topo validate", "topo show", "topo show --json", "hub token"])
def test_light_commands_load_nothing_heavy(argv) -> None:
    out, loaded = run_child(cli(*argv))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert loaded == []  # not even the benchmarks' modules: main registers the one command


def test_hub_serve_and_status_load_no_torch() -> None:
    serve = subprocess.Popen(
        [sys.executable, "-c", PROBE + cli("hub", "serve", "--port", "0", "--log-level",
                                           "WARNING")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    try:
        ready, _, _ = select.select([serve.stdout], [], [], 60)
        assert ready, "fabric hub serve printed nothing within 60 s"
        line = serve.stdout.readline()
        assert line.startswith("fabric hub serving at tcp://127.0.0.1:"), line
        url = line.split()[-1]

        out, loaded = run_child(cli("hub", "status", url))
        assert out.returncode == 0, out.stderr
        assert "0 models, 0 workers" in out.stdout
        assert loaded == []

        out, loaded = run_child(cli("hub", "status", url, "--json"))
        assert out.returncode == 0, out.stderr
        assert loaded == []
    finally:
        serve.send_signal(signal.SIGTERM)
        stdout, stderr = serve.communicate(timeout=30)
    assert serve.returncode == 0, stderr
    # The hub plans and ranks with networkx (and numpy); it moves no tensors.
    assert set(_loaded(stdout, stderr)) <= {"networkx", "numpy"}
