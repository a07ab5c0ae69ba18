"""Hub source ranking by widest-path bandwidth on the cluster graph."""

from __future__ import annotations

import pytest

from weightfabric.fabric.hub.ranking import topology_ranker
from weightfabric.fabric.locality import Location, SourceCandidate, rank_by_locality
from weightfabric.topology import reference_cluster, reference_clusters


def _cand(worker, dc, node, device="gpu0", *, load=0, complete=True):
    return SourceCandidate(worker, Location(dc, node, device), complete, load)


def test_a_reader_in_the_remote_datacenter_prefers_a_source_beside_it():
    rank = topology_ranker(reference_cluster("two-datacenters"))
    trainer = _cand("trainer", "dc-a", "trainer")
    peer = _cand("peer", "dc-b", "b-7", load=5)  # busier, but no WAN on the way
    reader = Location("dc-b", "b-0", "gpu2")
    assert [c.worker for c in rank(reader, [trainer, peer])] == ["peer", "trainer"]


def test_on_one_node_an_nvlink_peer_beats_a_remote_node_and_load_breaks_ties():
    rank = topology_ranker(reference_clusters()["4x-dgx-h100"])  # a YAML path works too
    reader = Location("", "node-1", "cuda:3")
    nvlink = _cand("nv", "", "node-1", "gpu5", load=9)
    remote = _cand("remote", "", "node-2", "gpu3")
    idle_remote = _cand("idle", "", "node-3", "gpu3", load=0)
    busy_remote = _cand("busy", "", "node-3", "gpu4", load=2)
    ranked = [c.worker for c in rank(reader, [busy_remote, remote, nvlink, idle_remote])]
    assert ranked[0] == "nv"
    assert ranked.index("idle") < ranked.index("busy")  # same bandwidth: least loaded


def test_unknown_locations_fall_back_to_locality_and_never_raise():
    rank = topology_ranker(reference_cluster("two-datacenters"))
    cands = [_cand("x", "dc-b", "b-1"), _cand("y", "dc-a", "a-1"),
             _cand("ghost", "dc-b", "no-such-node")]
    unknown_reader = Location("dc-z", "nowhere", "gpu0")
    assert rank(unknown_reader, cands) == rank_by_locality(unknown_reader, cands)
    # a known reader: mapped candidates by bandwidth, the unknown one last
    ranked = [c.worker for c in rank(Location("dc-b", "b-0", "gpu0"), cands)]
    assert ranked == ["x", "y", "ghost"]
    # unknown candidates among themselves: by locality before load, as rank_by_locality
    near_busy = _cand("near", "dc-b", "no-such-node", load=3)
    far_idle = _cand("far", "dc-a", "nor-this-one")
    ranked = [c.worker
              for c in rank(Location("dc-b", "b-0", "gpu0"), [far_idle, near_busy, *cands])]
    assert ranked == ["x", "y", "ghost", "near", "far"]
    # wrong datacenter for the node, GPU out of range, garbage device: unknown
    assert rank.vertex(Location("dc-a", "b-0", "gpu0")) is None
    assert rank.vertex(Location("dc-b", "b-0", "gpu8")) is None
    assert rank.vertex(Location("dc-b", "b-0", "tpu0")) is None
    assert rank(Location(), []) == []


@pytest.mark.parametrize("location, vertex", [
    (Location("dc-b", "b-0", "gpu3"), "b-0/gpu3"),
    (Location("", "b-0", "cuda:3"), "b-0/gpu3"),
    (Location("dc-b", "b-0", "3"), "b-0/gpu3"),
    (Location("dc-b", "b-0", ""), "b-0/host"),
    (Location("", "", "b-0/gpu3"), "b-0/gpu3"),
    (Location("", "a-0", "b-0/gpu3"), None),
])
def test_locations_map_to_graph_vertices(location, vertex):
    assert topology_ranker(reference_cluster("two-datacenters")).vertex(location) == vertex


def test_widest_paths_are_cached_per_pair():
    rank = topology_ranker(reference_cluster("two-datacenters"))
    wan = rank.bandwidth("trainer/gpu0", "b-0/gpu0")
    assert wan == pytest.approx(100e9 / 8)  # the 100 Gb/s WAN is the bottleneck
    assert rank._cache[("b-0/gpu0", "trainer/gpu0")] == wan
    assert rank.bandwidth("b-0/gpu1", "b-0/gpu0") == pytest.approx(450e9)
    with pytest.raises(TypeError, match="Cluster"):
        topology_ranker(42)
