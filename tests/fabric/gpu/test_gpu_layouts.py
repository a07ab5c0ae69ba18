"""Engine layouts into GPU stores: derive (Triton fp8 on CUDA) and copy (CUDA IPC) bit-exact.

The ``cpu`` parameters run everywhere (the same path with CPU stores); the ``cuda``
ones need a GPU (`tools/gpu/session.sh` runs this folder on a lent one). No
``transformers``: the published tensors are random ones of `hf_shapes`.
"""

from __future__ import annotations

import pytest
import torch

import weightfabric as wf
from weightfabric.fabric.gpu.probe import probe
from weightfabric.fabric.relayout.engines import hf_shapes
from weightfabric.fabric.relayout.rules import derive_reference

MISSING_CUDA = probe().missing("cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    MISSING_CUDA is not None, reason=str(MISSING_CUDA)))]
CHUNK = 1 << 16
CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 128, "tie_word_embeddings": False}
FP8 = torch.float8_e4m3fn


def _published() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_shapes(CONFIG).items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name].cpu()
        assert g.dtype == w.dtype, name
        assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g,
                           w.view(torch.uint8) if w.dtype == FP8 else w), name


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_reader_derives_and_a_second_copies_bit_exact(workers, device, fp8):
    weights = _published()
    trainer = workers.join("trainer")
    version = trainer.model("policy", chunk_size=CHUNK).publish(weights)
    layout = wf.vllm_layout(CONFIG, tp=2, fp8_block=128 if fp8 else None)
    for rank in range(2):
        first = workers.join(f"a{rank}").layout_model("policy", layout, rank=rank, device=device,
                                                      chunk_size=CHUNK)
        stats = first.fetch(version)
        assert stats.derived and set(stats.sources) == {"trainer"}
        assert all(t.device.type == device for t in first.tensors.values())
        want = derive_reference(layout, weights, rank)
        _same(first.tensors, want)
        second = workers.join(f"b{rank}").layout_model("policy", layout, rank=rank,
                                                       device=device, chunk_size=CHUNK)
        copied = second.fetch(version)
        assert not copied.derived and set(copied.sources) == {f"a{rank}"}
        _same(second.tensors, want)
