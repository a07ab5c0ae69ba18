"""The demo's Llama-shaped model and its toy RL objective."""

import torch

from weightfabric.tools.demo.model import (
    TinyLlama,
    TinyLlamaConfig,
    init_weights,
    probe_inputs,
    reinforce_step,
    reward,
    sample,
)


def make(seed: int = 0) -> TinyLlama:
    model = TinyLlama(TinyLlamaConfig.scaled("tiny"))
    init_weights(model, seed)
    return model


def test_parameter_names_follow_llama():
    names = set(dict(make().named_parameters()))
    for expected in ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                     "layers.0.self_attn.k_proj.weight", "layers.1.mlp.gate_proj.weight",
                     "layers.1.mlp.down_proj.weight", "layers.0.input_layernorm.weight",
                     "norm.weight", "lm_head.weight"]:
        assert expected in names
    cfg = TinyLlamaConfig.scaled("tiny")
    k = dict(make().named_parameters())["layers.0.self_attn.k_proj.weight"]
    assert k.shape == (cfg.num_kv_heads * cfg.dim // cfg.num_heads, cfg.dim)  # GQA


def test_same_seed_same_logits_bit_for_bit():
    x = probe_inputs(TinyLlamaConfig.scaled("tiny"))
    assert torch.equal(make(3)(x), make(3)(x))
    assert not torch.equal(make(3)(x), make(4)(x))


def test_reinforce_raises_the_reward():
    torch.manual_seed(0)
    model = make(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.cfg.vocab_size, (32, 4), generator=g)
    first = reward(sample(model, prompts, 8, generator=g), 4).mean()
    for _ in range(12):
        tokens = sample(model, prompts, 8, generator=g)
        reinforce_step(model, opt, tokens, 4, reward(tokens, 4))
    last = reward(sample(model, prompts, 8, generator=g), 4).mean()
    assert last > first + 0.2
