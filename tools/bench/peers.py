"""Peers `fabric bench e2e` compares with: Ray and NIXL where installed, CUDA IPC on a GPU.

Each is driven like the fabric: a trainer process makes the next version of
`agent.bench_tensors` (adding 1 to every byte), readers take it; the time runs from
the trainer's "ready" (just before its put) to the last reader holding the tensors,
and every reader's sha256 is compared with the trainer's (untimed).

- ``ray-put-get``: the trainer puts its dict of torch tensors (``ray.put``); readers
  ``ray.get`` it (Ray pickles torch tensors: copied out of the object store).
- ``ray-zero-copy``: the trainer puts the tensors as numpy byte arrays, which Ray
  maps zero-copy into each reader; readers view them as torch tensors
  (``torch.from_numpy``), read-only memory in the object store, checked by nothing.
- ``nixl-read`` (`NixlPeer`, run in `agent` processes): readers READ the trainer's
  registered tensors with NIXL over UCX, nothing packed or checked: the floor of a
  one-sided engine.
- ``ipc-per-tensor`` (`IpcPeer`, in `agent` processes, ``--device cuda``): vLLM's CUDA IPC
  weight transfer (``vllm.distributed.weight_transfer.ipc_engine``, unpacked): per
  version the trainer exports one IPC handle per tensor
  (``torch.multiprocessing.reductions.reduce_tensor``) and sends them, pickled, to every
  reader; a reader rebuilds each tensor (``rebuild_cuda_tensor``) and ``copy_``s it into
  its own, as ``load_weights`` does, then synchronizes and acknowledges. The rebuilt
  tensors are dropped after the copy, as vLLM's are after ``load_weights`` (torch keeps
  a mapping only while a tensor over it lives, so a later version may map the
  allocations again). Nothing in the transfer checks the bytes.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from weightfabric.tools.bench.agent import bench_tensors, digest, own_tensors


class RayTrainer:
    """The trainer's side: makes versions and puts them into the object store."""

    def __init__(self, size: int, seed: int) -> None:
        self.tensors = own_tensors(bench_tensors(size, seed))  # pickling a view sends its base
        self.calls = 0

    def layout(self) -> dict[str, tuple[list[int], str]]:
        """Name -> (shape, dtype name), for readers viewing byte arrays."""
        return {n: (list(t.shape), str(t.dtype).removeprefix("torch."))
                for n, t in self.tensors.items()}

    def put(self, zero_copy: bool) -> tuple[list[Any], float, str, int]:
        """The next version: ([its ObjectRef], start time, sha256, bytes)."""
        import ray

        if self.calls:
            for t in self.tensors.values():
                t.reshape(-1).view(torch.uint8).add_(1)
        self.calls += 1
        start = time.time()
        payload: dict[str, Any] = (
            {n: t.reshape(-1).view(torch.uint8).numpy() for n, t in self.tensors.items()}
            if zero_copy else self.tensors)
        ref = ray.put(payload)
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return [ref], start, digest(self.tensors), nbytes


class RayReader:
    """A reader's side: gets a version and keeps it (as an engine would hold weights)."""

    def __init__(self, layout: dict[str, tuple[list[int], str]]) -> None:
        self.layout = layout
        self.held: dict[str, torch.Tensor] = {}

    def ready(self) -> bool:
        """True once the actor runs."""
        return True

    def get(self, refs: list[Any], zero_copy: bool) -> tuple[float, str]:
        """Take the version; returns (end time, sha256 of what is held)."""
        import ray

        got = ray.get(refs[0])
        if zero_copy:
            with warnings.catch_warnings():  # object-store memory is read-only: never written
                warnings.simplefilter("ignore", UserWarning)
                self.held = {n: torch.from_numpy(a).view(getattr(torch, self.layout[n][1]))
                             .view(self.layout[n][0]) for n, a in got.items()}
        else:
            self.held = got
        end = time.time()
        return end, digest(self.held)


def ray_e2e(readers: int, size: int, versions: int, *, zero_copy: bool,
            seed: int, step_s: float = 0.0) -> dict[str, Any]:
    """Seconds per version of the Ray system, its bytes and whether every reader matched.

    ``step_s``: seconds slept between versions (an RL step's work), untimed.
    """
    import ray

    ray.init(num_cpus=readers + 1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        trainer: Any = ray.remote(RayTrainer).remote(size, seed)  # actor handles: untyped
        layout = ray.get(trainer.layout.remote())
        reader_actors: list[Any] = [ray.remote(RayReader).remote(layout) for _ in range(readers)]
        ray.get([r.ready.remote() for r in reader_actors])
        seconds, verified, nbytes = [], True, size
        for v in range(versions):
            if v:
                time.sleep(step_s)
            refs, start, want, nbytes = ray.get(trainer.put.remote(zero_copy))
            done = ray.get([r.get.remote(refs, zero_copy) for r in reader_actors])
            seconds.append(max(end for end, _ in done) - start)
            verified &= all(sha == want for _, sha in done)
    finally:
        ray.shutdown()
    return {"seconds": seconds, "verified": verified, "bytes": nbytes}


class NixlPeer:
    """One process of the raw NIXL READ baseline (``nixl-read``): the engine floor.

    The trainer registers its tensors with a NIXL agent (UCX backend) and hands out its
    agent metadata and descriptors; each reader registers tensors of the same sizes,
    adds the trainer as a remote agent and, per version, READs every tensor in one
    transfer. Nothing is packed or checksummed; readers all read from the trainer.
    """

    def __init__(self, name: str) -> None:
        from nixl_cu13._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.remote = ""
        self.local_descs: Any = None
        self.remote_descs: Any = None

    def serve(self, size: int, seed: int) -> dict[str, Any]:
        """Trainer: register the tensors; returns what readers need (base64)."""
        import base64

        self.tensors = own_tensors(bench_tensors(size, seed))
        self.agent.register_memory(list(self._views()))
        descs = self.agent.get_xfer_descs(list(self._views()))
        return {"meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "descs": base64.b64encode(self.agent.get_serialized_descs(descs)).decode(),
                "sizes": {n: t.numel() * t.element_size() for n, t in self.tensors.items()},
                "layout": {n: (list(t.shape), str(t.dtype).removeprefix("torch."))
                           for n, t in self.tensors.items()}}

    def bump(self) -> dict[str, Any]:
        """Trainer: the next version in place; returns its start time and sha256."""
        if self.calls:
            for view in self._views():
                view.add_(1)
        self.calls += 1
        return {"start": time.time(), "sha256": digest(self.tensors)}

    def read(self, served: dict[str, Any]) -> dict[str, Any]:
        """Reader: READ every tensor of the trainer's current version; end time and sha256."""
        import base64

        if not self.tensors:  # first call: register as much memory and connect
            self.tensors = {n: torch.empty(shape, dtype=getattr(torch, dtype))
                            for n, (shape, dtype) in served["layout"].items()}
            self.agent.register_memory(list(self._views()))
            self.remote = self.agent.add_remote_agent(base64.b64decode(served["meta"]))
            self.local_descs = self.agent.get_xfer_descs(list(self._views()))
            self.remote_descs = self.agent.deserialize_descs(base64.b64decode(served["descs"]))
        handle = self.agent.initialize_xfer("READ", self.local_descs, self.remote_descs,
                                            self.remote, b"")
        try:
            state = self.agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("NIXL READ failed")
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)
        return {"end": time.time(), "sha256": digest(self.tensors)}

    def _views(self) -> list[torch.Tensor]:
        return [t.reshape(-1).view(torch.uint8) for t in self.tensors.values()]


class IpcPeer:
    """One process of the ``ipc-per-tensor`` baseline: vLLM's CUDA IPC weight transfer.

    The trainer holds `agent.bench_tensors` on its GPU, one allocation per tensor as a
    model's parameters; a reader holds tensors of the same shapes on its own GPU (its
    engine's weights). Each reader opens the handles on the GPU the trainer's memory is
    on (the same index in every process: they share ``CUDA_VISIBLE_DEVICES``), so with
    readers on other GPUs the ``copy_`` crosses GPUs (vLLM colocates them instead).
    """

    def __init__(self, size: int, seed: int, device: str, *, trainer: bool) -> None:
        self.device = torch.device(device)
        source = bench_tensors(size, seed)
        self.tensors = ({n: t.to(self.device) for n, t in source.items()} if trainer else
                        {n: torch.empty(t.shape, dtype=t.dtype, device=self.device)
                         for n, t in source.items()})
        self.calls = 0
        torch.cuda.synchronize(self.device)

    def export(self) -> dict[str, Any]:
        """Trainer: the next version (untimed), then its handles (timed: ``start``, ``end``).

        Returns ``start``, ``end``, ``bytes`` and ``handles``: base64 of the pickled
        ``{name: reduce_tensor args}``, as vLLM's HTTP transport sends them.
        """
        import base64
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        if self.calls:
            torch.cuda.ipc_collect()  # what vLLM's trainer does after each send
            for t in self.tensors.values():
                t.reshape(-1).view(torch.uint8).add_(1)
        self.calls += 1
        torch.cuda.synchronize(self.device)
        start = time.time()
        handles = {n: reduce_tensor(t.detach())[1] for n, t in self.tensors.items()}
        blob = base64.b64encode(pickle.dumps(handles)).decode()
        end = time.time()
        return {"start": start, "end": end, "handles": blob,
                "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values())}

    def load(self, blob: str) -> dict[str, Any]:
        """Reader: rebuild each tensor and copy it into this process's own (``start``, ``end``)."""
        import base64
        import pickle

        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        start = time.time()
        handles = pickle.loads(base64.b64decode(blob))  # noqa: S301 (our own trainer's)
        for name, args in handles.items():
            self.tensors[name].copy_(rebuild_cuda_tensor(*args))
        torch.cuda.synchronize(self.device)
        end = time.time()
        return {"start": start, "end": end}
