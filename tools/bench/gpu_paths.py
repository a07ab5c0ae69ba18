"""GPU parts of `fabric bench fetch --device cuda`.

`reshard_reads`: the receive-path transforms on one device. One Llama-70B-shaped
layer (fused QKV with GQA, o, gate-up, down) held at TP2 in two source regions is
read by a TP1 reader, stored as bf16 and as blockwise fp8 (dequantised to bf16):
through a bounded staging buffer (`fabric.relayout.staging.run_staging`) and straight from
the regions (`fabric.relayout.direct.run_direct`), beside a ``copy_`` of the same
destination bytes (what a layout-matched fetch would move). GB/s count
destination bytes. It also runs on CPU, scaled down, which is how it is tested.

`nvshmem_reads`: one NVSHMEM job of ``pes`` processes on GPU 0, bootstrapped
through a hub's key-value store (`fabric.gpu.HubRendezvous`). PE 0 fills a
symmetric region, marks its progress flags and exposes it on a `ReadServer`;
every other PE (PE 0 itself when it is alone) reads the whole region chunk by
chunk with `NvshmemTransport` (lease, ``get_nbi``, ``quiet``) into its own
symmetric region, checks the bytes, and times a torch ``copy_`` of the same
bytes on the same GPU for the ratio. Several PEs on one GPU need an MPS daemon.

`nvshmem_store_fetch`: the same job through the library's API: every PE joins
the hub with its runtime and opens a symmetric model store (``worker.model(...,
symmetric=True)``); PE 0 publishes its weights in place, the others fetch two
versions (`ModelStore.fetch`, which reads over `NvshmemTransport` from whichever
PE the hub names) and report the second, warm, fetch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from weightfabric.fabric.relayout.staging import (
    FP8,
    HeldTensor,
    WantedTensor,
    plan_staging,
    run_staging,
)
from weightfabric.kernels import FusedGateUp, FusedQKV, Layout, Sharded, quantize_fp8, split_tensor
from weightfabric.tools.bench.kernels import median_seconds

HOLDER_KEY = "{session}/holder"
DONE_KEY = "{session}/done/{rank}"
VERSION_KEY = "{session}/version/{round}"
ROUND_DONE_KEY = "{session}/round/{round}/done/{rank}"
TEARDOWN_S = 60.0
"""How long PEs get to free their buffers and finalize after the last result."""


def pattern(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """Deterministic bytes every PE can regenerate (``nbytes`` a multiple of 8)."""
    i = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    return (i * 0x5851F42D4C957F2D + 12345).view(torch.uint8)


def _pe_main(url: str, session: str, rank: int, pes: int, size: int, chunk: int,
             out: mp.Queue) -> None:
    import msgpack

    import weightfabric as wf
    from weightfabric.fabric.gpu import HubRendezvous, NvshmemRuntime, SymmetricProgress
    from weightfabric.fabric.transports import ReadServer, SourceAddress
    from weightfabric.fabric.transports.nvshmem import NvshmemTransport, nvshmem_descriptor

    client = wf.connect(url)
    server = transport = rt = None
    try:
        rt = NvshmemRuntime.start(HubRendezvous(client), session=session, rank=rank, nranks=pes,
                                  local_rank=0)
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
            copy_s = median_seconds(lambda: dst.data.copy_(src.data), dst.data.device, 3)
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
        if rt is not None:
            rt.close()
        client.close()


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment, except names already set (what spawned children inherit)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def pe_environment(pes: int, heap: int) -> dict[str, str]:
    """What each PE of a job of ``pes`` processes on one GPU needs in its environment.

    NVSHMEM gives PEs that share a GPU its full API (stream barriers included) only
    under MPS with their ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` summing to at most
    100; otherwise "limited MPG" refuses such calls. ``NVSHMEM_SYMMETRIC_SIZE`` covers
    ``heap`` bytes (the default 1 GiB is all there is when NVSHMEM falls back from
    VMM to a static heap).
    """
    env = {"NVSHMEM_SYMMETRIC_SIZE": str(heap + (256 << 20))}
    if pes > 1:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // pes)
    return env


def _run_pes(target: Callable[..., None], args: tuple[Any, ...], *, pes: int, readers: int,
             heap: int, timeout: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start ``pes`` spawned processes on one hub and collect their results.

    Each runs ``target(hub_url, session, rank, pes, *args, queue)`` with
    `pe_environment` for ``heap`` symmetric bytes; collect ``readers`` results (or the first error) within ``timeout``; returns (results by
    rank, errors). Processes still alive at the end are killed; when every result
    came, a PE that did not exit cleanly (a teardown that hung or crashed) is an error.
    """
    import weightfabric as wf
    session = f"bench-{time.time_ns()}"
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with wf.serve("tcp://127.0.0.1:0") as hub:
        procs = [ctx.Process(target=target, args=(hub.url, session, r, pes, *args, results))
                 for r in range(pes)]
        with _environ(pe_environment(pes, heap)):
            for p in procs:
                p.start()
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
            # peers of a failed PE may wait in a collective forever; others tear down
            deadline = min(deadline, time.monotonic() + (
                15 if any("error" in g for g in got) else TEARDOWN_S))
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    ok = sorted((g for g in got if "error" not in g), key=lambda g: g["rank"])
    errors = [g for g in got if "error" in g]
    if len(ok) < readers and not errors:
        errors.append({"rank": None, "error": f"no result within {timeout:g} s; exit codes "
                                              f"{[p.exitcode for p in procs]}"})
    if not errors:  # the results came, but a PE's teardown (collective frees, finalize) failed
        errors = [{"rank": r, "error": f"PE {r} exited with code {p.exitcode}"
                                       + (" (killed at the deadline)" if p.exitcode == -9 else "")}
                  for r, p in enumerate(procs) if p.exitcode != 0]
    return ok, errors


def nvshmem_reads(*, pes: int, size: int, chunk_size: int, timeout: float = 600) -> dict[str, Any]:
    """Run the NVSHMEM read test; returns per-reader GB/s, the copy figure, bit-exactness.

    A PE that fails is reported under ``errors`` (``verified`` is then False), so a
    run on a machine where, say, two PEs cannot share the GPU still says why.
    """
    if pes < 1:
        raise ValueError(f"pes must be >= 1, got {pes}")
    size -= size % 8
    ok, errors = _run_pes(_pe_main, (size, chunk_size), pes=pes, readers=max(1, pes - 1),
                          heap=2 * size, timeout=timeout)
    return {"pes": pes, "bytes": size, "chunk_size": chunk_size,
            "per_reader_gbps": [g["gbps"] for g in ok],
            "copy_gbps": [g["copy_gbps"] for g in ok],
            "verified": bool(ok) and not errors and all(g["verified"] for g in ok),
            "errors": errors}


def _store_pe_main(url: str, session: str, rank: int, pes: int, size: int, chunk: int,
                   out: mp.Queue) -> None:
    import weightfabric as wf
    from weightfabric.fabric.gpu import HubRendezvous, NvshmemRuntime

    client = wf.connect(url)
    worker = rt = None
    try:
        rt = NvshmemRuntime.start(HubRendezvous(client), session=session, rank=rank, nranks=pes,
                                  local_rank=0)
        worker = wf.join(url, worker=f"pe-{rank}", nvshmem=rt)
        store = worker.model("bench", device="cuda:0", symmetric=True, chunk_size=chunk)
        weights = (pattern(size, "cuda:0") if rank == 0
                   else torch.zeros(size, dtype=torch.uint8, device="cuda:0"))
        store.attach({"w": weights})  # collective: every PE allocates its buffers here
        for round_ in (1, 2):
            version_key = VERSION_KEY.format(session=session, round=round_)
            if rank == 0:
                version = store.publish(snapshot=False)
                client.kv_put(version_key, str(version).encode())
                for r in range(1, pes):
                    client.kv_get(ROUND_DONE_KEY.format(session=session, round=round_, rank=r),
                                  timeout=600)
                store.retract(version)
                continue
            stats = store.fetch(int(client.kv_get(version_key, timeout=120)))
            got = store.tensors["w"]
            verified = bool(torch.equal(got, pattern(size, got.device)))
            client.kv_put(ROUND_DONE_KEY.format(session=session, round=round_, rank=rank), b"1")
        if rank > 0:
            scratch = torch.empty_like(got)
            copy_s = median_seconds(lambda: scratch.copy_(got), got.device, 3)
            out.put({"rank": rank, "gbps": stats.gbps, "seconds": stats.seconds,
                     "transports": dict(stats.transports), "sources": dict(stats.sources),
                     "copy_gbps": size / copy_s / 1e9, "verified": verified})
    except Exception:
        out.put({"rank": rank, "error": traceback.format_exc()[-3000:]})
        raise
    finally:
        if worker is not None:
            worker.close()  # frees the symmetric buffers: a collective, on every PE
        if rt is not None:
            rt.close()
        client.close()


def nvshmem_store_fetch(*, pes: int, size: int, chunk_size: int,
                        timeout: float = 600) -> dict[str, Any]:
    """Fetch between symmetric model stores of ``pes`` PEs on GPU 0 (see the module).

    Returns:
        Per reader: GB/s of the second fetch, the bytes per transport, the same GPU's
        ``copy_`` GB/s, bit-exactness (which needs every byte over ``nvshmem``);
        ``errors`` names a PE that failed.
    """
    if pes < 2:
        raise ValueError(f"a store fetch needs a publisher and a reader: pes >= 2, got {pes}")
    size -= size % 8
    ok, errors = _run_pes(_store_pe_main, (size, chunk_size), pes=pes, readers=pes - 1,
                          heap=2 * size, timeout=timeout)
    return {"pes": pes, "bytes": size, "chunk_size": chunk_size,
            "per_reader_gbps": [g["gbps"] for g in ok],
            "copy_gbps": [g["copy_gbps"] for g in ok],
            "transports": [g["transports"] for g in ok],
            "verified": bool(ok) and not errors and all(
                g["verified"] and set(g["transports"]) == {"nvshmem"} for g in ok),
            "errors": errors}


def llama_layer(tp: int, scale: int) -> dict[str, tuple[tuple[int, int], Layout]]:
    """Shapes and layouts of one Llama-3-70B layer at tensor-parallel degree ``tp``."""
    hidden, inter, heads, kv, head_dim = 8192 // scale, 28672 // scale, 64, 8, 128 // scale
    return {
        "qkv": (((heads + 2 * kv) * head_dim, hidden),
                FusedQKV(tp=tp, num_heads=heads, num_kv_heads=kv, head_dim=head_dim)),
        "o": ((hidden, heads * head_dim), Sharded(tp=tp, dim=1)),
        "gate_up": ((2 * inter, hidden), FusedGateUp(tp=tp)),
        "down": ((hidden, inter), Sharded(tp=tp, dim=1)),
    }


def _holder(full: dict[str, torch.Tensor], layer: dict[str, tuple[tuple[int, int], Layout]],
            fp8: bool) -> tuple[list[HeldTensor], list[torch.Tensor]]:
    """The TP2 holder: each rank's shards (fp8: and scales) packed into one flat region."""
    parts: list[list[torch.Tensor]] = [[], []]
    sizes = [0, 0]
    held = []

    def place(rank: int, t: torch.Tensor) -> int:
        raw = t.contiguous().view(-1).view(torch.uint8)
        at = -(-sizes[rank] // 256) * 256
        if at > sizes[rank]:
            parts[rank].append(torch.zeros(at - sizes[rank], dtype=torch.uint8, device=raw.device))
        parts[rank].append(raw)
        sizes[rank] = at + raw.numel()
        return at

    for name, (shape, layout) in layer.items():
        shards = split_tensor(full[name], layout, backend="torch")
        offsets, scales = [], []
        for rank, shard in enumerate(shards):
            if fp8:
                q, sc = quantize_fp8(shard)
                offsets.append(place(rank, q))
                scales.append(place(rank, sc))
            else:
                offsets.append(place(rank, shard))
        held.append(HeldTensor(name=name, shape=shape, layout=layout,
                               dtype=FP8 if fp8 else full[name].dtype, offsets=tuple(offsets),
                               scale_offsets=tuple(scales) if fp8 else None))
    return held, [torch.cat(p) for p in parts]


def _reshard_case(full: dict[str, torch.Tensor], src_layer: dict, dst_layer: dict, *, fp8: bool,
                  budget: int, repeats: int) -> dict[str, Any]:
    from weightfabric.fabric.relayout.direct import plan_direct, run_direct

    dev = next(iter(full.values())).device
    held, regions = _holder(full, src_layer, fp8=fp8)
    wanted = [WantedTensor(name=n, layout=lay, dtype=torch.bfloat16)
              for n, (_, lay) in dst_layer.items()]
    staged_plan = plan_staging(held, wanted, rank=0, budget=budget)
    direct_plan = plan_direct(held, wanted, rank=0)
    staged = {n: torch.empty_like(t) for n, t in full.items()}
    direct = {n: torch.empty_like(t) for n, t in full.items()}

    def read(rank: int, offset: int, buf: torch.Tensor) -> None:
        buf.copy_(regions[rank][offset:offset + buf.numel()])

    staging = torch.empty(staged_plan.staging_nbytes, dtype=torch.uint8, device=dev)  # kept,
    # as a ReshardReader keeps it
    staged_s = median_seconds(lambda: run_staging(staged_plan, read, staged, staging=staging),
                              dev, repeats)
    direct_s = median_seconds(lambda: run_direct(direct_plan, dict(enumerate(regions)), direct),
                               dev, repeats)
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    copy_dst = torch.empty_like(flat)
    copy_s = median_seconds(lambda: copy_dst.copy_(flat), dev, repeats)
    nbytes = flat.numel() * flat.element_size()
    same = all(torch.equal(staged[n].view(torch.int16), direct[n].view(torch.int16)) for n in full)
    if not fp8:
        same = same and all(torch.equal(staged[n], full[n]) for n in full)
    return {"bytes": nbytes, "staged_gbps": nbytes / staged_s / 1e9,
            "direct_gbps": nbytes / direct_s / 1e9, "copy_gbps": nbytes / copy_s / 1e9,
            "staged_vs_copy": copy_s / staged_s, "direct_vs_copy": copy_s / direct_s,
            "staging_peak_bytes": staged_plan.peak_bytes,
            "source_bytes_staged": staged_plan.fetched_bytes, "verified": same}


def reshard_reads(*, device: str = "cuda", budget: int = 64 << 20, scale: int = 1,
                  repeats: int = 5) -> dict[str, Any]:
    """Time staged and direct TP2 -> TP1 reads of one layer, bf16 and fp8 (see the module).

    Args:
        device: where the stores and buffers live (``cuda``, or ``cpu`` in tests).
        budget: the staged reader's staging budget in bytes.
        scale: divide the layer's dimensions (CPU runs and tests use 8 or more).
        repeats: timed reads of each kind; the median is reported.

    Returns:
        Per stored dtype: GB/s staged, direct and of ``copy_``, the ratios, the staging
        peak, and whether staged, direct and the original tensors agree bit for bit
        (bf16) or staged and direct agree (fp8).
    """
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(7)
    src_layer, dst_layer = llama_layer(2, scale), llama_layer(1, scale)
    full = {n: torch.randn(shape, generator=g).to(torch.bfloat16).to(dev)
            for n, (shape, _) in src_layer.items()}
    out: dict[str, Any] = {"budget": budget, "device": str(dev)}
    for kind in ("bf16", "fp8"):
        out[kind] = _reshard_case(full, src_layer, dst_layer, fp8=kind == "fp8", budget=budget,
                                  repeats=repeats)
    out["verified"] = out["bf16"]["verified"] and out["fp8"]["verified"]
    return out
