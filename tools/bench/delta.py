"""`fabric bench delta`: how small versions get as deltas, and what that does over a WAN.

Two parts, in one run:

1. **Density and codec.** Train a model with Adam (fp32 master weights, ``--lr``) on a
   next-token loss over random tokens and publish bf16 after each step, as a
   mixed-precision RL trainer does; for each version after the first: the fraction of
   bf16 words that changed (``changed_fraction``), the bytes of the version
   (``full_bytes``) and of its delta against the previous one in the fabric's chunks
   (``delta_bytes``, `kernels.delta`), the CPU encode and decode rates (bytes of the
   version per second, the torch/native path a CPU holder and reader run) and whether
   every decode was bit-exact. The models: the demo's TinyLlama (``medium``) and a
   Hugging Face ``LlamaForCausalLM`` from a small config (random init, no download).
   ``zlib_bytes`` is the deltas compressed with zlib (level 1): whether a general
   compressor would pay on top.
2. **Over a WAN.** `fabric bench crossdc --delta` on the same ``--lr``: two emulated
   datacenters, delta fetches against full ones in the same run (WAN bytes and the
   remote rollouts' stall). Needs root and ``ip netns``; skipped with the reason
   otherwise.
"""

from __future__ import annotations

import argparse
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.table import Table

from weightfabric.tools.bench import crossdc
from weightfabric.tools.bench.launch import AgentError, print_result
from weightfabric.tools.command import Console, add_command
from weightfabric.topology.units import parse_bandwidth, parse_size

if TYPE_CHECKING:  # torch loads when the benchmark runs, not for `fabric bench delta --help`
    import torch
    from torch import nn

CHUNK = 4 << 20
"""Bytes per chunk the versions are encoded in by default (`--chunk-size`)."""
TOKENS = (4, 64)  # batch, sequence of each training step


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench delta`."""
    p = add_command(
        subparsers, "delta", help="bf16 versions of an Adam-trained model as deltas; WAN "
                                  "bytes and stall with and without them",
        handler=_run, bad_input=(ValueError,), failures=(AgentError,),
        description="Trains the demo model and a small Hugging Face Llama with Adam (fp32\n"
                    "master weights), publishing bf16 after each step: the changed fraction,\n"
                    "full and delta bytes per version, CPU encode/decode GB/s, bit-exactness.\n"
                    "Then, as root, the two-datacenter emulation of `fabric bench crossdc\n"
                    "--delta`: WAN bytes and remote stall with deltas and without. Exits 1 if\n"
                    "a decode or a fetch is not bit-exact, 2 on bad options.",
        examples=["fabric bench delta --lr 1e-6 --json",
                  "sudo fabric bench delta --lr 1e-5 --size 256MB --rate 1Gbit/s"])
    p.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (default 1e-6)")
    p.add_argument("--versions", type=int, default=5, help="versions per model (default 5)")
    p.add_argument("--models", default="demo,llama",
                   help="comma-separated: demo, llama (default both)")
    p.add_argument("--size", default="256MB", help="WAN part: model bytes (default 256MB)")
    p.add_argument("--remote", type=int, default=2, help="WAN part: rollouts in dc-b (default 2)")
    p.add_argument("--rate", default="1Gbit/s", help="WAN part: its rate (default 1Gbit/s)")
    p.add_argument("--wan-versions", type=int, default=3,
                   help="WAN part: versions per plan, the first not counted (default 3)")
    p.add_argument("--chunk-size", default="4MiB",
                   help="bytes per encoded chunk, the fabric's chunks (default 4MiB)")
    p.add_argument("--device", default="cpu",
                   help="where the codec runs: cpu (torch/native path) or cuda (Triton)")
    p.add_argument("--no-wan", action="store_true", help="skip the WAN part")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def demo_model(seed: int) -> tuple[nn.Module, int]:
    """The demo's TinyLlama (``medium``) and its vocabulary size."""
    from weightfabric.tools.demo.model import TinyLlama, TinyLlamaConfig, init_weights

    cfg = TinyLlamaConfig.scaled("medium")
    model = TinyLlama(cfg)
    init_weights(model, seed)
    return model, cfg.vocab_size


def llama_model(seed: int) -> tuple[nn.Module, int]:
    """A Hugging Face ``LlamaForCausalLM`` from a small config (random init)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256)
    return LlamaForCausalLM(cfg), cfg.vocab_size


MODELS: dict[str, Callable[[int], tuple[nn.Module, int]]] = {"demo": demo_model,
                                                             "llama": llama_model}


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    import torch

    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def published(model: nn.Module) -> torch.Tensor:
    """The model's parameters as the trainer publishes them: bf16, end to end, as bytes."""
    import torch

    return torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()]
                     ).view(torch.uint8)


def bench_model(name: str, *, lr: float, versions: int, device: torch.device,
                chunk: int = CHUNK, seed: int = 0) -> dict[str, Any]:
    """Part 1 for one model (see the module docstring)."""
    import torch
    from torch import nn

    model, vocab = MODELS[name](seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    previous = published(model)
    rows = []
    for v in range(1, versions + 1):
        tokens = torch.randint(0, vocab, TOKENS, generator=g)
        logits = _logits(model, tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab).float(),
                                           tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        current = published(model)
        rows.append(_codec(previous.to(device), current.to(device), chunk) | {"version": v + 1})
        previous = current
    return {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
            "versions": rows, "verified": all(r["verified"] for r in rows)}


def _codec(base: torch.Tensor, new: torch.Tensor, chunk: int) -> dict[str, Any]:
    """One version's delta in chunks: sizes, rates (and ``copy_``'s), bit-exactness."""
    import torch

    from weightfabric.kernels.delta import changed_words, decode_delta, encode_delta

    spans = [(lo, min(lo + chunk, new.numel())) for lo in range(0, new.numel(), chunk)]
    warm = base[:chunk].clone()  # kernels compiled, pages touched
    decode_delta(encode_delta(warm, new[:chunk], 2), warm, warm)
    out, copied = base.clone(), torch.empty_like(new)
    copied.copy_(new)
    _sync(new)
    t0 = time.perf_counter()
    blobs = [encode_delta(base[lo:hi], new[lo:hi], 2) for lo, hi in spans]
    _sync(new)
    t1 = time.perf_counter()
    for (lo, hi), blob in zip(spans, blobs, strict=True):
        decode_delta(blob, out[lo:hi], out[lo:hi])
    _sync(new)
    t2 = time.perf_counter()
    copied.copy_(base)
    _sync(new)
    t3 = time.perf_counter()
    exact = bool(torch.equal(out, new))
    raw = b"".join(blob.cpu().numpy().tobytes() for blob in blobs)
    t4 = time.perf_counter()
    packed = len(zlib.compress(raw, 1))
    t5 = time.perf_counter()
    changed = changed_words(base, new, 2)
    return {"changed_fraction": changed / (new.numel() // 2), "full_bytes": new.numel(),
            "delta_bytes": len(raw), "ratio": new.numel() / len(raw),
            "encode_gbps": new.numel() / (t1 - t0) / 1e9,
            "decode_gbps": new.numel() / (t2 - t1) / 1e9,
            "copy_gbps": new.numel() / (t3 - t2) / 1e9,
            "zlib_bytes": packed, "zlib_gbps": len(raw) / (t5 - t4) / 1e9,
            "verified": exact}


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        import torch

        torch.cuda.synchronize(t.device)


def bench_delta(*, lr: float, versions: int, models: list[str], wan: dict[str, Any] | None,
                device: str = "cpu", chunk: int = CHUNK,
                on_phase: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Both parts; ``wan`` holds `crossdc.bench_crossdc`'s arguments, or None to skip it."""
    import torch

    if versions < 1 or chunk < 1 or chunk % 8:
        raise ValueError("--versions must be >= 1 and --chunk-size a positive multiple of 8")
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ValueError(f"--models: choose from {', '.join(MODELS)}, not {unknown or models}")
    where = torch.device(device)
    result: dict[str, Any] = {"lr": lr, "chunk_size": chunk, "device": _device_name(where),
                              "models": []}
    for name in models:
        on_phase(f"training {name}")
        result["models"].append(bench_model(name, lr=lr, versions=versions, device=where,
                                            chunk=chunk))
    verified = all(m["verified"] for m in result["models"])
    if wan is None:
        result["wan"] = {"skipped": "--no-wan"}
    elif (reason := crossdc.unavailable()) is not None:
        result["wan"] = {"skipped": reason}
    else:
        on_phase("WAN: delta and full fetches")
        out = crossdc.bench_crossdc(lr=lr, on_phase=on_phase, **wan)
        result["wan"] = {
            "size": out["size"], "remote": out["remote"], "rate_bytes_per_s": out["rate_bytes_per_s"],
            "wan_bytes_delta": out["delta"]["wan_bytes_per_version"],
            "wan_bytes_full": out["full"]["wan_bytes_per_version"],
            "wan_bytes_ratio": out["wan_bytes_ratio"],
            "remote_stall_delta_s": out["delta"]["max_remote_stall_seconds"],
            "remote_stall_full_s": out["full"]["max_remote_stall_seconds"],
            "stall_ratio": out["stall_ratio"],
            "changed_fraction": [r["changed_fraction"] for r in out["delta"]["versions"]],
            "verified": out["verified"]}
        verified = verified and out["verified"]
    result["verified"] = verified
    return result


def _device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _run(args: argparse.Namespace) -> int:
    wan = None if args.no_wan else {
        "remote": args.remote, "size": int(parse_size(args.size)),
        "chunk_size": int(parse_size(args.chunk_size)),
        "rate_bps": parse_bandwidth(args.rate), "rtt_s": 0.0, "versions": args.wan_versions}
    console = Console(stderr=True)
    with console.status("") as status:
        result = bench_delta(lr=args.lr, versions=args.versions,
                             models=[m.strip() for m in args.models.split(",") if m.strip()],
                             wan=wan, device=args.device,
                             chunk=int(parse_size(args.chunk_size)),
                             on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench delta: Adam lr {r['lr']:g}, bf16 published, "
                        f"chunks of {r['chunk_size'] >> 20} MiB, codec on {r['device']}")
    for col in ("model", "v", "changed %", "full MB", "delta MB", "full / delta",
                "encode GB/s", "decode GB/s", "copy_ GB/s", "zlib MB", "bit-exact"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m in r["models"]:
        for v in m["versions"]:
            table.add_row(m["model"], str(v["version"]), f"{100 * v['changed_fraction']:.2f}",
                          f"{v['full_bytes'] / 1e6:.1f}", f"{v['delta_bytes'] / 1e6:.2f}",
                          f"{v['ratio']:.1f}", f"{v['encode_gbps']:.2f}",
                          f"{v['decode_gbps']:.2f}", f"{v['copy_gbps']:.2f}",
                          f"{v['zlib_bytes'] / 1e6:.2f}",
                          "yes" if v["verified"] else "[red]NO[/red]")
    console.print(table)
    w = r["wan"]
    if "skipped" in w:
        console.print(f"WAN part skipped: {w['skipped']}")
        return
    console.print(f"WAN {w['rate_bytes_per_s'] * 8 / 1e9:g} Gbit/s, {w['size'] / 1e6:g} MB, "
                  f"{w['remote']} remote rollouts: WAN MB per version {w['wan_bytes_delta'] / 1e6:.1f} "
                  f"with deltas, {w['wan_bytes_full'] / 1e6:.1f} full ({w['wan_bytes_ratio']:.1f}x); "
                  f"max remote stall {w['remote_stall_delta_s']:.2f} s vs "
                  f"{w['remote_stall_full_s']:.2f} s ({w['stall_ratio']:.1f}x); "
                  f"bit-exact: {'yes' if w['verified'] else 'NO'}")
