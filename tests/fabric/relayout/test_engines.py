"""Ready-made layouts (fabric.relayout.engines) against vLLM's loading, redone in plain torch.

Each model is a tiny random ``transformers`` model; every rank of `derive_reference`
must equal, bit for bit, a conversion written here independently after vLLM's weight
loaders (QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear,
VocabParallelEmbedding, FusedMoE with FusedMoEParallelConfig.make and
determine_expert_map's linear placement).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weightfabric.fabric.errors import LayoutError, LayoutMismatchError
from weightfabric.fabric.relayout.engines import (
    SUPPORTED_MODEL_TYPES,
    hf_layout,
    hf_shapes,
    vllm_layout,
)
from weightfabric.fabric.relayout.rules import derive_reference
from weightfabric.kernels.fp8 import quantize_fp8_ref

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6)


def _model(name: str, **kw):
    config = getattr(transformers, f"{name}Config")(**{**SMALL, **kw})
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    g = torch.Generator().manual_seed(1234)
    # fresh values everywhere (no NaN from uninitialised memory, no constant norms); tied
    # tensors stay one tensor
    seen: dict[int, torch.Tensor] = {}
    state = {}
    for n, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen[t.data_ptr()] = torch.randn(t.shape, generator=g, dtype=torch.float32)
        state[n] = seen[t.data_ptr()]
    return config, state


def llama(**kw):
    return _model("Llama", intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                  **kw)


def qwen2(**kw):
    return _model("Qwen2", intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True, **kw)


def qwen3(**kw):
    kw = {"intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 24, **kw}
    return _model("Qwen3", **kw)


def qwen3_moe(**kw):
    kw = {"intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
          "mlp_only_layers": [1], **kw}
    return _model("Qwen3Moe", **kw)


def qwen2_moe(**kw):
    kw = {"intermediate_size": 96, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, **kw}
    return _model("Qwen2Moe", **kw)


# ------------------------------------------------------------ the independent conversion
def vllm_reference(config, sd, *, tp, rank, ep=1, expert_parallel=None):
    """The parameters of vLLM worker ``rank``, after its weight loaders step by step."""
    tp_rank = rank % tp
    H = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or H // heads
    out = {}

    def vocab_parallel(w):  # pad_vocab_size(V, 64), vocab_range_from_global_vocab_size
        padded = (w.shape[0] + 63) // 64 * 64
        per = padded // tp
        return F.pad(w, (0, 0, 0, padded - w.shape[0])).narrow(0, tp_rank * per, per)

    def column(w, per_rank, shard_rank):  # narrow(output_dim, shard_rank * size, size)
        return w.narrow(0, shard_rank * per_rank, per_rank)

    def row(w, parts, r):  # RowParallelLinear: narrow(input_dim, r * size, size)
        size = w.shape[1] // parts
        return w.narrow(1, r * size, size)

    num_heads = heads // tp
    if tp >= kv:
        num_kv, replicas = 1, tp // kv
    else:
        num_kv, replicas = kv // tp, 1

    def qkv(p, suffix):
        q = column(sd[f"{p}.q_proj.{suffix}"], num_heads * hd, tp_rank)
        k = column(sd[f"{p}.k_proj.{suffix}"], num_kv * hd, tp_rank // replicas)
        v = column(sd[f"{p}.v_proj.{suffix}"], num_kv * hd, tp_rank // replicas)
        return torch.cat([q, k, v])

    def dense_mlp(p, with_bias=False):
        inter = sd[f"{p}.gate_proj.weight"].shape[0] // tp
        out[f"{p}.gate_up_proj.weight"] = torch.cat(
            [column(sd[f"{p}.{x}_proj.weight"], inter, tp_rank) for x in ("gate", "up")])
        out[f"{p}.down_proj.weight"] = row(sd[f"{p}.down_proj.weight"], tp, tp_rank)
        if with_bias:
            out[f"{p}.gate_up_proj.bias"] = torch.cat(
                [column(sd[f"{p}.{x}_proj.bias"], inter, tp_rank) for x in ("gate", "up")])
            out[f"{p}.down_proj.bias"] = sd[f"{p}.down_proj.bias"]

    # FusedMoEParallelConfig.make: tp and dp flatten into one group of tp * ep workers
    flat_size, flat_rank = tp * ep, rank
    use_ep = flat_size > 1 and (ep > 1 if expert_parallel is None else expert_parallel)
    moe_tp, moe_tp_rank = (1, 0) if use_ep else (flat_size, flat_rank)
    ep_size, ep_rank = (flat_size, flat_rank) if use_ep else (1, 0)

    out["model.embed_tokens.weight"] = vocab_parallel(sd["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out[f"{a}.qkv_proj.weight"] = qkv(a, "weight")
        if f"{a}.q_proj.bias" in sd:
            out[f"{a}.qkv_proj.bias"] = qkv(a, "bias")
        out[f"{a}.o_proj.weight"] = row(sd[f"{a}.o_proj.weight"], tp, tp_rank)
        if f"{a}.o_proj.bias" in sd:
            out[f"{a}.o_proj.bias"] = sd[f"{a}.o_proj.bias"]
        for n in ("q_norm", "k_norm"):
            if f"{a}.{n}.weight" in sd:
                out[f"{a}.{n}.weight"] = sd[f"{a}.{n}.weight"]
        if f"{p}.mlp.gate.weight" in sd:
            out[f"{p}.mlp.gate.weight"] = sd[f"{p}.mlp.gate.weight"]
            E = sd[f"{p}.mlp.gate.weight"].shape[0]
            base, rem = divmod(E, ep_size)  # determine_expert_map, "linear"
            local = base + (ep_rank < rem)
            start = ep_rank * base + min(ep_rank, rem)
            w13, w2 = [], []
            for e in range(start, start + local):
                if f"{p}.mlp.experts.gate_up_proj" in sd:
                    gate, up = sd[f"{p}.mlp.experts.gate_up_proj"][e].chunk(2, dim=0)
                    down = sd[f"{p}.mlp.experts.down_proj"][e]
                else:
                    gate, up, down = (sd[f"{p}.mlp.experts.{e}.{x}_proj.weight"]
                                      for x in ("gate", "up", "down"))
                size = gate.shape[0] // moe_tp  # FusedMoE._load_w13 / _load_w2
                w13.append(torch.cat([gate.narrow(0, moe_tp_rank * size, size),
                                      up.narrow(0, moe_tp_rank * size, size)]))
                w2.append(down.narrow(1, moe_tp_rank * size, size))
            out[f"{p}.mlp.experts.w13_weight"] = torch.stack(w13)
            out[f"{p}.mlp.experts.w2_weight"] = torch.stack(w2)
            if f"{p}.mlp.shared_expert.gate_proj.weight" in sd:
                dense_mlp(f"{p}.mlp.shared_expert")
            if f"{p}.mlp.shared_expert_gate.weight" in sd:
                out[f"{p}.mlp.shared_expert_gate.weight"] = sd[f"{p}.mlp.shared_expert_gate.weight"]
        else:
            dense_mlp(f"{p}.mlp", f"{p}.mlp.gate_proj.bias" in sd)
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{n}.weight"] = sd[f"{p}.{n}.weight"]
    out["model.norm.weight"] = sd["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = vocab_parallel(sd["lm_head.weight"])
    return out


QUANTISED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
             "w13_weight", "w2_weight")


def expected(config, sd, *, tp, rank, ep=1, expert_parallel=None, dtype=None, fp8=None):
    ref = vllm_reference(config, sd, tp=tp, rank=rank, ep=ep, expert_parallel=expert_parallel)
    out = {}
    for n, t in ref.items():
        t = t.to(dtype) if dtype is not None else t
        if fp8 is not None and n.endswith(QUANTISED):
            pairs = [quantize_fp8_ref(x, fp8) for x in (t if t.dim() == 3 else [t])]
            q, s = zip(*pairs, strict=True)
            out[n], out[n + "_scale_inv"] = ((torch.stack(q), torch.stack(s)) if t.dim() == 3
                                             else (q[0], s[0]))
        else:
            out[n] = t.contiguous()
    return out


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        if t.dtype == torch.float8_e4m3fn:
            assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
        else:
            assert torch.equal(got[n], t), n


def check_all_ranks(config, sd, *, tp, ep=1, expert_parallel=None, dtype=None, fp8=None,
                    experts="stacked", published=None):
    layout = vllm_layout(config, tp=tp, ep=ep, dtype=dtype, fp8_block=fp8, experts=experts,
                         expert_parallel=expert_parallel)
    assert layout.ranks == tp * ep
    for rank in range(layout.ranks):
        got = derive_reference(layout, published if published is not None else sd, rank)
        assert_same(got, expected(config, sd, tp=tp, rank=rank, ep=ep,
                                  expert_parallel=expert_parallel, dtype=dtype, fp8=fp8))
    return layout


# ------------------------------------------------------------ dense models
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_gqa_every_rank_matches_vllm(tp):
    config, sd = llama()
    check_all_ranks(config, sd, tp=tp)  # tp 4 and 8 replicate the 2 kv heads


def test_llama_biases_and_bf16():
    config, sd = llama(attention_bias=True, mlp_bias=True)
    layout = check_all_ranks(config, sd, tp=4, dtype=torch.bfloat16)
    targets = {t.name for t in layout.bind(
        {n: _pub(t) for n, t in sd.items()}, 0).targets}
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.gate_up_proj.bias",
            "model.layers.0.mlp.down_proj.bias", "model.layers.0.self_attn.qkv_proj.bias"} <= targets


def test_mistral_config_is_the_llama_layout():
    config = transformers.MistralConfig(**SMALL, intermediate_size=96, num_attention_heads=8,
                                        num_key_value_heads=2)
    model = transformers.MistralForCausalLM(config)
    sd = {n: torch.randn(t.shape) for n, t in model.state_dict().items()}
    check_all_ranks(config, sd, tp=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen2_tied_embeddings_padded_vocab(tp):
    config, sd = qwen2()
    assert config.tie_word_embeddings and config.vocab_size % 64
    layout = check_all_ranks(config, sd, tp=tp)
    assert "lm_head.weight" not in {r.target for r in layout.rules}
    # the published version may carry only the embedding; lm_head is never read
    only = {n: t for n, t in sd.items() if n != "lm_head.weight"}
    got = derive_reference(layout, only, 0, aliases={"lm_head.weight": "model.embed_tokens.weight"})
    emb = got["model.embed_tokens.weight"]
    assert emb.shape == (128 // tp, 64)
    if tp == 2:  # rank 0: tokens 0..63; rank 1: 64..99, then 28 zero rows
        last = derive_reference(layout, only, 1)["model.embed_tokens.weight"]
        assert torch.equal(last[:36], sd["model.embed_tokens.weight"][64:])
        assert not last[36:].any()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_qk_norm_and_head_dim_from_config(tp):
    config, sd = qwen3()
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    check_all_ranks(config, sd, tp=tp, dtype=torch.bfloat16)


# ------------------------------------------------------------ MoE
@pytest.mark.parametrize("tp,ep,expert_parallel", [
    (1, 1, None), (2, 1, None), (2, 1, True), (1, 2, None), (2, 2, None), (2, 2, False),
])
def test_qwen3_moe_matches_vllm(tp, ep, expert_parallel):
    config, sd = qwen3_moe()
    layout = check_all_ranks(config, sd, tp=tp, ep=ep, expert_parallel=expert_parallel)
    assert layout.tp == tp and layout.ep == ep


def test_qwen3_moe_expert_placement_is_contiguous():
    config, sd = qwen3_moe(num_experts=6)
    layout = check_all_ranks(config, sd, tp=2, ep=2)  # 6 experts over 4: 2, 2, 1, 1
    pub = {n: _pub(t) for n, t in sd.items()}
    counts = [dict((t.name, t.shape) for t in layout.bind(pub, r).targets)[
        "model.layers.0.mlp.experts.w13_weight"][0] for r in range(4)]
    assert counts == [2, 2, 1, 1]


def test_qwen3_moe_per_expert_checkpoint_names():
    config, sd = qwen3_moe()
    per = {n: t for n, t in sd.items() if ".mlp.experts." not in n}
    for n, t in sd.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            p = n[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                per[f"{p}{e}.gate_proj.weight"], per[f"{p}{e}.up_proj.weight"] = t[e].chunk(2)
                per[f"{p}{e}.down_proj.weight"] = sd[p + "down_proj"][e]
    assert set(per) == set(hf_shapes(config, experts="per_expert"))
    for tp, ep in ((1, 1), (2, 1), (1, 2)):
        check_all_ranks(config, sd, tp=tp, ep=ep, experts="per_expert", published=per)
    with pytest.raises(LayoutMismatchError, match="experts.0.gate_proj.weight"):
        derive_reference(vllm_layout(config, experts="per_expert"), sd, 0)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_qwen2_moe_shared_expert(tp, ep):
    config, sd = qwen2_moe()
    check_all_ranks(config, sd, tp=tp, ep=ep)


# ------------------------------------------------------------ fp8
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_fp8_blocks(tp):
    config, sd = qwen3(head_dim=16, intermediate_size=64)
    check_all_ranks(config, sd, tp=tp, dtype=torch.bfloat16, fp8=16)


@pytest.mark.parametrize("tp,ep,expert_parallel", [(1, 1, None), (2, 1, None), (1, 2, None),
                                                   (2, 1, True)])
def test_qwen3_moe_fp8_blocks(tp, ep, expert_parallel):
    config, sd = qwen3_moe(intermediate_size=64)
    check_all_ranks(config, sd, tp=tp, ep=ep, expert_parallel=expert_parallel,
                    dtype=torch.bfloat16, fp8=16)


def test_fp8_needs_whole_blocks_per_rank():
    config, _ = qwen3(head_dim=16, intermediate_size=64)
    vllm_layout(config, tp=2, fp8_block=16)
    with pytest.raises(LayoutError, match="qkv_proj q piece of 32"):  # 2 heads of 16 per rank
        vllm_layout(config, tp=2, fp8_block=64)
    with pytest.raises(LayoutError, match="qkv_proj k piece of 32"):  # unsplit: q, k checked
        vllm_layout(config, tp=1, fp8_block=64)
    vllm_layout(config, tp=1, fp8_block=32)
    moe, _ = qwen3_moe(intermediate_size=64, head_dim=32)
    with pytest.raises(LayoutError, match="experts"):  # 32 / 2 = 16 per rank
        vllm_layout(moe, tp=2, fp8_block=32)
    vllm_layout(moe, tp=2, fp8_block=32, expert_parallel=True)  # whole experts: 32
    with pytest.raises(LayoutError, match="power of two"):
        vllm_layout(moe, fp8_block=24)


# ------------------------------------------------------------ names, configs, errors
def test_tensor_names_are_what_vllm_registers():
    config, sd = qwen3_moe()
    layout = vllm_layout(config, tp=2, dtype=torch.bfloat16, fp8_block=16)
    specs = layout.bind({n: _pub(t) for n, t in sd.items()}, 1).tensor_specs()
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in (0, 1):
        p = f"model.layers.{i}"
        want |= {f"{p}.self_attn.qkv_proj.weight", f"{p}.self_attn.qkv_proj.weight_scale_inv",
                 f"{p}.self_attn.o_proj.weight", f"{p}.self_attn.o_proj.weight_scale_inv",
                 f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight",
                 f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
    want |= {"model.layers.0.mlp.gate.weight",
             "model.layers.0.mlp.experts.w13_weight",
             "model.layers.0.mlp.experts.w13_weight_scale_inv",
             "model.layers.0.mlp.experts.w2_weight",
             "model.layers.0.mlp.experts.w2_weight_scale_inv",
             "model.layers.1.mlp.gate_up_proj.weight",
             "model.layers.1.mlp.gate_up_proj.weight_scale_inv",
             "model.layers.1.mlp.down_proj.weight",
             "model.layers.1.mlp.down_proj.weight_scale_inv"}
    assert set(specs) == want
    H, hd = 64, 16
    assert specs["model.layers.0.self_attn.qkv_proj.weight"] == (((2 + 1 + 1) * hd, H),
                                                                 torch.float8_e4m3fn)
    assert specs["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ((4, 4), torch.float32)
    assert specs["model.layers.0.mlp.experts.w13_weight"] == ((4, 32, H), torch.float8_e4m3fn)
    assert specs["model.layers.0.mlp.experts.w2_weight"] == ((4, H, 16), torch.float8_e4m3fn)
    assert specs["model.embed_tokens.weight"] == ((64, H), torch.bfloat16)
    assert specs["model.layers.0.mlp.gate.weight"] == ((4, H), torch.bfloat16)

    qconfig, qsd = qwen2()
    names = set(vllm_layout(qconfig, tp=2).bind({n: _pub(t) for n, t in qsd.items()}, 0)
                .tensor_specs())
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    assert names == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}" for i in (0, 1) for n in per_layer}


def test_names_and_a_dict_config_give_the_same_layout():
    config, _ = qwen3_moe()
    a = vllm_layout(config, tp=2, ep=2)
    b = vllm_layout(config.to_dict(), tp=2, ep=2)
    assert a.name == "vllm-qwen3_moe-tp2-ep2" and a.key == b.key
    assert vllm_layout(config, tp=2).name == "vllm-qwen3_moe-tp2"
    assert vllm_layout(config, tp=2, ep=2, expert_parallel=False).name == "vllm-qwen3_moe-tp2-dp2"
    assert vllm_layout(config, tp=2, expert_parallel=True).name == "vllm-qwen3_moe-tp2-ep"
    assert vllm_layout(config, fp8_block=16).name == "vllm-qwen3_moe-tp1-fp8"
    assert vllm_layout(config, name="mine").name == "mine"
    assert vllm_layout(config, tp=2).key != vllm_layout(config, tp=2, expert_parallel=True).key


def test_layout_errors():
    llama_config, _ = llama()
    with pytest.raises(LayoutError) as err:
        vllm_layout({"model_type": "gpt2"})
    for t in SUPPORTED_MODEL_TYPES:
        assert t in str(err.value)
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"} == set(
        SUPPORTED_MODEL_TYPES)
    with pytest.raises(LayoutError, match="attention heads"):
        vllm_layout(llama_config, tp=16)
    with pytest.raises(LayoutError, match="3 kv heads"):
        vllm_layout(llama_config.to_dict() | {"num_attention_heads": 12, "head_dim": 8,
                                              "num_key_value_heads": 3}, tp=4)
    with pytest.raises(LayoutError, match="MoE"):
        vllm_layout(llama_config, ep=2)
    with pytest.raises(LayoutError, match="tp must"):
        vllm_layout(llama_config, tp=0)
    with pytest.raises(LayoutError, match="fp8_block"):
        vllm_layout(llama_config, dtype=torch.float8_e4m3fn)
    with pytest.raises(LayoutError, match="experts"):
        vllm_layout(llama_config, experts="fused")  # type: ignore[arg-type]
    moe, _ = qwen3_moe()
    with pytest.raises(LayoutError, match="experts"):  # 4 experts over 8 workers
        vllm_layout(moe, tp=4, ep=2)
    with pytest.raises(LayoutError, match="moe_intermediate_size"):
        vllm_layout(moe.to_dict() | {"moe_intermediate_size": 30}, tp=4)
    with pytest.raises(LayoutError, match="vocabulary"):  # 100 -> 128 rows over 256
        vllm_layout(llama_config.to_dict() | {"num_attention_heads": 256, "head_dim": 4,
                                              "num_key_value_heads": 256,
                                              "intermediate_size": 256}, tp=256)


def test_a_layout_checks_the_published_shapes():
    config, sd = qwen3()
    other, _ = qwen3(num_key_value_heads=4)  # fits the names, not the shapes
    with pytest.raises(LayoutMismatchError, match="k_proj.weight.*written for"):
        derive_reference(vllm_layout(other, tp=2), sd, 0)
    fewer, _ = qwen3(num_hidden_layers=3)
    with pytest.raises(LayoutMismatchError, match="no tensor 'model.layers.2"):
        derive_reference(vllm_layout(fewer), sd, 0)


# ------------------------------------------------------------ HF layout
def test_hf_shapes_are_the_state_dict():
    for make in (llama, qwen2, qwen3, qwen3_moe, qwen2_moe):
        config, sd = make()
        want = {n: tuple(t.shape) for n, t in sd.items()}
        if config.tie_word_embeddings:
            del want["lm_head.weight"]
        assert hf_shapes(config) == want, config.model_type


def test_hf_layout_is_the_identity():
    config, sd = qwen3_moe()
    layout = hf_layout(config, dtype=torch.bfloat16)
    assert layout.name == "hf-qwen3_moe" and layout.ranks == 1
    got = derive_reference(layout, sd, 0)
    assert set(got) == set(sd)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in sd.items())
    qconfig, qsd = qwen2()  # tied: lm_head is the embedding, read through the alias
    by_names = hf_layout({n: t for n, t in qsd.items()})
    assert by_names.name == "hf"
    only = {n: t for n, t in qsd.items() if n != "lm_head.weight"}
    got = derive_reference(by_names, only, 0, aliases={"lm_head.weight": "model.embed_tokens.weight"})
    assert torch.equal(got["lm_head.weight"], qsd["model.embed_tokens.weight"])
    assert hf_layout(qconfig).key == hf_layout(qconfig.to_dict()).key


def _pub(t):
    from weightfabric.fabric.relayout.rules import Published
    return Published(tuple(t.shape), t.dtype)
