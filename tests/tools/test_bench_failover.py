"""A smoke run of `fabric bench failover` (one kill per set-up, 2 readers, 8 MB).

The JSON it promises for both set-ups, every fetch bit-exact across the kill, no record
lost, and nothing left running afterwards (no timing is checked: the machine may be busy).
"""

from __future__ import annotations

import json
import subprocess
import sys

from leftovers import processes_naming
from paths import ROOT, child_env
from timeouts import hard_timeout

KEYS = {"runs", "failover_s", "median_s", "max_s", "lost_records", "fetches_verified",
        "in_flight_at_kill", "leader_s", "error"}


def test_one_kill_per_set_up_loses_nothing_and_leaves_nothing_running(tmp_path) -> None:
    with hard_timeout(300):
        out = subprocess.run(
            [sys.executable, "-m", "weightfabric.tools", "bench", "failover", "--runs", "1",
             "--readers", "2", "--mb", "8", "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=240,
            env=child_env(TMPDIR=str(tmp_path)))
        assert out.returncode == 0, out.stdout + out.stderr
        r = json.loads(out.stdout)
        assert r["verified"] is True and r["target_s"] == 5.0 and r["machine"]["cores"]
        for mode in ("etcd", "state_dir"):
            m = r[mode]
            assert set(m) >= KEYS, m
            assert m["error"] is None, m
            assert m["runs"] == 1 and len(m["failover_s"]) == 1 and m["failover_s"][0] > 0
            assert m["fetches_verified"] == 1 * 2, m
            assert m["lost_records"] == 0, m["lost"]
            assert m["in_flight_at_kill"] == [m["in_flight_at_kill"][0]]
            assert 1 <= m["in_flight_at_kill"][0] <= 2
        assert r["etcd"]["hubs"] == 2 and r["state_dir"]["hubs"] == 1
        assert "etcd run 1:" in out.stderr and "state_dir run 1:" in out.stderr  # progress
        # etcd members, hubs and agents all ended (each names the run's temporary dir)
        assert processes_naming(str(tmp_path)) == []


def test_bad_numbers_are_refused_before_anything_starts() -> None:
    with hard_timeout(60):
        out = subprocess.run(
            [sys.executable, "-m", "weightfabric.tools", "bench", "failover", "--runs", "0"],
            capture_output=True, text=True, cwd=ROOT, timeout=50, env=child_env())
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--runs" in out.stderr
