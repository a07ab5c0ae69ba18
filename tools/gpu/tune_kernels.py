"""Sweep the launch settings of the segment-copy, checksum and fused pack+checksum kernels.

Run on a lent GPU (`bash tools/gpu/session.sh tune`): for every setting, the median
time of `pack` over the `fabric bench kernels` tensor set (one TP8 rank of eight
Llama-3-70B layers, bf16), of `chunk_checksums` over the packed buffer and of
`pack_with_checksums` (the fused kernel, `kernels.packsum`: tile / step / warps),
beside a device ``copy_`` of the same bytes. Each setting is first checked bit-exact
against the torch reference. Prints one JSON object per line; the last line names
the fastest setting of each kernel. Bytes count as in the bench: read + written for
pack and pack+checksum, read for the checksum. ``--only`` picks kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from weightfabric.kernels import (
    PackLayout,
    checksum,
    pack,
    pack_ref,
    pack_with_checksums,
    packsum,
    plan_layout,
    segcopy,
)
from weightfabric.kernels.checksum import chunk_checksums_ref, chunk_checksums_triton
from weightfabric.tools.bench.kernels import median_seconds, tensor_set


def main() -> int:
    """Sweep the kernels' tile settings and print each as JSON, then the best."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu under "
                        "TRITON_INTERPRET=1 to check this script")
    parser.add_argument("--scale", type=int, default=1, help="divide the shapes (default 1)")
    parser.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    parser.add_argument("--only", default="pack,checksum,packsum",
                        help="kernels to sweep, comma-separated (default: all three)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("tune_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    ts = tensor_set(8, args.layers, args.scale, device)
    lay = plan_layout(ts)
    nbytes = sum(t.numel() * t.element_size() for t in ts.values())
    buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t_copy = median_seconds(lambda: b.copy_(a), device, 10)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "copy_GBps": 2 * nbytes / t_copy / 1e9}))
    best: dict[str, tuple[float, dict[str, object]]] = {}
    want = pack_ref(ts, lay, torch.zeros_like(buf)).clone()
    pack_settings = itertools.product((2048, 8192), (512, 1024, 2048), (4, 8))
    for block, sub, warps in pack_settings if "pack" in only else ():
        segcopy.SUB_BLOCK, segcopy.NUM_WARPS = sub, warps
        buf.zero_()
        pack(ts, lay, out=buf, block=block, backend="triton")
        if not torch.equal(buf, want):
            print(json.dumps({"kernel": "pack", "block": block, "sub": sub, "warps": warps,
                              "error": "bytes differ from pack_ref"}), flush=True)
            continue
        t = median_seconds(lambda: pack(ts, lay, out=buf, block=block, backend="triton"), device, 10)  # noqa: B023
        _report(best, {"kernel": "pack", "block": block, "sub": sub, "warps": warps,
                       "GBps": 2 * nbytes / t / 1e9}, t_copy / t)
    words = buf[:nbytes // 4 * 4]
    expected = chunk_checksums_ref(words, 4 << 20)
    checksum_settings = itertools.product((512, 1024, 2048), (8192, 32768), (4, 8))
    for block, program_pairs, warps in checksum_settings if "checksum" in only else ():
        checksum.PROGRAM_PAIRS, checksum.NUM_WARPS = program_pairs, warps
        if not torch.equal(chunk_checksums_triton(words, 4 << 20, block=block), expected):
            print(json.dumps({"kernel": "checksum", "block": block, "warps": warps,
                              "error": "sums differ from chunk_checksums_ref"}), flush=True)
            continue
        t = median_seconds(lambda: chunk_checksums_triton(words, 4 << 20, block=block),  # noqa: B023
                           device, 10)
        _report(best, {"kernel": "checksum", "block": block, "program_pairs": program_pairs,
                       "warps": warps, "GBps": nbytes / t / 1e9}, t_copy / 2 / t)
    if "packsum" in only:
        _sweep_packsum(ts, lay, buf, want, nbytes, t_copy, device, best)
    print(json.dumps({"best": {k: v[1] for k, v in best.items()}}))
    return 0


PACKSUM_SETTINGS = ((32768, 8192, 8), (65536, 8192, 8), (131072, 8192, 8), (65536, 4096, 8),
                    (65536, 16384, 8), (65536, 8192, 4), (131072, 16384, 4), (262144, 16384, 8))
"""(tile bytes, step bytes, warps) of `kernels.packsum` to try: around the default (64 KiB
/ 8 KiB / 8), and the larger tiles the segment-copy sweep pointed to."""


def _sweep_packsum(ts: dict[str, torch.Tensor], lay: PackLayout, buf: torch.Tensor,
                   want: torch.Tensor, nbytes: int, t_copy: float, device: torch.device,
                   best: dict[str, tuple[float, dict[str, object]]]) -> None:
    """`pack_with_checksums` at each of `PACKSUM_SETTINGS`, 4 MiB chunks."""
    cs = 4 << 20
    want_sums = chunk_checksums_ref(want[:lay.nbytes], cs)
    for tile, sub, warps in PACKSUM_SETTINGS:
        packsum.TILE, packsum.SUB, packsum.NUM_WARPS = tile, sub, warps
        buf.zero_()
        sums = pack_with_checksums(ts, lay, buf, cs, backend="triton")
        if not (torch.equal(buf, want) and torch.equal(sums, want_sums)):
            print(json.dumps({"kernel": "packsum", "tile": tile, "sub": sub, "warps": warps,
                              "error": "bytes or sums differ from pack_ref, chunk_checksums_ref"}),
                  flush=True)
            continue
        t = median_seconds(lambda: pack_with_checksums(ts, lay, buf, cs, backend="triton"),
                           device, 10)
        _report(best, {"kernel": "packsum", "tile": tile, "sub": sub, "warps": warps,
                       "GBps": 2 * nbytes / t / 1e9}, t_copy / t)


def _report(best: dict[str, tuple[float, dict[str, object]]], row: dict[str, object],
            vs_copy: float) -> None:
    """Print a setting's ``row`` (with ``vs_copy``); keep it if its kernel's fastest yet."""
    row["vs_copy"] = vs_copy
    print(json.dumps(row), flush=True)
    kernel = str(row["kernel"])
    if vs_copy > best.get(kernel, (0.0, {}))[0]:
        best[kernel] = (vs_copy, row)


if __name__ == "__main__":
    sys.exit(main())
