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
PUBLISHED_DTYPE = torch.bfloat16
"""What the trainer publishes (it trains in fp32) and the rollouts run."""


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
    lr: float = 3e-3
    """The trainer's Adam learning rate (it sets how many bf16 values change per version)."""


def _setup(cfg: RoleConfig) -> TinyLlamaConfig:
    logging.basicConfig(level=logging.ERROR)  # the orchestrator reports what matters
    torch.set_num_threads(1)
    return TinyLlamaConfig.scaled(cfg.size)


def trainer_main(cfg: RoleConfig, commands: Any, events: Any) -> None:
    """Publish a version, wait for samples, take a REINFORCE step, repeat.

    Mixed precision, as RL trainers run: the model and Adam keep fp32 master weights;
    each version is a bf16 snapshot of them (`publish(model, dtype=bfloat16)` casts
    while packing), so training goes on at once. The previous version stays exposed in
    the store's other buffer until the next publish reuses it: a base that holders of
    both serve deltas against. The probe logits come from a bf16 model loaded with
    exactly the published tensors, as the rollouts run them; the ``published`` event
    also carries the fraction of bf16 values that changed since the previous version.

    Commands: ``served`` (every rollout holds the current version: report the
    trainer's egress since the last ``served``), ``train`` (samples: step, then
    publish the next version), ``stop``.
    """
    model_cfg = _setup(cfg)
    model = TinyLlama(model_cfg)
    init_weights(model, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    probe = probe_inputs(model_cfg)
    published_model = TinyLlama(model_cfg).to(PUBLISHED_DTYPE)  # runs what rollouts run
    with wf.join(cfg.hub_url, worker="trainer") as worker:
        store = worker.model(MODEL, chunk_size=cfg.chunk_size)
        store.reserve(model, dtype=PUBLISHED_DTYPE)
        previous: dict[str, torch.Tensor] | None = None

        def publish() -> int:
            nonlocal previous
            version = store.publish(model, dtype=PUBLISHED_DTYPE)
            assert store.layout is not None, "a publish sets the store's layout"
            tensors = store.tensors  # the active version: the one just published
            published_model.load_state_dict(tensors)
            with torch.no_grad():
                logits = published_model(probe)
            current = {name: t.view(torch.int16).clone() for name, t in tensors.items()}
            events.put({"kind": "published", "version": version, "logits": logits.float().numpy(),
                        "time": time.time(), "bytes": store.layout.nbytes,
                        "changed_fraction": (None if previous is None
                                             else changed_fraction(previous, current))})
            previous = current
            return version

        version = publish()
        served = 0
        while True:
            command = commands.get(timeout=cfg.lease_timeout * 4)
            if command["kind"] == "stop":
                break
            if command["kind"] == "served":
                events.put({"kind": "served", "version": version,
                            "egress": worker.bytes_served - served})
                served = worker.bytes_served
                continue
            tokens = torch.cat([torch.from_numpy(t) for t in command["tokens"]])
            rewards = reward(tokens, PROMPT_LEN)
            loss = reinforce_step(model, optimizer, tokens, PROMPT_LEN, rewards)
            events.put({"kind": "trained", "version": version, "loss": loss,
                        "reward": float(rewards.mean())})
            version = publish()


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The fraction of values whose bits differ between two versions, over all tensors.

    ``before`` and ``after``: name -> the tensor's bits (e.g. a bf16 tensor's
    ``view(torch.int16)``), the same names and shapes in both.
    """
    changed = sum(int((after[name] != t).sum()) for name, t in before.items())
    return changed / sum(t.numel() for t in before.values())


def rollout_main(cfg: RoleConfig, name: str, commands: Any, events: Any) -> None:
    """Fetch each version the orchestrator names, check it, generate samples.

    Runs the bf16 weights the trainer publishes, and starts from different (random)
    ones, so matching logits prove the fetch.
    A ``pause_after`` in a fetch command makes the rollout stop after that many
    chunks and say so: the orchestrator then kills it while others read from it.
    """
    model_cfg = _setup(cfg)
    model = TinyLlama(model_cfg)
    init_weights(model, 1000 + zlib.crc32(name.encode()) % 1000)
    model.to(PUBLISHED_DTYPE)
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
                        "stats": stats.to_dict(), "stall": stall, "logits": logits.float().numpy(),
                        "tokens": tokens.numpy()})
