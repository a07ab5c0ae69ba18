"""Smoke run of `fabric bench hub --broadcast N` (20 simulated readers, half-second fetches).

The hub runs in a process of its own and the readers in another, signed; this checks
the JSON it prints, that every reader completed without an error, and that the readers
report as the fetch engine does. No figure is checked: they are the benchmark's.
"""

from __future__ import annotations

import inspect
import json

import pytest
from timeouts import hard_timeout

from weightfabric.fabric.client import connect
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.tools.bench import hub as bench
from weightfabric.tools.cli import main

KEYS = {"readers", "completed", "reader_procs", "hub_cpu_s_per_version",
        "hub_cpu_s_per_version_net", "hub_cpu_baseline_per_s", "version_seconds",
        "ops_per_s", "p99_ms", "latency_ms", "reports_per_fetch", "publish_ms", "errors"}


def test_broadcast_json_has_the_hub_s_cost_and_every_reader_completes(capsys):
    with hard_timeout(120):
        assert main(["bench", "hub", "--broadcast", "20", "--fetch-seconds", "0.5",
                     "--lease", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= KEYS
    assert out["readers"] == out["completed"] == 20 and out["errors"] == {}
    assert out["hub_cpu_s_per_version"] > 0 and out["ops_per_s"] > 0
    assert {"begin_fetch", "complete_fetch", "report_progress", "heartbeat"} <= set(
        out["latency_ms"])
    assert out["latency_ms"]["begin_fetch"]["count"] == 20
    assert out["p99_ms"] == max(out["latency_ms"]["begin_fetch"]["p99"],
                                out["latency_ms"]["complete_fetch"]["p99"])
    assert 1 <= out["reports_per_fetch"]["max"] <= FetchOptions().max_reports
    assert out["resends"] == out["timeouts"] == 0


def test_the_readers_report_within_the_hub_s_budget(capsys):
    """A budget of 10 reports for 20 readers: the first 5 to begin send 2, the rest fewer."""
    with hard_timeout(120):
        assert main(["bench", "hub", "--broadcast", "20", "--fetch-seconds", "0.5",
                     "--lease", "3", "--report-budget", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 20 and out["errors"] == {}
    assert out["reports_per_fetch"]["min"] == 0
    assert out["reports_per_fetch"]["total"] <= 2 * 5 + 5


def test_readers_behind_simulated_relays_reach_the_hub_in_batches(capsys):
    with hard_timeout(120):
        assert main(["bench", "hub", "--broadcast", "24", "--fetch-seconds", "0.5",
                     "--lease", "3", "--relay", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 24 and out["errors"] == {} and out["relay"] is True
    sizes = {int(k): n for k, n in out["relay_batch_sizes"].items()}
    assert sum(k * n for k, n in sizes.items()) == out["relay_batched"] > 0
    assert max(sizes) > 1                  # a node's requests went together
    assert max(sizes) <= bench.NODE_SIZE * 4   # one node's readers, a few requests each
    assert 2 <= out["relay_joined"] <= 24      # readers of a node that began together
    assert set(out["first_second_cpu_s"]) == {"hub", "readers"}
    threads = out["hub_cpu_s_by_thread"]           # the hub's CPU, by thread
    assert "main" in threads and "ZMQbg/IO" in threads
    assert sum(threads.values()) == pytest.approx(out["hub_cpu_s_per_version"], abs=0.5)


def test_the_simulated_readers_retry_as_the_client_does():
    assert inspect.signature(connect).parameters["timeout"].default == bench.CLIENT_TIMEOUT_S


def test_the_simulated_readers_report_as_the_engine_does():
    assert FetchOptions().report_interval == bench.ENGINE_REPORT_INTERVAL
    assert FetchOptions().max_reports == bench.ENGINE_MAX_REPORTS


def test_broadcast_rejects_bad_input():
    with pytest.raises(ValueError, match="readers"):
        bench.bench_broadcast(0)


def test_the_broadcast_table_says_the_hub_s_cost(capsys):
    with hard_timeout(120):
        assert main(["bench", "hub", "--broadcast", "8", "--fetch-seconds", "0.2",
                     "--lease", "3", "--settle", "0.5", "--relay"]) == 0
    out = capsys.readouterr().out
    for row in ("hub CPU per version", "hub CPU by thread", "--settle", "begin_fetch p50",
                "begins joined", "second after the commit"):
        assert row in out, out
