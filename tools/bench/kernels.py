"""`fabric bench kernels`: GB/s of the transfer kernels beside plain torch.

Bytes formula: every figure counts bytes read + bytes written once. The tensor
set is one tensor-parallel rank's share of Llama-3-70B-shaped layers (hidden
8192, 64 heads, 8 kv heads, head_dim 128, intermediate 28672), TP8; the reshard
case moves a layer from TP8 to TP4, and its fp8 variant reads gate_up, o and down
stored as blockwise fp8 at TP8 into bf16 at TP4 (fused kernel vs dequantise, then
copy). "pack+checksum" is `pack_with_checksums` (a snapshot publish's pack: one
fused pass, `kernels.packsum` on GPU, the compiled loop on CPU) against `copy_` of
the same bytes and against `pack`, then `chunk_checksums` (bytes: read + written
once, the checksum's read of the packed bytes not counted again). On CPU the shapes
are scaled down (hidden / 4, 4 layers) so a run takes about a minute; there the
dispatch picks the torch path (for pack+checksum: the compiled loop where one was
built, backend ``native (C)``, else torch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from weightfabric.tools.command import EXIT_OK, BadInput, Console, add_command

if TYPE_CHECKING:  # torch and the kernels load when the benchmark runs, not for its --help
    import torch

    from weightfabric.kernels import PackLayout, ReshardPlan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after one warm-up.

    Median wall time of ``fn`` over ``repeat`` runs after one warm-up, the device
    synchronised around each.
    """
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tensor_set(tp: int, layers: int, scale: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One TP rank's bf16 share of ``layers`` Llama-3-70B-shaped layers, shapes divided by ``scale``."""
    import torch

    h, inter, kvh, hd, heads = 8192 // scale, 28672 // scale, 8, 128 // scale, 64
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        shapes = {"qkv": ((heads + 2 * kvh) * hd // tp, h), "o": (h, heads * hd // tp),
                  "gate_up": (2 * inter // tp, h), "down": (h, inter // tp),
                  "in_norm": (h,), "post_norm": (h,)}
        for name, shape in shapes.items():
            out[f"layers.{i}.{name}"] = torch.randn(shape, device=device, dtype=torch.bfloat16)
    return out


# One result row (its keys are the JSON output's and the table's column names).
KernelRow = TypedDict("KernelRow", {
    "kernel": str, "backend": str, "bytes": int, "seconds": float, "GB/s": float,
    "baseline": str, "baseline GB/s": float | None, "speedup": float | None})


def run(device: torch.device, *, layers: int, scale: int, repeat: int) -> list[KernelRow]:
    """Time each kernel and its baseline on `device`: one row per kernel."""
    import torch

    from weightfabric.kernels import (
        FusedGateUp,
        FusedQKV,
        Sharded,
        chunk_checksums,
        dequantize_fp8,
        pack,
        pack_ref,
        plan_layout,
        plan_reshard,
        quantize_fp8,
        reshard,
        unpack,
    )
    from weightfabric.kernels.native import checksum_library

    rows: list[KernelRow] = []
    backend = "triton" if device.type == "cuda" else "torch"

    def add(name: str, nbytes: int, seconds: float, baseline: str, base_seconds: float) -> None:
        rows.append({"kernel": name, "backend": backend, "bytes": nbytes,
                     "seconds": seconds, "GB/s": nbytes / seconds / 1e9,
                     "baseline": baseline, "baseline GB/s": nbytes / base_seconds / 1e9,
                     "speedup": base_seconds / seconds})

    ts = tensor_set(8, layers, scale, device)
    lay = plan_layout(ts)
    nbytes = sum(t.numel() * t.element_size() for t in ts.values())
    buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    t_copy = median_seconds(lambda: flat_dst.copy_(flat_src), device, repeat)
    rows.append({"kernel": "copy_ (reference)", "backend": "torch", "bytes": 2 * nbytes,
                 "seconds": t_copy, "GB/s": 2 * nbytes / t_copy / 1e9, "baseline": "-",
                 "baseline GB/s": None, "speedup": None})
    add("pack", 2 * nbytes, median_seconds(lambda: pack(ts, lay, out=buf), device, repeat),
        "per-tensor copy_ loop", median_seconds(lambda: pack_ref(ts, lay, buf), device, repeat))
    outs = {n: torch.empty_like(t) for n, t in ts.items()}
    add("unpack", 2 * nbytes, median_seconds(lambda: unpack(buf, lay, out=outs), device, repeat),
        "per-tensor copy_ loop",
        median_seconds(lambda: [outs[s.name].view(-1).copy_(buf[s.offset:s.offset + s.nbytes].view(
            torch.bfloat16)) for s in lay], device, repeat))
    cs = 4 << 20 if device.type == "cuda" else 1 << 20
    words = buf[:nbytes // 4 * 4]
    add("checksum", nbytes, median_seconds(lambda: chunk_checksums(words, cs), device, repeat),
        "copy_ of the same bytes", t_copy / 2)
    native = device.type == "cpu" and checksum_library() is not None  # the CPU default: C loop
    if native:
        rows[-1]["backend"] = "native (C)"
        add("checksum", nbytes, median_seconds(lambda: chunk_checksums(words, cs, backend="torch"),
                                               device, repeat), "copy_ of the same bytes", t_copy / 2)
    _pack_checksum_rows(add, ts, lay, buf, cs, device, repeat, t_copy)
    if native:
        rows[-2]["backend"] = rows[-1]["backend"] = "native (C)"

    w = ts["layers.0.gate_up"]
    wb = w.numel() * 2
    q, s = quantize_fp8(w)
    add("fp8 quantise", wb + w.numel() + s.numel() * 4, median_seconds(lambda: quantize_fp8(w), device, repeat),
        "torch .to(float8) (no scaling)", median_seconds(lambda: w.to(torch.float8_e4m3fn), device, repeat))
    add("fp8 dequantise", w.numel() + wb + s.numel() * 4,
        median_seconds(lambda: dequantize_fp8(q, s), device, repeat),
        "torch .to(bfloat16) (no scaling)", median_seconds(lambda: q.to(torch.bfloat16), device, repeat))

    # reshard one layer TP8 -> TP4 (all eight source shards on this device)
    h, inter, hd = 8192 // scale, 28672 // scale, 128 // scale
    cases = [(FusedQKV(8, 64, 8, hd), FusedQKV(4, 64, 8, hd), ((64 + 16) * hd, h)),
             (FusedGateUp(8), FusedGateUp(4), (2 * inter, h)),
             (Sharded(8, 1), Sharded(4, 1), (h, 64 * hd)),
             (Sharded(8, 1), Sharded(4, 1), (h, inter))]
    plans, srcs, dsts = [], [], []
    for src, dst, shape in cases:
        plan = plan_reshard(src, dst, shape)
        plans.append(plan)
        srcs.append([torch.randn(sh, device=device, dtype=torch.bfloat16) for sh in plan.src_shapes])
        dsts.append([torch.empty(sh, device=device, dtype=torch.bfloat16) for sh in plan.dst_shapes])
    moved = 2 * 2 * sum(p.num_elements for p in plans)

    def loop() -> None:
        for plan, src, dst in zip(plans, srcs, dsts, strict=True):
            for g in plan.segments:
                dst[g.dst_rank][g.dst_row:g.dst_row + g.rows, g.dst_col:g.dst_col + g.cols].copy_(
                    src[g.src_rank][g.src_row:g.src_row + g.rows, g.src_col:g.src_col + g.cols])

    add("reshard TP8->TP4", moved,
        median_seconds(lambda: [reshard(p, s_, d_) for p, s_, d_ in zip(plans, srcs, dsts, strict=True)],
              device, repeat),
        "per-segment copy_ loop", median_seconds(loop, device, repeat))
    nbytes, fused, two_pass = _fp8_reshard_case(plans[1:], srcs[1:], dsts[1:], backend)
    add("fp8 dequant+reshard TP8->TP4, fused", nbytes, median_seconds(fused, device, repeat),
        "dequantize_fp8, then copy_segments", median_seconds(two_pass, device, repeat))
    return rows


def _pack_checksum_rows(add: Callable[[str, int, float, str, float], None],
                       ts: dict[str, torch.Tensor], lay: PackLayout, buf: torch.Tensor, cs: int,
                       device: torch.device, repeat: int, t_copy: float) -> None:
    """`pack_with_checksums` (fused) against ``copy_`` and against pack, then checksum.

    Checks first that both give the same bytes and sums.
    """
    import torch

    from weightfabric.kernels import chunk_checksums, pack, pack_with_checksums

    nbytes = sum(t.numel() * t.element_size() for t in ts.values())
    packed = buf[:lay.nbytes]
    buf.fill_(0x5A)
    sums = pack_with_checksums(ts, lay, buf, cs)
    fused_bytes = buf.clone()
    buf.fill_(0x5A)
    pack(ts, lay, out=buf)
    if not (torch.equal(buf, fused_bytes) and torch.equal(sums, chunk_checksums(packed, cs))):
        raise RuntimeError("bench kernels: pack_with_checksums differs from pack, then "
                           "chunk_checksums")
    t_fused = median_seconds(lambda: pack_with_checksums(ts, lay, buf, cs), device, repeat)
    add("pack+checksum, fused", 2 * nbytes, t_fused, "copy_ of the same bytes", t_copy)
    add("pack+checksum, fused", 2 * nbytes, t_fused, "pack, then chunk_checksums",
        median_seconds(lambda: (pack(ts, lay, out=buf), chunk_checksums(packed, cs)), device,
                       repeat))


def _fp8_reshard_case(plans: list[ReshardPlan], srcs: list[list[torch.Tensor]],
                      dsts: list[list[torch.Tensor]], backend: str
                      ) -> tuple[int, Callable[[], None], Callable[[], None]]:
    """gate_up, o and down stored as blockwise fp8 at TP8, read as bf16 at TP4.

    Returns the bytes moved (fp8 elements + the scales of their blocks, once, + bf16
    written) and the two ways of doing it: one `dequantize_fp8_segments` call for every
    window, or (as the staged path does) each source shard dequantised whole into a
    temporary and then cut by one `copy_segments` call.
    """
    from weightfabric.kernels import (
        Fp8Segment,
        copy_segments,
        dequantize_fp8,
        dequantize_fp8_segments,
        quantize_fp8,
    )

    shards = [[quantize_fp8(t) for t in src] for src in srcs]
    windows = [Fp8Segment(q, s, d[g.dst_rank][g.dst_row:g.dst_row + g.rows,
                                              g.dst_col:g.dst_col + g.cols],
                          row=g.src_row, col=g.src_col)
               for plan, qs, d in zip(plans, shards, dsts, strict=True)
               for g in plan.segments for q, s in [qs[g.src_rank]]]
    nbytes = sum(3 * w.dst.numel() for w in windows) + sum(
        s.numel() * 4 for qs in shards for _, s in qs)

    def fused() -> None:
        dequantize_fp8_segments(windows, backend=backend)

    def two_pass() -> None:
        temps = [[dequantize_fp8(q, s, backend=backend) for q, s in qs] for qs in shards]
        copy_segments([(temps[i][g.src_rank][g.src_row:g.src_row + g.rows,
                                             g.src_col:g.src_col + g.cols],
                        dsts[i][g.dst_rank][g.dst_row:g.dst_row + g.rows,
                                            g.dst_col:g.dst_col + g.cols])
                       for i, plan in enumerate(plans) for g in plan.segments], backend=backend)

    return nbytes, fused, two_pass


def _handler(args: argparse.Namespace) -> int:
    import torch

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type not in ("cpu", "cuda") or (device.type == "cuda"
                                                  and not torch.cuda.is_available()):
            raise ValueError(f"--device {args.device}: use cpu, or cuda on a machine with a GPU")
        if args.repeat < 1 or (args.layers is not None and args.layers < 1):
            raise ValueError("--repeat and --layers must be >= 1")
    except (RuntimeError, ValueError) as exc:
        raise BadInput(exc) from exc
    on_gpu = device.type == "cuda"
    layers = args.layers or (8 if on_gpu else 4)
    scale = 1 if on_gpu else 4
    rows = run(device, layers=layers, scale=scale, repeat=args.repeat)
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
    meta = {"device": name, "layers": layers, "shape_scale": f"1/{scale}",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    if args.json:
        print(json.dumps({"meta": meta, "results": rows}, indent=2))
        return EXIT_OK
    from rich.table import Table

    table = Table(title=f"kernels on {name}: {layers} Llama-3-70B TP8 layers, shapes x{meta['shape_scale']}")
    for col in ("kernel", "backend", "MB", "GB/s", "baseline", "baseline GB/s", "speedup"):
        table.add_column(col, justify="left" if col in ("kernel", "backend", "baseline") else "right")
    for r in rows:
        table.add_row(str(r["kernel"]), str(r["backend"]), f"{r['bytes'] / 1e6:.1f}",
                      f"{r['GB/s']:.2f}", str(r["baseline"]),
                      "-" if r["baseline GB/s"] is None else f"{r['baseline GB/s']:.2f}",
                      "-" if r["speedup"] is None else f"{r['speedup']:.2f}x")
    Console().print(table)
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench kernels`."""
    p = add_command(
        subparsers, "kernels", handler=_handler,
        help="GB/s of pack/unpack, fp8, reshard and checksum kernels vs torch",
        description="Times the transfer kernels on one device beside torch doing the same "
                    "bytes.\nOn CPU, shapes are scaled down 4x and 4 layers run by default.",
        examples=["fabric bench kernels --json", "fabric bench kernels --device cuda:1"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 8 GPU, 4 CPU)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions, the median is reported (default 5)")
