"""A hub with many workers lengthens their lease so their heartbeats stay in its budget.

``heartbeat_rate`` R: the lease is at least 3 x workers / R (heartbeats every lease/3),
never shorter than configured, and never shortens while the hub runs (leases still end in
the order they were renewed). Clients take the lease from their heartbeats' replies.
"""

from __future__ import annotations

import itertools

import pytest
from hub_helpers import FakeClock

import weightfabric as wf
from weightfabric.fabric.hub.state import HubState

_names = itertools.count()


def test_the_lease_grows_with_the_workers_and_never_shrinks() -> None:
    clock = FakeClock()
    state = HubState(clock=clock, lease_s=1.0, heartbeat_rate=10)
    granted = [state.register(f"w{i}", session=f"w{i}").lease_s for i in range(6)]
    assert granted == [1.0, 1.0, 1.0, 1.2, 1.5, 1.8]          # 3 x workers / 10, at least 1
    assert state.heartbeat("w0", session="w0").lease_s == 1.8
    state.register("w0", session="w0")                       # a refresh is not a new worker
    assert state.lease_s == 1.8
    for i in range(1, 6):
        state.unregister(f"w{i}", session=f"w{i}")
    assert state.lease_s == 1.8
    state._check_indexes()                                   # lease order still holds
    clock.advance(1.7)
    assert state.expire() == []                              # w0 renewed with 1.8 s
    clock.advance(0.2)
    assert state.expire() == ["w0"]


def test_without_a_rate_the_lease_is_as_given() -> None:
    state = HubState(lease_s=1.0, heartbeat_rate=None)
    for i in range(50):
        assert state.register(f"w{i}", session=f"w{i}").lease_s == 1.0
    with pytest.raises(ValueError, match="heartbeat_rate"):
        HubState(heartbeat_rate=0)


def test_a_client_heartbeats_at_the_lease_its_last_heartbeat_was_granted() -> None:
    url = f"memory://rate-{next(_names)}"
    with wf.serve(url, lease_s=3.0, heartbeat_rate=2.0), \
            wf.connect(url, worker="w0", heartbeat=False, timeout=5) as first:
        assert first.lease_s == 3.0
        others = [wf.connect(url, worker=f"w{i}", heartbeat=False, timeout=5)
                  for i in range(1, 4)]
        try:
            first.heartbeat()
            assert first.lease_s == 6.0                      # 3 x 4 workers / 2 per s
        finally:
            for c in others:
                c.close()
