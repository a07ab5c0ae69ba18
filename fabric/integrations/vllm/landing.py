"""How a fetched version lands in a vLLM worker's parameters: straight in, or through vLLM.

Two ways, chosen once per engine rank (`choose`):

``direct``
    The rank's tensors in vLLM's layout (`fabric.relayout.engines.vllm_layout`: fused
    ``qkv_proj`` / ``gate_up_proj``, this rank's TP shard, padded vocabulary) are exactly
    the model's parameters: same names, shapes and dtypes, and the model is not quantised
    (quantised kernels repack or rescale what they load, so equal shapes do not mean the
    checkpoint's bytes). Each update copies the fetched tensors into the parameters in
    place (`DirectLanding`): their storage never moves, which CUDA graphs and prepacked
    kernels rely on. With ``in_place`` the parameters are attached to the fabric's store
    instead (they become views of its buffer: no copy, one less copy of the weights in
    memory; only for engines that capture no parameter addresses, see `attach_ok`).

``load_weights``
    Anything else (another architecture, a quantised model, kernels that repacked the
    weights, pipeline stages): the published Hugging Face tensors are handed to the
    model's own ``load_weights`` inside vLLM's layerwise reload (`LoaderLanding`), the
    way vLLM's checkpoint-format engines land theirs, so every model vLLM can load from a
    checkpoint works and post-processing (repacking, transposes) runs as at start-up.

Either way a landing starts only after the whole version is fetched and verified, so a
failed fetch leaves the engine's weights untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from weightfabric.fabric.errors import LayoutError, LayoutMismatchError
from weightfabric.fabric.relayout.engines import vllm_layout
from weightfabric.fabric.relayout.rules import EngineLayout, Published

log = logging.getLogger(__name__)

Mode = Literal["auto", "direct", "load_weights"]
MODES: tuple[str, ...] = ("auto", "direct", "load_weights")


@dataclass(frozen=True)
class Choice:
    """The landing chosen for one engine rank, and why."""

    mode: Literal["direct", "load_weights"]
    reason: str
    layout: EngineLayout | None = None
    """With ``direct``: vLLM's layout of the model for this engine."""
    rank: int = 0
    """With ``direct``: this worker's rank in ``layout``."""


def rank_specs(layout: EngineLayout, rank: int, dtype: torch.dtype
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of what ``rank`` holds in ``layout``, for the config's own sizes.

    The layout is bound to the Hugging Face shapes its config implies (`EngineLayout.expects`)
    stored in ``dtype``: what a version of that model looks like once published.
    """
    published = {n: Published(tuple(s), dtype) for n, s in layout.expects}
    return layout.bind(published, rank).tensor_specs()


def misfit(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
           params: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``params`` are not exactly the tensors ``specs`` describe (None: they are)."""
    missing = sorted(set(params) - set(specs))
    if missing:
        return f"the layout does not make {missing[0]!r} (and {len(missing) - 1} more)" \
            if len(missing) > 1 else f"the layout does not make {missing[0]!r}"
    extra = sorted(set(specs) - set(params))
    if extra:
        return f"the model has no parameter {extra[0]!r}"
    for name, (shape, dtype) in specs.items():
        p = params[name]
        if tuple(p.shape) != tuple(shape) or p.dtype != dtype:
            return (f"{name!r} is {tuple(p.shape)} {p.dtype} in the model, "
                    f"{tuple(shape)} {dtype} in the layout (repacked by its kernels?)")
    return None


def choose(mode: Mode, *, hf_config: Any, params: Mapping[str, torch.Tensor],
           dtype: torch.dtype, tp: int, tp_rank: int, quantization: str | None,
           pipeline: int = 1, ep: int = 1, ep_rank: int = 0,
           expert_parallel: bool = False) -> Choice:
    """Pick how versions land in this rank's ``params`` (module docstring).

    Args:
        mode: ``auto`` (direct where it is exact, else load_weights), ``direct`` (or
            `LayoutMismatchError`), ``load_weights``.
        hf_config: the model's Hugging Face config.
        params: the model's parameters by name, as vLLM holds them now.
        dtype: the model's dtype.
        tp, tp_rank: the engine's tensor-parallel size and this worker's rank in it.
        quantization: vLLM's quantisation method, or None.
        pipeline: the pipeline-parallel size (stages hold some layers only: load_weights).
        ep, ep_rank, expert_parallel: MoE engines sharing experts (`vllm_layout`).

    Raises:
        LayoutError: an unknown ``mode``.
        LayoutMismatchError: ``direct`` asked for, and the parameters are not the layout.
    """
    if mode not in MODES:
        raise LayoutError(f"load must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "load_weights":
        return Choice("load_weights", "asked for")
    why: str | None = None
    layout: EngineLayout | None = None
    if pipeline > 1:
        why = f"pipeline parallel ({pipeline} stages)"
    elif quantization is not None and mode == "auto":
        why = f"quantised ({quantization}): its kernels may change what they load"
    else:
        try:
            layout = vllm_layout(hf_config, tp=tp, ep=ep, dtype=dtype,
                                 expert_parallel=expert_parallel if ep > 1 else None)
            why = misfit(rank_specs(layout, ep_rank * tp + tp_rank, dtype), params)
        except LayoutError as exc:  # LayoutMismatchError included
            why = str(exc)
    if why is None:
        assert layout is not None
        return Choice("direct", "the parameters are vLLM's layout", layout, ep_rank * tp + tp_rank)
    if mode == "direct":
        raise LayoutMismatchError(f"load='direct': {why}; use load='auto' or 'load_weights'")
    return Choice("load_weights", why)


class DirectLanding:
    """Copy a fetched rank's tensors into the engine's parameters, in place."""

    mode = "direct"

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = dict(params)

    @torch.no_grad()
    def land(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy every parameter's new value from ``tensors`` (same names, shapes, dtypes)."""
        for name, param in self.params.items():
            src = tensors[name]
            if src.data_ptr() != param.data_ptr():  # attached: the parameter is the buffer
                param.data.copy_(src)


class LoaderLanding:
    """Hand published Hugging Face tensors to the model's ``load_weights`` (layerwise reload).

    Args:
        model: the vLLM model.
        model_config: vLLM's model config (the reload's post-processing reads it).
    """

    mode = "load_weights"

    def __init__(self, model: nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    def land(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Reload the model's weights from ``tensors`` (checkpoint names and layout)."""
        reload_with_vllm(self.model, self.model_config, tensors.items())


def reload_with_vllm(model: nn.Module, model_config: Any,
                     weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Reload through vLLM: its ``load_weights`` of ``weights``, then its post-processing.

    What vLLM's own checkpoint-format backends do between ``start_weight_update`` and
    ``finish_weight_update``, in one call.
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        with _no_mtp_check():
            load: Any = model.load_weights  # vLLM models define it; nn.Module does not
            load(weights)
    finally:
        finalize_layerwise_reload(model, model_config)


def _no_mtp_check() -> contextlib.AbstractContextManager[object]:
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:  # older vLLM
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in a local safetensors checkpoint (headers only).

    None when ``path`` is not a local folder of ``*.safetensors`` files (a hub id, say).
    """
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def check_against_checkpoint(published: Mapping[str, Published], aliases: Mapping[str, str],
                             checkpoint: Mapping[str, tuple[int, ...]], *, where: str) -> None:
    """Refuse a version whose tensors are not the engine's checkpoint's (before loading any).

    Every checkpoint tensor must be published (or be an alias of one), with the same
    shape; a published tensor the checkpoint lacks is refused too (``load_weights`` would
    fail on it halfway through).

    Raises:
        LayoutMismatchError: naming the first tensor that differs.
    """
    for name, shape in checkpoint.items():
        p = published.get(aliases.get(name, name))
        if p is None:
            raise LayoutMismatchError(f"{where}: the engine's checkpoint has {name!r}; the "
                                      "version does not (another model?)")
        if tuple(p.shape) != tuple(shape):
            raise LayoutMismatchError(f"{where}: {name!r} is {tuple(p.shape)} in the version, "
                                      f"{tuple(shape)} in the engine's checkpoint (another "
                                      "model's config?)")
    extra = sorted(set(published) - set(checkpoint))
    if extra:
        raise LayoutMismatchError(f"{where}: the version has {extra[0]!r}, which the engine's "
                                  "checkpoint lacks (another model?)")


Landing = DirectLanding | LoaderLanding

__all__ = ["MODES", "Choice", "DirectLanding", "Landing", "LoaderLanding", "Mode",
           "check_against_checkpoint", "checkpoint_shapes", "choose", "misfit",
           "reload_with_vllm", "rank_specs"]
