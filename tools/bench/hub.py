"""`fabric bench hub`: control-plane throughput and latency, and plan computation time.

Simulates ``--workers`` workers on loopback from one process (one DEALER socket each,
multiplexed by a zmq poller): each registers, then runs a closed loop of heartbeats
and progress reports against a hub on a background thread, every request signed and
every reply checked as `HubClient` does (``--auth both`` also runs a hub with
authentication off, for the cost of it). Separately times `HubState.begin_fetch`
plans for ``--readers`` readers of one version.

With ``--broadcast N`` it measures instead what one version fetched by N readers costs
the hub, with the hub alone in a process (`bench_broadcast`): its CPU seconds per
version, operations per second and each operation's p50/p99 (docs/benchmarks.md, "Hub
at 10,000 readers").
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import math
import os
import random
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq

from weightfabric.tools.command import EXIT_OK, BadInput, Console, add_command
from weightfabric.tools.hub_cmd import budget_arg, rate_arg

if TYPE_CHECKING:
    from weightfabric.fabric.node_begins import Item


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench hub`."""
    p = add_command(
        subparsers, "hub", help="control-plane ops/s, p99 latency, plan time", handler=_run,
        description="Control-plane operations per second and p50/p99 latency with many "
                    "simulated workers on loopback, and plan computation time for many readers.",
        examples=["fabric bench hub --workers 1000 --seconds 5 --json"])
    p.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    p.add_argument("--seconds", type=float, default=5.0, help="measurement time (default 5)")
    p.add_argument("--readers", type=int, default=1000, help="readers to plan for (default 1000)")
    p.add_argument("--chunks", type=int, default=None,
                   help="chunks per version (default 256; with --broadcast 1024)")
    p.add_argument("--auth", choices=["on", "off", "curve", "all"], default="all",
                   help="signed requests (on), a hub run --insecure (off), signed on a "
                        "CURVE-encrypted channel (curve), or all three in one run (default all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    b = p.add_argument_group(
        "broadcast", "with --broadcast N: only one version fetched by N simulated readers, "
        "the hub in a process of its own, signed, heartbeats throughout")
    b.add_argument("--broadcast", type=int, default=None, metavar="N",
                   help="simulated readers fetching one version together")
    b.add_argument("--fetch-seconds", type=float, default=4.0,
                   help="how long each simulated fetch takes (default 4)")
    b.add_argument("--read-chunks", type=int, default=4,
                   help="chunks per simulated read (default 4: 64 MiB reads of 16 MiB chunks)")
    b.add_argument("--lease", type=float, default=10.0,
                   help="the hub's lease; readers heartbeat every lease/3 (default 10)")
    b.add_argument("--settle", type=float, default=None, metavar="SECONDS",
                   help="heartbeats only, from the readers' registration to the version, "
                        "measured as the hub's idle rate (default: a third of the lease; "
                        "30 or more: the version comes once the leases the hub grants have "
                        "settled, as in a deployment whose workers registered long before)")
    b.add_argument("--start-spread", type=float, default=0.0, metavar="SECONDS",
                   help="readers begin their fetch a random delay up to this after the "
                        "commit wakes them (default 0: all at once)")
    b.add_argument("--report-interval", type=float, default=None, metavar="SECONDS",
                   help="seconds between a reader's progress reports (default: the engine's)")
    b.add_argument("--max-reports", default=None, metavar="K|none",
                   help="progress reports per fetch before the last one (default: the "
                        "engine's; none: every interval, as before)")
    b.add_argument("--report-budget", type=budget_arg, default=argparse.SUPPRESS,
                   metavar="N|none",
                   help="the hub's budget of progress reports per shard (default: the hub's, "
                        "as `fabric hub serve`; none: as many as readers send)")
    b.add_argument("--heartbeat-rate", type=rate_arg, default=argparse.SUPPRESS,
                   metavar="N|none",
                   help="heartbeats per second the hub's leases ask for at most (default: "
                        "the hub's, as `fabric hub serve`; none: the lease as given)")
    b.add_argument("--reader-procs", type=int, default=None,
                   help=f"processes simulating the readers (default 1 per "
                        f"{READERS_PER_PROCESS})")
    b.add_argument("--relay", action="store_true",
                   help="each node's 8 readers talk to the hub through a node relay "
                        "(`fabric hub relay`): requests that answer at once go in one "
                        "batch per node every --relay-window (one on its way at a time), "
                        "vouched for by the relay (readers and relays share the bench's "
                        "secret), a node's fresh begins of the shard joined in one")
    b.add_argument("--relay-window", type=float, default=None, metavar="SECONDS",
                   help="how long a relay holds a batch's first request for others (default: "
                        "the relay's, 0.005)")
    b.add_argument("--sync", action="store_true",
                   help="readers learn of the version as ModelStore.sync does: a "
                        "wait_version parked at the hub each, before and after the fetch")
    b.add_argument("--profile", metavar="FILE",
                   help="cProfile the hub's thread (CPU time) into FILE")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_ops(num_workers: int, seconds: float, *, auth: str = "on") -> dict:
    """Closed-loop heartbeats and progress reports from ``num_workers`` DEALER sockets.

    ``auth`` ``"on"``: each request is signed and each reply's signature checked;
    ``"curve"``: the same on an encrypted channel; ``"off"``: the hub runs insecure.
    """
    from weightfabric.fabric.auth import load_credential
    from weightfabric.fabric.hub.server import serve
    from weightfabric.fabric.manifest import Manifest, TensorSpec
    from weightfabric.fabric.protocol import REQUEST, Message, decode, encode
    from weightfabric.fabric.zmq_util import endpoint, make_socket

    hub = serve(f"{'curve' if auth == 'curve' else 'tcp'}://127.0.0.1:0", lease_s=120.0,
                insecure=auth == "off")
    cred = load_credential() if auth != "off" else None
    macs: dict[zmq.Socket, bytes] = {}

    def put(sock: zmq.Socket, payload: bytes) -> None:
        if cred is None:
            sock.send(payload)
            return
        frame, macs[sock] = cred.sign(payload)
        sock.send_multipart([payload, frame])

    def take(sock: zmq.Socket, flags: int = 0) -> Message:
        raw, frame = sock.recv_multipart(flags)
        if cred is not None and not cred.check_reply(frame, macs[sock], raw):
            raise RuntimeError("a reply not signed for its request")
        return decode(raw)

    socks: list[zmq.Socket] = []
    try:
        poller = zmq.Poller()
        for _ in range(num_workers):
            s = make_socket(zmq.DEALER, max_message_size=1 << 24)
            if auth == "curve":
                assert cred is not None
                s.curve_serverkey = cred.hub_key
                s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
            s.connect(endpoint(hub.url, bind=False))
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        index = {s: i for i, s in enumerate(socks)}
        req = [0] * num_workers
        sent_at = [0.0] * num_workers

        def send(i: int, op: str, args: dict) -> None:
            req[i] += 1
            sent_at[i] = time.perf_counter()
            put(socks[i], encode(REQUEST, req[i], f"s{i}", op, {"worker": f"w{i}", **args}))

        def drain(deadline: float, on_reply) -> None:
            while time.perf_counter() < deadline:
                for s, _ in poller.poll(100):
                    while True:
                        try:
                            msg = take(s, zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        on_reply(index[s], msg)

        pending = set(range(num_workers))
        for i in range(num_workers):
            send(i, "register", {"location": {"datacenter": f"dc{i % 2}", "node": f"n{i % 50}"}})
        t_end = time.perf_counter() + 30
        while pending and time.perf_counter() < t_end:
            for s, _ in poller.poll(100):
                while True:
                    try:
                        take(s, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    pending.discard(index[s])
        # One version published by w0 so half the loop can be progress reports of fetches.
        spec = TensorSpec("w", (1 << 20,), "uint8", 1 << 20, 0)
        manifest = Manifest((spec,), 1 << 14).to_wire()
        t0 = socks[0]
        put(t0, encode(REQUEST, 10**6, "s0", "begin_publish",
                       {"worker": "w0", "model": "m", "manifest": manifest}))
        take(t0)
        put(t0, encode(REQUEST, 10**6 + 1, "s0", "commit",
                       {"worker": "w0", "model": "m", "version": 1}))
        take(t0)
        latencies: list[float] = []
        errors = 0
        progress = [0] * num_workers

        def next_op(i: int) -> None:
            if i % 2 or i == 0:
                send(i, "heartbeat", {})
            elif progress[i] == 0:
                progress[i] = 1
                send(i, "begin_fetch", {"model": "m", "version": 1, "fetch_id": f"f{i}"})
            else:
                chunk = progress[i] % 64
                progress[i] += 1
                send(i, "report_progress", {"fetch_id": f"f{i}", "chunks": [chunk]})

        def on_reply(i: int, msg) -> None:
            nonlocal errors
            if msg.req_id != req[i]:
                return
            latencies.append(time.perf_counter() - sent_at[i])
            errors += msg.kind != 2
            next_op(i)

        start = time.perf_counter()
        for i in range(num_workers):
            next_op(i)
        drain(start + seconds, on_reply)
        elapsed = time.perf_counter() - start
        return {"auth": auth, "workers": num_workers, "ops": len(latencies), "seconds": round(elapsed, 3),
                "ops_per_s": round(len(latencies) / elapsed, 1), "errors": errors,
                "p50_ms": round(1e3 * _pct(latencies, 0.50), 3),
                "p99_ms": round(1e3 * _pct(latencies, 0.99), 3),
                "registered": num_workers - len(pending)}
    finally:
        for s in socks:
            s.close(0)
        hub.stop()


def bench_auth(n: int = 20_000) -> dict:
    """Microseconds per heartbeat a client spends signing, and the hub checking and signing back.

    The closed loop above runs its clients and the hub in one process, so it counts both
    sides' costs against the hub; these are each side's alone.
    """
    from weightfabric.fabric.auth import Authority, load_credential, reply_mac
    from weightfabric.fabric.protocol import REQUEST, encode

    authority, cred = Authority(), load_credential()
    payload = encode(REQUEST, 1, "s1", "heartbeat", {"worker": "w1"})
    start = time.perf_counter()
    frames = [cred.sign(payload)[0] for _ in range(n)]
    signed = time.perf_counter()
    for frame in frames:
        v = authority.verify(payload, frame)
        reply_mac(v.key, v.mac, payload)
    checked = time.perf_counter()
    return {"client_sign_us": round((signed - start) / n * 1e6, 2),
            "hub_verify_and_sign_us": round((checked - signed) / n * 1e6, 2)}


def bench_plans(num_readers: int, num_chunks: int) -> dict:
    """Time `begin_fetch` plans for ``num_readers`` readers; every 4th has progress."""
    from weightfabric.fabric.hub.state import HubState
    from weightfabric.fabric.locality import Location
    from weightfabric.fabric.manifest import Manifest, TensorSpec

    state = HubState(lease_s=3600)
    manifest = Manifest((TensorSpec("w", (num_chunks,), "uint8", num_chunks, 0),), 1)
    state.register("trainer", session="t", location=Location("dc0", "n0"))
    v = state.begin_publish("m", "trainer", manifest, session="t").version
    state.commit("m", v, "trainer", session="t")
    times = []
    for i in range(num_readers):
        w = f"r{i}"
        state.register(w, session=w, location=Location(f"dc{i % 2}", f"n{i % 100}"))
        t0 = time.perf_counter()
        state.begin_fetch("m", v, w, session=w, fetch_id=w)
        times.append(time.perf_counter() - t0)
        if i % 4 == 0:
            state.report_progress(w, w, session=w, chunks=list(range(0, num_chunks, 2)))
    return {"readers": num_readers, "chunks": num_chunks,
            "plan_total_s": round(sum(times), 3),
            "plan_mean_ms": round(1e3 * statistics.mean(times), 3),
            "plan_p99_ms": round(1e3 * _pct(times, 0.99), 3)}


# ------------------------------------------------------------------ broadcast

ENGINE_REPORT_INTERVAL = 0.02
"""`fabric.fetch.FetchOptions.report_interval`'s default (tests check they agree)."""
ENGINE_MAX_REPORTS: int | None = 2
"""`fabric.fetch.FetchOptions.max_reports`'s default (None: a report every interval)."""
BROADCAST_MODEL = "broadcast"
BROADCAST_CHUNK_SIZE = 16 << 20   # `fabric.tensorset.DEFAULT_CHUNK_SIZE`
NODE_SIZE = 8
"""Simulated readers per node (each reader's location names its node)."""
READERS_PER_PROCESS = 2500
"""Simulated readers per process (one DEALER socket each, polled with epoll)."""
CLIENT_TIMEOUT_S = 10.0
"""`fabric.client.connect`'s default ``timeout``: a call not answered by then fails."""
_LAT_BASE = math.log(1.02)        # latency histograms: buckets 2 % wide


def bench_broadcast(readers: int, *, fetch_seconds: float = 4.0, chunks: int = 1024,
                    read_chunks: int = 4, lease_s: float = 10.0, procs: int | None = None,
                    start_spread: float = 0.0,
                    report_interval: float = ENGINE_REPORT_INTERVAL,
                    max_reports: int | None = ENGINE_MAX_REPORTS,
                    sync: bool = False, baseline_s: float | None = None,
                    report_budget: int | None | str = "hub",
                    heartbeat_rate: float | None | str = "hub",
                    relay: bool = False, relay_window: float | None = None,
                    profile: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """One version broadcast to ``readers`` simulated readers; the hub's cost of it.

    The hub runs alone in a child process (authentication on, a secret made for the run),
    the readers in ``procs`` others (one DEALER socket each, every request signed and
    every reply's signature checked, and a request not answered within
    `fabric.client.FIRST_TRY_S` sent again, each try waiting twice as long, until `CLIENT_TIMEOUT_S`, as `HubClient`
    does; a reader's heartbeats go one at a time, as its heartbeat thread sends them). A
    publisher (a real `HubClient`) registers, then the readers register (not counted) and
    start heartbeats every ``lease_s / 3``. After a baseline window (heartbeats only), the
    publisher begins and commits a version of ``chunks`` chunks; each reader, told of it
    as soon as it is committed (plus a random delay up to ``start_spread`` s), calls
    ``begin_fetch``, then simulates its fetch: reads of ``read_chunks`` chunks land evenly
    over ``fetch_seconds``, reported as the fetch engine does for a store (``max_reports``
    times at chunk milestones, at least ``report_interval`` s apart, the rest left to
    ``complete_fetch``; with ``max_reports`` None as the engine did before: every
    ``report_interval`` s and a last report), then ``complete_fetch``. With ``sync`` the
    readers learn of the version as `ModelStore.sync` does instead: each parks a
    ``wait_version`` before the version and parks a new one after its fetch (the hub
    holds them all). The hub's ``report_budget`` and ``heartbeat_rate`` are its defaults
    (``"hub"``) or these (`HubServer`); each plan's ``max_reports`` caps the reader's, and
    readers heartbeat every third of the lease the hub's last reply granted. With
    ``relay`` each node's `NODE_SIZE` readers reach the hub as through a `fabric.relay`
    node relay: the requests it batches go in one ``batch`` per node, sent
    ``relay_window`` s after its first (`fabric.relay.WINDOW_S` by default) once the
    node's last batch is answered (or `fabric.relay.AWAIT_S` old), the others alone;
    ``relay_window`` 0 sends what is ready at each pass of the reader loop.

    Measured from the begin_publish to the last ``complete_fetch`` answered: the hub
    process's CPU seconds (``/proc``; also by thread: the hub's loop, zmq's I/O), the operations
    answered per second (heartbeats included), and each operation's latency.
    """
    if readers < 1 or chunks < 1 or read_chunks < 1 or fetch_seconds < 0 or lease_s <= 0 \
            or (relay_window is not None and relay_window < 0):
        raise ValueError("readers, chunks and read_chunks must be >= 1, fetch_seconds and "
                         "relay_window >= 0 and lease_s > 0")
    from weightfabric.fabric.auth import SECRET_FILE_ENV
    from weightfabric.fabric.client import connect
    from weightfabric.fabric.manifest import Manifest, TensorSpec
    from weightfabric.fabric.relay import WINDOW_S

    procs = procs or max(1, -(-readers // READERS_PER_PROCESS))
    if relay:    # a node's readers in one process, behind its relay
        procs = min(procs, -(-readers // NODE_SIZE))
    relay_wait = WINDOW_S if relay_window is None else relay_window
    # The hub gets a core of its own, the readers the others (as if they ran elsewhere).
    cpus = sorted(os.sched_getaffinity(0))
    hub_cpus, reader_cpus = (cpus[:1], cpus[1:]) if len(cpus) > 1 else (cpus, cpus)
    baseline_s = lease_s / 3 if baseline_s is None else baseline_s
    deadline = time.monotonic() + timeout
    tmp = Path(tempfile.mkdtemp(prefix="wf-bench-hub-"))
    secret = tmp / "secret"
    with os.fdopen(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    env = {**os.environ, SECRET_FILE_ENV: str(secret)}
    children: list[subprocess.Popen] = []
    publisher = None
    sampler = readers_sampler = None
    try:
        hub = _spawn(["_hub_main", json.dumps({"lease_s": lease_s, "secret_file": str(secret),
                                               "profile": profile, "cpus": hub_cpus,
                                               "report_budget": report_budget,
                                               "heartbeat_rate": heartbeat_rate})],
                     tmp / "hub.log", env, stdin=subprocess.DEVNULL)
        children.append(hub)
        url = _line(hub, deadline, tmp / "hub.log").strip()
        sampler = _CpuSampler(hub.pid)
        share = -(-readers // procs)
        share = -(-share // NODE_SIZE) * NODE_SIZE if relay else share
        sims = []
        for k in range(procs):
            first, count = k * share, min(share, readers - k * share)
            if count <= 0:
                break
            p = _spawn(["_reader_main"], tmp / f"readers-{k}.log", env, stdin=subprocess.PIPE)
            children.append(p)
            sims.append(p)
            _say(p, {"url": url, "secret_file": str(secret), "first": first, "count": count,
                     "lease_s": lease_s, "fetch_seconds": fetch_seconds, "chunks": chunks,
                     "read_chunks": read_chunks, "start_spread": start_spread,
                     "report_interval": report_interval, "max_reports": max_reports,
                     "chunk_size": BROADCAST_CHUNK_SIZE, "model": BROADCAST_MODEL,
                     "sync": sync, "seed": k, "cpus": reader_cpus,
                     "relay": relay, "relay_window": relay_wait})
        publisher = connect(url, worker="trainer", secret_file=secret, timeout=120,
                            location={"datacenter": "dc0", "node": "trainer"},
                            endpoints={"read": {"host": "10.0.0.1", "port": 7471,
                                                "host_id": "trainer"}})
        for k, p in enumerate(sims):
            ready = json.loads(_line(p, deadline, tmp / f"readers-{k}.log"))
            if ready.get("registered") != ready.get("count"):
                raise RuntimeError(f"reader process {k} registered {ready}")
        readers_sampler = _CpuSampler(*(p.pid for p in sims))
        for p in sims:
            _say(p, "go")
        base_t0, base_c0 = time.time(), sampler.cpu()
        time.sleep(baseline_s)
        base_t1, base_c1 = time.time(), sampler.cpu()
        baseline = (base_c1 - base_c0) / max(base_t1 - base_t0, 1e-9)
        size = chunks * BROADCAST_CHUNK_SIZE
        manifest = Manifest((TensorSpec("w", (size,), "uint8", size, 0),),
                            BROADCAST_CHUNK_SIZE,
                            checksums=tuple(random.Random(7).getrandbits(63)
                                            for _ in range(chunks)))
        t_start = time.time()
        c_start = sampler.cpu()
        threads_start = _threads_cpu(hub.pid)
        r_start = sum(_cpu_of(p.pid) for p in sims)
        p0 = time.perf_counter()
        version = publisher.begin_publish(BROADCAST_MODEL, manifest)
        p1 = time.perf_counter()
        publisher.commit(BROADCAST_MODEL, version)
        p2, t_commit = time.perf_counter(), time.time()
        if not sync:
            for p in sims:
                _say(p, {"version": version})
        results = [json.loads(_line(p, deadline, tmp / f"readers-{k}.log"))
                   for k, p in enumerate(sims)]
        t_end = max(r["last_complete"] or t_start for r in results)
        r_cpu = sum(_cpu_of(p.pid) for p in sims) - r_start   # a little past t_end
        time.sleep(0.05)  # the sampler reads past t_end
        c_end = sampler.cpu_at(t_end)
        burst = {"hub": round(sampler.cpu_at(t_commit + 1) - sampler.cpu_at(t_commit), 3),
                 "readers": round(readers_sampler.cpu_at(t_commit + 1)
                                  - readers_sampler.cpu_at(t_commit), 3)}
        threads = {k: v - threads_start.get(k, 0.0) for k, v in _threads_cpu(hub.pid).items()}
        window = max(t_end - t_start, 1e-9)
        hub_cpu = c_end - c_start
        hist: dict[str, Counter[int]] = {}
        for r in results:
            for op, h in r["hist"].items():
                hist.setdefault(op, Counter()).update({int(b): n for b, n in h.items()})
        bins: Counter[int] = Counter()
        for r in results:
            bins.update({int(b): n for b, n in r["bins"].items()})
        ops = sum(n for b, n in bins.items() if t_start <= b * 0.1 < t_end)
        lat = {op: {"count": sum(h.values()), "p50": _hist_pct(h, 0.5), "p99": _hist_pct(h, 0.99)}
               for op, h in sorted(hist.items())}
        reports = [n for r in results for n in r["reports"]]
        errors: Counter[str] = Counter()
        for r in results:
            errors.update(r["errors"])
        completed = sum(r["completed"] for r in results)
        return {
            "readers": readers, "completed": completed, "reader_procs": len(sims),
            "chunks": chunks, "read_chunks": read_chunks, "fetch_seconds": fetch_seconds,
            "start_spread": start_spread, "settle_s": baseline_s, "lease_s": lease_s,
            "sync": sync,
            "relay": relay, "relay_window_s": relay_wait if relay else None,
            "hub_cpus": hub_cpus, "reader_cpus": reader_cpus,
            "report_policy": {"report_interval": report_interval, "max_reports": max_reports,
                              "hub_report_budget": report_budget,
                              "hub_heartbeat_rate": heartbeat_rate},
            "version_seconds": round(window, 3),
            "hub_cpu_s_per_version": round(hub_cpu, 3),
            "hub_cpu_baseline_per_s": round(baseline, 4),
            "hub_cpu_s_per_version_net": round(hub_cpu - baseline * window, 3),
            "hub_cpu_util": round(hub_cpu / window, 3),
            "hub_cpu_s_by_thread": {k: round(v, 3) for k, v in sorted(threads.items())},
            "first_second_cpu_s": burst,
            "readers_cpu_util": round(r_cpu / window / len(reader_cpus), 3),
            "ops_per_s": round(ops / window, 1), "ops_in_version": ops,
            "latency_ms": lat,
            "p99_ms": max(lat.get("begin_fetch", {}).get("p99", 0.0),
                          lat.get("complete_fetch", {}).get("p99", 0.0)),
            "publish_ms": {"begin_publish": round(1e3 * (p1 - p0), 3),
                           "commit": round(1e3 * (p2 - p1), 3)},
            "reports_per_fetch": {"min": min(reports, default=0),
                                  "mean": round(statistics.mean(reports), 2) if reports else 0,
                                  "max": max(reports, default=0),
                                  "total": sum(reports)},
            "errors": dict(errors),
            "lease_s_granted": max(r["lease_s"] for r in results),
            "resends": sum(r["resends"] for r in results),
            "timeouts": sum(r["timeouts"] for r in results),
            "relay_batches": sum(r["batches"] for r in results),
            "relay_batched": sum(r["batched"] for r in results),
            "relay_joined": sum(r["joined"] for r in results),
            "relay_batch_sizes": dict(sorted(sum((Counter({int(k): n for k, n in
                                                           r["batch_sizes"].items()})
                                                  for r in results), Counter()).items())),
        }
    finally:
        if publisher is not None:
            with contextlib.suppress(Exception):
                publisher.close()
        for p in children[1:]:
            with contextlib.suppress(Exception):
                _say(p, "stop")
        for p in children[::-1]:
            if p is children[0]:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for cpus_of in (sampler, readers_sampler):
            if cpus_of is not None:
                cpus_of.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _spawn(argv: list[str], log: Path, env: dict[str, str], *, stdin: int) -> subprocess.Popen:
    """``python -c 'tools.bench.hub.ARGV[0]()' ARGV[1:]``, its stderr into ``log``."""
    code = f"from weightfabric.tools.bench.hub import {argv[0]}; {argv[0]}()"
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-c", code, *argv[1:]], stdin=stdin,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)


def _say(p: subprocess.Popen, what: object) -> None:
    assert p.stdin is not None
    p.stdin.write((what if isinstance(what, str) else json.dumps(what)) + "\n")
    p.stdin.flush()


def _line(p: subprocess.Popen, deadline: float, log: Path) -> str:
    """The next line ``p`` prints, before ``deadline`` (else the end of its log, raised)."""
    assert p.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or p.poll() is not None and not select.select([p.stdout], [], [], 0)[0]:
            break
        if select.select([p.stdout], [], [], min(left, 1.0))[0]:
            line = p.stdout.readline()
            if line:
                return line
            break
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"bench child {log.stem} gave no answer (exit {p.poll()}):\n{tail}")


def _threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds process ``pid``'s threads used so far, summed by thread name (``/proc``).

    The process's first thread is ``main`` (the hub's loop), zmq's I/O threads
    ``ZMQbg/IO/N`` are counted as ``ZMQbg/IO``, others by their name.
    """
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = "main" if task == str(pid) else re.sub(r"/[0-9]+$", "", f.read().strip())
            out[name] = out.get(name, 0.0) + _stat_cpu(f"/proc/{pid}/task/{task}/stat")
    return out


def _cpu_of(pid: int) -> float:
    """CPU seconds process ``pid`` used so far (``/proc``)."""
    return _stat_cpu(f"/proc/{pid}/stat")


def _stat_cpu(path: str) -> float:
    """The user and system CPU seconds in a ``/proc`` ``stat`` file."""
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuSampler:
    """The CPU seconds processes used, sampled every 10 ms on a thread (`cpu_at` any time)."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float]] = [(time.time(), self.cpu())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cpu(self) -> float:
        return sum(_cpu_of(pid) for pid in self.pids)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.samples.append((time.time(), self.cpu()))
            except OSError:
                return

    def cpu_at(self, t: float) -> float:
        """The CPU seconds at wall time ``t`` (interpolated between samples)."""
        samples = self.samples[:]
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return samples[-1][1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)


def _hist_pct(h: Counter[int], q: float) -> float:
    """The ``q`` quantile in ms of a histogram of log-spaced microsecond buckets."""
    total = sum(h.values())
    if not total:
        return float("nan")
    seen = 0
    for b in sorted(h):
        seen += h[b]
        if seen >= q * total:
            return round(math.exp((b + 0.5) * _LAT_BASE) / 1e3, 3)
    return float("nan")


class _PlanBudget(msgspec.Struct):
    """The one field of a plan a simulated reader reads (a plan's manifest is not parsed)."""

    max_reports: int | None = None


_plan_budget = msgspec.msgpack.Decoder(_PlanBudget)


def _hub_main() -> None:
    """The hub of `bench_broadcast`, in its own process: prints its URL, serves until SIGTERM."""
    import cProfile
    import logging

    cfg = json.loads(sys.argv[1])
    _raise_fd_limit()
    os.sched_setaffinity(0, cfg["cpus"])
    logging.basicConfig(level=logging.WARNING)
    from weightfabric.fabric.hub.server import HubServer

    budget = {k: cfg[k] for k in ("report_budget", "heartbeat_rate") if cfg[k] != "hub"}
    hub = HubServer("tcp://127.0.0.1:0", lease_s=cfg["lease_s"], secret_file=cfg["secret_file"],
                    **budget)
    signal.signal(signal.SIGTERM, lambda *_: hub.stop(timeout=0))
    # CPU time of the hub's thread (not wall time: the readers share the machine)
    prof = cProfile.Profile(time.thread_time) if cfg.get("profile") else None
    if prof is not None:
        prof.enable()
    try:
        hub.serve_forever(on_ready=lambda url: print(url, flush=True))
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(cfg["profile"])


def _raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _reader_main() -> None:
    """Simulated readers of `bench_broadcast`, in their own process (driven on stdin)."""
    cfg = json.loads(sys.stdin.readline())
    _raise_fd_limit()
    os.sched_setaffinity(0, cfg["cpus"])
    sim = _Readers(cfg)
    try:
        sim.register()
        print(json.dumps({"registered": sim.registered, "count": sim.n}), flush=True)
        sim.run()     # heartbeating while the other processes register (before "go")
    finally:
        sim.close()


class _Readers:
    """``count`` simulated readers on DEALER sockets, polled with epoll.

    zmq's socket FD is edge-like: a socket sent on, or whose FD fired, is looked at
    (``EVENTS``) until it has nothing to read.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        from weightfabric.fabric.auth import load_credential
        from weightfabric.fabric.zmq_util import endpoint, make_socket

        self.cfg = cfg
        self.first, self.n = int(cfg["first"]), int(cfg["count"])
        self.rng = random.Random(cfg["seed"])
        zmq.Context.instance().set(zmq.MAX_SOCKETS, self.n + self.n // NODE_SIZE + 64)
        self.cred = load_credential(secret_file=cfg["secret_file"])
        self.poll = select.epoll()
        self.socks: list[zmq.Socket] = []
        self.by_fd: dict[int, int] = {}

        def connect(socks: list[zmq.Socket], by_fd: dict[int, int]) -> None:
            """One more DEALER to the hub, polled: ``socks[k]``, its FD in ``by_fd``."""
            s = make_socket(zmq.DEALER, max_message_size=1 << 24)
            s.connect(endpoint(cfg["url"], bind=False))
            fd = cast(int, s.getsockopt(zmq.FD))
            by_fd[fd] = len(socks)
            socks.append(s)
            self.poll.register(fd, select.EPOLLIN)

        for _ in range(self.n):
            connect(self.socks, self.by_fd)
        self.poll.register(sys.stdin.fileno(), select.EPOLLIN)
        self.check: set[int] = set(range(self.n))
        # With a relay per node: the node's socket, the requests it holds for its next
        # batch, and the readers each batch on its way answers, in order.
        self.relay, self.window = bool(cfg.get("relay")), float(cfg.get("relay_window", 0))
        self.node_socks: list[zmq.Socket] = []
        self.node_by_fd: dict[int, int] = {}
        self.held: dict[int, list[tuple[int, bytes]]] = {}
        self.in_batch: dict[int, tuple[bytes, int, list[int], list[Item]]] = {}
        self.first_held: dict[int, float] = {}     # node -> when its first held came
        self.node_busy: dict[int, tuple[int, float]] = {}  # node -> its batch on its way
        self.check_nodes: set[int] = set()
        self.batches = self.batched = self.joined = 0
        self.batch_sizes: Counter[int] = Counter()
        self.batch_ids = 0
        if self.relay:
            for _ in range(-(-self.n // NODE_SIZE)):
                connect(self.node_socks, self.node_by_fd)
            self.check_nodes = set(range(len(self.node_socks)))
        self.req = [0] * self.n
        # (reader, request id) -> (op, sent, payload, each try's MAC), as `HubClient` tries
        self.pending: dict[tuple[int, int], tuple[str, float, bytes, list[bytes]]] = {}
        self.resends = 0
        self.timeouts = 0
        self.beating = [False] * self.n    # a heartbeat on its way (the client waits for it)
        self.lease = [float(cfg["lease_s"])] * self.n   # as the hub's last reply said
        # heartbeats as `HubClient` sends them (`fabric.client.heartbeat_due`)
        from weightfabric.fabric.client import FIRST_TRY_S, heartbeat_due
        from weightfabric.fabric.hub_messages import RENEWS_LEASE

        self.heartbeat_due, self.renewing = heartbeat_due, RENEWS_LEASE
        from weightfabric.fabric.client import node_phase
        from weightfabric.fabric.locality import Location

        # each node's readers heartbeat together, as `HubClient` (`node_phase`)
        self.phase = [node_phase(Location.from_wire(self.location(i))) for i in range(self.n)]
        self.wall_offset = time.time() - time.monotonic()
        self.first_try = FIRST_TRY_S      # then twice as long at each try, as the client
        self.last_beat = [0.0] * self.n     # the last heartbeat sent (time.monotonic)
        self.renewed = [-math.inf] * self.n  # the last request that renewed the lease, sent
        self.timers: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.hist: dict[str, Counter[int]] = {}
        self.bins: Counter[int] = Counter()
        self.errors: Counter[str] = Counter()
        self.registered = 0
        self.stopping = False
        self.stdin_buf = b""
        # each reader's fetch
        self.chunks, self.rc = int(cfg["chunks"]), int(cfg["read_chunks"])
        self.nreads = -(-self.chunks // self.rc)
        self.dt = float(cfg["fetch_seconds"]) / self.nreads
        self.interval = float(cfg["report_interval"])
        self.max_reports = cfg["max_reports"]
        self.most: list[int | None] = [self.max_reports] * self.n   # with the plan's limit
        self.version = [0] * self.n
        self.t0 = [0.0] * self.n          # when its plan came
        self.k = [0] * self.n             # reads counted at the last report attempt
        self.last = [0.0] * self.n        # the last report attempt (the engine's last_report)
        self.reported = [0] * self.n      # chunks reported
        self.sent = [0] * self.n          # reports sent
        self.inflight = [False] * self.n  # a report on its way
        self.finishing = [False] * self.n
        self.completing = [False] * self.n
        self.done = [False] * self.n
        self.completed = 0
        self.last_complete: float | None = None

    # --- wire
    def worker(self, i: int) -> str:
        return f"r{self.first + i}"

    def send(self, i: int, op: str, args: dict[str, Any]) -> None:
        from weightfabric.fabric.protocol import REQUEST, encode

        self.req[i] += 1
        rid = self.req[i]
        payload = encode(REQUEST, rid, f"s-{self.worker(i)}", op, args)
        frame, mac = self.cred.sign(payload)
        self.forward(i, payload, frame)
        now = time.monotonic()
        self.pending[(i, rid)] = (op, now, payload, [mac])
        if op != "wait_version":      # a long poll's try lasts its wait (10 s) and more
            self.at(now + self.first_try, i, f"try:{rid}")
        self.check.add(i)

    def forward(self, i: int, payload: bytes, frame: bytes) -> None:
        """Send a reader's signed request: alone, or held for its node relay's next batch.

        The readers and their relays share the bench's secret, so a relay vouches for
        every request it batches (sent without its auth frame; the relay signs the answer,
        `fabric.relay`); the simulated relay neither checks the readers' signatures nor
        signs their answers, as a real one does on its node (the readers of all nodes share
        one core here): it checks the batch's answer, signed by the hub.
        """
        from weightfabric.fabric.relay import batchable

        if not self.relay or not batchable(payload):
            self.socks[i].send_multipart([payload, frame])
            return
        j = i // NODE_SIZE
        held = self.held.setdefault(j, [])
        if not held:
            self.first_held[j] = now = time.monotonic()
            self.at(now + self.window, j, "flush")
        held.append((i, payload))

    def flush(self, j: int) -> None:
        """Node ``j``'s relay sends the requests it holds as one batch, when due.

        As `fabric.relay.NodeRelay`: once the first has waited the window, and its last
        batch is answered or older than `fabric.relay.AWAIT_S` (then a timer comes back).
        """
        from weightfabric.fabric.hub_messages import BatchRequest
        from weightfabric.fabric.node_begins import join
        from weightfabric.fabric.protocol import REQUEST, encode
        from weightfabric.fabric.relay import AWAIT_S

        if not self.held.get(j):
            return
        now = time.monotonic()
        busy = self.node_busy.get(j)
        if now < self.first_held[j] + self.window:
            return
        if busy is not None and now < busy[1] + AWAIT_S:
            self.at(busy[1] + AWAIT_S, j, "flush")
            return
        held = self.held.pop(j)
        self.batch_ids += 1
        session = f"relay-{self.first}-{j}"
        joined = join([p for _, p in held], [True] * len(held), session)
        data = encode(REQUEST, self.batch_ids, session, "batch",
                      BatchRequest(items=[(it.payload, b"") for it in joined]))
        frame, mac = self.cred.sign(data)
        self.node_socks[j].send_multipart([data, frame])
        self.in_batch[self.batch_ids] = (mac, j, [i for i, _ in held], joined)
        self.joined += sum(len(it.members) for it in joined if it.req_ids)
        self.node_busy[j] = (self.batch_ids, now)
        self.batches += 1
        self.batched += len(held)
        self.batch_sizes[len(held)] += 1
        self.check_nodes.add(j)

    def try_again(self, i: int, rid: int, now: float) -> None:
        """No answer yet to request ``rid``: send it again, or fail it at the client's timeout."""
        got = self.pending.get((i, rid))
        if got is None:
            return
        op, sent, payload, macs = got
        if now - sent >= CLIENT_TIMEOUT_S:
            del self.pending[(i, rid)]
            self.timeouts += 1
            self.errors[f"{op}: no answer within {CLIENT_TIMEOUT_S:g} s"] += 1
            self.on_reply(i, op, None, ok=False)
            return
        frame, mac = self.cred.sign(payload)      # a fresh timestamp, as each try
        self.forward(i, payload, frame)
        macs.append(mac)
        self.resends += 1
        self.check.add(i)
        self.at(min(sent + CLIENT_TIMEOUT_S, now + self.first_try * 2 ** (len(macs) - 1)), i,
                f"try:{rid}")

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for replies, and handle them."""
        busy = self.check or self.check_nodes
        for fd, _ in self.poll.poll(0 if busy else max(0.0, timeout)):
            i = self.by_fd.get(fd)
            if i is None and fd in self.node_by_fd:
                self.check_nodes.add(self.node_by_fd[fd])
                continue
            if i is None:
                self.from_parent()
                continue
            self.check.add(i)
        todo, self.check = self.check, set()
        for i in todo:
            s = self.socks[i]
            while cast(int, s.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                raw, frame = s.recv_multipart(zmq.NOBLOCK)
                self.take(i, raw, frame)
        nodes, self.check_nodes = self.check_nodes, set()
        for j in nodes:
            s = self.node_socks[j]
            while cast(int, s.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                raw, frame = s.recv_multipart(zmq.NOBLOCK)
                self.take_batch(raw, frame)

    def from_parent(self) -> None:
        """The bench's lines on stdin: ``go``, ``{"version": N}``, ``stop`` (or its end)."""
        data = os.read(sys.stdin.fileno(), 1 << 16)
        if not data:
            self.stopping = True
        self.stdin_buf += data
        while b"\n" in self.stdin_buf:
            raw, self.stdin_buf = self.stdin_buf.split(b"\n", 1)
            line = raw.decode().strip()
            if line == "go" and self.cfg["sync"]:
                for i in range(self.n):
                    self.wait_version(i, 0)
            elif line.startswith("{"):
                self.begin_all(int(json.loads(line)["version"]))
            elif line == "stop":
                self.stopping = True

    def take_batch(self, raw: bytes, frame: bytes) -> None:
        """A batch's answers, each to its reader (a refused batch: its readers retry)."""
        from weightfabric.fabric.hub_messages import BatchReply
        from weightfabric.fabric.node_begins import split
        from weightfabric.fabric.protocol import decode, decode_body

        msg = decode(raw)
        mac, j, members, joined = self.in_batch.pop(msg.req_id, (b"", -1, [], []))
        if not members:
            return
        if self.node_busy.get(j, (0,))[0] == msg.req_id:
            del self.node_busy[j]
            self.flush(j)        # what waited for this answer
        if not self.cred.check_reply(frame, mac, raw):
            raise RuntimeError("a batch's answer not signed for it")
        if msg.kind != 2:
            why = str(msgspec.msgpack.decode(msg.body).get("message", ""))
            self.errors[f"batch: {why[:160]}"] += len(members)
            return
        for item, (data, _) in zip(joined, decode_body(msg, BatchReply).items, strict=True):
            answers = split(data, item.req_ids) if item.req_ids else [data]
            for m, answer in zip(item.members, answers, strict=True):
                i = members[m]
                if answer is None:    # a real relay sends it alone
                    self.errors["begin_fetch: left out of its node's joined begins"] += 1
                    continue
                self.take(i, answer, None)

    def take(self, i: int, raw: bytes, frame: bytes | None) -> None:
        """Reader ``i``'s answer ``raw`` (its auth ``frame``): checked, timed, acted on.

        ``frame`` None: an answer of its node's simulated relay, in the same process, whose
        batch's answer was checked (the relay's signing for the reader and the reader's
        check of it are node-local work, left out so that the readers' one core keeps up).
        """
        from weightfabric.fabric.protocol import decode

        msg = decode(raw)
        got = self.pending.pop((i, msg.req_id), None)
        if got is None:
            return
        op, sent, _, macs = got
        now = time.monotonic()
        if frame is not None and (not any(self.cred.check_reply(frame, mac, raw)
                                          for mac in macs) and (msg.kind == 2 or frame)):
            raise RuntimeError("a reply not signed for its request")
        if msg.kind == 2 and op in self.renewing:
            self.renewed[i] = max(self.renewed[i], sent)
        us = max(1.0, (now - sent) * 1e6)
        self.hist.setdefault(op, Counter())[int(math.log(us) / _LAT_BASE)] += 1
        self.bins[int(time.time() / 0.1)] += 1
        if msg.kind != 2:
            why = str(msgspec.msgpack.decode(msg.body).get("message", ""))
            self.errors[f"{op}: {re.sub(r'r[0-9]+', 'rN', why)[:160]}"] += 1
        self.on_reply(i, op, msg, ok=msg.kind == 2)

    def at(self, t: float, i: int, kind: str) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (t, self.seq, i, kind))

    # --- phases
    def location(self, i: int) -> dict[str, str]:
        k = self.first + i
        return {"datacenter": f"dc{(k // 512) % 2}", "node": f"n{k // NODE_SIZE}",
                "device": f"gpu{k % NODE_SIZE}"}

    def register(self) -> None:
        for i in range(self.n):
            k = self.first + i
            self.send(i, "register", {
                "worker": self.worker(i),
                "location": self.location(i),
                "endpoints": {"read": {"host": f"10.{k >> 16 & 255}.{k >> 8 & 255}.{k & 255}",
                                       "port": 7471, "host_id": f"h{k // NODE_SIZE}"}}})
        end = time.monotonic() + 120
        while self.pending and time.monotonic() < end:
            self.due(time.monotonic())
            self.pump(0.05)

    def due(self, now: float) -> None:
        """Run the timers due by ``now``."""
        while self.timers and self.timers[0][0] <= now:
            _, _, i, kind = heapq.heappop(self.timers)
            self.on_timer(i, kind, now)

    def run(self) -> None:
        """Heartbeat, and fetch as the bench says, until it says stop."""
        reported = False
        while not self.stopping:
            self.due(time.monotonic())
            if not reported and all(self.done):
                print(json.dumps(self.result()), flush=True)
                reported = True
            wait = self.timers[0][0] - time.monotonic() if self.timers else 0.1
            self.pump(min(max(wait, 0.0), 0.1))

    def begin_all(self, version: int) -> None:
        for i in range(self.n):
            self.begin(i, version)

    def begin(self, i: int, version: int) -> None:
        self.version[i] = version
        spread = float(self.cfg["start_spread"])
        self.at(time.monotonic() + self.rng.uniform(0, spread) if spread else 0.0, i, "begin")

    def wait_version(self, i: int, after: int) -> None:
        self.send(i, "wait_version", {"model": self.cfg["model"], "after": after,
                                      "timeout": 10.0})

    def on_timer(self, i: int, kind: str, now: float) -> None:
        if kind == "flush":     # ``i`` is a node here
            self.flush(i)
        elif kind.startswith("try:"):
            self.try_again(i, int(kind[4:]), now)
        elif kind == "heartbeat" and self.beating[i]:   # its thread still waits for the last
            self.at(now + 0.25, i, "heartbeat")
        elif kind == "heartbeat":   # as `HubClient._heartbeat_loop`: due, or pushed back
            interval = self.lease[i] / 3
            due = self.heartbeat_due(self.last_beat[i], self.renewed[i], interval,
                                     publishing=False, phase=self.phase[i],
                                     wall_offset=self.wall_offset)
            if now < due:
                self.at(due, i, "heartbeat")
                return
            self.last_beat[i] = now
            self.send(i, "heartbeat", {"worker": self.worker(i), "publishing": []})
            self.beating[i] = True
            self.at(self.heartbeat_due(now, self.renewed[i], interval, publishing=False,
                                       phase=self.phase[i], wall_offset=self.wall_offset),
                    i, "heartbeat")
        elif kind == "begin":
            self.send(i, "begin_fetch", {"worker": self.worker(i), "model": self.cfg["model"],
                                         "version": self.version[i],
                                         "fetch_id": f"{self.worker(i)}/v{self.version[i]}"})
        elif kind == "report":
            self.try_report(i, now)
        elif kind == "end":
            self.finishing[i] = True
            self.finish(i)

    def on_reply(self, i: int, op: str, msg: Any, *, ok: bool) -> None:
        if ok and op in ("register", "heartbeat"):   # the lease the hub grants (it grows)
            self.lease[i] = float(msgspec.msgpack.decode(msg.body)["lease_s"])
        if op == "heartbeat":
            self.beating[i] = False
        elif op == "register":
            self.registered += ok   # heartbeats from now on, as a client's thread does
            interval, now = self.lease[i] / 3, time.monotonic()
            # as if its client connected at a random moment of the last interval; the first
            # heartbeat on its node's beat, as the client's thread sends it
            self.last_beat[i] = now - self.rng.uniform(0, interval)
            self.renewed[i] = -math.inf
            first = self.heartbeat_due(self.last_beat[i], -math.inf, interval, publishing=False,
                                       phase=self.phase[i], wall_offset=self.wall_offset)
            self.at(first if first >= now else first + interval, i, "heartbeat")
        elif op == "wait_version":
            v = msgspec.msgpack.decode(msg.body).get("version") if ok else None
            if v is not None and v > self.version[i] and not self.done[i]:
                self.begin(i, v)
            elif not self.stopping:
                self.wait_version(i, self.version[i])
        elif op == "begin_fetch":
            if not ok:
                self.done[i] = True
                return
            asked = _plan_budget.decode(msg.body).max_reports   # the hub's budget
            limits = [k for k in (self.max_reports, asked) if k is not None]
            self.most[i] = min(limits) if limits else None
            self.t0[i] = self.last[i] = time.monotonic()
            self.schedule_report(i)
            self.at(self.t0[i] + self.nreads * self.dt, i, "end")
        elif op == "report_progress":
            self.inflight[i] = False
            if self.finishing[i]:
                self.finish(i)
        elif op == "complete_fetch":
            self.done[i] = True
            self.completed += ok
            self.last_complete = time.time()
            if self.cfg["sync"]:
                self.wait_version(i, self.version[i])

    # --- the fetch engine's reports, read by read
    def fetched(self, k: int) -> int:
        return min(k * self.rc, self.chunks)

    def schedule_report(self, i: int) -> None:
        """The next read after which the engine would send a report (none: the end)."""
        k = max(self.k[i] + 1, self.reported[i] // self.rc + 1,
                math.ceil((self.last[i] + self.interval - self.t0[i]) / self.dt - 1e-9))
        most = self.most[i]
        if most is not None:
            if self.sent[i] >= most:
                return
            milestone = math.ceil((self.sent[i] + 1) * self.chunks / (most + 1))
            k = max(k, math.ceil(milestone / self.rc))
        if k < self.nreads:
            self.at(self.t0[i] + k * self.dt, i, "report")
            self.k[i] = k

    def try_report(self, i: int, now: float) -> None:
        if self.finishing[i]:
            return
        k = min(self.nreads, int((now - self.t0[i]) / self.dt + 1e-9))
        if self.inflight[i]:
            if self.max_reports is None:
                self.last[i] = now   # the engine's flush: the chunks wait for the next one
            self.k[i] = k
            self.schedule_report(i)
            return
        self.report(i, self.fetched(k))
        self.last[i] = now
        self.k[i] = k
        self.schedule_report(i)

    def report(self, i: int, upto: int) -> None:
        self.send(i, "report_progress", {"worker": self.worker(i),
                                         "fetch_id": f"{self.worker(i)}/v{self.version[i]}",
                                         "chunks": list(range(self.reported[i], upto))})
        self.reported[i] = upto
        self.sent[i] += 1
        self.inflight[i] = True

    def finish(self, i: int) -> None:
        """The end of a fetch: every chunk reported (one report at a time), then complete."""
        if self.inflight[i] or self.completing[i]:
            return
        if self.reported[i] < self.chunks and self.max_reports is None:
            self.report(i, self.chunks)   # the engine before: a last report, then complete
            return
        self.completing[i] = True   # the rest goes with complete_fetch (`HubPlanner.completes`)
        nbytes = self.chunks * int(self.cfg["chunk_size"])
        self.send(i, "complete_fetch", {"worker": self.worker(i),
                                        "fetch_id": f"{self.worker(i)}/v{self.version[i]}",
                                        "traffic": {"trainer": [nbytes, nbytes]}})

    def result(self) -> dict[str, Any]:
        return {"hist": self.hist, "bins": self.bins, "errors": self.errors,
                "completed": self.completed, "last_complete": self.last_complete,
                "reports": self.sent, "resends": self.resends, "timeouts": self.timeouts,
                "lease_s": max(self.lease), "batches": self.batches, "batched": self.batched,
                "joined": self.joined,
                "batch_sizes": self.batch_sizes}

    def close(self) -> None:
        for s in [*self.socks, *self.node_socks]:
            s.close(0)


def _run(args: argparse.Namespace) -> int:
    if args.broadcast is not None:
        return _run_broadcast(args)
    args.chunks = 256 if args.chunks is None else args.chunks
    if min(args.workers, args.readers, args.chunks) < 1 or args.seconds <= 0:
        raise BadInput("--workers, --readers and --chunks must be >= 1 and --seconds > 0")
    modes = ["on", "off", "curve"] if args.auth == "all" else [args.auth]
    runs = [bench_ops(args.workers, args.seconds, auth=auth) for auth in modes]
    plans = bench_plans(args.readers, args.chunks)
    out = {"ops": runs[0], "plans": plans,
           **{f"ops_{r['auth']}": r for r in runs[1:]},
           **({"auth_cost": bench_auth()} if "on" in modes else {})}
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table("measure", "value", title="fabric bench hub")
    t.add_row("simulated workers", str(runs[0]["workers"]))
    for ops in runs:
        mode = {"on": "signed", "off": "insecure", "curve": "signed, CURVE"}[ops["auth"]]
        t.add_row(f"control ops/s ({mode}: heartbeat, begin_fetch, report_progress)",
                  f"{ops['ops_per_s']:,.0f}")
        t.add_row(f"latency p50 / p99 ({mode})",
                  f"{ops['p50_ms']:.2f} ms / {ops['p99_ms']:.2f} ms")
        t.add_row(f"errors ({mode})", str(ops["errors"]))
    if "auth_cost" in out:
        cost = out["auth_cost"]
        t.add_row("signing a request (client) / checking it and signing the reply (hub)",
                  f"{cost['client_sign_us']:.1f} us / {cost['hub_verify_and_sign_us']:.1f} us")
    t.add_row(f"plans for {plans['readers']} readers ({plans['chunks']} chunks)",
              f"{plans['plan_total_s']:.2f} s total, {plans['plan_mean_ms']:.2f} ms mean, "
              f"{plans['plan_p99_ms']:.2f} ms p99")
    Console().print(t)
    return EXIT_OK


def _run_broadcast(args: argparse.Namespace) -> int:
    max_reports: int | None = ENGINE_MAX_REPORTS
    if args.max_reports is not None:
        if args.max_reports.lower() == "none":
            max_reports = None
        elif args.max_reports.isdigit():
            max_reports = int(args.max_reports)
        else:
            raise BadInput(f"--max-reports takes a number >= 0 or 'none', not "
                           f"{args.max_reports!r}")
    interval = ENGINE_REPORT_INTERVAL if args.report_interval is None else args.report_interval
    if (args.broadcast < 1 or (args.chunks is not None and args.chunks < 1)
            or args.read_chunks < 1 or args.fetch_seconds < 0 or args.lease <= 0
            or interval < 0 or args.start_spread < 0 or (args.settle or 0) < 0
            or (args.reader_procs is not None and args.reader_procs < 1)):
        raise BadInput("--broadcast, --chunks, --read-chunks and --reader-procs must be >= 1, "
                       "--lease > 0, and --fetch-seconds, --report-interval, "
                       "--start-spread and --settle >= 0")
    out = bench_broadcast(args.broadcast, fetch_seconds=args.fetch_seconds,
                          chunks=args.chunks or 1024, read_chunks=args.read_chunks,
                          lease_s=args.lease, procs=args.reader_procs,
                          start_spread=args.start_spread, report_interval=interval,
                          max_reports=max_reports, sync=args.sync,
                          report_budget=getattr(args, "report_budget", "hub"),
                          heartbeat_rate=getattr(args, "heartbeat_rate", "hub"),
                          relay=args.relay, relay_window=args.relay_window,
                          baseline_s=args.settle, profile=args.profile)
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table("measure", "value", title=f"fabric bench hub --broadcast {out['readers']}")
    t.add_row("readers (completed) / reader processes",
              f"{out['readers']:,} ({out['completed']:,}) / {out['reader_procs']}")
    t.add_row("version: begin_publish to the last complete_fetch", f"{out['version_seconds']:.2f} s")
    t.add_row("hub CPU per version (heartbeats included / beyond the idle rate)",
              f"{out['hub_cpu_s_per_version']:.2f} s / {out['hub_cpu_s_per_version_net']:.2f} s")
    t.add_row("hub ops/s during the version", f"{out['ops_per_s']:,.0f}")
    t.add_row("hub CPU by thread (the hub's loop / zmq's I/O)",
              f"{out['hub_cpu_s_by_thread'].get('main', 0.0):.2f} s / "
              f"{out['hub_cpu_s_by_thread'].get('ZMQbg/IO', 0.0):.2f} s")
    t.add_row("heartbeats only before the version (--settle)", f"{out['settle_s']:.1f} s")
    t.add_row("busy: hub's core / the readers' cores",
              f"{out['hub_cpu_util']:.0%} / {out['readers_cpu_util']:.0%}")
    first = out["first_second_cpu_s"]
    t.add_row("CPU in the second after the commit: hub / readers",
              f"{first['hub']:.2f} s / {first['readers']:.2f} s")
    if out["relay"]:
        t.add_row("through relays: batches / requests / begins joined",
                  f"{out['relay_batches']:,} / {out['relay_batched']:,} / "
                  f"{out['relay_joined']:,}")
    for op, lat in out["latency_ms"].items():
        t.add_row(f"{op} p50 / p99 ({lat['count']:,})",
                  f"{lat['p50']:.2f} ms / {lat['p99']:.2f} ms")
    r = out["reports_per_fetch"]
    t.add_row("progress reports per fetch (min / mean / max)",
              f"{r['min']} / {r['mean']} / {r['max']}")
    t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in out["errors"].items()) or "none")
    Console().print(t)
    return EXIT_OK
