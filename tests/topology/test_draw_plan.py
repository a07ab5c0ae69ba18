"""`fabric topo plan --draw`, `fabric topo draw --plan`: bytes per link, network legs, pictures."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from draw_helpers import dgx_cluster, png_size
from matplotlib.figure import Figure

from weightfabric.tools.cli import main
from weightfabric.topology import loads_cluster, reference_cluster, reference_clusters
from weightfabric.topology.draw import draw_plan
from weightfabric.topology.draw.layout import Layout as PictureLayout
from weightfabric.topology.draw.overlay import (
    STRIPE_COLOURS,
    network_legs,
    placed_legs,
    split_stripes,
    wan_points,
)
from weightfabric.topology.draw.painter import Painter
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import Plan, Transfer, link, link_bytes
from weightfabric.topology.planner import plan_broadcast

TWO_DC = str(reference_clusters()["two-datacenters"])
CASES = [("4x-dgx-h100", None), ("two-datacenters", ["b-3", "a-1/gpu2", "a-7"]),
         ("heterogeneous", ["infer-5", "train-1/gpu3"]), ("dgx-h100", None)]


def planned(name: str, readers: list[str] | None) -> tuple[Layout, Plan]:
    cluster = reference_cluster(name)
    layout = Layout(cluster.graph())
    sources = ["train-0"] if name == "heterogeneous" else None
    return layout, plan_broadcast(cluster, 14 * 10**9, sources=sources, readers=readers)


def test_link_bytes_sums_both_directions_of_a_link() -> None:
    there = Transfer("b/gpu0", "a/gpu0", 0, 100, 0,
                     ("a/gpu0", "a/nic0", "leaf", "b/nic0", "b/gpu0"))
    back = Transfer("a/gpu1", "b/gpu0", 100, 130, 1,
                    ("b/gpu0", "b/nic0", "leaf", "a/nic0", "a/gpu1"))
    loads = link_bytes([there, back])
    assert loads[link("leaf", "a/nic0")] == loads[("b/nic0", "leaf")] == 130
    assert loads[("b/gpu0", "b/nic0")] == 130
    assert loads[("a/gpu0", "a/nic0")] == 100 and loads[("a/gpu1", "a/nic0")] == 30
    assert len(loads) == 5


@pytest.mark.parametrize(("name", "readers"), CASES)
def test_link_bytes_equal_the_transfers_crossing_each_link(name: str, readers: list[str] | None
                                                           ) -> None:
    layout, plan = planned(name, readers)
    loads = link_bytes(plan.transfers)
    for (u, v), nbytes in loads.items():
        assert layout.graph.has_edge(u, v), (u, v)
        crossing = [t for t in plan.transfers
                    if any({a, b} == {u, v} for a, b in zip(t.path, t.path[1:], strict=False))]
        assert nbytes == sum(t.nbytes for t in crossing) > 0, (u, v)
    assert sum(loads.values()) == sum(t.nbytes * (len(t.path) - 1) for t in plan.transfers)


def test_the_wan_carries_the_version_once() -> None:
    _, plan = planned("two-datacenters", None)
    assert link_bytes(plan.transfers)[("dc-a/wan", "dc-b/wan")] == plan.size


@pytest.mark.parametrize(("name", "readers"), CASES)
def test_every_reader_is_reached_and_drawn(name: str, readers: list[str] | None) -> None:
    layout, plan = planned(name, readers)
    loads = link_bytes(plan.transfers)
    into = Counter()
    for (u, v), nbytes in loads.items():
        into[u] += nbytes
        into[v] += nbytes
    picture = PictureLayout(reference_cluster(name), Painter(Figure()))
    picture.draw("test")
    for reader, need in plan.needs.items():
        assert into[reader] >= sum(hi - lo for lo, hi in need), reader
        assert reader in picture.anchors.devices, reader


@pytest.mark.parametrize(("name", "readers"), CASES)
def test_network_legs_carry_what_the_nic_links_carry(name: str, readers: list[str] | None
                                                     ) -> None:
    layout, plan = planned(name, readers)
    at_nic = Counter()
    for (a, b, _), nbytes in network_legs(plan.transfers, layout.kinds).items():
        for end in (a, b):
            if isinstance(end, str):
                at_nic[end] += nbytes
    nic_links = {(u if layout.kinds[u] == "nic" else v): nbytes
                 for (u, v), nbytes in link_bytes(plan.transfers).items()
                 if layout.graph.edges[u, v]["tier"] == "nic"}
    assert at_nic == Counter(nic_links)


def highlighted_pixels(path: Path) -> int:
    """Pixels of the picture in the colour of stripe 0's tree."""
    pixels = matplotlib.image.imread(path)[:, :, :3]
    colour = np.array([int(STRIPE_COLOURS[0][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels - colour).max(axis=2) < 0.04).sum())


def test_cli_draws_the_plan_to_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    assert main(["topo", "plan", TWO_DC, "--size", "14GB", "--draw", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height = png_size(out)
    assert 1000 <= width <= 6000 and 800 <= height <= 4000, (width, height)
    assert highlighted_pixels(out) > 200, "no tree drawn"
    bare = tmp_path / "bare.png"
    assert main(["topo", "draw", TWO_DC, "-o", str(bare)]) == 0
    assert highlighted_pixels(bare) == 0


def test_cli_bad_draw_path_exits_2_with_a_message(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing" / "plan.png"
    four = str(reference_clusters()["4x-dgx-h100"])
    assert main(["topo", "plan", four, "--size", "1GB", "--draw", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fabric topo plan: error: cannot write {out}: ") and "Traceback" not in err
    assert main(["topo", "plan", four, "--size", "1GB", "--draw", str(tmp_path)]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_folded_nodes_send_and_receive_at_their_box(tmp_path: Path) -> None:
    cluster = loads_cluster(dgx_cluster(64))  # 32 nodes per datacenter: "+N more" boxes
    plan = plan_broadcast(cluster, 14 * 10**9)
    draw_plan(cluster, plan, tmp_path / "big.png")
    assert highlighted_pixels(tmp_path / "big.png") > 200
    picture = PictureLayout(cluster, Painter(Figure()))
    picture.draw("test")
    for reader in plan.needs:
        assert reader in picture.anchors.devices or reader.split("/")[0] in picture.anchors.folded


def test_cli_topo_draw_plan_draws_the_default_broadcast(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    assert main(["topo", "draw", TWO_DC, "--plan", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "140000000000" in printed  # wan_bytes: the default size
    width, height = png_size(out)
    assert 1000 <= width <= 6000 and 800 <= height <= 4000, (width, height)
    assert highlighted_pixels(out) > 200, "no tree drawn"


@pytest.mark.parametrize(("options", "message"), [
    (["--size", "14GB"], "--size: only with --plan"),
    (["--sources", "trainer", "--readers", "b-0"], "--sources, --readers: only with --plan"),
    (["--plan", "--size", "lots"], "'lots' is not a size"),
    (["--plan", "--readers", "nope"], "reader 'nope' is not a device or node"),
])
def test_cli_topo_draw_bad_plan_options_exit_2_with_a_message(
        options: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    assert main(["topo", "draw", TWO_DC, *options, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric topo draw: error: ") and message in err, err
    assert not out.exists()


THREE_DC = """
version: 1
name: three-datacenters
node_types:
  dgx-h100:
    gpus: 8
    gpu: {model: H100-SXM, memory: 80GB}
    nvlink: {bandwidth: 450GB/s, latency: 2us}
    pcie: {bandwidth: 64GB/s, latency: 2us}
    nics: {count: 8, bandwidth: 400Gbps, kind: rdma, latency: 5us}
datacenters:
  - {name: dc-a, nodes: [{name: trainer, type: dgx-h100}, {name: "a-{i}", type: dgx-h100, count: 2}]}
  - {name: dc-b, nodes: [{name: "b-{i}", type: dgx-h100, count: 2}]}
  - {name: dc-c, nodes: [{name: "c-{i}", type: dgx-h100, count: 3}]}
wan:
  - {between: [dc-a, dc-b], bandwidth: 100Gbps, latency: 20ms}
  - {between: [dc-b, dc-c], bandwidth: 100Gbps, latency: 20ms}
  - {between: [dc-a, dc-c], bandwidth: 100Gbps, latency: 40ms}
roles: {trainer: [trainer], rollout: ["a-*", "b-*", "c-*"]}
"""


def multi_path_plan() -> Plan:
    """A plan on THREE_DC whose stripes reach dc-c half straight from dc-a, half through dc-b."""
    plan = plan_broadcast(loads_cluster(THREE_DC), 14 * 10**9)
    transfers = []
    for t in plan.transfers:
        if ("dc-a/wan", "dc-c/wan") not in zip(t.path, t.path[1:], strict=False):
            transfers.append(t)
            continue
        cut, mid = t.path.index("dc-c/wan"), (t.start + t.end) // 2
        transfers += [dataclasses.replace(t, end=mid), dataclasses.replace(
            t, start=mid, path=(*t.path[:cut], "dc-b/wan", *t.path[cut:]))]
    plan.transfers = transfers
    return plan


def wan_entry(t: Transfer, gateway: str, kinds: dict[str, str]) -> int:
    """Where `t`'s path enters `gateway` over a WAN link; 0 if it does not."""
    return next((i for i in range(1, len(t.path))
                 if t.path[i] == gateway and kinds[t.path[i - 1]] == "wan"), 0)


def test_a_stripe_split_over_wan_paths_joins_at_the_datacenter_it_enters(tmp_path: Path) -> None:
    cluster, plan = loads_cluster(THREE_DC), multi_path_plan()
    layout = Layout(cluster.graph())
    assert split_stripes(plan.transfers, layout.kinds) == list(range(len(plan.stripes)))
    two_dc, unsplit = planned("two-datacenters", None)
    assert split_stripes(unsplit.transfers, two_dc.kinds) == []
    picture = PictureLayout(cluster, Painter(Figure()))
    picture.draw("test")
    ends = wan_points(picture.anchors, layout.graph)
    entry = ends[("dc-c/wan", "dc-a/wan")]
    assert ends[("dc-c/wan", "dc-b/wan")] == entry  # both lines enter dc-c from the left
    legs = placed_legs(network_legs(plan.transfers, layout.kinds), picture.anchors, layout.graph)
    for stripe in range(len(plan.stripes)):
        entering = {t: i for t in plan.transfers if t.stripe == stripe
                    and (i := wan_entry(t, "dc-c/wan", layout.kinds))}
        nics = {next(v for v in t.path[i:] if layout.kinds[v] == "nic")
                for t, i in entering.items()}
        from_entry = {leg: n for leg, n in legs.items() if leg[0] == entry and leg[2] == stripe}
        assert len(from_entry) == len(nics), "one arrow per NIC, the WAN paths joined"
        assert sum(from_entry.values()) == sum(t.nbytes for t in entering)
    out = tmp_path / "split.png"
    draw_plan(cluster, plan, out)
    assert highlighted_pixels(out) > 200


def test_topo_draw_help_explains_plan_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["topo", "draw", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--plan plan a broadcast" in out and "one colour per stripe" in out
    assert "fabric topo draw topology/clusters/two-datacenters.yaml --plan -o plan.png" in out
