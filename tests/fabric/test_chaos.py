r"""Chaos test of the CPU data plane.

Random, seeded schedules of publishes, fetches, kills, joins, retracts and corruption across
worker processes, checked against the contracts (docs/design.md).

Per seed: an in-process hub (short leases), a trainer and a few rollouts, each a
`tests/fabric_process.py` process, spread over two pretend hosts
(``WEIGHTFABRIC_HOST_ID``: same host reads over shared memory, unverified by
default; across hosts over TCP, verified), some reading slowly (``--read-delay``)
so that actions land while fetches are in flight. Each round:

1. the trainer publishes a new version (fresh contents);
2. maybe one idle rollout's replica of the previous version is corrupted (fetches
   of that version then verify);
3. new rollouts may join; they and some others fetch, concurrently, the latest or
   the previous (still retained) version, and meanwhile, at random moments: a
   rollout is SIGKILLed (fetching, or a holder others read from), or SIGSTOPped for
   shorter or longer than a lease, then SIGCONTed; the hub's loop stalls for
   shorter or longer than a lease; a new one joins under a new name; the trainer
   or an idle rollout retracts a version and, when the retract says ``done``,
   overwrites that memory at once (contract 1 allows it: a reader still copying
   from it would return wrong bytes);
4. every live rollout fetches the latest version.

Checked: a fetch that returns is bit-exact and of the version asked for; a fetch
that fails raises a `fabric.errors` type (never another exception), within a
bound, and only where no good source was sure to stay (the trainer keeps every
version it has not retracted, so those fetches must succeed, unless the hub
dropped the trainer meanwhile because its lease ran out, which a loaded machine
can cause); every command answers within a bound (no hang); after every round
all live rollouts hold the latest version bit-exactly and the hub names it
``latest``; at the end every process exits by itself and no arena file of
theirs is left in /dev/shm. Workers are forked from a preloaded forkserver
(`procs.Proc(fork=True)`), so a join costs milliseconds, not a torch import.

The schedule (who does what, in which order, after which pause) is a function of
the seed alone; thread timing is not, so a replay repeats the actions, not every
interleaving. A failure names its seed and the schedule so far, with what each
command answered and when; ``-s`` prints the schedule of passing runs too.
Replay or soak::

    WEIGHTFABRIC_CHAOS_SEED=7 WEIGHTFABRIC_CHAOS_ROUNDS=20 \
        python -m pytest -q tests/fabric/test_chaos.py
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from procs import Proc, arena_files_of, running_cluster

import weightfabric as wf

SEEDS = ([int(os.environ["WEIGHTFABRIC_CHAOS_SEED"])] if os.environ.get("WEIGHTFABRIC_CHAOS_SEED")
         else [101, 202, 303])
ROUNDS = int(os.environ.get("WEIGHTFABRIC_CHAOS_ROUNDS", "6"))
MB = 32  # tensor_set size: about 16 MiB, 17 chunks of 1 MiB
ROLLOUTS = 4  # at the start; kills and joins keep MIN_ROLLOUTS to MAX_ROLLOUTS alive
MIN_ROLLOUTS, MAX_ROLLOUTS = 2, 6
LEASE_S = 3.0
READ_TIMEOUT, DEADLINE = 5.0, 20.0  # each fetch's FetchOptions
REPLY_BOUND = DEADLINE + 10.0  # every command answers within this (a typed error included)
RETRACT_WAIT = 8.0
HOSTS = ("chaos-a", "chaos-b")
DELAYS = (0.0, 0.0, 0.05, 0.15)  # --read-delay choices: slow readers are caught mid-fetch
PAUSES = (0.3, 1.5, 4.0)  # SIGSTOP lengths: shorter and longer than a lease


@dataclass
class Member:
    """A worker process and what the test knows of it."""

    proc: Proc
    host: str
    delay: float
    joined: bool = False
    paused: bool = False
    corrupted: set[int] = field(default_factory=set)  # versions whose bytes were flipped here
    pending: Pending | None = None  # the command it is busy with
    future: Pending | None = None  # a fetch_async whose result was not asked for yet


@dataclass
class Pending:
    """A command sent and not answered yet."""

    op: str
    args: dict[str, Any]
    sent: float
    must_succeed: bool = False
    expect: int | None = None  # the version a fetch must return


class ChaosFailure(AssertionError):
    pass


class Chaos:
    """One seeded run against a hub and its worker processes."""

    def __init__(self, seed: int, rounds: int, hub: wf.HubServer, spawn: Any) -> None:
        self.seed, self.rounds = seed, rounds
        self.rng = random.Random(seed)
        self.hub, self._spawn = hub, spawn
        self.log: list[str] = []
        self.start = time.monotonic()
        self.seeds: dict[int, int] = {}  # version -> tensor_set seed
        self.versions: list[int] = []
        self.trainer_holds: set[int] = set()  # versions the trainer serves (not retracted)
        self.trainer_lapses: list[float] = []  # when the hub dropped the trainer (lease)
        self.tainted: set[int] = set()  # versions a replica of which was corrupted
        self.rollouts: list[Member] = []
        self.spawned = 0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count(1000)
        self.hub_stall = 0.0  # seconds the hub's loop sleeps at its next tick
        tick = hub._tick

        def stalling_tick() -> None:  # runs on the hub's thread
            stall, self.hub_stall = self.hub_stall, 0.0
            time.sleep(stall)
            tick()

        hub._tick = stalling_tick
        self.trainer = self.spawn("trainer", host=HOSTS[0], delay=0.0)

    # --- bookkeeping --------------------------------------------------------------------

    def note(self, event: str) -> None:
        self.log.append(f"{time.monotonic() - self.start:6.2f}s {event}")

    def fail(self, why: str) -> ChaosFailure:
        return ChaosFailure(
            f"chaos seed {self.seed} failed: {why}\nreplay: WEIGHTFABRIC_CHAOS_SEED={self.seed} "
            f"WEIGHTFABRIC_CHAOS_ROUNDS={self.rounds} python -m pytest "
            "tests/fabric/test_chaos.py\nschedule so far:\n  " + "\n  ".join(self.log))

    def check(self, ok: bool, why: str) -> None:
        if not ok:
            raise self.fail(why)

    def dropped(self, worker: str, why: str) -> None:
        """The hub dropped a worker (called from the hub's thread, see `HubNews`).

        On a loaded machine even the trainer can miss its heartbeats for a lease: until it
        registers again, nothing it holds can be fetched, as contract 4 says.
        """
        self.note(f"hub dropped {worker}: {why}")
        if worker == self.trainer.proc.name and why.startswith("lease"):
            self.trainer_lapses.append(time.monotonic())

    def trainer_lapsed_since(self, t: float) -> bool:
        return any(lapse >= t for lapse in self.trainer_lapses)

    # --- processes ----------------------------------------------------------------------

    def spawn(self, name: str, *, host: str, delay: float) -> Member:
        """Start a worker (not waiting for it to join: `wait_joined`)."""
        proc = self._spawn(name, wait=False, fork=True, read_delay=delay,
                           args=["--read-timeout", str(READ_TIMEOUT), "--deadline", str(DEADLINE)],
                           env={"WEIGHTFABRIC_HOST_ID": host})
        self.note(f"spawn {name} host={host} read_delay={delay}")
        return Member(proc, host, delay)

    def spawn_rollout(self) -> Member:
        name = f"rollout-{self.spawned}"
        self.spawned += 1
        self.rollouts.append(self.spawn(name, host=self.rng.choice(HOSTS),
                                        delay=self.rng.choice(DELAYS)))
        return self.rollouts[-1]

    def wait_joined(self) -> None:
        for m in [self.trainer, *self.rollouts]:
            if not m.joined:
                try:
                    m.proc.wait_ready(60)
                except AssertionError as exc:
                    raise self.fail(str(exc)) from None
                m.joined = True

    def send(self, m: Member, op: str, *, must_succeed: bool = False,
             expect: int | None = None, **args: Any) -> None:
        assert m.pending is None, f"{m.proc.name} is busy with {m.pending}"
        m.pending = Pending(op, args, time.monotonic(), must_succeed, expect)
        shown = {k: v for k, v in args.items() if k != "seeds"}
        self.note(f"{m.proc.name}: {op} {shown}" + (" (must succeed)" if must_succeed else ""))
        m.proc.send(op, **args)

    def collect(self, m: Member) -> dict[str, Any]:
        """The reply to `m`'s pending command, checked.

        Within the bound, an error only of a fabric type and only where allowed, a fetch of
        the version asked for and bit-exact.
        """
        p = m.pending
        assert p is not None
        left = REPLY_BOUND - (time.monotonic() - p.sent)
        try:
            reply = m.proc.next_reply(max(0.1, left))
        except AssertionError as exc:
            raise self.fail(f"{m.proc.name}: no answer to {p.op} {p.args}: {exc}") from None
        took = time.monotonic() - p.sent
        m.pending = None
        self.note(f"  {m.proc.name} -> {_brief(reply)} in {took:.2f} s")
        if "error" in reply:
            self.check(reply.get("fabric", False),
                       f"{m.proc.name}: {p.op} raised an untyped {reply['error']}: "
                       f"{reply['message']}\n{reply.get('trace', '')}")
            self.check(not self.must_succeed(p), f"{m.proc.name}: {p.op} must succeed (the "
                       f"trainer serves it) but raised {reply['error']}: {reply['message']}")
        elif p.op == "fetch":
            # Where the trainer's lease ran out, the newest version may have had no live
            # replica for a while; "latest" then names the newest that had one.
            older_ok = p.args["version"] == "latest" and self.trainer_lapsed_since(p.sent)
            self.check(reply["version"] == p.expect
                       or (older_ok and reply["version"] in self.seeds
                           and reply["version"] < p.expect),
                       f"{m.proc.name} fetched v{reply['version']}, asked for "
                       f"{p.args['version']} (v{p.expect})")
            self.check(reply["exact"], f"{m.proc.name}: the fetch of v{p.expect} returned "
                       f"wrong bytes: {reply}")
        elif p.op == "retract" and reply["version"] is not None:
            self.check(reply["state"] in ("done", "retracting", "delayed"),
                       f"{m.proc.name}: retract answered {reply['state']!r}")
        return reply

    def must_succeed(self, p: Pending) -> bool:
        """A fetch of a version the trainer served all along must succeed.

        A fetch of a version the trainer served all along must succeed (the latest, or an
        older one it did not retract, even mid-fetch).
        """
        return (p.must_succeed and not self.trainer_lapsed_since(p.sent)
                and (p.expect == self.versions[-1] or p.expect in self.trainer_holds))

    def kill(self, m: Member) -> None:
        self.note(f"SIGKILL {m.proc.name}" + (f" (busy: {m.pending.op})" if m.pending else ""))
        m.proc.kill()
        self.rollouts.remove(m)

    def run_timeline(self, actions: list[tuple[float, Callable[[], None]]]) -> None:
        """Run the actions at their offsets from now, and what they schedule (`later`)."""
        start = time.monotonic()
        self.events = [(start + due, i, action) for i, (due, action) in enumerate(actions)]
        heapq.heapify(self.events)
        while self.events:
            due, _, action = heapq.heappop(self.events)
            time.sleep(max(0.0, due - time.monotonic()))
            action()

    def later(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (time.monotonic() + delay, next(self._order), action))

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        for _ in range(ROLLOUTS):
            self.spawn_rollout()
        self.wait_joined()
        for k in range(1, self.rounds + 1):
            self.round(k)
        self.finish()

    def round(self, k: int) -> None:
        self.note(f"--- round {k}")
        latest = self.publish()
        previous = self.versions[-2] if len(self.versions) > 1 else None
        holders = list(self.rollouts)  # they fetched `previous` in the last round
        joiners = self.join_some()
        others = self.rng.sample(holders, self.rng.randint(0, len(holders)))
        idle = [m for m in holders if m not in others]
        if previous is not None and idle and self.rng.random() < 0.5:
            self.corrupt(self.rng.choice(idle), previous)
        for m in [*joiners, *others]:
            self.start_fetch(m, latest, previous)
        self.run_timeline(self.actions())
        for m in [self.trainer, *self.rollouts]:
            if m.pending is not None:
                self.collect(m)
            if m.future is not None:
                self.ask_result(m)
                self.collect(m)
        self.wait_joined()
        self.settle(latest)

    def join_some(self) -> list[Member]:
        """New rollouts that fetch this round: from scratch, they read from everyone."""
        count = min(self.rng.choice([0, 1, 1, 2]), MAX_ROLLOUTS - len(self.rollouts))
        joiners = [self.spawn_rollout() for _ in range(count)]
        self.wait_joined()
        return joiners

    def publish(self) -> int:
        seed = self.rng.randrange(1 << 30)
        self.send(self.trainer, "publish", seed=seed, mb=MB)
        version = self.collect(self.trainer)["version"]
        self.check(not self.versions or version > self.versions[-1],
                   f"version {version} after {self.versions[-1:]}: not monotonic")
        self.seeds[version] = seed
        self.versions.append(version)
        self.trainer_holds.add(version)
        return version

    def corrupt(self, m: Member, version: int) -> None:
        """Flip bytes of `m`'s replica of `version` (if it has one): readers of it verify."""
        self.send(m, "corrupt", version=version)
        self.collect(m)
        m.corrupted.add(version)
        self.tainted.add(version)

    def start_fetch(self, m: Member, latest: int, previous: int | None) -> None:
        """`m` fetches the latest version, or the previous one (still retained).

        In the background (`fetch_async`) half the time, so it takes commands meanwhile.
        """
        target: int | str = "latest"
        if previous is not None and previous not in m.corrupted and self.rng.random() < 0.4:
            target = previous
        version = latest if target == "latest" else target
        verify = True if version in self.tainted else self.rng.choice([None, None, True])
        args = {"version": target, "verify": verify, "mb": MB,
                "seeds": {str(v): s for v, s in self.seeds.items()}}
        if self.rng.random() < 0.5:
            self.send(m, "fetch", must_succeed=True, expect=version, **args)
            return
        self.send(m, "fetch_async", **args)
        self.collect(m)
        m.future = Pending("fetch", args, time.monotonic(), True, version)

    def ask_result(self, m: Member) -> None:
        """Ask for the result of `m`'s fetch_async: collected as a fetch sent back then."""
        assert m.future is not None and m.pending is None
        m.pending, m.future = m.future, None
        self.note(f"{m.proc.name}: result")
        m.proc.send("result", timeout=max(0.1, REPLY_BOUND - (time.monotonic() - m.pending.sent)))

    def actions(self) -> list[tuple[float, Callable[[], None]]]:
        """What happens while the round's fetches run: (offset, action)."""
        kinds = [self.kill_one, self.kill_one, self.pause_one, self.join_one,
                 self.retract_trainer, self.retract_rollout, self.reopen_one, self.stall_hub,
                 lambda: None]
        chosen = self.rng.sample(kinds, self.rng.randint(1, 4))
        return sorted(((self.rng.uniform(0.02, 0.6), action) for action in chosen),
                      key=lambda a: a[0])

    def pause_one(self) -> None:
        """SIGSTOP a rollout, SIGCONT it later.

        A frozen reader or holder, whose lease may run out meanwhile (then the hub drops it,
        and it registers again).
        """
        ready = [m for m in self.rollouts if m.joined and not m.paused]
        if not ready:
            return
        m = self.rng.choice(ready)
        seconds = self.rng.choice(PAUSES)
        self.note(f"SIGSTOP {m.proc.name} for {seconds} s"
                  + (f" (busy: {m.pending.op})" if m.pending else ""))
        m.proc.pause()
        m.paused = True
        self.later(seconds, lambda: self.resume(m))

    def stall_hub(self) -> None:
        """The hub's loop reads no request for a while (as if its process were paused).

        Heartbeats queue up unread, which must not cost anyone its lease.
        """
        self.hub_stall = self.rng.choice(PAUSES)
        self.note(f"hub stalls for {self.hub_stall} s")

    def resume(self, m: Member) -> None:
        if m in self.rollouts:
            self.note(f"SIGCONT {m.proc.name}")
            m.proc.resume()
            m.paused = False

    def kill_one(self) -> None:
        """SIGKILL a rollout, most often one busy fetching (others may read from it)."""
        if len(self.rollouts) <= MIN_ROLLOUTS:
            return
        busy = [m for m in self.rollouts if m.pending is not None]
        self.kill(self.rng.choice(busy if busy and self.rng.random() < 0.7 else self.rollouts))
        if len(self.rollouts) <= MIN_ROLLOUTS or self.rng.random() < 0.5:
            self.spawn_rollout()

    def join_one(self) -> None:
        if len(self.rollouts) < MAX_ROLLOUTS:
            self.spawn_rollout()

    def retract_trainer(self) -> None:
        """The trainer retracts an older version it serves, then overwrites its memory.

        The trainer retracts an older version it serves (the previous one is then no longer
        sure to be fetchable) and, once done, overwrites its memory.
        """
        old = sorted(v for v in self.trainer_holds if v != self.versions[-1])
        if old and self.trainer.pending is None:
            version = self.rng.choice(old)
            self.trainer_holds.discard(version)  # it may refuse (RetentionError): not sure
            self.send(self.trainer, "retract", version=version, wait=RETRACT_WAIT,
                      scribble=True)

    def idle_rollout(self) -> Member | None:
        """A rollout that takes a command now (its fetch_async may be running)."""
        idle = [m for m in self.rollouts if m.pending is None and m.joined]
        return self.rng.choice(idle) if idle else None

    def retract_rollout(self) -> None:
        """An idle rollout retracts or releases a version, or overwrites its memory.

        An idle rollout retracts an older version it serves, then overwrites that memory, or
        retracts the latest (its tensors' or the one it is fetching), or releases the
        previous one.
        """
        m = self.idle_rollout()
        if m is None:
            return
        how = self.rng.choice(["spare", "spare", "latest", "release"])
        version: int | str = {"spare": "spare", "latest": self.versions[-1],
                              "release": self.versions[-2:][0]}[how]
        if m.future is not None and m.future.expect == version:
            m.future.must_succeed = False  # this ends its own fetch of that version
        if how == "release":
            self.send(m, "release", version=version, wait=RETRACT_WAIT)
        else:
            self.send(m, "retract", version=version, wait=RETRACT_WAIT, scribble=True)

    def reopen_one(self) -> None:
        """An idle rollout closes its store and opens a new one.

        An idle rollout closes its store (cancelling its fetch_async) and opens a new one,
        which knows nothing (its first fetch learns the layout from the hub).
        """
        m = self.idle_rollout()
        if m is None:
            return
        if m.future is not None:
            m.future.must_succeed = False
        m.corrupted.clear()
        self.send(m, "reopen")

    def settle(self, latest: int) -> None:
        """Every live rollout fetches the latest version, which must work bit-exactly.

        Every live rollout fetches the latest version, which must work bit-exactly (again,
        once the hub names it latest, where the trainer's lease ran out).
        """
        todo = list(self.rollouts)
        verify = {m.proc.name: self.rng.choice([None, True]) for m in todo}
        for _ in range(3):
            for m in todo:
                self.send(m, "fetch", must_succeed=True, expect=latest, version="latest",
                          verify=verify[m.proc.name], seeds={str(latest): self.seeds[latest]},
                          mb=MB)
            todo = [m for m in todo if "error" in self.collect(m)]
            self.wait_latest(latest)
            if not todo:
                return
        raise self.fail(f"{[m.proc.name for m in todo]} could not fetch v{latest} three times")

    def wait_latest(self, latest: int) -> None:
        """The hub names `latest` latest (at once, unless the trainer's lease ran out)."""
        deadline = time.monotonic() + 4 * LEASE_S
        with wf.connect(self.hub.url, timeout=5) as observer:
            while (named := observer.latest("bench")) != latest:
                self.check(self.trainer_lapses and time.monotonic() < deadline,
                           f"the hub names v{named} latest, not v{latest}")
                time.sleep(0.1)

    def finish(self) -> None:
        """Every live process exits by itself, in time, and removes its arena files."""
        members = [*self.rollouts, self.trainer]
        for m in members:
            self.note(f"exit {m.proc.name}")
            m.proc.send("exit")
        for m in members:
            self.check(m.proc.close(timeout=30), f"{m.proc.name} did not exit cleanly "
                       "within 30 s")
        left = arena_files_of({m.proc.pid for m in members})
        self.check(not left, f"arena files left by workers that exited: {left}")


def _brief(reply: dict[str, Any]) -> str:
    if "error" in reply:
        return f"{reply['error']}: {reply['message'][:300]}"
    if "exact" in reply:
        return (f"v{reply['version']} exact={reply['exact']} sources={sorted(reply['sources'])} "
                f"failed={reply['failed_sources']} corrupted={reply['corrupted_chunks']}")
    return str(reply)


class HubNews(logging.Handler):
    """Hands `Chaos.dropped` the workers the in-process hub drops, as it logs them."""

    def __init__(self, chaos: Chaos) -> None:
        super().__init__()
        self.chaos = chaos

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "worker dropped worker=%s why=%s":
            worker, why = record.args  # type: ignore[misc]
            self.chaos.dropped(str(worker), str(why))


def run_seed(seed: int, rounds: int = ROUNDS) -> Chaos:
    """One seeded run, all processes cleaned up after (whatever happens).

    Its schedule is printed (pytest shows it with ``-s``, or ``-rP``).
    """
    with running_cluster(lease_s=LEASE_S, limit=60 + 40 * rounds) as (hub, spawn):
        chaos = Chaos(seed, rounds, hub, spawn)
        news = HubNews(chaos)
        logging.getLogger(__name__).addHandler(news)
        try:
            chaos.run()
        except ChaosFailure:
            raise
        except BaseException as exc:  # a hang (the alarm) or a broken helper: say where
            raise chaos.fail(f"{type(exc).__name__}: {exc}") from exc
        finally:
            logging.getLogger(__name__).removeHandler(news)
            print(f"chaos seed {seed}, {rounds} rounds:\n  " + "\n  ".join(chaos.log))
    return chaos


@pytest.mark.parametrize("seed", SEEDS)
def test_chaos(seed: int) -> None:
    run_seed(seed)
