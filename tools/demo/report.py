"""The demo's result: checks, per-version accounting, and the printed summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from weightfabric.tools.demo.orchestrator import Demo


def result(demo: Demo, seconds: float) -> dict[str, Any]:
    """Everything `fabric demo --json` prints; ``ok`` is the conjunction of ``checks``."""
    versions = []
    for v, rec in sorted(demo.versions.items()):
        fetches = rec.fetches.values()
        nbytes = sum(f["bytes"] for f in fetches)
        slowest = max((f["seconds"] for f in fetches), default=0.0)
        versions.append({
            "version": v,
            "bytes": nbytes,
            "changed_fraction": rec.changed_fraction,
            "seconds": slowest,
            "gbps": nbytes / slowest / 1e9 if slowest > 0 else 0.0,
            "sources": sorted({s for f in fetches for s in f["sources"]}),
            "trainer_egress_bytes": rec.trainer_egress,
            "stall_seconds": sum(f["stall_seconds"] for f in fetches),
            "rollouts": sorted(rec.fetches),
            "expected": sorted(rec.expected),
            "logits_match": all(rec.logits_match.values()) and bool(rec.logits_match),
            "reward": rec.reward,
            "per_rollout": {name: {k: f[k] for k in ("bytes", "seconds", "gbps", "sources",
                                                     "chunks_reread", "failed_sources",
                                                     "stall_seconds")}
                            for name, f in sorted(rec.fetches.items())},
        })
    checks = {
        "logits_match": bool(versions) and all(v["logits_match"] for v in versions),
        "every_version_reached_every_live_rollout": all(
            v["rollouts"] == v["expected"] for v in versions),
        "no_errors": not demo.errors,
    }
    killed = demo.killed
    if killed is not None:
        at = demo.versions[killed["version"]]
        rereads = {n: f["chunks_reread"] for n, f in at.fetches.items()
                   if killed["worker"] in f["failed_sources"]}
        killed = {**killed, "reread_by": rereads}
        checks["killed_rollouts_chunks_reread_elsewhere"] = sum(rereads.values()) > 0
    joined = demo.joined
    if joined is not None:
        checks["joined_rollout_pulled_from_peers"] = any(
            s != "trainer" for s in joined.get("sources", ()))
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "seconds": seconds,
        "versions": versions,
        "rollouts": sorted(n for n in demo.procs if n != "trainer"),
        "killed": killed,
        "joined": joined,
        "logits_match": checks["logits_match"],
        "errors": demo.errors,
    }


def print_summary(out: dict[str, Any], console: Console) -> None:
    """Print the demo's result `out` as a summary and tables."""
    table = Table(title="per version", title_justify="left")
    for column in ("v", "changed %", "rollouts", "MB", "ms", "GB/s", "trainer MB", "stall s", "read from",
                   "logits", "reward"):
        table.add_column(column, justify="left" if column == "read from" else "right")
    for v in out["versions"]:
        peers = [s for s in v["sources"] if s != "trainer"]
        sources = " + ".join((["trainer"] if "trainer" in v["sources"] else [])
                             + ([str(len(peers))] if peers else []))
        changed = v["changed_fraction"]
        table.add_row(str(v["version"]), "" if changed is None else f"{changed * 100:.2f}",
                      str(len(v["rollouts"])), f"{v['bytes'] / 1e6:.1f}",
                      f"{v['seconds'] * 1e3:.0f}", f"{v['gbps']:.2f}",
                      f"{v['trainer_egress_bytes'] / 1e6:.1f}", f"{v['stall_seconds']:.2f}",
                      sources, "equal" if v["logits_match"] else "[red]DIFFER[/]",
                      "" if v["reward"] is None else f"{v['reward']:.2f}")
    console.print(table)
    console.print("changed %: the version's bf16 values whose bits differ from the previous "
                  "version's; MB: bytes fetched by all rollouts; ms: until the last rollout had the "
                  "version; trainer MB: the trainer's egress; stall s: rollouts' fetch time, "
                  "summed; read from: the trainer and/or N peer rollouts; logits: every "
                  "rollout's logits vs the trainer's, bit for bit.")
    if out["killed"]:
        k = out["killed"]
        rereads = ", ".join(f"{n} re-read {c} chunks" for n, c in k["reread_by"].items())
        console.print(f"killed: {k['worker']} mid-fetch of v{k['version']} holding "
                      f"{k['chunks_held']} of {k['chunks']} chunks; "
                      f"{rereads or 'nobody was reading from it'}")
    if out["joined"]:
        j = out["joined"]
        console.print(f"joined: {j['worker']} at v{j['version']}, pulled from "
                      f"{', '.join(j.get('sources', []))}")
    for name, passed in out["checks"].items():
        console.print(f"{'[green]ok[/]' if passed else '[red]FAILED[/]'}  {name.replace('_', ' ')}")
    verdict = "[bold green]demo passed[/]" if out["ok"] else "[bold red]demo FAILED[/]"
    console.print(f"{verdict} in {out['seconds']:.1f} s")
