"""Smoke runs of `fabric bench e2e` (small: 2 readers, 32 MB).

The JSON it promises, every reader bit-exact, and the memory each reader mode holds.
"""

from __future__ import annotations

import pytest

from weightfabric.tools.bench.e2e import bench_e2e


def _run(systems: tuple[str, ...], mode: str) -> dict:
    r = bench_e2e(readers=2, size=32 << 20, versions=2, chunk_size=1 << 20, systems=systems,
                  reader_mode=mode)
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
