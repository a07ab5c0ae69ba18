"""Smoke run of `fabric bench fetch`'s code path, and the host-id override.

Smoke run of `fabric bench fetch`'s code path (small: 2 readers, 16 MB), and the host-id
override the cross-datacenter benchmark relies on.
"""

from __future__ import annotations

import json

import pytest

from weightfabric.fabric.transports import local_host_id
from weightfabric.tools.bench.fetch import bench_fetch

KEYS = {"readers", "bytes", "verified", "per_reader_gbps", "aggregate_gbps",
        "trainer_egress_bytes", "memcpy_gbps", "gloo_broadcast_gbps", "versions",
        "cold_aggregate_gbps", "targets", "publish_seconds", "from_publish_seconds",
        "from_publish_aggregate_gbps"}


def test_bench_fetch_two_readers_is_bit_exact_and_reports_every_key():
    result = bench_fetch(readers=2, size=16 << 20, chunk_size=1 << 20, versions=2)
    assert set(result) >= KEYS
    assert result["verified"] is True
    assert result["readers"] == 2 and len(result["per_reader_gbps"]) == 2
    assert result["bytes"] >= 16 << 20
    assert all(g > 0 for g in result["per_reader_gbps"]) and result["aggregate_gbps"] > 0
    # timed from the publish, the same job is slower than its fetch phase alone
    assert 0 < result["publish_seconds"] < result["from_publish_seconds"]
    assert result["from_publish_aggregate_gbps"] < result["aggregate_gbps"]
    assert result["targets"]["aggregate_vs_gloo"]["value"] == pytest.approx(
        result["from_publish_aggregate_gbps"] / result["gloo_broadcast_gbps"])
    # the readers pipeline: the trainer serves each version at most twice
    assert 0 < result["trainer_egress_bytes"] <= 2 * result["bytes"]
    assert [v["version"] for v in result["versions"]] == [1, 2]
    # per reader and version: the time beyond copying the bytes, and the leases taken
    for v in result["versions"]:
        assert len(v["per_reader_fixed_ms"]) == len(v["per_reader_leases"]) == 2
        for ms, secs, leases in zip(v["per_reader_fixed_ms"], v["per_reader_seconds"],
                                    v["per_reader_leases"], strict=True):
            assert ms == pytest.approx(
                (secs - v["bytes"] / (result["memcpy_gbps"] * 1e9)) * 1e3, rel=0.05)
            assert isinstance(leases, int) and leases >= 0
    assert result["per_reader_fixed_ms"] == result["versions"][-1]["per_reader_fixed_ms"]
    assert "per_reader_leases" in json.loads(json.dumps(result))  # what --json prints


def test_bench_fetch_verify_both_alternates_and_reports_the_cost():
    result = bench_fetch(readers=1, size=16 << 20, chunk_size=1 << 20, versions=4,
                         baselines=False, verify="both")
    assert result["verified"] is True
    assert [v["verify"] for v in result["versions"]] == [True, False, True, False]
    assert result["per_reader_fixed_ms"] == [None]  # no copy_ measured: no rate to take off
    assert result["verify_cost"] == pytest.approx(
        1 - result["verified_aggregate_gbps"] / result["unverified_aggregate_gbps"])


def test_bench_fetch_rejects_bad_input():
    with pytest.raises(ValueError, match="readers"):
        bench_fetch(readers=0, size=16 << 20, chunk_size=1 << 20)
    with pytest.raises(ValueError, match="chunk-size"):
        bench_fetch(readers=1, size=16 << 20, chunk_size=1000)
    with pytest.raises(ValueError, match="--verify both needs"):
        bench_fetch(readers=1, size=16 << 20, chunk_size=1 << 20, versions=2, verify="both")


def test_cuda_bench_without_a_gpu_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="--device cuda needs a GPU: cuda: "):
        bench_fetch(readers=1, size=16 << 20, chunk_size=1 << 20, device="cuda")


def test_reshard_reads_staged_and_direct_agree_scaled_down_on_cpu():
    from weightfabric.tools.bench.gpu_paths import reshard_reads

    r = reshard_reads(device="cpu", budget=256 << 10, scale=32, repeats=1)
    assert r["verified"] is True
    for kind in ("bf16", "fp8"):
        assert r[kind]["staging_peak_bytes"] <= 256 << 10
        assert min(r[kind]["staged_gbps"], r[kind]["direct_gbps"], r[kind]["copy_gbps"]) > 0
    assert r["fp8"]["source_bytes_staged"] < r["bf16"]["source_bytes_staged"]  # half the bytes


def test_host_id_override_makes_peers_on_one_machine_use_tcp(monkeypatch):
    monkeypatch.delenv("WEIGHTFABRIC_HOST_ID", raising=False)
    machine = local_host_id()
    assert ":" in machine
    monkeypatch.setenv("WEIGHTFABRIC_HOST_ID", "dc-b")
    assert local_host_id() == "dc-b"
    monkeypatch.delenv("WEIGHTFABRIC_HOST_ID")
    assert local_host_id() == machine


def test_fixed_ms_is_the_wall_time_beyond_copying_the_bytes():
    from weightfabric.tools.bench.fetch import fixed_ms

    assert fixed_ms(0.5, 10**9, 4.0) == pytest.approx(250.0)
    assert fixed_ms(0.5, 10**9, None) is None
