"""How closely `Plan.predicted` agrees with the flow-level simulator.

`agreement` compares one plan's predicted completion times with `simulate`'s;
`random_case` draws a plan input on a random WAN of three or four datacenters (what
the property test of tests/topology/test_predictions.py explores); `measure` runs
both over the shipped clusters and seeded random cases. Reproduce the figures of
docs/planner.md ("Predicted times")::

    python -m weightfabric.topology.agreement --random 300 --seed 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from dataclasses import dataclass

from weightfabric.topology.endpoints import default_endpoints
from weightfabric.topology.estimate import SIMULATOR, finish_times
from weightfabric.topology.layout import Layout
from weightfabric.topology.loader import loads_cluster
from weightfabric.topology.plan import EmptyTransferError, Plan
from weightfabric.topology.planner import plan_broadcast
from weightfabric.topology.references import reference_cluster, reference_clusters
from weightfabric.topology.simulator import MAX_CHUNKS, simulate

WAN_SHAPES = ("chain", "ring", "star", "mesh", "random")
SIZE_EXPONENTS = (8, 11)  # a random case's version: 1e8 to 1e11 bytes, log-uniform
CHUNKS = (None, None, 1 << 20, 4 << 20, 16 << 20, 64 << 20)  # None: the planner chooses

NODE_TYPES = """\
  nvl2:
    gpus: 2
    gpu: {{model: X}}
    nvlink: {{bandwidth: 300GB/s, latency: {inside}}}
    pcie: {{bandwidth: 64GB/s, latency: {inside}}}
    nics: {{count: 1, bandwidth: 200Gbps, latency: {nic}}}
  pcie4:
    gpus: 4
    gpu: {{model: X}}
    pcie: {{bandwidth: 32GB/s, latency: {inside}}}
    nics: {{count: 2, bandwidth: 400Gbps, latency: {nic}}}
  cpu:
    gpus: 0
    nics: {{count: 2, bandwidth: 100Gbps, kind: tcp, latency: {nic}}}
"""


@dataclass(frozen=True)
class Agreement:
    """A prediction against the simulation of the same plan."""

    predicted_s: float
    simulated_s: float
    reader_error: float    # largest |predicted - simulated| of a reader, over simulated_s
    method: str            # `Plan.predicted_by`
    equal_share_s: float   # the makespan of the equal-share estimate (`finish_times`)

    @property
    def error(self) -> float:
        """Relative error of `Plan.predicted_s` against the simulated makespan."""
        return abs(self.predicted_s / self.simulated_s - 1)

    @property
    def equal_share_error(self) -> float:
        """Relative error of the equal-share estimate (what `Plan.predicted` was before)."""
        return abs(self.equal_share_s / self.simulated_s - 1)


@dataclass(frozen=True)
class Case:
    """A plan input: a cluster's layout, who holds and who reads, size and chunk."""

    layout: Layout
    sources: list[str]
    readers: list[str]
    size: int
    chunk: int | None
    label: str

    def plan(self) -> Plan:
        """The planner's plan of this case."""
        return plan_broadcast(self.layout, self.size, sources=self.sources,
                              readers=self.readers, chunk=self.chunk)


def agreement(plan: Plan, layout: Layout) -> Agreement:
    """Simulate `plan` on `layout` and compare with its predictions."""
    sim = simulate(layout.graph, plan.transfers, chunk=plan.chunk, size=plan.size,
                   holders=plan.sources)
    worst = max((abs(plan.predicted[r] - sim.completion[r]) for r in plan.predicted),
                default=0.0)
    equal_share = max(finish_times(layout.graph, plan.transfers, plan.chunk), default=0.0)
    return Agreement(plan.predicted_s, sim.makespan, worst / sim.makespan, plan.predicted_by,
                     equal_share)


def random_case(rng: random.Random) -> Case:
    """A broadcast on a random WAN of three or four datacenters.

    WAN links in a chain, ring, star, full mesh or random connected shape, of 10-400
    Gb/s and 0-30 ms; one to three machines per datacenter (two-GPU NVLink, four-GPU
    PCIe-only, or CPU-only), leaves of one or two machines at 1:1 to 3:1; the first
    datacenter's first machine holds the version (and the second's, sometimes); every
    other machine's GPUs, or host memory, read it; 0.1-100 GB, the chunk chosen or fixed.
    """
    n = rng.randint(3, 4)
    shape = rng.choice(WAN_SHAPES)
    flat = rng.random() < 0.3  # no latency anywhere, as `fabric bench cluster` emulates
    lines = [f"  - {{between: [d{a}, d{b}], bandwidth: {rng.choice([10, 25, 50, 100, 200, 400])}"
             f"Gbps, latency: {0 if flat else rng.choice([1, 5, 20, 30])}ms}}"
             for a, b in _wan_pairs(rng, n, shape)]
    dcs = []
    for d in range(n):
        kinds = [rng.choice(["nvl2", "pcie4", "cpu"]) for _ in range(rng.randint(1, 3) + (d == 0))]
        nodes = ", ".join(f"{{name: d{d}n{i}, type: {k}}}" for i, k in enumerate(kinds))
        dcs.append(f"  - name: d{d}\n    network: {{oversubscription: "
                   f"{rng.choice([1.0, 2.0, 3.0])}, nodes_per_leaf: {rng.choice([1, 2])}, "
                   f"latency: {'0us' if flat else '1us'}}}\n    nodes: [{nodes}]")
    types = NODE_TYPES.format(inside="0us" if flat else "2us", nic="0us" if flat else "5us")
    text = (f"version: 1\nname: random-{shape}-{n}\nnode_types:\n{types}datacenters:\n"
            + "\n".join(dcs) + "\nwan:\n" + "\n".join(lines) + "\n")
    layout = Layout(loads_cluster(text, source=f"<random {shape} WAN>").graph())
    host = rng.random() < 0.5
    holders = ["d0n0"] + (["d1n0"] if rng.random() < 0.3 else [])
    sources = [f"{m}/host" for m in holders] if host else holders
    readers = [f"{m}/host" if host else m for m in layout.machines if m not in holders]
    size = int(10 ** rng.uniform(*SIZE_EXPONENTS))
    chunk = rng.choice(CHUNKS)
    if chunk is not None and chunk * MAX_CHUNKS < size:
        chunk = None
    label = (f"{shape} of {n}, {'host' if host else 'GPU'} readers, {size / 1e9:.3g} GB, "
             f"chunk {'chosen' if chunk is None else chunk >> 20}{'' if chunk is None else ' MiB'}"
             f"{', no latency' if flat else ''}")
    return Case(layout, sources, readers, size, chunk, label)


def _wan_pairs(rng: random.Random, n: int, shape: str) -> list[tuple[int, int]]:
    if shape == "chain":
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif shape == "ring":
        pairs = [(i, (i + 1) % n) for i in range(n)]
    elif shape == "star":
        pairs = [(0, i) for i in range(1, n)]
    elif shape == "mesh":
        pairs = list(itertools.combinations(range(n), 2))
    else:  # a random tree, so it is connected, and random links on top
        every = list(itertools.combinations(range(n), 2))
        pairs = [(rng.randint(0, b - 1), b) for b in range(1, n)]
        pairs += rng.sample(every, rng.randint(0, len(every)))
    return list(dict.fromkeys((min(a, b), max(a, b)) for a, b in pairs))


def shipped_cases(size: int = 140 * 10**9) -> dict[str, Case]:
    """The default broadcast (YAML roles) of every shipped cluster that has readers."""
    out = {}
    for name in reference_clusters():
        cluster = reference_cluster(name)
        layout = Layout(cluster.graph())
        try:
            sources, readers = default_endpoints(cluster, layout)
        except EmptyTransferError:
            continue
        out[name] = Case(layout, sources, readers, size, None, f"{name}, {size / 1e9:g} GB")
    return out


def measure(random_cases: int, seed: int = 0) -> dict[str, object]:
    """Largest errors over the shipped clusters and `random_cases` seeded random cases."""
    rows: dict[str, list[tuple[str, Agreement, float]]] = {"shipped": [], "random": []}
    rng = random.Random(seed)
    cases = [("shipped", c) for c in shipped_cases().values()]
    cases += [("random", random_case(rng)) for _ in range(random_cases)]
    for group, case in cases:
        plan = case.plan()
        rows[group].append((case.label, agreement(plan, case.layout), plan.plan_seconds))
    out: dict[str, object] = {"seed": seed}
    for group, got in rows.items():
        worst = max(got, key=lambda r: r[1].error, default=None)
        out[group] = {
            "cases": len(got),
            "max_error": max((a.error for _, a, _ in got), default=0.0),
            "max_reader_error": max((a.reader_error for _, a, _ in got), default=0.0),
            "max_equal_share_error": max((a.equal_share_error for _, a, _ in got),
                                         default=0.0),
            "simulated_share": sum(a.method == SIMULATOR for _, a, _ in got) / max(len(got), 1),
            "worst_case": worst[0] if worst else None,
            "plan_seconds": sum(s for _, _, s in got)}
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m weightfabric.topology.agreement [--random N] [--seed S]``: print JSON."""
    p = argparse.ArgumentParser(description="How closely the planner's predicted times agree "
                                            "with the flow-level simulator (JSON).")
    p.add_argument("--random", type=int, default=300, help="random cases (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cases")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.random, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
