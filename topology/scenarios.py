"""Scenarios from the papers, each run for our plan and every baseline.

- ``standalone``: the trainer broadcasts to every rollout device.
- ``elastic``: the first half of the rollout machines already hold the version
  (they are sources too); the other half join and read it.
- ``cross-dc``: rollout devices outside the trainer's datacenter read across the WAN.
- ``preemption``: a standalone broadcast in which every fourth rollout machine (the
  second, sixth, ...) is preempted at 40% of our plan's time; the survivors re-plan what they miss.

The reported time of a strategy is when its last surviving reader has every byte
(the rollouts' stall for this version).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightfabric.topology.plan import Interval, PlanError
from weightfabric.topology.schema import Cluster

if TYPE_CHECKING:  # networkx and numpy load when a scenario runs (not for `fabric --help`)
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.simulator import Join, SimResult, Vanish

SCENARIOS = ("standalone", "elastic", "cross-dc", "preemption")
BASELINES = ("star", "ring", "storage")
DEFAULT_STORAGE_BANDWIDTH = 25e9  # bytes/s, a parallel file system's per-job share


@dataclass
class ScenarioResult:
    """Times of our plan and the baselines in one scenario."""

    scenario: str
    readers: int
    ours_s: float
    baselines: dict[str, float]
    lower_bound_s: float
    predicted_s: float
    wan_bytes: float
    plan_seconds: float
    simulate_seconds: float
    timeline: list[tuple[float, float]] = field(default_factory=list)

    @property
    def speedup(self) -> dict[str, float]:
        """Each baseline's time divided by ours."""
        return {k: v / self.ours_s if self.ours_s > 0 else float("inf")
                for k, v in self.baselines.items()}

    @property
    def efficiency(self) -> float:
        """The lower bound divided by our time."""
        return self.lower_bound_s / self.ours_s if self.ours_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The result as plain data."""
        return {"scenario": self.scenario, "readers": self.readers, "ours_s": self.ours_s,
                "baselines": self.baselines, "speedup": self.speedup,
                "lower_bound_s": self.lower_bound_s, "efficiency": self.efficiency,
                "predicted_s": self.predicted_s, "wan_bytes": self.wan_bytes,
                "plan_seconds": self.plan_seconds, "simulate_seconds": self.simulate_seconds}


def _endpoints(cluster: Cluster, layout: Layout, name: str
               ) -> tuple[list[str], list[str], list[str]]:
    """(trainer devices, extra holders, readers) for a scenario."""
    from weightfabric.topology.planner import default_endpoints

    trainer, readers = default_endpoints(cluster, layout)
    if name in ("standalone", "preemption"):
        return trainer, [], readers
    if name == "elastic":
        machines = list(dict.fromkeys(layout.machine_of[r] for r in readers))
        if len(machines) < 2:
            raise PlanError("the elastic scenario needs at least two rollout nodes")
        old = set(machines[: len(machines) // 2])
        return (trainer, [r for r in readers if layout.machine_of[r] in old],
                [r for r in readers if layout.machine_of[r] not in old])
    if name == "cross-dc":
        home = layout.datacenter(trainer[0])
        remote = [r for r in readers if layout.datacenter(r) != home]
        if not remote:
            raise PlanError("the cross-dc scenario needs rollout nodes in another datacenter; "
                            "use a cluster with a WAN link (e.g. two-datacenters.yaml)")
        return trainer, [], remote
    raise PlanError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")


def run_scenario(cluster: Cluster, name: str, size: int, *,
                 storage_bandwidth: float = DEFAULT_STORAGE_BANDWIDTH,
                 baselines_to_run: tuple[str, ...] = BASELINES) -> ScenarioResult:
    """Run scenario `name` on `cluster` for a version of `size` bytes.

    Raises:
        PlanError: Unknown scenario, or the cluster cannot host it (e.g. one datacenter for
            ``cross-dc``).
    """
    from weightfabric.topology import baselines
    from weightfabric.topology.bounds import lower_bound
    from weightfabric.topology.layout import Layout
    from weightfabric.topology.planner import plan_broadcast
    from weightfabric.topology.simulator import Vanish, simulate

    layout = Layout(cluster.graph())
    trainer, extra, readers = _endpoints(cluster, layout, name)
    whole: list[Interval] = [(0, size)]
    holders = {d: whole for d in trainer + extra}
    needs = {r: whole for r in readers}
    plan = plan_broadcast(layout, size, sources=holders, needs=needs)
    bound = lower_bound(layout, holders, needs)
    events: list[Vanish | Join] = []
    if name == "preemption":
        machines = list(dict.fromkeys(layout.machine_of[r] for r in readers))
        victims = tuple(d for m in machines[1::4] for d in layout.machines[m].devices)
        events = [Vanish(0.4 * plan.predicted_s, victims)]

    def ours_replanner(hold, missing):
        return plan_broadcast(layout, size, sources=hold, needs=missing, chunk=plan.chunk,
                              stripes=plan.stripes, planes=plan.planes).transfers

    started = time.perf_counter()
    ours = simulate(layout.graph, plan.transfers, chunk=plan.chunk, size=size,
                    holders=holders, events=events, replanner=ours_replanner)
    sim_s = time.perf_counter() - started
    results: dict[str, float] = {}
    for base in baselines_to_run:
        if base == "star":
            tr = baselines.star(layout, trainer, needs)
            res = simulate(layout.graph, tr, chunk=plan.chunk, size=size, holders=holders,
                           events=events, replanner=baselines.star_replanner(layout, trainer))
        elif base == "ring":
            tr = baselines.chain(layout, trainer, needs)
            res = simulate(layout.graph, tr, chunk=plan.chunk, size=size, holders=holders,
                           events=events, replanner=baselines.chain_replanner(layout, trainer))
        elif base == "storage":
            dc = layout.datacenter(trainer[0])
            g = baselines.storage_graph(layout, dc, storage_bandwidth)
            tr = baselines.storage(layout, trainer, needs, size)
            res = simulate(g, tr, chunk=size, size=size, holders=holders, events=events,
                           replanner=baselines.storage_replanner(layout, trainer))
        else:
            raise PlanError(f"unknown baseline {base!r}; choose from {', '.join(BASELINES)}")
        results[base] = float(_stall(res, readers))
    return ScenarioResult(scenario=name, readers=len(readers), ours_s=float(_stall(ours, readers)),
                          baselines=results, lower_bound_s=bound.seconds,
                          predicted_s=plan.predicted_s, wan_bytes=ours.wan_bytes,
                          plan_seconds=plan.plan_seconds, simulate_seconds=sim_s,
                          timeline=ours.timeline)


def _stall(result: SimResult, readers: list[str]) -> float:
    return max((result.completion[r] for r in readers if r in result.completion), default=0.0)
