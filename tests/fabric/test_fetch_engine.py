"""The fetch engine against real read servers (in this process, over loopback TCP)."""

import contextlib
import socket
import threading
import time
import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from timeouts import hard_timeout

from weightfabric.fabric.errors import NoSourceError
from weightfabric.fabric.fetch import (
    Assignment,
    FetchError,
    FetchOptions,
    Source,
    _no_source_left,
    _ranges,
    _schedule,
    fetch_chunks,
)
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer, SourceAddress, TcpTransport
from weightfabric.fabric.transports.wire import REPLY, REQUEST, Status, recv_exact

CHUNK = 64 * 1024
NBYTES = 10 * CHUNK + 123
NUM_CHUNKS = 11


def data() -> torch.Tensor:
    return (torch.arange(NBYTES, dtype=torch.int64) * 7 % 253).to(torch.uint8)


def crc(chunk: int, piece: torch.Tensor) -> int:
    return zlib.crc32(piece.numpy().tobytes(), chunk)


def crcs(first: int, piece: torch.Tensor) -> list[int]:
    """`crc` of each chunk of a run of chunks from ``first`` (the engine's checksum_fn)."""
    return [crc(first + i, piece[i * CHUNK:(i + 1) * CHUNK])
            for i in range(-(-piece.numel() // CHUNK))]


EXPECTED = [crc(c, data()[c * CHUNK:(c + 1) * CHUNK]) for c in range(NUM_CHUNKS)]


class StaticPlanner:
    """Offers every source that is not reported failed, all chunks, stripe over all."""

    def __init__(self, sources: list[Source], stripe: int | None = None) -> None:
        self.sources = sources
        self.stripe = stripe or len(sources)
        self.reported: list[int] = []
        self.rounds = 0

    def plan(self, missing, failed):
        self.rounds += 1
        live = tuple(s for s in self.sources if s.worker not in failed)
        return [Assignment(tuple(missing), live, self.stripe)] if live else []

    def report(self, chunks):
        self.reported.extend(chunks)


@pytest.fixture
def tcp():
    t = TcpTransport()
    yield t
    t.close()


def serve(worker: str, tensor: torch.Tensor, progress: ChunkProgress | None = None):
    server = ReadServer()
    server.expose("v1", tensor, chunk_size=CHUNK, progress=progress)
    return server, Source(worker, server.address, "v1")


LIMITS = FetchOptions(read_timeout=5, deadline=60)


def run(planner, transport, dest=None, progress=None, options=LIMITS, **kw):
    """Fetch the 11 chunks (verified) through `transport`; returns (dest, progress, stats)."""
    dest = torch.zeros(NBYTES, dtype=torch.uint8) if dest is None else dest
    progress = progress or ChunkProgress(NUM_CHUNKS)
    kw.setdefault("checksum_fn", crcs)
    stats = fetch_chunks(dest, chunk_size=CHUNK, progress=progress, planner=planner,
                         choose=lambda _: transport, checksums=EXPECTED, options=options, **kw)
    return dest, progress, stats


def test_stripes_over_two_sources_bit_exact(tcp):
    a, src_a = serve("a", data())
    b, src_b = serve("b", data())
    try:
        dest, progress, stats = run(StaticPlanner([src_a, src_b]), tcp)
        assert torch.equal(dest, data()) and progress.complete
        assert stats.bytes == NBYTES and stats.chunks == NUM_CHUNKS
        assert set(stats.sources) == {"a", "b"} and min(stats.sources.values()) >= 4 * CHUNK
        assert a.bytes_served + b.bytes_served == NBYTES
    finally:
        a.close()
        b.close()


def test_a_dead_source_is_replaced_and_only_its_chunks_reread(tcp):
    a, src_a = serve("a", data())
    b, src_b = serve("b", data())
    b.close()  # b died before the fetch: every chunk assigned to it must move to a
    try:
        planner = StaticPlanner([src_a, src_b])
        dest, _, stats = run(planner, tcp)
        assert torch.equal(dest, data())
        assert stats.failed_sources == ["b"] and stats.sources == {"a": NBYTES}
        assert 2 <= planner.rounds <= 3  # b's two reads re-planned together or one by one
        assert stats.chunks_reread <= NUM_CHUNKS // 2 + 1  # only b's share, once
    finally:
        a.close()


def bad_and_good(flipped_byte: int):
    """Two holders: "bad" with one byte flipped, "good" intact (holder, source each)."""
    bad = data().clone()
    bad[flipped_byte] ^= 0xFF
    return serve("bad", bad), serve("good", data())


def test_corrupted_chunk_is_caught_and_reread_elsewhere(tcp):
    (a, src_a), (b, src_b) = bad_and_good(2 * CHUNK + 10)
    try:
        dest, _, stats = run(StaticPlanner([src_a, src_b]), tcp)
        assert torch.equal(dest, data())
        assert stats.corrupted_chunks == 1 and stats.chunks_reread == 1
    finally:
        a.close()
        b.close()


def test_a_chunk_corrupt_from_every_source_is_an_error_naming_the_checksum(tcp):
    (a, src_a), (b, src_b) = bad_and_good(3 * CHUNK + 5)
    try:
        with pytest.raises(FetchError, match=r"chunks 3 failed their checksum .*\(bad\)") as info:
            run(StaticPlanner([src_a]), tcp)
        assert "no source left" not in str(info.value)  # every other chunk arrived
    finally:
        a.close()
        b.close()


class CopyingTransport:
    """A transport that copies (as shm does): it reads via `inner` into scratch, then copies."""

    name = "copying"
    fuses_copy = True

    def __init__(self, inner) -> None:
        self.inner = inner

    def read(self, source, region, offset, out, *, timeout, prefix=False, abort=None, copy=None):
        scratch = torch.empty_like(out)
        got = self.inner.read(source, region, offset, scratch, timeout=timeout, prefix=prefix,
                              abort=abort)
        (copy or (lambda dst, src: dst.copy_(src)))(out[:got], scratch[:got])
        return got


def test_a_transport_that_copies_verifies_in_its_copy(tcp):
    """With copy_checksums, a copying transport's chunks are checked by the sums its copy made.

    The separate checksum pass does not run, and a corrupt chunk is still caught.
    """
    (a, src_a), (b, src_b) = bad_and_good(2 * CHUNK + 10)
    separate: list[int] = []

    def counted(first, piece):
        sums = crcs(first, piece)
        separate.extend(range(first, first + len(sums)))
        return sums

    def copy_crc(dst, src, first):
        dst.copy_(src)
        return torch.tensor(crcs(first, dst), dtype=torch.int64)

    try:
        dest = torch.zeros(NBYTES, dtype=torch.uint8)
        stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(NUM_CHUNKS),
                             planner=StaticPlanner([src_a, src_b]),
                             choose=lambda _: CopyingTransport(tcp), checksums=EXPECTED,
                             checksum_fn=counted, copy_checksums=copy_crc, options=LIMITS)
        assert torch.equal(dest, data())
        assert stats.corrupted_chunks == 1 and separate == []
        _, _, stats = run(StaticPlanner([src_b]), tcp, checksum_fn=counted,
                          copy_checksums=copy_crc)   # tcp receives in place: checked after
        assert sorted(separate) == list(range(NUM_CHUNKS))
    finally:
        a.close()
        b.close()


def test_chunks_already_present_are_kept(tcp):
    a, src_a = serve("a", data())
    try:
        dest = data().clone()
        progress = ChunkProgress(NUM_CHUNKS)
        for c in range(0, NUM_CHUNKS, 2):
            progress.mark(c)
        dest[1 * CHUNK:2 * CHUNK] = 0
        dest, _, stats = run(StaticPlanner([src_a]), tcp, dest=dest, progress=progress)
        assert torch.equal(dest, data())
        assert stats.chunks == NUM_CHUNKS // 2
    finally:
        a.close()


def test_reader_pipelines_from_a_partial_replica(tcp):
    """Origin -> A -> B: B reads from A while A is still fetching."""
    origin, src_origin = serve("origin", data())
    a_bytes = torch.zeros(NBYTES, dtype=torch.uint8)
    a_progress = ChunkProgress(NUM_CHUNKS)
    a_server, src_a = serve("a", a_bytes, a_progress)
    try:
        result = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("a", run(StaticPlanner([src_origin]), tcp,
                                                      dest=a_bytes, progress=a_progress)))
        thread.start()
        dest, _, stats = run(StaticPlanner([src_a]), tcp)
        thread.join(timeout=60)
        assert torch.equal(dest, data()) and torch.equal(a_bytes, data())
        assert stats.sources == {"a": NBYTES}
        assert origin.bytes_served == NBYTES  # the origin served the version once
    finally:
        for s in (origin, a_server):
            s.close()


def test_no_source_left_is_an_error_naming_the_chunks(tcp):
    a, src_a = serve("a", data())
    a.close()
    with pytest.raises(FetchError, match=r"no source left for chunks 0-10.*\ba: SourceLostError"):
        run(StaticPlanner([src_a]), tcp)


def test_progress_callback_and_reports(tcp):
    a, src_a = serve("a", data())
    seen = []
    try:
        planner = StaticPlanner([src_a])
        run(planner, tcp, on_chunk=lambda done, total: seen.append((done, total)))
        assert sorted(planner.reported) == list(range(NUM_CHUNKS))
        assert seen[-1] == (NUM_CHUNKS, NUM_CHUNKS)
    finally:
        a.close()


@hard_timeout(30)
def test_chunks_read_are_reported_while_the_fetch_waits_on_a_partial_source(tcp):
    """A reader waiting on a partial source still reports the chunks it has.

    A reader stuck waiting on a partial source still reports the chunks it has, so the
    planner's view of its replica (and other readers' plans) does not lag behind for as long
    as the wait lasts.
    """
    held = ChunkProgress(NUM_CHUNKS)
    for chunk in range(5):
        held.mark(chunk)
    a, src_a = serve("a", data(), held)
    planner = StaticPlanner([src_a])
    out: list = []
    fetch = threading.Thread(target=lambda: out.append(run(planner, tcp)))
    try:
        fetch.start()
        deadline = time.monotonic() + 5
        while sorted(planner.reported) != list(range(5)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(planner.reported) == list(range(5))
        assert fetch.is_alive()  # still waiting on chunk 5
    finally:
        for chunk in range(5, NUM_CHUNKS):
            held.mark(chunk)
        fetch.join(20)
        a.close()
    assert out and torch.equal(out[0][0], data())
    assert sorted(planner.reported) == list(range(NUM_CHUNKS))


def test_chunks_queued_for_a_source_that_failed_are_replanned_not_an_error(tcp):
    """One in flight at a time.

    The dead source fails its first read, and every other chunk queued for it must go back
    to the planner (not end the fetch).
    """
    good, src_good = serve("good", data())
    dead, src_dead = serve("dead", data())
    dead.close()
    try:
        dest, _, stats = run(StaticPlanner([src_dead, src_good]), tcp,
                             options=replace(LIMITS, max_inflight=1))
        assert torch.equal(dest, data()) and stats.failed_sources == ["dead"]
    finally:
        good.close()


class CountingTransport:
    """Wraps a transport and records each read's sizes and timeout.

    Wraps a transport and records each read's (offset, bytes asked, bytes granted) and the
    timeout it was given.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.reads: list[tuple[int, int, int]] = []
        self.timeouts: list[float] = []

    def read(self, source, region, offset, out, *, timeout, prefix=False, abort=None):
        self.timeouts.append(timeout)
        got = self.inner.read(source, region, offset, out, timeout=timeout, prefix=prefix,
                              abort=abort)
        self.reads.append((offset, out.numel(), got))
        return got


def test_chunks_a_source_holds_are_read_in_spans(tcp):
    a, src_a = serve("a", data())
    counting = CountingTransport(tcp)
    try:
        dest, _, stats = run(StaticPlanner([src_a]), counting,
                             options=replace(LIMITS, max_inflight=1, read_bytes=4 * CHUNK + 5))
        assert torch.equal(dest, data()) and stats.chunks == NUM_CHUNKS
        last = NBYTES - 8 * CHUNK
        assert counting.reads == [(0, 4 * CHUNK, 4 * CHUNK), (4 * CHUNK, 4 * CHUNK, 4 * CHUNK),
                                  (8 * CHUNK, last, last)]
    finally:
        a.close()


def test_a_partial_source_grants_the_chunks_it_has_and_the_rest_is_asked_again(tcp):
    """A reads from a partial replica holding chunks 0-5 (one span asked for all 11).

    It gets those 6 at once, then the rest as the holder marks them.
    """
    partial = data().clone()
    partial[6 * CHUNK:] = 0
    progress = ChunkProgress(NUM_CHUNKS)
    for c in range(6):
        progress.mark(c)
    a, src_a = serve("a", partial, progress)
    counting = CountingTransport(tcp)

    def fill() -> None:
        for c in range(6, NUM_CHUNKS):
            time.sleep(0.05)
            partial[c * CHUNK:(c + 1) * CHUNK] = data()[c * CHUNK:(c + 1) * CHUNK]
            progress.mark(c)

    filler = threading.Thread(target=fill)
    try:
        filler.start()
        dest, _, stats = run(StaticPlanner([src_a]), counting,
                             options=replace(LIMITS, max_inflight=1, read_timeout=10,
                                             read_bytes=NUM_CHUNKS * CHUNK))
        assert torch.equal(dest, data()) and stats.chunks == NUM_CHUNKS
        assert stats.chunks_reread == 0
        assert counting.reads[0] == (0, NBYTES, 6 * CHUNK)
        for offset, asked, got in counting.reads:   # each ask continues where the last ended
            assert offset % CHUNK == 0 and offset + asked == NBYTES
            assert got == asked or (got > 0 and got % CHUNK == 0)
        assert len(counting.reads) >= 2
    finally:
        filler.join(timeout=10)
        a.close()


def test_spans_are_shared_between_reads_in_flight_and_stripe_sources(tcp):
    """11 chunks over 4 reads in flight are cut in spans of 3.

    With room for 64 chunks per read, 11 chunks over 4 reads in flight are cut in spans of 3
    (so the reads run in parallel), alternating between the two sources.
    """
    a, src_a = serve("a", data())
    b, src_b = serve("b", data())
    counting = CountingTransport(tcp)
    try:
        dest, _, _ = run(StaticPlanner([src_a, src_b]), counting,
                         options=replace(LIMITS, max_inflight=4, read_bytes=64 * CHUNK))
        assert torch.equal(dest, data())
        assert sorted(r[:2] for r in counting.reads) == [
            (0, 3 * CHUNK), (3 * CHUNK, 3 * CHUNK), (6 * CHUNK, 3 * CHUNK),
            (9 * CHUNK, NBYTES - 9 * CHUNK)]
        assert a.bytes_served == 6 * CHUNK and b.bytes_served == NBYTES - 6 * CHUNK
    finally:
        a.close()
        b.close()


def test_a_corrupted_chunk_inside_a_span_is_reread_alone(tcp):
    (a, src_a), (b, src_b) = bad_and_good(5 * CHUNK + 1)
    counting = CountingTransport(tcp)
    try:
        dest, _, stats = run(StaticPlanner([src_a, src_b], stripe=1), counting,
                             options=replace(LIMITS, max_inflight=1,
                                             read_bytes=NUM_CHUNKS * CHUNK))
        assert torch.equal(dest, data())
        assert stats.corrupted_chunks == 1 and stats.chunks_reread == 1
        assert counting.reads == [(0, NBYTES, NBYTES), (5 * CHUNK, CHUNK, CHUNK)]
        assert stats.sources == {"bad": NBYTES - CHUNK, "good": CHUNK}
    finally:
        a.close()
        b.close()


WORKERS = ("a", "b", "c")


@st.composite
def schedules(draw):
    """Missing chunks, assignments over them, corrupt chunks and read limits.

    Missing chunks, assignments over them (overlapping, possibly without sources), chunks
    some workers sent corrupted, and the read limits.
    """
    total = draw(st.integers(1, 40))
    missing = sorted(draw(st.sets(st.integers(0, total - 1), min_size=1)))
    sources = {w: Source(w, SourceAddress("127.0.0.1", 1, "h"), "v") for w in WORKERS}
    assignments = []
    for _ in range(draw(st.integers(0, 3))):
        chunks = tuple(sorted(draw(st.sets(st.integers(0, total - 1)))))
        names = draw(st.lists(st.sampled_from(WORKERS), unique=True, max_size=3))
        assignments.append(Assignment(chunks, tuple(sources[w] for w in names),
                                      draw(st.integers(1, 3))))
    avoid = draw(st.dictionaries(st.sampled_from(missing),
                                 st.sets(st.sampled_from(WORKERS), min_size=1), max_size=4))
    return missing, assignments, avoid, draw(st.integers(1, 8)), draw(st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_schedule_reads_each_servable_chunk_once_in_spans(case):
    missing, assignments, avoid, per_read, inflight = case
    reads = _schedule(assignments, missing, avoid, chunks_per_read=per_read, inflight=inflight)
    scheduled = [c for span, _ in reads for c in span]
    assert len(scheduled) == len(set(scheduled)) and set(scheduled) <= set(missing)
    servable = {c for a in assignments for c in a.chunks if c in missing
                and any(s.worker not in avoid.get(c, ()) for s in a.sources)}
    assert set(scheduled) == servable
    turns: dict[int, list[int]] = {}     # assignment -> the starts of its reads, in order
    for span, source in reads:
        assert list(span) == list(range(span[0], span[0] + len(span))) and len(span) <= per_read
        assert all(source.worker not in avoid.get(c, ()) for c in span)
        assert len(span) == 1 or not any(avoid.get(c) for c in span)
        owner = next(i for i, a in enumerate(assignments) if span[0] in a.chunks
                     and any(s.worker not in avoid.get(span[0], ()) for s in a.sources))
        a = assignments[owner]
        assert source in a.sources[:max(1, a.stripe)] or avoid.get(span[0])
        turns.setdefault(owner, []).append(span[0])
    # each assignment's reads in chunk order, the assignments taking turns
    assert all(starts == sorted(starts) for starts in turns.values())
    rank = [turns[i].index(span[0]) for span, _ in reads
            for i in [next(i for i in turns if span[0] in turns[i])]]
    assert rank == sorted(rank)


# --- time limits and lost sources ---------------------------------------------------------


def stalled(worker: str):
    """A partial replica that never gets a chunk (holder, source)."""
    return serve(worker, torch.zeros(NBYTES, dtype=torch.uint8), ChunkProgress(NUM_CHUNKS))


class LateSource:
    """A source that answers reads with `fill` bytes only once `answer` is set.

    A source that reads each request and answers it with `fill` bytes only once `answer` is
    set (a holder that froze, then woke up). `reached` is set when a first read has asked;
    `answered` once every read that asked before `answer` is answered (`late_reads` of them:
    a read abandoned before it connected never asks).
    """

    def __init__(self, worker: str, fill: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)  # to look at `answer` between connections
        self.source = Source(worker, SourceAddress("127.0.0.1", self.listener.getsockname()[1],
                                                   "elsewhere"), "v1")
        self.fill, self.answer = fill, threading.Event()
        self.reached, self.answered = threading.Event(), threading.Event()
        self.late_reads = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conns = []
        while not self.answer.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                break
            try:
                conn.settimeout(5)
                *_, name_len, offset, nbytes, timeout, cap_len = REQUEST.unpack(
                    recv_exact(conn, REQUEST.size))
                recv_exact(conn, name_len + cap_len)
            except OSError:  # the read was abandoned before it asked
                conn.close()
                continue
            conns.append((conn, nbytes))
            self.reached.set()
        for conn, nbytes in conns:
            with contextlib.suppress(OSError):
                conn.sendall(REPLY.pack(Status.OK, 0, nbytes) + bytes([self.fill]) * nbytes)
            conn.close()
        self.late_reads = len(conns)
        self.answered.set()

    def close(self) -> None:
        self.answer.set()
        self.listener.close()
        self.thread.join(10)


@pytest.mark.parametrize("kind", ["stalled partial", "late"])
def test_a_fetch_raises_at_its_deadline_without_waiting_out_its_reads(tcp, kind):
    """Reads in flight at the deadline are abandoned.

    The fetch does not wait for them (read_timeout 5 s), and a late answer never lands in
    the destination.
    """
    holder, source = stalled("a") if kind == "stalled partial" else (LateSource("a", 0xAB), None)
    source = source or holder.source
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    with hard_timeout(30):
        try:
            start = time.monotonic()
            with pytest.raises(FetchError, match="deadline of 0.5 s"):
                run(StaticPlanner([source]), tcp, dest=dest,
                    options=FetchOptions(read_timeout=5, deadline=0.5))
            assert time.monotonic() - start < 1.5
            if kind == "late":
                holder.answer.set()
                assert holder.answered.wait(10) and holder.late_reads >= 1
                time.sleep(0.2)
            assert not dest.any()
        finally:
            holder.close()


class LostPlanner(StaticPlanner):
    """A `StaticPlanner` that can be told a source is lost (as the hub tells it)."""

    def __init__(self, sources: list[Source], stripe: int | None = None) -> None:
        super().__init__(sources, stripe)
        self.gone: set[str] = set()

    def lost(self) -> set[str]:
        return set(self.gone)


def test_a_source_reported_lost_is_left_at_once_and_never_writes_again(tcp):
    """The planner hears that "a" (a partial replica the reads wait on) is lost.

    Its reads are abandoned and re-planned on "b" without waiting out read_timeout, and "a"
    waking up later with wrong bytes does not touch the destination.
    """
    late = LateSource("a", 0xEE)
    b, src_b = serve("b", data())
    planner = LostPlanner([late.source, src_b], stripe=1)  # every read goes to "a"
    with hard_timeout(30):
        try:
            def lose_a() -> None:  # once a read of "a" has asked, to be answered late
                late.reached.wait(5)
                planner.gone.add("a")

            threading.Timer(0.3, lose_a).start()
            start = time.monotonic()
            dest, _, stats = run(planner, tcp, options=FetchOptions(read_timeout=5, deadline=4))
            assert time.monotonic() - start < 1.5
            assert stats.failed_sources == ["a"] and stats.sources == {"b": NBYTES}
            late.answer.set()
            assert late.answered.wait(10) and late.late_reads >= 1
            time.sleep(0.2)
            assert torch.equal(dest, data())
        finally:
            late.close()
            b.close()


def test_reads_left_while_asking_a_lost_source_what_it_is_do_not_hold_up_the_rest(tcp):
    """Choosing a transport may ask the source first (a same-host lookup).

    With "a" hung there, its reads are left when it is reported lost, and the re-planned
    reads of "b" do not wait for the threads still stuck asking.
    """
    b, src_b = serve("b", data())
    hung = Source("a", SourceAddress("127.0.0.1", 1, "elsewhere"), "v1")
    answer = threading.Event()

    def choose(source: Source) -> TcpTransport:
        if source.worker == "a":
            answer.wait(10)
        return tcp

    planner = LostPlanner([hung, src_b], stripe=1)  # every read goes to "a"
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    with hard_timeout(30):
        try:
            threading.Timer(0.3, planner.gone.add, ["a"]).start()
            start = time.monotonic()
            stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(NUM_CHUNKS),
                                 planner=planner, choose=choose,
                                 options=FetchOptions(read_timeout=5, deadline=4))
            assert time.monotonic() - start < 1.5
            assert torch.equal(dest, data()) and stats.sources == {"b": NBYTES}
        finally:
            answer.set()
            b.close()


class SwitchingPlanner(LostPlanner):
    """Names the `first` sources (striped) in its first plan, the `later` ones after it."""

    def __init__(self, first: list[Source], later: list[Source]) -> None:
        super().__init__(first)
        self.later = later

    def plan(self, missing, failed):
        if self.rounds:
            self.sources, self.stripe = self.later, len(self.later)
        return super().plan(missing, failed)


@pytest.mark.parametrize("kind", ["lost", "dead"])
def test_chunks_of_a_failed_read_are_replanned_while_another_read_is_stalled(tcp, kind):
    """Reads stripe over "a" and "c", a partial replica still waiting for its chunks.

    When "a" is reported lost (its reads hang) or is dead (its reads fail), its chunks are
    read from "b" at once, while the reads of "c" still wait (read_timeout 10 s).
    """
    a, src_a = stalled("a")
    if kind == "dead":
        a.close()
    partial = torch.zeros(NBYTES, dtype=torch.uint8)
    progress_c = ChunkProgress(NUM_CHUNKS)
    c, src_c = serve("c", partial, progress_c)
    b, src_b = serve("b", data())
    planner = SwitchingPlanner([src_a, src_c], [src_b])  # a: chunks 0-2 and 6-8
    progress = ChunkProgress(NUM_CHUNKS)
    result = {}

    def fetch() -> None:
        result["out"] = run(planner, tcp, progress=progress,
                            options=FetchOptions(read_timeout=10, deadline=20))

    def fill_c() -> None:
        partial.copy_(data())
        for chunk in range(NUM_CHUNKS):
            progress_c.mark(chunk)

    thread = threading.Thread(target=fetch)
    with hard_timeout(30):
        try:
            if kind == "lost":
                threading.Timer(0.3, planner.gone.add, ["a"]).start()
            thread.start()
            assert progress.wait(0, 2, 5) and progress.wait(6, 8, 5)
            assert progress.count == 6  # c's reads are still waiting
            fill_c()
            thread.join(10)
            dest, _, stats = result["out"]
            assert torch.equal(dest, data()) and stats.failed_sources == ["a"]
            assert stats.sources == {"b": 6 * CHUNK, "c": NBYTES - 6 * CHUNK}
        finally:
            fill_c()
            thread.join(10)
            for server in (a, b, c):
                server.close()


def test_a_replan_that_fails_within_a_round_is_tried_again_after_it(tcp):
    """The planner refuses every re-plan.

    The dead source's chunks wait for the end of the round (the good source's reads finish),
    whose plan raises the planner's error.
    """
    dead, src_dead = serve("dead", data())
    dead.close()
    good, src_good = serve("good", data())

    class Refusing(StaticPlanner):
        def plan(self, missing, failed):
            if self.rounds:
                self.rounds += 1
                raise NoSourceError("no live replica holds them")
            return super().plan(missing, failed)

    planner = Refusing([src_dead, src_good])
    progress = ChunkProgress(NUM_CHUNKS)
    try:
        with pytest.raises(NoSourceError, match="no live replica"):
            run(planner, tcp, progress=progress)
        assert progress.count == 5 and planner.rounds >= 3  # good's reads, then the re-plans
    finally:
        good.close()


def test_a_partial_source_that_does_not_get_the_chunk_in_time_is_replaced(tcp):
    """NOT_READY from a partial replica the reads wait on fails it for this fetch.

    The chunks are re-planned on a source that has them.
    """
    a, src_a = stalled("a")
    b, src_b = serve("b", data())
    with hard_timeout(30):
        try:
            dest, _, stats = run(StaticPlanner([src_a, src_b], stripe=1), tcp,
                                 options=FetchOptions(read_timeout=0.3, deadline=4))
            assert torch.equal(dest, data())
            assert stats.failed_sources == ["a"] and stats.sources == {"b": NBYTES}
        finally:
            a.close()
            b.close()


def test_a_cancelled_fetch_stops_within_a_wait_slice(tcp):
    a, src_a = stalled("a")
    cancel = threading.Event()
    with hard_timeout(30):
        try:
            threading.Timer(0.2, cancel.set).start()
            start = time.monotonic()
            with pytest.raises(FetchError, match="cancelled"):
                run(StaticPlanner([src_a]), tcp, options=FetchOptions(read_timeout=5, deadline=4),
                    cancel=cancel)
            assert time.monotonic() - start < 1.0
        finally:
            a.close()


# --- the engine's steps, one at a time ----------------------------------------------------


class RecordingPlanner(LostPlanner):
    """A `LostPlanner` that records each plan and can hear a worker is lost.

    A `LostPlanner` that records each plan's (missing, failed) and, with `lose_after`, hears
    that worker `lose` is lost once those chunks have been reported.
    """

    def __init__(self, sources: list[Source], stripe: int | None = None, *,
                 lose: str = "", lose_after: frozenset[int] = frozenset()) -> None:
        super().__init__(sources, stripe)
        self.plans: list[tuple[list[int], set[str]]] = []
        self.lose, self.lose_after = lose, lose_after

    def plan(self, missing, failed):
        self.plans.append((list(missing), set(failed)))
        return super().plan(missing, failed)

    def report(self, chunks):
        super().report(chunks)
        if self.lose and self.lose_after <= set(self.reported):
            self.gone.add(self.lose)


def test_a_replan_after_a_lost_source_keeps_the_chunks_already_read(tcp, caplog):
    """A partial source lost mid-wait: only its missing chunks are re-planned.

    "a", a partial replica, grants chunks 0-4 of the one span asked for, and the read of the
    rest waits on it. Once 0-4 are reported, the planner hears "a" is lost: the waiting read
    is abandoned (not waited out: read_timeout 60 s) and only chunks 5-10 are re-planned,
    without "a"; 0-4 stay, counted as read from "a", none re-read.
    """
    held = ChunkProgress(NUM_CHUNKS)
    for chunk in range(5):
        held.mark(chunk)
    a, src_a = serve("a", data(), held)
    b, src_b = serve("b", data())
    planner = RecordingPlanner([src_a, src_b], stripe=1, lose="a", lose_after=frozenset(range(5)))
    with hard_timeout(30):
        try:
            dest, _, stats = run(planner, tcp, options=FetchOptions(
                max_inflight=1, read_bytes=NUM_CHUNKS * CHUNK, read_timeout=60, deadline=120))
            assert torch.equal(dest, data())
            assert planner.plans == [(list(range(NUM_CHUNKS)), set()),
                                     (list(range(5, NUM_CHUNKS)), {"a"})]
            assert stats.sources == {"a": 5 * CHUNK, "b": NBYTES - 5 * CHUNK}
            assert stats.chunks == NUM_CHUNKS and stats.chunks_reread == 0
            assert stats.failed_sources == ["a"] and "source a failed (lost: " in caplog.text
        finally:
            a.close()
            b.close()


def corrupt_at(worker: str, flipped_byte: int):
    """A holder of the data with one byte flipped (holder, source)."""
    bad = data().clone()
    bad[flipped_byte] ^= 0xFF
    return serve(worker, bad)


def test_a_corrupt_chunk_counts_against_its_source_for_that_chunk_only(tcp):
    """Chunk 3 is corrupt on "bad1" and "bad2".

    Its re-read avoids every source that sent it wrong ("bad1", then "bad2" too) though the
    planner names them first, and neither is failed: "bad1" still serves every other chunk.
    """
    bad1, src_bad1 = corrupt_at("bad1", 3 * CHUNK + 7)
    bad2, src_bad2 = corrupt_at("bad2", 3 * CHUNK + 9)
    good, src_good = serve("good", data())
    planner = RecordingPlanner([src_bad1, src_bad2, src_good], stripe=1)
    counting = CountingTransport(tcp)
    try:
        dest, _, stats = run(planner, counting, options=replace(
            LIMITS, max_inflight=1, read_bytes=NUM_CHUNKS * CHUNK))
        assert torch.equal(dest, data())
        assert counting.reads[1:] == [(3 * CHUNK, CHUNK, CHUNK)] * 2  # bad2's, then good's
        assert stats.corrupted_chunks == 2 and stats.chunks_reread == 2
        assert stats.failed_sources == [] and all(not failed for _, failed in planner.plans)
        assert stats.sources == {"bad1": NBYTES - CHUNK, "good": CHUNK}
        assert bad2.bytes_served == CHUNK
    finally:
        for server in (bad1, bad2, good):
            server.close()


def test_a_chunk_corrupt_from_each_source_names_them_all(tcp):
    bad1, src_bad1 = corrupt_at("bad1", 3 * CHUNK + 7)
    bad2, src_bad2 = corrupt_at("bad2", 3 * CHUNK + 9)
    try:
        with pytest.raises(FetchError, match=r"^chunks 3 failed their checksum from every "
                                             r"source that sent them \(bad1, bad2\)"):
            run(StaticPlanner([src_bad1, src_bad2]), tcp)
    finally:
        bad1.close()
        bad2.close()


@pytest.mark.parametrize(("read_timeout", "deadline"), [(30, 5), (0.5, 60)])
def test_each_read_waits_at_most_its_timeout_and_what_is_left_of_the_deadline(
        tcp, read_timeout, deadline):
    a, src_a = serve("a", data())
    counting = CountingTransport(tcp)
    try:
        run(StaticPlanner([src_a]), counting,
            options=FetchOptions(read_timeout=read_timeout, deadline=deadline))
        assert counting.timeouts and all(0 < t <= min(read_timeout, deadline)
                                         for t in counting.timeouts)
    finally:
        a.close()


def test_on_chunk_is_called_once_per_batch_and_reports_go_out_beside_the_reads(tcp):
    """One read in flight, so each read that finishes is a batch.

    `on_chunk` hears the count of chunks present after each batch; every chunk is
    reported (on the reporter thread, never twice) before the fetch returns, and a slow
    report holds up no read.
    """
    a, src_a = serve("a", data())
    reports: list[list[int]] = []
    counts: list[tuple[int, int]] = []

    class SlowReporting(StaticPlanner):
        def report(self, chunks):
            time.sleep(0.2)                     # a hub in another datacenter
            reports.append(list(chunks))

    try:
        run(SlowReporting([src_a]), tcp,
            options=replace(LIMITS, max_inflight=1, read_bytes=4 * CHUNK, report_interval=0),
            on_chunk=lambda done, total: counts.append((done, total)))
        assert counts == [(4, NUM_CHUNKS), (8, NUM_CHUNKS), (NUM_CHUNKS, NUM_CHUNKS)]
        assert [c for r in reports for c in r] == list(range(NUM_CHUNKS))
        # the reads did not wait for the slow reports: later batches met a report on its
        # way and went out together with the next one
        assert len(reports) < 3
    finally:
        a.close()


def test_a_fetch_out_of_rounds_names_the_chunks_still_missing(tcp):
    """One planner call allowed.

    The dead source's spans (0-2, 6-8 of four spans striped over two sources) cannot be
    re-planned, and the next round gives up.
    """
    dead, src_dead = serve("dead", data())
    dead.close()
    good, src_good = serve("good", data())
    planner = StaticPlanner([src_dead, src_good])
    progress = ChunkProgress(NUM_CHUNKS)
    try:
        with pytest.raises(FetchError, match=r"gave up after 1 re-plans; chunks 0-2, 6-8 still"):
            run(planner, tcp, progress=progress, options=replace(LIMITS, max_rounds=1))
        assert planner.rounds == 1 and progress.count == 5
    finally:
        good.close()


def test_a_planner_that_names_no_source_is_an_error(tcp):
    class Empty(StaticPlanner):
        def plan(self, missing, failed):
            return []

    with pytest.raises(FetchError, match=r"no source left for chunks 0-10: the planner named none"):
        run(Empty([]), tcp)


def test_before_write_is_told_each_range_and_what_it_raises_ends_the_fetch(tcp):
    a, src_a = serve("a", data())
    ranges: list[tuple[int, int]] = []
    try:
        run(StaticPlanner([src_a]), tcp, options=replace(LIMITS, max_inflight=1,
                                                          read_bytes=4 * CHUNK),
            before_write=lambda lo, hi: ranges.append((lo, hi)))
        assert ranges == [(0, 4 * CHUNK), (4 * CHUNK, 8 * CHUNK), (8 * CHUNK, NBYTES)]

        def refuse(lo: int, hi: int) -> None:
            raise RuntimeError("no pages")

        dest = torch.zeros(NBYTES, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="no pages"):
            run(StaticPlanner([src_a]), tcp, dest=dest, before_write=refuse)
        assert not dest.any()
    finally:
        a.close()


def test_the_no_source_error_names_corrupt_chunks_and_failed_sources_apart():
    error = _no_source_left([1, 2, 3, 7], {"b": "SourceLostError: gone", "a": "timed out"},
                            {3: {"y", "x"}})
    assert str(error).startswith("chunks 3 failed their checksum from every source that sent "
                                 "them (x, y): ")
    assert (". no source left for chunks 1-2, 7: the sources failed (a: timed out; "
            "b: SourceLostError: gone); retry") in str(error)


def test_ranges_collapse_runs_of_chunks():
    assert _ranges([5, 0, 2, 1, 7, 8]) == "0-2, 5, 7-8" and _ranges([]) == ""
