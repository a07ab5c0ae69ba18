"""`fabric bench rollout`: its options, its workload and table, and one smallest real run.

The run (2 engines, one step of 6 requests, a kill after 1 s, no replacement) exercises
the pool mode (``restart`` and ``sync`` differ only in the pool's options, tested with
scripted engines in tests/rollout: left to the benchmark, for the suite's time) and
checks the JSON the issue asks for,
that the pool mode migrated requests and verified them (kept tokens exact, continuations
equal to the oracle), that only that JSON reaches standard output, and that no process
or shared-memory region it made is left (no timing is checked: the machine may be busy).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import processes_naming
from paths import ROOT, child_env
from rich.console import Console
from timeouts import hard_timeout

from weightfabric.tools.bench.rollout import MODES, Options, _ratios, _table, workload
from weightfabric.tools.cli import main

RUN_KEYS = {"useful_tokens_per_s", "regenerated_tokens", "last_sample_s", "wall_s",
            "preemptions", "migrations", "verified", "kept_checked", "oracle_checked"}


def test_help_names_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "rollout", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--engines", "--prompts", "--group", "--steps", "--slots",
                   "--preempt-every", "--replace-after", "--train-s", "--max-model-len",
                   "--oracle", "--modes", "--seed", "--json"):
        assert option in out
    assert "restart" in out and "sync" in out


@pytest.mark.parametrize("argv, words", [
    (["--engines", "0"], "--engines"),
    (["--steps", "0"], "--steps"),
    (["--preempt-every", "0"], "--preempt-every"),
    (["--modes", "fifo"], "unknown modes"),
])
def test_bad_options_exit_2_before_any_engine_starts(argv, words, capsys) -> None:
    assert main(["bench", "rollout", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric bench rollout: error: ") and words in err


def test_the_workload_is_fixed_long_tailed_and_fits_the_context() -> None:
    o = Options(prompts=24, group=4, max_model_len=512)
    prompts = workload(o)
    assert prompts == workload(o) and len(prompts) == 24
    assert len({p.group for p in prompts}) == 6
    lengths = sorted(p.max_tokens for p in prompts)
    assert lengths[-1] > 4 * lengths[len(lengths) // 2]   # a long tail
    assert all(len(p.prompt) + p.max_tokens <= 512 for p in prompts)
    short = workload(Options(prompts=6, group=3, max_model_len=64))
    assert all(len(p.prompt) + p.max_tokens <= 64 for p in short)


def _run_result(**over) -> dict:
    run = {"useful_tokens_per_s": 100.0, "regenerated_tokens": 0, "last_sample_s": 2.0,
           "wall_s": 4.0, "preemptions": 1, "migrations": 2, "steals": 0, "restarts": 0,
           "kept_checked": 2, "oracle_checked": 2, "verified": True}
    return {**run, **over}


def test_ratios_and_table() -> None:
    runs = {"pool": _run_result(),
            "restart": _run_result(useful_tokens_per_s=50.0, regenerated_tokens=40,
                                   last_sample_s=3.0, migrations=0, restarts=2),
            "sync": _run_result(useful_tokens_per_s=80.0, last_sample_s=4.0, wall_s=6.0,
                                verified=False)}
    ratios = _ratios(runs)
    assert ratios["tokens_per_s_pool_vs_restart"] == 2.0
    assert ratios["last_sample_sync_vs_pool"] == 2.0
    r = {"engines": 2, "slots": 4, "steps": 1, "prompts": 6, "preempt_every_s": 1.0,
         "output_tokens": {"per_step": 100, "median": 10, "max": 50}, "runs": runs,
         "ratios": ratios}
    console = Console(record=True, width=200)
    _table(r, console)
    text = console.export_text()
    assert "restart" in text and "NO" in text and "tokens per s pool vs sync" in text


def test_smallest_run_migrates_and_verifies(tmp_path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    with hard_timeout(120):
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightfabric.tools", "bench", "rollout", "--engines", "2",
             "--prompts", "6", "--group", "3", "--steps", "1", "--preempt-every", "1",
             "--replace-after", "600", "--max-model-len", "256", "--modes", "pool",
             "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=child_env(TMPDIR=str(tmp_path)))
        try:
            out, err = proc.communicate(timeout=115)
        finally:
            if proc.poll() is None:   # SIGINT: the bench cleans up as after Ctrl-C
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
        r = json.loads(out)  # nothing but the JSON on stdout
        assert r["engines"] == 2 and r["prompts"] == 6 and r["verified"] is True
        assert set(r["runs"]) == {"pool"}
        for name, run in r["runs"].items():
            assert set(run) >= RUN_KEYS, name
            assert run["verified"] is True, (name, run)
            assert run["useful_tokens"] == r["output_tokens"]["per_step"], name
            assert run["preemptions"] >= 1, name
        pool = r["runs"]["pool"]
        assert pool["migrations"] >= 1 and pool["oracle_checked"] >= 1, pool
        assert pool["kept_checked"] >= 1 and pool["restarts"] == 0, pool
        # engines gone (each names the run's temporary directory), and the fabric regions
        # of the trainer (the bench's process) and of the engines (named after the modes)
        assert processes_naming(str(tmp_path)) == []
        left = [p.name for p in Path("/dev/shm").glob("weightfabric-*")
                if p.name.startswith(f"weightfabric-{proc.pid}-")
                or any(f"-{mode}-e" in p.name for mode in MODES)]
        assert left == []
