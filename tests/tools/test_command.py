"""`tools.command`: how a handler's outcome becomes an exit code and a message."""

from __future__ import annotations

import argparse

import pytest

from weightfabric.tools.command import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BadInput,
    CommandFailed,
    add_command,
    run,
)


class LibraryError(Exception):
    """An error type a command declares as bad input."""


def parse(handler, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fabric")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(sub, "thing", help="h", description="d", examples=["fabric thing"],
                handler=handler, **kw)
    return parser.parse_args(["thing"])


def raising(exc: BaseException):
    def handler(args: argparse.Namespace) -> int:
        raise exc
    return handler


@pytest.mark.parametrize("exc, code", [
    (BadInput("no such file"), EXIT_BAD_INPUT),
    (LibraryError("no such file"), EXIT_BAD_INPUT),
    (CommandFailed("no such file"), EXIT_FAILED),
    (TimeoutError("no such file"), EXIT_FAILED),
])
def test_typed_errors_become_exit_codes_with_one_line(exc, code, capsys) -> None:
    args = parse(raising(exc), bad_input=(LibraryError,), failures=(TimeoutError,))
    assert run(args) == code
    assert capsys.readouterr().err == "fabric thing: error: no such file\n"


def test_interrupt_and_a_closed_pipe(capsys) -> None:
    assert run(parse(raising(KeyboardInterrupt()))) == EXIT_INTERRUPTED == 130
    assert run(parse(raising(BrokenPipeError()))) == EXIT_BROKEN_PIPE == 141
    assert run(parse(lambda args: EXIT_OK)) == 0


def test_an_undeclared_error_is_not_hidden() -> None:
    with pytest.raises(ValueError):
        run(parse(raising(ValueError("a bug"))))


def test_help_lists_the_examples() -> None:
    parser = argparse.ArgumentParser(prog="fabric")
    sub = parser.add_subparsers(dest="command")
    one = add_command(sub, "a", help="h", description="d", examples=["fabric a"])
    two = add_command(sub, "b", help="h", description="d", examples=["fabric b", "fabric b -x"])
    assert "example:\n  fabric a" in one.format_help()
    assert "examples:\n  fabric b\n  fabric b -x" in two.format_help()
