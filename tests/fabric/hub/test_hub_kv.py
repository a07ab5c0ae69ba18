"""The key/value rendezvous store over memory:// and loopback TCP."""

from __future__ import annotations

import itertools
import math
import threading
import time

import pytest
from hub_helpers import FakeClock, OffsetClock

import weightfabric as wf
from weightfabric.fabric.errors import BadRequestError, HubTimeoutError, ValueTooLargeError
from weightfabric.fabric.hub.kv import KvStore
from weightfabric.fabric.hub.state import MAX_KV_VALUE, HubState

_names = itertools.count()


@pytest.fixture(params=["memory", "tcp"])
def hub(request):
    clock = OffsetClock()
    url = f"memory://kv-{next(_names)}" if request.param == "memory" else "tcp://127.0.0.1:0"
    server = wf.serve(url, clock=clock)
    server.test_clock = clock
    yield server
    server.stop()


@pytest.fixture
def clients(hub):
    made: list[wf.HubClient] = []

    def make(worker: str | None = None) -> wf.HubClient:
        c = wf.connect(hub.url, worker=worker, heartbeat=False, timeout=5.0)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_kv_get_returns_what_another_client_put(clients) -> None:
    a, b = clients("rank0"), clients()
    a.kv_put("job/uid", b"\x00\x01binary\xff")
    assert b.kv_get("job/uid", timeout=1) == b"\x00\x01binary\xff"
    a.kv_put("job/uid", b"second")                 # last writer wins
    assert b.kv_get("job/uid", timeout=0) == b"second"


def test_kv_get_long_polls_until_the_key_is_put(clients) -> None:
    a, b = clients(), clients()
    putter = threading.Timer(0.3, lambda: a.kv_put("late", b"here"))
    putter.start()
    try:
        t0 = time.monotonic()
        assert b.kv_get("late", timeout=10) == b"here"
        assert 0.2 < time.monotonic() - t0 < 5
    finally:
        putter.join()


def test_kv_get_times_out_with_typed_error(clients) -> None:
    b = clients()
    t0 = time.monotonic()
    with pytest.raises(HubTimeoutError, match="did not appear"):
        b.kv_get("never", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    with pytest.raises(HubTimeoutError):
        b.kv_get("never", timeout=0)


def test_kv_value_size_is_bounded(clients, hub) -> None:
    a = clients()
    a.kv_put("max", b"x" * MAX_KV_VALUE)
    assert len(a.kv_get("max", timeout=0)) == MAX_KV_VALUE
    with pytest.raises(ValueTooLargeError):
        a.kv_put("big", b"x" * (MAX_KV_VALUE + 1))
    # The hub checks too (a client that skips the local check still gets the typed error).
    with pytest.raises(ValueTooLargeError):
        a.call("kv_put", {"key": "big", "value": b"x" * (MAX_KV_VALUE + 1)})
    with pytest.raises(ValueTooLargeError):
        a.kv_put("k" * 300, b"v")
    with pytest.raises(BadRequestError):
        a.kv_put("", b"v")
    with pytest.raises(BadRequestError):
        a.kv_put("k", b"v", ttl=0)
    with pytest.raises(BadRequestError):
        a.call("kv_put", {"key": "k", "value": "not bytes"})
    assert a.status()["models"] == {}               # the hub still serves


def test_kv_ttl_expires_keys(clients, hub) -> None:
    a = clients()
    a.kv_put("short", b"1", ttl=5)
    a.kv_put("long", b"2")
    assert a.kv_get("short", timeout=0) == b"1"
    hub.test_clock.advance(6)
    with pytest.raises(HubTimeoutError):
        a.kv_get("short", timeout=0)
    assert a.kv_get("long", timeout=0) == b"2"


def test_kv_is_per_hub_and_soft_state() -> None:
    one, two = wf.serve("memory://kv-one"), wf.serve("memory://kv-two")
    try:
        with wf.connect(one.url, timeout=5) as c1, wf.connect(two.url, timeout=5) as c2:
            c1.kv_put("k", b"on one")
            with pytest.raises(HubTimeoutError):
                c2.kv_get("k", timeout=0)
        one.stop()
        one = wf.serve("memory://kv-one")        # a restart forgets every key
        with wf.connect(one.url, timeout=5) as c1, pytest.raises(HubTimeoutError):
            c1.kv_get("k", timeout=0)
    finally:
        one.stop()
        two.stop()


def test_kv_state_ttl_heap_drops_only_expired_versions_of_a_key() -> None:
    now = [0.0]
    s = HubState(clock=lambda: now[0])
    s.kv_put("k", b"a", ttl=1)
    s.kv_put("k", b"b", ttl=10)                    # re-put with a longer ttl
    now[0] = 2
    s.expire()
    assert s.kv_get("k") == b"b"
    now[0] = 11
    s.expire()
    assert s.kv_get("k") is None and not s.kv


def test_kv_ttl_heap_stays_bounded_when_a_key_is_overwritten_often() -> None:
    clock = FakeClock()
    kv = KvStore(clock)
    kv.put("forever", b"x")
    for i in range(10_000):
        kv.put("job-7/leader", b"%d" % i, ttl=3600)
        kv.put(f"short-{i % 8}", b"s", ttl=1 + i % 3)
        clock.advance(0.001)
        assert len(kv._ttl) <= 2 * len(kv) + 64
    assert kv.get("job-7/leader") == b"9999" and len(kv) == 10
    clock.advance(3600)
    kv.expire()
    assert len(kv) == 1 and kv.get("forever") == b"x" and not kv._ttl


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -math.inf, -1.0, 0])
def test_kv_ttl_must_be_finite_and_positive(clients, ttl) -> None:
    c = clients()
    with pytest.raises(BadRequestError, match="finite"):
        c.kv_put("k", b"v", ttl=ttl)
    with pytest.raises(HubTimeoutError):
        c.kv_get("k", timeout=0)            # nothing stored


@pytest.mark.parametrize("op,args", [("kv_get", {"key": "never"}),
                                     ("wait_version", {"model": "m"})])
@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf])
def test_long_poll_with_non_finite_timeout_is_refused_not_parked_forever(
        hub, clients, op, args, timeout) -> None:
    c = clients()
    with pytest.raises(BadRequestError, match="finite"):
        c.call(op, {**args, "timeout": timeout})
    assert not hub._parked
