"""`fabric topo plan|simulate` and `fabric bench planner` argument wiring."""

from __future__ import annotations

import json

from weightfabric.tools.cli import main
from weightfabric.topology.references import reference_clusters

TWO_DC = str(reference_clusters()["two-datacenters"])
FOUR = str(reference_clusters()["4x-dgx-h100"])


def test_plan_json_has_the_documented_keys(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["topo", "plan", TWO_DC, "--size", "14GB", "--json", "-o", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("predicted_s", "lower_bound_s", "efficiency", "wan_bytes", "plan_seconds"):
        assert key in data
    assert data["wan_bytes"] == 14e9
    assert data["lower_bound_s"] <= data["simulated_s"]
    full = json.loads(out.read_text())
    assert len(full["transfers"]) == data["transfers"]


def test_simulate_json_has_the_documented_keys(capsys):
    assert main(["topo", "simulate", FOUR, "--scenario", "standalone", "--size", "14GB",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scenario"] == "standalone"
    assert set(data["baselines"]) == set(data["speedup"]) == {"star", "ring", "storage"}
    assert data["speedup"]["star"] == data["baselines"]["star"] / data["ours_s"]


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["topo", "plan", FOUR, "--size", "0B"]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["topo", "plan", FOUR, "--size", "1GB", "--readers", "nope"]) == 2
    assert "not a device or node" in capsys.readouterr().err
    assert main(["topo", "simulate", FOUR, "--scenario", "cross-dc", "--size", "1GB"]) == 2
    assert "another datacenter" in capsys.readouterr().err


def test_an_unwritable_timeline_exits_2(capsys, tmp_path):
    assert main(["topo", "simulate", FOUR, "--scenario", "standalone", "--size", "1GB",
                 "--timeline", str(tmp_path / "no-dir" / "t.png")]) == 2
    assert "cannot write" in capsys.readouterr().err
