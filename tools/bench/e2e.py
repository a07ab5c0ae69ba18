"""`fabric bench e2e`: time to version, end to end, against what RL stacks use today.

The same job for every system: a trainer's new weights (``--size`` bytes of
Llama-shaped tensors, `agent.bench_tensors`) are ready; the clock stops when the
last of ``--readers`` reader processes holds them, bit for bit (a sha256 of every
reader's tensors is compared with the trainer's after each version, untimed).
Each system runs ``--versions`` versions: the first is *cold* (right after the
processes started and set up, as an RL job's first sync), the others *warm*
(medians reported). A peer that fails (e.g. Ray out of memory) is listed under
``failed`` with its error, and the run goes on. Systems:

- ``weightfabric-snapshot``: the trainer reserved its buffer at start-up
  (`ModelStore.reserve`) and publishes a snapshot (copy + checksums in one pass);
  readers, with their models attached, fetch (every chunk verified, the default)
  and switch; with ``--reader-mode in-place`` they fetch into their live
  weights (one buffer each; `ModelStore.fetch`'s ``in_place``).
- ``weightfabric-inplace``: the trainer attached its tensors and publishes them in
  place (``publish(snapshot=False)``: checksums only); the rest as above.
- ``gloo-per-tensor`` / ``gloo-flat``: a ``torch.distributed`` gloo broadcast from
  the trainer to the readers, tensor by tensor, or packed into one flat buffer and
  unpacked on each reader (both copies timed).
- ``memcpy``: one process copying the bytes (``copy_``), the local floor.
- ``ray-put-get`` / ``ray-zero-copy`` (`tools.bench.peers`) when ``ray`` is
  installed: Ray's object store, torch tensors pickled, or numpy byte arrays that
  readers map zero-copy (and check nothing); ``nixl-read`` when ``nixl-cu13`` is:
  readers READ the trainer's registered tensors with NIXL (UCX), nothing packed or
  checked, the engine's floor.

Start-up (joining, attaching, reserving, and the background populate of prepared
buffers: `ModelStore.wait_prepared`) is untimed, as an RL job does it before its
first step. The systems run one after another (all at once would not fit: at 2 GB
and 4 readers the fabric alone holds about 11 x S). Peak memory per fabric process
is its own: anonymous RSS plus the /dev/shm files it owns (`agent.MemoryWatch`;
plain RSS also counts peers' shared pages it read): its peak from the end of
start-up on, less what the process held when it started (the interpreter and
torch), as ``peak_memory_per_model`` = that / S. Times are wall-clock seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from weightfabric.tools.bench.launch import Agent, AgentError, close_all, print_result
from weightfabric.tools.command import Console, add_command
from weightfabric.topology.units import parse_size

SEED = 4321
FABRIC = ("weightfabric-snapshot", "weightfabric-inplace")
GLOO = ("gloo-per-tensor", "gloo-flat")
PEERS = {"ray-put-get": "ray", "ray-zero-copy": "ray", "nixl-read": "nixl_cu13"}
"""Systems that run only where their package is importable (`tools.bench.peers`); the
others are reported skipped, with the reason."""
SYSTEMS = (*FABRIC, *GLOO, "memcpy", *PEERS)
READER_MODES = ("double", "in-place")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench e2e`."""
    p = add_command(
        subparsers, "e2e", help="time to version end to end: fabric vs gloo, Ray, NIXL, memcpy",
        handler=_run, bad_input=(ValueError,), failures=(AgentError,),
        description="From 'the trainer's new weights are ready' until every reader holds\n"
                    "them, bit-exact: weightfabric (snapshot and in-place publish) beside a\n"
                    "gloo broadcast (per tensor and flat) and a memcpy, each for --versions\n"
                    "versions (the first cold, medians of the rest warm). Exits 1 if any\n"
                    "reader's bytes differ, 2 on bad options.",
        examples=["fabric bench e2e --readers 4 --size 512MB",
                  "fabric bench e2e --readers 1 --size 2GB --json"])
    p.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--size", default="512MB", help="model bytes (default 512MB)")
    p.add_argument("--versions", type=int, default=4,
                   help="versions per system, the first cold (default 4: 3 warm)")
    p.add_argument("--chunk-size", default="16MiB", help="fabric chunk size (default 16MiB)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--reader-mode", choices=READER_MODES, default="double",
                   help="how fabric readers hold versions: 'double' (a spare buffer, the engine "
                        "keeps running on the old version; 2 x S each) or 'in-place' (the "
                        "version lands in the live weights, engine paused; 1 x S each). "
                        "Default double")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_e2e(*, readers: int, size: int, versions: int = 4, chunk_size: int = 16 << 20,
              systems: tuple[str, ...] = SYSTEMS, reader_mode: str = "double",
              on_phase: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (module docstring; `_table` reads it).

    Raises:
        ValueError: bad options.  AgentError: a process failed or timed out.
    """
    if readers < 1:
        raise ValueError(f"--readers must be >= 1, got {readers}")
    if versions < 2:
        raise ValueError(f"--versions must be >= 2 (one cold, then warm), got {versions}")
    if size < 1 << 20:
        raise ValueError(f"--size must be at least 1MiB, got {size} bytes")
    if chunk_size <= 0 or chunk_size % 256:
        raise ValueError(f"--chunk-size must be a positive multiple of 256, got {chunk_size}")
    if reader_mode not in READER_MODES:
        raise ValueError(f"--reader-mode must be one of {', '.join(READER_MODES)}, "
                         f"got {reader_mode!r}")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    runs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for system in systems:
        if system in PEERS and importlib.util.find_spec(PEERS[system]) is None:
            skipped[system] = f"{PEERS[system]} is not installed"
            continue
        on_phase(system)
        if system in PEERS:  # a peer that fails (e.g. Ray out of memory) is reported, not fatal
            try:
                runs[system] = _peer(system, readers, size, versions)
            except Exception as exc:  # noqa: BLE001 (whatever the peer raised, with its text)
                failed[system] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if system in FABRIC:
            times = _fabric(readers, size, versions, chunk_size,
                            inplace=system == "weightfabric-inplace", reader_mode=reader_mode,
                            on_phase=on_phase)
        elif system in GLOO:
            times = _gloo(readers, size, versions, flat=system == "gloo-flat")
        else:
            times = _memcpy(size, versions)
        runs[system] = times
    result: dict[str, Any] = {"bytes": runs[next(iter(runs))]["bytes"] if runs else size,
                              "readers": readers, "versions": versions,
                              "reader_mode": reader_mode,
                              "chunk_size": chunk_size, "runs": runs, "skipped": skipped,
                              "failed": failed}
    for system in FABRIC:  # the top-level phases: the snapshot publisher's, else in place
        if system in runs:
            result["publish_s"] = runs[system]["publish_s"]
            result["fetch_s"] = runs[system]["fetch_s"]
            result["phases_of"] = system
            break
    result["verified"] = all(r["verified"] for r in runs.values())
    result["targets"] = _targets(result)
    return result


def _summary(seconds: list[float], verified: bool, nbytes: int, **extra: Any) -> dict[str, Any]:
    return {"cold_s": seconds[0], "warm_s": statistics.median(seconds[1:]),
            "versions_s": seconds, "verified": verified, "bytes": nbytes, **extra}


def _fabric(readers: int, size: int, versions: int, chunk_size: int, *, inplace: bool,
            reader_mode: str, on_phase: Callable[[str], None]) -> dict[str, Any]:
    from weightfabric.fabric.arena import remove_stale_regions

    agents: list[Agent] = []
    try:
        hub = Agent("hub")
        agents.append(hub)
        url = hub.ask("hub", host="127.0.0.1")["url"]
        started = [Agent(n, ready_timeout=None)
                   for n in ["trainer", *(f"reader-{i}" for i in range(readers))]]
        agents.extend(started)
        for a in started:
            a.reply(120)
        trainer, reader_agents = started[0], started[1:]
        in_place_readers = reader_mode == "in-place"
        for a in started:  # start-up, untimed: what an RL job does before its first step
            a.ask("join", url=url, name=a.name, chunk_size=chunk_size,
                  attach=size if a is not trainer else 0, timeout=300,
                  keep_last=1 if in_place_readers and a is trainer else 0,
                  prepare_spare=not (in_place_readers if a is not trainer else inplace))
        trainer.ask("prepare", size=size, seed=SEED, inplace=inplace, timeout=300)
        for a in started:
            a.ask("settle", timeout=300)
        seconds, publish, fetch, verified = [], [], [], True
        for v in range(versions):
            on_phase(f"{'in place' if inplace else 'snapshot'} v{v + 1}")
            pub = trainer.ask("publish", size=size, seed=SEED, inplace=inplace, timeout=300)
            for r in reader_agents:
                r.send("fetch", version=pub["version"], in_place=in_place_readers)
            fetched = [r.reply(600) for r in reader_agents]
            end = max(f["end"] for f in fetched)
            seconds.append(end - pub["start"])
            publish.append(pub["end"] - pub["start"])
            fetch.append(end - pub["end"])
            want = trainer.ask("digest", timeout=300)["sha256"]
            verified &= all(r.ask("digest", timeout=300)["sha256"] == want for r in reader_agents)
        memory = {a.name: a.ask("memory") for a in started}
        nbytes = int(pub["bytes"])
    finally:
        close_all(agents)
        remove_stale_regions()
    return _summary(seconds, verified, nbytes, publish_s=statistics.median(publish[1:]),
                    fetch_s=statistics.median(fetch[1:]), cold_publish_s=publish[0],
                    reader_mode=reader_mode, memory=memory, peak_memory_per_model={
                        name: round((m["peak_total"] - m["base_total"]) / nbytes, 2)
                        for name, m in memory.items()})


def _gloo(readers: int, size: int, versions: int, *, flat: bool) -> dict[str, Any]:
    agents: list[Agent] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            agents = [Agent(f"rank-{r}", ready_timeout=None) for r in range(readers + 1)]
            for a in agents:
                a.reply(120)
            seconds, verified = [], True
            for _ in range(versions):
                for rank, a in enumerate(agents):
                    a.send("gloo", rank=rank, world=readers + 1, store=str(Path(tmp) / "store"),
                           size=size, seed=SEED, flat=flat)
                done = [a.reply(600) for a in agents]
                seconds.append(max(d["end"] for d in done) - min(d["start"] for d in done))
                verified &= all(d["sha256"] == done[0]["sha256"] for d in done)
        finally:
            close_all(agents)
    return _summary(seconds, verified, int(done[0]["bytes"]))


def _peer(system: str, readers: int, size: int, versions: int) -> dict[str, Any]:
    if system == "nixl-read":
        return _nixl(readers, size, versions)
    from weightfabric.tools.bench.peers import ray_e2e

    ray = ray_e2e(readers, size, versions, zero_copy=system == "ray-zero-copy", seed=SEED)
    return _summary(ray["seconds"], ray["verified"], ray["bytes"])


def _nixl(readers: int, size: int, versions: int) -> dict[str, Any]:
    agents: list[Agent] = []
    try:
        agents = [Agent(n, ready_timeout=None)
                  for n in ["trainer", *(f"reader-{i}" for i in range(readers))]]
        for a in agents:
            a.reply(120)
        trainer, reader_agents = agents[0], agents[1:]
        served = trainer.ask("nixl_serve", name="trainer", size=size, seed=SEED, timeout=300)
        seconds, verified = [], True
        for _ in range(versions):
            ready = trainer.ask("nixl_bump", timeout=300)
            for r in reader_agents:
                r.send("nixl_read", name=r.name, served=served)
            done = [r.reply(600) for r in reader_agents]
            seconds.append(max(d["end"] for d in done) - ready["start"])
            verified &= all(d["sha256"] == ready["sha256"] for d in done)
    finally:
        close_all(agents)
    return _summary(seconds, verified, sum(served["sizes"].values()))


def _memcpy(size: int, versions: int) -> dict[str, Any]:
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)  # fresh pages: the first copy is the cold one
    seconds = []
    for _ in range(versions):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return _summary(seconds, bool(torch.equal(dst, src)), size)


def _targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 22's targets that this run's systems measure."""
    runs, out = r["runs"], {}
    fabric = [runs[s]["warm_s"] for s in FABRIC if s in runs]
    if fabric:
        best = min(fabric)
        for peer in ("gloo-per-tensor", "gloo-flat"):
            if peer in runs:
                ratio = best / runs[peer]["warm_s"]
                out[f"fabric_vs_{peer}"] = {"value": ratio, "goal": "<= 1.0", "met": ratio <= 1.0}
        if "ray-zero-copy" in runs:
            ratio = best / runs["ray-zero-copy"]["warm_s"]
            out["fabric_vs_ray_zero_copy"] = {"value": ratio, "goal": "<= 1.2",
                                              "met": ratio <= 1.2}
    if r.get("phases_of") == "weightfabric-snapshot" and "memcpy" in runs:
        ratio = r["publish_s"] / runs["memcpy"]["warm_s"]
        out["snapshot_publish_vs_memcpy"] = {"value": ratio, "goal": "<= 2.0", "met": ratio <= 2.0}
    for system in FABRIC:
        if system in runs:
            ratio = runs[system]["cold_s"] / runs[system]["warm_s"]
            out[f"{system}_cold_vs_warm"] = {"value": ratio, "goal": "<= 1.5", "met": ratio <= 1.5}
    return out


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    with console.status("starting") as status:
        result = bench_e2e(readers=args.readers, size=int(parse_size(args.size)),
                           versions=args.versions, chunk_size=int(parse_size(args.chunk_size)),
                           systems=systems, reader_mode=args.reader_mode,
                           on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench e2e: {r['bytes'] / 1e9:.3f} GB to {r['readers']} "
                        f"reader(s), {r['versions'] - 1} warm versions (median)")
    for column in ("system", "warm s", "cold s", "GB/s warm (aggregate)", "verified"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name, run in r["runs"].items():
        table.add_row(name, f"{run['warm_s']:.3f}", f"{run['cold_s']:.3f}",
                      f"{r['readers'] * run['bytes'] / run['warm_s'] / 1e9:.2f}"
                      if name != "memcpy" else f"{run['bytes'] / run['warm_s'] / 1e9:.2f}",
                      "yes" if run["verified"] else "[red]NO[/red]")
    for name, why in r["skipped"].items():
        table.add_row(name, "-", "-", "-", f"skipped: {why}")
    for name, why in r["failed"].items():
        table.add_row(name, "-", "-", "-", f"[red]failed[/red]: {why}")
    console.print(table)
    if "publish_s" in r:
        console.print(f"{r['phases_of']}: publish {r['publish_s']:.3f} s, then fetch "
                      f"{r['fetch_s']:.3f} s (warm medians)")
    for name in FABRIC:
        if name in r["runs"]:
            peaks = ", ".join(f"{w} {x:.2f}" for w, x in r["runs"][name]["peak_memory_per_model"]
                              .items())
            console.print(f"{name} peak memory per process, x S: {peaks}")
    for name, t in r["targets"].items():
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        console.print(f"target {name} {t['goal']}: {t['value']:.2f} {mark}")
