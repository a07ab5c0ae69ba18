"""An FSDP2 trainer rank in its own process: the ``fsdp-trainer`` role of `procs`.

Usage: ``procs.Child("fsdp-trainer", HUB_URL, RANK, WORLD, INIT_FILE, wait=False)``
for each rank (they meet in ``init_process_group("gloo", init_method="file://INIT_FILE")``
before replying ready), or ``python tests/procs.py fsdp-trainer ...``.

The rank builds `fsdp_model` (the same seed on every rank), shards it with
``fully_shard`` on a 1-D CPU mesh, takes one SGD step, joins the hub as
``fsdp-RANK`` and replies ``{"ready": true}``. Commands:

- ``{"op": "publish", "model": M, "group": G}`` -> ``{"version": V, "local": {name:
  [shape, values]}, "full": {name: [shape, values]}, "no_copy": bool}``: publishes the
  module to ``worker.model(M, shard=RANK, num_shards=WORLD)``; ``local`` is each
  DTensor's local shard, ``full`` its ``full_tensor()`` (a collective: send ``publish``
  to every rank before reading the replies); ``no_copy``: the store's staging did not
  copy the local shards (each is its DTensor's own local tensor).
- ``{"op": "exit"}``: the worker closes (its versions go with it), the group ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import weightfabric as wf
from weightfabric.fabric.dtensors import local_shards

Commands = Iterator[dict[str, Any]]
Reply = Callable[[dict[str, Any]], None]


def fsdp_model() -> nn.Module:
    """A small model with uneven dim-0 sizes: 7 rows and 1 row over 2 ranks (4+3, 1+0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 1))


def _plain(t: torch.Tensor) -> list[Any]:
    return [list(t.shape), t.detach().reshape(-1).tolist()]


def role(args: list[str], commands: Commands, reply: Reply) -> None:
    """Run one FSDP2 rank (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    url, rank, world, init_file = args[0], int(args[1]), int(args[2]), args[3]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = fsdp_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        with wf.join(url, worker=f"fsdp-{rank}", timeout=10) as worker:
            reply({"ready": True})
            for cmd in commands:
                if cmd["op"] != "publish":
                    reply({"error": "ValueError", "message": f"unknown op {cmd['op']!r}"})
                    continue
                store = worker.model(cmd["model"], shard=rank, num_shards=world,
                                     chunk_size=1 << 12)
                version = store.publish(model, group=cmd["group"])
                state = model.state_dict()
                staged, _ = local_shards(dict(state), model=cmd["model"], shard=rank,
                                         num_shards=world)
                reply({"version": version,
                       "local": {n: _plain(t.to_local()) for n, t in state.items()},
                       "full": {n: _plain(t.full_tensor()) for n, t in state.items()},
                       "no_copy": all(staged[n].untyped_storage().data_ptr()
                                      == t._local_tensor.untyped_storage().data_ptr()
                                      for n, t in state.items())})
    finally:
        dist.destroy_process_group()
