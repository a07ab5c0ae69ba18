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

``--cold-start`` runs the weightfabric systems as a new user's job runs, following
the README's trainer and rollout code: the trainer makes its tensors and publishes
(``store.publish(tensors)``) with no `ModelStore.reserve` before the first publish;
readers attach their models and go straight into ``store.sync`` (waiting for each
version, then fetching it); nobody waits for the stores' background populates (the
spare buffer `attach` prepares, the spare after each switch). Every version is timed,
the first ones included, so the cold versions show. (The in-place publisher still
attaches its tensors: that is what in-place publishing is.) The other systems are
the same with or without it.

``--step-seconds S`` (default 0.5) is slept before every version in every system,
the first included, for the RL step before each publish (generation, the training
step; the README's trainer trains a step before its first publish too): the time
the stores' background work has in a real loop. The untimed sha256 check after
each version (every process in parallel) adds to it; each fabric version's
``gap_s`` is the time actually between the previous version's last reader and this
publish. ``--verify last`` checks the fabric's readers after the last version only, so
that with ``--step-seconds 0`` its versions run back to back (a loop that publishes as
soon as the readers hold the previous version).

Per system and version: ``versions_s`` (the time to version), ``versions_vs_warm``
(each over the warm median); the fabric and ``ipc-per-tensor`` split each into the
trainer's part (``publish_versions_s``: the publish, or exporting the IPC handles)
and the readers' (``fetch_versions_s``: from its end until the last reader holds
the version), and the fabric lists each reader's (``reader_fetch_s``, from the end
of the publish; ``reader_engine_s``, its fetch's own seconds; ``reader_leases``).

``--device cuda`` runs the same job on the visible GPUs: the trainer on ``cuda:0``,
reader *i* on ``cuda:(i + 1) mod GPUs`` (all on one GPU when there is one), fabric
stores with ``device="cuda:N"`` (readers copy over CUDA IPC), against
``ipc-per-tensor`` (vLLM's CUDA IPC weight transfer, `peers.IpcPeer`: per version the
trainer exports one handle per tensor, each reader rebuilds them and ``copy_``s into
its own tensors, then acknowledges) and ``copy`` (one ``copy_`` of S on ``cuda:0`` in
one process: the limit). Times end after a device synchronize. Memory figures are
host memory only. Without a usable GPU it exits 2, saying why.
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
CUDA_SYSTEMS = (*FABRIC, "ipc-per-tensor", "copy")
"""``--device cuda``'s systems (the others are CPU-only)."""
READER_MODES = ("double", "in-place")
VERIFY = ("each", "last")
DEVICES = ("cpu", "cuda")
STEP_S = 0.5
"""Default seconds slept before each version (``--step-seconds``)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench e2e`."""
    p = add_command(
        subparsers, "e2e", help="time to version end to end: fabric vs gloo, Ray, NIXL, memcpy",
        handler=_run, bad_input=(ValueError,), failures=(AgentError,),
        description="From 'the trainer's new weights are ready' until every reader holds\n"
                    "them, bit-exact: weightfabric (snapshot and in-place publish) beside a\n"
                    "gloo broadcast (per tensor and flat) and a memcpy, each for --versions\n"
                    "versions (the first cold, medians of the rest warm), --step-seconds\n"
                    "apart. --cold-start runs the fabric as the README's trainer and\n"
                    "rollouts do (no reserve, no waiting for background populates).\n"
                    "--device cuda: the same on the GPUs, against vLLM's CUDA IPC weight\n"
                    "transfer and a device copy_. Exits 1 if any reader's bytes differ, 2 on\n"
                    "bad options (or --device cuda without a usable GPU).",
        examples=["fabric bench e2e --readers 4 --size 512MB",
                  "fabric bench e2e --readers 1 --size 2GB --json",
                  "fabric bench e2e --cold-start --readers 1 --size 2GB --versions 4 --json",
                  "fabric bench e2e --device cuda --readers 4 --size 2GB --json"])
    p.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--size", default="512MB", help="model bytes (default 512MB)")
    p.add_argument("--versions", type=int, default=4,
                   help="versions per system, the first cold (default 4: 3 warm)")
    p.add_argument("--chunk-size", default="16MiB", help="fabric chunk size (default 16MiB)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {', '.join(SYSTEMS)}; with --device cuda "
                        f"of {', '.join(CUDA_SYSTEMS)} (default: all of the device's)")
    p.add_argument("--reader-mode", choices=READER_MODES, default="double",
                   help="how fabric readers hold versions: 'double' (a spare buffer, the engine "
                        "keeps running on the old version; 2 x S each) or 'in-place' (the "
                        "version lands in the live weights, engine paused; 1 x S each). "
                        "Default double")
    p.add_argument("--cold-start", action="store_true",
                   help="run the weightfabric systems as a new user's job, following the "
                        "README: the trainer publishes without reserve(), readers attach and "
                        "call store.sync, nobody waits for background populates "
                        "(wait_prepared); every version timed, the first ones included "
                        "(per-version times and their ratio to the warm median). gloo, "
                        "memcpy and the peers run as without it")
    p.add_argument("--step-seconds", type=float, default=STEP_S,
                   help=f"seconds slept before each version in every system, the first included "
                        f"(default {STEP_S:g}): the RL step before each publish (generation, "
                        "training; the README's trainer trains before its first publish), the time "
                        "background work (populating spare buffers) has in a real loop; the "
                        "untimed sha256 check after each version adds to it (the fabric "
                        "reports the gap it measured, gap_s). 0: versions back to back")
    p.add_argument("--verify", choices=VERIFY, default="each",
                   help="when the fabric systems' readers are checked against the trainer "
                        "(sha256, untimed): after 'each' version (default; the check adds to "
                        "the gap between versions) or only the 'last', so that with "
                        "--step-seconds 0 the versions run back to back, as a loop that "
                        "publishes as soon as the readers hold the last version")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu (default), or cuda: trainer and readers on the visible GPUs "
                        "(round-robin, the trainer on cuda:0), fabric stores on them, against "
                        "ipc-per-tensor (vLLM's CUDA IPC weight transfer: a handle per "
                        "tensor, each reader copy_s) and copy (one device copy_ of the "
                        "bytes, the limit); exits 2 without a usable GPU")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def check_options(*, readers: int, size: int, versions: int, chunk_size: int,
                  systems: tuple[str, ...] | None, reader_mode: str, step_s: float,
                  device: str) -> tuple[str, ...]:
    """Check `bench_e2e`'s options (no GPU needed); returns the systems to run.

    Raises:
        ValueError: a bad option, or a system that does not run on ``device``.
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
    if not step_s >= 0 or step_s == float("inf"):  # NaN fails the first test
        raise ValueError(f"--step-seconds must be a finite number >= 0, got {step_s}")
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    allowed = CUDA_SYSTEMS if device == "cuda" else SYSTEMS
    systems = allowed if systems is None else systems
    unknown = sorted(set(systems) - set(allowed))
    if unknown:
        raise ValueError(f"unknown systems {unknown}"
                         + (" on --device cuda" if device == "cuda" else "")
                         + f"; choose from {', '.join(allowed)}")
    if not systems:
        raise ValueError("--systems names no system")
    return systems


def gpu_devices(processes: int, gpus: int) -> list[str]:
    """The device of each process (trainer first): round-robin over ``gpus`` GPUs."""
    if gpus < 1:
        raise ValueError(f"no GPU to place {processes} processes on")
    return [f"cuda:{i % gpus}" for i in range(processes)]


def bench_e2e(*, readers: int, size: int, versions: int = 4, chunk_size: int = 16 << 20,
              systems: tuple[str, ...] | None = None, reader_mode: str = "double",
              cold_start: bool = False, step_s: float = STEP_S, device: str = "cpu",
              verify: str = "each",
              on_phase: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (module docstring; `_table` reads it).

    ``systems``: None runs all of ``device``'s (`SYSTEMS`, `CUDA_SYSTEMS`).

    Raises:
        ValueError: bad options, or ``device="cuda"`` without a usable GPU.
        AgentError: a process failed or timed out.
    """
    systems = check_options(readers=readers, size=size, versions=versions,
                            chunk_size=chunk_size, systems=systems, reader_mode=reader_mode,
                            step_s=step_s, device=device)
    devices = ["cpu"] * (readers + 1)
    if device == "cuda":
        import torch

        from weightfabric.fabric.gpu import probe

        missing = probe().missing("cuda")
        if missing is not None:
            raise ValueError(f"--device cuda needs a GPU: {missing}")
        devices = gpu_devices(readers + 1, torch.cuda.device_count())
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
                runs[system] = _peer(system, readers, size, versions, step_s)
            except Exception as exc:  # noqa: BLE001 (whatever the peer raised, with its text)
                failed[system] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if system in FABRIC:
            times = _fabric(readers, size, versions, chunk_size,
                            inplace=system == "weightfabric-inplace", reader_mode=reader_mode,
                            cold_start=cold_start, step_s=step_s, devices=devices,
                            check_each=verify == "each", on_phase=on_phase)
        elif system in GLOO:
            times = _gloo(readers, size, versions, flat=system == "gloo-flat", step_s=step_s)
        elif system == "ipc-per-tensor":
            times = _ipc(readers, size, versions, devices=devices, step_s=step_s)
        else:  # memcpy, or copy on cuda:0
            times = _memcpy(size, versions, step_s=step_s, device=devices[0])
        runs[system] = times
    return assemble(runs, skipped=skipped, failed=failed, size=size, readers=readers,
                    versions=versions, reader_mode=reader_mode, chunk_size=chunk_size,
                    cold_start=cold_start, step_s=step_s, device=device, devices=devices,
                    verify=verify)


def assemble(runs: dict[str, dict[str, Any]], *, skipped: dict[str, str],
             failed: dict[str, str], size: int, readers: int, versions: int,
             reader_mode: str, chunk_size: int, cold_start: bool, step_s: float,
             device: str, devices: list[str], verify: str = "each") -> dict[str, Any]:
    """The JSON result of `bench_e2e` from each system's run (the module docstring)."""
    result: dict[str, Any] = {"bytes": runs[next(iter(runs))]["bytes"] if runs else size,
                              "readers": readers, "versions": versions,
                              "reader_mode": reader_mode,
                              "chunk_size": chunk_size, "runs": runs, "skipped": skipped,
                              "failed": failed, "cold_start": cold_start, "step_s": step_s,
                              "verify": verify, "device": device, "devices": devices}
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
    warm = statistics.median(seconds[1:])
    return {"cold_s": seconds[0], "warm_s": warm, "versions_s": seconds,
            "versions_vs_warm": [s / warm for s in seconds], "verified": verified,
            "bytes": nbytes, **extra}


def _start_processes(agents: list[Agent], readers: int) -> tuple[Agent, list[Agent]]:
    """Start a trainer and ``readers`` reader processes, ready; returns (trainer, readers).

    They are appended to ``agents`` as they start, so the caller's `close_all` ends them.
    """
    started = [Agent(n, ready_timeout=None)
               for n in ["trainer", *(f"reader-{i}" for i in range(readers))]]
    agents.extend(started)
    for a in started:
        a.reply(120)
    return started[0], started[1:]


def _pause(step_s: float) -> None:
    """Before each version, the first included: the RL step's time (``--step-seconds``).

    Before the first too: the README's trainer takes a training step before its first
    publish, while the readers it starts with are attaching.
    """
    time.sleep(step_s)


def _digests_match(want_from: Agent, readers: list[Agent], op: str = "digest") -> bool:
    """Whether every reader's sha256 equals ``want_from``'s (all asked at once; untimed)."""
    for a in (want_from, *readers):
        a.send(op)
    want = want_from.reply(300)["sha256"]
    return all(r.reply(300)["sha256"] == want for r in readers)


def _fabric(readers: int, size: int, versions: int, chunk_size: int, *, inplace: bool,
            reader_mode: str, cold_start: bool, step_s: float, devices: list[str],
            on_phase: Callable[[str], None], check_each: bool = True) -> dict[str, Any]:
    from weightfabric.fabric.arena import remove_stale_regions

    agents: list[Agent] = []
    try:
        hub = Agent("hub")
        agents.append(hub)
        url = hub.ask("hub", host="127.0.0.1")["url"]
        trainer, reader_agents = _start_processes(agents, readers)
        started = [trainer, *reader_agents]
        in_place_readers = reader_mode == "in-place"
        for a, device in zip(started, devices, strict=True):  # start-up, untimed
            a.ask("join", url=url, name=a.name, chunk_size=chunk_size, device=device,
                  attach=size if a is not trainer else 0, timeout=300,
                  keep_last=1 if in_place_readers and a is trainer else 0,
                  prepare_spare=not (in_place_readers if a is not trainer else inplace))
        # cold: the trainer only makes its tensors (in place: attaches them, which is what
        # in-place publishing is); nobody waits for the background populates
        trainer.ask("prepare", size=size, seed=SEED, inplace=inplace, reserve=not cold_start,
                    timeout=300)
        for a in started:
            a.ask("settle", wait=not cold_start, timeout=300)
        seconds, publish, fetch, verified = [], [], [], True
        reader_fetch, reader_engine, reader_leases, gaps = [], [], [], []
        last_end: float | None = None
        for v in range(versions):
            _pause(step_s)
            on_phase(f"{'in place' if inplace else 'snapshot'} v{v + 1}")
            if cold_start:  # a rollout's loop: waiting in store.sync for the next version
                for r in reader_agents:
                    r.send("sync", in_place=in_place_readers, timeout=600)
            pub = trainer.ask("publish", size=size, seed=SEED, inplace=inplace, timeout=300)
            if not cold_start:
                for r in reader_agents:
                    r.send("fetch", version=pub["version"], in_place=in_place_readers)
            fetched = [r.reply(600) for r in reader_agents]
            wrong = [f["version"] for f in fetched if f["version"] != pub["version"]]
            if wrong:
                raise AgentError(f"readers synced to {wrong}, not v{pub['version']}")
            end = max(f["end"] for f in fetched)
            seconds.append(end - pub["start"])
            publish.append(pub["end"] - pub["start"])
            fetch.append(end - pub["end"])
            reader_fetch.append([f["end"] - pub["end"] for f in fetched])
            reader_engine.append([f["seconds"] for f in fetched])
            reader_leases.append([int(f.get("leases", 0)) for f in fetched])
            gaps.append(None if last_end is None else pub["start"] - last_end)
            last_end = end
            if check_each or v == versions - 1:
                verified &= _digests_match(trainer, reader_agents)
        memory = {a.name: a.ask("memory") for a in started}
        nbytes = int(pub["bytes"])
    finally:
        close_all(agents)
        remove_stale_regions()
    return _summary(seconds, verified, nbytes, publish_s=statistics.median(publish[1:]),
                    fetch_s=statistics.median(fetch[1:]), cold_publish_s=publish[0],
                    publish_versions_s=publish, fetch_versions_s=fetch,
                    reader_fetch_s=reader_fetch, reader_engine_s=reader_engine,
                    reader_leases=reader_leases, gap_s=gaps, cold_start=cold_start,
                    reader_mode=reader_mode, memory=memory, peak_memory_per_model={
                        name: round((m["peak_total"] - m["base_total"]) / nbytes, 2)
                        for name, m in memory.items()})


def _gloo(readers: int, size: int, versions: int, *, flat: bool,
          step_s: float) -> dict[str, Any]:
    agents: list[Agent] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            agents = [Agent(f"rank-{r}", ready_timeout=None) for r in range(readers + 1)]
            for a in agents:
                a.reply(120)
            seconds, verified = [], True
            for _ in range(versions):
                _pause(step_s)
                for rank, a in enumerate(agents):
                    a.send("gloo", rank=rank, world=readers + 1, store=str(Path(tmp) / "store"),
                           size=size, seed=SEED, flat=flat)
                done = [a.reply(600) for a in agents]
                seconds.append(max(d["end"] for d in done) - min(d["start"] for d in done))
                verified &= all(d["sha256"] == done[0]["sha256"] for d in done)
        finally:
            close_all(agents)
    return _summary(seconds, verified, int(done[0]["bytes"]))


def _peer(system: str, readers: int, size: int, versions: int, step_s: float) -> dict[str, Any]:
    if system == "nixl-read":
        return _nixl(readers, size, versions, step_s)
    from weightfabric.tools.bench.peers import ray_e2e

    ray = ray_e2e(readers, size, versions, zero_copy=system == "ray-zero-copy", seed=SEED,
                  step_s=step_s)
    return _summary(ray["seconds"], ray["verified"], ray["bytes"])


def _nixl(readers: int, size: int, versions: int, step_s: float) -> dict[str, Any]:
    agents: list[Agent] = []
    try:
        trainer, reader_agents = _start_processes(agents, readers)
        served = trainer.ask("nixl_serve", name="trainer", size=size, seed=SEED, timeout=300)
        seconds, verified = [], True
        for _ in range(versions):
            _pause(step_s)
            ready = trainer.ask("nixl_bump", timeout=300)
            for r in reader_agents:
                r.send("nixl_read", name=r.name, served=served)
            done = [r.reply(600) for r in reader_agents]
            seconds.append(max(d["end"] for d in done) - ready["start"])
            verified &= all(d["sha256"] == ready["sha256"] for d in done)
    finally:
        close_all(agents)
    return _summary(seconds, verified, sum(served["sizes"].values()))


def _ipc(readers: int, size: int, versions: int, *, devices: list[str],
         step_s: float) -> dict[str, Any]:
    """``ipc-per-tensor``: vLLM's CUDA IPC weight transfer (`peers.IpcPeer`).

    Timed from the trainer's "ready" (before it exports the handles) to the last reader's
    acknowledgement.
    """
    agents: list[Agent] = []
    try:
        trainer, reader_agents = _start_processes(agents, readers)
        for a, device in zip(agents, devices, strict=True):
            a.ask("ipc_prepare", size=size, seed=SEED, device=device, trainer=a is trainer,
                  timeout=300)
        seconds, publish, fetch, verified = [], [], [], True
        for _ in range(versions):
            _pause(step_s)
            exported = trainer.ask("ipc_export", timeout=300)
            for r in reader_agents:  # the handles go through the driver, as through vLLM's API
                r.send("ipc_load", handles=exported["handles"])
            done = [r.reply(600) for r in reader_agents]
            end = max(d["end"] for d in done)
            seconds.append(end - exported["start"])
            publish.append(exported["end"] - exported["start"])
            fetch.append(end - exported["end"])
            verified &= _digests_match(trainer, reader_agents, op="ipc_digest")
    finally:
        close_all(agents)
    return _summary(seconds, verified, int(exported["bytes"]), publish_versions_s=publish,
                    fetch_versions_s=fetch)


def _memcpy(size: int, versions: int, *, step_s: float, device: str = "cpu") -> dict[str, Any]:
    """One process copying the bytes (``copy_``) on ``device``; times end after a synchronize."""
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)  # fresh pages: the first copy is the cold one
    sync = torch.cuda.synchronize if src.device.type == "cuda" else (lambda: None)
    seconds = []
    for _ in range(versions):
        _pause(step_s)
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        seconds.append(time.perf_counter() - start)
    return _summary(seconds, bool(torch.equal(dst, src)), size)


def _targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 22's targets that this run's systems measure (on a GPU: against IPC per tensor)."""
    runs, out = r["runs"], {}
    fabric = [runs[s]["warm_s"] for s in FABRIC if s in runs]
    if fabric:
        best = min(fabric)
        for peer in ("gloo-per-tensor", "gloo-flat", "ipc-per-tensor"):
            if peer in runs:
                ratio = best / runs[peer]["warm_s"]
                out[f"fabric_vs_{peer}"] = {"value": ratio, "goal": "<= 1.0", "met": ratio <= 1.0}
        if "ray-zero-copy" in runs:
            ratio = best / runs["ray-zero-copy"]["warm_s"]
            out["fabric_vs_ray_zero_copy"] = {"value": ratio, "goal": "<= 1.2",
                                              "met": ratio <= 1.2}
    floor = next((f for f in ("memcpy", "copy") if f in runs), None)
    if r.get("phases_of") == "weightfabric-snapshot" and floor is not None:
        ratio = r["publish_s"] / runs[floor]["warm_s"]
        out[f"snapshot_publish_vs_{floor}"] = {"value": ratio, "goal": "<= 2.0",
                                               "met": ratio <= 2.0}
    for system in FABRIC:
        if system in runs:
            ratio = runs[system]["cold_s"] / runs[system]["warm_s"]
            out[f"{system}_cold_vs_warm"] = {"value": ratio, "goal": "<= 1.5", "met": ratio <= 1.5}
    return out


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    systems = (None if args.systems is None else
               tuple(s.strip() for s in args.systems.split(",") if s.strip()))
    with console.status("starting") as status:
        result = bench_e2e(readers=args.readers, size=int(parse_size(args.size)),
                           versions=args.versions, chunk_size=int(parse_size(args.chunk_size)),
                           systems=systems, reader_mode=args.reader_mode,
                           cold_start=args.cold_start, step_s=args.step_seconds,
                           device=args.device, verify=args.verify,
                           on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    floor = "copy" if r.get("device") == "cuda" else "memcpy"
    table = Table(title=f"fabric bench e2e: {r['bytes'] / 1e9:.3f} GB to {r['readers']} "
                        f"reader(s) on {r.get('device', 'cpu')}, {r['versions'] - 1} warm "
                        f"versions (median), {r.get('step_s', 0):g} s apart"
                        + (", fabric from a cold start" if r.get("cold_start") else ""))
    for column in ("system", "warm s", "cold s", "GB/s warm (aggregate)", "verified"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name, run in r["runs"].items():
        table.add_row(name, f"{run['warm_s']:.3f}", f"{run['cold_s']:.3f}",
                      f"{r['readers'] * run['bytes'] / run['warm_s'] / 1e9:.2f}"
                      if name != floor else f"{run['bytes'] / run['warm_s'] / 1e9:.2f}",
                      "yes" if run["verified"] else "[red]NO[/red]")
    for name, why in r["skipped"].items():
        table.add_row(name, "-", "-", "-", f"skipped: {why}")
    for name, why in r["failed"].items():
        table.add_row(name, "-", "-", "-", f"[red]failed[/red]: {why}")
    console.print(table)
    if r["runs"]:
        console.print(_versions_table(r))
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


def _versions_table(r: dict[str, Any]) -> Table:
    """Every version of every system: seconds and x the warm median.

    Also the trainer's and the readers' parts (publish / fetch) where a system has them,
    and the fabric's gaps between versions.
    """
    table = Table(title="per version: seconds (x warm median); publish / fetch s; "
                        "gap since the previous version s")
    table.add_column("system")
    for v in range(r["versions"]):
        table.add_column(f"v{v + 1}", justify="right")
    for name, run in r["runs"].items():
        table.add_row(name, *(f"{t:.3f} ({x:.2f}x)" for t, x in
                              zip(run["versions_s"], run["versions_vs_warm"], strict=True)))
        if "publish_versions_s" in run:
            table.add_row("  publish / fetch", *(
                f"{p:.3f} / {f:.3f}" for p, f in
                zip(run["publish_versions_s"], run["fetch_versions_s"], strict=True)))
        if "gap_s" in run:
            table.add_row("  gap", *("-" if g is None else f"{g:.3f}" for g in run["gap_s"]))
    return table
