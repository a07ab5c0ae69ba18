"""`fabric bench layouts`: FSDP2 trainer -> vLLM-layout engines through derived replicas.

A 2-rank gloo FSDP2 trainer (two processes) publishes a Llama-shaped model of about
``--size`` bytes (fp32 parameters, published as bf16: each rank its DTensor
shards). Two engines of TP=2 (four reader processes, one per engine rank) fetch
it into vLLM's layout (fused qkv and gate_up, row- and column-parallel splits,
vocab padding) at the same time: per rank, one reader derives the version from
the trainer's shards and the other copies the derived replica. Then, in the same
run, every reader fetches the same bytes as a plain same-layout fetch (trainer
shard = its TP rank). Three versions are published: the first two fill both
buffers of every double-buffered store (an RL loop's steady state keeps them), the
third is measured. Finally each reader fetches it in an fp8 (128 x 128 block) layout.

Reported (JSON keys): ``bytes`` (S, the published size), ``readers``,
``trainer_egress_bytes`` (bytes the trainer ranks served during the layout
fetches of the measured version) and its ratio to S, ``resharded_gbps`` (per reader:
its layout's bytes / the wall time of its ``fetch`` call, median), ``plain_fetch_gbps``
(the same for the plain fetch, median) and the ratio, ``seconds`` (per reader: both
wall times), ``sources`` (per
reader: worker -> bytes), ``derived`` (which readers derived), ``verified`` (every
reader bit-exact against a reference conversion of the model) and
``fp8_verified``. Targets: egress <= 1.25 S, resharded >= 0.7 x plain.

Needs ``transformers`` (the model class; random init, nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from weightfabric.tools.bench.launch import ROOT, print_result
from weightfabric.tools.command import add_command
from weightfabric.topology.units import parse_size

MODEL = "policy"
TP = 2
ENGINES = 2
VERSIONS = 3
"""Versions published; the first ones fill both buffers of every double-buffered store
(an RL loop's steady state keeps them), the last is measured."""
FP8_BLOCK = 128


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench layouts`."""
    p = add_command(
        subparsers, "layouts",
        help="FSDP2 trainer -> 2 vLLM-layout TP2 engines: egress, GB/s vs plain fetch",
        handler=_run, bad_input=(ValueError,),
        description="A 2-rank gloo FSDP2 trainer publishes a Llama-shaped model (bf16);\n"
                    "two TP=2 engines (4 reader processes) fetch it into vLLM's layout at\n"
                    "once (one reader per rank derives, the other copies its replica), then\n"
                    "the same bytes as a plain fetch, then an fp8 layout. Reports trainer\n"
                    "egress / S (target <= 1.25), resharded / plain GB/s (target >= 0.7),\n"
                    "sources per reader, bit-exactness. Exits 1 if a reader is not\n"
                    "bit-exact, 2 on bad options. Needs transformers.",
        examples=["fabric bench layouts", "fabric bench layouts --size 1GB --json"])
    p.add_argument("--size", default="256MB", help="published bytes, about (default 256MB)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for the whole run (default 600)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def llama_config(nbytes: int) -> dict[str, Any]:
    """A Llama config of about ``nbytes`` of bf16 weights (fp8-friendly at TP=2)."""
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 2 * (hidden * (hidden + 2 * 256) + hidden * hidden + 3 * hidden * inter + 2 * hidden)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, (nbytes - fixed) // per_layer)
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": int(layers), "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 128, "vocab_size": vocab,
            "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def _build(config: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {k: v for k, v in config.items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_layouts(*, size: int = 256 << 20, timeout: float = 600.0) -> dict[str, Any]:
    """Run the benchmark once; returns the JSON result (see the module docstring).

    Raises:
        ValueError: bad size or timeout.
        RuntimeError: a process failed or did not finish in time.
    """
    if size < 64 << 20:
        raise ValueError(f"--size must be at least 64MB, got {size}")
    if timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {timeout}")
    import weightfabric as wf

    config = llama_config(size)
    procs: list[subprocess.Popen[str]] = []
    outs: list[Any] = []
    with wf.serve("tcp://127.0.0.1:0") as hub, tempfile.TemporaryDirectory() as tmp:
        common = {"url": hub.url, "config": config}
        port = _free_port()
        try:
            for rank in range(TP):
                procs.append(_spawn("trainer", {**common, "rank": rank, "port": port}, tmp, outs))
            for engine in range(ENGINES):
                for rank in range(TP):
                    procs.append(_spawn("reader", {**common, "engine": engine, "rank": rank},
                                        tmp, outs))
            results = _collect(procs, outs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
            for f in outs:
                f.close()
    return _summarise(results, config)


def _spawn(role: str, args: dict[str, Any], tmp: str, outs: list[Any]
           ) -> subprocess.Popen[str]:
    out = open(Path(tmp) / f"{role}-{len(outs)}.log", "w+")  # noqa: SIM115 (closed by the caller)
    outs.append(out)
    return subprocess.Popen([sys.executable, "-m", "weightfabric.tools.bench.layouts", role,
                             json.dumps(args)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=out, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _collect(procs: list[subprocess.Popen[str]], outs: list[Any], timeout: float
             ) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout
    results = []
    for p, out in zip(procs, outs, strict=True):
        try:
            stdout, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"bench layouts: a process did not finish within {timeout:g} s"
                               f"{_tail(out)}") from None
        if p.returncode != 0:
            raise RuntimeError(f"bench layouts: a process exited with {p.returncode}{_tail(out)}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def _tail(out: Any) -> str:
    out.seek(0)
    return "\n--- stderr ---\n" + out.read()[-3000:]


def _summarise(results: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    trainers = [r for r in results if r["role"] == "trainer"]
    readers = [r for r in results if r["role"] == "reader"]
    size = sum(t["bytes"] for t in trainers)
    egress = sum(t["served_layouts"] for t in trainers)
    resharded = statistics.median(r["layout_gbps"] for r in readers)
    plain = statistics.median(r["plain_gbps"] for r in readers)
    return {"bytes": size, "readers": len(readers), "layers": config["num_hidden_layers"],
            "trainer_egress_bytes": egress, "egress_over_bytes": egress / size,
            "resharded_gbps": resharded, "plain_fetch_gbps": plain,
            "resharded_over_plain": resharded / plain,
            "resharded_gbps_each": [r["layout_gbps"] for r in readers],
            "plain_fetch_gbps_each": [r["plain_gbps"] for r in readers],
            "layout_bytes": [r["layout_bytes"] for r in readers],
            "sources": {r["name"]: r["sources"] for r in readers},
            "derived": {r["name"]: r["derived"] for r in readers},
            "seconds": {r["name"]: {"layout": r["layout_s"], "plain": r["plain_s"]}
                        for r in readers},
            "verified": all(r["exact"] for r in readers),
            "fp8_verified": all(r["fp8_exact"] for r in readers),
            "targets_met": egress <= 1.25 * size and resharded >= 0.7 * plain}


def _run(args: argparse.Namespace) -> int:
    result = bench_layouts(size=int(parse_size(args.size)), timeout=args.timeout)
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench layouts: FSDP2 (2 ranks) -> 2 vLLM TP2 engines, "
                        f"{r['bytes'] / 1e6:.0f} MB bf16, {r['layers']} layers")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("trainer egress / S (target <= 1.25)", f"{r['egress_over_bytes']:.3f}")
    table.add_row("resharded GB/s per reader (median)", f"{r['resharded_gbps']:.2f}")
    table.add_row("plain fetch GB/s per reader (median)", f"{r['plain_fetch_gbps']:.2f}")
    table.add_row("resharded / plain (target >= 0.7)", f"{r['resharded_over_plain']:.2f}")
    for name, sources in r["sources"].items():
        shown = ", ".join(f"{w} {b / 1e6:.0f} MB" for w, b in sorted(sources.items()))
        table.add_row(f"{name} {'derived' if r['derived'][name] else 'copied'} from", shown)
    table.add_row("bit-exact (bf16 / fp8)",
                  f"{'yes' if r['verified'] else 'NO'} / {'yes' if r['fp8_verified'] else 'NO'}")
    console.print(table)


# ------------------------------------------------------------------ child processes
def _barrier(hub: Any, name: str, count: int, timeout: float = 300.0) -> None:
    """Wait until ``count`` processes put ``name``-i keys (a hub kv barrier)."""
    end = time.monotonic() + timeout
    while sum(hub.kv_get(f"{name}-{i}") is not None for i in range(count)) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name!r}: not everyone arrived in {timeout:g} s")
        time.sleep(0.02)


def _trainer(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import weightfabric as wf

    rank = args["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}",
                            rank=rank, world_size=TP)
    try:
        model = _build(args["config"])
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        with wf.join(args["url"], worker=f"trainer-{rank}") as worker:
            store = worker.model(MODEL, shard=rank, num_shards=TP)
            for version in range(1, VERSIONS + 1):   # the last one is measured
                if version > 1:
                    with torch.no_grad():   # a "training step" the readers can redo exactly
                        for p in model.parameters():
                            p.mul_(0.5)
                served = worker.bytes_served
                store.publish(model, group=f"step-{version}", dtype=torch.bfloat16)
                _barrier(worker.hub, f"layouts-{version}", ENGINES * TP)
                served = worker.bytes_served - served
            if rank == 0:               # the readers' plain fetches start together
                worker.hub.kv_put("plain-go", b"1")
            nbytes = store.layout.nbytes if store.layout is not None else 0
            _barrier(worker.hub, "all-done", ENGINES * TP)
            return {"role": "trainer", "rank": rank, "bytes": nbytes, "served_layouts": served}
    finally:
        dist.destroy_process_group()


def _reader(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    import weightfabric as wf
    from weightfabric.fabric.relayout.engines import vllm_layout
    from weightfabric.fabric.relayout.rules import derive_reference

    engine, rank = args["engine"], args["rank"]
    index = engine * TP + rank
    name = f"engine{engine}-tp{rank}"
    weights = {n: t.detach() for n, t in _build(args["config"]).state_dict().items()}
    layout = vllm_layout(args["config"], tp=TP)
    fp8 = vllm_layout(args["config"], tp=TP, fp8_block=FP8_BLOCK)
    with wf.join(args["url"], worker=name) as worker:
        hub = worker.hub
        store = worker.layout_model(MODEL, layout, rank=rank)
        plain = worker.model(MODEL, shard=rank, num_shards=TP)
        for version in range(1, VERSIONS + 1):   # the last one is measured
            hub.wait_version(MODEL, after=version - 1, timeout=300)
            start = time.monotonic()
            stats = store.fetch(version)
            layout_s = time.monotonic() - start
            reference = {n: (t * 0.5 ** (version - 1)).to(torch.bfloat16)
                         for n, t in weights.items()}
            exact = _equal(store.tensors, derive_reference(layout, reference, rank))
            if version < VERSIONS:
                plain.fetch(version)
            hub.kv_put(f"layouts-{version}-{index}", b"1")
            _barrier(hub, f"layouts-{version}", ENGINES * TP)
        # After the trainer counted its layout egress, all at once (a hub long poll wakes
        # every reader, as the commit does for the layout fetch), timed the same way.
        hub.kv_get("plain-go", timeout=300)
        start = time.monotonic()
        plain.fetch(VERSIONS)
        plain_s = time.monotonic() - start
        layout_bytes = sum(t.numel() * t.element_size() for t in store.tensors.values())
        fp8_store = worker.layout_model(MODEL, fp8, rank=rank)
        fp8_store.fetch(VERSIONS)
        fp8_exact = _equal(fp8_store.tensors, derive_reference(fp8, reference, rank))
        hub.kv_put(f"all-done-{index}", b"1")
        _barrier(hub, "all-done", ENGINES * TP)
        return {"role": "reader", "name": name, "layout_s": layout_s, "plain_s": plain_s,
                "layout_gbps": layout_bytes / layout_s / 1e9,
                "layout_bytes": layout_bytes, "plain_gbps": layout_bytes / plain_s / 1e9,
                "sources": stats.sources, "derived": stats.derived, "exact": exact,
                "fp8_exact": fp8_exact}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import torch

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return set(got) == set(want) and all(
        got[n].dtype == w.dtype and torch.equal(bits(got[n]), bits(w)) for n, w in want.items())


if __name__ == "__main__":
    role, raw = sys.argv[1], json.loads(sys.argv[2])
    result = _trainer(raw) if role == "trainer" else _reader(raw)
    print(json.dumps(result), flush=True)
