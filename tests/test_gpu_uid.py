"""NVSHMEM unique-id exchange through a rendezvous (in-memory fake of the hub's kv)."""

from __future__ import annotations

import importlib.util
import os
import threading

import msgpack
import pytest

from fabric.gpu.uid import (
    UID_NBYTES,
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
    raw = os.urandom(UID_NBYTES)
    assert uid_to_bytes(uid_from_bytes(raw)) == raw
