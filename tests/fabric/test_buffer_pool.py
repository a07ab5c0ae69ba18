"""BufferPool through its public surface.

Which buffer a new version takes, what stays reserved, and that a buffer holding no known
version never becomes active.
"""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.buffer_pool import MAX_BUFFERS, PREPARED_BUFFERS, Buffer, BufferPool
from weightfabric.fabric.errors import FabricError


class FakeRegion:
    def __init__(self) -> None:
        self.tensor = torch.zeros(8, dtype=torch.uint8)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def pool_with(*versions: int | None) -> tuple[BufferPool, list[Buffer]]:
    pool = BufferPool("m")
    buffers = []
    for v in versions:
        buffers.append(pool.add(FakeRegion()))
        buffers[-1].version = v
    return pool, buffers


def test_a_new_version_takes_an_unused_buffer_first_then_the_oldest_version():
    pool, (active, v3, spare, v2) = pool_with(5, 3, None, 2)
    pool.activate(active)
    assert pool.reusable() == [spare, v2, v3]
    tried: list[Buffer] = []

    def refuse_all_but(wanted: Buffer):
        def reclaim(buffer: Buffer) -> bool:
            tried.append(buffer)
            return buffer is wanted
        return reclaim

    got = pool.take(refuse_all_but(v3), allocate=FakeRegion)
    assert got is v3 and got.version is None and tried == [spare, v2, v3]


def test_reserved_released_and_active_buffers_are_never_reused():
    pool, (active, pending, releasing, free) = pool_with(4, 3, 2, 1)
    pool.activate(active)
    pending.pending = True
    releasing.releasing = True
    assert pool.reusable() == [free]
    assert pool.take(lambda b: True, allocate=FakeRegion) is free


def test_a_full_pool_refuses_with_a_reason_and_allocates_nothing():
    pool, buffers = pool_with(*range(1, MAX_BUFFERS + 1))
    pool.activate(buffers[-1])
    allocated: list[FakeRegion] = []

    def allocate() -> FakeRegion:
        allocated.append(FakeRegion())
        return allocated[-1]

    with pytest.raises(FabricError, match=f"all {MAX_BUFFERS} buffers hold versions"):
        pool.take(lambda b: False, allocate=allocate)
    with pytest.raises(FabricError, match="retract or release one"):
        pool.add(FakeRegion())
    assert not allocated and len(pool) == MAX_BUFFERS


def test_activating_a_version_ends_the_reservation_of_older_fetched_ones():
    pool, (v1, v2, v3, v4) = pool_with(1, 2, 3, 4)
    for b in (v2, v4):
        b.pending = True
    pool.activate(v3)
    assert not v2.pending and v4.pending  # a superseded future pins no memory
    pool.switch(v4, 4)
    assert pool.active is v4 and not v4.pending


def test_a_buffer_holding_no_known_version_is_never_matched_or_switched_to():
    pool, (active, spare) = pool_with(1, None)
    pool.activate(active)
    assert pool.find(None) is None and pool.reserve(None) is None  # type: ignore[arg-type]
    assert not spare.pending
    spare.pending = True
    with pytest.raises(FabricError, match="no known version"):
        pool.switch(spare, None)  # type: ignore[arg-type]
    with pytest.raises(FabricError, match="released or reused"):
        pool.switch(spare, 2)
    assert pool.active is active


def test_switching_needs_the_buffer_still_reserved_for_that_version():
    pool, (v1, v2, v3) = pool_with(1, 2, 3)
    pool.activate(v1)
    assert pool.reserve(2) is v2 and v2.pending  # kept (e.g. pinned): switch back, no read
    pool.activate(v3)  # a newer version first
    with pytest.raises(FabricError, match="no longer reserved"):
        pool.switch(v2, 2)
    v2.releasing = True
    assert pool.reserve(2) is None  # being released: not handed to a fetch


def test_a_spare_is_wanted_only_up_to_the_double_buffer():
    pool, (active,) = pool_with(1)
    pool.activate(active)
    assert pool.wants_spare()
    spare = pool.add(FakeRegion())
    assert not pool.wants_spare() and pool.unused() == [spare]
    spare.version = 2
    assert len(pool) == PREPARED_BUFFERS and not pool.wants_spare()


def test_removed_and_cleared_buffers_leave_the_pool():
    pool, (active, other) = pool_with(1, 2)
    pool.activate(active)
    pool.remove(active)
    assert active.region.closed and pool.active is None and pool.buffers == (other,)
    assert pool.clear() == [other] and len(pool) == 0 and not other.region.closed
    with pytest.raises(FabricError, match="freed"):
        pool.activate(other)
