"""`fabric bench failover`: how long the control plane is gone when the leading hub dies.

Two hubs serve one 3-member etcd cluster (`tools.etcd_cluster.EtcdCluster`, real etcd
processes on loopback; each hub a ``fabric hub serve --store etcd://...`` process); a
trainer and ``--readers`` readers (`tools.bench.agent` processes, each with its own
``WEIGHTFABRIC_HOST_ID``, so they read each other over TCP as on separate machines) are
given both hubs' URLs. Each of ``--runs`` runs:

1. the trainer publishes a new version (``--mb`` MB of `agent.bench_tensors`), and an admin
   client writes records through the leader: a retention policy (``keep_last`` 2 and 3 in
   turn: more retained versions than a store has buffers would leave a reader, the last
   holder of old ones, no buffer to fetch into) and a rendezvous key (``kv_put``) with
   the run's number;
2. every reader starts fetching that version; as soon as the first chunk lands at one of
   them, the leading hub's process is SIGKILLed (the fetches are in flight: how many had
   chunks left to read at the kill is ``in_flight_at_kill``, taken from each reader's
   per-chunk timestamps);
3. a probe asks every hub URL, each with its own client and short timeouts, where the
   version can be read (``locate``) until one answers a plan that names only live
   workers: ``failover_s`` is that time less the kill's. ``leader_s`` is when a hub first
   answered as the leader (the standby won the etcd election);
4. every reader's fetch must finish, and its bytes' sha256 equal the trainer's
   (``fetches_verified``); the records written before the kill must all be at the new
   leader: the policy, every key put so far, the version committed and the next number
   one above it, and the version one above the previous run's (``lost_records`` counts
   what is missing or wrong);
5. the killed hub is started again on its port (clients know only the URLs they were
   given), as a standby: the next run kills the other hub.

The baseline (``state_dir``) runs the same with one hub keeping its records in a
``--state-dir``: SIGKILLed, then started again at once on the same port and directory (a
supervisor that restarts it without delay); ``failover_s`` includes that restart.

A run that has no plan within `RECOVER_S` of the kill, or whose fetches do not end within
`RECOVER_S` of the plan, stops its mode with an error in the result (``error``); the
command then exits 1, as it does when a fetch fails or is not bit-exact, a record is
lost, or a kill found every fetch done (``verified`` is false). Every process (etcd
members, hubs, agents) is ended on every way out. Progress goes to stderr, one line per
run.

The result (``--json``), per set-up (``etcd``, ``state_dir``): ``runs`` done,
``failover_s`` and ``leader_s`` per run with ``median_s``, ``max_s`` (of ``failover_s``)
and ``leader_median_s``; ``fetches_verified`` of ``fetches``; ``lost_records`` and what
they were (``lost``); per run ``in_flight_at_kill``, ``fetches_done_s`` (the last reader's
fetch returned this long after the kill) and ``plan_named`` (the holders of the first
plan); ``fetch_errors``, ``error``, ``hubs``. Beside them: ``target_s`` and
``target_met`` (every etcd run within it), ``runs``, ``readers``, ``mb``, ``lease_s``,
``verified``, ``machine`` and ``date``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from weightfabric.tools.bench.launch import ROOT, Agent, AgentError, close_all, print_result
from weightfabric.tools.command import Console, add_command

if TYPE_CHECKING:
    from weightfabric.fabric.client import HubClient

MODES = ("etcd", "state_dir")
"""The two set-ups, in the order run (``--mode`` takes ``etcd``, ``state-dir`` or ``both``)."""
MODEL = "bench"
"""The model the agents publish and fetch (`tools.bench.agent`'s)."""
TARGET_S = 5.0
"""The goal for the etcd service: a plan again within this long of the leader's death."""
RECOVER_S = 60.0
"""A run with no plan this long after the kill, or whose fetches do not end this long
after the plan, fails."""
START_S = 60.0
"""Longest wait for a hub to print its URL, a leader to be elected, an agent to start."""
BIND_RETRY_S = 10.0
"""How long a hub restarted on its old port keeps trying while the port is still taken."""
PROBE_TIMEOUT_S = 1.0
"""Each probe call's deadline (a silent hub costs a probe this long, then it asks again)."""
PROBE_EVERY_S = 0.02
"""Pause between two probe calls to one hub."""
CHUNK = 1 << 20
"""Chunk size of the agents' stores: 64 chunks at the default 64 MB."""
LEASE_S = 10.0
"""The hubs' worker lease (``fabric hub serve --lease``'s default): workers heartbeat
every third of it, so it bounds when an idle holder finds the new leader."""


class FailoverError(RuntimeError):
    """The bench could not set up or measure a run (a hub did not start, no leader)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench failover`."""
    p = add_command(
        subparsers, "failover",
        help="time from SIGKILL of the leading hub to the next plan: etcd vs --state-dir",
        handler=_run, bad_input=(ValueError,), failures=(AgentError, FailoverError),
        description="Two hubs over a 3-member etcd, a trainer and --readers readers given\n"
                    "both URLs. Each run publishes a version, writes records, starts every\n"
                    "reader's fetch and SIGKILLs the leading hub once the first chunk\n"
                    "lands; the time until a hub plans again (a locate naming live\n"
                    "workers) is the run's failover. Then every fetch must finish\n"
                    "bit-exact and every record written before the kill be at the new\n"
                    "leader; the killed hub comes back on its port as a standby. The\n"
                    "baseline: one hub with --state-dir, killed and started again on its\n"
                    "port. Exits 1 if a run does not recover, a fetch is not bit-exact, a\n"
                    "record is lost, or a kill found no fetch in flight.",
        examples=["fabric bench failover --runs 10 --json",
                  "fabric bench failover --mode etcd --runs 3 --readers 2 --mb 8"])
    p.add_argument("--runs", type=int, default=10, help="kills per mode (default 10)")
    p.add_argument("--readers", type=int, default=4,
                   help="reader processes fetching at each kill (default 4)")
    p.add_argument("--mb", type=int, default=64, help="MB per version (default 64)")
    p.add_argument("--mode", choices=["etcd", "state-dir", "both"], default="both",
                   help="the etcd service, the --state-dir baseline, or both (default)")
    p.add_argument("--lease", type=float, default=LEASE_S,
                   help=f"the hubs' worker lease in seconds (default {LEASE_S:g}, the hub's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ----------------------------------------------------------------------------- hubs


class HubProcess:
    """One ``fabric hub serve`` process, started (again) by `start` and SIGKILLed by `kill`.

    Args:
        name: for messages and its log file.
        options: ``fabric hub serve`` options besides the port (the store or state dir).
        log_dir: where its stderr goes (``hub-NAME.log``, appended at each start).
    """

    def __init__(self, name: str, options: list[str], log_dir: Path) -> None:
        self.name = name
        self.options = options
        self.log = log_dir / f"hub-{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0

    def start(self, port: int = 0, timeout: float = START_S) -> str:
        """Start the hub on ``port`` (0: any) and return its URL once it serves.

        On a given port it tries again for `BIND_RETRY_S` while the port is still taken.

        Raises:
            FailoverError: it exited or printed no URL in ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        bind_deadline = time.monotonic() + BIND_RETRY_S
        while True:
            error = self._try_start(port, deadline)
            if error is None:
                return self.url
            if port == 0 or time.monotonic() > min(bind_deadline, deadline):
                raise FailoverError(f"hub {self.name} did not start on port {port}: "
                                    f"{error}\n--- its log ({self.log}):\n{self._tail()}")
            time.sleep(0.1)

    def _try_start(self, port: int, deadline: float) -> str | None:
        argv = [sys.executable, "-m", "weightfabric.tools", "hub", "serve",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
                *self.options]
        # Killed with us if this process dies without cleaning up (SIGKILL): the parent
        # death signal (set from the main thread only: it fires when the starting thread
        # exits).
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            argv = [setpriv, "--pdeathsig", "KILL", *argv]
        with open(self.log, "a") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=log, text=True, cwd=ROOT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.proc = proc
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:   # reads every line, so that the hub never blocks on stdout
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name=f"hub-{self.name}-stdout", daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                return "no 'fabric hub serving at' line in time"
            if line is None:
                proc.wait(10)
                self.proc = None
                return f"it exited with status {proc.returncode}"
            if line.startswith("fabric hub serving at "):
                self.url = line.split()[-1]
                self.port = int(self.url.rsplit(":", 1)[1])
                return None

    def alive(self) -> bool:
        """Whether its process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL the process; returns when (``time.monotonic()``) the signal went."""
        proc, self.proc = self.proc, None
        at = time.monotonic()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        return at

    def _tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def _observer(url: str, secret: Path, timeout: float) -> HubClient:
    import weightfabric as wf

    return wf.connect(url, timeout=timeout, secret_file=secret)


def _leads(service: dict[str, Any] | None) -> bool:
    """Whether a hub's ``status()["service"]`` says it serves: it leads, or runs alone."""
    return service is None or service.get("role") in ("leader", "single")


def _leader(hubs: list[HubProcess], secret: Path, timeout: float = START_S) -> int:
    """The index in ``hubs`` of the one that leads, once one does.

    Raises:
        FailoverError: none leads within ``timeout`` seconds.
    """
    import weightfabric as wf

    deadline = time.monotonic() + timeout
    while True:
        for i, hub in enumerate(hubs):
            if not hub.alive():
                continue
            try:
                with _observer(hub.url, secret, 2.0) as c:
                    service = c.status().get("service")
            except wf.HubError:
                continue
            if _leads(service):
                return i
        if time.monotonic() > deadline:
            raise FailoverError(f"no hub of {[h.url for h in hubs]} leads after {timeout:g} s")
        time.sleep(0.1)


# ---------------------------------------------------------------------------- probe


class Probe:
    """Asks every hub URL, one thread and client each, where a version can be read.

    ``plan_at``: when (``time.monotonic()``) a hub first answered a `HubClient.locate`
    whose every shard has holders, all of them in ``live``; ``leader_at``: when a hub first
    said it leads (its ``status()``; a hub alone, ``single``, always does). Start it
    right after the kill: the dead hub's thread only times out until it comes back.
    """

    def __init__(self, urls: list[str], version: int, live: set[str], secret: Path) -> None:
        self.version, self.live, self.secret = version, live, secret
        self.plan_at: float | None = None
        self.leader_at: float | None = None
        self.named: list[str] = []
        self.errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(url,), daemon=True,
                                          name=f"failover-probe-{url}") for url in urls]
        for t in self._threads:
            t.start()

    def wait(self, timeout: float) -> bool:
        """Wait for a plan; stop every thread either way. Returns whether one came."""
        got = self._done.wait(timeout)
        self._done.set()
        for t in self._threads:
            t.join(PROBE_TIMEOUT_S * 3 + 5)
        return got

    def _ask(self, url: str) -> None:
        import weightfabric as wf

        client: HubClient | None = None
        try:
            while not self._done.is_set():
                try:
                    if client is None:
                        client = _observer(url, self.secret, PROBE_TIMEOUT_S)
                    if self.leader_at is None:
                        service = client.status().get("service")
                        if _leads(service):
                            with self._lock:
                                self.leader_at = self.leader_at or time.monotonic()
                    where = client.locate_reply(MODEL, self.version)
                    holders = {w for shard in where.shards for w in shard.holders}
                    if (where.shards and all(shard.holders for shard in where.shards)
                            and holders <= self.live):
                        with self._lock:
                            if self.plan_at is None:
                                self.plan_at, self.named = time.monotonic(), sorted(holders)
                        self._done.set()
                        return
                    self.errors[url] = f"a plan naming {sorted(holders - self.live)} (not live)"
                except wf.HubError as exc:
                    self.errors[url] = f"{type(exc).__name__}: {exc}"
                self._done.wait(PROBE_EVERY_S)
        finally:
            if client is not None:
                client.close()


# ------------------------------------------------------------------------- one mode


class Readers:
    """The first progress line of each reader's fetch in the current run (`Agent` hook)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.totals: dict[str, int] = {}

    def on_progress(self, name: str, done: int, total: int) -> None:
        """Called on an agent's pump thread for each progress line."""
        self.totals[name] = total
        if done >= 1:
            self.started.set()


def _held_at(samples: list[list[float]], when: float) -> int:
    """Chunks a reader held at wall-clock time ``when`` (its fetch's per-chunk samples)."""
    return max((int(done) for t, done in samples if t <= when), default=0)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def bench_mode(mode: str, *, runs: int, readers: int, mb: int, lease: float, tmp: Path,
               secret: Path, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """``runs`` kills of the leading hub in ``mode`` (``etcd`` or ``state_dir``); its result.

    Raises:
        FailoverError, AgentError: the set-up failed (before the first run).
    """
    from weightfabric.tools.etcd_cluster import EtcdCluster

    result: dict[str, Any] = {
        "runs": 0, "failover_s": [], "leader_s": [], "median_s": None, "max_s": None,
        "lost_records": 0, "lost": [], "fetches_verified": 0, "fetches": 0,
        "in_flight_at_kill": [], "fetches_done_s": [], "plan_named": [], "fetch_errors": [],
        "error": None, "hubs": 2 if mode == "etcd" else 1}
    cluster: EtcdCluster | None = None
    hubs: list[HubProcess] = []
    agents: list[Agent] = []
    admin: HubClient | None = None
    try:
        common = ["--lease", f"{lease:g}", "--secret-file", str(secret)]
        if mode == "etcd":
            cluster = EtcdCluster(3, base_dir=tmp).start()
            store = f"{cluster.url}/failover"
            hubs = [HubProcess(f"etcd-{i}", ["--store", store, *common], tmp) for i in range(2)]
        else:
            state = tmp / "state"
            hubs = [HubProcess("state-dir", ["--state-dir", str(state), *common], tmp)]
        for hub in hubs:
            hub.start()
        urls = [hub.url for hub in hubs]
        service = ",".join(urls)
        _leader(hubs, secret)
        log(f"{mode}: hubs {service}" + (f" over {cluster.url}" if cluster else ""))

        progress = Readers()
        names = ["trainer", *(f"reader-{i}" for i in range(readers))]
        env = {"WEIGHTFABRIC_SECRET_FILE": str(secret)}
        for name in names:
            agents.append(Agent(name, env={**env, "WEIGHTFABRIC_HOST_ID": f"failover-{name}"},
                                on_progress=progress.on_progress, ready_timeout=None))
        for agent in agents:
            agent.reply(START_S)
        for agent in agents:
            agent.ask("join", url=service, name=agent.name, chunk_size=CHUNK, timeout=START_S)
        trainer, fetchers = agents[0], agents[1:]
        import weightfabric as wf

        admin = wf.connect(service, timeout=10.0, secret_file=secret)
        live = set(names)
        keys: dict[str, bytes] = {}
        previous: int | None = None
        for run in range(runs):
            try:
                outcome = _one_run(run, mode=mode, hubs=hubs, urls=urls, trainer=trainer,
                                   fetchers=fetchers, admin=admin, progress=progress,
                                   live=live, keys=keys, previous=previous, mb=mb,
                                   secret=secret, result=result, log=log)
            except (FailoverError, AgentError, wf.HubError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            if isinstance(outcome, str):
                result["error"] = f"run {run + 1}: {outcome}"
                log(f"{mode} run {run + 1}/{runs} failed: {outcome}")
                break
            previous = outcome
    finally:
        if admin is not None:
            admin.close()
        close_all(agents)
        for hub in hubs:
            hub.kill()
        if cluster is not None:
            cluster.stop()
    times = result["failover_s"]
    result.update(median_s=_median(times), max_s=max(times) if times else None,
                  leader_median_s=_median(result["leader_s"]))
    return result


def _one_run(run: int, *, mode: str, hubs: list[HubProcess], urls: list[str], trainer: Agent,
             fetchers: list[Agent], admin: HubClient, progress: Readers, live: set[str],
             keys: dict[str, bytes], previous: int | None, mb: int, secret: Path,
             result: dict[str, Any], log: Callable[[str], None]) -> int | str:
    """One kill; adds to ``result``. Returns the version published, or why the run failed."""
    import weightfabric as wf

    leading = _leader(hubs, secret)
    published = trainer.ask("publish", size=mb << 20, seed=1, timeout=START_S)
    version = int(published["version"])
    keep = 2 + run % 2   # changes every run; never more than a reader's buffers can hold
    key, value = f"failover/run-{run}", str(run).encode()
    admin.set_retention(MODEL, keep_last=keep)
    admin.kv_put(key, value)
    keys[key] = value

    progress.started.clear()
    for r in fetchers:
        r.send("fetch", version=version, samples=True, options={"deadline": 2 * RECOVER_S})
    if not progress.started.wait(RECOVER_S):
        return f"no reader received a chunk of v{version} within {RECOVER_S:g} s"
    killed_wall = time.time()
    killed = hubs[leading].kill()
    probe = Probe(urls, version, live, secret)
    if mode == "state_dir":
        hubs[leading].start(hubs[leading].port)   # a supervisor restarting it at once
    if not probe.wait(max(0.0, killed + RECOVER_S - time.monotonic())):
        return (f"no plan for v{version} within {RECOVER_S:g} s of the kill of "
                f"{urls[leading]}; last answers: {probe.errors}")
    assert probe.plan_at is not None
    failover = probe.plan_at - killed
    leader = (probe.leader_at or probe.plan_at) - killed

    want = trainer.ask("digest")["sha256"]
    in_flight, verified, ends = 0, 0, []
    for r in fetchers:
        asked = time.monotonic()
        try:
            stats = r.reply(RECOVER_S)
        except AgentError as exc:   # a failed fetch; one that does not end stops the mode
            if r.proc.poll() is not None or time.monotonic() - asked >= RECOVER_S:
                return f"{r.name}'s fetch of v{version} did not end: {exc}"
            result["fetch_errors"].append(f"run {run + 1}: {exc}")
            continue
        total = progress.totals.get(r.name) or math.ceil(published["bytes"] / CHUNK)
        if _held_at(stats.get("samples", []), killed_wall) < total:
            in_flight += 1
        ends.append(float(stats["end"]) - killed_wall)
        if r.ask("digest")["sha256"] == want:
            verified += 1
        else:
            result["fetch_errors"].append(f"run {run + 1}: {r.name}'s v{version} differs")

    lost = _check_records(admin, version=version, keep=keep, keys=keys, previous=previous)
    result["lost"] += [f"run {run + 1}: {why}" for why in lost]
    result["lost_records"] += len(lost)
    result["fetches_verified"] += verified
    result["fetches"] += len(fetchers)
    result["in_flight_at_kill"].append(in_flight)
    result["failover_s"].append(round(failover, 4))
    result["leader_s"].append(round(leader, 4))
    result["fetches_done_s"].append(round(max(ends), 4) if ends else None)
    result["plan_named"].append(probe.named)
    result["runs"] += 1
    log(f"{mode} run {run + 1}: failover {failover:.2f} s (a leader after {leader:.2f} s), "
        f"{in_flight}/{len(fetchers)} fetches in flight at the kill, {verified} verified, "
        f"{len(lost)} records lost")
    if mode == "etcd":   # back on its port, as a standby: the next run kills the other
        hubs[leading].start(hubs[leading].port)
    with contextlib.suppress(wf.HubError):
        admin.status()    # the admin client back at the leader before the next run
    return version


def _check_records(admin: HubClient, *, version: int, keep: int, keys: dict[str, bytes],
                   previous: int | None) -> list[str]:
    """What of the records written before the kill the leader lacks or has wrong."""
    import weightfabric as wf

    lost: list[str] = []
    model = admin.status()["models"].get(MODEL)
    if model is None:
        return [f"model {MODEL!r} unknown"] + [f"key {k}" for k in keys]
    if model["policy"].get("keep_last") != keep:
        lost.append(f"keep_last {model['policy'].get('keep_last')}, not {keep}")
    states = {v["version"]: v["state"] for v in model["versions"]}
    if states.get(version) != "committed":
        lost.append(f"v{version} is {states.get(version, 'missing')}, not committed")
    if model["next_version"] != version + 1:
        lost.append(f"next version {model['next_version']}, not {version + 1}")
    if previous is not None and version != previous + 1:
        lost.append(f"v{version} published after v{previous}")
    for key, value in keys.items():
        try:
            got = admin.kv_get(key, timeout=0)
        except wf.HubError:
            lost.append(f"key {key} missing")
            continue
        if got != value:
            lost.append(f"key {key} is {got!r}, not {value!r}")
    return lost


# --------------------------------------------------------------------------- command


def machine() -> dict[str, Any]:
    """What ran the bench: CPU model and cores, memory, OS and Python."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 2**20, 1)
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory,
            "os": platform.platform(), "python": platform.python_version()}


def bench_failover(*, runs: int = 10, readers: int = 4, mb: int = 64,
                   modes: tuple[str, ...] = MODES, lease: float = LEASE_S,
                   log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Both set-ups' (or ``modes``') failover over ``runs`` kills each; the bench's result.

    Raises:
        ValueError: bad numbers or modes.
        FailoverError, AgentError: a set-up failed.
    """
    if runs < 1 or readers < 1 or mb < 1:
        raise ValueError(f"--runs, --readers and --mb must be at least 1 "
                         f"(got {runs}, {readers}, {mb})")
    if lease <= 0:
        raise ValueError(f"--lease must be > 0, got {lease:g}")
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    from weightfabric.fabric.auth import ensure_secret

    out: dict[str, Any] = {"runs": runs, "readers": readers, "mb": mb, "lease_s": lease,
                           "target_s": TARGET_S}
    with tempfile.TemporaryDirectory(prefix="wf-failover-") as tmp:
        secret, _ = ensure_secret(Path(tmp) / "secret" / "secret")
        for mode in modes:
            work = Path(tmp) / mode
            work.mkdir()
            out[mode] = bench_mode(mode, runs=runs, readers=readers, mb=mb, lease=lease,
                                   tmp=work, secret=secret, log=log)
    if "etcd" in out:
        worst = out["etcd"]["max_s"]
        out["target_met"] = worst is not None and worst <= TARGET_S
    out["verified"] = all(
        out[m]["error"] is None and out[m]["runs"] == runs and out[m]["lost_records"] == 0
        and out[m]["fetches_verified"] == runs * readers
        and min(out[m]["in_flight_at_kill"]) >= 1 for m in modes)
    out["machine"] = machine()
    return out


def _run(args: argparse.Namespace) -> int:
    modes = MODES if args.mode == "both" else (args.mode.replace("-", "_"),)

    def log(line: str) -> None:
        print(f"failover: {line}", file=sys.stderr, flush=True)

    result = bench_failover(runs=args.runs, readers=args.readers, mb=args.mb, modes=modes,
                            lease=args.lease, log=log)
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench failover: {r['runs']} SIGKILLs of the leading hub per "
                        f"set-up, {r['readers']} reader(s) fetching {r['mb']} MB at each")
    for column in ("set-up", "runs", "median s", "max s", "leader s (median)",
                   "in flight at kill", "fetches verified", "records lost"):
        table.add_column(column, justify="left" if column == "set-up" else "right")
    names = {"etcd": "2 hubs over etcd", "state_dir": "1 hub, --state-dir, restarted"}
    for mode in MODES:
        if mode not in r:
            continue
        m = r[mode]

        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"
        table.add_row(names[mode], str(m["runs"]), s(m["median_s"]), s(m["max_s"]),
                      s(m["leader_median_s"]), ", ".join(map(str, m["in_flight_at_kill"])),
                      f"{m['fetches_verified']}/{m['fetches']}", str(m["lost_records"]))
    console.print(table)
    for mode in MODES:
        if mode in r:
            console.print(f"{mode} failover s: " + ", ".join(f"{x:.2f}"
                                                            for x in r[mode]["failover_s"]))
            for line in [r[mode]["error"], *r[mode]["fetch_errors"], *r[mode]["lost"]]:
                if line:
                    console.print(f"[red]{mode}: {line}[/red]")
    if "target_met" in r:
        mark = "[green]met[/green]" if r["target_met"] else "[red]missed[/red]"
        console.print(f"target: etcd failover <= {r['target_s']:g} s in every run: {mark}")
    mc = r["machine"]
    console.print(f"machine: {mc['cpu']}, {mc['cores']} cores, {mc['memory_gib']} GiB")
