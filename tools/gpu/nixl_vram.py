"""VRAM -> VRAM NIXL READs between two processes on one GPU, against ``copy_`` (issue 25).

Run on a GPU machine with the ``rdma`` extra: ``python tools/gpu/nixl_vram.py [GiB]``.
A holder process registers a GPU tensor with its NIXL agent; a reader process
registers one of its own and READs the holder's whole tensor, three times; each READ
is checked bit for bit. Prints one JSON line: the device, GB/s of each READ, GB/s of a
same-GPU ``copy_`` of the same bytes, and whether every READ was exact.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time


def holder(queue: mp.Queue, done: mp.Queue, nbytes: int) -> None:
    """Register ``nbytes`` of VRAM and hand the reader what it needs; wait for ``done``."""
    import torch

    from weightfabric.fabric.transports.nixl import nixl_api

    api = nixl_api()
    agent = api.nixl_agent("vram-holder", api.nixl_agent_config(backends=["UCX"]))
    data = torch.arange(nbytes // 8, dtype=torch.int64, device="cuda").mul_(7).view(torch.uint8)
    agent.register_memory(data)
    queue.put((agent.get_agent_metadata(), data.data_ptr(), nbytes))
    done.get()


def reader(queue: mp.Queue, out: mp.Queue, nbytes: int) -> None:
    """READ the holder's VRAM three times, check it, time ``copy_``; the result to ``out``."""
    import torch

    from weightfabric.fabric.transports.nixl import nixl_api

    api = nixl_api()
    meta, addr, size = queue.get()
    agent = api.nixl_agent("vram-reader", api.nixl_agent_config(backends=["UCX"]))
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    agent.register_memory(dst)
    peer = agent.add_remote_agent(meta)
    want = torch.arange(nbytes // 8, dtype=torch.int64, device="cuda").mul_(7).view(torch.uint8)
    reads, exact = [], True
    for _ in range(3):
        dst.zero_()
        torch.cuda.synchronize()
        local = agent.get_xfer_descs(dst)
        remote = agent.get_xfer_descs([(addr, size, 0)], "VRAM")
        start = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        exact = exact and state == "DONE" and bool(torch.equal(dst, want))
        reads.append(nbytes / seconds / 1e9)
    copy = torch.empty_like(dst)
    copy.copy_(want)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        copy.copy_(want)
    torch.cuda.synchronize()
    out.put({"device": torch.cuda.get_device_name(), "bytes": nbytes, "read_gbps": reads,
             "copy_gbps": 3 * nbytes / (time.perf_counter() - start) / 1e9, "exact": exact})


def main() -> int:
    """Both processes on this GPU; prints the JSON line, exits 1 unless every READ was exact."""
    nbytes = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 1 << 30
    ctx = mp.get_context("spawn")
    queue, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=holder, args=(queue, done, nbytes)),
             ctx.Process(target=reader, args=(queue, out, nbytes))]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        done.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print(json.dumps(result))
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
