"""Publishing DTensors (FSDP2, `distribute_tensor`): each rank publishes its local shard.

A DTensor on a 1-D device mesh is published as what this rank holds: ``to_local()``
(a view, not a copy). ``Shard(d)`` makes it a slice of the logical tensor, described
by a `ShardedTensor` (dim, global shape and start, as DTensor itself cuts it:
``torch.chunk``, so the last ranks may hold fewer rows, or none); ``Replicate()``
makes it an ordinary tensor that every shard holds. Other placements (``Partial``,
strided shards) and meshes of more dimensions are refused.

The store publishing them must be this rank's shard of a model with one shard per
mesh rank: ``worker.model(name, shard=rank, num_shards=world)``.

torch.distributed is never imported here: a set can only hold DTensors once their
module is loaded, so a set is searched for them only then.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from weightfabric.fabric.errors import TensorSetError
from weightfabric.fabric.manifest import ShardedTensor

_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a `torch.distributed.tensor.DTensor`."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def local_shards(tensors: dict[str, torch.Tensor], *, model: str, shard: int,
                 num_shards: int) -> tuple[dict[str, torch.Tensor], tuple[ShardedTensor, ...]]:
    """The tensors this rank publishes, and which of them are slices of larger ones.

    Args:
        tensors: name -> tensor; plain tensors pass through unchanged.
        model, shard, num_shards: the store's model name and its shard of how many.

    Returns:
        name -> tensor with each DTensor replaced by its local tensor (a detached view),
        in the same order, and a `ShardedTensor` per ``Shard(d)`` DTensor.

    Raises:
        TensorSetError: a DTensor on a mesh of more than one dimension, with a placement
            other than ``Shard(d)`` or ``Replicate()``, or on a mesh whose size or this
            rank's coordinate differ from ``num_shards`` and ``shard``.
    """
    if not any(is_dtensor(t) for t in tensors.values()):
        return tensors, ()
    out: dict[str, torch.Tensor] = {}
    sharding: list[ShardedTensor] = []
    for name, t in tensors.items():
        if not is_dtensor(t):
            out[name] = t
            continue
        out[name], sliced = _local_shard(name, t, model=model, shard=shard, num_shards=num_shards)
        if sliced is not None:
            sharding.append(sliced)
    return out, tuple(sharding)


def _local_shard(name: str, t: Any, *, model: str, shard: int, num_shards: int
                 ) -> tuple[torch.Tensor, ShardedTensor | None]:
    """One DTensor's local tensor and, for ``Shard(d)``, the slice it is."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    if mesh.ndim != 1:
        raise TensorSetError(
            f"tensor {name!r} is a DTensor on a {mesh.ndim}-D device mesh of shape "
            f"{tuple(mesh.shape)} with placements {placements}; only DTensors on a 1-D mesh "
            "(FSDP2 without other parallelism, or one mesh dimension) can be published: "
            "publish the full tensors (full_tensor()) or one mesh dimension's shards")
    placement = placements[0]
    if type(placement) is not Shard and not isinstance(placement, Replicate):
        raise TensorSetError(
            f"tensor {name!r} is a DTensor with placements {placements}; only Shard(dim) and "
            "Replicate() can be published (reduce a Partial one first, e.g. "
            "redistribute(placements=[Replicate()]))")
    rank = mesh.get_coordinate()
    world = mesh.size()
    if rank is None or (world, rank[0]) != (num_shards, shard):
        where = "is not in its mesh" if rank is None else f"is rank {rank[0]} of it"
        raise TensorSetError(
            f"tensor {name!r} is a DTensor sharded over a mesh of {world} ranks, and this "
            f"process {where}; the store of model {model!r} is shard {shard} of {num_shards}. "
            f"Open it as worker.model(name, shard=rank, num_shards=world): here "
            f"worker.model({model!r}, shard={rank[0] if rank else 'rank'}, num_shards={world})")
    with torch.no_grad():
        local = t.to_local().detach()
    if isinstance(placement, Replicate):
        return local, None
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise TensorSetError(f"tensor {name!r}: its local tensor has shape {tuple(local.shape)}, "
                             f"but {placements} of {tuple(t.shape)} on {world} ranks gives rank "
                             f"{shard} the shape {tuple(shape)} (a padded or uneven local "
                             "tensor this fabric does not describe)")
    dim = placement.dim % t.ndim
    return local, ShardedTensor(name, dim, tuple(t.shape), int(offset[dim]))


__all__ = ["is_dtensor", "local_shards"]
