"""How often a fetch reports its progress: a few times per fetch, not per unit of time.

`FetchOptions.max_reports` K: at most K reports before the last one, each when the chunks
verified pass another 1/(K+1) of those the fetch reads; the last report carries the rest
before the fetch returns, unless the planner's side completes the fetch (`HubPlanner`:
the hub's ``complete_fetch`` records every chunk). Against a real read server and hub; no
timing is asserted.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import replace

import pytest
import torch
from timeouts import hard_timeout

from weightfabric.fabric.fetch import Assignment, FetchOptions, Source, fetch_chunks
from weightfabric.fabric.progress import ChunkProgress
from weightfabric.fabric.transports import ReadServer, TcpTransport

CHUNK = 4096
NUM_CHUNKS = 120
ONE_BY_ONE = FetchOptions(max_inflight=1, read_bytes=CHUNK, report_interval=0,
                          read_timeout=10, deadline=60)
"""A read per chunk, one at a time, and no interval between reports: only the
milestones bound them."""


def data() -> torch.Tensor:
    return (torch.arange(NUM_CHUNKS * CHUNK, dtype=torch.int64) * 13 % 251).to(torch.uint8)


def sums(first: int, piece: torch.Tensor) -> list[int]:
    return [zlib.crc32(piece[i * CHUNK:(i + 1) * CHUNK].numpy().tobytes(), first + i)
            for i in range(-(-piece.numel() // CHUNK))]


class Recording:
    """A planner offering one source for every chunk; it records each report."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.reports: list[list[int]] = []

    def plan(self, missing, failed):
        return [Assignment(tuple(missing), (self.source,))]

    def report(self, chunks):
        self.reports.append(list(chunks))


class Completing(Recording):
    """A planner whose side completes the fetch (as `HubPlanner`): no last report."""

    completes = True


@pytest.fixture
def holder():
    server = ReadServer()
    server.expose("v1", data(), chunk_size=CHUNK)
    transport = TcpTransport()
    try:
        yield Source("holder", server.address, "v1"), transport
    finally:
        transport.close()
        server.close()


def fetch(planner, transport, options: FetchOptions) -> torch.Tensor:
    dest = torch.zeros(NUM_CHUNKS * CHUNK, dtype=torch.uint8)
    stats = fetch_chunks(dest, chunk_size=CHUNK, progress=ChunkProgress(NUM_CHUNKS),
                         planner=planner, choose=lambda _: transport,
                         checksums=sums(0, data()), checksum_fn=sums, options=options)
    assert stats.chunks == NUM_CHUNKS
    return dest


@hard_timeout(60)
@pytest.mark.parametrize("most", [0, 1, 2, 5])
def test_a_fetch_of_many_chunks_reports_at_most_k_times_then_the_rest(holder, most):
    """120 reads, each a batch: at most K reports before the last one."""
    source, transport = holder
    planner = Recording(source)
    dest = fetch(planner, transport, replace(ONE_BY_ONE, max_reports=most))
    assert torch.equal(dest, data())
    reports = planner.reports
    assert 1 <= len(reports) <= most + 1
    assert [c for r in reports for c in r] == list(range(NUM_CHUNKS))  # each once, in order
    if most == 0:
        assert len(reports) == 1


class Budgeted(Completing):
    """A planner that asks for fewer milestone reports (as the hub's budget does)."""

    def __init__(self, source: Source, asked: int) -> None:
        super().__init__(source)
        self.max_reports = asked


@hard_timeout(60)
@pytest.mark.parametrize("own,asked,most", [(2, 0, 0), (2, 1, 1), (1, 5, 1), (None, 1, 1)])
def test_the_planner_can_ask_for_fewer_milestone_reports(holder, own, asked, most):
    """The smaller of the engine's K and the planner's ``max_reports`` bounds them."""
    source, transport = holder
    planner = Budgeted(source, asked)
    fetch(planner, transport, replace(ONE_BY_ONE, max_reports=own))
    assert min(most, 1) <= len(planner.reports) <= most
    told = [c for r in planner.reports for c in r]
    assert told == list(range(len(told))) and len(told) < NUM_CHUNKS


@hard_timeout(60)
def test_a_fetch_waiting_on_a_partial_source_reports_what_it_has(holder):
    """10 of 120 chunks there (below the first milestone, 40): reported while it waits.

    Once no chunk came for `IDLE_REPORT_S` (one of its `max_reports`).
    """
    _, transport = holder
    held = ChunkProgress(NUM_CHUNKS)
    for chunk in range(10):
        held.mark(chunk)
    server = ReadServer()
    server.expose("v1", data(), chunk_size=CHUNK, progress=held)
    planner = Recording(Source("partial", server.address, "v1"))
    out: list[torch.Tensor] = []
    reading = threading.Thread(target=lambda: out.append(fetch(planner, transport, ONE_BY_ONE)))
    try:
        reading.start()
        deadline = time.monotonic() + 20
        while not planner.reports and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planner.reports == [list(range(10))] and reading.is_alive()
    finally:
        for chunk in range(10, NUM_CHUNKS):
            held.mark(chunk)
        reading.join(30)
        server.close()
    assert out and torch.equal(out[0], data())
    assert len(planner.reports) <= ONE_BY_ONE.max_reports + 1


@hard_timeout(60)
def test_the_default_is_a_few_reports_per_fetch(holder):
    source, transport = holder
    planner = Recording(source)
    fetch(planner, transport, FetchOptions(max_inflight=1, read_bytes=CHUNK, report_interval=0))
    assert FetchOptions().max_reports is not None
    assert len(planner.reports) <= FetchOptions().max_reports + 1


@hard_timeout(60)
def test_a_planner_that_completes_the_fetch_gets_no_last_report(holder):
    """`HubPlanner` completes at the hub after the engine returns: only the K reports."""
    source, transport = holder
    planner = Completing(source)
    fetch(planner, transport, ONE_BY_ONE)
    told = [c for r in planner.reports for c in r]
    assert len(planner.reports) <= ONE_BY_ONE.max_reports
    assert told == list(range(len(told))) and len(told) < NUM_CHUNKS


@hard_timeout(60)
def test_a_store_fetch_costs_the_hub_at_most_k_progress_reports(workers, hub, monkeypatch):
    """Counted at the hub: 64 reads, one at a time, no interval; the fetch completes."""
    trainer, reader = workers.join("trainer"), workers.join("reader")
    tensors = {"w": torch.randn(64 * 1024)}       # 256 KiB: 64 chunks of 4 KiB
    version = trainer.model("m", chunk_size=CHUNK).publish(tensors)
    calls: list[tuple[str, int]] = []
    report = hub.state.report_progress

    def counted(fetch_id, worker, **kwargs):
        calls.append((worker, len(kwargs["chunks"])))
        return report(fetch_id, worker, **kwargs)

    monkeypatch.setattr(hub.state, "report_progress", counted)
    store = reader.model("m")
    stats = store.fetch(version, options=FetchOptions(max_inflight=1, read_bytes=CHUNK,
                                                      report_interval=0))
    assert stats.chunks == 64 and torch.equal(store.tensors["w"], tensors["w"])
    mine = [n for w, n in calls if w == "reader"]
    assert 1 <= len(mine) <= FetchOptions().max_reports   # the rest came with the completion
    assert sum(mine) < 64
    assert "reader" in reader.hub.locate("m", version)["shards"][0]["holders"]
