"""Pins: a reader that keeps a holder's memory mapped (CUDA IPC) keeps it allocated.

The server side is the real `ReadServer`; `PinnedMappings` runs with mapping
functions that only record what they were asked, since mapping GPU memory needs a
GPU (tests/fabric/gpu/test_gpu_ipc.py does that on one).
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref

import pytest
import torch

from weightfabric.fabric.errors import ReadRefusedError, TransportError
from weightfabric.fabric.transports import ReadServer, client
from weightfabric.fabric.transports import server as server_module
from weightfabric.fabric.transports.pinned import PinnedMappings
from weightfabric.fabric.transports.wire import REPLY, Op, Status, recv_exact


def exposed(server: ReadServer, name: str) -> weakref.ref:
    """Expose fresh bytes as `name`; the returned reference dies with the server's."""
    data = torch.arange(4000, dtype=torch.int32).to(torch.uint8)
    server.expose(name, data, chunk_size=1000)
    return weakref.ref(data)


def until(condition, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def freed(ref: weakref.ref, within: float = 5.0) -> bool:
    return until(lambda: gc.collect() >= 0 and ref() is None, within)


def notice(pin: socket.socket, timeout: float = 5.0) -> tuple[int, str]:
    pin.settimeout(timeout)
    status, msg_len, _ = REPLY.unpack(recv_exact(pin, REPLY.size))
    return status, recv_exact(pin, msg_len).decode()


def test_a_pin_keeps_a_retracted_regions_memory_until_the_reader_closes_it():
    with ReadServer() as server:
        unpinned, pinned = exposed(server, "a"), exposed(server, "b")
        pin = client.pin(server.address, "b", timeout=5)
        try:
            assert server.retract("a", timeout=5) and freed(unpinned)
            assert server.retract("b", timeout=5) is True  # a pin is not a read in flight
            assert notice(pin) == (Status.NOT_FOUND, "retracted: unmap it")
            assert not freed(pinned, within=0.3)
        finally:
            pin.close()
        assert freed(pinned)


def test_pinning_a_region_that_is_not_exposed_is_refused():
    with ReadServer() as server, pytest.raises(ReadRefusedError, match="NOT_FOUND"):
        client.pin(server.address, "nothing", timeout=5)


def test_a_region_being_retracted_can_be_pinned_under_a_lease_and_says_unmap_at_once():
    with ReadServer() as server:
        ref = exposed(server, "w")
        pool = client.ConnectionPool()
        retracted: list[bool] = []
        try:
            with pool.connection(server.address) as conn:
                client.lease(conn, server.address, "w", offset=0, nbytes=10, timeout=5)
                retract = threading.Thread(
                    target=lambda: retracted.append(server.retract("w", timeout=10)), daemon=True)
                retract.start()
                time.sleep(0.1)  # the retract now waits for the lease
                pin = client.pin(server.address, "w", timeout=5)
                assert notice(pin)[0] == Status.NOT_FOUND
                client.request(conn, server.address, Op.END, "w", timeout=5)
                retract.join(10)
            assert retracted == [True]
            assert not freed(ref, within=0.3)
            pin.close()
            assert freed(ref)
        finally:
            pool.close()


def test_closing_the_server_asks_pinned_readers_to_unmap_and_waits_for_them(monkeypatch):
    monkeypatch.setattr(server_module, "UNPIN_WAIT", 1.0)
    server = ReadServer()
    exposed(server, "w")
    prompt = client.pin(server.address, "w", timeout=5)
    silent = client.pin(server.address, "w", timeout=5)

    def unmap_when_told() -> None:
        notice(prompt)
        time.sleep(0.2)
        prompt.close()

    reader = threading.Thread(target=unmap_when_told, daemon=True)
    reader.start()
    try:
        start = time.monotonic()
        server.close()  # waits for the prompt reader, gives up on the silent one
        assert 0.9 < time.monotonic() - start < 4
        assert notice(silent)[0] == Status.NOT_FOUND
        assert silent.recv(1) == b""  # and its connection was closed
    finally:
        reader.join(5)
        silent.close()


def test_a_reader_is_told_to_unmap_once_though_retract_and_close_both_tell(monkeypatch):
    """One notice per pin.

    The region's retract tells the reader; the server's close that follows (or a
    close racing the pin's answer) does not tell it again.
    """
    monkeypatch.setattr(server_module, "UNPIN_WAIT", 0.3)
    server = ReadServer()
    exposed(server, "w")
    silent = client.pin(server.address, "w", timeout=5)
    try:
        assert server.retract("w", timeout=5)
        server.close()
        assert notice(silent)[0] == Status.NOT_FOUND
        assert silent.recv(1) == b""  # no second notice: the connection just ends
    finally:
        silent.close()


class Reader:
    """`PinnedMappings` of `holder`'s regions with map functions that record calls."""

    def __init__(self, holder: ReadServer, capacity: int = 4) -> None:
        self.holder = holder
        self.opened: list[str] = []
        self.unmapped: list[str] = []
        self.maps = PinnedMappings(self.unmapped.append, capacity=capacity)

    def use(self, name: str, open_mapping=None):
        def record() -> str:
            self.opened.append(name)
            return name
        return self.maps.use(name.encode(), self.holder.address, name, open_mapping or record,
                             timeout=5)


@pytest.fixture
def holder():
    with ReadServer() as server:
        yield server


@pytest.fixture
def reader(holder):
    reader = Reader(holder)
    yield reader
    reader.maps.close()


def test_a_mapping_is_opened_and_pinned_once_then_unmapped_soon_after_its_region_is_retracted(
        holder, reader):
    ref = exposed(holder, "w")
    for _ in range(3):
        with reader.use("w") as mapping:
            assert mapping == "w"
    assert reader.opened == ["w"] and len(reader.maps) == 1
    assert holder.retract("w", timeout=5)
    assert until(lambda: reader.unmapped == ["w"]) and len(reader.maps) == 0
    assert freed(ref)


def test_a_mapping_in_use_when_its_region_is_retracted_is_unmapped_when_the_use_ends(
        holder, reader):
    ref = exposed(holder, "w")
    with reader.use("w"):
        assert holder.retract("w", timeout=5)
        time.sleep(0.5)  # several watcher rounds: it must not unmap memory in use
        assert reader.unmapped == [] and not freed(ref, within=0.1)
    assert reader.unmapped == ["w"]  # at once, not at the watcher's next round
    assert freed(ref)


def test_the_least_recently_used_idle_mapping_is_unmapped_and_unpinned_beyond_capacity(holder):
    reader = Reader(holder, capacity=2)
    refs = {name: exposed(holder, name) for name in "abc"}
    try:
        for name in "abac":
            with reader.use(name):
                pass
        assert reader.opened == ["a", "b", "c"] and reader.unmapped == ["b"]
        assert holder.retract("b", timeout=5) and freed(refs["b"])  # its pin went with it
        assert holder.retract("a", timeout=5)
        assert until(lambda: "a" in reader.unmapped) and freed(refs["a"])
    finally:
        reader.maps.close()
    assert sorted(reader.unmapped) == ["a", "b", "c"]


def test_a_failed_mapping_releases_its_pin_and_a_refused_pin_maps_nothing(holder, reader):
    ref = exposed(holder, "w")

    def cannot_map() -> str:
        raise RuntimeError("no such device")

    with pytest.raises(RuntimeError, match="no such device"), reader.use("w", cannot_map):
        pass
    with pytest.raises(ReadRefusedError), reader.use("gone"):
        pass
    assert len(reader.maps) == 0 and reader.opened == []
    assert holder.retract("w", timeout=5) and freed(ref)


def test_closing_unmaps_everything_and_refuses_further_use(holder, reader):
    ref = exposed(holder, "w")
    with reader.use("w"):
        pass
    reader.maps.close()
    assert reader.unmapped == ["w"]
    assert holder.retract("w", timeout=5) and freed(ref)
    with pytest.raises(TransportError, match="closed"), reader.use("w"):
        pass


def test_a_holder_that_closes_gets_its_mappings_unmapped_without_waiting_out_its_limit():
    holder = ReadServer()
    reader = Reader(holder)
    exposed(holder, "w")
    try:
        with reader.use("w"):
            pass
        start = time.monotonic()
        holder.close()
        assert time.monotonic() - start < 2 and reader.unmapped == ["w"]
    finally:
        holder.close()
        reader.maps.close()
