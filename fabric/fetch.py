"""The fetch engine: pull the chunks of one replica from its sources, verified.

The engine knows nothing of the hub's protocol. A `FetchPlanner` (the store
wires it to the hub) tells it, for the chunks still missing, which sources to
read from; the engine reads them with several chunks in flight, striping over
the sources it was given, verifies each chunk's checksum, writes it in place
(into the destination region other readers may already be reading from) and
marks it present, so a chain of readers pipelines. When a source fails, or a
chunk's bytes are wrong, only those chunks go back to the planner, which may
name other sources; chunks already fetched are kept.

The engine works in rounds: a plan of every chunk still missing, then its reads.
The chunks of a read that fails, or is abandoned (below), or that fail their
checksum are re-planned at once, and their new reads go first, while the other
reads of the round go on. Chunks the planner cannot place then (it names no
source, or raises) wait for the next round, which begins once no read is left in
flight; its plan raises the error if there is still no source for them.

A read asks for a span of consecutive chunks (up to `FetchOptions.read_bytes`):
one lease or request and one copy instead of one per chunk, which is what keeps
small chunks fast. The source waits only for the span's first chunk and grants
the run of chunks it has from there (all of them, unless it is a partial replica
still filling); the rest of the span is asked for again.

The engine waits on its reads in short slices (`WAIT_SLICE`) and between them
looks at the deadline, at a cancel event, and at the sources the planner heard
are lost (the hub dropped them): a read from a lost source is abandoned and its
chunks re-planned at once, without waiting out its timeout. An abandoned read is
aborted (`ReadAbort`: its sockets are shut down) and never writes into the
destination again, before its chunks are read elsewhere or the fetch returns.

::

    missing ──plan──► [spans → ranked sources] ──read (N in flight)──► verify
       ▲                                                  │ each chunk ok: mark, report
       └──────────── failed source / bad checksum ◄───────┘
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from weightfabric.fabric.deltas import DeltaBase, delta_mode
from weightfabric.fabric.errors import FabricError, FetchError, NoBaseError, TransportError
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadAbort, SourceAddress, Transport, local_host_id
from weightfabric.fabric.transports.base import CopyFn, Landing, StreamCopy
from weightfabric.fabric.transports.held import HeldLease
from weightfabric.kernels.delta import DeltaFormatError, decode_delta

log = logging.getLogger(__name__)

WAIT_SLICE = 0.25
"""Seconds between the engine's looks at the deadline, the cancel event and lost sources."""
MAX_STREAMS = 16
"""Most reads in flight a broadcast plan's assignments raise `FetchOptions.max_inflight` to."""
LAND_BYTES = 256 << 10
"""Bytes at least between two looks at what a read has landed (whole chunks, at least
one): each chunk is verified and marked before the read ends, so a relay forwards it."""
DEVICE_LAND_BYTES = 64 << 20
"""The same for a read that copies on a device stream (`base.StreamCopy`): each piece is one
launch and one event, so fewer, larger ones (a launch costs what copying ~20 MB does on a GPU)."""
IDLE_REPORT_S = 1.0
"""Seconds without a new chunk after which a fetch reports the chunks it has not reported
(one of its `FetchOptions.max_reports`): a reader held up by a partial source."""


@dataclass(frozen=True)
class Source:
    """A region of a worker that holds (or is fetching) the bytes."""

    worker: str
    address: SourceAddress
    region: str


@dataclass(frozen=True)
class Assignment:
    """Chunks to read and the sources that have them, best first.

    The engine stripes the chunks over the sources of the best `stripe` ranks, and keeps
    at least `window` bytes of them in flight (a path's bandwidth-delay product): as
    many reads as that takes, plus one.
    """

    chunks: tuple[int, ...]
    sources: tuple[Source, ...]
    stripe: int = 1
    window: int = 0


class FetchPlanner(Protocol):
    """Where a fetch reads its chunks from; told what it got and whom it lost."""
    def plan(self, missing: list[int], failed: set[str]) -> list[Assignment]:
        """Sources for the `missing` chunks, avoiding the workers in `failed`."""

    def report(self, chunks: list[int]) -> None:
        """Chunks now present and verified here (the reader is a partial replica)."""

    def lost(self) -> set[str]:
        """Workers this fetch reads from that are gone (e.g. the hub dropped them).

        Their reads in flight are abandoned and their chunks re-planned. Optional: a planner
        without it hears of none.
        """

    # Also optional: ``max_reports`` (int or None, `HubPlanner.max_reports`): milestone
    # reports the planner asks for at most, below `FetchOptions.max_reports`;
    # ``planned`` (bool attribute, `HubPlanner.planned`): the assignments
    # follow a broadcast plan, and the engine keeps a read in flight for each; and
    # ``completes`` (bool attribute, `HubPlanner.completes`): the fetch is completed at the
    # planner's side right after it returns (the hub's ``complete_fetch`` records every
    # chunk), so the engine leaves the chunks verified since its last report to that.


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
        sources: worker -> bytes read from it (delivered: a delta counts as what it decodes to).
        wire_bytes, wire: bytes that crossed to this reader (deltas as encoded), in all and
            per worker; equal to the delivered bytes without deltas.
        delta_chunks: chunks that came as deltas (`fabric.deltas`).
        transports: transport name (``"shm"``, ``"tcp"``, ``"cuda_ipc"`` ...) -> bytes.
        failed_sources: workers given up on during this fetch.
        leases: lease round trips this fetch took from its holders (a held lease covers
            every read of one holder's region: at most one per holder unless it had to be
            taken again after a failure).
        streams: the most reads this fetch had in flight at once.
    """

    version: int | None = None
    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    chunks_reread: int = 0
    corrupted_chunks: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # worker -> bytes read from it
    wire_bytes: int = 0
    wire: dict[str, int] = field(default_factory=dict)  # worker -> bytes on the wire
    delta_chunks: int = 0
    transports: dict[str, int] = field(default_factory=dict)  # "shm", "cuda_ipc"... -> bytes
    failed_sources: list[str] = field(default_factory=list)
    leases: int = 0
    streams: int = 0

    @property
    def gbps(self) -> float:
        """``bytes / seconds`` in GB/s (0 when nothing was timed)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """Every field and `gbps`, as plain data (for JSON)."""
        return {"version": self.version, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "chunks": self.chunks, "chunks_reread": self.chunks_reread,
                "corrupted_chunks": self.corrupted_chunks, "sources": dict(self.sources),
                "wire_bytes": self.wire_bytes, "wire": dict(self.wire),
                "delta_chunks": self.delta_chunks,
                "transports": dict(self.transports),
                "failed_sources": list(self.failed_sources), "leases": self.leases,
                "streams": self.streams}


def verify_rule(verify: bool | None) -> Callable[[Source], bool]:
    """Whether to check the bytes read from a source against the published checksums.

    All (True, and by default: None), or none (False: for those who measured and accept
    the risk). On one host the check costs nothing measurable: shared-memory reads
    checksum the bytes in the copy (`Transport.fuses_copy`), and that copy is faster
    than ``copy_`` (`docs/benchmarks.md`, ``fabric bench fetch --verify both``).
    """
    check = verify is None or bool(verify)
    return lambda source: check


def band_verify_rule(verify: bool | None) -> Callable[[Source], bool]:
    """`verify_rule` for reads of byte bands (resharding, deriving an engine layout).

    All (True), none (False), or by default (None) only bands read from another host.
    A verified band is widened to the whole chunks around it (a chunk's checksum covers
    the chunk), which multiplies what derivers read from the trainer (2.8 x S against
    1.16 x S in `fabric bench layouts`), so on one host bands are not verified unless
    asked; what they derive is checksummed, and every copy of it verified.
    """
    if verify is None:
        here = local_host_id()
        return lambda source: source.address.host_id != here
    return lambda source: bool(verify)


ChecksumFn = Callable[[int, torch.Tensor], list[int]]
"""(first chunk index, bytes of whole chunks from it, end to end) -> their checksums, one
per chunk, the function the publisher used: a read's chunks checksummed in one call (one
kernel launch and one device sync on a GPU, not one per chunk)."""

CopyChecksumFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(dst, src, first chunk) -> the checksums of the chunks copied (int64, on the bytes'
device): copies ``src`` into ``dst`` (chunk-aligned) and checksums them in the same pass,
as `ChecksumFn` would (`kernels.copy_with_checksums`; on a GPU one launch, no sync)."""


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """Concurrency and time limits of one fetch (``ModelStore.fetch(options=...)``).

    Attributes:
        max_inflight: reads in flight at once; for a planner whose ``planned`` is true (the
            hub routes the fetch along a broadcast plan), at least one per assignment, up to
            `MAX_STREAMS`: each stripe tree keeps a read in flight.
        read_bytes: the most bytes one read asks a source for (see below).
        read_timeout: seconds to wait for one read (a partial source may still be
            fetching its chunks).
        deadline: seconds the whole fetch may take.
        max_rounds: planner calls allowed before giving up.
        report_interval: seconds at least between two progress reports to the hub.
        max_reports: progress reports before the last one, at most (at chunk milestones).
    """

    max_inflight: int = 4
    """Reads in flight at once."""
    read_bytes: int = 64 * 2**20
    """Most bytes one read asks a source for: consecutive chunks are asked for
    together, up to this size and to an even share of the chunks per read in flight,
    and the source grants those it has from the first (see the module docstring).
    Chunks re-read after a bad checksum are read alone. At most the chunk size: one
    chunk per read."""
    read_timeout: float = 30.0
    """Longest wait for one read (a partial source may still be fetching its chunks),
    and never beyond the deadline. A source that does not answer in time, or a partial
    one that did not get the chunk in time, counts as failed and its chunks are
    re-planned without it."""
    deadline: float = 600.0
    """Longest the whole fetch may take: past it the fetch raises `FetchError` within
    about `WAIT_SLICE`, aborting the reads still in flight."""
    max_rounds: int = 50
    """Planner calls allowed before giving up: each round's plan of the chunks still
    missing, and each re-plan, within a round, of the chunks of failed reads."""
    report_interval: float = 0.02
    """Seconds at least between two progress reports to the planner (a hub round trip
    each): verified chunks are batched in between, and the rest is reported when the
    reads end, before the fetch returns. Peers reading this partial replica are not
    delayed by the reports: they wait on the local chunk bitmap, marked per chunk."""
    max_reports: int | None = 2
    """Progress reports a fetch sends before its last one, at most: one each time the
    chunks it verified pass another ``1 / (max_reports + 1)`` of those it reads (the
    batch goes when the next read finishes, or within a `WAIT_SLICE`), or sooner when no
    chunk came for `IDLE_REPORT_S` (it waits on a partial source). A fetch costs the hub
    at most ``max_reports + 1`` reports however long it takes (``max_reports`` when its
    planner completes it, `HubPlanner.completes`), so a broadcast to N readers is O(N)
    operations, not N x its duration. Readers chain through a partial replica without
    its reports: the hub names it as a ``wait`` for the chunks it has not reported, and
    its read server holds a read until they arrive (docs/hub.md, "Progress and
    pipelining"). None: a report every `report_interval`, as before (`fabric bench hub
    --broadcast N --max-reports none` simulates that)."""
    deltas: str | None = None
    """Ask sources for deltas against a version this reader holds (`fabric.deltas`):
    ``"auto"``, ``"on"`` or ``"off"``; None: ``$WEIGHTFABRIC_DELTAS``, else ``"auto"``."""


def fetch_chunks(dest: torch.Tensor, *, chunk_size: int, progress: ChunkProgress,
                 planner: FetchPlanner, choose: Callable[[Source], Transport],
                 checksums: list[int] | None = None, checksum_fn: ChecksumFn | None = None,
                 copy_checksums: CopyChecksumFn | None = None,
                 verify: Callable[[Source], bool] = lambda source: True,
                 options: FetchOptions = FetchOptions(),
                 on_chunk: Callable[[int, int], None] | None = None,
                 before_write: Callable[[int, int], None] | None = None,
                 cancel: threading.Event | None = None,
                 deferred: dict[int, int] | None = None,
                 delta: DeltaBase | None = None) -> FetchStats:
    """Fill the missing chunks of `dest` (flat ``uint8``) from the planner's sources.

    Args:
        dest: the local replica's bytes; chunk ``c`` is ``dest[c*chunk_size : ...]``.
        chunk_size: bytes per chunk.
        progress: the local replica's chunk bitmap; chunks already present are kept.
        planner: source selection and progress reporting (see `FetchPlanner`).
        choose: the transport to read a source's region with (it may raise
            `TransportError`, e.g. when it must ask the source and cannot reach it).
        checksums, checksum_fn: expected per-chunk checksums and the function that
            computes those of a run of chunks; verification is skipped when either is None.
        copy_checksums: the same checksums computed while copying, for transports that
            copy (`Transport.fuses_copy`): a verified read then passes over the bytes
            once, not twice.
        verify: whether to verify the chunks read from a source (e.g. only over
            slow or remote links).
        options: concurrency and time limits.
        on_chunk: called with (chunks done, chunks total) as chunks arrive: once for
            each batch of chunks verified together (the reads that finished in one
            wait), after that batch is marked (its report to the planner goes out on a
            thread of its own, so a slow hub holds up no read; every chunk is reported
            before the fetch returns).
        before_write: called with the byte range ``[lo, hi)`` of `dest` a read is about
            to write (e.g. to populate fresh pages first); what it raises ends the fetch.
        cancel: set from another thread to stop the fetch within `WAIT_SLICE`.
        deferred: for bytes whose checksums are not known yet (a version its holder is
            still deriving, `ModelStore.fetch`): with ``checksums`` None, the checksum of
            every chunk ``verify`` selects is computed (in the copy where the transport
            fuses it) and stored here by chunk index, for the caller to compare later.
        delta: a version this reader holds whole, to ask sources for deltas against
            (`fabric.deltas`; ``options.deltas`` and its policy say from which). Each
            chunk decoded is verified like any other (its checksum is computed after
            the decode).

    Returns:
        FetchStats of this call.

    Raises:
        FetchError: some chunks had no working source, the deadline passed, or
            `cancel` was set. Once it returns or raises, no read of this call
            touches `dest` again.
    """
    return _FetchRun(dest, chunk_size=chunk_size, progress=progress, planner=planner,
                     choose=choose, checksums=checksums, checksum_fn=checksum_fn,
                     copy_checksums=copy_checksums, verify=verify, options=options,
                     on_chunk=on_chunk, before_write=before_write, cancel=cancel,
                     deferred=deferred, delta=delta).run()


_Queued = tuple[tuple[int, ...], Source]
"""A read to start: (span of consecutive chunks, the source to read it from)."""


class _InFlight(NamedTuple):
    """A read started and not yet looked at."""

    span: tuple[int, ...]
    source: Source
    claim: _Claim


class _FetchRun:
    """One call of `fetch_chunks`: its state, and the steps of its loop.

    `run` repeats rounds until no chunk is missing: `plan_round` plans every chunk
    still missing into `queue`; then, until the queue is empty and no read is in
    flight, `launch` starts reads, `wait_slice` waits up to a `WAIT_SLICE` for some to
    finish, `absorb_lost` abandons the reads of sources the planner heard are lost,
    `settle` takes in each finished read, `requeue` puts what is left to read back at
    the front of the queue (re-planned if need be) and `report` tells the planner and
    `on_chunk` of the chunks that landed meanwhile (`take_landed`). `read_span` is what
    a read does, on a thread of `pool`: its chunks are verified and marked as they land
    (`_Arrivals`), before the read returns; it touches nothing of the run but `dest`,
    `progress` and `landed`.
    """

    def __init__(self, dest: torch.Tensor, *, chunk_size: int, progress: ChunkProgress,
                 planner: FetchPlanner, choose: Callable[[Source], Transport],
                 checksums: list[int] | None, checksum_fn: ChecksumFn | None,
                 copy_checksums: CopyChecksumFn | None,
                 verify: Callable[[Source], bool], options: FetchOptions,
                 on_chunk: Callable[[int, int], None] | None,
                 before_write: Callable[[int, int], None] | None,
                 cancel: threading.Event | None, deferred: dict[int, int] | None,
                 delta: DeltaBase | None = None) -> None:
        self.dest, self.chunk_size, self.progress = dest, chunk_size, progress
        self.planner, self.choose, self.options = planner, choose, options
        self.checksums, self.checksum_fn, self.verify = checksums, checksum_fn, verify
        self.copy_checksums, self.deferred = copy_checksums, deferred
        self.on_chunk, self.before_write, self.cancel = on_chunk, before_write, cancel
        self.delta, self.delta_mode = delta, delta_mode(options.deltas)
        self.no_base: set[str] = set()  # workers that hold none of the delta's bases
        self.whole: set[int] = set()  # chunks a delta failed for: read whole from now on
        self.lost_news: Callable[[], set[str]] = getattr(planner, "lost", set)
        self.total = progress.num_chunks
        self.chunks_per_read = max(1, options.read_bytes // chunk_size)
        self.start = time.monotonic()
        self.stats = FetchStats()
        self.failed: dict[str, str] = {}  # worker given up on -> why
        self.corrupt_from: dict[int, set[str]] = {}  # chunk -> workers that sent it wrong
        self.attempted: set[int] = set()  # chunks some finished read has tried
        self.plans = 0  # planner calls, bounded by max_rounds
        self.queue: list[_Queued] = []  # reads of this round not started yet, in order
        self.inflight: dict[Future[_Read], _InFlight] = {}
        self.pool = self._new_pool()
        self.streams = options.max_inflight  # reads in flight at most (`schedule` raises it)
        self.unreported: list[int] = []  # verified chunks not yet told to the planner
        self.last_report = self.start
        self.target = self.total - progress.count  # chunks this call reads (its milestones)
        self.mid_reports = 0  # reports sent before the last one (`FetchOptions.max_reports`)
        self.last_chunk = self.start  # when chunks last came (`IDLE_REPORT_S`)
        # Reports go out on their own thread: a hub far away (another datacenter) must not
        # hold up the loop that starts the next reads.
        self.reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wf-report")
        self.reporting: Future[None] | None = None
        # One held lease per source whose transport holds (`fabric.transports.held`): taken
        # by the first read from it, shared by the rest, ended when no read of the source
        # is queued or in flight (`end_idle_leases`), or when the fetch ends.
        self.held: dict[Source, HeldLease] = {}
        self.holding: dict[Source, threading.Lock] = {}  # one lease taken at a time per source
        self.retired: list[HeldLease] = []  # failed or lapsed, closed with the rest at the end
        self.held_lock = threading.Lock()  # `held`, `holding` and `stats.leases`
        # Chunks verified and marked by the reads, not yet counted and reported (`landed_lock`)
        self.landed: list[tuple[int, str, str, bool]] = []  # (chunk, worker, via, delta)
        self.landed_lock = threading.Lock()
        self.land_step = -(-LAND_BYTES // chunk_size) * chunk_size
        self.device_land_step = -(-DEVICE_LAND_BYTES // chunk_size) * chunk_size

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> FetchStats:
        """Fetch every missing chunk; abandon what is still in flight however it ends."""
        try:
            while missing := [c for c in range(self.total) if not self.progress.has(c, c)]:
                self.queue = self.plan_round(missing)
                while self.queue or self.inflight:
                    self.launch()
                    if not self.inflight:  # the rest was assigned to sources that failed:
                        break              # the next round re-plans it
                    done = self.wait_slice()
                    retry = self.absorb_lost()  # chunks to read elsewhere, none in flight
                    rests: list[_Queued] = []
                    for future in done:
                        read = future.result()
                        if read.rest:  # a partial source granted a prefix: ask again for the rest
                            rests.append((read.rest, read.source))
                        retry += self.settle(read)
                    self.requeue(rests, retry)
                    self.report(self.take_landed())
                    if not self.queue:
                        self.end_idle_leases()
            # the last report: every chunk before returning, unless the completion says it
            self.flush_reports(wait=True, rest=not getattr(self.planner, "completes", False))
        finally:
            self.close()
        self.stats.seconds = time.monotonic() - self.start
        return self.stats

    def plan_round(self, missing: list[int]) -> list[_Queued]:
        """The reads of a new round, for every chunk still `missing`.

        Raises if the rounds or the deadline ran out, or the planner names no source.
        """
        if self.plans >= self.options.max_rounds:
            raise FetchError(f"gave up after {self.options.max_rounds} re-plans; chunks "
                             f"{_ranges(missing)} still missing")
        if self.time_left() < 0:
            raise FetchError(f"fetch ran past its deadline of {self.options.deadline:g} s with "
                             f"{len(missing)} of {self.total} chunks missing")
        self.plans += 1
        queue = self.schedule(self.planner.plan(missing, set(self.failed)), missing)
        if not queue:
            raise _no_source_left(missing, self.failed, self.corrupt_from)
        return queue

    def launch(self) -> None:
        """Start queued reads, up to `streams` in flight (skipping failed sources)."""
        while self.queue and len(self.inflight) < self.streams:
            span, source = self.queue.pop(0)
            if source.worker in self.failed:
                continue
            claim = _Claim()
            future = self.pool.submit(self.read_span, span, source, claim)
            self.inflight[future] = _InFlight(span, source, claim)
            self.stats.streams = max(self.stats.streams, len(self.inflight))

    def wait_slice(self) -> set[Future[_Read]]:
        """Wait up to a `WAIT_SLICE` for reads to finish and take them out of `inflight`.

        Raises once the deadline has passed or the fetch is cancelled.
        """
        left = self.time_left()
        if left <= 0:
            raise FetchError(f"fetch ran past its deadline of {self.options.deadline:g} s "
                             f"with {len(self.inflight)} reads still waiting on sources")
        done, _ = wait(self.inflight, timeout=min(WAIT_SLICE, left), return_when=FIRST_COMPLETED)
        if self.cancel is not None and self.cancel.is_set():
            raise FetchError(f"fetch cancelled with {self.total - self.progress.count} of "
                             f"{self.total} chunks missing")
        for future in done:
            del self.inflight[future]
        return done

    def absorb_lost(self) -> list[int]:
        """Give up on the sources the planner heard are lost and abandon their reads in flight.

        Returns those reads' chunks (to re-plan).
        """
        gone = self.lost_news()
        for worker in gone - self.failed.keys():
            self.give_up(worker, "lost: the hub dropped it (its lease ran out, or it dropped "
                                 "the model)")
        stale = [f for f, read in self.inflight.items() if read.source.worker in gone]
        if not stale:
            return []
        chunks = [c for f in stale for c in self.inflight[f].span]
        self.revoke(stale)
        # Their threads may still be asking a hung source what it is (`choose`, never
        # touching `dest`): the next reads get threads of their own.
        self.pool.shutdown(wait=False)
        self.pool = self._new_pool()
        return chunks

    def settle(self, read: _Read) -> list[int]:
        """Take in a finished read (its good chunks were marked as they landed).

        Count its corrupt chunks against its source, give up on the source if the read
        failed. Returns the chunks to read elsewhere.
        """
        worker = read.source.worker
        self.stats.chunks_reread += sum(1 for c in read.span if c in self.attempted)
        self.attempted.update(read.span)
        if read.error is not None:
            self.give_up(worker, read.error)
            return [c for c in read.span if not self.progress.has(c, c)]
        bad: list[int] = []
        for chunk in read.corrupted:
            self.stats.corrupted_chunks += 1
            if read.delta:
                # decoded over this reader's own base, which may be what is wrong: read the
                # chunk whole next time, from any source (the sender is not to blame)
                self.whole.add(chunk)
                log.warning("chunk %d decoded from a delta failed its checksum; reading it "
                            "whole", chunk)
            else:
                self.corrupt_from.setdefault(chunk, set()).add(worker)
                log.warning("chunk %d from %s failed its checksum; re-reading", chunk, worker)
            bad.append(chunk)
        self.stats.wire_bytes += read.wire
        self.stats.wire[worker] = self.stats.wire.get(worker, 0) + read.wire
        if bad and not read.delta:
            self.report_corrupt(worker, bad)
        return bad

    def arrived(self, chunks: list[int], source: Source, via: str, delta: bool) -> None:
        """Mark `chunks`, verified (or not to be), as present; counted by `take_landed`.

        Called on a read's thread.
        """
        for chunk in chunks:
            self.progress.mark(chunk)
        with self.landed_lock:
            self.landed.extend((c, source.worker, via, delta) for c in chunks)

    def take_landed(self) -> list[int]:
        """Count the chunks marked since the last call in the stats; return them."""
        with self.landed_lock:
            landed, self.landed = self.landed, []
        stats = self.stats
        for chunk, worker, via, delta in landed:
            nbytes = self.chunk_bytes(chunk).numel()
            stats.bytes += nbytes
            stats.chunks += 1
            stats.sources[worker] = stats.sources.get(worker, 0) + nbytes
            stats.transports[via] = stats.transports.get(via, 0) + nbytes
            stats.delta_chunks += delta
        return [chunk for chunk, *_ in landed]

    def report_corrupt(self, worker: str, chunks: list[int]) -> None:
        """Tell the planner (if it listens: `HubPlanner.corrupt`) who sent corrupt chunks."""
        corrupt = getattr(self.planner, "corrupt", None)
        if corrupt is not None:
            corrupt(worker, chunks)

    def requeue(self, rests: list[_Queued], retry: list[int]) -> None:
        """Queue partial reads' rests, and re-planned reads of failed chunks, first.

        Put the `rests` of partial reads at the front of the queue, and the reads of the
        `retry` chunks and of those queued for a failed source, re-planned, before them.
        """
        self.queue[:0] = sorted(rests, key=lambda r: r[0][0])
        retry = retry + [c for span, source in self.queue if source.worker in self.failed
                         for c in span]
        self.queue = [(span, source) for span, source in self.queue
                      if source.worker not in self.failed]
        retry = [c for c in retry if not self.progress.has(c, c)]  # landed before a failure
        if retry and self.plans < self.options.max_rounds:
            self.plans += 1
            self.queue[:0] = self.replan(sorted(retry))

    def replan(self, chunks: list[int]) -> list[_Queued]:
        """Reads for chunks to read again within a round.

        None for those the planner cannot place now (the end-of-round plan then raises the
        proper error).
        """
        try:
            assignments = self.planner.plan(chunks, set(self.failed))
        except FabricError as exc:
            log.info("re-plan of chunks %s failed (%s); trying again after this round",
                     _ranges(chunks), exc)
            return []
        return self.schedule(assignments, chunks)

    def report(self, finished: list[int]) -> None:
        """Report the chunks verified so far when a report is due (`report_due`).

        Then call `on_chunk` if some chunks just finished. Called after every wait, also
        when none finished: a fetch waiting on a slow or partial source sends a report
        that fell due meanwhile within a `WAIT_SLICE`, not only when it ends.
        """
        self.unreported.extend(finished)
        now = time.monotonic()
        if finished:
            self.last_chunk = now
        if self.unreported and self.report_due(waiting=now - self.last_chunk >= IDLE_REPORT_S):
            self.flush_reports()
        if finished and self.on_chunk is not None:
            self.on_chunk(self.progress.count, self.total)

    def report_due(self, *, waiting: bool) -> bool:
        """Whether the chunks verified and not reported should go to the planner now.

        At least `FetchOptions.report_interval` after the previous report, and, with
        ``max_reports`` K, only K times before the last report, none on its way: when the
        chunks this call verified reach the next of ``target * m / (K + 1)`` (m = 1..K),
        or when the fetch is ``waiting`` (no chunk came for `IDLE_REPORT_S`: a reader held
        up by a partial source tells what it has meanwhile). A planner's ``max_reports``
        (the hub's budget, `HubPlanner.max_reports`) lowers K for the milestones; reports
        while waiting count against the engine's own K only.
        """
        if time.monotonic() - self.last_report < self.options.report_interval:
            return False
        own = self.options.max_reports
        asked = getattr(self.planner, "max_reports", None)
        if own is None and asked is None:
            return True
        if (own is not None and self.mid_reports >= own) or (self.reporting is not None
                                                             and not self.reporting.done()):
            return False
        if waiting:
            return True
        most = min(k for k in (own, asked) if k is not None)
        return (self.mid_reports < most
                and self.stats.chunks * (most + 1) >= (self.mid_reports + 1) * self.target)

    def flush_reports(self, *, wait: bool = False, rest: bool = True) -> None:
        """Report every chunk verified and not reported yet, on the reporter thread.

        While the previous report is still on its way the chunks wait for the next one,
        unless ``wait``: then every chunk is reported before this returns (with ``rest``
        false, only the report on its way is waited for). What a report raised is raised
        here, at the next flush.
        """
        if self.reporting is not None and (wait or self.reporting.done()):
            done, self.reporting = self.reporting, None
            done.result()
        if self.unreported and self.reporting is None and rest:
            self.reporting = self.reporter.submit(self.planner.report, sorted(self.unreported))
            self.unreported.clear()
            self.mid_reports += not wait
            if wait:
                self.flush_reports(wait=True)
        self.last_report = time.monotonic()

    def close(self) -> None:
        """Abandon the reads still in flight and let the pool go.

        Abandon the reads still in flight (none of them writes `dest` once this returns) and
        let the pool go.
        """
        self.revoke(list(self.inflight))
        self.end_leases()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.reporter.shutdown(wait=False)

    # --- the parts ------------------------------------------------------------------------

    def read_span(self, span: tuple[int, ...], source: Source, claim: _Claim) -> _Read:
        """Read `span` from `source` into `dest` (while `claim` holds), verified and marked.

        Each chunk is verified and marked as soon as it has landed, where the transport
        tells (`Landing`), else when the read returns. A `TransportError` becomes the
        read's error (the chunks that landed before it stay marked). Runs on a thread of
        `pool`.
        """
        lo = span[0] * self.chunk_size
        hi = min((span[-1] + 1) * self.chunk_size, self.dest.numel())
        via = "?"
        try:
            transport = self.choose(source)
            via = transport.name
            with claim.held() as live:
                if not live:
                    return _Read(span, source, via, error="abandoned")
                if self.before_write is not None:
                    self.before_write(lo, hi)
                timeout = max(0.0, min(self.options.read_timeout, self.time_left()))
                checkable = ((self.checksums is not None or self.deferred is not None)
                             and self.checksum_fn is not None)
                arrivals = _Arrivals(self, span, source, via,
                                     checking=checkable and self.verify(source))
                as_delta = self.delta_read(transport, span, source, timeout, claim.abort)
                if as_delta is not None:
                    got, wire = as_delta
                    arrivals.delta = True
                    arrivals.checking = checkable  # decoded over our own base: checked anyway
                else:
                    started = time.monotonic()
                    got = wire = self.read_bytes(transport, source, lo, self.dest[lo:hi],
                                                 timeout, claim.abort, arrivals)
                    if self.delta is not None:
                        self.delta.policy.observe(source.address, delivered=got, wire=got,
                                                  seconds=time.monotonic() - started)
                if got < hi - lo and got % self.chunk_size:
                    raise TransportError(f"source granted {got} bytes, not whole chunks of "
                                         f"{self.chunk_size}")
                arrivals(got)
                done = span if got == hi - lo else span[:got // self.chunk_size]
        except TransportError as exc:
            return _Read(span, source, via, error=f"{type(exc).__name__}: {exc}")
        return _Read(done, source, via, corrupted=tuple(arrivals.corrupted),
                     rest=span[len(done):], wire=wire, delta=as_delta is not None)

    def read_bytes(self, transport: Transport, source: Source, offset: int, out: torch.Tensor,
                   timeout: float, abort: ReadAbort, arrivals: _Arrivals) -> int:
        """Read the present run at `offset` from `source` into `out`; the bytes read.

        Under the fetch's held lease on the source when its transport holds one (no round
        trip per read), else with one `Transport.read` (the leases it takes are counted).
        The chunks are told to `arrivals` as they land where the transport can say so
        (`Transport.lands`; a held lease into host memory, or on a device stream), copied
        by the checksumming copy where the transport fuses one and the fetch verifies into
        host memory. A transport that copies on a device stream (`base.StreamCopy`, CUDA
        IPC) gets the read in `DEVICE_LAND_BYTES` pieces, each one launch of the fused copy.
        """
        on_cpu = self.dest.device.type == "cpu"
        fused = self.copy_checksums if arrivals.checking else None
        copy: CopyFn | None = None
        landing = Landing(self.land_step, arrivals)
        stream_copy: StreamCopy | None = getattr(transport, "stream_copy", None)
        if stream_copy is not None:  # a device copy: pieces launched at once, waited by event
            copy = stream_copy(None if fused is None else _at_chunk(fused, out, self.chunk_size,
                                                                    arrivals.span[0]),
                               None if fused is None else arrivals.sums.extend)
            landing = Landing(max(self.land_step, self.device_land_step), arrivals)
        elif fused is not None and on_cpu and getattr(transport, "fuses_copy", False):
            sums = arrivals.sums

            def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
                sums.extend(fused(dst, src, arrivals.span[len(sums)]).tolist())
        if getattr(transport, "hold", None) is None:
            extra: dict[str, object] = {} if copy is None else {"copy": copy}
            if getattr(transport, "lands", False):
                extra["landing"] = landing
            got = transport.read(source.address, source.region, offset, out, timeout=timeout,
                                 prefix=True, abort=abort, **extra)
            with self.held_lock:
                self.stats.leases += getattr(transport, "leases_per_read", 0)
            return got
        lease = self.held_lease(transport, source, timeout, abort)
        return lease.read(offset, out, timeout=timeout, prefix=True, abort=abort, copy=copy,
                          landing=landing if on_cpu or stream_copy is not None else None)

    def held_lease(self, transport: Transport, source: Source, timeout: float,
                   abort: ReadAbort) -> HeldLease:
        """The fetch's held lease on `source`, taken now if it has none that holds."""
        with self.held_lock:
            turn = self.holding.setdefault(source, threading.Lock())
        with turn:
            with self.held_lock:
                lease = self.held.get(source)
            if lease is not None and not lease.failed and not lease.lapsed:
                return lease
            new: HeldLease = transport.hold(  # type: ignore[attr-defined]
                source.address, source.region, self.dest.numel(), timeout=timeout, abort=abort)
            with self.held_lock:
                self.held[source] = new
                self.stats.leases += 1
                if lease is not None:  # other reads may still be copying under it
                    self.retired.append(lease)
        return new

    def end_idle_leases(self) -> None:
        """End the held leases of the sources no read in flight uses (none is queued).

        So that a fetch left waiting on a slow source does not keep the others' versions
        from being retracted; a source read again later is leased again.
        """
        busy = {read.source for read in self.inflight.values()}
        with self.held_lock:
            leases = [self.held.pop(s) for s in [s for s in self.held if s not in busy]]
        for lease in leases:
            lease.close()

    def end_leases(self) -> None:
        """End every held lease (once no read is in flight: `close`)."""
        with self.held_lock:
            leases = [*self.held.values(), *self.retired]
            self.held.clear()
            self.retired.clear()
        for lease in leases:
            lease.close()

    def fail_leases(self, worker: str, why: str) -> None:
        """End the held leases on `worker`'s sources here: their reads fail from now on."""
        with self.held_lock:
            leases = [lease for s, lease in self.held.items() if s.worker == worker]
        for lease in leases:
            lease.fail(why)

    def delta_read(self, transport: Transport, span: tuple[int, ...], source: Source,
                   timeout: float, abort: ReadAbort) -> tuple[int, int] | None:
        """Read `span` as deltas and decode it into `dest`, if this read should.

        Returns (bytes delivered, bytes on the wire), or None: read it in full (no base
        here, the policy says full is faster, a chunk of it failed its checksum before
        (as a delta or whole),
        the transport has no delta reads, or the source holds none of the bases).
        """
        delta = self.delta
        read_delta = getattr(transport, "read_delta", None)
        if (delta is None or read_delta is None or source.worker in self.no_base
                or any(c in self.corrupt_from or c in self.whole for c in span)
                or not delta.policy.use(self.delta_mode, source.address)):
            return None
        lo = span[0] * self.chunk_size
        hi = min((span[-1] + 1) * self.chunk_size, self.dest.numel())
        started = time.monotonic()
        try:
            reply = read_delta(source.address, source.region, lo, hi - lo,
                               chunk_size=self.chunk_size, width=delta.width, bases=[delta.name],
                               timeout=timeout, prefix=True, abort=abort)
        except NoBaseError:
            self.no_base.add(source.worker)
            return None
        decoding = time.monotonic()
        delivered = 0
        for i, blob in enumerate(reply.blobs):
            c_lo = lo + i * self.chunk_size
            c_hi = min(c_lo + self.chunk_size, hi)
            out = self.dest[c_lo:c_hi]
            base = delta.tensor[c_lo:c_hi]
            try:
                decode_delta(torch.frombuffer(blob, dtype=torch.uint8),
                             out if base.data_ptr() == out.data_ptr() else base, out)
            except DeltaFormatError as exc:
                raise TransportError(f"chunk {span[i]} from {source.worker}: {exc}") from exc
            delivered += c_hi - c_lo
        done = time.monotonic()
        delta.policy.observe(source.address, delivered=delivered, wire=reply.wire_bytes,
                             seconds=done - started, decode_seconds=done - decoding)
        return delivered, reply.wire_bytes

    def schedule(self, assignments: list[Assignment], missing: list[int]) -> list[_Queued]:
        """`_schedule` with this fetch's read limits, avoiding corrupt senders.

        Along a broadcast plan, the reads in flight are raised to one per assignment, or
        as many as its `Assignment.window` takes (at most `MAX_STREAMS` in all; never
        lowered during a fetch).
        """
        if getattr(self.planner, "planned", False):
            wanted = sum(_depth(a, self.chunks_per_read * self.chunk_size)
                         for a in assignments)
            self.streams = max(self.streams, min(wanted, MAX_STREAMS))
        return _schedule(assignments, missing, self.corrupt_from,
                         chunks_per_read=self.chunks_per_read, inflight=self.streams,
                         chunk_size=self.chunk_size)

    def revoke(self, futures: Iterable[Future[_Read]]) -> None:
        """Abandon these reads.

        Abort them all, wait until none touches `dest` any more, and forget them (their
        results are never looked at).
        """
        claims = [self.inflight.pop(f).claim for f in list(futures)]
        for claim in claims:
            claim.abort.abort()
        for claim in claims:
            claim.wait_released()

    def give_up(self, worker: str, why: str) -> None:
        """Count `worker` as failed for the rest of this fetch (once)."""
        if worker not in self.failed:
            self.failed[worker] = why
            self.stats.failed_sources.append(worker)
            self.fail_leases(worker, why)
            log.warning("source %s failed (%s); re-planning its chunks", worker, why)

    def chunk_bytes(self, chunk: int) -> torch.Tensor:
        """`chunk`'s bytes in `dest`."""
        return self.dest[chunk * self.chunk_size:min((chunk + 1) * self.chunk_size,
                                                     self.dest.numel())]

    def time_left(self) -> float:
        """Seconds left before the deadline (negative once past it)."""
        return self.options.deadline - (time.monotonic() - self.start)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=max(self.options.max_inflight, MAX_STREAMS),
                                  thread_name_prefix="wf-fetch")


class _Claim:
    """One read's hold on the destination, which the engine can revoke."""

    def __init__(self) -> None:
        self.abort = ReadAbort()
        self._lock = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[bool]:
        """Held while the read touches the destination.

        Yields False once revoked (the read must then not touch it).
        """
        with self._lock:
            yield not self.abort.aborted

    def wait_released(self) -> None:
        """Return once the read no longer touches the destination.

        Return once the read no longer touches the destination (after `abort`, promptly: its
        transport's sockets are shut down).
        """
        with self._lock:
            pass


class _Arrivals:
    """One read's chunks as they land: each verified (where the read checks) and marked.

    Called with the bytes landed from the span's start (`Landing`), on the read's
    thread; a chunk is taken in once whole (the last chunk of `dest` may be short).
    ``sums`` holds the checksums of the span's chunks from its first, computed here or
    by the read's checksumming copy (and goes to the fetch's ``deferred`` as each chunk
    is taken in, where it defers its checks); ``corrupted`` the chunks whose checksum was
    wrong (not marked: read again elsewhere).
    """

    def __init__(self, run: _FetchRun, span: tuple[int, ...], source: Source, via: str, *,
                 checking: bool) -> None:
        self.run, self.span, self.source, self.via = run, span, source, via
        self.checking, self.delta = checking, False
        self.lo = span[0] * run.chunk_size
        self.sums: list[int] = []
        self.corrupted: list[int] = []
        self.taken = 0  # chunks of the span taken in

    def __call__(self, landed: int) -> None:
        run = self.run
        size, end = run.chunk_size, run.dest.numel()
        whole = min(len(self.span), (landed if self.lo + landed < end else landed + size - 1)
                    // size)
        if whole <= self.taken:
            return
        if self.checking and len(self.sums) < whole:
            assert run.checksum_fn is not None
            a = self.lo + len(self.sums) * size
            self.sums += run.checksum_fn(self.span[len(self.sums)],
                                         run.dest[a:min(self.lo + whole * size, end)])
        good: list[int] = []
        for i in range(self.taken, whole):
            chunk = self.span[i]
            if self.checking and run.checksums is not None and \
                    self.sums[i] != run.checksums[chunk]:
                self.corrupted.append(chunk)
            else:
                good.append(chunk)
                if self.checking and run.deferred is not None:
                    run.deferred[chunk] = self.sums[i]
        self.taken = whole
        run.arrived(good, self.source, self.via, self.delta)


@dataclass(frozen=True)
class _Read:
    """The outcome of one read of consecutive chunks from one source.

    `span` was read (or failed with `error`); `rest` was asked for too but not granted yet.
    """

    span: tuple[int, ...]
    source: Source
    via: str
    error: str | None = None
    corrupted: tuple[int, ...] = ()
    rest: tuple[int, ...] = ()
    wire: int = 0  # bytes that came over the wire (a delta's encoded size)
    delta: bool = False  # the span came as deltas


def _at_chunk(fused: CopyChecksumFn, out: torch.Tensor, chunk_size: int,
              first: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fused`` for a piece of `out` (whose first chunk is `first`): the piece's own first chunk.

    Pieces are chunk-aligned slices of `out` (`Landing.pieces`), launched before any has
    finished, so each finds its chunk from where it starts, not from the sums so far.
    """
    def kernel(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        at = dst.data_ptr() - out.data_ptr()
        return fused(dst, src, first + at // chunk_size)

    return kernel


def _no_source_left(missing: list[int], failed: dict[str, str],
                    corrupt_from: dict[int, set[str]]) -> FetchError:
    """The error for `missing` chunks that no source is left for.

    Which failed their checksum from which sources, and which sources failed and why.
    """
    corrupt = sorted(c for c in missing if corrupt_from.get(c))
    rest = [c for c in missing if not corrupt_from.get(c)]
    parts = []
    if corrupt:
        senders = sorted(set().union(*(corrupt_from[c] for c in corrupt)))
        parts.append(f"chunks {_ranges(corrupt)} failed their checksum from every source that "
                     f"sent them ({', '.join(senders)}): those replicas are corrupt or do not "
                     "match the published checksums; republish the version or fetch another")
    if rest:
        why = "; ".join(f"{w}: {e}" for w, e in sorted(failed.items()))
        parts.append(f"no source left for chunks {_ranges(rest)}: "
                     + (f"the sources failed ({why})" if why else "the planner named none")
                     + "; retry once a holder is reachable again, or fetch another version")
    return FetchError(". ".join(parts))


def _schedule(assignments: list[Assignment], missing: list[int], avoid: dict[int, set[str]], *,
              chunks_per_read: int, inflight: int, chunk_size: int = 1
              ) -> list[tuple[tuple[int, ...], Source]]:
    """Reads as (span of consecutive chunks, source), the assignments' spans interleaved.

    Each assignment's chunks are cut into spans of at most `chunks_per_read`, and
    of an even share per stripe source or read in flight (so small fetches still
    read in parallel); spans go round-robin over the assignment's best `stripe`
    sources. The reads take the assignments in turn, each in chunk order: the
    assignments of a planned reader are its stripes' trees, which carry bytes at
    the same time, so each gets a read in flight (in chunk order, a reader would
    drain one tree before it asked the next); an assignment with a `window` gets
    `_depth` reads per turn. A chunk that some source already sent corrupted is
    read alone, from a source that did not.
    """
    wanted = set(missing)
    taken: set[int] = set()
    queues: list[list[list[tuple[tuple[int, ...], Source]]]] = []  # per assignment, per turn
    for a in assignments:
        chunks = [c for c in a.chunks if c in wanted and c not in taken]
        best = a.sources[:max(1, a.stripe)]
        if not best:
            continue
        reads: list[tuple[tuple[int, ...], Source]] = []
        plain = [c for c in chunks if not avoid.get(c)]
        share = -(-len(plain) // max(len(best), inflight))
        most = max(1, min(chunks_per_read, share))
        for i, span in enumerate(_spans(plain, most)):
            reads.append((span, best[i % len(best)]))
        taken.update(plain)
        for chunk in (c for c in chunks if avoid.get(c)):
            usable = [s for s in a.sources if s.worker not in avoid[chunk]][:max(1, a.stripe)]
            if usable:
                reads.append(((chunk,), usable[chunk % len(usable)]))
                taken.add(chunk)
        reads.sort(key=lambda read: read[0][0])
        per_turn = _depth(a, most * chunk_size)
        queues.append([reads[i:i + per_turn] for i in range(0, len(reads), per_turn)])
    return [read for turn in itertools.zip_longest(*queues, fillvalue=[])
            for reads in turn for read in reads]


def _depth(assignment: Assignment, read_bytes: int) -> int:
    """Reads to keep in flight along `assignment`: those its `window` takes, plus one."""
    return 1 + -(-assignment.window // max(1, read_bytes))


def _spans(chunks: list[int], most: int) -> list[tuple[int, ...]]:
    """Sorted `chunks` cut into runs of consecutive indices, each at most `most` long."""
    spans: list[list[int]] = []
    for c in chunks:
        if spans and spans[-1][-1] == c - 1 and len(spans[-1]) < most:
            spans[-1].append(c)
        else:
            spans.append([c])
    return [tuple(span) for span in spans]


def _ranges(chunks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out: list[str] = []
    for c in sorted(chunks):
        if out and int(out[-1].split("-")[-1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ", ".join(out)
