"""Smoke run of `fabric bench reshard` (one small layer).

Bit-exact both ways, and verification reads whole chunks and checks them.
"""

from __future__ import annotations

import pytest

from weightfabric.tools.bench.reshard import bench_reshard


def test_bench_reshard_small_layer_is_bit_exact_and_verifies_chunks():
    r = bench_reshard(scale=32, chunk_size=64 << 10, budget=1 << 20, repeats=1)
    assert r["verified"] is True
    assert r["unverified_gbps"] > 0 and r["verified_gbps"] > 0 and r["one_shot_gbps"] > 0
    assert r["verified_chunks"] > 0 and r["verify_peak_bytes"] > 0
    assert r["fetched_bytes_verified"] >= r["fetched_bytes_unverified"] == r["bytes"]
    assert 0 < r["staging_peak_bytes"] <= 1 << 20


@pytest.mark.parametrize("kwargs, words", [
    ({"scale": 3}, "--scale"), ({"chunk_size": 1000}, "--chunk-size"),
    ({"budget": 0}, "--budget"), ({"repeats": 0}, "--repeats")])
def test_bench_reshard_rejects_bad_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        bench_reshard(**kwargs)
