"""Two vLLM engines on the fabric: the second reads from the first, and a hub that goes away.

Engine A starts from a random checkpoint and takes v1 from the fabric; engine B starts
fresh from v1's ``save_pretrained`` checkpoint (vLLM's own loading from disk): both
generate the same tokens and logprobs. B then joins the fabric, and for v2 (updated after
A) every byte B reads comes from A's worker, so the trainer sends the version once. With
the hub gone, an update fails with the fabric's error and A keeps v2's exact tokens.
"""

from __future__ import annotations

import pytest
import torch
from timeouts import hard_timeout
from vllm_helpers import engine, generate, hf_model, record_of, save_bf16, train_step

import weightfabric as wf


def test_a_second_engine_reads_from_the_first_and_a_lost_hub_changes_nothing(tmp_path):
    hub = wf.serve("tcp://127.0.0.1:0")
    hub_stopped = False
    model = hf_model("llama", seed=0)
    try:
        with hard_timeout(600), wf.join(hub.url, worker="trainer") as trainer, \
                engine(save_bf16(model, tmp_path / "v0")) as a:
            store = trainer.model("policy")
            wf.vllm.connect(a, hub.url, "policy", engine="engine-a")
            train_step(model, seed=1)
            v1 = store.publish(model, dtype=torch.bfloat16)
            wf.vllm.update(a, v1)
            with engine(save_bf16(model, tmp_path / "v1")) as b:
                assert generate(b) == generate(a)  # fresh from v1's checkpoint == fabric's v1
                wf.vllm.connect(b, hub.url, "policy", engine="engine-b")
                train_step(model, seed=2)
                v2 = store.publish(model, dtype=torch.bfloat16)
                both = wf.vllm.FanOut([wf.vllm.LLMClient(a), wf.vllm.LLMClient(b)],
                                      concurrent=False)
                wf.vllm.switch(both, v2)
                (ra,), (rb,) = a.collective_rpc(record_of), b.collective_rpc(record_of)
                assert ra["version"] == rb["version"] == v2
                assert set(ra["sources"]) == {"trainer"}, ra
                assert set(rb["sources"]) == {ra["worker"]}, rb  # all of B's bytes from A
                assert b.get_weight_version() == str(v2)
                assert generate(b) == generate(a)
            tokens = generate(a)
            train_step(model, seed=3)
            v3 = store.publish(model, dtype=torch.bfloat16)
            hub.stop()
            hub_stopped = True
            with pytest.raises(wf.HubError):  # unavailable, or timed out
                wf.vllm.update(a, v3)
            assert generate(a) == tokens
    finally:
        if not hub_stopped:
            hub.stop()
