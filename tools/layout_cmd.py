"""`fabric layout`: what one engine rank holds in a ready-made layout, for a model config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from weightfabric.tools.command import EXIT_OK, BadInput, Console, add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric layout`."""
    from weightfabric.fabric.errors import LayoutError, LayoutMismatchError

    p = add_command(
        subparsers, "layout", help="the tensors a vLLM worker holds for a Hugging Face config",
        handler=_layout, bad_input=(BadInput, LayoutError, LayoutMismatchError),
        description="Read a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE,\n"
                    "Qwen3-MoE) and print, for one rank of vLLM's layout at the given\n"
                    "tensor/expert parallelism, every target tensor: its name, shape, dtype and\n"
                    "the published tensors it is made of (wf.vllm_layout, bound to the shapes\n"
                    "the config implies). Nothing is loaded or moved; use it to compare with\n"
                    "the engine's own parameters before wiring `worker.layout_model`.\n"
                    "Exits 2 when the config cannot be laid out so (the reason is printed).",
        examples=["fabric layout --config Qwen3-8B/config.json --tp 2 --rank 1",
                  "fabric layout --config config.json --tp 4 --fp8-block 128 --json"])
    p.add_argument("--config", required=True, help="path of a Hugging Face config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="data-parallel engines sharing the MoE layers (default 1)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="vLLM's --enable-expert-parallel: whole experts per worker")
    p.add_argument("--rank", type=int, default=0, help="the worker's rank, ep_rank * tp + tp_rank")
    p.add_argument("--dtype", default=None, help="cast every target, e.g. bfloat16")
    p.add_argument("--fp8-block", type=int, default=None,
                   help="quantise the linear weights to fp8 in blocks of this edge (e.g. 128)")
    p.add_argument("--published-dtype", default="bfloat16",
                   help="dtype the trainer publishes in (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _dtype(name: str | None) -> Any:
    from weightfabric.fabric.tensorset import dtype_from_name

    if name is None:
        return None
    dtype = dtype_from_name(name)
    if dtype is None:
        raise BadInput(f"unknown dtype {name!r} (e.g. bfloat16, float16, float32)")
    return dtype


def describe(config: dict[str, Any], *, tp: int, ep: int, expert_parallel: bool, rank: int,
             dtype: str | None, fp8_block: int | None,
             published_dtype: str = "bfloat16") -> dict[str, Any]:
    """The JSON result: the layout's name and key, and rank ``rank``'s target tensors.

    Raises:
        LayoutError, LayoutMismatchError: the config cannot be laid out so.
        BadInput: an unknown dtype.
    """
    from weightfabric.fabric.relayout.engines import vllm_layout
    from weightfabric.fabric.relayout.rules import Published

    layout = vllm_layout(config, tp=tp, ep=ep, dtype=_dtype(dtype), fp8_block=fp8_block,
                         expert_parallel=expert_parallel or None)
    stored = _dtype(published_dtype)
    bound = layout.bind({n: Published(s, stored) for n, s in layout.expects}, rank)
    targets = []
    for t in bound.targets:
        sources = sorted({p.source for p in t.pieces})
        targets.append({"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype)[6:],
                        "sources": sources})
        if t.scale is not None:
            targets.append({"name": t.scale[0], "shape": list(t.scale[1]), "dtype": "float32",
                            "sources": sources})
    nbytes = sum(_nbytes(t) for t in targets)
    return {"layout": layout.name, "key": layout.key, "ranks": layout.ranks, "rank": rank,
            "tensors": targets, "bytes": nbytes}


def _nbytes(t: dict[str, Any]) -> int:
    n = 1
    for d in t["shape"]:
        n *= d
    return n * _dtype(t["dtype"]).itemsize


def _after_shared_prefix(name: str, other: str) -> str:
    """``name`` without the dotted components it shares with ``other`` at the front."""
    parts, theirs = name.split("."), other.split(".")
    k = 0
    while k < min(len(parts), len(theirs)) - 1 and parts[k] == theirs[k]:
        k += 1
    return ".".join(parts[k:])


def _layout(args: argparse.Namespace) -> int:
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise BadInput(f"{path} is not a config (a JSON object)")
    result = describe(config, tp=args.tp, ep=args.ep, expert_parallel=args.expert_parallel,
                      rank=args.rank, dtype=args.dtype, fp8_block=args.fp8_block,
                      published_dtype=args.published_dtype)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    from rich.table import Table

    table = Table(title=f"{result['layout']} rank {result['rank']} of {result['ranks']}: "
                        f"{len(result['tensors'])} tensors, {result['bytes'] / 1e6:.1f} MB "
                        f"(derived replicas: <model>@{result['key']}.r{result['rank']})")
    for column in ("tensor", "shape", "dtype", "from"):
        table.add_column(column, overflow="fold")
    for t in result["tensors"]:
        short = [_after_shared_prefix(src, t["name"]) for src in t["sources"]]
        shown = ", ".join(short[:3]) + (f" (+{len(short) - 3})" if len(short) > 3 else "")
        table.add_row(t["name"], str(tuple(t["shape"])), t["dtype"], shown)
    Console().print(table)
    return EXIT_OK
