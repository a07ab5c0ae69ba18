"""The demo's trainer and rollout processes.

Each runs in its own process (multiprocessing, spawn), joins the fabric as a
worker, and talks to the orchestrator through two queues: commands in, events
out. Every event is a dict with a ``kind``; tensors travel as numpy arrays (by
value: torch would share them through file descriptors that die with the sender). Torch runs single-threaded in every
process so that the same weights give bit-identical logits everywhere.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch

import weightfabric as wf
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.tools.demo.model import (
    TinyLlama,
    TinyLlamaConfig,
    init_weights,
    probe_inputs,
    reinforce_step,
    reward,
    sample,
)

MODEL = "policy"
PROMPT_LEN = 4
NEW_TOKENS = 12
BATCH = 16


@dataclass(frozen=True)
class RoleConfig:
    """What a demo role process needs to know to start."""
    hub_url: str
    size: str
    chunk_size: int
    seed: int = 0
    lease_timeout: float = 60.0
    rollout_token: str | None = None
    """The rollouts' credential: a read-only token the hub issued (None: the secret file)."""


def _setup(cfg: RoleConfig) -> TinyLlamaConfig:
    logging.basicConfig(level=logging.ERROR)  # the orchestrator reports what matters
    torch.set_num_threads(1)
    return TinyLlamaConfig.scaled(cfg.size)


def trainer_main(cfg: RoleConfig, commands: Any, events: Any) -> None:
    """Publish a version, wait for samples, take a REINFORCE step, repeat.

    The model's parameters live in the arena (attach); each version is exposed in
    place (no copy) and retracted as soon as a rollout holds it, before the
    optimizer writes the next step into the same memory.
    """
    model_cfg = _setup(cfg)
    model = TinyLlama(model_cfg)
    init_weights(model, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    probe = probe_inputs(model_cfg)
    with wf.join(cfg.hub_url, worker="trainer") as worker:
        store = worker.model(MODEL, chunk_size=cfg.chunk_size)
        store.attach(model)
        served = 0
        while True:
            with torch.no_grad():
                logits = model(probe)
            version = store.publish(snapshot=False)
            assert store.layout is not None, "a publish sets the store's layout"
            events.put({"kind": "published", "version": version, "logits": logits.numpy(),
                        "time": time.time(), "bytes": store.layout.nbytes})
            state = store.retract(version, wait=cfg.lease_timeout, delay=True)
            events.put({"kind": "retracted", "version": version, "state": state,
                        "egress": worker.bytes_served - served})
            served = worker.bytes_served
            command = commands.get(timeout=cfg.lease_timeout * 4)
            if command["kind"] == "stop":
                break
            tokens = torch.cat([torch.from_numpy(t) for t in command["tokens"]])
            rewards = reward(tokens, PROMPT_LEN)
            loss = reinforce_step(model, optimizer, tokens, PROMPT_LEN, rewards)
            events.put({"kind": "trained", "version": version, "loss": loss,
                        "reward": float(rewards.mean())})


def rollout_main(cfg: RoleConfig, name: str, commands: Any, events: Any) -> None:
    """Fetch each version the orchestrator names, check it, generate samples.

    Starts from different (random) weights, so matching logits prove the fetch.
    A ``pause_after`` in a fetch command makes the rollout stop after that many
    chunks and say so: the orchestrator then kills it while others read from it.
    """
    model_cfg = _setup(cfg)
    model = TinyLlama(model_cfg)
    init_weights(model, 1000 + zlib.crc32(name.encode()) % 1000)
    probe = probe_inputs(model_cfg)
    generator = torch.Generator().manual_seed(cfg.seed + zlib.crc32(name.encode()))
    with wf.join(cfg.hub_url, worker=name, secret=cfg.rollout_token) as worker:
        store = worker.model(MODEL, chunk_size=cfg.chunk_size)
        store.attach(model)
        events.put({"kind": "joined", "worker": name})
        while True:
            command = commands.get(timeout=cfg.lease_timeout * 4)
            if command["kind"] == "stop":
                break
            version, pause_after = command["version"], command.get("pause_after")

            def on_chunk(done: int, total: int, version=version, pause_after=pause_after) -> None:
                events.put({"kind": "progress", "worker": name, "version": version,
                            "done": done, "total": total})
                if pause_after is not None and done >= pause_after:
                    events.put({"kind": "paused", "worker": name, "version": version,
                                "done": done, "total": total})
                    time.sleep(cfg.lease_timeout * 10)  # until the orchestrator kills us

            options = FetchOptions(read_timeout=15, deadline=120)
            if pause_after is not None:
                # One chunk per read, one read at a time: when it pauses it holds exactly
                # `pause_after` chunks. With several reads in flight, a loaded machine
                # could finish them all before the first `on_chunk`, leaving a complete
                # replica for the others to read without a single failover.
                options = replace(options, max_inflight=1, read_bytes=cfg.chunk_size)
            started = time.perf_counter()
            try:
                stats = store.fetch(version, on_chunk=on_chunk, options=options)
            except Exception as exc:  # reported; the orchestrator fails the demo
                events.put({"kind": "error", "worker": name, "version": version,
                            "error": f"{type(exc).__name__}: {exc}"})
                continue
            stall = time.perf_counter() - started
            with torch.no_grad():
                logits = model(probe)
            prompts = torch.randint(0, model_cfg.vocab_size, (BATCH, PROMPT_LEN),
                                    generator=generator)
            tokens = sample(model, prompts, NEW_TOKENS, generator=generator)
            events.put({"kind": "rollout", "worker": name, "version": version,
                        "stats": stats.to_dict(), "stall": stall, "logits": logits.numpy(),
                        "tokens": tokens.numpy()})
