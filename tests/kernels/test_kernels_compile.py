"""Every Triton kernel still compiles for Hopper (sm_90) on this CPU-only machine.

The compile runs in a fresh process without TRITON_INTERPRET: the interpreter
patches `triton.language` while interpreted kernels run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paths import ROOT

EXPECTED = {"_segcopy_kernel", "_checksum_kernel", "_pack_checksum_kernel", "_quantize_kernel",
            "_dequantize_kernel", "_dequant_segments_kernel", "_delta_count_kernel", "_delta_compact_kernel",
            "_delta_bitmask_kernel", "_delta_scatter_kernel", "_delta_popcount_kernel",
            "_delta_expand_kernel"}


def test_every_kernel_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "weightfabric.kernels.aot"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failures = [f"{r['kernel']} {r['signature']}: {r['error']}" for r in records if not r["ok"]]
    assert not failures, "kernels that stopped compiling for sm_90:\n" + "\n".join(failures)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["kernel"] for r in records} >= EXPECTED
    assert all(r["sm90"] and r["cubin_bytes"] > 0 for r in records)
    # the data movers read and write 16-byte vectors (with 16-byte-aligned pointer arguments)
    for r in records:
        if r["kernel"] in ("_segcopy_kernel", "_checksum_kernel", "_pack_checksum_kernel"):
            assert r["vector_loads"], r
        if r["kernel"] in ("_segcopy_kernel", "_pack_checksum_kernel"):
            assert r["vector_stores"], r
    # Triton before 3.7 (the lent GPUs run 3.6) compiles a float `-x` as `0 - x`, so
    # -0.0 would come out +0.0 there: the kernels set sign bits with integer ops
    negating = [r["kernel"] for r in records if r["float_negations"]]
    assert not negating, f"float negation in {negating}: wrong sign of zero on Triton < 3.7"
