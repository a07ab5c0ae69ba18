"""What every `fabric` command shares: exit codes, registration, error handling.

A command module exposes ``register(subparsers)`` and adds its sub-commands with
`add_command`, which gives each the same help layout (a description, then an
``example(s):`` epilog) and records its handler. A handler is a function of the
parsed arguments that returns an exit code; instead of printing errors itself it
raises:

- `BadInput` (or a library error listed in the command's ``bad_input``): exit 2,
  with one line ``fabric COMMAND: error: MESSAGE`` on stderr;
- `CommandFailed` (or an error listed in ``failures``): exit 1, same format.

`run` calls the handler and turns those, Ctrl-C and a closed standard output into
exit codes, so ``fabric ... | head`` stops quietly and a stray traceback never
reaches the user.

Exit codes (`EXIT_*`): 0 success, 1 a check or the run failed, 2 bad input,
130 interrupted (Ctrl-C, 128 + SIGINT), 141 standard output closed early
(128 + SIGPIPE: what a shell reports for any program a pipe's reader stopped
reading, e.g. ``seq 1000000 | head``; the command stops writing at once).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import rich.console

EXIT_OK = 0
"""The command did what it was asked and every check passed."""
EXIT_FAILED = 1
"""A check failed, or the run did (a process died, a hub did not answer, ...)."""
EXIT_BAD_INPUT = 2
"""Bad options or input files; nothing ran (argparse exits with 2 too)."""
EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (128 + SIGINT)."""
EXIT_BROKEN_PIPE = 141
"""Standard output was closed before everything was written (128 + SIGPIPE)."""

EXIT_CODES_HELP = ("Exit codes: 0 success, 1 a check or the run failed, 2 bad input,\n"
                   "130 interrupted (Ctrl-C), 141 output closed early (e.g. '| head').")

Handler = Callable[[argparse.Namespace], int]


class Console(rich.console.Console):
    """The rich console commands print with.

    A closed pipe raises BrokenPipeError for `run` to handle (rich's own handling
    would exit 1 at once, skipping clean-up).
    """

    def on_broken_pipe(self) -> None:
        """Stop printing, and let `run` turn the closed pipe into exit 141."""
        self.quiet = True
        raise BrokenPipeError("standard output closed")


class BadInput(Exception):
    """Bad options or input: the command exits 2 with this message."""


class CommandFailed(Exception):
    """The run or one of its checks failed: the command exits 1 with this message."""


def add_command(subparsers: argparse._SubParsersAction, name: str, *, help: str,
                description: str, examples: Sequence[str], handler: Handler | None = None,
                bad_input: tuple[type[BaseException], ...] = (),
                failures: tuple[type[BaseException], ...] = ()) -> argparse.ArgumentParser:
    """Add a sub-command (or a group of them) to `subparsers`.

    Args:
        subparsers: what the parent's ``add_subparsers`` returned.
        name: the command's name.
        help: one line for the parent's list of commands.
        description: what the command does (printed as written: break lines by hand).
        examples: command lines shown under ``example:`` (``examples:`` if several).
        handler: runs the command (None for a group, whose sub-commands have one).
        bad_input: exception types that mean bad input: exit 2 with their message.
        failures: exception types that mean the run failed: exit 1 with their message.

    Returns:
        The new parser, for its arguments.
    """
    word = "example" if len(examples) == 1 else "examples"
    parser = subparsers.add_parser(
        name, help=help, description=description,
        epilog=f"{word}:\n" + "\n".join(f"  {line}" for line in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    if handler is not None:
        parser.set_defaults(handler=handler, command_prog=parser.prog,
                            command_bad_input=bad_input, command_failures=failures)
    return parser


def add_group(subparsers: argparse._SubParsersAction, name: str, *, help: str,
              description: str, examples: Sequence[str], metavar: str = "SUBCOMMAND",
              ) -> argparse._SubParsersAction:
    """Add a command group (``fabric NAME SUBCOMMAND``); returns its sub-parsers."""
    group = add_command(subparsers, name, help=help, description=description,
                        examples=examples)
    return group.add_subparsers(dest=f"{name}_command", metavar=metavar, required=True)


def cannot_write(path: object, exc: OSError) -> BadInput:
    """The bad-input error for an output file `path` that cannot be written."""
    return BadInput(f"cannot write {exc.filename or path}: {exc.strerror or exc}")


def error(command: str, message: object) -> None:
    """Print ``COMMAND: error: MESSAGE`` on stderr (argparse's format)."""
    print(f"{command}: error: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run the handler `add_command` recorded in `args`; returns the exit code.

    `BadInput`, `CommandFailed` and the command's own ``bad_input`` and ``failures``
    types become exit 2 and 1 with a one-line message; KeyboardInterrupt becomes
    130; a standard output closed early (BrokenPipeError) becomes 141, silently.
    """
    command = getattr(args, "command_prog", "fabric")
    try:
        try:
            code = args.handler(args)
        except (BadInput, *getattr(args, "command_bad_input", ())) as exc:
            error(command, exc)
            return EXIT_BAD_INPUT
        except (CommandFailed, *getattr(args, "command_failures", ())) as exc:
            error(command, exc)
            return EXIT_FAILED
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    """Point standard output at /dev/null.

    So that the interpreter's last flush of what is still buffered for the closed
    pipe does not raise again at exit.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (e.g. captured in a test)
        pass
