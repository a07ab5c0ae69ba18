"""GPU-only parts of `fabric bench fetch --device cuda`.

`nvshmem_reads`: one NVSHMEM job of ``pes`` processes on GPU 0, bootstrapped
through a hub's key-value store (`fabric.gpu.HubRendezvous`). PE 0 fills a
symmetric region, marks its progress flags and exposes it on a `ReadServer`;
every other PE (PE 0 itself when it is alone) reads the whole region chunk by
chunk with `NvshmemTransport` (flags, lease, ``get_nbi``, ``quiet``) into its own
symmetric region, checks the bytes, and times a torch ``copy_`` of the same
bytes on the same GPU for the ratio. Several PEs on one GPU need an MPS daemon.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any

import torch

HOLDER_KEY = "{session}/holder"
DONE_KEY = "{session}/done/{rank}"


def pattern(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """Deterministic bytes every PE can regenerate (``nbytes`` a multiple of 8)."""
    i = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    return (i * 0x5851F42D4C957F2D + 12345).view(torch.uint8)


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _pe_main(url: str, session: str, rank: int, pes: int, size: int, chunk: int,
             out: mp.Queue) -> None:
    import msgpack

    import fabric
    from fabric.gpu import HubRendezvous, NvshmemRuntime, SymmetricProgress
    from fabric.transports import ReadServer, SourceAddress
    from fabric.transports.nvshmem import NvshmemTransport, nvshmem_descriptor

    client = fabric.connect(url)
    server = transport = None
    rt = NvshmemRuntime.start(HubRendezvous(client), session=session, rank=rank, nranks=pes,
                              local_rank=0)
    try:
        src = rt.allocate_region("bench-src", size, chunk)  # collective, same order everywhere
        dst = rt.allocate_region("bench-dst", size, chunk)
        if rank == 0:
            src.data.copy_(pattern(size, src.data.device))
            progress = SymmetricProgress(src)
            for c in range(src.num_chunks):
                progress.mark(c)
            server = ReadServer()
            server.expose("bench", src.data, chunk_size=chunk, progress=progress,
                          gpu=nvshmem_descriptor(rt, src))
            client.kv_put(HOLDER_KEY.format(session=session), msgpack.packb(server.address.to_dict()))
        if rank > 0 or pes == 1:
            holder = SourceAddress.from_dict(msgpack.unpackb(
                client.kv_get(HOLDER_KEY.format(session=session), timeout=120)))
            transport = NvshmemTransport(rt)
            transport.read(holder, "bench", 0, dst.data[:chunk], timeout=60)  # warm up
            start = time.perf_counter()
            for lo in range(0, size, chunk):
                transport.read(holder, "bench", lo, dst.data[lo:min(lo + chunk, size)], timeout=60)
            seconds = time.perf_counter() - start
            verified = bool(torch.equal(dst.data, pattern(size, dst.data.device)))
            copy_s = _copy_seconds(src.data, dst.data)
            out.put({"rank": rank, "seconds": seconds, "gbps": size / seconds / 1e9,
                     "copy_gbps": size / copy_s / 1e9, "verified": verified})
            client.kv_put(DONE_KEY.format(session=session, rank=rank), b"1")
        if rank == 0:  # keep serving until every reader is done
            for r in range(1, pes):
                client.kv_get(DONE_KEY.format(session=session, rank=r), timeout=600)
    except Exception:
        out.put({"rank": rank, "error": traceback.format_exc()[-3000:]})
        raise
    finally:
        if transport is not None:
            transport.close()
        if server is not None:
            server.close()
        rt.close()
        client.close()


def nvshmem_reads(*, pes: int, size: int, chunk_size: int, timeout: float = 600) -> dict[str, Any]:
    """Run the NVSHMEM read test; returns per-reader GB/s, the copy figure, bit-exactness.

    A PE that fails is reported under ``errors`` (``verified`` is then False), so a
    run on a machine where, say, two PEs cannot share the GPU still says why.
    """
    import fabric

    if pes < 1:
        raise ValueError(f"pes must be >= 1, got {pes}")
    size -= size % 8
    session = f"bench-{time.time_ns()}"
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with fabric.serve("tcp://127.0.0.1:0") as hub:
        procs = [ctx.Process(target=_pe_main, args=(hub.url, session, r, pes, size, chunk_size,
                                                    results)) for r in range(pes)]
        for p in procs:
            p.start()
        readers = max(1, pes - 1)
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        try:
            while len([g for g in got if "error" not in g]) < readers and \
                    not any("error" in g for g in got):
                left = deadline - time.monotonic()
                if left <= 0 or not any(p.is_alive() for p in procs) and results.empty():
                    break
                try:
                    got.append(results.get(timeout=min(left, 1.0)))
                except queue.Empty:
                    continue
            if any("error" in g for g in got):  # peers may wait in a collective forever
                deadline = min(deadline, time.monotonic() + 15)
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    ok = [g for g in got if "error" not in g]
    errors = [g for g in got if "error" in g]
    if len(ok) < readers and not errors:
        errors.append({"rank": None, "error": f"no result within {timeout:g} s; exit codes "
                                              f"{[p.exitcode for p in procs]}"})
    return {"pes": pes, "bytes": size, "chunk_size": chunk_size,
            "per_reader_gbps": [g["gbps"] for g in sorted(ok, key=lambda g: g["rank"])],
            "copy_gbps": [g["copy_gbps"] for g in ok],
            "verified": bool(ok) and not errors and all(g["verified"] for g in ok),
            "errors": errors}
