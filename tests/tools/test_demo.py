"""`fabric demo` and the example run end to end and pass their own checks."""

import ast
import json
import re
import subprocess
import sys

import pytest
import torch
from paths import ROOT

from weightfabric.fabric.tensorset import layout_of, named_tensors
from weightfabric.tools.demo.model import TinyLlama, TinyLlamaConfig
from weightfabric.tools.demo.roles import changed_fraction


def test_demo_passes_its_checks_with_small_settings():
    result = subprocess.run(
        [sys.executable, "-m", "weightfabric.tools.cli", "demo", "--json", "--steps", "4", "--size", "tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["ok"] and all(out["checks"].values()), out["checks"]
    assert out["logits_match"] is True
    assert set(out["checks"]) >= {"logits_match", "every_version_reached_every_live_rollout",
                                  "killed_rollouts_chunks_reread_elsewhere",
                                  "joined_rollout_pulled_from_peers"}
    assert [v["version"] for v in out["versions"]] == [1, 2, 3, 4]
    for v in out["versions"]:
        assert {"bytes", "seconds", "trainer_egress_bytes", "stall_seconds",
                "changed_fraction"} <= set(v)
        assert v["rollouts"] == v["expected"] and v["bytes"] > 0
    # the trainer publishes bf16 snapshots of its fp32 weights, and the fraction of bf16
    # values that changed since the previous version (none for the first)
    with torch.device("meta"):
        bf16_bytes = layout_of(named_tensors(
            TinyLlama(TinyLlamaConfig.scaled("tiny")).to(torch.bfloat16))).nbytes
    assert all(f["bytes"] == bf16_bytes for v in out["versions"]
               for f in v["per_rollout"].values())
    assert out["versions"][0]["changed_fraction"] is None
    assert all(0 < v["changed_fraction"] < 1 for v in out["versions"][1:]), out["versions"]
    killed, joined = out["killed"], out["joined"]
    assert killed["worker"] not in out["versions"][-1]["rollouts"]
    assert killed["chunks_held"] < killed["chunks"]  # a complete replica is no failover test
    assert sum(killed["reread_by"].values()) > 0
    assert joined["worker"] in out["versions"][-1]["rollouts"]
    assert len(out["rollouts"]) == 4  # 3 at the start, one killed, one joined


def test_changed_fraction_counts_values_whose_bits_differ():
    before = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.bfloat16)
    after = torch.tensor([1.0, 2.015625, 3.0, -0.0], dtype=torch.bfloat16)  # +1 ulp; -0 != 0
    same = torch.zeros(4, dtype=torch.bfloat16)
    bits = {"a": before.view(torch.int16), "b": same.view(torch.int16)}
    assert changed_fraction(bits, bits) == 0.0
    assert changed_fraction(bits, {"a": after.view(torch.int16), "b": same.view(torch.int16)}) == 2 / 8


@pytest.mark.parametrize("argv, words", [(["--workers", "0"], "--workers"),
                                         (["--chunk-size", "0B"], "chunk"),  # was "default"
                                         (["--chunk-size", "1b"], "chunk")])
def test_demo_rejects_bad_settings(argv, words, capsys):
    from weightfabric.tools.cli import main

    assert main(["demo", *argv]) == 2
    assert words in capsys.readouterr().err


def test_example_rl_loop_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Counted in the whole output, not per line: the two processes share the pipe, and
    # unbuffered (PYTHONUNBUFFERED) prints write a line and its newline separately.
    assert result.stdout.count("rollout: v") == 3
    assert result.stdout.count("trainer: published v") == 3


def test_example_planned_broadcast_runs_along_the_plan():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "planned_broadcast.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("read MB from") == 3 * 4 and "NOT BIT-EXACT" not in out
    # versions 2 and 3 are planned over the four rollouts, nobody routed around
    assert out.count("readers, predicted") == 2 and "routed around: none" in out
    # along the plan, dc-b's rollouts together read the version once from dc-a
    v3 = out.split("v3:")[1].split("plan of")[0]
    crossed = sum(mb for line in v3.splitlines() if "(dc-b)" in line
                  for src, mb in ast.literal_eval(line.split("read MB from ")[1]).items()
                  if src in ("trainer", "a-0"))
    assert crossed == pytest.approx(4 * 4 * 2**20 / 1e6, abs=0.2), v3


def test_example_hubs_over_etcd_survives_the_leaders_death():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hubs_over_etcd.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "v1 published and fetched" in result.stdout
    assert "leader killed; v2 published" in result.stdout
    assert "rollout holds v2, bit-exact" in result.stdout


def test_example_node_relay_fetches_through_the_relay_in_batches():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "node_relay.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("fetched by 4 rollouts, bit-exact: True") == 2
    batched, batches = (int(n) for n in re.search(
        r"relay: (\d+) requests in (\d+) batches", out).groups())
    assert batched >= 4 * (1 + 2 * 2) and 0 < batches <= batched   # registers, plans, completions
    assert f"the hub answered {batches} batches" in out
