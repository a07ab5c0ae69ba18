"""Child process roles for the multi-process hub tests: ``python hub_child.py ROLE URL ...``.

Each role prints one JSON line with its result (or "ready" lines the parent waits for).
"""

from __future__ import annotations

import json
import sys
import time

from hub_helpers import small_manifest

import weightfabric as wf
from weightfabric.fabric.errors import WaitTimeoutError


def publisher(url: str, worker: str, model: str, count: int) -> None:
    c = wf.connect(url, worker=worker, timeout=10)
    c.set_retention(model, keep_last=count, min_replicas=0)
    versions = []
    for _ in range(count):
        v = c.begin_publish(model, small_manifest(tag=model))
        c.commit(model, v)
        versions.append(v)
    print(json.dumps({"versions": versions}), flush=True)
    # Stay a source until the readers are done (the parent closes stdin).
    sys.stdin.read()
    c.close()


def reader(url: str, worker: str, model: str, count: int) -> None:
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
    print(json.dumps({"got": got}), flush=True)
    c.close()


def holder(url: str, worker: str, model: str) -> None:
    c = wf.connect(url, worker=worker, timeout=10)
    v = c.begin_publish(model, small_manifest())
    c.commit(model, v)
    print(json.dumps({"ready": v}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    role, url, *rest = sys.argv[1:]
    {"publisher": lambda: publisher(url, rest[0], rest[1], int(rest[2])),
     "reader": lambda: reader(url, rest[0], rest[1], int(rest[2])),
     "holder": lambda: holder(url, rest[0], rest[1])}[role]()
