"""Runs the demo: an embedded hub, a trainer and rollout processes, a kill and a join.

Step by step: the trainer, which keeps fp32 master weights, publishes version v
as a bf16 snapshot; the rollouts fetch it (pipelining through each other) and
generate; the trainer learns from their samples and publishes v+1. At `kill_step`
one rollout is held after its first chunks and SIGKILLed while the others read
from it; at `join_step` a new rollout joins and catches up from its peers. Every rollout's logits on fixed
inputs must equal the trainer's at every version, bit for bit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import weightfabric as wf
from weightfabric.fabric.arena import remove_stale_regions
from weightfabric.fabric.tensorset import ALIGNMENT, check_chunk_size, layout_of, named_tensors
from weightfabric.tools.demo.model import TinyLlama, TinyLlamaConfig
from weightfabric.tools.demo.roles import (
    PUBLISHED_DTYPE,
    RoleConfig,
    rollout_main,
    trainer_main,
)


def default_chunk_size(size: str) -> int:
    """About 1/16 of the published (bf16) model (so a fetch has chunks to pipeline), at most 1 MiB."""
    with torch.device("meta"):
        model = TinyLlama(TinyLlamaConfig.scaled(size)).to(PUBLISHED_DTYPE)
        nbytes = layout_of(named_tensors(model)).nbytes
    return max(ALIGNMENT, min(1 << 20, nbytes // 16 // ALIGNMENT * ALIGNMENT))


READER_WAIT_S = 10.0
"""Longest wait, before the kill, for another rollout to be reading from the victim."""


class DemoFailure(RuntimeError):
    """The demo could not run to the end (a process failed or timed out)."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of one demo run (`fabric demo`'s options)."""
    workers: int = 3
    steps: int = 6
    size: str = "small"
    chunk_size: int = 1 << 20
    kill_step: int | None = 2
    join_step: int | None = 3
    event_timeout: float = 120.0
    seed: int = 0
    lr: float = 3e-3
    """The trainer's Adam learning rate. At 3e-3 the model learns within a few steps,
    but Adam's steps (about lr per weight) exceed most weights' bf16 spacing: 94-99.9 %
    of the bf16 values change per version (small model). At 3e-6 about 2-5 % change,
    as in large RL runs, and the reward stays at chance level over a few steps."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        check_chunk_size(self.chunk_size)
        if self.kill_step is not None and self.workers < 2:
            raise ValueError("killing a rollout needs at least 2 rollouts (--workers 2)")


@dataclass
class VersionRecord:
    """One version: its bytes, the trainer's logits, each rollout's fetch and logits check.

    ``changed_fraction``: the fraction of its bf16 values whose bits differ from the
    previous version's (None for the first).
    """
    version: int
    nbytes: int
    published_at: float
    trainer_logits: np.ndarray
    expected: list[str]
    changed_fraction: float | None = None
    fetches: dict[str, dict[str, Any]] = field(default_factory=dict)
    logits_match: dict[str, bool] = field(default_factory=dict)
    trainer_egress: int = 0
    reward: float | None = None
    tokens: list[np.ndarray] = field(default_factory=list)


class Demo:
    """One run; `run` returns the result dict (see `tools.demo.report`)."""

    def __init__(self, config: DemoConfig, log: Callable[[str], None],
                 on_step: Callable[[int], None] = lambda step: None) -> None:
        self.config = config
        self.log = log
        self.on_step = on_step
        self.ctx = mp.get_context("spawn")
        self.events = self.ctx.Queue()
        self.backlog: list[dict[str, Any]] = []
        self.procs: dict[str, Any] = {}
        self.commands: dict[str, Any] = {}
        self.versions: dict[int, VersionRecord] = {}
        self.killed: dict[str, Any] | None = None
        self.joined: dict[str, Any] | None = None
        self.errors: list[str] = []

    # --- processes ---------------------------------------------------------------------

    def _start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        commands = self.ctx.Queue()
        proc = self.ctx.Process(target=target, args=(*args, commands, self.events), name=name,
                                daemon=True)
        proc.start()
        self.procs[name], self.commands[name] = proc, commands

    def _start_rollout(self, name: str, role: RoleConfig) -> None:
        self._start(name, rollout_main, role, name)
        self._wait(lambda e: e["kind"] == "joined" and e["worker"] == name)

    def _live_rollouts(self) -> list[str]:
        return [n for n, p in self.procs.items() if n != "trainer" and p.is_alive()]

    # --- events --------------------------------------------------------------------------

    def _wait(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        for i, event in enumerate(self.backlog):
            if match(event):
                return self.backlog.pop(i)
        deadline = time.monotonic() + self.config.event_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoFailure(f"no progress for {self.config.event_timeout:g} s")
            try:
                event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [n for n, p in self.procs.items()
                        if not p.is_alive() and n != (self.killed or {}).get("worker")
                        and p.exitcode not in (0, None)]
                if dead:
                    raise DemoFailure(f"{', '.join(dead)} exited unexpectedly "
                                      f"(exit code {self.procs[dead[0]].exitcode})") from None
                continue
            if event["kind"] == "error":
                self.errors.append(f"{event['worker']} v{event['version']}: {event['error']}")
                raise DemoFailure(self.errors[-1])
            if match(event):
                return event
            if event["kind"] != "progress":
                self.backlog.append(event)

    # --- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run the demo; returns its result (the ``--json`` output)."""
        cfg = self.config
        logging.getLogger("fabric").setLevel(logging.ERROR)  # the demo reports events itself
        hub = wf.serve("tcp://127.0.0.1:0", lease_s=2.0)
        assert hub.authority is not None, "the demo runs authenticated"
        # the trainer signs with the deployment secret; rollouts get a token that may only read
        token = hub.authority.issue_token("rollouts", ["read"])
        role = RoleConfig(hub.url, cfg.size, cfg.chunk_size, seed=cfg.seed, rollout_token=token,
                          lr=cfg.lr)
        started = time.perf_counter()
        try:
            self._start("trainer", trainer_main, role)
            for i in range(cfg.workers):
                self._start_rollout(f"rollout-{i}", role)
            self.log(f"hub at {hub.url}, authentication {hub.auth_mode}; the trainer and "
                     f"{cfg.workers} rollouts (read-only token) joined")
            for step in range(1, cfg.steps + 1):
                self._step(step, role)
                self.on_step(step)
        finally:
            self._stop_all()
            hub.stop()
            remove_stale_regions()
        from weightfabric.tools.demo.report import result

        return result(self, time.perf_counter() - started)

    def _step(self, step: int, role: RoleConfig) -> None:
        cfg = self.config
        published = self._wait(lambda e: e["kind"] == "published")
        v = published["version"]
        live = self._live_rollouts()
        changed = published["changed_fraction"]
        record = VersionRecord(v, published["bytes"], published["time"], published["logits"],
                               expected=list(live), changed_fraction=changed)
        self.versions[v] = record
        self.log(f"v{v} published by the trainer (bf16 snapshot, {published['bytes'] / 1e6:.1f} MB"
                 + ("" if changed is None else f"; {changed:.2%} of its values changed") + ")")
        if step == cfg.kill_step and len(live) >= 2:
            self._kill_mid_fetch(record, live, role.hub_url)
        else:
            for name in live:
                self.commands[name].put({"kind": "fetch", "version": v})
        if step == cfg.join_step:
            name = f"rollout-{len(self.procs) - 1}"
            self._start_rollout(name, role)
            self.commands[name].put({"kind": "fetch", "version": v})
            record.expected.append(name)
            self.joined = {"worker": name, "version": v}
        for name in record.expected:
            def rollout_of(e: dict[str, Any], n: str = name) -> bool:
                return e["kind"] == "rollout" and e["worker"] == n and e["version"] == v

            event = self._wait(rollout_of)
            record.fetches[name] = {**event["stats"], "stall_seconds": event["stall"]}
            record.logits_match[name] = bool(np.array_equal(event["logits"], record.trainer_logits))
            stats = event["stats"]
            self.log(f"  {name} has v{v}: {stats['bytes'] / 1e6:.1f} MB in "
                     f"{stats['seconds'] * 1e3:.0f} ms from {', '.join(sorted(stats['sources']))}"
                     + (f"; re-read {stats['chunks_reread']} chunks after losing "
                        f"{', '.join(stats['failed_sources'])}" if stats["failed_sources"] else "")
                     + ("" if record.logits_match[name] else "  [LOGITS DIFFER]"))
            record.tokens.append(event["tokens"])
        if self.joined and self.joined["version"] == v:
            self.joined["sources"] = sorted(record.fetches[self.joined["worker"]]["sources"])
        self.commands["trainer"].put({"kind": "served"})
        served = self._wait(lambda e: e["kind"] == "served" and e["version"] == v)
        record.trainer_egress = served["egress"]
        if step < cfg.steps:
            self.commands["trainer"].put({"kind": "train", "tokens": record.tokens})
            trained = self._wait(lambda e: e["kind"] == "trained" and e["version"] == v)
            record.reward = trained["reward"]
            self.log(f"  trainer: reward {trained['reward']:.3f} on v{v}'s samples")

    def _kill_mid_fetch(self, record: VersionRecord, live: list[str], hub_url: str) -> None:
        victim, others = live[-1], live[:-1]
        v = record.version
        num_chunks = -(-record.nbytes // self.config.chunk_size)
        if num_chunks < 2:
            self.log(f"  v{v} is a single chunk: nothing to kill mid-fetch (lower --chunk-size)")
            for name in live:
                self.commands[name].put({"kind": "fetch", "version": v})
            return
        self.commands[victim].put({"kind": "fetch", "version": v,
                                   "pause_after": max(1, num_chunks // 4)})
        paused = self._wait(lambda e: e["kind"] == "paused" and e["worker"] == victim)
        for name in others:
            self.commands[name].put({"kind": "fetch", "version": v})
        if not self._await_reader_of(hub_url, victim, v, paused["done"]):
            self.log(f"  no rollout was seen reading v{v} from {victim} within "
                     f"{READER_WAIT_S:g} s; killing it anyway")
        self.procs[victim].kill()
        self.procs[victim].join(10)
        record.expected.remove(victim)
        self.killed = {"worker": victim, "version": v, "chunks_held": paused["done"],
                       "chunks": paused["total"]}
        self.log(f"  SIGKILL {victim} in the middle of fetching v{v} (it held "
                 f"{paused['done']} of {paused['total']} chunks)")

    def _await_reader_of(self, hub_url: str, victim: str, v: int, held: int) -> bool:
        """Wait until the hub shows another rollout's fetch of ``v`` planned from ``victim``.

        That fetch must hold at least the ``held`` chunks the victim holds (a fixed
        sleep lost that race on a loaded machine).
        """
        deadline = time.monotonic() + READER_WAIT_S
        with wf.connect(hub_url) as hub:
            while time.monotonic() < deadline:
                if any(f["version"] == v and f["worker"] != victim and victim in f["sources"]
                       and f["have"] >= held for f in hub.status()["fetches"]):
                    return True
                time.sleep(0.02)
        return False

    def _stop_all(self) -> None:
        for name, commands in self.commands.items():
            if self.procs[name].is_alive():
                commands.put({"kind": "stop"})
        for proc in self.procs.values():
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
