"""Invariant checkers for plans and simulations, and the planner tests' small clusters.

The checkers are in the style of networkx's flow tests.
"""

from __future__ import annotations

from hypothesis import strategies as st

from weightfabric.topology import loads_cluster
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import Plan, merge_intervals


def check_plan(plan: Plan, graph) -> None:
    """Check that every reader gets each needed byte exactly once.

    Also that every transfer's bytes are held by its source or brought to it by an
    earlier transfer, and that paths follow graph arcs.
    """
    got: dict[str, list[tuple[int, int]]] = {}
    for i, t in enumerate(plan.transfers):
        assert 0 <= t.start < t.end <= plan.size, t
        assert t.path[0] == t.source and t.path[-1] == t.reader, t
        for a, b in zip(t.path, t.path[1:], strict=False):
            assert graph.has_edge(a, b), (a, b)
        if t.upstream is None:
            held = plan.sources.get(t.source, [])
            assert any(a <= t.start and t.end <= b for a, b in held), t
        else:
            assert t.upstream < i
            u = plan.transfers[t.upstream]
            assert u.reader == t.source
            # the source ends with the whole stripe: what it held plus what it receives
            have = plan.sources.get(t.source, []) + [
                (x.start, x.end) for x in plan.transfers if x.reader == t.source]
            assert sum(min(b, t.end) - max(a, t.start) for a, b in merge_intervals(have)
                       if min(b, t.end) > max(a, t.start)) == t.nbytes, t
        got.setdefault(t.reader, []).append((t.start, t.end))
    assert set(got) == set(plan.needs)
    for reader, ranges in got.items():
        check_exactly_once(ranges, plan.needs[reader])


def check_exactly_once(received: list[tuple[int, int]], need: list[tuple[int, int]]) -> None:
    """`received` covers `need` with no byte twice."""
    assert sum(b - a for a, b in received) == sum(b - a for a, b in need), (received, need)
    assert merge_intervals(received) == merge_intervals(need), (received, need)


def _cluster(node_types: str, dcs: str, wan: str = "") -> Layout:
    text = f"version: 1\nname: t\nnode_types:\n{node_types}\ndatacenters:\n{dcs}\n{wan}"
    return Layout(loads_cluster(text).graph())


@st.composite
def small_clusters(draw):
    """A hypothesis strategy of small clusters for the planner tests."""
    types, dcs = [], []
    for i in range(draw(st.integers(1, 2))):
        gpus = draw(st.integers(1, 4))
        nvlink = draw(st.sampled_from(["none", "switch", "pairs"])) if gpus > 1 else "none"
        lines = [f"  t{i}:", f"    gpus: {gpus}", "    gpu: {model: X}",
                 f"    pcie: {{bandwidth: {draw(st.integers(8, 64))}GB/s, latency: 2us}}",
                 f"    nics: {{count: {draw(st.integers(1, 2))}, "
                 f"bandwidth: {draw(st.integers(5, 50))}GB/s, latency: 5us}}"]
        if nvlink == "switch":
            lines.append("    nvlink: {bandwidth: 300GB/s}")
        elif nvlink == "pairs":
            pairs = [[j, j + 1] for j in range(0, gpus - 1, 2)]
            lines.append(f"    nvlink: {{bandwidth: 100GB/s, groups: {pairs}}}")
        types.append("\n".join(lines))
    n_types = len(types)
    n_dcs = draw(st.integers(1, 2))
    for d in range(n_dcs):
        nodes = ", ".join(f"{{name: 'd{d}n{k}', type: t{draw(st.integers(0, n_types - 1))}}}"
                          for k in range(draw(st.integers(1, 3))))
        over = draw(st.sampled_from([1.0, 2.0]))
        dcs.append(f"  - name: d{d}\n    network: {{oversubscription: {over}, "
                   f"nodes_per_leaf: 2}}\n    nodes: [{nodes}]")
    wan_bw = draw(st.integers(1, 10))
    wan = (f"wan:\n  - {{between: [d0, d1], bandwidth: {wan_bw}GB/s, latency: 5ms}}\n"
           if n_dcs == 2 else "")
    lay = _cluster("\n".join(types) + "\n", "\n".join(dcs) + "\n", wan)
    devices = [d for m in lay.machines.values() for d in m.devices]
    n_src = draw(st.integers(1, max(1, len(devices) - 1)))
    order = draw(st.permutations(devices))
    return lay, list(order[:n_src]), list(order[n_src:])
