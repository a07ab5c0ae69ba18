"""Reads across hosts over NIXL (`fabric.transports.nixl`), skipped without the rdma extra.

"Hosts" are ``WEIGHTFABRIC_HOST_ID`` values: in one process, each worker's read server
records the id it was created under, and the reader's id is the last one set; across
processes, each has its own. NIXL's UCX backend uses whatever transports this machine
has (shared memory, TCP).
"""

from __future__ import annotations

import time

import pytest
import torch
from procs import running_cluster
from test_data_plane import striping_over_two_holders

from weightfabric.fabric.errors import FabricError
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.transports.nixl import NIXL_KV_PREFIX, nixl_missing

MISSING = nixl_missing(True)
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=f"no NIXL: {MISSING}"),
              pytest.mark.hub(lease_s=5.0)]

CHUNK = 1 << 20
FULL = FetchOptions(deltas="off")  # whole chunks: what NIXL moves


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(1000, generator=g)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def nixl_on(monkeypatch):
    """NIXL also without an RDMA device here."""
    monkeypatch.setenv("WEIGHTFABRIC_NIXL", "1")


def test_a_reader_on_another_host_reads_over_nixl_bit_exact(on_hosts):
    trainer = on_hosts("trainer", "host-a")
    reader = on_hosts("reader", "host-b")
    assert trainer.nixl is not None and reader.nixl is not None
    assert trainer.server.address.nixl == trainer.nixl.name  # the endpoint names the agent
    t, r = trainer.model("m", chunk_size=CHUNK), reader.model("m", chunk_size=CHUNK)
    for seed in (1, 2, 3):  # the trainer's second buffer registers later: metadata again
        t.publish(weights(seed))
        stats = r.fetch("latest", options=FULL)
        assert equal(r.tensors, weights(seed))
        assert stats.transports == {"nixl": stats.bytes} and stats.bytes > 0
    assert trainer.server.bytes_served == 3 * stats.bytes  # leases count the egress


def test_a_reader_joining_later_finds_the_holders_agents_through_the_hub(on_hosts):
    trainer = on_hosts("trainer", "host-a")
    first = on_hosts("first", "host-b")
    t = trainer.model("m", chunk_size=CHUNK)
    for seed in (1, 2, 3, 4):
        t.publish(weights(seed))
        first.model("m", chunk_size=CHUNK).fetch("latest", options=FULL)
    assert first.hub.kv_get(NIXL_KV_PREFIX + trainer.nixl.name, timeout=0)
    late = on_hosts("late", "host-c")
    stats = late.model("m", chunk_size=CHUNK).fetch("latest", options=FULL)
    assert equal(late.model("m", chunk_size=CHUNK).tensors, weights(4))
    assert stats.transports == {"nixl": stats.bytes}


def test_a_peer_without_nixl_is_read_and_reads_over_tcp(on_hosts):
    plain = on_hosts("plain", "host-a", nixl=False)
    assert plain.nixl is None and plain.server.address.nixl == ""
    t = plain.model("m", chunk_size=CHUNK)
    t.publish(weights(1))
    reader = on_hosts("reader", "host-b")
    stats = reader.model("m", chunk_size=CHUNK).fetch("latest", options=FULL)
    assert stats.transports == {"tcp": stats.bytes}  # the holder has no agent
    t.publish(weights(2))
    other = on_hosts("other", "host-c", nixl=False)  # a reader without one reads a NIXL holder
    stats = other.model("m", chunk_size=CHUNK).fetch("latest", options=FULL)
    assert set(stats.transports) == {"tcp"}


def test_a_holder_whose_metadata_the_hub_lacks_is_read_over_tcp(on_hosts):
    trainer = on_hosts("trainer", "host-a")
    t = trainer.model("m", chunk_size=CHUNK)
    trainer.nixl._publish = lambda agent, meta: None  # never reaches the hub
    t.publish(weights(1))
    reader = on_hosts("reader", "host-b")
    stats = reader.model("m", chunk_size=CHUNK).fetch("latest", options=FULL)
    assert stats.transports == {"tcp": stats.bytes}


def test_nixl_true_without_the_extra_says_why(on_hosts, monkeypatch):
    monkeypatch.setenv("WEIGHTFABRIC_NIXL", "0")
    with pytest.raises(FabricError, match="WEIGHTFABRIC_NIXL"):
        on_hosts("w", "host-a", nixl=True)
    assert on_hosts("w2", "host-a").nixl is None


@pytest.fixture
def cluster():
    with running_cluster(lease_s=2.0, limit=240) as (hub, spawn):
        yield hub, spawn


def test_a_source_killed_mid_read_leaves_the_reader_to_another_and_is_never_asked_again(
        cluster):
    hub, spawn = cluster

    def on(host: str) -> dict[str, str]:
        return {"WEIGHTFABRIC_HOST_ID": host, "WEIGHTFABRIC_DELTAS": "off",
                "WEIGHTFABRIC_NIXL": "1"}

    a, reader, version = striping_over_two_holders(hub, spawn, lambda name: on(f"host-{name}"))
    a.kill()
    stats = reader.reply()
    assert stats["exact"] and stats["failed_sources"] == ["holder-a"], stats
    assert set(stats["transports"]) == {"nixl"}
    time.sleep(2.5)  # holder-a's lease runs out: the hub drops it
    late = spawn("late", env=on("host-l"))
    late.ask("expect", seed=2, mb=64)
    again = late.ask("fetch", version=version)
    assert again["exact"] and "holder-a" not in again["sources"], again
    assert not again["failed_sources"], again  # holder-a was never asked


def test_by_default_nixl_waits_for_an_rdma_device(on_hosts, monkeypatch):
    monkeypatch.setenv("WEIGHTFABRIC_NIXL", "auto")
    monkeypatch.setattr("weightfabric.fabric.transports.nixl.rdma_devices", lambda: [])
    assert "no RDMA device" in nixl_missing() and nixl_missing(True) is None
    assert on_hosts("plain", "host-a").nixl is None
    assert on_hosts("forced", "host-a", nixl=True).nixl is not None
    monkeypatch.setattr("weightfabric.fabric.transports.nixl.rdma_devices", lambda: ["mlx5_0"])
    assert nixl_missing() is None and on_hosts("rdma", "host-b").nixl is not None
