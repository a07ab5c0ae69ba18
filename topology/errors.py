"""Errors of the topology package."""

from __future__ import annotations


class ClusterConfigError(ValueError):
    """A cluster description is invalid.

    The message reads ``file:line: field: what is wrong`` so that editors and
    terminals can jump to the offending line.

    Attributes:
        source: the file (or ``<string>``) the description came from.
        line: 1-based line number, or None when the position is unknown.
        field: dotted path of the offending field, e.g. ``node_types.dgx.nics.bandwidth``.
        problem: what is wrong, in words.
    """

    def __init__(self, problem: str, *, source: str = "<string>", line: int | None = None,
                 field: str = "") -> None:
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")
