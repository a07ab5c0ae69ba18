"""Turning hub plans into engine assignments: striping, waits, failed sources."""

from weightfabric.fabric.client import FetchPlan, PlanRange, SourceInfo
from weightfabric.fabric.fetch_planner import HubPlanner
from weightfabric.fabric.locality import Location
from weightfabric.fabric.manifest import Manifest, TensorSpec

ENDPOINT = {"read": {"host": "127.0.0.1", "port": 1, "host_id": "h"}}


def plan(ranges, locations) -> FetchPlan:
    manifest = Manifest((TensorSpec("w", (1024,), "uint8", 1024, 0),), 256)
    workers = {w: SourceInfo(w, Location(*loc), ENDPOINT, complete=False)
               for w, loc in locations.items()}
    return FetchPlan("f1", "m", 1, 0, 1, manifest, tuple(ranges), workers)


class NoHub:
    def replan(self, *a, **k):
        raise AssertionError("the first plan must be used as given")


def test_complete_sources_of_the_nearest_tier_are_striped():
    p = plan([PlanRange(0, 4, ("near-a", "near-b", "far"), ())],
             {"near-a": ("dc-b", "n1"), "near-b": ("dc-b", "n2"), "far": ("dc-a", "t")})
    [a] = HubPlanner(NoHub(), p, me=Location("dc-b", "n3")).plan([0, 1, 2, 3], set())
    assert [s.worker for s in a.sources[:a.stripe]] == ["near-a", "near-b"]
    assert a.sources[-1].worker == "far"  # still there as a fallback


def test_waits_come_first_and_only_the_nearest_are_striped():
    p = plan([PlanRange(0, 4, ("trainer",), ("remote-partial", "local-partial"))],
             {"trainer": ("dc-a", "t"), "remote-partial": ("dc-a", "r"),
              "local-partial": ("dc-b", "n1")})
    [a] = HubPlanner(NoHub(), p, me=Location("dc-b", "n2")).plan([0, 1, 2, 3], set())
    assert a.stripe == 1 and a.sources[0].worker == "local-partial"
    assert "remote-partial" not in [s.worker for s in a.sources]


def test_failed_workers_are_left_out_and_the_hub_is_asked_again():
    calls = []

    class Hub:
        def replan(self, fetch_id, *, chunks, exclude):
            calls.append((chunks, exclude))
            return plan([PlanRange(0, 2, ("b",), ())], {"b": ("dc", "n2")})

    first = plan([PlanRange(0, 2, ("a", "b"), ())], {"a": ("dc", "n1"), "b": ("dc", "n2")})
    planner = HubPlanner(Hub(), first, me=Location("dc", "n3"))
    planner.plan([0, 1], set())
    [a] = planner.plan([1], {"a"})
    assert calls == [([1], ["a"])] and [s.worker for s in a.sources] == ["b"]
    assert a.sources[0].region == "m/v1/s0"
