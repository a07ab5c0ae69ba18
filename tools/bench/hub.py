"""`fabric bench hub`: control-plane throughput and latency, and plan computation time.

Simulates ``--workers`` workers on loopback from one process (one DEALER socket each,
multiplexed by a zmq poller): each registers, then runs a closed loop of heartbeats
and progress reports against a hub on a background thread. Separately times
`HubState.begin_fetch` plans for ``--readers`` readers of one version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import zmq

from weightfabric.tools.command import EXIT_OK, BadInput, Console, add_command


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
    p.add_argument("--chunks", type=int, default=256, help="chunks per version (default 256)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_ops(num_workers: int, seconds: float) -> dict:
    """Closed-loop heartbeats and progress reports from ``num_workers`` DEALER sockets."""
    from weightfabric.fabric.hub.server import serve
    from weightfabric.fabric.manifest import Manifest, TensorSpec
    from weightfabric.fabric.protocol import REQUEST, decode, encode
    from weightfabric.fabric.zmq_util import make_socket

    hub = serve("tcp://127.0.0.1:0", lease_s=120.0)
    socks: list[zmq.Socket] = []
    try:
        poller = zmq.Poller()
        for _ in range(num_workers):
            s = make_socket(zmq.DEALER, max_message_size=1 << 24)
            s.connect(hub.url)
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        index = {s: i for i, s in enumerate(socks)}
        req = [0] * num_workers
        sent_at = [0.0] * num_workers

        def send(i: int, op: str, args: dict) -> None:
            req[i] += 1
            sent_at[i] = time.perf_counter()
            socks[i].send(encode(REQUEST, req[i], f"s{i}", op, {"worker": f"w{i}", **args}))

        def drain(deadline: float, on_reply) -> None:
            while time.perf_counter() < deadline:
                for s, _ in poller.poll(100):
                    while True:
                        try:
                            raw = s.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        on_reply(index[s], decode(raw))

        pending = set(range(num_workers))
        for i in range(num_workers):
            send(i, "register", {"location": {"datacenter": f"dc{i % 2}", "node": f"n{i % 50}"}})
        t_end = time.perf_counter() + 30
        while pending and time.perf_counter() < t_end:
            for s, _ in poller.poll(100):
                while True:
                    try:
                        decode(s.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    pending.discard(index[s])
        # One version published by w0 so half the loop can be progress reports of fetches.
        spec = TensorSpec("w", (1 << 20,), "uint8", 1 << 20, 0)
        manifest = Manifest((spec,), 1 << 14).to_wire()
        t0 = socks[0]
        t0.send(encode(REQUEST, 10**6, "s0", "begin_publish",
                       {"worker": "w0", "model": "m", "manifest": manifest}))
        decode(t0.recv())
        t0.send(encode(REQUEST, 10**6 + 1, "s0", "commit",
                       {"worker": "w0", "model": "m", "version": 1}))
        decode(t0.recv())
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
        return {"workers": num_workers, "ops": len(latencies), "seconds": round(elapsed, 3),
                "ops_per_s": round(len(latencies) / elapsed, 1), "errors": errors,
                "p50_ms": round(1e3 * _pct(latencies, 0.50), 3),
                "p99_ms": round(1e3 * _pct(latencies, 0.99), 3),
                "registered": num_workers - len(pending)}
    finally:
        for s in socks:
            s.close(0)
        hub.stop()


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


def _run(args: argparse.Namespace) -> int:
    if min(args.workers, args.readers, args.chunks) < 1 or args.seconds <= 0:
        raise BadInput("--workers, --readers and --chunks must be >= 1 and --seconds > 0")
    ops = bench_ops(args.workers, args.seconds)
    plans = bench_plans(args.readers, args.chunks)
    out = {"ops": ops, "plans": plans}
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table("measure", "value", title="fabric bench hub")
    t.add_row("simulated workers", str(ops["workers"]))
    t.add_row("control ops/s (heartbeat, begin_fetch, report_progress)", f"{ops['ops_per_s']:,.0f}")
    t.add_row("latency p50 / p99", f"{ops['p50_ms']:.2f} ms / {ops['p99_ms']:.2f} ms")
    t.add_row("errors", str(ops["errors"]))
    t.add_row(f"plans for {plans['readers']} readers ({plans['chunks']} chunks)",
              f"{plans['plan_total_s']:.2f} s total, {plans['plan_mean_ms']:.2f} ms mean, "
              f"{plans['plan_p99_ms']:.2f} ms p99")
    Console().print(t)
    return EXIT_OK
