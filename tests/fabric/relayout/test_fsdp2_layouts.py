"""FSDP2 trainer -> vLLM-layout readers, end to end, against an independent reference.

The conversion each reader must reproduce is `test_engines.expected`: vLLM's weight
loaders redone in plain torch (written apart from `fabric.relayout`), applied to the
trainer's whole bf16 weights.
"""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch
from paths import ROOT
from procs import Proc, children
from test_engines import assert_same, expected

import weightfabric as wf

pytest.importorskip("transformers")

CHUNK = 4096


def _example(monkeypatch):
    """The example as a module its spawned processes import too (examples/ on sys.path)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("fsdp2_to_vllm")


def _config(example):
    import transformers

    raw = dict(example.CONFIG)
    kind = raw.pop("model_type")
    return transformers.AutoConfig.for_model(kind, **raw)


def test_fsdp2_trainer_to_vllm_tp2_engines_hf_fp8_and_ep_readers(monkeypatch):
    """The example's run, checked: two TP=2 engines, then HF, fp8 and EP readers."""
    example = _example(monkeypatch)
    config = _config(example)
    seen: dict[str, object] = {}

    def check(url, fulls, rows):
        for engine, rank, version, derived, sources, tensors in rows:
            assert_same(tensors, expected(config, fulls[version], tp=2, rank=rank))
            seen.setdefault(f"v{version}-r{rank}", []).append((engine, derived, sources))
        version = max(fulls)
        full = fulls[version]
        with wf.join(url, worker="checker") as worker:
            hf = worker.layout_model("policy", wf.hf_layout(config), rank=0, chunk_size=CHUNK)
            hf.fetch(version)
            assert_same(hf.tensors, full)
            for rank in range(2):
                fp8 = worker.layout_model("policy", wf.vllm_layout(config, tp=2, fp8_block=16),
                                          rank=rank, chunk_size=CHUNK)
                fp8.fetch(version)
                assert_same(fp8.tensors, expected(config, full, tp=2, rank=rank, fp8=16))
                ep = worker.layout_model("policy", wf.vllm_layout(config, tp=2,
                                                                  expert_parallel=True),
                                         rank=rank, chunk_size=CHUNK)
                ep.fetch(version)
                assert_same(ep.tensors, expected(config, full, tp=2, rank=rank,
                                                 expert_parallel=True))

    with children(limit=240):  # a hard time limit on the example's processes
        example.run(check=check, timeout=180)
    assert len(seen) == 2 * example.STEPS
    for key, readers in seen.items():
        derivers = [f"engine{e}-tp{key[-1]}" for e, derived, _ in readers if derived]
        assert len(derivers) == 1, (key, readers)     # one per (version, rank) derives
        for _, derived, sources in readers:
            if derived:
                assert set(sources) == {"trainer-0", "trainer-1"}
            else:
                assert set(sources) == set(derivers), (key, readers)  # the copy reads only it


QWEN2 = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": True}


@pytest.mark.hub(lease_s=2.0)
def test_a_copy_whose_source_is_killed_mid_fetch_still_finishes_exact(hub, workers):
    """B copies from A; A is killed while B's copy waits on it: B derives it itself."""
    import transformers

    raw = dict(QWEN2)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    trainer = workers.join("trainer")
    version = trainer.model("policy", chunk_size=CHUNK).publish(model, dtype=torch.bfloat16)
    full = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    with children(limit=120, make=Proc) as spawn:
        first = spawn(hub.url, "a", fork=True)
        got = first.ask("layout_fetch", model="policy", config=QWEN2, tp=2, rank=0,
                        version=version, chunk_size=CHUNK)
        assert got["derived"] and set(got["sources"]) == {"trainer"}
        b = workers.join("b").layout_model("policy", wf.vllm_layout(config, tp=2), rank=0,
                                           chunk_size=CHUNK)
        first.pause()                                # B's copy now waits on A
        future = b.fetch_async(version)
        killer = threading.Timer(0.5, first.kill)
        killer.start()
        start = time.monotonic()
        stats = future.result(timeout=60)
        killer.join()
        assert stats.derived and set(stats.sources) == {"trainer"}, stats
        assert time.monotonic() - start < 30
        assert_same(b.tensors, expected(config, full, tp=2, rank=0))
