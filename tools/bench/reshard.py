"""`fabric bench reshard`: what verifying a resharded fetch costs.

Two TP2 publishers (workers of this process, on an embedded hub) publish their
shards of one Llama-3-70B-shaped layer (dimensions divided by ``--scale``); a TP1
reader reads the whole layer, ``--repeats`` times each way, in turn: with a kept
`ReshardReader` unverified (``verify=False``) and verified (``verify=True``: every
chunk a band touches is read whole and checked against the shard's manifest), and
with a one-shot `fetch_resharded` unverified (fresh buffers each time, as a loop
that keeps no reader pays). Reported: the median GB/s of each (useful bytes /
fetch time), the ratios, what verification read and kept (chunks, peak memory),
and a ``copy_`` of the same bytes in the same run. Every fetch is compared bit for
bit with the layer. The first fetch of each kept reader (allocating its buffers)
is a warm-up and not counted.

Publishers and reader share one host, so reads are shared-memory copies: the
ratio is the cost of the checksums and the chunk widening on top of copy and
reshard. A reader on another host, the case the default rule verifies, adds the
network transfer to both sides.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from weightfabric.tools.bench.launch import print_result
from weightfabric.tools.command import add_command
from weightfabric.topology.units import parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench reshard`."""
    p = add_command(
        subparsers, "reshard", help="resharded fetch (TP2 -> TP1) GB/s, verified vs unverified",
        handler=_run, bad_input=(ValueError,),
        description="Two TP2 publishers and a TP1 reader in this process, on an embedded\n"
                    "hub: the reader fetches one Llama-3-70B-shaped layer in turn with a\n"
                    "kept ReshardReader, unverified and verified against the chunk\n"
                    "checksums, and with a one-shot fetch_resharded (fresh buffers).\n"
                    "Reports median GB/s of each, their ratios, the verification memory,\n"
                    "and a copy_ of the same bytes. Exits 1 if a fetch is not bit-exact,\n"
                    "2 on bad options.",
        examples=["fabric bench reshard",
                  "fabric bench reshard --scale 1 --chunk-size 4MiB --repeats 5 --json"])
    p.add_argument("--scale", type=int, default=2,
                   help="divide the layer's dimensions by this (1: 1.7 GB, 2: 0.43 GB; default 2)")
    p.add_argument("--chunk-size", default="16MiB",
                   help="publishers' chunk size: what verification reads whole (default 16MiB)")
    p.add_argument("--budget", default="64MiB", help="staging budget (default 64MiB)")
    p.add_argument("--repeats", type=int, default=3,
                   help="fetches of each kind; the median is reported (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_reshard(*, scale: int = 2, chunk_size: int = 16 << 20, budget: int = 64 << 20,
                  repeats: int = 3) -> dict[str, Any]:
    """Run the benchmark once; returns the JSON result (see the module docstring).

    Raises:
        ValueError: bad scale, sizes or repeats.
    """
    if scale < 1 or 8192 % scale or 128 % scale:
        raise ValueError(f"--scale must divide 128 (the head dimension), got {scale}")
    if chunk_size <= 0 or chunk_size % 256:
        raise ValueError(f"--chunk-size must be a positive multiple of 256, got {chunk_size}")
    if budget <= 0:
        raise ValueError(f"--budget must be positive, got {budget}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    import torch

    import weightfabric as wf
    from weightfabric.fabric.relayout.reader import Resharding, ReshardReader, fetch_resharded
    from weightfabric.kernels import split_tensor
    from weightfabric.tools.bench.baselines import memcpy_gbps
    from weightfabric.tools.bench.gpu_paths import llama_layer

    held, wanted = llama_layer(2, scale), llama_layer(1, scale)
    g = torch.Generator().manual_seed(7)
    full = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (shape, _) in held.items()}
    spec = {n: Resharding(shape, held[n][1], wanted[n][1]) for n, (shape, _) in held.items()}
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    runs: dict[str, list[Any]] = {"unverified": [], "verified": [], "one_shot": []}
    exact = True
    with wf.serve("tcp://127.0.0.1:0") as hub:
        workers = [wf.join(hub.url, worker=f"trainer-{r}") for r in range(2)]
        try:
            for rank, worker in enumerate(workers):
                shards = {n: split_tensor(full[n], layout, backend="torch")[rank]
                          .reshape(layout.shard_shape(shape, rank)[:len(shape)]).contiguous()
                          for n, (shape, layout) in held.items()}
                worker.model("layer", chunk_size=chunk_size, shard=rank,
                             num_shards=2).publish(shards, group="step-1")
            with wf.join(hub.url, worker="reader") as reader:
                dst = {n: torch.empty_like(t) for n, t in full.items()}
                kept = {kind: ReshardReader(reader, "layer", spec, rank=0, budget=budget,
                                            verify=kind == "verified")
                        for kind in ("unverified", "verified")}
                fetches = {**{kind: r.fetch for kind, r in kept.items()},
                           "one_shot": lambda d: fetch_resharded(reader, "layer", spec, d, rank=0,
                                                                 budget=budget, verify=False)}
                for r in kept.values():
                    r.fetch(dst)
                for _ in range(repeats):
                    for kind, stats_list in runs.items():
                        for t in dst.values():
                            t.zero_()
                        stats_list.append(fetches[kind](dst))
                        exact = exact and all(torch.equal(dst[n], full[n]) for n in full)
        finally:
            for worker in workers:
                worker.close()
    gbps = {kind: statistics.median(s.useful_bytes / s.seconds / 1e9 for s in stats)
            for kind, stats in runs.items()}
    last = runs["verified"][-1]
    return {"scale": scale, "bytes": nbytes, "chunk_size": chunk_size, "budget": budget,
            "repeats": repeats,
            "unverified_gbps": gbps["unverified"], "verified_gbps": gbps["verified"],
            "one_shot_gbps": gbps["one_shot"],
            "verified_vs_unverified": gbps["verified"] / gbps["unverified"],
            "one_shot_vs_unverified": gbps["one_shot"] / gbps["unverified"],
            "memcpy_gbps": memcpy_gbps(nbytes),
            "fetched_bytes_unverified": runs["unverified"][-1].fetched_bytes,
            "fetched_bytes_verified": last.fetched_bytes,
            "staging_peak_bytes": last.staging_peak_bytes,
            "verify_peak_bytes": last.verify_peak_bytes, "verified_chunks": last.verified_chunks,
            "reused_chunks": last.reused_chunks, "verified": exact}


def _run(args: argparse.Namespace) -> int:
    result = bench_reshard(scale=args.scale, chunk_size=int(parse_size(args.chunk_size)),
                           budget=int(parse_size(args.budget)), repeats=args.repeats)
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    mib = 1 << 20
    table = Table(title=f"fabric bench reshard: TP2 -> TP1, {r['bytes'] / 1e9:.3f} GB, chunks of "
                        f"{r['chunk_size'] / mib:g} MiB, staging budget {r['budget'] / mib:g} MiB")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("unverified GB/s (median)", f"{r['unverified_gbps']:.2f}")
    table.add_row("verified GB/s (median)", f"{r['verified_gbps']:.2f}")
    table.add_row("verified / unverified", f"{r['verified_vs_unverified']:.2f}")
    table.add_row("one-shot unverified GB/s (fresh buffers)", f"{r['one_shot_gbps']:.2f}")
    table.add_row("one-shot / kept reader, unverified", f"{r['one_shot_vs_unverified']:.2f}")
    table.add_row("copy_ of the same bytes GB/s", f"{r['memcpy_gbps']:.2f}")
    table.add_row("bytes read unverified / verified",
                  f"{r['fetched_bytes_unverified'] / mib:.0f} / {r['fetched_bytes_verified'] / mib:.0f} MiB")
    table.add_row("chunks verified (reused from cache)",
                  f"{r['verified_chunks']} ({r['reused_chunks']})")
    table.add_row("verification memory peak", f"{r['verify_peak_bytes'] / mib:.1f} MiB")
    table.add_row("bit-exact", "yes" if r["verified"] else "NO")
    console.print(table)
