"""NVSHMEM unique-id exchange through a rendezvous: in memory and through a real hub."""

from __future__ import annotations

import importlib.util
import os
import threading

import msgpack
import pytest

import weightfabric as wf
from weightfabric.fabric.gpu.uid import (
    UID_NBYTES,
    HubRendezvous,
    MemoryRendezvous,
    decode_uid,
    encode_uid,
    exchange_unique_id,
    uid_from_bytes,
    uid_to_bytes,
)


def test_every_pe_gets_pe0s_unique_id_whoever_arrives_first():
    rdv, raw = MemoryRendezvous(), os.urandom(UID_NBYTES)
    got: dict[int, bytes] = {}
    created = []

    def pe(rank: int) -> None:
        got[rank] = exchange_unique_id(rdv, session="s1", rank=rank, nranks=4,
                                       create=lambda: created.append(1) or raw, timeout=10)

    threads = [threading.Thread(target=pe, args=(r,)) for r in (3, 1, 2, 0)]  # readers first
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert got == {r: raw for r in range(4)} and created == [1]


def test_pes_exchange_the_id_through_the_hub_and_a_late_pe0_is_a_timeout():
    raw = os.urandom(UID_NBYTES)
    with wf.serve("tcp://127.0.0.1:0", lease_s=5.0) as hub:
        clients = [wf.connect(hub.url) for _ in range(3)]
        got: dict[int, bytes] = {}
        try:
            def pe(rank: int) -> None:
                got[rank] = exchange_unique_id(HubRendezvous(clients[rank]), session="job-9",
                                               rank=rank, nranks=3, create=lambda: raw, timeout=10)

            threads = [threading.Thread(target=pe, args=(r,)) for r in (2, 1, 0)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(15)
            assert got == {0: raw, 1: raw, 2: raw}
            with pytest.raises(TimeoutError, match="nvshmem-uid/other"):
                exchange_unique_id(HubRendezvous(clients[1]), session="other", rank=1, nranks=2,
                                   create=bytes, timeout=0.2)
        finally:
            for c in clients:
                c.close()


def test_a_stale_id_from_another_session_or_size_is_refused():
    value = encode_uid(bytes(UID_NBYTES), nranks=2, session="old-job")
    with pytest.raises(ValueError, match="session 'old-job' with 2 PEs.*stale"):
        decode_uid(value, nranks=2, session="new-job")
    with pytest.raises(ValueError, match="joins 'old-job' with 4"):
        decode_uid(value, nranks=4, session="old-job")
    assert decode_uid(value, nranks=2, session="old-job") == bytes(UID_NBYTES)


def test_malformed_values_and_bad_ranks_are_errors():
    with pytest.raises(ValueError, match="not msgpack"):
        decode_uid(b"\xc1", nranks=1, session="s")
    with pytest.raises(ValueError, match="not a weightfabric"):
        decode_uid(msgpack.packb({"uid": b"x"}), nranks=1, session="s")
    with pytest.raises(ValueError, match="128 bytes"):
        encode_uid(b"short", nranks=1, session="s")
    with pytest.raises(ValueError, match="rank 2 outside"):
        exchange_unique_id(MemoryRendezvous(), session="s", rank=2, nranks=2, create=bytes)


def test_a_pe_waiting_for_a_missing_pe0_times_out():
    with pytest.raises(TimeoutError, match="nvshmem-uid/s"):
        exchange_unique_id(MemoryRendezvous(), session="s", rank=1, nranks=2, create=bytes,
                           timeout=0.05)


@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None,
                    reason="nvshmem4py not installed (gpu extra); the byte round-trip needs its bindings, not a GPU")
def test_uid_bytes_round_trip_through_nvshmem_bindings():
    import ctypes

    raw = os.urandom(UID_NBYTES)
    uid = uid_from_bytes(raw)
    assert uid_to_bytes(uid) == raw
    assert ctypes.string_at(uid.ptr, UID_NBYTES) == raw  # the bytes init hands to libnvshmem
