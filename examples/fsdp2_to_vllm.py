"""FSDP2 trainer -> rollouts in vLLM's layout: publish DTensors, fetch fused TP shards.

Run it:  python examples/fsdp2_to_vllm.py          (CPU, gloo; about half a minute)

Two FSDP2 ranks train a small Qwen3-MoE model (built from a config, random
weights: nothing is downloaded) and publish each version straight from the
sharded module: each rank its DTensor shards, fp32 parameters stored as bf16.
Two rollout engines of tensor-parallel size 2 (four processes, one per engine
rank) hold the weights the way vLLM does (fused qkv_proj, experts stacked into
w13/w2, TP shards, padded vocabulary) and sync to every version: per engine rank,
one rollout derives the version from the trainer's shards and the other copies
it from that rollout, so the trainer sends each byte about once however many
engines read. In a cluster, run `fabric hub serve` once and give every process
the URL it prints; a rollout passes its engine's tensors to `store.attach(...)`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import weightfabric as wf

MODEL = "policy"
STEPS = 2
CONFIG: dict[str, Any] = {  # a tiny Qwen3-MoE: 4 experts, GQA (4 heads, 2 kv heads)
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def make_model(config: dict[str, Any]) -> torch.nn.Module:
    """The trainer's model: a Hugging Face causal LM from ``config``, seeded, fp32."""
    import transformers

    torch.manual_seed(0)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    return transformers.AutoModelForCausalLM.from_config(hf_config)


def trainer(rank: int, world: int, url: str, init: str, config: dict[str, Any],
            steps: int, fulls: Any) -> None:
    """One FSDP2 rank: train, publish every version from the sharded module."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = make_model(config)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        with wf.join(url, worker=f"trainer-{rank}") as worker:
            store = worker.model(MODEL, shard=rank, num_shards=world)
            for step in range(steps):
                # each rank publishes its own shards; fp32 is stored as bf16 while packing
                version = store.publish(model, group=f"step-{step}", dtype=torch.bfloat16)
                full = {n: t.full_tensor().to(torch.bfloat16) for n, t in model.state_dict().items()}
                if rank == 0:
                    print(f"trainer: published v{version} from {world} FSDP2 ranks", flush=True)
                    if fulls is not None:
                        fulls.put((version, full))
                tokens = torch.randint(0, config["vocab_size"], (2, 8))
                model(tokens, labels=tokens).loss.backward()   # a training step
                optimizer.step()
                optimizer.zero_grad()
            # versions live as long as a live worker holds them: stay until the rollouts are done
            wait_key(worker.hub, "release", timeout=300)
    finally:
        dist.destroy_process_group()


def rollout(engine: int, tp_rank: int, url: str, config: dict[str, Any], tp: int,
            steps: int, results: Any) -> None:
    """One rank of an inference engine: sync to each version, in vLLM's layout."""
    layout = wf.vllm_layout(config, tp=tp)
    with wf.join(url, worker=f"engine{engine}-tp{tp_rank}") as worker:
        store = worker.layout_model(MODEL, layout, rank=tp_rank)
        for _ in range(steps):
            stats = store.sync(timeout=300)       # the newest version, in this rank's layout
            how = "derived" if stats.derived else "copied"
            print(f"engine {engine} rank {tp_rank}: v{stats.version} {how} from "
                  f"{', '.join(sorted(stats.sources)) or 'nobody'}", flush=True)
            if results is not None:
                results.put((engine, tp_rank, stats.version, stats.derived, dict(stats.sources),
                             {n: t.clone() for n, t in store.tensors.items()}))
            # ... generate with store.tensors (the engine's own parameters after attach) ...
        worker.hub.kv_put(f"done-{engine}-{tp_rank}", b"1")   # tell the launcher
        # a rollout that leaves takes its replicas along: stay while the others may copy them
        wait_key(worker.hub, "release", timeout=300)


def wait_key(hub: wf.HubClient, key: str, *, timeout: float) -> None:
    """Wait until some process puts ``key`` in the hub's key-value store."""
    end = time.monotonic() + timeout
    while hub.kv_get(key) is None:
        if time.monotonic() > end:
            raise TimeoutError(f"nobody put {key!r} within {timeout:g} s")
        time.sleep(0.05)


def run(config: dict[str, Any] = CONFIG, *, engines: int = 2, tp: int = 2, steps: int = STEPS,
        check: Callable[[str, dict[int, dict[str, torch.Tensor]], list[Any]], None] | None = None,
        timeout: float = 300.0) -> None:
    """Start a hub, 2 FSDP2 trainer ranks and ``engines`` x ``tp`` rollout ranks; wait.

    ``check(url, fulls, results)``, if given, runs before the trainers leave, with the
    trainer's whole bf16 weights per version and each rollout's tensors per version.
    """
    ctx = mp.get_context("spawn")
    fulls, results = (ctx.Queue(), ctx.Queue()) if check else (None, None)
    with wf.serve("tcp://127.0.0.1:0") as hub, tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=trainer, args=(r, 2, hub.url, init, config, steps, fulls))
                 for r in range(2)]
        procs += [ctx.Process(target=rollout, args=(e, r, hub.url, config, tp, steps, results))
                  for e in range(engines) for r in range(tp)]
        for p in procs:
            p.start()
        try:
            with wf.connect(hub.url) as client:
                if check is not None:
                    versions = dict(fulls.get(timeout=timeout) for _ in range(steps))
                    rows = [results.get(timeout=timeout) for _ in range(engines * tp * steps)]
                for e in range(engines):
                    for r in range(tp):
                        wait_key(client, f"done-{e}-{r}", timeout=timeout)
                if check is not None:
                    check(hub.url, versions, rows)
                client.kv_put("release", b"1")
            for p in procs:
                p.join(timeout)
                if p.exitcode != 0:
                    raise RuntimeError(f"{p.name} exited with {p.exitcode}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)


def main() -> int:
    """Run the example once with the default config."""
    run()
    print("all rollouts held every version in vLLM's TP=2 layout", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
