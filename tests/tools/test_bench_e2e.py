"""Smoke runs of `fabric bench e2e` (small: 2 readers, 32 MB; a cold start at 8 MB).

The JSON it promises, every reader bit-exact, the memory each reader mode holds, a cold
start's per-version times, and ``--device cuda``'s refusal without a GPU and its
CPU-side parts (options, placement, result).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from timeouts import hard_timeout

from weightfabric.fabric.arena import PREFIX, SHM_DIR
from weightfabric.tools.bench.e2e import (
    CUDA_SYSTEMS,
    SYSTEMS,
    assemble,
    bench_e2e,
    check_options,
    gpu_devices,
)
from weightfabric.tools.cli import main


def _run(systems: tuple[str, ...], mode: str) -> dict:
    r = bench_e2e(readers=2, size=32 << 20, versions=2, chunk_size=1 << 20, systems=systems,
                  reader_mode=mode, step_s=0)
    assert r["verified"] is True and r["readers"] == 2 and r["bytes"] >= 32 << 20
    assert set(r["runs"]) | set(r["skipped"]) == set(systems)
    for run in r["runs"].values():
        assert {"warm_s", "cold_s", "verified"} <= set(run) and run["warm_s"] > 0
    assert r["publish_s"] > 0 and r["fetch_s"] > 0
    return r


def test_in_place_everywhere_holds_one_copy_per_process_beside_gloo_and_memcpy():
    r = _run(("weightfabric-inplace", "gloo-per-tensor", "memcpy", "ray-zero-copy"), "in-place")
    held = r["runs"]["weightfabric-inplace"]["peak_memory_per_model"]
    assert max(held.values()) < 1.6, held  # the trainer's attached weights, a reader's live ones
    assert "fabric_vs_gloo-per-tensor" in r["targets"]
    if "ray-zero-copy" in r["skipped"]:
        assert "ray" in r["skipped"]["ray-zero-copy"]


def test_a_snapshot_trainer_and_double_buffered_readers_hold_their_spares():
    r = _run(("weightfabric-snapshot",), "double")
    held = r["runs"]["weightfabric-snapshot"]["peak_memory_per_model"]
    assert held["trainer"] > 2.5 and min(held["reader-0"], held["reader-1"]) > 1.6, held
    assert r["runs"]["weightfabric-snapshot"]["publish_s"] == r["publish_s"]


def test_bench_e2e_rejects_bad_input():
    with pytest.raises(ValueError, match="versions"):
        bench_e2e(readers=1, size=8 << 20, versions=1)
    with pytest.raises(ValueError, match="unknown systems"):
        bench_e2e(readers=1, size=8 << 20, systems=("nccl",))
    with pytest.raises(ValueError, match="reader-mode"):
        bench_e2e(readers=1, size=8 << 20, reader_mode="triple")
    with pytest.raises(ValueError, match="step-seconds"):
        bench_e2e(readers=1, size=8 << 20, step_s=-0.5)


def _children() -> set[int]:
    """PIDs of this process's live children."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.add(int(stat.parent.name))
    return out


def _regions() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}-*")}


def test_a_cold_start_times_every_version_and_splits_publish_from_fetch(capsys):
    children, regions = _children(), _regions()
    with hard_timeout(120):
        assert main(["bench", "e2e", "--cold-start", "--readers", "1", "--size", "8MB",
                     "--versions", "3", "--step-seconds", "0.2", "--chunk-size", "1MiB",
                     "--systems", "weightfabric-snapshot,memcpy", "--verify", "last",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cold_start"] is True and r["step_s"] == 0.2 and r["verified"] is True
    assert r["verify"] == "last"
    assert r["device"] == "cpu" and r["devices"] == ["cpu", "cpu"]
    run = r["runs"]["weightfabric-snapshot"]
    assert run["verified"] is True and run["cold_start"] is True
    assert len(run["versions_s"]) == 3 and run["cold_s"] == run["versions_s"][0]
    assert run["versions_vs_warm"] == pytest.approx([t / run["warm_s"] for t in run["versions_s"]])
    # each version is the trainer's publish, then the readers' fetch after it
    for t, pub, fetch, readers in zip(run["versions_s"], run["publish_versions_s"],
                                      run["fetch_versions_s"], run["reader_fetch_s"],
                                      strict=True):
        assert pub > 0 and fetch > 0 and t == pytest.approx(pub + fetch)
        assert len(readers) == 1 and readers[0] == pytest.approx(fetch)
    assert [len(x) for x in run["reader_engine_s"]] == [1, 1, 1]
    assert all(isinstance(n, int) for x in run["reader_leases"] for n in x)
    assert run["gap_s"][0] is None and min(run["gap_s"][1:]) >= 0.2  # the step, and the check
    assert len(r["runs"]["memcpy"]["versions_vs_warm"]) == 3
    assert "weightfabric-snapshot_cold_vs_warm" in r["targets"]
    assert _children() <= children, "benchmark processes left running"
    leaked = {n for n in _regions() - regions if not Path(f"/proc/{n.split('-')[1]}").exists()}
    assert not leaked, leaked


def test_device_cuda_without_a_gpu_exits_2_and_says_why(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "e2e", "--device", "cuda", "--readers", "1", "--size", "8MB"]) == 2
    assert capsys.readouterr().err.startswith(
        "fabric bench e2e: error: --device cuda needs a GPU: cuda: ")


def test_device_cuda_options_systems_and_placement_without_a_gpu():
    common = dict(readers=4, size=8 << 20, versions=2, chunk_size=1 << 20,
                  reader_mode="double", step_s=0.5)
    assert check_options(**common, systems=None, device="cuda") == CUDA_SYSTEMS
    assert check_options(**common, systems=None, device="cpu") == SYSTEMS
    assert "ipc-per-tensor" in CUDA_SYSTEMS and "copy" in CUDA_SYSTEMS
    with pytest.raises(ValueError, match=r"unknown systems \['gloo-flat'\] on --device cuda"):
        bench_e2e(readers=1, size=8 << 20, device="cuda", systems=("gloo-flat",))
    with pytest.raises(ValueError, match=r"unknown systems \['ipc-per-tensor'\]; choose"):
        check_options(**common, systems=("ipc-per-tensor",), device="cpu")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--step-seconds"):
            check_options(**{**common, "step_s": bad}, systems=None, device="cpu")
    assert gpu_devices(5, 1) == ["cuda:0"] * 5
    assert gpu_devices(5, 2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    with pytest.raises(ValueError, match="no GPU"):
        gpu_devices(2, 0)


def test_a_cuda_result_compares_the_fabric_with_ipc_per_tensor_and_the_copy():
    def run(seconds: list[float], **extra: object) -> dict:
        warm = sorted(seconds[1:])[len(seconds[1:]) // 2]
        return {"cold_s": seconds[0], "warm_s": warm, "versions_s": seconds,
                "versions_vs_warm": [t / warm for t in seconds], "verified": True,
                "bytes": 1 << 30, **extra}

    runs = {"weightfabric-snapshot": run([0.3, 0.1, 0.1], publish_s=0.02, fetch_s=0.08),
            "ipc-per-tensor": run([0.5, 0.2, 0.2]), "copy": run([0.02, 0.01, 0.01])}
    r = assemble(runs, skipped={}, failed={}, size=1 << 30, readers=1, versions=3,
                 reader_mode="double", chunk_size=64 << 20, cold_start=False, step_s=0.5,
                 device="cuda", devices=["cuda:0", "cuda:0"])
    assert r["verified"] is True and r["phases_of"] == "weightfabric-snapshot"
    assert r["targets"]["fabric_vs_ipc-per-tensor"]["value"] == pytest.approx(0.5)
    assert r["targets"]["snapshot_publish_vs_copy"]["value"] == pytest.approx(2.0)
    assert r["targets"]["weightfabric-snapshot_cold_vs_warm"]["met"] is False
    json.dumps(r)  # what --json prints
