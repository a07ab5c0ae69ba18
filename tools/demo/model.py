"""A small Llama-shaped decoder and a toy RL objective for the demo.

Parameter names and shapes follow Llama (``embed_tokens``, ``layers.N.self_attn.
{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``, RMS norms, ``lm_head``),
with grouped-query attention, so the tensor set looks like a real checkpoint's.
The reward asks for tokens from a target set; REINFORCE raises its rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyLlamaConfig:
    """Sizes of the demo's Llama-shaped model."""
    vocab_size: int = 256
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    ffn_dim: int = 704
    max_seq_len: int = 64

    @classmethod
    def scaled(cls, size: str) -> TinyLlamaConfig:
        """Presets: ``tiny`` (~0.1M parameters, tests), ``small`` (~3M), ``medium`` (~25M)."""
        presets = {
            "tiny": cls(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=176),
            "small": cls(),
            "medium": cls(vocab_size=1024, dim=512, num_layers=8, ffn_dim=1408),
        }
        if size not in presets:
            raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(presets)}")
        return presets[size]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm."""
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` over its last dimension."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal self-attention with rotary position embeddings."""
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.dim // cfg.num_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attend over `x` with the rotary embedding `rope` (cos, sin)."""
        b, t, _ = x.shape
        q = _rotate(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), rope)
        k = _rotate(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), rope)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """The SwiGLU feed-forward block."""
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to `x`."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer layer: attention, then MLP."""
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Apply the layer to `x` with the rotary embedding `rope`."""
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Decoder-only transformer with Llama's parameter names."""

    rope_cos: torch.Tensor      # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.num_heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for `tokens` of shape (batch, seq)."""
        t = tokens.shape[1]
        rope = (self.rope_cos[:t], self.rope_sin[:t])
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, rope)
        return self.lm_head(self.norm(x))


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (r[None, :, None, :] for r in rope)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


@torch.no_grad()
def sample(model: TinyLlama, prompts: torch.Tensor, new_tokens: int, *,
           generator: torch.Generator) -> torch.Tensor:
    """Sample `new_tokens` after each prompt (temperature 1); returns prompts + samples."""
    tokens = prompts
    for _ in range(new_tokens):
        probs = torch.softmax(model(tokens)[:, -1].float(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def reward(tokens: torch.Tensor, prompt_len: int, *, modulus: int = 4) -> torch.Tensor:
    """Fraction of sampled tokens divisible by `modulus` (chance level: 1/modulus)."""
    return (tokens[:, prompt_len:] % modulus == 0).float().mean(dim=1)


def reinforce_step(model: TinyLlama, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                   prompt_len: int, rewards: torch.Tensor) -> float:
    """One REINFORCE update with a mean-reward baseline; returns the loss."""
    logits = model(tokens[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1)
    taken = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)[:, prompt_len - 1:]
    advantage = rewards - rewards.mean()
    loss = -(advantage[:, None] * taken).sum(dim=1).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def probe_inputs(cfg: TinyLlamaConfig, *, batch: int = 2, seq: int = 16) -> torch.Tensor:
    """Fixed inputs on which trainer and rollouts compare logits bit for bit."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def init_weights(model: TinyLlama, seed: int) -> None:
    """Deterministic initialisation (scaled normal), independent of torch's defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
