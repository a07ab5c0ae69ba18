"""Hub clients in their own processes: roles ``publisher``, ``reader``, ``hub-holder``.

Usage: ``procs.Child("publisher", URL, WORKER, MODEL, COUNT, wait=False)``, or
``python tests/procs.py ROLE URL ARGS...``; ``python tests/hub_child.py ROLE URL
ARGS...`` is the same (``holder`` for ``hub-holder``). Each prints one JSON line:

- ``publisher URL WORKER MODEL COUNT``: publishes and commits COUNT versions, replies
  ``{"ready": true, "versions": [...]}`` and stays a source until ``exit`` or the end
  of its commands (the parent closing stdin);
- ``reader URL WORKER MODEL COUNT``: fetches (as far as the hub knows) the next COUNT
  versions as they come, replies ``{"ready": true, "got": [...]}`` and exits;
- ``hub-holder URL WORKER MODEL``: publishes one version, replies ``{"ready": V}``
  and holds it until killed, ``exit`` or the end of its commands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hub_helpers import small_manifest

import weightfabric as wf
from weightfabric.fabric.errors import WaitTimeoutError

Commands = Iterator[dict[str, Any]]
Reply = Callable[[dict[str, Any]], None]


def _idle(commands: Commands, reply: Reply) -> None:
    """Answer every command with an error until ``exit`` or the end of the commands."""
    for cmd in commands:
        reply({"error": "ValueError", "message": f"unknown op {cmd.get('op')!r}"})


def publisher(args: list[str], commands: Commands, reply: Reply) -> None:
    """Publish COUNT versions of MODEL as WORKER, then stay a source (see the module)."""
    url, worker, model, count = args[0], args[1], args[2], int(args[3])
    c = wf.connect(url, worker=worker, timeout=10)
    c.set_retention(model, keep_last=count, min_replicas=0)
    versions = []
    for _ in range(count):
        v = c.begin_publish(model, small_manifest(tag=model))
        c.commit(model, v)
        versions.append(v)
    reply({"ready": True, "versions": versions})
    _idle(commands, reply)  # a source until the readers are done
    c.close()


def reader(args: list[str], commands: Commands, reply: Reply) -> None:
    """Fetch the next COUNT versions of MODEL as WORKER (see the module)."""
    url, worker, model, count = args[0], args[1], args[2], int(args[3])
    c = wf.connect(url, worker=worker, timeout=10)
    got, seen = [], 0
    while len(got) < count:
        try:
            v = c.wait_version(model, after=seen, timeout=20)
        except WaitTimeoutError:
            break
        plan = c.begin_fetch(model, v)
        c.report_progress(plan.fetch_id, plan.chunks())
        c.complete_fetch(plan.fetch_id)
        got.append(v)
        seen = v
    reply({"ready": True, "got": got})
    c.close()


def holder(args: list[str], commands: Commands, reply: Reply) -> None:
    """Publish one version of MODEL as WORKER and hold it (see the module)."""
    url, worker, model = args[0], args[1], args[2]
    c = wf.connect(url, worker=worker, timeout=10)
    v = c.begin_publish(model, small_manifest())
    c.commit(model, v)
    reply({"ready": v})
    _idle(commands, reply)
    c.close()


if __name__ == "__main__":
    import sys

    import procs

    role, *rest = sys.argv[1:]
    sys.exit(procs.main(["hub-holder" if role == "holder" else role, *rest]))
