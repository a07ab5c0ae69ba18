"""`fabric bench tls`: what TLS costs a read from a holder, against plain TCP, in one run.

Two read servers in this process expose the same region, one plain and one over mutual
TLS (a throwaway CA and certificate made with the ``openssl`` command); one reader reads
the whole region from each in ``--read-bytes`` requests, ``--repeats`` times, over
loopback. Reports GB/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from weightfabric.tools.command import EXIT_OK, BadInput, CommandFailed, Console, add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench tls`."""
    p = add_command(
        subparsers, "tls", help="read throughput over TLS against plain TCP", handler=_run,
        description="GB/s of reads from a holder over mutual TLS and over plain TCP, on "
                    "loopback, in one run\n(needs the openssl command for a throwaway CA).",
        examples=["fabric bench tls --size 512MB --json"])
    p.add_argument("--size", default="256MB", help="region size (default 256MB)")
    p.add_argument("--read-bytes", default="64MB", help="bytes per request (default 64MB)")
    p.add_argument("--repeats", type=int, default=3, help="reads of the region, best kept "
                                                           "(default 3)")
    p.add_argument("--json", action="store_true", help="print JSON")


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and one certificate it signed, for every worker of a test (cert, key, ca).

    Raises:
        RuntimeError: no ``openssl`` command, or it failed.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=weightfabric-test-ca"],
        [openssl, "req", *ec, "-keyout", "worker.key", "-out", "worker.csr",
         "-subj", "/CN=weightfabric-worker"],
        [openssl, "x509", "-req", "-in", "worker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "worker.pem", "-days", "2"],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed: {done.stderr.strip()[-500:]}")
    return folder / "worker.pem", folder / "worker.key", folder / "ca.pem"


def bench_tls(size: int, read_bytes: int, repeats: int) -> dict:
    """Best GB/s of reading ``size`` bytes from a plain and a TLS holder."""
    import torch

    from weightfabric.fabric.transports import ReadServer, TcpTransport
    from weightfabric.fabric.transports.tls import TlsConfig, use_for_reads

    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    out = torch.empty_like(data)
    results = {}
    with tempfile.TemporaryDirectory(prefix="wf-bench-tls-") as tmp:
        cert, key, ca = make_certs(Path(tmp))
        tls = TlsConfig(cert, key, ca)
        use_for_reads(tls)
        try:
            for name, config in (("tcp", None), ("tls", tls)):
                with ReadServer(tls=config) as server:
                    server.expose("bench/v1/s0", data, chunk_size=min(read_bytes, size))
                    reader = TcpTransport()
                    best = float("inf")
                    for _ in range(repeats):
                        start = time.perf_counter()
                        for lo in range(0, size, read_bytes):
                            n = min(read_bytes, size - lo)
                            reader.read(server.address, "bench/v1/s0", lo, out[lo:lo + n],
                                        timeout=60)
                        best = min(best, time.perf_counter() - start)
                    reader.close()
                    if not torch.equal(out, data):
                        raise RuntimeError(f"{name}: the bytes read differ from the region")
                    results[name] = round(size / best / 1e9, 3)
        finally:
            use_for_reads(None)
    return {"size": size, "read_bytes": read_bytes, "tcp_gbps": results["tcp"],
            "tls_gbps": results["tls"], "tls_over_tcp": round(results["tls"] / results["tcp"], 3)}


def _run(args: argparse.Namespace) -> int:
    from weightfabric.topology.units import parse_size

    try:
        size, read_bytes = int(parse_size(args.size)), int(parse_size(args.read_bytes))
    except ValueError as exc:
        raise BadInput(exc) from exc
    if size < 1 or read_bytes < 1 or args.repeats < 1:
        raise BadInput("--size, --read-bytes and --repeats must be >= 1")
    try:
        out = bench_tls(size, read_bytes, args.repeats)
    except RuntimeError as exc:
        raise CommandFailed(exc) from exc
    if args.json:
        print(json.dumps(out, indent=2))
        return EXIT_OK
    Console().print(f"reads of {size / 1e6:.0f} MB over loopback: plain TCP "
                    f"{out['tcp_gbps']:.2f} GB/s, mutual TLS {out['tls_gbps']:.2f} GB/s "
                    f"({out['tls_over_tcp']:.2f}x)")
    return EXIT_OK
