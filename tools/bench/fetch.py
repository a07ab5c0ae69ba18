"""`fabric bench fetch`: the data plane on localhost against what users have today.

A hub, a trainer and N readers run as separate processes. The trainer publishes
``--size`` bytes of Llama-shaped tensors; the readers fetch them concurrently
(pipelined: readers feed each other). Reported beside them, in the same run: a
single-process ``copy_`` of the same bytes on the same device (the local limit)
and, on CPU, a gloo broadcast of the same tensors to the same number of processes
(what RL frameworks do without a fabric).

With ``--device cuda`` the stores live in GPU memory on one GPU and readers copy
over CUDA IPC; the run adds the receive-path reshard (staged and direct, bf16 and
fp8) and NVSHMEM reads between ``--nvshmem-pes`` PEs (`tools.bench.gpu_paths`). There is no broadcast baseline there: NCCL needs one
GPU per rank.

GB/s are 1e9 bytes/s. Which phase each figure covers: ``from_publish_*`` from
the start of the trainer's ``publish`` (the new weights are ready) until the last
reader holds them (publish, its checksums and every fetch): the time a user waits,
compared with gloo's whole broadcast in the targets. ``aggregate_gbps``: the
readers' fetch phase only, readers x model bytes / (last reader's end - first
reader's start). Per reader: model bytes / its fetch time (hub plan included).
Gloo: readers x bytes / slowest reader's time, from tensors ready on rank 0.
``--verify both`` alternates verified and unverified versions after the cold one
and reports each one's median fetch phase and ``verify_cost`` (1 - verified /
unverified GB/s): what checking every same-host read costs.

Per reader and version (``per_reader_fixed_ms``, ``per_reader_leases``, in ``versions``;
the last version's at the top level): ``fixed_ms``, the reader's fetch wall time less
what moving its bytes costs at the same run's ``copy_`` rate on the same device
(``memcpy_gbps``: wall - bytes / rate; the cost that does not scale with the bytes:
hub round trips, leases, waits, checksums; null with ``--no-baselines``, which skips
the ``copy_``), and ``leases``, the lease round trips its fetch took
(`FetchStats.leases`).

``--distinct-hosts`` gives every process its own ``WEIGHTFABRIC_HOST_ID``, so every
read crosses "hosts": over TCP, or NIXL where both sides run an agent.
``--transport nixl,nixl-tcp,tcp`` runs the whole benchmark once per transport on
fresh processes (``tcp``: NIXL off; ``nixl``: NIXL with UCX's default transports;
``nixl-tcp``: NIXL with ``UCX_TLS=tcp``) and reports each under ``"runs"`` with
``cpu_s_per_gb``: the CPU seconds of the trainer and every reader during the fetch
phase (every thread) per GB delivered. Deltas are off in those runs (whole chunks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from weightfabric.tools.bench.launch import Agent, AgentError, close_all, print_result
from weightfabric.tools.command import Console, add_command
from weightfabric.topology.units import parse_size

SEED = 1234


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench fetch`."""
    p = add_command(
        subparsers, "fetch", help="CPU fetch GB/s, N readers, vs memcpy and gloo broadcast",
        handler=_run, bad_input=(ValueError,), failures=(AgentError,),
        description="Trainer and N readers as separate processes on localhost; the readers\n"
                    "fetch one version concurrently. Reports aggregate and per-reader GB/s,\n"
                    "the trainer's egress and a bit-exact check, beside a memcpy and a gloo\n"
                    "broadcast of the same bytes. Exits 1 if a reader's bytes differ from the\n"
                    "trainer's or a process fails, 2 on bad options (or --device cuda\n"
                    "without a usable GPU).",
        examples=["fabric bench fetch --readers 4 --size 1GB --json",
                  "fabric bench fetch --device cuda --readers 1 --size 4GB --chunk-size 64MiB",
                  "fabric bench fetch --readers 2 --size 256MB --transport nixl,nixl-tcp,tcp "
                  "--json"])
    p.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--size", default="1GB", help="model bytes, e.g. 256MB, 1GB (default 1GB)")
    p.add_argument("--chunk-size", default="16MiB", help="fetch chunk size (default 16MiB, the "
                                                         "library default)")
    p.add_argument("--max-inflight", type=int, default=4,
                   help="reads in flight per reader (default 4)")
    p.add_argument("--read-bytes", default=None,
                   help="most bytes per read: consecutive chunks are asked for together "
                        "up to this size, and a partial source grants those it has "
                        "(FetchOptions.read_bytes; default: the engine's, 64MiB; the chunk "
                        "size reads chunk by chunk)")
    p.add_argument("--report-interval", type=float, default=None,
                   help="seconds between a reader's progress reports to the hub "
                        "(FetchOptions.report_interval; default: the engine's)")
    p.add_argument("--versions", type=int, default=3,
                   help="versions published and fetched; the last one is reported, the first "
                        "(into fresh memory) as cold_aggregate_gbps (default 3)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the stores keep the weights (default cpu; cuda: GPU 0, "
                        "readers copy over CUDA IPC)")
    p.add_argument("--nvshmem-pes", type=int, default=1,
                   help="with --device cuda: PEs of the NVSHMEM read test (1: a PE reads "
                        "its own region; 2+ on one GPU need MPS, and add a fetch between "
                        "symmetric model stores; 0: skip; default 1)")
    p.add_argument("--attach", action="store_true",
                   help="readers attach a model of the same layout before the first version, "
                        "as RL rollouts do (the first version then lands in the spare buffer "
                        "prepared at attach)")
    p.add_argument("--verify", choices=("default", "all", "none", "both"), default="default",
                   help="which reads check chunk checksums: 'default' (the library's rule: "
                        "every read), 'all', 'none', or 'both': versions after the "
                        "first alternate all / none, and the medians of each are reported with "
                        "the cost of verifying (verify_cost)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip memcpy and gloo (for profiling the fetch alone)")
    p.add_argument("--distinct-hosts", action="store_true",
                   help="every process its own host id: reads cross hosts (tcp or nixl)")
    p.add_argument("--transport", default=None,
                   help="comma-separated runs: nixl (UCX defaults), nixl-tcp (UCX_TLS=tcp), "
                        "tcp (NIXL off); implies --distinct-hosts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_fetch(*, readers: int, size: int, chunk_size: int, max_inflight: int = 4,
                versions: int = 3, baselines: bool = True, report_interval: float | None = None,
                read_bytes: int | None = None,
                device: str = "cpu", nvshmem_pes: int = 0, attach: bool = False,
                verify: str = "default", distinct_hosts: bool = False,
                env: dict[str, str] | None = None,
                on_phase: Callable[[str, int | None], None] = lambda name, total: None,
                on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the benchmark once; returns the JSON result (see the module docstring).

    ``env``: extra environment variables of every process (a transport's settings).

    Raises:
        ValueError: bad sizes or reader count, or ``device="cuda"`` without a usable GPU.
        AgentError: a process failed or timed out.
    """
    if readers < 1:
        raise ValueError(f"--readers must be >= 1, got {readers}")
    if versions < 1:
        raise ValueError(f"--versions must be >= 1, got {versions}")
    if size < 1 << 20:
        raise ValueError(f"--size must be at least 1MiB, got {size} bytes")
    if chunk_size <= 0 or chunk_size % 256:
        raise ValueError(f"--chunk-size must be a positive multiple of 256, got {chunk_size}")
    if max_inflight < 1:
        raise ValueError(f"--max-inflight must be >= 1, got {max_inflight}")
    if read_bytes is not None and read_bytes <= 0:
        raise ValueError(f"--read-bytes must be positive, got {read_bytes}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"--verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if verify == "both" and versions < 3:
        raise ValueError("--verify both needs --versions >= 3 (a cold one, then one of each)")
    if device == "cuda":
        from weightfabric.fabric.gpu import probe

        missing = probe().missing("cuda")
        if missing is not None:
            raise ValueError(f"--device cuda needs a GPU: {missing}")
    from weightfabric.fabric.arena import remove_stale_regions
    from weightfabric.fabric.fetch import FetchOptions
    from weightfabric.tools.bench import baselines as base

    result: dict[str, Any] = {"readers": readers, "size_requested": size, "device": device,
                              "attach": attach,
                              "chunk_size": chunk_size, "max_inflight": max_inflight,
                              "read_bytes": read_bytes or FetchOptions.read_bytes}
    options: dict[str, Any] = {"max_inflight": max_inflight}
    if distinct_hosts:
        options["deltas"] = "off"  # whole chunks: what the transports move
    if read_bytes is not None:
        options["read_bytes"] = read_bytes
    if report_interval is not None:
        options["report_interval"] = report_interval
    if baselines:
        on_phase("memcpy", None)
        result["memcpy_gbps"] = base.memcpy_gbps(size, device=device)
    agents: list[Agent] = []
    try:
        on_phase("start processes", None)
        hub = Agent("hub")
        agents.append(hub)
        url = hub.ask("hub", host="127.0.0.1")["url"]
        names = ["trainer", *(f"reader-{i}" for i in range(readers))]
        started = [Agent(n, on_progress=on_progress, ready_timeout=None,
                         env={**(env or {}), **({"WEIGHTFABRIC_HOST_ID": n}
                                                if distinct_hosts else {})})
                   for n in names]
        agents.extend(started)
        for a in started:
            a.reply(120)
            a.ask("join", url=url, name=a.name, chunk_size=chunk_size, device=device,
                  attach=size if attach and a.name != "trainer" else 0, timeout=300)
        trainer, reader_agents = started[0], started[1:]
        rounds = []
        for i in range(versions):
            on_phase(f"v{i + 1}: publish", None)
            pub = trainer.ask("publish", size=size, seed=SEED, timeout=300)
            served = int(trainer.ask("served")["bytes"])
            on_phase(f"v{i + 1}: fetch", None)
            checks = _verify_flag(verify, i)
            cpu = sum(a.ask("cpu")["seconds"] for a in started)
            for r in reader_agents:
                r.send("fetch", version=pub["version"], options=options, verify=checks)
            fetched = [r.reply(600) for r in reader_agents]
            cpu = sum(a.ask("cpu")["seconds"] for a in started) - cpu
            egress = int(trainer.ask("served")["bytes"]) - served
            on_phase(f"v{i + 1}: verify", None)
            want = trainer.ask("digest", timeout=300)["sha256"]
            digests = [r.ask("digest", timeout=300)["sha256"] for r in reader_agents]
            rounds.append({**_round(pub, fetched, egress, all(d == want for d in digests),
                                    copy_gbps=result.get("memcpy_gbps")),
                           "verify": checks, "cpu_s_per_gb": cpu / (readers * pub["bytes"] / 1e9),
                           "transports": [f["transports"] for f in fetched]})
    finally:
        close_all(agents)
        remove_stale_regions()
    last = rounds[-1]
    result.update(last)
    result["verified"] = all(r["verified"] for r in rounds)
    result["versions"] = rounds
    result["cold_aggregate_gbps"] = rounds[0]["aggregate_gbps"]
    result["verify"] = verify
    if verify == "both":
        result.update(_verify_cost(rounds[1:]))
    if device == "cuda":
        from weightfabric.tools.bench.gpu_paths import reshard_reads

        on_phase("reshard reads", None)
        result["reshard"] = reshard_reads(device="cuda")
        result["verified"] = result["verified"] and result["reshard"]["verified"]
    if device == "cuda" and nvshmem_pes > 0:
        from weightfabric.tools.bench.gpu_paths import nvshmem_reads

        on_phase("nvshmem reads", None)
        result["nvshmem"] = nvshmem_reads(pes=nvshmem_pes, size=size, chunk_size=chunk_size)
        result["verified"] = result["verified"] and result["nvshmem"]["verified"]
    if device == "cuda" and nvshmem_pes > 1:
        from weightfabric.tools.bench.gpu_paths import nvshmem_store_fetch

        on_phase("nvshmem store fetch", None)
        result["nvshmem_store"] = nvshmem_store_fetch(pes=nvshmem_pes, size=size,
                                                      chunk_size=chunk_size)
        result["verified"] = result["verified"] and result["nvshmem_store"]["verified"]
    if baselines and device == "cpu":
        on_phase("gloo broadcast", None)
        result["gloo_broadcast_gbps"] = base.gloo_broadcast_gbps(pub["tensor_bytes"], readers)
    if baselines:
        result["targets"] = _targets(result)
    return result


VERIFY_MODES = ("default", "all", "none", "both")
TRANSPORTS = {"nixl": {"WEIGHTFABRIC_NIXL": "1"},
              "nixl-tcp": {"WEIGHTFABRIC_NIXL": "1", "UCX_TLS": "tcp"},
              "tcp": {"WEIGHTFABRIC_NIXL": "0"}}
"""``--transport`` runs: each one's environment."""


def bench_transports(transports: list[str], **kwargs: Any) -> dict[str, Any]:
    """`bench_fetch` once per transport, across "hosts", on fresh processes each.

    Returns the first run's result with every run's figures under ``"runs"``.

    Raises:
        ValueError: an unknown transport, or NIXL asked for where it is not installed.
    """
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown or not transports:
        raise ValueError(f"--transport: choose from {', '.join(TRANSPORTS)}, not "
                         f"{unknown or transports}")
    from weightfabric.fabric.transports.nixl import nixl_missing

    missing = nixl_missing(True)
    if missing is not None and any(t.startswith("nixl") for t in transports):
        raise ValueError(f"--transport nixl: {missing}")
    runs: dict[str, Any] = {}
    result: dict[str, Any] = {}
    baselines = kwargs.pop("baselines", True)
    for i, name in enumerate(transports):
        out = bench_fetch(**kwargs, distinct_hosts=True, env=TRANSPORTS[name],
                          baselines=baselines and i == 0)
        moved = {t for per_reader in out["transports"] for t in per_reader}
        runs[name] = {"per_reader_gbps": out["per_reader_gbps"],
                      "aggregate_gbps": out["aggregate_gbps"],
                      "verified": out["verified"], "cpu_s_per_gb": out["cpu_s_per_gb"],
                      "bytes_by": sorted(moved),
                      "versions": [{k: v[k] for k in ("aggregate_gbps", "per_reader_gbps",
                                                        "cpu_s_per_gb")}
                                   for v in out["versions"]]}
        result = result or out
    result["runs"] = runs
    result["verified"] = all(r["verified"] for r in runs.values())
    return result


def _verify_flag(mode: str, index: int) -> bool | None:
    """The ``verify=`` of version ``index`` (0-based) under ``--verify mode``."""
    if mode == "both":  # the first (cold) and then every other one verified
        return index % 2 == 0
    return {"default": None, "all": True, "none": False}[mode]


def _verify_cost(warm: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of the verified and unverified warm versions' fetch phases, and the cost."""
    import statistics

    def median(flag: bool, key: str) -> float:
        return statistics.median(r[key] for r in warm if r["verify"] is flag)

    verified, unverified = (median(True, "aggregate_gbps"), median(False, "aggregate_gbps"))
    return {"verified_aggregate_gbps": verified, "unverified_aggregate_gbps": unverified,
            "verified_from_publish_seconds": median(True, "from_publish_seconds"),
            "unverified_from_publish_seconds": median(False, "from_publish_seconds"),
            "verify_cost": 1 - verified / unverified}


def fixed_ms(wall_s: float, nbytes: int, copy_gbps: float | None) -> float | None:
    """Milliseconds of ``wall_s`` beyond copying ``nbytes`` at ``copy_gbps`` (None: no rate)."""
    if copy_gbps is None or copy_gbps <= 0:
        return None
    return (wall_s - nbytes / (copy_gbps * 1e9)) * 1e3


def _round(pub: dict[str, Any], fetched: list[dict[str, Any]], egress: int,
           verified: bool, *, copy_gbps: float | None = None) -> dict[str, Any]:
    """The figures of one version: every reader's fetch, the trainer's egress.

    ``copy_gbps``: the run's ``copy_`` rate on the device, for each reader's `fixed_ms`.
    """
    model_bytes = int(pub["bytes"])
    span = max(f["end"] for f in fetched) - min(f["start"] for f in fetched)
    from_publish = max(f["end"] for f in fetched) - pub["start"]
    return {
        "version": pub["version"],
        "bytes": model_bytes,
        "verified": verified,
        "publish_seconds": pub["end"] - pub["start"],
        "from_publish_seconds": from_publish,
        "from_publish_aggregate_gbps": len(fetched) * model_bytes / from_publish / 1e9,
        "per_reader_gbps": [model_bytes / (f["end"] - f["start"]) / 1e9 for f in fetched],
        "per_reader_seconds": [f["end"] - f["start"] for f in fetched],
        "per_reader_engine_seconds": [f["seconds"] for f in fetched],
        "per_reader_sources": [f["sources"] for f in fetched],
        "per_reader_fixed_ms": [fixed_ms(f["end"] - f["start"], int(f["bytes"]), copy_gbps)
                                for f in fetched],
        "per_reader_leases": [int(f.get("leases", 0)) for f in fetched],
        "aggregate_gbps": len(fetched) * model_bytes / span / 1e9,
        "seconds": span,
        "trainer_egress_bytes": egress,
        "trainer_egress_per_model": egress / model_bytes,
    }


def _targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets for this device and reader count (issue 6 on CPU, issue 7 on GPU)."""
    if r["device"] == "cuda":
        ratio = r["aggregate_gbps"] / r["memcpy_gbps"]
        return {"aggregate_vs_device_copy": {"value": ratio, "goal": ">= 0.85",
                                             "met": ratio >= 0.85}}
    if r["readers"] == 1:
        ratio = r["aggregate_gbps"] / r["memcpy_gbps"]
        return {"one_reader_vs_memcpy": {"value": ratio, "goal": ">= 0.70", "met": ratio >= 0.70}}
    # like with like: gloo's time is the whole job, so the fabric's counts from the publish
    ratio = r["from_publish_aggregate_gbps"] / r["gloo_broadcast_gbps"]
    egress = r["trainer_egress_per_model"]
    return {"aggregate_vs_gloo": {"value": ratio, "goal": "> 1.0", "met": ratio > 1.0},
            "trainer_egress_per_model": {"value": egress, "goal": "<= 2.0", "met": egress <= 2.0}}


def _run(args: argparse.Namespace) -> int:
    size = int(parse_size(args.size))
    chunk = int(parse_size(args.chunk_size))
    read_bytes = None if args.read_bytes is None else int(parse_size(args.read_bytes))
    console = Console(stderr=True)
    columns = (TextColumn("{task.description:<16}"), BarColumn(), TaskProgressColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        phase = progress.add_task("", total=None)
        bars: dict[str, TaskID] = {}

        def on_phase(name: str, total: int | None) -> None:
            progress.update(phase, description=name)

        def on_progress(name: str, done: int, total: int) -> None:
            if name not in bars:
                bars[name] = progress.add_task(name, total=total)
            progress.update(bars[name], completed=done)

        common: dict[str, Any] = dict(
            readers=args.readers, size=size, chunk_size=chunk, max_inflight=args.max_inflight,
            read_bytes=read_bytes, versions=args.versions,
            report_interval=args.report_interval, device=args.device,
            nvshmem_pes=args.nvshmem_pes, attach=args.attach, verify=args.verify,
            baselines=not args.no_baselines, on_phase=on_phase, on_progress=on_progress)
        if args.transport is not None:
            result = bench_transports([t.strip() for t in args.transport.split(",")
                                       if t.strip()], **common)
        else:
            result = bench_fetch(**common, distinct_hosts=args.distinct_hosts)
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench fetch: {r['readers']} reader(s), {r['bytes'] / 1e9:.3f} GB "
                        f"on {r['device']}, chunks of {r['chunk_size'] / (1 << 20):g} MiB, "
                        f"reads up to {r['read_bytes'] / (1 << 20):g} MiB")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("fabric aggregate GB/s, from publish (ready -> every reader has it)",
                  f"{r['from_publish_aggregate_gbps']:.2f}")
    table.add_row("  publish s / until the last reader s",
                  f"{r['publish_seconds']:.3f} / {r['from_publish_seconds']:.3f}")
    table.add_row("fabric aggregate GB/s, fetch phase only", f"{r['aggregate_gbps']:.2f}")
    for i, (gbps, src) in enumerate(zip(r["per_reader_gbps"], r["per_reader_sources"], strict=True)):
        origin = ", ".join(f"{w} {b / r['bytes']:.0%}" for w, b in sorted(src.items()))
        table.add_row(f"  reader-{i} GB/s", f"{gbps:.2f}  ({origin})")
    for i in range(r["readers"]):
        table.add_row(f"  reader-{i} fixed ms / leases, per version",
                      ", ".join(f"v{v['version']} " + ("-" if v["per_reader_fixed_ms"][i] is None
                                                       else f"{v['per_reader_fixed_ms'][i]:.1f}")
                                + f" / {v['per_reader_leases'][i]}" for v in r["versions"]))
    table.add_row("trainer egress", f"{r['trainer_egress_bytes'] / 1e9:.3f} GB "
                                    f"({r['trainer_egress_per_model']:.2f} x model)")
    table.add_row("bit-exact on every reader", "yes" if r["verified"] else "[red]NO[/red]")
    if "memcpy_gbps" in r:
        table.add_row(f"torch copy_ GB/s (1 process, {r['device']})", f"{r['memcpy_gbps']:.2f}")
    for kind, x in ((k, r["reshard"][k]) for k in ("bf16", "fp8") if "reshard" in r):
        table.add_row(f"TP2->TP1 {kind} GB/s staged / direct / copy_",
                      f"{x['staged_gbps']:.1f} / {x['direct_gbps']:.1f} / {x['copy_gbps']:.1f}"
                      + ("" if x["verified"] else "  [red]NOT bit-exact[/red]"))
    for key, what in (("nvshmem", "NVSHMEM get"), ("nvshmem_store", "NVSHMEM store fetch")):
        if key in r:
            n = r[key]
            table.add_row(f"{what} GB/s ({n['pes']} PEs, per reader; copy_)",
                          ", ".join(f"{g:.2f}" for g in n["per_reader_gbps"]) +
                          f"; {max(n['copy_gbps'], default=0):.2f}" +
                          ("" if n["verified"] else "  [red]NOT verified[/red]"))
    if "verify_cost" in r:
        table.add_row("fetch phase GB/s verified / unverified (warm medians)",
                      f"{r['verified_aggregate_gbps']:.2f} / {r['unverified_aggregate_gbps']:.2f}"
                      f"  (verifying costs {r['verify_cost']:.0%})")
    if "gloo_broadcast_gbps" in r:
        table.add_row("gloo broadcast GB/s (aggregate)", f"{r['gloo_broadcast_gbps']:.2f}")
    for name, t in r.get("targets", {}).items():
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        table.add_row(f"target {name} {t['goal']}", f"{t['value']:.2f} {mark}")
    for name, run in r.get("runs", {}).items():
        table.add_row(f"--transport {name}: aggregate GB/s, per reader, CPU s/GB",
                      f"{run['aggregate_gbps']:.2f}; "
                      + ", ".join(f"{g:.2f}" for g in run["per_reader_gbps"])
                      + f"; {run['cpu_s_per_gb']:.2f}"
                      + ("" if run["verified"] else "  [red]NOT bit-exact[/red]"))
    console.print(table)
