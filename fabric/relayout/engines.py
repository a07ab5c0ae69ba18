"""Ready-made engine layouts: the tensors one vLLM worker holds, and the plain HF layout.

`vllm_layout` turns a Hugging Face config (a ``transformers`` config object or a
plain dict of the same fields) into an `EngineLayout`: one `Rule` per tensor that a
vLLM worker of a tensor-parallel group (and, for MoE models, of an expert-parallel
group) registers, each saying how it derives from the trainer's published Hugging
Face tensors. `hf_layout` is the unsharded Hugging Face layout itself, for a plain
``transformers`` reader. Neither imports vLLM or ``transformers``; the rules follow
vLLM's public weight-loading code (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear`` and their weight loaders in ``layers/linear.py``;
``VocabParallelEmbedding`` / ``ParallelLMHead``; ``FusedMoE`` and
``FusedMoEParallelConfig.make``; the models' ``load_weights``).

Supported model types: ``llama`` and ``mistral`` (vLLM's ``llama.py``),
``qwen2``, ``qwen3``, ``qwen2_moe``, ``qwen3_moe``.

The rules (``tp``: tensor-parallel size, ``r``: the worker's tensor-parallel rank;
vLLM's "even" splits assert divisibility, and so do these, at layout time):

* ``model.layers.{i}.self_attn.qkv_proj.weight`` (and ``.bias`` where the model has
  q/k/v biases: Qwen2, Qwen2-MoE, ``attention_bias``): ``[q_r; k_r; v_r]`` along
  dim 0, each of ``q_proj`` / ``k_proj`` / ``v_proj`` cut in whole heads of
  ``head_dim`` rows. With ``tp > num_key_value_heads`` the kv heads are replicated:
  rank ``r`` holds kv head ``r // (tp // num_key_value_heads)``.
* ``self_attn.o_proj.weight``: row-parallel, cut along dim 1 (its input); its bias,
  where there is one (Llama ``attention_bias``), whole on every rank.
* ``mlp.gate_up_proj.weight`` = ``[gate_r; up_r]`` (each cut along dim 0; a
  ``mlp_bias`` likewise); ``mlp.down_proj.weight`` cut along dim 1 (bias whole).
* ``model.embed_tokens.weight`` and ``lm_head.weight``: vocab-parallel: the vocabulary
  is padded to a multiple of 64, then cut evenly; the padding rows are zeros. With
  ``tie_word_embeddings`` vLLM shares the embedding and has no ``lm_head`` tensor, so
  there is no ``lm_head`` rule (a published ``lm_head.weight`` alias is not read).
* Norms (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, Qwen3's
  ``self_attn.q_norm`` / ``k_norm``), the MoE router ``mlp.gate.weight`` and Qwen2-MoE's
  ``mlp.shared_expert_gate.weight``: whole on every rank. Qwen2-MoE's
  ``mlp.shared_expert.gate_up_proj`` / ``down_proj`` are a dense MLP (cut as above).
* MoE experts: ``mlp.experts.w13_weight`` ``[E_local, 2 * I_local, hidden]``, per
  expert ``[gate; up]``, and ``mlp.experts.w2_weight`` ``[E_local, hidden, I_local]``.
  vLLM's fused-MoE group spans every worker of the layout (it folds tensor and data
  parallelism into one: ``FusedMoEParallelConfig.make``), so these rules are ``flat``:
  they take the worker's rank ``ep_rank * tp + tp_rank`` among all ``tp * ep``. With
  expert parallelism (``--enable-expert-parallel``) each worker holds whole experts,
  a contiguous run of them (vLLM's default "linear" placement: rank ``k`` of ``n``
  gets ``E // n`` experts, the first ``E % n`` ranks one more); without it every
  worker holds every expert, its intermediate dim cut over all ``tp * ep`` workers.
  The published experts are the stacked ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (rows ``[0, I)`` of each expert are the gate, ``[I, 2I)`` the up projection) and
  ``mlp.experts.down_proj`` ``[E, H, I]`` of ``transformers`` 5, or, with
  ``experts="per_expert"``, the ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` /
  ``down_proj`` of older checkpoints.
* ``dtype`` casts every target. ``fp8_block`` quantises the linear weights (qkv, o,
  gate_up, down, the experts' w13 / w2, the shared expert's) to float8_e4m3fn with
  float32 block scales named ``<target>_scale_inv`` (``...qkv_proj.weight_scale_inv``,
  ``...experts.w13_weight_scale_inv``: vLLM's block-fp8 parameters); embeddings,
  ``lm_head``, norms, routers and biases stay in ``dtype``. vLLM needs each tensor-
  parallel piece of a block-quantised weight to be whole blocks
  (``validate_fp8_block_shape``, ``Fp8MoEMethod.create_weights``): a config that
  cannot be is a `LayoutError` here.

Each layout also records the Hugging Face shapes its config implies
(`EngineLayout.expects`, from `hf_shapes`): binding it to a version of another
model is a `LayoutMismatchError` that names the tensor, not a wrong split.

The ``ep`` argument is the number of vLLM data-parallel engines (each ``tp`` workers
wide) that share the experts: worker ``rank = ep_rank * tp + tp_rank`` is tensor-
parallel rank ``tp_rank`` of engine ``ep_rank``. Dense tensors are the same in every
engine; ``expert_parallel`` (default: ``ep > 1``) is vLLM's
``--enable-expert-parallel``: ``vllm serve -tp 2 --enable-expert-parallel`` is
``vllm_layout(cfg, tp=2, expert_parallel=True)``, ``-tp 2 -dp 2
--enable-expert-parallel`` is ``vllm_layout(cfg, tp=2, ep=2)``.

Adding an architecture: write a function from the config to an `_Arch` (the sizes
and the switches: biases, q/k norms, tied embeddings, experts, shared expert), and
register it in ``_ARCHS`` under its ``model_type``. If the model has tensors the
`_Arch` switches do not describe, add a switch and its rules in `_LayoutBuilder`
(and its Hugging Face names in `hf_shapes`), reading the model's vLLM
``load_weights`` (its ``stacked_params_mapping`` and expert mapping) and the layers'
weight loaders first. Test it as ``tests/fabric/relayout/test_engines.py``
does: a tiny random model from its ``transformers`` config, every rank of
`derive_reference` against a conversion written independently in plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from weightfabric.fabric.errors import LayoutError
from weightfabric.fabric.relayout.rules import (
    EngineLayout,
    Published,
    Rule,
    Split,
    Term,
    identity_layout,
)

Experts = Literal["stacked", "per_expert"]
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class _Arch:
    """The sizes and switches of a decoder-only model that its layouts depend on."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False
    sparse: frozenset[int] = frozenset()


def _field(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` or ``config[key]``; ``default`` when absent or None."""
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def _need(config: Any, key: str, model_type: str, alias: str | None = None) -> int:
    value = _field(config, key, _field(config, alias) if alias else None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LayoutError(f"{model_type} config: {key} must be a non-negative int, got {value!r}")
    return value


def _base(config: Any, model_type: str, **switches: Any) -> _Arch:
    hidden = _need(config, "hidden_size", model_type)
    heads = _need(config, "num_attention_heads", model_type)
    if not heads or hidden % heads and _field(config, "head_dim") is None:
        raise LayoutError(f"{model_type} config: hidden_size {hidden} and "
                          f"num_attention_heads {heads} give no head_dim")
    kv = _field(config, "num_key_value_heads", heads)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise LayoutError(f"{model_type} config: num_key_value_heads {kv!r} does not divide "
                          f"the {heads} attention heads")
    return _Arch(model_type=model_type, layers=_need(config, "num_hidden_layers", model_type),
                 hidden=hidden, heads=heads, kv_heads=int(kv),
                 head_dim=int(_field(config, "head_dim", hidden // heads)),
                 intermediate=_need(config, "intermediate_size", model_type),
                 vocab=_need(config, "vocab_size", model_type),
                 tied=bool(_field(config, "tie_word_embeddings", False)), **switches)


def _llama(config: Any, model_type: str) -> _Arch:
    # vLLM llama.py: qkv bias = attention_bias (or bias), o_proj bias likewise; mlp_bias
    bias = bool(_field(config, "attention_bias", False) or _field(config, "bias", False))
    return _base(config, model_type, qkv_bias=bias, o_bias=bias,
                 mlp_bias=bool(_field(config, "mlp_bias", False)))


def _qwen2(config: Any, model_type: str) -> _Arch:
    return _base(config, model_type, qkv_bias=True)  # vLLM qwen2.py: qkv_proj bias=True


def _qwen3(config: Any, model_type: str) -> _Arch:
    return _base(config, model_type, qkv_bias=bool(_field(config, "attention_bias", False)),
                 qk_norm=True)


def _sparse_layers(config: Any, layers: int, experts: int) -> frozenset[int]:
    """Layers with a sparse MoE block: vLLM's and transformers' Qwen MoE rule."""
    step = int(_field(config, "decoder_sparse_step", 1))
    dense = set(_field(config, "mlp_only_layers", []))
    if experts <= 0 or step <= 0:
        return frozenset()
    return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _moe(config: Any, model_type: str, **switches: Any) -> _Arch:
    # transformers 5 serialises Qwen3-MoE's num_experts as num_local_experts
    experts = _need(config, "num_experts", model_type, alias="num_local_experts")
    arch = _base(config, model_type, experts=experts,
                 moe_intermediate=_need(config, "moe_intermediate_size", model_type), **switches)
    return _replace(arch, sparse=_sparse_layers(config, arch.layers, experts))


def _qwen2_moe(config: Any, model_type: str) -> _Arch:
    return _moe(config, model_type, qkv_bias=True, shared_gate=True,
                shared_intermediate=int(_field(config, "shared_expert_intermediate_size", 0)))


def _qwen3_moe(config: Any, model_type: str) -> _Arch:
    return _moe(config, model_type, qk_norm=True,
                qkv_bias=bool(_field(config, "attention_bias", False)))


def _replace(arch: _Arch, **changes: Any) -> _Arch:
    return _Arch(**{**arch.__dict__, **changes})


_ARCHS: dict[str, Callable[[Any, str], _Arch]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_ARCHS))


def _arch(config: Any) -> _Arch:
    model_type = _field(config, "model_type")
    if model_type not in _ARCHS:
        raise LayoutError(f"no ready-made layout for model_type {model_type!r}; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} (or write the rules: "
                          "fabric.relayout.rules)")
    return _ARCHS[model_type](config, model_type)


def _check_experts(experts: str) -> None:
    if experts not in ("stacked", "per_expert"):
        raise LayoutError(f"experts must be 'stacked' or 'per_expert', got {experts!r}")


# ------------------------------------------------------------------ HF names
def hf_shapes(config: Any, *, experts: Experts = "stacked") -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of a model and their shapes, as a trainer publishes them.

    Tied ``lm_head.weight`` is left out (it is ``model.embed_tokens.weight``, as in a
    saved checkpoint). MoE experts are the stacked tensors of ``transformers`` 5, or
    with ``experts="per_expert"`` one tensor per expert and projection.

    Raises:
        LayoutError: unsupported ``model_type`` or a config that lacks a size.
    """
    _check_experts(experts)
    a = _arch(config)
    H, hd = a.hidden, a.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab, H)}

    def mlp(p: str, inter: int, bias: bool) -> None:
        for proj in ("gate_proj", "up_proj"):
            out[f"{p}.{proj}.weight"] = (inter, H)
            if bias:
                out[f"{p}.{proj}.bias"] = (inter,)
        out[f"{p}.down_proj.weight"] = (H, inter)
        if bias:
            out[f"{p}.down_proj.bias"] = (H,)

    for i in range(a.layers):
        p = f"model.layers.{i}"
        for proj, heads in (("q_proj", a.heads), ("k_proj", a.kv_heads), ("v_proj", a.kv_heads)):
            out[f"{p}.self_attn.{proj}.weight"] = (heads * hd, H)
            if a.qkv_bias:
                out[f"{p}.self_attn.{proj}.bias"] = (heads * hd,)
        out[f"{p}.self_attn.o_proj.weight"] = (H, a.heads * hd)
        if a.o_bias:
            out[f"{p}.self_attn.o_proj.bias"] = (H,)
        if a.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (hd,)
            out[f"{p}.self_attn.k_norm.weight"] = (hd,)
        if i in a.sparse:
            E, moe_i = a.experts, a.moe_intermediate
            out[f"{p}.mlp.gate.weight"] = (E, H)
            if experts == "stacked":
                out[f"{p}.mlp.experts.gate_up_proj"] = (E, 2 * moe_i, H)
                out[f"{p}.mlp.experts.down_proj"] = (E, H, moe_i)
            else:
                for e in range(E):
                    mlp(f"{p}.mlp.experts.{e}", moe_i, False)
            if a.shared_intermediate:
                mlp(f"{p}.mlp.shared_expert", a.shared_intermediate, False)
            if a.shared_gate:
                out[f"{p}.mlp.shared_expert_gate.weight"] = (1, H)
        else:
            mlp(f"{p}.mlp", a.intermediate, a.mlp_bias)
        out[f"{p}.input_layernorm.weight"] = (H,)
        out[f"{p}.post_attention_layernorm.weight"] = (H,)
    out["model.norm.weight"] = (H,)
    if not a.tied:
        out["lm_head.weight"] = (a.vocab, H)
    return out


def hf_layout(config_or_names: Any, *, dtype: torch.dtype | None = None,
              experts: Experts = "stacked", name: str | None = None) -> EngineLayout:
    """The unsharded Hugging Face layout: every tensor as published (optionally cast).

    Args:
        config_or_names: a config (object, or dict with ``model_type``): its tensors from
            `hf_shapes`; or a mapping of the published names to shapes (or tensors, or
            `Published`).
        dtype: cast every tensor to this dtype.
        experts: with a config, how its MoE experts are published.
        name: the layout's name (default ``hf-<model_type>``, or ``hf``).
    """
    if isinstance(config_or_names, Mapping) and "model_type" not in config_or_names:
        shapes = {n: tuple(v.shape if isinstance(v, torch.Tensor | Published) else v)
                  for n, v in config_or_names.items()}
        default = "hf"
    else:
        shapes = dict(hf_shapes(config_or_names, experts=experts))
        default = f"hf-{_field(config_or_names, 'model_type')}"
    return identity_layout(shapes, name=name or default, dtype=dtype)


# ------------------------------------------------------------------ vLLM
def vllm_layout(config: Any, *, tp: int = 1, ep: int = 1, dtype: torch.dtype | None = None,
                fp8_block: int | None = None, name: str | None = None,
                experts: Experts = "stacked",
                expert_parallel: bool | None = None) -> EngineLayout:
    """The tensors each vLLM worker holds, derived from the published HF tensors.

    Args:
        config: a ``transformers`` config, or a dict of its fields (``model_type``:
            one of `SUPPORTED_MODEL_TYPES`).
        tp: vLLM's tensor-parallel size.
        ep: how many tp-wide data-parallel engines share the MoE experts (the layout has
            ``tp * ep`` ranks; rank ``ep_rank * tp + tp_rank``); 1 for a dense model.
        dtype: cast every target (e.g. fp32 master weights to bf16); None keeps the
            published dtype.
        fp8_block: quantise the linear weights to float8_e4m3fn in ``fp8_block``-square
            blocks (vLLM block fp8), scales in ``<target>_scale_inv``.
        name: the layout's name (default ``vllm-<model_type>-tp<tp>[-ep<ep>][-fp8]``).
        experts: how the trainer publishes MoE experts: ``stacked`` (``transformers`` 5:
            ``mlp.experts.gate_up_proj`` / ``down_proj``) or ``per_expert``
            (``mlp.experts.<e>.gate_proj.weight``, ...).
        expert_parallel: vLLM's ``--enable-expert-parallel`` (default: ``ep > 1``): whole
            experts split over all ``tp * ep`` workers; without it every worker holds a
            slice of every expert.

    Raises:
        LayoutError: unsupported ``model_type``, or sizes vLLM cannot split this way
            (heads, kv heads, intermediate or vocabulary over ``tp``, experts over the
            workers, fp8 blocks over the pieces).
    """
    _check_experts(experts)
    a = _arch(config)
    for what, v in (("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"vllm_layout: {what} must be an int >= 1, got {v!r}")
    if dtype is not None and (not dtype.is_floating_point or dtype.itemsize == 1):
        raise LayoutError(f"vllm_layout: dtype {dtype} is not a 16/32/64-bit float "
                          "(fp8 weights: give fp8_block)")
    moe = bool(a.sparse)
    ep_on = (ep > 1) if expert_parallel is None else bool(expert_parallel)
    if not moe and (ep > 1 or ep_on):
        raise LayoutError(f"vllm_layout: {a.model_type} has no MoE layers; ep and "
                          "expert_parallel are for MoE models")
    _check_vllm_splits(a, tp, tp * ep, ep_on)
    if fp8_block is not None:
        _check_fp8(a, tp, tp * ep, ep_on, fp8_block)
    if name is None:
        name = f"vllm-{a.model_type}-tp{tp}"
        if ep > 1:
            name += f"-ep{ep}" if ep_on else f"-dp{ep}"
        elif ep_on and tp > 1:
            name += "-ep"
        name += "-fp8" if fp8_block is not None else ""
    rules = _LayoutBuilder(a, tp, ep, ep_on, dtype, fp8_block, experts).rules()
    return EngineLayout(name, tuple(rules), tp=tp, ep=ep, scale_suffix="_scale_inv",
                        expects=tuple(hf_shapes(config, experts=experts).items()))


def _check_vllm_splits(a: _Arch, tp: int, ranks: int, ep_on: bool) -> None:
    """The divisibility vLLM asserts, as LayoutErrors that name the size."""
    where = f"vllm_layout({a.model_type}, tp={tp})"
    if a.heads % tp:
        raise LayoutError(f"{where}: {a.heads} attention heads do not split over tp={tp}")
    kv = a.kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise LayoutError(f"{where}: {kv} kv heads neither split over tp={tp} nor divide it")
    dense = a.layers > len(a.sparse)
    for what, size in (("intermediate_size", a.intermediate if dense else 0),
                       ("shared_expert_intermediate_size", a.shared_intermediate)):
        if size % tp:
            raise LayoutError(f"{where}: {what} {size} does not split over tp={tp}")
    padded = -(-a.vocab // VOCAB_PAD) * VOCAB_PAD
    if padded % tp:
        raise LayoutError(f"{where}: the vocabulary padded to {padded} does not split over "
                          f"tp={tp}")
    if not a.sparse:
        return
    if tp > a.experts:
        raise LayoutError(f"{where}: tp={tp} is greater than the {a.experts} experts")
    if ep_on and a.experts < ranks:
        raise LayoutError(f"{where}: {a.experts} experts over {ranks} expert-parallel "
                          "workers leave some with none")
    if not ep_on and a.moe_intermediate % ranks:
        raise LayoutError(f"{where}: moe_intermediate_size {a.moe_intermediate} does not "
                          f"split over the {ranks} workers of the MoE group")


def _check_fp8(a: _Arch, tp: int, ranks: int, ep_on: bool, block: int) -> None:
    """The block-fp8 shape rules of vLLM (validate_fp8_block_shape, Fp8MoEMethod)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
        raise LayoutError(f"vllm_layout: fp8_block must be a power of two >= 16, got {block!r}")
    where = f"vllm_layout({a.model_type}, tp={tp}, fp8_block={block})"

    def column(what: str, parts: Sequence[int]) -> None:
        # column-parallel: every piece whole blocks; unsplit merged: all but the last
        for part, size in zip(("q", "k", "v") if len(parts) == 3 else ("gate", "up"),
                              parts if tp > 1 else parts[:-1], strict=False):
            if size % block:
                raise LayoutError(f"{where}: {what} {part} piece of {size} rows per rank is "
                                  "not a whole number of blocks")

    def row(what: str, cols: int) -> None:
        if tp > 1 and cols % block:
            raise LayoutError(f"{where}: {what} piece of {cols} input columns per rank is not "
                              "a whole number of blocks")

    hd = a.head_dim
    kv_r = max(1, a.kv_heads // tp) * hd
    column("qkv_proj", (a.heads // tp * hd, kv_r, kv_r))
    row("o_proj", a.heads // tp * hd)
    mlps = ([("mlp", a.intermediate)] if a.layers > len(a.sparse) else []) + (
        [("shared_expert", a.shared_intermediate)] if a.sparse and a.shared_intermediate else [])
    for what, inter in mlps:
        column(f"{what}.gate_up_proj", (inter // tp, inter // tp))
        row(f"{what}.down_proj", inter // tp)
    if a.sparse:
        local = a.moe_intermediate // (1 if ep_on else ranks)
        if local % block:
            raise LayoutError(f"{where}: the experts' intermediate piece of {local} per rank "
                              "is not a whole number of blocks")


class _LayoutBuilder:
    """The rules of one `vllm_layout` call."""

    def __init__(self, a: _Arch, tp: int, ep: int, ep_on: bool, dtype: torch.dtype | None,
                 fp8_block: int | None, experts: Experts) -> None:
        self.a, self.tp, self.ranks, self.ep_on = a, tp, tp * ep, ep_on
        self.dtype, self.fp8, self.experts = dtype, fp8_block, experts

    def plain(self, target: str, *names: str, split: Split | None = None) -> Rule:
        """A target of ``names`` concatenated on dim 0, cut by ``split``, cast."""
        return Rule(target, (tuple(Term(n) for n in names),), split=split, dtype=self.dtype)

    def linear(self, target: str, *names: str, split: Split) -> Rule:
        """Like `plain`, quantised with ``fp8_block``."""
        return Rule(target, (tuple(Term(n) for n in names),), split=split, dtype=self.dtype,
                    fp8_block=self.fp8)

    def rules(self) -> list[Rule]:
        a, tp = self.a, self.tp
        vocab = Split(0, tp, pad_to=VOCAB_PAD)
        out = [self.plain("model.embed_tokens.weight", "model.embed_tokens.weight", split=vocab)]
        for i in range(a.layers):
            out += self.layer(f"model.layers.{i}", i in a.sparse)
        out.append(self.plain("model.norm.weight", "model.norm.weight"))
        if not a.tied:
            out.append(self.plain("lm_head.weight", "lm_head.weight", split=vocab))
        return out

    def layer(self, p: str, sparse: bool) -> list[Rule]:
        a, tp = self.a, self.tp
        attn = f"{p}.self_attn"
        heads = Split(0, tp, unit=a.head_dim, replicate=True)
        qkv = [f"{attn}.{x}_proj" for x in "qkv"]
        out = [self.linear(f"{attn}.qkv_proj.weight", *(f"{n}.weight" for n in qkv), split=heads)]
        if a.qkv_bias:
            out.append(self.plain(f"{attn}.qkv_proj.bias", *(f"{n}.bias" for n in qkv),
                                  split=heads))
        out.append(self.linear(f"{attn}.o_proj.weight", f"{attn}.o_proj.weight",
                               split=Split(1, tp, unit=a.head_dim)))
        if a.o_bias:
            out.append(self.plain(f"{attn}.o_proj.bias", f"{attn}.o_proj.bias"))
        if a.qk_norm:
            out += [self.plain(f"{attn}.{n}.weight", f"{attn}.{n}.weight")
                    for n in ("q_norm", "k_norm")]
        if sparse:
            out += self.moe(f"{p}.mlp")
        else:
            out += self.mlp(f"{p}.mlp", a.mlp_bias)
        out += [self.plain(f"{p}.{n}.weight", f"{p}.{n}.weight")
                for n in ("input_layernorm", "post_attention_layernorm")]
        return out

    def mlp(self, p: str, bias: bool) -> list[Rule]:
        """A dense MLP: MergedColumnParallel gate_up_proj, RowParallel down_proj."""
        cols, rows = Split(0, self.tp), Split(1, self.tp)
        out = [self.linear(f"{p}.gate_up_proj.weight", f"{p}.gate_proj.weight",
                           f"{p}.up_proj.weight", split=cols),
               self.linear(f"{p}.down_proj.weight", f"{p}.down_proj.weight", split=rows)]
        if bias:
            out += [self.plain(f"{p}.gate_up_proj.bias", f"{p}.gate_proj.bias",
                               f"{p}.up_proj.bias", split=cols),
                    self.plain(f"{p}.down_proj.bias", f"{p}.down_proj.bias")]
        return out

    def moe(self, p: str) -> list[Rule]:
        """Router, fused experts (w13, w2), and Qwen2-MoE's shared expert and its gate."""
        a = self.a
        out = [self.plain(f"{p}.gate.weight", f"{p}.gate.weight")]
        E, inter = a.experts, a.moe_intermediate
        if self.experts == "stacked":
            w13 = tuple((Term(f"{p}.experts.gate_up_proj", index=e, rows=(0, inter)),
                         Term(f"{p}.experts.gate_up_proj", index=e, rows=(inter, 2 * inter)))
                        for e in range(E))
            w2 = tuple((Term(f"{p}.experts.down_proj", index=e),) for e in range(E))
        else:
            w13 = tuple((Term(f"{p}.experts.{e}.gate_proj.weight"),
                         Term(f"{p}.experts.{e}.up_proj.weight")) for e in range(E))
            w2 = tuple((Term(f"{p}.experts.{e}.down_proj.weight"),) for e in range(E))
        if self.ep_on:  # whole experts, vLLM's linear placement over the flat rank
            place = Split(0, self.ranks, style="tensor_split")
            cut13 = cut2 = None
        else:  # every expert, its intermediate dim cut over the flat rank
            place, cut13, cut2 = None, Split(0, self.ranks), Split(1, self.ranks)
        for target, entries, cut in (("w13_weight", w13, cut13), ("w2_weight", w2, cut2)):
            out.append(Rule(f"{p}.experts.{target}", entries, split=cut, ep=place,
                            dtype=self.dtype, fp8_block=self.fp8, stack=True, flat=True))
        if a.shared_intermediate:
            out += self.mlp(f"{p}.shared_expert", False)
        if a.shared_gate:
            out.append(self.plain(f"{p}.shared_expert_gate.weight",
                                  f"{p}.shared_expert_gate.weight"))
        return out


__all__ = ["SUPPORTED_MODEL_TYPES", "hf_layout", "hf_shapes", "vllm_layout"]
