"""The fetch engine: pull the chunks of one replica from its sources, verified.

The engine knows nothing of the hub's protocol. A `FetchPlanner` (the store
wires it to the hub) tells it, for the chunks still missing, which sources to
read from; the engine reads them with several chunks in flight, striping over
the sources it was given, verifies each chunk's checksum, writes it in place
(into the destination region other readers may already be reading from) and
marks it present, so a chain of readers pipelines. When a source fails, or a
chunk's bytes are wrong, only those chunks go back to the planner, which may
name other sources; chunks already fetched are kept.

::

    missing ──plan──► [chunks → ranked sources] ──read (N in flight)──► verify
       ▲                                                      │ ok: mark, report
       └──────────── failed source / bad checksum ◄───────────┘
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fabric.errors import FabricError, ReadRefusedError, TransportError
from fabric.progress import ChunkProgress
from fabric.transports import SourceAddress, Transport, local_host_id

log = logging.getLogger(__name__)


class FetchError(FabricError):
    """A fetch could not complete: no source left for some chunks, or out of time."""


@dataclass(frozen=True)
class Source:
    """A region of a worker that holds (or is fetching) the bytes."""

    worker: str
    address: SourceAddress
    region: str


@dataclass(frozen=True)
class Assignment:
    """Chunks to read and the sources that have them, best first. The engine
    stripes the chunks over the sources of the best `stripe` ranks."""

    chunks: tuple[int, ...]
    sources: tuple[Source, ...]
    stripe: int = 1


class FetchPlanner(Protocol):
    def plan(self, missing: list[int], failed: set[str]) -> list[Assignment]:
        """Sources for the `missing` chunks, avoiding the workers in `failed`."""

    def report(self, chunks: list[int]) -> None:
        """Chunks now present and verified here (the reader is a partial replica)."""


@dataclass
class FetchStats:
    """What one fetch did.

    Attributes:
        version: the version fetched.
        bytes, chunks, seconds: what this fetch read (chunks already present are not
            counted) and its wall time; `gbps` is their ratio.
        chunks_reread: reads of a chunk already tried once (its source failed, or its
            checksum was wrong).
        corrupted_chunks: reads whose checksum did not match.
        sources: worker -> bytes read from it.
        transports: transport name (``"shm"``, ``"tcp"``, ``"cuda_ipc"`` ...) -> bytes.
        failed_sources: workers given up on during this fetch.
    """

    version: int | None = None
    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    chunks_reread: int = 0
    corrupted_chunks: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # worker -> bytes read from it
    transports: dict[str, int] = field(default_factory=dict)  # "shm", "cuda_ipc"... -> bytes
    failed_sources: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """``bytes / seconds`` in GB/s (0 when nothing was timed)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """Every field and `gbps`, as plain data (for JSON)."""
        return {"version": self.version, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "chunks": self.chunks, "chunks_reread": self.chunks_reread,
                "corrupted_chunks": self.corrupted_chunks, "sources": dict(self.sources),
                "transports": dict(self.transports),
                "failed_sources": list(self.failed_sources)}


def verify_rule(verify: bool | None) -> Callable[[Source], bool]:
    """Whether to check the bytes read from a source against the published checksums:
    all (True), none (False), or by default (None) only those read from another host
    (on one host the copy is the transfer, and checksumming costs more than the copy)."""
    if verify is None:
        here = local_host_id()
        return lambda source: source.address.host_id != here
    return lambda source: verify


ChecksumFn = Callable[[int, torch.Tensor], int]
"""(chunk index, chunk bytes) -> checksum, the same function the publisher used."""


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """Concurrency and time limits of one fetch (``ModelStore.fetch(options=...)``).

    Attributes:
        max_inflight: chunk reads in flight at once.
        read_timeout: seconds to wait for one chunk (a partial source may still be
            fetching it).
        deadline: seconds the whole fetch may take.
        max_rounds: re-plans allowed before giving up.
        report_interval: seconds between progress reports to the hub.
    """

    max_inflight: int = 4
    """Chunk reads in flight at once."""
    read_timeout: float = 30.0
    """Longest wait for one chunk (a partial source may still be fetching it)."""
    deadline: float = 600.0
    """Longest the whole fetch may take."""
    max_rounds: int = 50
    """Re-plans allowed before giving up."""
    report_interval: float = 0.02
    """Seconds between progress reports to the planner (a hub round trip each):
    verified chunks are batched in between, and flushed when the fetch ends. Peers
    reading this partial replica are not delayed by it: they wait on the local
    chunk bitmap, which is marked per chunk."""


def fetch_chunks(dest: torch.Tensor, *, chunk_size: int, progress: ChunkProgress,
                 planner: FetchPlanner, choose: Callable[[Source], Transport],
                 checksums: list[int] | None = None, checksum_fn: ChecksumFn | None = None,
                 verify: Callable[[Source], bool] = lambda source: True,
                 options: FetchOptions = FetchOptions(),
                 on_chunk: Callable[[int, int], None] | None = None,
                 before_write: Callable[[int, int], None] | None = None) -> FetchStats:
    """Fill the missing chunks of `dest` (flat ``uint8``) from the planner's sources.

    Args:
        dest: the local replica's bytes; chunk ``c`` is ``dest[c*chunk_size : ...]``.
        chunk_size: bytes per chunk.
        progress: the local replica's chunk bitmap; chunks already present are kept.
        planner: source selection and progress reporting (see `FetchPlanner`).
        choose: the transport to read a source's region with (it may raise
            `TransportError`, e.g. when it must ask the source and cannot reach it).
        checksums, checksum_fn: expected per-chunk checksums and the function that
            computes one; verification is skipped when either is None.
        verify: whether to verify the chunks read from a source (e.g. only over
            slow or remote links).
        options: concurrency and time limits.
        on_chunk: called with (chunks done, chunks total) after every chunk.
        before_write: called with the byte range ``[lo, hi)`` of `dest` a read is about
            to write (e.g. to populate fresh pages first); what it raises ends the fetch.

    Returns:
        FetchStats of this call.

    Raises:
        FetchError: some chunks had no working source, or the deadline passed.
    """
    stats = FetchStats()
    start = time.monotonic()
    failed: set[str] = set()
    lock = threading.Lock()
    total = progress.num_chunks
    attempted: set[int] = set()
    corrupt_from: dict[int, set[str]] = {}  # chunk -> workers that sent it wrong
    unreported: list[int] = []
    last_report = start

    def flush_reports() -> None:
        nonlocal last_report
        if unreported:
            planner.report(sorted(unreported))
            unreported.clear()
        last_report = time.monotonic()

    def read_one(chunk: int, source: Source) -> tuple[int, Source, str | None, str]:
        lo = chunk * chunk_size
        hi = min(lo + chunk_size, dest.numel())
        piece = dest[lo:hi]
        if before_write is not None:
            before_write(lo, hi)
        via = "?"
        try:
            transport = choose(source)
            via = transport.name
            transport.read(source.address, source.region, lo, piece, timeout=options.read_timeout)
        except TransportError as exc:
            return chunk, source, f"{type(exc).__name__}: {exc}", via
        if checksums is not None and checksum_fn is not None and verify(source):
            got = checksum_fn(chunk, piece)
            if got != checksums[chunk]:
                return chunk, source, "checksum", via
        return chunk, source, None, via

    with ThreadPoolExecutor(max_workers=options.max_inflight,
                            thread_name_prefix="wf-fetch") as pool:
        for _ in range(options.max_rounds):
            missing = [c for c in range(total) if not progress.has(c, c)]
            if not missing:
                break
            if time.monotonic() - start > options.deadline:
                raise FetchError(f"fetch ran past its deadline of {options.deadline:g} s with "
                                 f"{len(missing)} of {total} chunks missing")
            work = _schedule(planner.plan(missing, set(failed)), missing, corrupt_from)
            if not work:
                raise FetchError(f"no source for chunks {_ranges(missing)}: every holder failed "
                                 f"or left ({', '.join(sorted(failed)) or 'none failed'})")
            pending: set[Future] = set()
            queue = list(work)
            while queue or pending:
                while queue and len(pending) < options.max_inflight:
                    chunk, source = queue.pop(0)
                    if source.worker in failed:
                        continue
                    pending.add(pool.submit(read_one, chunk, source))
                if not pending:  # the rest was assigned to sources that failed: re-plan
                    break
                left = options.deadline - (time.monotonic() - start)
                done, pending = wait(pending, timeout=max(0.0, left), return_when=FIRST_COMPLETED)
                if not done:
                    raise FetchError(f"fetch ran past its deadline of {options.deadline:g} s "
                                     f"with {len(pending)} reads still waiting on sources")
                finished: list[int] = []
                for future in done:
                    chunk, source, error, via = future.result()
                    with lock:
                        if chunk in attempted:
                            stats.chunks_reread += 1
                        attempted.add(chunk)
                    if error is None:
                        nbytes = min(chunk_size, dest.numel() - chunk * chunk_size)
                        progress.mark(chunk)
                        stats.bytes += nbytes
                        stats.chunks += 1
                        stats.sources[source.worker] = stats.sources.get(source.worker, 0) + nbytes
                        stats.transports[via] = stats.transports.get(via, 0) + nbytes
                        finished.append(chunk)
                    elif error == "checksum":
                        stats.corrupted_chunks += 1
                        corrupt_from.setdefault(chunk, set()).add(source.worker)
                        log.warning("chunk %d from %s failed its checksum; re-reading",
                                    chunk, source.worker)
                    else:
                        if source.worker not in failed and not _transient(error):
                            failed.add(source.worker)
                            stats.failed_sources.append(source.worker)
                            log.warning("source %s failed (%s); re-planning its chunks",
                                        source.worker, error)
                if finished:
                    unreported.extend(finished)
                    if time.monotonic() - last_report >= options.report_interval:
                        flush_reports()
                    if on_chunk is not None:
                        on_chunk(progress.count, total)
            flush_reports()
        else:
            missing = [c for c in range(total) if not progress.has(c, c)]
            if missing:
                raise FetchError(f"gave up after {options.max_rounds} re-plans; chunks "
                                 f"{_ranges(missing)} still missing")
    stats.seconds = time.monotonic() - start
    return stats


def _transient(error: str) -> bool:
    """A partial source that did not have the chunk in time is slow, not dead."""
    return error.startswith(ReadRefusedError.__name__) and "NOT_READY" in error


def _schedule(assignments: list[Assignment], missing: list[int],
              avoid: dict[int, set[str]]) -> list[tuple[int, Source]]:
    """(chunk, source) pairs in chunk order, striped over each assignment's best
    sources, never pairing a chunk with a source that already sent it corrupted."""
    wanted = set(missing)
    pairs: dict[int, Source] = {}
    for a in assignments:
        for i, chunk in enumerate(c for c in a.chunks if c in wanted and c not in pairs):
            usable = [s for s in a.sources if s.worker not in avoid.get(chunk, ())]
            if usable:
                stripe = usable[:max(1, a.stripe)]
                pairs[chunk] = stripe[i % len(stripe)]
    return sorted(pairs.items())


def _ranges(chunks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out: list[str] = []
    for c in sorted(chunks):
        if out and int(out[-1].split("-")[-1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ", ".join(out)
