"""Readers with another tensor-parallel layout fetch a sharded version through the fabric.

TP2 publishers, TP1 and TP4 readers, fp8 stored and bf16 wanted, a holder that fails, a
holder that sends corrupted bytes (verified against the chunk checksums).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import weightfabric as wf
from weightfabric.fabric.errors import (
    FetchError,
    ManifestMismatchError,
    UnknownModelError,
    UnknownVersionError,
)
from weightfabric.fabric.fetch import Source, band_verify_rule, verify_rule
from weightfabric.fabric.relayout.reader import Resharding, ReshardReader, fetch_resharded
from weightfabric.fabric.transports import SourceAddress, local_host_id
from weightfabric.kernels import (
    FusedGateUp,
    FusedQKV,
    Replicated,
    Sharded,
    dequantize_fp8_ref,
    quantize_fp8_ref,
    split_tensor,
)

CHUNK = 4096
HEADS, KV, HD, HIDDEN, INTER = 8, 2, 16, 64, 96


def layouts(tp: int) -> dict[str, tuple[tuple[int, ...], object]]:
    return {
        "qkv": (((HEADS + 2 * KV) * HD, HIDDEN),
                FusedQKV(tp=tp, num_heads=HEADS, num_kv_heads=KV, head_dim=HD)),
        "o": ((HIDDEN, HEADS * HD), Sharded(tp=tp, dim=1)),
        "gate_up": ((2 * INTER, HIDDEN), FusedGateUp(tp=tp)),
        "down": ((HIDDEN, INTER), Sharded(tp=tp, dim=1)),
        "norm": ((HIDDEN,), Replicated(tp=tp)),
        "w8": ((256, 128), Sharded(tp=tp, dim=0)),  # stored as fp8 with scales
    }


def full_tensors(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(shape, generator=g).to(torch.bfloat16)
           for n, (shape, _) in layouts(1).items()}
    out["norm"] = out["norm"].float()
    return out


def publisher_tensors(full: dict[str, torch.Tensor], rank: int, block: int = 128
                      ) -> dict[str, torch.Tensor]:
    out = {}
    for name, (shape, layout) in layouts(2).items():
        shard = split_tensor(full[name], layout, backend="torch")[rank].contiguous()
        if name == "w8":
            q, scale = quantize_fp8_ref(shard.float(), block)
            out[name], out[name + ".scale"] = q, scale
        else:
            out[name] = shard.reshape(layout.shard_shape(shape, rank)[:len(shape)])
    return out


def expected(full: dict[str, torch.Tensor], tp: int, rank: int, block: int = 128
             ) -> dict[str, torch.Tensor]:
    """What reader ``rank`` of ``tp`` must hold.

    Its shard of the logical tensors, with w8 dequantised from the publishers' fp8 shards
    (quantised in blocks of ``block``).
    """
    w8 = torch.cat([dequantize_fp8_ref(*quantize_fp8_ref(s.float(), block),
                                       dtype=torch.bfloat16, block=block)
                    for s in split_tensor(full["w8"], layouts(2)["w8"][1], backend="torch")])
    logical = {**full, "w8": w8}
    return {n: split_tensor(logical[n], layout, backend="torch")[rank].reshape(
                layout.shard_shape(shape, rank)[:len(shape)])
            for n, (shape, layout) in layouts(tp).items()}


def spec(tp: int, block: int = 128) -> dict[str, Resharding]:
    held, wanted = layouts(2), layouts(tp)
    return {n: Resharding(shape, held[n][1], wanted[n][1], block=block)
            for n, (shape, _) in held.items()}


@pytest.fixture
def published(hub, workers):
    """Two TP2 trainers (on the shared ``hub``) that published one version of `full_tensors`."""
    full = full_tensors()
    trainers = [workers.join(f"trainer-{r}") for r in range(2)]
    versions = {trainers[r].model("policy", chunk_size=CHUNK, shard=r, num_shards=2)
                .publish(publisher_tensors(full, r), group="step-1") for r in range(2)}
    assert len(versions) == 1
    return hub, full, versions.pop(), trainers


@pytest.mark.parametrize("tp,rank", [(1, 0), (4, 1), (4, 3)])
def test_readers_with_another_tp_degree_get_their_shards_bit_exact(published, tp, rank):
    hub, full, version, _ = published
    want = expected(full, tp, rank)
    with wf.join(hub.url, worker="reader") as reader:
        dst = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fetch_resharded(reader, "policy", spec(tp), dst, rank=rank, budget=64 << 10)
    assert stats.version == version
    for name in want:
        assert torch.equal(dst[name], want[name]), name
    assert stats.staging_peak_bytes <= 64 << 10 and stats.bands >= len(want)
    assert set(stats.sources) <= {"trainer-0", "trainer-1"} and not stats.failed_sources


def test_a_holder_that_stops_serving_is_skipped_for_another_of_its_shard(published):
    hub, full, version, trainers = published
    with wf.join(hub.url, worker="rollout-0") as spare, \
            wf.join(hub.url, worker="reader") as reader:
        spare.model("policy", chunk_size=CHUNK, shard=0, num_shards=2).fetch(version)
        trainers[0].server.close()  # its data plane is gone, its hub lease is not
        locate = reader.hub.locate

        def trainer_first(model, v="latest"):
            where = locate(model, v)
            where["shards"][0]["holders"].sort(key=lambda w: w != "trainer-0")
            return where

        reader.hub.locate = trainer_first
        want = expected(full, 1, 0)
        dst = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fetch_resharded(reader, "policy", spec(1), dst, rank=0, budget=64 << 10)
    assert all(torch.equal(dst[n], want[n]) for n in want)
    assert stats.failed_sources == ["trainer-0"] and stats.sources.get("rollout-0", 0) > 0


def test_fp8_scales_must_match_the_block_the_reader_names(workers):
    """Publishers quantised in blocks of 64.

    A reader assuming the default 128 (or scales stored in another dtype) is refused, one
    naming block 64 gets exact bytes.
    """
    full = full_tensors()
    trainers = [workers.join(f"trainer-{r}") for r in range(2)]
    for r in range(2):
        tensors = publisher_tensors(full, r, block=64)
        bf16_scales = {**tensors, "w8.scale": tensors["w8.scale"].bfloat16()}
        for model, published in (("policy", tensors), ("bf16-scales", bf16_scales)):
            trainers[r].model(model, chunk_size=CHUNK, shard=r, num_shards=2
                              ).publish(published, group=model)
    want = expected(full, 1, 0, block=64)
    reader = workers.join("reader")
    dst = {n: torch.empty_like(t) for n, t in want.items()}
    with pytest.raises(ManifestMismatchError, match="scales 'w8.scale'.*block"):
        fetch_resharded(reader, "policy", spec(1), dst, rank=0)
    with pytest.raises(ManifestMismatchError, match="torch.bfloat16"):
        fetch_resharded(reader, "bf16-scales", spec(1, block=64), dst, rank=0)
    fetch_resharded(reader, "policy", spec(1, block=64), dst, rank=0)
    assert all(torch.equal(dst[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="block must be a power of two"):
        Resharding((4, 4), Sharded(tp=1, dim=0), Sharded(tp=1, dim=0), block=0)


def test_layouts_that_do_not_match_the_shards_are_refused_naming_the_tensor(published):
    hub, _, _, _ = published
    wrong = dict(spec(1))
    wrong["o"] = Resharding((HIDDEN, HEADS * HD), Sharded(tp=2, dim=0), Sharded(tp=1, dim=0))
    with wf.join(hub.url, worker="reader") as reader:
        dst = {n: torch.empty_like(t) for n, t in expected(full_tensors(), 1, 0).items()}
        with pytest.raises(ManifestMismatchError, match="tensor 'o' is"):
            fetch_resharded(reader, "policy", wrong, dst, rank=0)
        with pytest.raises(ValueError, match="no destination for \\['down'\\]"):
            fetch_resharded(reader, "policy", spec(1), {n: t for n, t in dst.items()
                                                       if n != "down"}, rank=0)


def test_locate_names_every_shards_holders_and_refuses_what_is_not_committed(published):
    hub, _, version, _ = published
    with wf.connect(hub.url) as observer:
        where = observer.locate("policy")
        assert where["version"] == version and where["num_shards"] == 2
        assert [s["holders"] for s in where["shards"]] == [["trainer-0"], ["trainer-1"]]
        assert set(where["workers"]) == {"trainer-0", "trainer-1"}
        with pytest.raises(UnknownModelError):
            observer.locate("nope")
        with pytest.raises(UnknownVersionError):
            observer.locate("policy", version + 1)


@dataclass
class Tap:
    """Installed as a worker's ``transport_for``.

    Reads through its transports, records every read as (worker, region, offset, nbytes),
    and flips one byte of each read from the worker ``corrupt``. The reader asks for a
    transport just before each read, one read at a time.
    """

    choose: object
    corrupt: str | None = None
    reads: list[tuple[str, str, int, int]] = field(default_factory=list)
    timeouts: set[float] = field(default_factory=set)  # how long the reader lets it ask

    def __call__(self, source: Source, *, timeout: float) -> Tap:
        self.timeouts.add(timeout)
        self.source, self.inner = source, self.choose(source, timeout=timeout)
        return self

    def read(self, address, region, offset, out, *, timeout):
        self.inner.read(address, region, offset, out, timeout=timeout)
        self.reads.append((self.source.worker, region, offset, out.numel()))
        if self.source.worker == self.corrupt:
            out[out.numel() // 2] ^= 0xFF


def tapped(reader, monkeypatch, corrupt: str | None = None) -> Tap:
    tap = Tap(reader.transport_for, corrupt)
    monkeypatch.setattr(reader, "transport_for", tap)
    return tap


def test_a_holder_sending_corrupted_bytes_is_skipped_for_another_of_its_shard(published,
                                                                              monkeypatch):
    hub, full, version, _ = published
    with wf.join(hub.url, worker="rollout-0") as spare, \
            wf.join(hub.url, worker="reader") as reader:
        spare.model("policy", chunk_size=CHUNK, shard=0, num_shards=2).fetch(version)
        locate = reader.hub.locate

        def trainer_first(model, v="latest"):
            where = locate(model, v)
            where["shards"][0]["holders"].sort(key=lambda w: w != "trainer-0")
            return where

        monkeypatch.setattr(reader.hub, "locate", trainer_first)
        tap = tapped(reader, monkeypatch, corrupt="trainer-0")
        want = expected(full, 1, 0)
        dst = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fetch_resharded(reader, "policy", spec(1), dst, rank=0, budget=64 << 10,
                                verify=True, timeout=7.5)
    assert all(torch.equal(dst[n], want[n]) for n in want)
    assert tap.timeouts == {7.5}  # a holder on this host is asked within the read timeout
    assert stats.failed_sources == ["trainer-0"] and "trainer-0" not in stats.sources
    assert stats.sources["rollout-0"] > 0 and stats.verified_chunks > 0
    assert stats.fetched_bytes == sum(n for *_, n in tap.reads) > sum(stats.sources.values())
    assert 0 < stats.verify_peak_bytes <= stats.staging_peak_bytes + 6 * CHUNK


def test_corrupted_bytes_from_the_only_holder_fail_the_fetch_naming_the_chunk(published,
                                                                             monkeypatch):
    hub, full, version, _ = published
    with wf.join(hub.url, worker="reader") as reader:
        tapped(reader, monkeypatch, corrupt="trainer-1")
        dst = {n: torch.empty_like(t) for n, t in expected(full, 1, 0).items()}
        with pytest.raises(FetchError, match=f"'policy' v{version} shard 1: .*"
                                             r"trainer-1: chunk \d+ failed its checksum"):
            fetch_resharded(reader, "policy", spec(1), dst, rank=0, verify=True)


@pytest.mark.parametrize("verify", [False, None])
def test_unverified_reads_let_corrupted_bytes_through(published, monkeypatch, verify):
    """verify=False, and by default for bands read from holders on this host.

    The checksums are what catches the corruption above.
    """
    hub, full, _, _ = published
    with wf.join(hub.url, worker="reader") as reader:
        tapped(reader, monkeypatch, corrupt="trainer-1")
        want = expected(full, 1, 0)
        dst = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fetch_resharded(reader, "policy", spec(1), dst, rank=0, verify=verify)
    assert not all(torch.equal(dst[n], want[n]) for n in want)
    assert stats.verified_chunks == 0 and not stats.failed_sources


def test_by_default_bands_from_holders_on_other_hosts_are_verified(published, monkeypatch):
    hub, full, _, trainers = published
    monkeypatch.setenv("WEIGHTFABRIC_HOST_ID", "elsewhere")  # the trainers' host is not ours
    with wf.join(hub.url, worker="reader") as reader:
        tapped(reader, monkeypatch, corrupt="trainer-1")
        dst = {n: torch.empty_like(t) for n, t in expected(full, 1, 0).items()}
        with pytest.raises(FetchError, match=r"trainer-1: chunk \d+ failed its checksum"):
            fetch_resharded(reader, "policy", spec(1), dst, rank=0)
    here = Source("w", SourceAddress("127.0.0.1", 1, local_host_id()), "r")
    there = Source("w", SourceAddress("127.0.0.1", 1, "other-host"), "r")
    assert (band_verify_rule(None)(here), band_verify_rule(None)(there)) == (False, True)
    assert (verify_rule(None)(here), verify_rule(None)(there)) == (True, True)  # whole chunks
    assert verify_rule(True)(here) and not verify_rule(False)(there)


@pytest.mark.parametrize("tp,rank", [(1, 0), (4, 1)])
def test_a_chunk_shared_by_neighbouring_bands_is_read_once(published, monkeypatch, tp, rank):
    hub, full, _, _ = published
    with wf.join(hub.url, worker="reader") as reader:
        tap = tapped(reader, monkeypatch)
        want = expected(full, tp, rank)
        dst = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fetch_resharded(reader, "policy", spec(tp), dst, rank=rank, budget=64 << 10,
                                verify=True)
    assert all(torch.equal(dst[n], want[n]) for n in want)
    read = [(region, c) for _, region, offset, n in tap.reads
            for c in range(offset // CHUNK, (offset + n - 1) // CHUNK + 1)]
    assert all(offset % CHUNK == 0 for _, _, offset, _ in tap.reads)
    assert stats.reused_chunks > 0 and len(read) == len(set(read)) == stats.verified_chunks


def test_a_kept_reader_fetches_each_new_version_in_the_same_buffers(published):
    """v1's cached chunks do not serve v2, and v1's buffers are reused for v2.

    The chunks cached for v1's bands must not serve v2's, and the staging and verification
    buffers of v1 are reused for v2 (same layout, so same sizes).
    """
    hub, full, version, trainers = published
    with wf.join(hub.url, worker="reader") as reader:
        kept = ReshardReader(reader, "policy", spec(1), rank=0, budget=64 << 10, verify=True)
        dst = {n: torch.empty_like(t) for n, t in expected(full, 1, 0).items()}
        first = kept.fetch(dst, version)
        assert first.reused_chunks > 0 and all(torch.equal(dst[n], t)
                                               for n, t in expected(full, 1, 0).items())
        buffers = [kept._staging.data_ptr(), kept._chunks._scratch.data_ptr(),
                   kept._chunks._slots.data_ptr()]
        full2 = full_tensors(seed=4)
        for r in range(2):
            trainers[r].model("policy", chunk_size=CHUNK, shard=r,
                              num_shards=2).publish(publisher_tensors(full2, r), group="step-2")
        second = kept.fetch(dst)
    assert second.version == version + 1
    for name, want in expected(full2, 1, 0).items():
        assert torch.equal(dst[name], want), name
    assert [kept._staging.data_ptr(), kept._chunks._scratch.data_ptr(),
            kept._chunks._slots.data_ptr()] == buffers


def test_the_chunk_cache_keeps_the_most_recently_used_chunks_in_its_slots():
    from weightfabric.fabric.relayout.reader import _CACHED_CHUNKS, ChunkBuffers

    buffers = ChunkBuffers()
    chunk = {c: torch.full((8,), c, dtype=torch.uint8) for c in range(_CACHED_CHUNKS + 2)}
    buffers.put((0, _CACHED_CHUNKS), chunk[_CACHED_CHUNKS][:5], 8)  # a shorter last chunk
    slots = buffers._slots.data_ptr()
    for c in range(_CACHED_CHUNKS - 1):
        buffers.put((0, c), chunk[c], 8)
    assert buffers._slots.data_ptr() == slots  # sized by the chunk size, not the first chunk
    assert torch.equal(buffers.get((0, _CACHED_CHUNKS)), chunk[_CACHED_CHUNKS][:5])
    assert torch.equal(buffers.get((0, 0)), chunk[0])  # now the most recently used
    buffers.put((0, _CACHED_CHUNKS - 1), chunk[_CACHED_CHUNKS - 1], 8)
    assert buffers.get((0, 1)) is None  # the least recently used went
    assert all(torch.equal(buffers.get((0, c)), chunk[c]) for c in (0, 2, _CACHED_CHUNKS - 1))
    assert torch.equal(buffers.get((0, _CACHED_CHUNKS)), chunk[_CACHED_CHUNKS][:5])
    nbytes = buffers.nbytes
    buffers.clear()
    assert buffers.get((0, 0)) is None and buffers.nbytes == nbytes == _CACHED_CHUNKS * 8
    buffers.put((1, 0), torch.zeros(16, dtype=torch.uint8), 16)  # a larger chunk size
    assert buffers.nbytes == _CACHED_CHUNKS * 16 and buffers.get((1, 0)).numel() == 16


def test_a_kept_readers_unverified_fetch_reports_the_verification_memory_it_still_holds(
        published):
    hub, full, version, _ = published
    with wf.join(hub.url, worker="reader") as reader:
        kept = ReshardReader(reader, "policy", spec(1), rank=0, budget=64 << 10, verify=True)
        dst = {n: torch.empty_like(t) for n, t in expected(full, 1, 0).items()}
        verified = kept.fetch(dst, version)
        kept._verify = verify_rule(False)
        unverified = kept.fetch(dst, version)
    assert unverified.verified_chunks == 0 < verified.verified_chunks
    assert unverified.verify_peak_bytes == verified.verify_peak_bytes == kept._chunks.nbytes > 0


def test_one_resharding_reader_republishes_its_layout_for_the_others_to_fetch(published):
    """The fan-out recipe of docs/gpu.md.

    Resharding readers hold no replica, so one reader per wanted layout publishes what it
    read under its own model name, and the other readers of that layout fetch it
    layout-matched (through the fabric's trees).
    """
    hub, full, _, _ = published
    want = expected(full, 1, 0)
    with wf.join(hub.url, worker="rollout-0") as first, \
            wf.join(hub.url, worker="rollout-1") as second:
        mine = {n: torch.empty_like(t) for n, t in want.items()}
        ReshardReader(first, "policy", spec(1), rank=0).fetch(mine)
        v = first.model("policy-tp1", chunk_size=CHUNK).publish(mine)
        store = second.model("policy-tp1")
        stats = store.fetch(v)
        got = store.tensors
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert set(stats.sources) == {"rollout-0"}
