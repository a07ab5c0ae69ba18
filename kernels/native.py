"""The CPU checksum in one fused pass: a small C loop built with the machine's C compiler.

`kernels.checksum` defines the per-chunk checksum; its torch reference makes one pass
over memory per arithmetic step (about 0.6-2.5 GB/s on a 2-core VM). This module
compiles the same arithmetic as one C loop (``cc -O3 -march=native``: wrapping
unsigned 64-bit arithmetic, vectorised where the CPU has 64-bit multiplies) the
first time it is needed, caches the shared library per source, flags and CPU
(``$WEIGHTFABRIC_CACHE``, default ``~/.cache/weightfabric``), loads it with
`ctypes` (calls release the GIL) and splits a buffer over ``torch.get_num_threads()``
threads. Where there is no C compiler, or with ``WEIGHTFABRIC_NATIVE=0``,
`checksum_library` returns None and callers use the torch reference: same results,
slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xBF58476D1CE4E5B9ULL
#define K3 0x94D049BB133111EBULL

/* Add to out[c] the mixed words of chunk c found in words [a, b) of w; word k of w
   sits at position base + k of the whole byte space (see kernels/checksum.py). */
void wf_mixed_sums(const uint32_t *w, size_t a, size_t b, uint64_t base, size_t chunk_words,
                   uint64_t *out) {
    size_t i = a;
    while (i < b) {
        size_t c = i / chunk_words, end = (c + 1) * chunk_words;
        if (end > b) end = b;
        uint64_t s = 0;
        for (size_t k = i; k < end; k++) {
            uint64_t x = ((uint64_t)w[k] ^ ((base + k) * K1)) * K2;
            x ^= x >> 31;
            x *= K3;
            s += x ^ (x >> 29);
        }
        out[c] += s;
        i = end;
    }
}
"""

_MIN_TASK_WORDS = 1 << 20
"""Words (4 MiB) below which a buffer is not split over threads."""


def _cpu_key() -> str:
    """What the compiled code depends on besides its source: the CPU (for -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("WEIGHTFABRIC_CACHE") or Path.home() / ".cache" / "weightfabric"
    return Path(root)


def _build(target: Path, flags: list[str]) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "checksum.c", Path(tmp) / "checksum.so"
        src.write_text(SOURCE)
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log.debug("cc %s failed: %s", " ".join(flags), done.stderr[-500:])
            return False
        os.replace(out, target)  # atomic: concurrent builders leave one whole file
    return True


@functools.cache
def checksum_library() -> ctypes.CDLL | None:
    """The compiled checksum loop, built on first use; None if it cannot be (see module)."""
    if os.environ.get("WEIGHTFABRIC_NATIVE", "1") in ("0", ""):
        return None
    for flags in (["-O3", "-march=native"], ["-O3"]):
        key = hashlib.sha256("\0".join([SOURCE, *flags, _cpu_key()]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"checksum-{key}.so"
        try:
            if target.exists() or _build(target, flags):
                lib = ctypes.CDLL(str(target))
                lib.wf_mixed_sums.restype = None
                lib.wf_mixed_sums.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                              ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
                return lib
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("native checksum with %s unavailable: %s", flags, exc)
    log.warning("no C compiler could build the CPU checksum; using the torch reference "
                "(same results, several times slower)")
    return None


def _threads() -> int:
    """How many threads a large buffer is split over: torch's intra-op count."""
    return torch.get_num_threads()


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="wf-checksum")


# A forked child has the parent's pool object but none of its threads: start afresh.
os.register_at_fork(after_in_child=_pool.cache_clear)


def mixed_sums(words: torch.Tensor, chunk_words: int, base: int) -> torch.Tensor | None:
    """Per chunk, the wrapping sum of the mixed words of ``words`` (uint32, CPU, contiguous).

    Word ``k`` is at position ``base + k``; chunk ``c`` covers words
    ``[c * chunk_words, (c + 1) * chunk_words)``. Returns int64 sums (the length term
    not added), or None without the compiled loop.
    """
    lib = checksum_library()
    if lib is None:
        return None
    n = words.numel()
    num_chunks = -(-n // chunk_words)
    threads = max(1, min(_threads(), n // _MIN_TASK_WORDS))
    parts = torch.zeros(threads, max(num_chunks, 1), dtype=torch.int64)
    bounds = [n * t // threads for t in range(threads + 1)]
    ptr, out = words.data_ptr(), parts.data_ptr()

    def run(t: int) -> None:
        lib.wf_mixed_sums(ptr, bounds[t], bounds[t + 1], base % 2**64, chunk_words,
                          out + t * parts.shape[1] * 8)

    if threads == 1:
        run(0)
    else:
        list(_pool(threads).map(run, range(threads)))
    return parts.sum(0)[:num_chunks]


__all__ = ["SOURCE", "checksum_library", "mixed_sums"]
