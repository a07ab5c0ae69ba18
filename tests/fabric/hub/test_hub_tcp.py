"""Several processes against a hub over loopback TCP: concurrency, SIGKILL, hub restart."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_helpers import kill_all, small_manifest
from paths import ROOT as REPO_ROOT
from paths import TESTS, child_env
from timeouts import hard_timeout

import weightfabric as wf
from weightfabric.fabric.errors import NoSourceError, UnknownVersionError, WaitTimeoutError

CHILD = str(TESTS / "hub_child.py")
HARD_TIMEOUT_S = 90


@pytest.fixture(autouse=True)
def _time_limit():
    with hard_timeout(HARD_TIMEOUT_S):
        yield


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of a child, or fail after ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child {proc.args} printed nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child {proc.args} exited early with {proc.wait()}")
    return line


def start_hub(procs: list, *, port: int = 0, state_dir: Path | None = None,
              lease: float = 1.0) -> str:
    cmd = [sys.executable, "-m", "weightfabric.tools", "hub", "serve", "--port", str(port),
           "--lease", str(lease), "--log-level", "WARNING"]
    if state_dir is not None:
        cmd += ["--state-dir", str(state_dir)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env(),
                         cwd=REPO_ROOT)
    procs.append(p)
    line = read_line(p, 30)
    assert line.startswith("fabric hub serving at "), line
    return line.split()[-1]


def spawn(procs: list, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=child_env())
    procs.append(p)
    return p


def test_concurrent_publishers_and_readers() -> None:
    procs: list[subprocess.Popen] = []
    try:
        url = start_hub(procs, lease=3.0)
        pubs = [spawn(procs, "publisher", url, f"trainer-{m}", m, "3") for m in ("a", "b")]
        readers = [spawn(procs, "reader", url, f"r{i}-{m}", m, "1") for i in range(3)
                   for m in ("a", "b")]
        versions = {m: json.loads(read_line(p, 60))["versions"] for m, p in zip("ab", pubs,
                                                                                 strict=True)}
        for m, vs in versions.items():
            assert vs == sorted(vs) and len(set(vs)) == 3, (m, vs)
        for p in readers:
            got = json.loads(read_line(p, 60))["got"]
            assert len(got) == 1 and got[0] in versions["a"] + versions["b"]
        with wf.connect(url, timeout=5) as obs:
            snap = obs.status()
            for m in "ab":
                assert obs.latest(m) == versions[m][-1]
                full = sum(v["full"] for v in snap["models"][m]["versions"])
                assert full >= 1 + 3 - sum(1 for v in snap["models"][m]["versions"]
                                           if v["state"] == "retired")
        for p in pubs:
            p.stdin.close()
            assert p.wait(20) == 0
    finally:
        kill_all(procs)


def test_sigkilled_client_loses_replicas_after_lease() -> None:
    procs: list[subprocess.Popen] = []
    try:
        url = start_hub(procs, lease=1.0)
        holder = spawn(procs, "holder", url, "victim", "policy")
        v = json.loads(read_line(holder, 30))["ready"]
        with wf.connect(url, worker="reader", timeout=5) as r:
            assert r.latest("policy") == v
            plan = r.begin_fetch("policy", v)
            assert plan.ranges[0].sources == ("victim",)
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
            # wait_version long-polls; the lease (1 s) ends well within this bound.
            deadline = time.monotonic() + 10
            while r.latest("policy") is not None:
                assert time.monotonic() < deadline, "replicas of the killed worker stayed"
                with contextlib.suppress(WaitTimeoutError):
                    r.wait_version("policy", after=v, timeout=0.5)
            r.heartbeat()                      # news reach the reader by heartbeat
            assert r.lost.get(plan.fetch_id) == {"victim"}
            with pytest.raises(NoSourceError):
                r.replan(plan.fetch_id)
            with pytest.raises(UnknownVersionError):
                r.begin_fetch("policy", "latest")
    finally:
        kill_all(procs)


def test_hub_restart_with_state_dir_continues_versions(tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    try:
        url = start_hub(procs, state_dir=tmp_path, lease=5.0)
        port = int(url.rsplit(":", 1)[1])
        with wf.connect(url, worker="trainer", timeout=20) as t:
            v1 = t.begin_publish("policy", small_manifest())
            t.commit("policy", v1)
            v2 = t.begin_publish("policy", small_manifest())
            t.commit("policy", v2)
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(10)
            start_hub(procs, port=port, state_dir=tmp_path, lease=5.0)
            # The client notices the new hub, re-registers what it holds, and goes on.
            assert t.latest("policy") in (None, v2)
            v3 = t.begin_publish("policy", small_manifest())
            assert v3 == v2 + 1
            assert t.latest("policy") == v2       # restored from the trainer's holdings
            t.commit("policy", v3)
            assert t.latest("policy") == v3
    finally:
        kill_all(procs)


def test_hub_restart_without_state_dir_still_never_reuses_held_versions() -> None:
    procs: list[subprocess.Popen] = []
    try:
        url = start_hub(procs, lease=5.0)
        port = int(url.rsplit(":", 1)[1])
        with wf.connect(url, worker="trainer", timeout=20) as t:
            vs = []
            for _ in range(3):
                vs.append(t.begin_publish("policy", small_manifest()))
                t.commit("policy", vs[-1])
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(10)
            start_hub(procs, port=port, lease=5.0)
            t.heartbeat()                      # triggers the transparent re-registration
            assert t.begin_publish("policy", small_manifest()) > vs[-1]
    finally:
        kill_all(procs)
