"""Where the tests find the repository, their helper scripts and fixtures."""

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process, with tests/ first on its PYTHONPATH.

    tests/ holds the helper modules; ``weightfabric`` comes from wherever this
    process found it.
    """
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, **extra,
            "PYTHONPATH": os.pathsep.join([str(TESTS), *([path] if path else [])])}
