"""Prometheus metrics of hubs and workers (`fabric.metrics`), scraped over loopback HTTP."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from paths import ROOT, child_env
from timeouts import hard_timeout
from torch import nn

import weightfabric as wf

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def _time_limit():
    with hard_timeout(120):
        yield


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at ``url``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def closed(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.URLError:
        return True
    return False


@pytest.mark.hub(metrics_port=0)
def test_hub_and_worker_metrics_count_a_publish_and_a_fetch(hub, workers, monkeypatch):
    # the reader on another "host": it reads over TCP, so the holder's egress is real
    monkeypatch.setenv("WEIGHTFABRIC_HOST_ID", "host-a")
    trainer = workers.join("trainer", timeout=5, metrics_port=0)
    monkeypatch.setenv("WEIGHTFABRIC_HOST_ID", "host-b")
    rollout = workers.join("rollout", timeout=5, metrics_port=0)
    assert hub.metrics_url.startswith("http://127.0.0.1:")
    assert rollout.metrics_url.startswith("http://127.0.0.1:")

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 7))
    v = trainer.model("m", chunk_size=CHUNK).publish(source)
    r_store = rollout.model("m", chunk_size=CHUNK)
    r_store.attach(nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 7)))
    stats = r_store.fetch(v)
    size = r_store.pool.active.region.nbytes
    assert stats.bytes == size > 0 and stats.transports == {"tcp": size}

    h = scrape(hub.metrics_url)
    assert value(h, "weightfabric_hub_op_seconds_count", op="begin_fetch") >= 1
    assert value(h, "weightfabric_hub_op_seconds_count", op="commit") >= 1
    assert value(h, "weightfabric_hub_op_seconds_count", op="complete_fetch") >= 1
    assert value(h, "weightfabric_hub_op_seconds_bucket", op="commit", le="+Inf") >= 1
    assert value(h, "weightfabric_hub_requests_total") == hub.num_requests > 0
    assert value(h, "weightfabric_hub_requests_refused_total") == 0
    assert value(h, "weightfabric_hub_bad_frames_total") == 0
    assert value(h, "weightfabric_hub_models") == 1
    assert value(h, "weightfabric_hub_versions", model="m", state="committed") == 1
    assert value(h, "weightfabric_hub_versions", model="m", state="publishing") == 0
    assert value(h, "weightfabric_hub_latest_version", model="m") == v
    assert value(h, "weightfabric_hub_workers") == 2
    assert value(h, "weightfabric_hub_fetches_in_flight") == 0
    assert value(h, "weightfabric_hub_leading") == 1
    assert value(h, "weightfabric_hub_terms_total") == 0

    r = scrape(rollout.metrics_url)
    assert value(r, "weightfabric_worker_fetches_total", model="m") == 1
    assert value(r, "weightfabric_worker_fetched_bytes_total", model="m") == size
    assert value(r, "weightfabric_worker_fetched_wire_bytes_total", model="m") == size
    assert value(r, "weightfabric_worker_transport_bytes_total", transport="tcp") == size
    assert value(r, "weightfabric_worker_fetch_seconds_count", model="m") == 1
    assert value(r, "weightfabric_worker_fetch_seconds_sum", model="m") == pytest.approx(
        stats.seconds)
    assert value(r, "weightfabric_worker_active_version", model="m") == v
    assert value(r, "weightfabric_worker_versions_held", model="m") >= 1
    assert value(r, "weightfabric_worker_fetches_in_flight") == 0
    assert value(r, "weightfabric_worker_chunks_reread_total") == 0
    assert value(r, "weightfabric_worker_served_bytes_total") == 0   # nobody read from it

    t = scrape(trainer.metrics_url)
    assert value(t, "weightfabric_worker_served_bytes_total") == trainer.bytes_served == size
    assert value(t, "weightfabric_worker_regions_served") >= 1
    assert value(t, "weightfabric_worker_active_version", model="m") == v
    assert ("weightfabric_worker_fetches_total", (("model", "m"),)) not in t  # it published

    urls = [rollout.metrics_url, trainer.metrics_url]
    rollout.close()
    trainer.close()
    assert all(closed(u) for u in urls)
    url = hub.metrics_url
    hub.stop()
    assert closed(url)


def test_hubs_and_workers_of_one_process_have_their_own_registries():
    with wf.serve("tcp://127.0.0.1:0", metrics_port=0) as a, \
            wf.serve("tcp://127.0.0.1:0", metrics_port=0) as b:
        assert a.metrics.port != b.metrics.port
        with wf.join(a.url, worker="w", metrics_port=0) as w:
            assert value(scrape(a.metrics_url), "weightfabric_hub_workers") == 1
            assert value(scrape(b.metrics_url), "weightfabric_hub_workers") == 0
            assert value(scrape(w.metrics_url), "weightfabric_worker_served_bytes_total") == 0


def test_no_metrics_port_no_exporter():
    with wf.serve("tcp://127.0.0.1:0") as hub, wf.join(hub.url, worker="w") as w:
        assert hub.metrics is None and hub.metrics_url == ""
        assert w.metrics is None and w.metrics_url == ""


def test_a_metrics_port_without_prometheus_client_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install weightfabric\[metrics\]"):
        wf.serve("tcp://127.0.0.1:0", metrics_port=0)
    with pytest.raises(ImportError, match=r"pip install weightfabric\[metrics\]"):
        wf.join("tcp://127.0.0.1:1", worker="w", metrics_port=0)


def test_importing_weightfabric_and_its_cli_loads_no_prometheus_client():
    code = ("import sys, weightfabric as wf; wf.join; wf.serve; wf.HubServer; "
            "import weightfabric.tools.cli, weightfabric.tools.hub_cmd; "
            "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_fabric_hub_serve_metrics_port_prints_where_it_serves():
    serve = subprocess.Popen(
        [sys.executable, "-m", "weightfabric.tools", "hub", "serve", "--port", "0",
         "--metrics-port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    try:
        ready, _, _ = select.select([serve.stdout], [], [], 60)
        assert ready, "fabric hub serve printed nothing within 60 s"
        lines = [serve.stdout.readline()]   # the rest follows at once (or the hard timeout)
        while lines[-1] and not lines[-1].startswith("metrics at "):
            lines.append(serve.stdout.readline())
        assert lines[-1], f"fabric hub serve exited after {lines}"
        assert lines[0].startswith("fabric hub serving at tcp://127.0.0.1:")
        url = lines[-1].split()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert value(scrape(url), "weightfabric_hub_leading") == 1
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
    assert closed(url)
