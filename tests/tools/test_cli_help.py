"""Every `fabric` command's --help says what it does, documents each option, shows an example.

Bad options exit 2 before anything runs.
"""

from __future__ import annotations

import argparse

import pytest

from weightfabric.tools.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


# `fabric topo ...` is checked in test_cli_topo.py.
COMMANDS = [(path, p) for path, p in _commands(build_parser()) if path[:1] != ("topo",)]


@pytest.mark.parametrize("path, parser", COMMANDS, ids=[" ".join(p) or "fabric" for p, _ in COMMANDS])
def test_help_has_a_description_an_example_and_every_option_explained(path, parser) -> None:
    text = parser.format_help()
    assert parser.description, f"fabric {' '.join(path)} --help has no description"
    assert "example" in text.lower(), f"fabric {' '.join(path)} --help has no example"
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            assert action.help, f"fabric {' '.join(path)}: {action.option_strings} has no help"


@pytest.mark.parametrize("argv", [
    ["bench", "fetch", "--max-inflight", "0"],
    ["bench", "hub", "--readers", "0"],
    ["bench", "hub", "--seconds", "0"],
    ["bench", "kernels", "--repeat", "0"],
    ["bench", "kernels", "--device", "nonsense"],
])
def test_bench_rejects_bad_options_with_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"fabric bench {argv[1]}: ")
