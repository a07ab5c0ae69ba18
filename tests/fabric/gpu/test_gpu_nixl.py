"""GPU stores on two "hosts" read each other over NIXL, VRAM to VRAM.

Skipped without CUDA (with the probe's reason) or without the rdma extra.
"""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.gpu.probe import probe
from weightfabric.fabric.transports.nixl import nixl_missing

MISSING = probe().missing("cuda") or nixl_missing(True)
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=str(MISSING)),
              pytest.mark.hub(lease_s=10.0)]

CHUNK = 4 << 20


def test_gpu_stores_on_two_hosts_read_each_other_over_nixl(on_hosts, monkeypatch):
    g = torch.Generator().manual_seed(5)
    weights = {"w": torch.randn(64 << 20, generator=g).to(torch.bfloat16).cuda()}
    monkeypatch.setenv("WEIGHTFABRIC_NIXL", "1")  # also without an RDMA device
    trainer, reader = on_hosts("trainer", "gpu-host-a"), on_hosts("reader", "gpu-host-b")
    t = trainer.model("m", chunk_size=CHUNK, device="cuda:0")
    r = reader.model("m", chunk_size=CHUNK, device="cuda:0")
    t.publish(weights)
    stats = r.fetch("latest", options=FetchOptions(deltas="off"))
    assert stats.transports == {"nixl": stats.bytes} and stats.bytes > 0
    assert torch.equal(r.tensors["w"], weights["w"])
    assert t.server.nixl is not None
    assert t.server.regions() and all(
        e.nixl is not None and e.nixl["mem"] == "VRAM" for e in t.server._regions.values())
