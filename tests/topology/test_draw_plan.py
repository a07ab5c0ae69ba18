"""`fabric topo plan --draw`: bytes per link, network legs, and the picture of a plan."""

from __future__ import annotations

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
from weightfabric.topology.draw.overlay import STRIPE_COLOURS, network_legs
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
