"""The CPU checksum in one fused pass: a small C loop built with the machine's C compiler.

`kernels.checksum` defines the per-chunk checksum; its torch reference makes one pass
over memory per arithmetic step (about 0.6-2.5 GB/s on a 2-core VM). This module
compiles the same arithmetic as one C loop (``cc -O3 -march=native``: AVX2
intrinsics where the CPU has them, four pairs per instruction, else a plain loop
the compiler vectorises as it can), which can also copy the bytes it reads (with
streaming stores for large copies), the first time it is needed, caches the shared library per source, flags and CPU
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
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#define K1 0x9E3779B97F4A7C15ULL

static inline uint64_t mix(uint64_t d, uint64_t pk) {
    uint64_t k = d ^ pk;
    return (uint64_t)(uint32_t)k * (k >> 32) + d;
}

/* The sum of the mixed pairs [a, b) of w, pair a at position pos; copies them to dst
   unless dst is NULL, with streaming stores if stream (large copies: the bytes are
   not read again soon, and streaming spares reading dst's lines in first). */
static uint64_t run(uint32_t *dst, const uint32_t *w, size_t a, size_t b, uint64_t pos,
                    int stream) {
    uint64_t s = 0, d;
    size_t k = a;
#ifdef __AVX2__
    if (stream)  /* whole 32-byte stores from here on */
        for (; k < b && ((uintptr_t)(dst + 2 * k) & 31); k++) {
            memcpy(&d, w + 2 * k, 8);
            memcpy(dst + 2 * k, &d, 8);
            s += mix(d, (pos + k - a) * K1);
        }
    if (k + 4 <= b) {
        uint64_t p0 = pos + k - a;
        __m256i acc = _mm256_setzero_si256(), step = _mm256_set1_epi64x((long long)(4 * K1));
        __m256i pk = _mm256_set_epi64x((long long)((p0 + 3) * K1), (long long)((p0 + 2) * K1),
                                       (long long)((p0 + 1) * K1), (long long)(p0 * K1));
        for (; k + 4 <= b; k += 4) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2 * k));
            if (dst != NULL) {
                if (stream) _mm256_stream_si256((__m256i *)(dst + 2 * k), v);
                else _mm256_storeu_si256((__m256i *)(dst + 2 * k), v);
            }
            __m256i x = _mm256_xor_si256(v, pk);
            x = _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32));
            acc = _mm256_add_epi64(acc, _mm256_add_epi64(x, v));
            pk = _mm256_add_epi64(pk, step);
        }
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        s += lanes[0] + lanes[1] + lanes[2] + lanes[3];
        if (stream) _mm_sfence();
    }
#endif
    for (; k < b; k++) {
        memcpy(&d, w + 2 * k, 8);
        if (dst != NULL) memcpy(dst + 2 * k, &d, 8);
        s += mix(d, (pos + k - a) * K1);
    }
    return s;
}

/* Add to out[c] the mixed pairs of pairs [a, b) of w that fall in chunk c (counted from
   the chunk holding w's pair 0); pair k of w sits at position base + k of the whole byte
   space (see kernels/checksum.py). With dst, also copy those pairs to it. */
void wf_pair_sums(uint32_t *dst, const uint32_t *w, size_t a, size_t b, uint64_t base,
                  uint64_t chunk_pairs, uint64_t *out) {
    int stream = dst != NULL && (b - a) * 8 >= (1u << 20) && ((uintptr_t)dst & 7) == 0;
    uint64_t first = base / chunk_pairs;
    size_t k = a;
    while (k < b) {
        uint64_t c = (base + k) / chunk_pairs;
        size_t end = (size_t)((c + 1) * chunk_pairs - base);
        if (end > b) end = b;
        out[c - first] += run(dst, w, k, end, base + k, stream);
        k = end;
    }
}

/* wf_pair_sums over `rows` rows of `row_pairs` pairs each: row r is read at w + r *
   stride_words and lands (in dst, if not NULL, and in the byte space) right after row
   r - 1, from position base on; out counts chunks from the one holding base. */
void wf_rows_sums(uint32_t *dst, const uint32_t *w, size_t rows, size_t row_pairs,
                  size_t stride_words, uint64_t base, uint64_t chunk_pairs, uint64_t *out) {
    uint64_t first = base / chunk_pairs;
    for (size_t r = 0; r < rows; r++) {
        uint64_t at = base + r * row_pairs;
        wf_pair_sums(dst == NULL ? NULL : dst + 2 * r * row_pairs, w + r * stride_words, 0,
                     row_pairs, at, chunk_pairs, out + (at / chunk_pairs - first));
    }
}

/* The words of n that differ from b (nwords words of `width` bytes, 1, 2, 4 or 8):
   their indices into pos and their bytes into vals, in order, at most cap of them.
   32 bytes at a time are compared with AVX2 and only the words whose bytes differ are
   visited; without AVX2, 64 bytes at a time as eight 64-bit lanes, and a lane that
   differs word by word. Returns the number of changed words, or cap + 1 once there
   are more than cap (then pos and vals hold the first cap). */
size_t wf_delta_scan(const uint8_t *b, const uint8_t *n, size_t nwords, size_t width,
                     int64_t *pos, uint8_t *vals, size_t cap) {
    size_t nbytes = nwords * width, count = 0, i = 0;
    uint64_t mask = width == 8 ? ~0ULL : (1ULL << (8 * width)) - 1;
#ifdef __AVX2__
    /* 32 bytes at a time: a byte mask of the differences, then only its set bits */
    uint64_t word_bits = (1ULL << width) - 1;
    for (; i + 32 <= nbytes; i += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(b + i));
        __m256i y = _mm256_loadu_si256((const __m256i *)(n + i));
        uint64_t diff = (uint32_t)~_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, y));
        while (diff) {
            size_t o = (size_t)__builtin_ctzll(diff);
            o -= o % width;
            diff &= ~(word_bits << o);
            if (count == cap) return cap + 1;
            pos[count] = (int64_t)((i + o) / width);
            memcpy(vals + count * width, n + i + o, width);
            count++;
        }
    }
#endif
    for (; i + 64 <= nbytes; i += 64) {
        uint64_t x[8], y[8], any = 0;
        memcpy(x, b + i, 64);
        memcpy(y, n + i, 64);
        for (int k = 0; k < 8; k++) any |= x[k] ^ y[k];
        if (!any) continue;
        for (int k = 0; k < 8; k++) {
            uint64_t d = x[k] ^ y[k];
            for (size_t w = 0; d != 0 && w < 8; w += width, d = width == 8 ? 0 : d >> (8 * width)) {
                if (!(d & mask)) continue;
                if (count == cap) return cap + 1;
                size_t at = i + 8 * (size_t)k + w;
                pos[count] = (int64_t)(at / width);
                memcpy(vals + count * width, n + at, width);
                count++;
            }
        }
    }
    for (; i < nbytes; i += width) {
        if (memcmp(b + i, n + i, width) == 0) continue;
        if (count == cap) return cap + 1;
        pos[count] = (int64_t)(i / width);
        memcpy(vals + count * width, n + i, width);
        count++;
    }
    return count;
}
"""

_MIN_TASK_PAIRS = 1 << 19
"""Pairs (4 MiB) below which a buffer is not split over threads."""


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
                lib.wf_pair_sums.restype = None
                lib.wf_pair_sums.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64,
                                             ctypes.c_void_p]
                lib.wf_delta_scan.restype = ctypes.c_size_t
                lib.wf_delta_scan.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_size_t]
                lib.wf_rows_sums.restype = None
                lib.wf_rows_sums.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                                             ctypes.c_uint64, ctypes.c_void_p]
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


def pair_sums(words: torch.Tensor, dst: torch.Tensor | None, chunk_pairs: int,
              base: int) -> torch.Tensor | None:
    """Per chunk, the wrapping sum of the mixed pairs of ``words`` (see `kernels.checksum`).

    ``words`` is uint32, CPU, contiguous; its whole pairs are summed (an odd last word is
    the caller's), pair ``k`` at position ``base + k``; chunk ``c`` covers positions
    ``[c * chunk_pairs, (c + 1) * chunk_pairs)``, and the result lists the chunks from the
    one holding ``base`` on. With ``dst`` (uint32, as long), the pairs are also copied
    there in the same pass. Returns int64 sums (no length term), or None without the
    compiled loop.
    """
    lib = checksum_library()
    if lib is None:
        return None
    n = words.numel() // 2
    num_chunks = (base + n - 1) // chunk_pairs - base // chunk_pairs + 1 if n else 0
    threads = max(1, min(_threads(), n // _MIN_TASK_PAIRS))
    parts = torch.zeros(threads, max(num_chunks, 1), dtype=torch.int64)
    bounds = [n * t // threads for t in range(threads + 1)]
    src, out = words.data_ptr(), parts.data_ptr()
    to = None if dst is None else dst.data_ptr()

    def run(t: int) -> None:
        lib.wf_pair_sums(to, src, bounds[t], bounds[t + 1], base % 2**64, chunk_pairs,
                         out + t * parts.shape[1] * 8)

    if threads == 1:
        run(0)
    else:
        list(_pool(threads).map(run, range(threads)))
    return parts.sum(0)[:num_chunks]


def rows_sums(rows: torch.Tensor, dst: torch.Tensor | None, chunk_pairs: int,
              base: int) -> torch.Tensor | None:
    """`pair_sums` of a row-strided block, rows laid end to end.

    ``rows`` is a 2-D uint8 CPU view ``[n, row_bytes]`` whose rows are contiguous, ``row_bytes``
    a multiple of 8 and the row stride a multiple of 4; row ``r`` takes positions ``base +
    r * row_bytes / 8`` on. With ``dst`` (uint8, contiguous, ``n * row_bytes`` bytes), the
    rows are also copied there, end to end, in the same pass (one thread). Returns int64
    sums per chunk from the one holding ``base`` (no length term), or None without the
    compiled loop.
    """
    lib = checksum_library()
    if lib is None:
        return None
    n, row_bytes = rows.shape
    row_pairs = row_bytes // 8
    total = n * row_pairs
    num_chunks = (base + total - 1) // chunk_pairs - base // chunk_pairs + 1 if total else 0
    out = torch.zeros(max(num_chunks, 1), dtype=torch.int64)
    lib.wf_rows_sums(None if dst is None else dst.data_ptr(), rows.data_ptr(), n, row_pairs,
                     rows.stride(0) // 4, base % 2**64, chunk_pairs, out.data_ptr())
    return out[:num_chunks]


def delta_scan(base: torch.Tensor, new: torch.Tensor, width: int, cap: int
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The words of ``new`` that differ from ``base``: (positions int64, their bytes uint8).

    ``base`` and ``new`` are uint8, CPU, contiguous, of equal length, a multiple of
    ``width`` (1, 2, 4 or 8). One pass over both at memory speed (`kernels.delta`'s
    sparse encodings). None without the compiled loop, or when more than ``cap`` words
    differ (the caller's dense path is the better one then).
    """
    lib = checksum_library()
    if lib is None:
        return None
    nwords = new.numel() // width
    pos = torch.empty(cap, dtype=torch.int64)
    vals = torch.empty(cap * width, dtype=torch.uint8)
    count = lib.wf_delta_scan(base.data_ptr(), new.data_ptr(), nwords, width, pos.data_ptr(),
                              vals.data_ptr(), cap)
    if count > cap:
        return None
    return pos[:count], vals[:count * width]


__all__ = ["SOURCE", "checksum_library", "delta_scan", "pair_sums", "rows_sums"]
