"""`fabric hub serve` and `fabric hub status` as a person runs them (subprocesses)."""

from __future__ import annotations

import io
import json
import select
import signal
import subprocess
import sys

import pytest
from hub_helpers import kill_all, small_manifest
from paths import ROOT as REPO_ROOT
from paths import child_env
from rich.console import Console
from timeouts import hard_timeout

import weightfabric as wf
from weightfabric.tools.command import EXIT_BROKEN_PIPE
from weightfabric.tools.hub_cmd import render_status

HARD_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _time_limit():
    with hard_timeout(HARD_TIMEOUT_S):
        yield


def fabric_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightfabric.tools", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT,
                          env={**child_env(), "COLUMNS": "200"})


def start_serve(procs: list[subprocess.Popen]) -> str:
    """`fabric hub serve --port 0`; returns the URL it prints once bound (no sleeps)."""
    return start_cli(procs, "serve", "--lease", "30", says="fabric hub serving at")


def start_cli(procs: list[subprocess.Popen], command: str, *args: str, says: str) -> str:
    """`fabric hub COMMAND --port 0 ARGS`; the URL it prints after ``says`` once bound."""
    p = subprocess.Popen([sys.executable, "-m", "weightfabric.tools", "hub", command,
                          "--port", "0", *args, "--log-level", "WARNING"],
                         stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO_ROOT)
    procs.append(p)
    ready, _, _ = select.select([p.stdout], [], [], 30)
    assert ready, f"fabric hub {command} printed nothing within 30 s"
    line = p.stdout.readline()
    assert line.startswith(f"{says} tcp://127.0.0.1:"), line
    return line.split()[-1]


@pytest.mark.hub(lease_s=30.0)
def test_status_shows_versions_fetches_and_leases_as_table_and_json(hub, workers) -> None:
    t = workers.connect("trainer", location={"datacenter": "dc1", "node": "n1"}, timeout=5)
    r = workers.connect("rollout-7", location={"datacenter": "dc2"}, timeout=5)
    v1 = t.begin_publish("policy", small_manifest())
    t.commit("policy", v1)
    v2 = t.begin_publish("policy", small_manifest())
    plan = r.begin_fetch("policy", v1)
    r.report_progress(plan.fetch_id, [0, 1])

    out = fabric_cli("hub", "status", hub.url, "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    policy = snap["models"]["policy"]
    assert policy["latest"] == v1
    assert {v["version"]: (v["state"], v["full"], v["partial"])
            for v in policy["versions"]} == {v1: ("committed", 1, 1),
                                              v2: ("publishing", 0, 1)}
    assert [(f["fetch_id"], f["worker"], f["have"], f["num_chunks"], f["sources"])
            for f in snap["fetches"]] == [(plan.fetch_id, "rollout-7", 2, 4, ["trainer"])]
    assert {w["worker"] for w in snap["workers"]} == {"trainer", "rollout-7"}
    assert all(0 < w["expires_in"] <= 30 for w in snap["workers"])

    out = fabric_cli("hub", "status", hub.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "2 workers, 1 fetches in flight" in text
    assert f"{v1}*" in text and "committed" in text and "publishing" in text
    assert plan.fetch_id in text and "2/4 (50%)" in text
    assert "rollout-7" in text and "dc2" in text and "n1" in text


def test_status_shows_the_traffic_of_recent_fetches(hub, workers) -> None:
    t = workers.connect("trainer", timeout=5)
    r = workers.connect("rollout-7", timeout=5)
    v1 = t.begin_publish("policy", small_manifest())
    t.commit("policy", v1)
    plan = r.begin_fetch("policy", v1)
    r.report_progress(plan.fetch_id, [0, 1, 2, 3])
    r.complete_fetch(plan.fetch_id, traffic={"trainer": [4_000_000, 250_000],
                                             "bogus": [-1, 5], "short": [7]})
    out = fabric_cli("hub", "status", hub.url, "--json")
    assert out.returncode == 0, out.stderr
    [recent] = json.loads(out.stdout)["recent_fetches"]
    assert recent == {"worker": "rollout-7", "model": "policy", "version": v1, "shard": 0,
                      "delivered": 4_000_000, "wire": 250_000,
                      "sources": {"trainer": [4_000_000, 250_000]}}  # nonsense dropped
    text = fabric_cli("hub", "status", hub.url).stdout
    assert "recent fetches" in text and "trainer 4.0/0.2" in text and "0.062" in text


def column_text(table: str, column: int) -> str:
    """The cells of `column` (0 = the first) of a rich table's body rows, joined."""
    return "".join(line.split("│")[column + 1].strip() for line in table.splitlines()
                   if line.count("│") > column + 1)


@pytest.mark.parametrize("width", [200, 80, 50])
def test_status_table_shows_long_model_and_worker_names_whole(width) -> None:
    """A name wider than its column wraps inside it, whole: never cut, never '…'."""
    model = "org-" + "x" * 30 + "/llama-3-70b-instruct-rl-run-" + "7" * 17  # 80 characters
    worker = "rollout-" + "w" * 60
    assert len(model) == 80
    snap = {"lease_s": 10.0, "fetches": [],
            "models": {model: {"latest": 3, "retired": [], "versions": [
                {"version": 3, "state": "committed", "num_shards": 1, "full": 1, "partial": 0,
                 "retracting": 0, "pinned": False, "retained": True, "reason": ""}]}},
            "workers": [{"worker": worker, "expires_in": 9.5,
                         "location": {"datacenter": "dc1", "node": "n1", "device": "cpu"}}]}
    buf = io.StringIO()
    render_status(snap, Console(file=buf, width=width, color_system=None))
    text = buf.getvalue()
    assert "…" not in text
    versions, leases = text.split("leases")
    assert column_text(versions, 0) == model
    assert column_text(leases, 0) == worker


def test_status_piped_into_head_exits_quietly(hub, workers) -> None:
    """`fabric hub status URL | head -1`.

    The reader closes the pipe after one line; the command stops with exit 141 (128 +
    SIGPIPE, as a shell reports for any program killed by it) and no traceback, for the
    table and for --json.
    """
    t = workers.connect("trainer", timeout=5)
    for i in range(400):  # some 100 KB of table: more than a pipe holds (64 KiB)
        name = f"model-{i:03d}-" + "x" * 60
        t.commit(name, t.begin_publish(name, small_manifest()))
    for extra in ([], ["--json"]):
        p = subprocess.Popen([sys.executable, "-m", "weightfabric.tools", "hub", "status",
                              hub.url, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=REPO_ROOT, env={**child_env(), "COLUMNS": "200"})
        try:
            ready, _, _ = select.select([p.stdout], [], [], 30)
            assert ready, "fabric hub status printed nothing within 30 s"
            assert p.stdout.readline()
            p.stdout.close()  # as `head -1` does once it has its line
            _, err = p.communicate(timeout=30)
        finally:
            kill_all([p])
        assert p.returncode == EXIT_BROKEN_PIPE == 141, err
        assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception" not in err, err


def test_serve_stops_cleanly_on_sigterm() -> None:
    procs: list[subprocess.Popen] = []
    try:
        url = start_serve(procs)
        with wf.connect(url, timeout=5) as c:
            assert c.status()["models"] == {}
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(10) == 0
    finally:
        kill_all(procs)


def test_a_relay_forwards_to_a_served_hub_and_stops_cleanly_on_sigterm() -> None:
    procs: list[subprocess.Popen] = []
    try:
        hub_url = start_serve(procs)
        url = start_cli(procs, "relay", "--hub", hub_url, says="fabric hub relay serving at")
        with wf.connect(url, worker="w", timeout=5) as c:   # through the relay
            assert c.latest("m") is None
            assert [w["worker"] for w in c.status()["workers"]] == ["w"]
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(10) == 0
    finally:
        kill_all(procs)


@pytest.mark.parametrize("args, what", [
    (["--hub", "http://hub:1"], "bad hub URL"),
    (["--hub", "tcp://127.0.0.1:7470", "--port", "99999"], "not a TCP port"),
    (["--port", "0"], "required: --hub"),
])
def test_relay_rejects_bad_options_with_exit_2(args: list[str], what: str) -> None:
    result = fabric_cli("hub", "relay", *args)
    assert result.returncode == 2 and what in result.stderr


def test_status_of_an_unreachable_hub_fails_with_a_clear_message() -> None:
    out = fabric_cli("hub", "status", "tcp://127.0.0.1:9", "--timeout", "0.5")
    assert out.returncode == 1
    assert "no hub answered at tcp://127.0.0.1:9" in out.stderr
    out = fabric_cli("hub", "status", "http://nope", "--timeout", "0.5")
    assert out.returncode == 2 and "bad hub URL" in out.stderr
    out = fabric_cli("hub", "status", "tcp://127.0.0.1:99999")  # zmq would use 99999 % 65536
    assert out.returncode == 2 and "bad hub URL" in out.stderr
    for timeout in ("nan", "inf", "-1", "0"):
        out = fabric_cli("hub", "status", "tcp://127.0.0.1:9", "--timeout", timeout)
        assert out.returncode == 2 and "positive, finite number of seconds" in out.stderr


@pytest.mark.parametrize("command, example", [
    ("serve", "fabric hub serve --host 0.0.0.0 --port 7470 --state-dir"),
    ("status", "fabric hub status tcp://127.0.0.1:7470"),
    ("relay", "fabric hub relay --hub tcp://10.0.0.1:7470 --port 7471"),
])
def test_help_shows_an_example(command: str, example: str) -> None:
    out = fabric_cli("hub", command, "--help")
    assert out.returncode == 0
    assert "example" in out.stdout and example in out.stdout


def test_serve_with_a_broken_cluster_file_exits_2_naming_the_line(tmp_path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("version: 1\nname: x\nnode_types:\n  a: {gpus: 0, nics: {count: 1, "
                   "bandwidth: 10GBs}}\ndatacenters: [{name: d, nodes: [{name: n, type: a}]}]\n")
    result = fabric_cli("hub", "serve", "--port", "0", "--cluster", str(bad))
    assert result.returncode == 2
    assert f"{bad}:4: node_types.a.nics.bandwidth" in result.stderr


def test_serve_rejects_an_unusable_state_dir_before_binding(tmp_path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = fabric_cli("hub", "serve", "--port", "0", "--state-dir", str(not_a_dir / "state"))
    assert result.returncode == 2
    assert "state dir" in result.stderr and "cannot create it" in result.stderr
    assert "serving" not in result.stdout


@pytest.mark.parametrize("args, what", [
    (["--port", "99999"], "not a TCP port"),        # zmq would bind 99999 % 65536
    (["--port", "-1"], "not a TCP port"),
    (["--log-level", "loud"], "invalid choice"),
    (["--lease", "nan"], "positive, finite number of seconds"),
    (["--lease", "0"], "positive, finite number of seconds"),
    (["--report-budget", "-3"], "not a number >= 0 or 'none'"),
    (["--heartbeat-rate", "0"], "not a positive number or 'none'"),
])
def test_serve_rejects_bad_options_with_exit_2(args: list[str], what: str) -> None:
    result = fabric_cli("hub", "serve", *args)
    assert result.returncode == 2 and what in result.stderr


def test_serve_help_states_the_hub_s_budgets(capsys) -> None:
    from weightfabric.fabric.hub.state import HEARTBEAT_RATE, REPORT_BUDGET
    from weightfabric.tools.cli import main

    with pytest.raises(SystemExit):
        main(["hub", "serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"(default {REPORT_BUDGET}," in shown and f"(default {HEARTBEAT_RATE:g}," in shown


def test_status_says_why_a_lease_is_longer_than_asked() -> None:
    from weightfabric.fabric.hub.state import HubState

    state = HubState(lease_s=1.0, heartbeat_rate=10)
    for i in range(6):
        state.register(f"w{i}", session=f"w{i}")
    buf = io.StringIO()
    render_status(state.snapshot(), Console(file=buf, width=200, color_system=None))
    first = buf.getvalue().splitlines()[0]
    assert "lease 1.8 s (1 s asked;" in first and "at most 10 times a second" in first
    buf = io.StringIO()
    render_status(HubState(lease_s=1.0).snapshot(), Console(file=buf, width=200, color_system=None))
    assert buf.getvalue().splitlines()[0].endswith("lease 1 s")
