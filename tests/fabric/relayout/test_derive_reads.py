"""`derive`: an engine rank's tensors from reads of sharded publishers equal `derive_reference`."""

import pytest
import torch

from weightfabric.fabric.relayout.derive import Held, PublishedVersion, derive
from weightfabric.fabric.relayout.rules import (
    EngineLayout,
    Published,
    Rule,
    Split,
    Term,
    derive_reference,
)

FP8 = torch.float8_e4m3fn

LAYOUT = EngineLayout("t", (
    Rule("qkv", ((Term("q"), Term("k"), Term("v")),), split=Split(0, 2, unit=2, replicate=True),
         dtype=torch.bfloat16),
    Rule("o", ((Term("o"),),), split=Split(1, 2)),
    Rule("emb", ((Term("e"),),), split=Split(0, 2, pad_to=8)),
    Rule("n", ((Term("n"),),)),
    Rule("w13", tuple((Term("gu", index=e, rows=(0, 16)), Term("gu", index=e, rows=(16, 32)))
                      for e in range(4)), split=Split(0, 2), ep=Split(0, 2), fp8_block=16),
    Rule("w2", tuple((Term("d", index=e),) for e in range(4)), split=Split(1, 2), ep=Split(0, 2)),
), tp=2, ep=2)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (8, 4), "k": (4, 4), "v": (4, 4), "o": (4, 8), "e": (10, 4),
              "gu": (4, 32, 16), "d": (4, 16, 16), "n": (7,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _publish(tensors: dict[str, torch.Tensor], shards: int):
    """Pack ``tensors`` like ``shards`` FSDP2 ranks would (torch.chunk along dim 0)."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(shards)]
    offsets, held = [0] * shards, {}
    for name, x in tensors.items():
        chunks, start, slices = torch.chunk(x, shards, 0), 0, []
        for k in range(shards):
            piece = chunks[k] if k < len(chunks) else x[:0]
            raw = piece.contiguous().view(-1).view(torch.uint8)
            slices.append(Held(k, offsets[k], tuple(piece.shape), 0 if shards > 1 else None, start))
            start += piece.shape[0]
            parts[k].append(raw)
            offsets[k] += raw.numel()
        held[name] = tuple(slices)
    buffers = [torch.cat(p) for p in parts]
    published = PublishedVersion({n: Published(tuple(x.shape), x.dtype) for n, x in tensors.items()},
                                 held, {})

    def read(shard: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(buffers[shard][offset:offset + out.numel()])
    return published, read


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("budget", [64, 1 << 20])
def test_derive_matches_reference_for_every_rank(shards, budget):
    tensors = _tensors()
    published, read = _publish(tensors, shards)
    for rank in range(LAYOUT.ranks):
        bound = LAYOUT.bind(published.tensors, rank)
        dst = bound.empty()
        stats = derive(bound, published, read, dst, budget=budget)
        ref = derive_reference(LAYOUT, tensors, rank)
        assert set(ref) == set(dst)
        for name, want in ref.items():
            assert dst[name].dtype == want.dtype
            assert torch.equal(_bits(dst[name]), _bits(want)), (shards, rank, name)
        assert stats.staging_bytes <= max(budget, 16 * 16 * 4)
