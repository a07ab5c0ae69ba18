"""`fabric bench hub`: control-plane throughput and latency, and plan computation time.

Simulates ``--workers`` workers on loopback from one process (one DEALER socket each,
multiplexed by a zmq poller): each registers, then runs a closed loop of heartbeats
and progress reports against a hub on a background thread, every request signed and
every reply checked as `HubClient` does (``--auth both`` also runs a hub with
authentication off, for the cost of it). Separately times `HubState.begin_fetch`
plans for ``--readers`` readers of one version.
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
    p.add_argument("--auth", choices=["on", "off", "curve", "all"], default="all",
                   help="signed requests (on), a hub run --insecure (off), signed on a "
                        "CURVE-encrypted channel (curve), or all three in one run (default all)")
    p.add_argument("--json", action="store_true", help="print JSON")


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


def _run(args: argparse.Namespace) -> int:
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
