"""Benchmark children keep the caller's import path (the GPU machine's carried wheels)."""

from __future__ import annotations

import os
from pathlib import Path

from weightfabric.tools.bench.launch import Agent


def test_an_agent_inherits_the_callers_pythonpath(tmp_path: Path, monkeypatch):
    """An agent sees the caller's PYTHONPATH.

    Its children once ran with PYTHONPATH set to the repository alone, so packages
    carried to a GPU machine in /tmp/site (pyzmq) were missing there.
    """
    marker = tmp_path / "imported"
    (tmp_path / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *([old] if old else [])]))
    agent = Agent("probe", ready_timeout=60)
    agent.close()
    assert marker.exists()
