"""A hard time limit for tests that start processes or servers."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def hard_timeout(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the main thread after `seconds`.

    So a stuck test fails and still runs its `finally` clean-up instead of hanging
    the suite.
    """
    def expired(*_: object) -> None:
        raise TimeoutError(f"test exceeded {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
