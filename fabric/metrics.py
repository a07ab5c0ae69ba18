"""Prometheus metrics of hubs and workers, on an opt-in HTTP port.

``HubServer(..., metrics_port=9470)`` (``fabric hub serve --metrics-port 9470``) and
``fabric.join(..., metrics_port=9471)`` serve ``http://127.0.0.1:PORT/metrics`` in the
Prometheus text format (port 0: the OS picks; read ``hub.metrics.port``). Every metric is
listed in docs/operations.md ("Metrics").

Each exporter has its own `prometheus_client.CollectorRegistry` (several hubs and workers
in one process do not collide) and its own HTTP server thread, shut by the hub's `stop` or
the worker's `close`. Most values are read from the live objects when Prometheus scrapes
(`_HubCollector`, `_WorkerCollector`): counts of the hub's records, the worker's stores and
its read server's egress. What must be counted as it happens is one call where it happens:
the hub times each operation (`HubMetrics.timed`), and a store reports each fetch it
completes (`WorkerMetrics.fetched`).

``prometheus-client`` is an optional dependency (the ``metrics`` extra), imported only
when a port is asked for: importing the package, or running ``fabric``, does not load it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:
    from prometheus_client.registry import Collector, CollectorRegistry

    from weightfabric.fabric.fetch import FetchStats
    from weightfabric.fabric.hub.server import HubServer
    from weightfabric.fabric.worker import Worker

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "pip install weightfabric[metrics]"

OP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
              0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: the buckets of hub operation and persist latencies (most take well under 1 ms)."""

FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)
"""Seconds: the buckets of a worker's fetch times."""


def require() -> None:
    """Check that ``prometheus-client`` is installed.

    Raises:
        ImportError: it is not (the message says how to install it).
    """
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ImportError("metrics need prometheus-client, which is not installed: "
                          f"{INSTALL_HINT} (or pip install 'prometheus-client>=0.20')") from exc


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Exporter:
    """An HTTP server on a daemon thread answering with one registry's metrics.

    Args:
        registry: what it serves.
        port: TCP port; 0 lets the OS pick (see `port`).
        host: address to bind (loopback by default: give ``0.0.0.0`` for a scraper on
            another host).

    Raises:
        ImportError: ``prometheus-client`` is not installed.
        OSError: the port is taken.
    """

    def __init__(self, registry: CollectorRegistry, port: int = 0,
                 host: str = "127.0.0.1") -> None:
        require()
        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        server_class: type[WSGIServer] = ThreadingWSGIServer
        if ":" in host:  # an IPv6 address
            server_class = type("ThreadingWSGIServer6", (ThreadingWSGIServer,),
                                {"address_family": socket.AF_INET6})
        self._httpd = make_server(host, port, make_wsgi_app(registry), server_class,
                                  handler_class=_QuietHandler)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        """The port it listens on (the one the OS picked, for port 0)."""
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name=f"wf-metrics-{self.port}", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _copied(read: Callable[[], T]) -> T | None:
    """``read()``, a copy of records another thread owns; once more if they changed meanwhile.

    Copying a dict another thread writes may raise RuntimeError (it changed size); a
    scrape tries again once, then leaves the value out (None) rather than fail.
    """
    for _ in range(2):
        try:
            return read()
        except RuntimeError:
            continue
    log.debug("metrics: records changed during two copies in a row; left out of this scrape")
    return None


class _Served:
    """Metrics served on a port of their own (`Exporter`)."""

    exporter: Exporter

    @property
    def port(self) -> int:
        """The port the metrics are served on."""
        return self.exporter.port

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        return self.exporter.url

    def close(self) -> None:
        """Stop serving."""
        self.exporter.close()


class _Collector:
    """Reads its owner's live state at each scrape (from the scrape's thread)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def describe(self) -> list[Any]:
        return []


class HubMetrics(_Served):
    """The metrics of one `HubServer`, served on their own port.

    Args:
        hub: the hub whose state is read at each scrape.
        port, host: where to serve (`Exporter`).

    Raises:
        ImportError: ``prometheus-client`` is not installed.
        OSError: the port is taken.
    """

    def __init__(self, hub: HubServer, port: int = 0, host: str = "127.0.0.1") -> None:
        require()
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self.op_seconds = Histogram(
            "weightfabric_hub_op_seconds", "Seconds the hub took to handle a request, per "
            "operation (its rights check, the operation, what authentication adds; "
            "not the wait of a parked long poll, nor saving the records)", ["op"],
            registry=self.registry, buckets=OP_BUCKETS)
        self.persist_seconds = Histogram(
            "weightfabric_hub_persist_seconds", "Seconds the hub took to save its records "
            "(state dir or etcd) after a change", registry=self.registry, buckets=OP_BUCKETS)
        self.registry.register(cast("Collector", _HubCollector(hub)))
        self.exporter = Exporter(self.registry, port, host)


    def timed(self, op: str | None) -> AbstractContextManager[Any]:
        """Time the block into ``weightfabric_hub_op_seconds{op=op}`` (None: persist_seconds).

        ``op`` must be one of a bounded set of names (the hub's operations).
        """
        if op is None:
            return cast("AbstractContextManager[Any]", self.persist_seconds.time())
        return cast("AbstractContextManager[Any]", self.op_seconds.labels(op).time())



class _HubCollector(_Collector):
    """Reads a hub's counters and records at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        hub: HubServer = self.owner
        yield CounterMetricFamily("weightfabric_hub_requests_total",
                                  "Requests received (every frame, bad ones included)",
                                  value=hub.num_requests)
        yield CounterMetricFamily("weightfabric_hub_requests_refused_total",
                                  "Requests refused as unauthenticated", value=hub.num_refused)
        yield CounterMetricFamily("weightfabric_hub_bad_frames_total",
                                  "Frames that were not a well-formed request",
                                  value=hub.num_bad_frames)
        yield GaugeMetricFamily("weightfabric_hub_leading", "1 while this hub serves "
                                "operations (a single hub, or the leader of a service); 0 while "
                                "it stands by", value=1 if hub.leading else 0)
        service = hub.service
        yield CounterMetricFamily("weightfabric_hub_terms_total", "Terms this hub took the lead "
                                  "of a service (failovers to it; 0 for a single hub)",
                                  value=service.terms if service is not None else 0)
        yield GaugeMetricFamily("weightfabric_hub_parked_requests",
                                "Requests waiting for a change (long polls: wait_version, "
                                "kv_get, group completions, retracts, planned fetches)",
                                value=len(hub._parked))
        yield GaugeMetricFamily("weightfabric_hub_reply_cache_bytes",
                                "Bytes of replies kept for retries", value=hub._replies_size)
        state = hub.state   # swapped whole on a change of role: one snapshot of the reference
        yield CounterMetricFamily("weightfabric_hub_stalled_seconds_total",
                                  "Seconds the hub's loop stalled (its leases stopped as long)",
                                  value=float(getattr(state, "_stalled", 0.0)))
        yield GaugeMetricFamily("weightfabric_hub_workers", "Workers registered (live leases)",
                                value=len(state.workers))
        yield GaugeMetricFamily("weightfabric_hub_fetches_in_flight",
                                "Fetches begun and not yet completed or released",
                                value=len(state.fetches))
        models = _copied(state.models.copy)
        if models is None:
            return
        yield GaugeMetricFamily("weightfabric_hub_models", "Models the hub knows",
                                value=len(models))
        versions = GaugeMetricFamily("weightfabric_hub_versions", "Versions per model and "
                                     "state (publishing, committed, retired and still listed)",
                                     labels=["model", "state"])
        latest = GaugeMetricFamily("weightfabric_hub_latest_version",
                                   "The newest committed version of each model",
                                   labels=["model"])
        for m in models.values():
            copied = _copied(m.versions.copy)
            if copied is None:
                continue
            records = list(copied.values())
            for name in ("publishing", "committed", "retired"):
                versions.add_metric([m.name, name], sum(1 for v in records if v.state == name))
            committed = [v.number for v in records if v.state == "committed"]
            if committed:
                latest.add_metric([m.name], max(committed))
        yield versions
        yield latest


class WorkerMetrics(_Served):
    """The metrics of one `Worker`, served on their own port.

    Args:
        worker: the worker whose stores and read server are read at each scrape.
        port, host: where to serve (`Exporter`).

    Raises:
        ImportError: ``prometheus-client`` is not installed.
        OSError: the port is taken.
    """

    def __init__(self, worker: Worker, port: int = 0, host: str = "127.0.0.1") -> None:
        require()
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry(auto_describe=False)
        self._fetches = Counter("weightfabric_worker_fetches_total",
                                "Fetches completed (versions read into this worker)",
                                ["model"], registry=r)
        self._bytes = Counter("weightfabric_worker_fetched_bytes_total",
                              "Bytes fetched (as delivered: a delta counts as what it "
                              "decodes to)", ["model"], registry=r)
        self._wire = Counter("weightfabric_worker_fetched_wire_bytes_total",
                             "Bytes fetched as they crossed to this worker (deltas encoded)",
                             ["model"], registry=r)
        self._transports = Counter("weightfabric_worker_transport_bytes_total",
                                   "Bytes fetched per transport (shm, tcp, cuda_ipc, nixl...)",
                                   ["transport"], registry=r)
        self._seconds = Histogram("weightfabric_worker_fetch_seconds",
                                  "Seconds each completed fetch took to read its chunks",
                                  ["model"], registry=r, buckets=FETCH_BUCKETS)
        self._reread = Counter("weightfabric_worker_chunks_reread_total",
                               "Chunk reads retried (their source failed or sent bad bytes)",
                               registry=r)
        self._corrupted = Counter("weightfabric_worker_corrupted_chunks_total",
                                  "Chunk reads whose checksum did not match", registry=r)
        self._deltas = Counter("weightfabric_worker_delta_chunks_total",
                               "Chunks fetched as deltas against a version held", registry=r)
        self._failed = Counter("weightfabric_worker_failed_sources_total",
                               "Sources given up on during fetches (gone, stalled, refused, "
                               "or corrupt)", registry=r)
        r.register(cast("Collector", _WorkerCollector(worker)))
        self.exporter = Exporter(r, port, host)


    def fetched(self, model: str, stats: FetchStats) -> None:
        """Count a completed fetch of ``model`` (called once per fetch, by its store)."""
        self._fetches.labels(model).inc()
        self._bytes.labels(model).inc(stats.bytes)
        self._wire.labels(model).inc(stats.wire_bytes)
        for transport, n in stats.transports.items():
            self._transports.labels(transport).inc(n)
        self._seconds.labels(model).observe(stats.seconds)
        self._reread.inc(stats.chunks_reread)
        self._corrupted.inc(stats.corrupted_chunks)
        self._deltas.inc(stats.delta_chunks)
        self._failed.inc(len(stats.failed_sources))



class _WorkerCollector(_Collector):
    """Reads a worker's stores, read server and holdings at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        worker: Worker = self.owner
        server = worker.server
        yield CounterMetricFamily("weightfabric_worker_served_bytes_total",
                                  "Bytes this worker sent to readers (its egress; deltas as "
                                  "encoded)", value=server.bytes_served)
        yield CounterMetricFamily("weightfabric_worker_served_delivered_bytes_total",
                                  "What the bytes served stand for once decoded (a delta counts "
                                  "as the chunks it encodes)", value=server.bytes_delivered)
        yield CounterMetricFamily("weightfabric_worker_reads_forbidden_total",
                                  "Reads refused for want of a valid capability",
                                  value=server.num_forbidden)
        yield CounterMetricFamily("weightfabric_worker_stalled_reads_total",
                                  "Reads of a partial replica here answered early because its "
                                  "own fetch stalled (no chunk arrived for the stall timeout)",
                                  value=server.num_stalled)
        yield GaugeMetricFamily("weightfabric_worker_regions_served",
                                "Replicas (regions) this worker's read server exposes",
                                value=len(server.regions()))
        holdings = _copied(getattr(worker.hub, "_holdings", {}).copy)
        if holdings is not None:
            yield GaugeMetricFamily("weightfabric_worker_fetches_in_flight",
                                    "Fetches begun at the hub and not yet completed or released",
                                    value=sum(1 for h in holdings.values()
                                              if h.fetch_id is not None))
        with worker._lock:
            stores = [s for s in worker._stores.values() if not s.closed]
        active = GaugeMetricFamily("weightfabric_worker_active_version",
                                   "The version each model's tensors hold now",
                                   labels=["model"])
        held = GaugeMetricFamily("weightfabric_worker_versions_held",
                                 "Versions each model's store holds in its buffers (the active "
                                 "one, kept ones, ones being fetched or not yet switched to)",
                                 labels=["model"])
        for store in stores:
            if store.version is not None:
                active.add_metric([store.model], store.version)
            held.add_metric([store.model], sum(1 for b in store.pool.buffers
                                               if b.version is not None))
        yield active
        yield held


__all__ = ["Exporter", "HubMetrics", "WorkerMetrics", "require"]
