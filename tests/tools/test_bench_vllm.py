"""`fabric bench vllm`: its options, its table, and one small real run (when vLLM imports).

The run (one TP=1 engine, the tiny model, two versions per system) checks the JSON the
command promises, that every system's updates matched vLLM's own load of each version,
and that only that JSON reaches standard output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rich.console import Console

from weightfabric.tools.bench.vllm import SYSTEMS, _ratios, _summary, _table, bench_vllm
from weightfabric.tools.cli import main


def test_help_names_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "vllm", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--engines", "--tp", "--size", "--versions", "--systems", "--json"):
        assert option in out
    assert "gloo" in out and "floor" in out


@pytest.mark.parametrize("argv, words", [
    (["--engines", "0"], "--engines"),
    (["--versions", "1"], "--versions"),
    (["--systems", "nccl"], "unknown systems"),
])
def test_bad_options_exit_2_before_any_engine_starts(argv, words, capsys) -> None:
    assert main(["bench", "vllm", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric bench vllm: error: ") and words in err


@pytest.mark.parametrize("argv", [["--tp", "3"], ["--size", "huge"]])
def test_choices_are_enforced_by_argparse(argv) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "vllm", *argv])
    assert exit_.value.code == 2


def test_bench_vllm_refuses_bad_options_as_a_function() -> None:
    with pytest.raises(ValueError, match="--tp"):
        bench_vllm(tp=4)
    with pytest.raises(ValueError, match="--size"):
        bench_vllm(size="huge")


def _version(update: float, pause: float, **extra) -> dict:
    return {"update_s": update, "pause_s": pause, "verified": True, "sources": {}, **extra}


def test_medians_skip_the_cold_version_and_ratios_meet_or_miss_their_targets() -> None:
    fabric = _summary([_version(9.0, 9.0, publish_s=1.0, fetch_s=1.0, land_s=1.0),
                       _version(1.0, 0.5, publish_s=0.2, fetch_s=0.3, land_s=0.1,
                                sources={"trainer": 10, "engine0-rank0": 10}),
                       _version(3.0, 0.7, publish_s=0.2, fetch_s=0.3, land_s=0.1,
                                sources={"trainer": 10, "engine0-rank0": 10})])
    assert fabric["update_s"] == 2.0 and fabric["pause_s"] == 0.6
    assert fabric["cold_update_s"] == 9.0 and fabric["sources"]["trainer"] == 10
    gloo = _summary([_version(5.0, 5.0), _version(4.0, 4.0), _version(4.0, 4.0)])
    floor = _summary([_version(1.0, 1.0), _version(1.0, 1.0), _version(1.0, 1.0)])
    ratios, targets = _ratios({"weightfabric": fabric, "gloo": gloo, "floor": floor})
    assert ratios["weightfabric_update_vs_gloo"] == 0.5
    assert targets["weightfabric_update_vs_gloo"]["met"] is True
    assert targets["weightfabric_update_vs_floor"]["met"] is False  # 2.0 > 1.5
    result = {"engines": 2, "tp": 1, "size": "tiny", "bytes": 20, "versions": 3,
              "fabric_landing": ["direct"], "ratios": ratios, "targets": targets,
              "runs": {"weightfabric": fabric, "gloo": gloo, "floor": floor}}
    console = Console(record=True, width=160)
    _table(result, console)
    text = console.export_text()
    assert "weightfabric" in text and "in memory" in text and "missed" in text


def test_one_tiny_engine_every_system_verified() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-m", "weightfabric.tools", "bench", "vllm", "--engines", "1",
         "--tp", "1", "--size", "tiny", "--versions", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)  # nothing but the JSON on stdout
    assert r["engines"] == 1 and r["tp"] == 1 and r["bytes"] > 0 and r["verified"] is True
    assert set(r["runs"]) == set(SYSTEMS)
    for name, run in r["runs"].items():
        assert run["verified"] is True, name
        assert run["update_s"] > 0 and run["pause_s"] > 0, name
        assert len(run["per_version"]) == 2, name
    assert sum(r["runs"]["weightfabric"]["sources"].values()) >= r["bytes"]
    assert r["runs"]["gloo"]["sources"] == {"trainer": r["bytes"]}
    assert {"weightfabric_update_vs_gloo", "weightfabric_update_vs_floor",
            "weightfabric_pause_vs_gloo"} <= set(r["targets"])
