"""What users have today, measured on this machine, for benchmarks to stand beside.

- `memcpy_gbps`: one process copying the bytes (`torch` ``copy_``) in host memory or
  on one GPU, the local limit.
- `gloo_broadcast_gbps`: ``torch.distributed`` gloo broadcast of the same tensors
  from one process to N readers, what RL frameworks do without a fabric.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def memcpy_gbps(nbytes: int, *, device: str = "cpu", repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s (bytes copied / s) of copying `nbytes` between two buffers.

    The buffers are on `device`: host memory, or device-to-device on one GPU.
    """
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in, warm the GPU up
    sync = torch.cuda.synchronize if src.device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _broadcast_worker(rank: int, world: int, store_path: str, tensor_bytes: list[int],
                      results: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        tensors = [torch.full((n,), rank == 0, dtype=torch.uint8) for n in tensor_bytes]
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        elapsed = time.perf_counter() - start
        if rank != 0:
            results[rank] = (elapsed, all(bool(t.all()) for t in tensors))
    finally:
        dist.destroy_process_group()


def gloo_broadcast_gbps(tensor_bytes: list[int], readers: int, *, timeout: float = 300) -> float:
    """Aggregate GB/s of a gloo broadcast from rank 0 to `readers` processes.

    GB/s: bytes delivered to all readers / slowest reader's time, for tensors of the
    given sizes.

    Raises:
        RuntimeError: a process failed, or a reader did not receive the right bytes.
    """
    world = readers + 1
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            results = manager.dict()
            procs = [ctx.Process(target=_broadcast_worker,
                                 args=(r, world, os.path.join(tmp, "store"), tensor_bytes, results))
                     for r in range(world)]
            for p in procs:
                p.start()
            try:
                deadline = time.monotonic() + timeout
                for p in procs:
                    p.join(max(0.0, deadline - time.monotonic()))
                if any(p.exitcode != 0 for p in procs):
                    raise RuntimeError(f"gloo broadcast failed: exit codes "
                                       f"{[p.exitcode for p in procs]}")
                outcome = dict(results)
            finally:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join()
    if len(outcome) != readers or not all(ok for _, ok in outcome.values()):
        raise RuntimeError("gloo broadcast delivered wrong bytes")
    slowest = max(elapsed for elapsed, _ in outcome.values())
    return readers * sum(tensor_bytes) / slowest / 1e9
