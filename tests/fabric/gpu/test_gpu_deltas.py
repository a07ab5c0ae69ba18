"""Deltas on a GPU.

The Triton encode/decode against the torch reference, and a delta fetch between GPU
stores on two "hosts" (skipped without CUDA, with the probe's reason).
"""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.gpu.probe import probe
from weightfabric.kernels.delta import decode_delta, delta_info, encode_delta, encode_delta_ref

MISSING_CUDA = probe().missing("cuda")
pytestmark = [pytest.mark.skipif(MISSING_CUDA is not None, reason=str(MISSING_CUDA)),
              pytest.mark.hub(lease_s=10.0)]

CHUNK = 4 << 20


def versions(nbytes: int, fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.bfloat16)
    new = base.clone()
    idx = torch.randperm(new.numel(), generator=g)[:int(new.numel() * fraction)]
    new[idx] = (new[idx].float() + 1e-3).to(torch.bfloat16)
    return base.view(torch.uint8), new.view(torch.uint8)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.3, 1.0])
def test_triton_blobs_equal_the_reference_and_decode_bit_exact(width, fraction):
    base, new = versions(CHUNK + 4096, fraction)
    blob = encode_delta(base.cuda(), new.cuda(), width)
    assert torch.equal(blob.cpu(), encode_delta_ref(base, new, width)), delta_info(blob.cpu())
    out = base.cuda()
    decode_delta(blob, out, out)
    assert torch.equal(out.cpu(), new)
    other = torch.empty_like(out)
    decode_delta(blob.cpu(), base.cuda(), other)
    assert torch.equal(other.cpu(), new)


def test_a_gpu_reader_on_another_host_fetches_deltas_bit_exact(on_hosts):
    base, new = versions(16 * CHUNK, 0.02)
    trainer, reader = on_hosts("trainer", "gpu-host-a"), on_hosts("reader", "gpu-host-b")
    t = trainer.model("m", chunk_size=CHUNK, device="cuda:0")
    r = reader.model("m", chunk_size=CHUNK, device="cuda:0")
    t.publish({"w": base.view(torch.bfloat16).cuda()})
    r.fetch("latest")
    t.publish({"w": new.view(torch.bfloat16).cuda()})
    stats = r.fetch("latest", options=FetchOptions(deltas="on"))
    assert stats.delta_chunks == stats.chunks > 0
    assert stats.wire_bytes < stats.bytes / 8
    assert torch.equal(r.tensors["w"].view(torch.uint8).cpu(), new)
