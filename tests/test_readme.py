"""Every Python snippet of the README runs: the trainer and rollout together, the rest alone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import ROOT

import weightfabric as wf
from weightfabric.fabric.arena import PREFIX, SHM_DIR, remove_stale_regions

SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


def snippets() -> dict[str, str]:
    """The README's Python blocks by their first line (``# trainer.py``: ``trainer.py``)."""
    blocks = SNIPPET.findall((ROOT / "README.md").read_text())
    return {b.splitlines()[0].lstrip("# ").split(":")[0] or f"block {i}": b
            for i, b in enumerate(blocks)}


def _write(tmp_path: Path, name: str) -> str:
    path = tmp_path / name.replace(" ", "_")
    path.write_text(snippets()[name])
    return str(path)


def _env(hub) -> dict[str, str]:
    # vLLM's engine core in the snippet's process: the same code, started in half the time
    return {**os.environ, "WEIGHTFABRIC_HUB": hub.url, "MY_IP": "127.0.0.1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_the_readme_has_the_snippets_these_tests_run():
    names = set(snippets())
    assert {"trainer.py", "rollout.py", "engine_layout.py"} <= names
    assert len(names) == len(SNIPPET.findall((ROOT / "README.md").read_text()))


def test_the_trainer_exits_and_its_last_version_lives_on_in_the_rollout(hub, tmp_path):
    """The lifetime rule: the last version outlives the trainer.

    After the trainer's `wait_replicated` and exit, a late reader still fetches the
    last version, from the rollout.
    """
    rollout = subprocess.Popen([sys.executable, _write(tmp_path, "rollout.py")], env=_env(hub),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            trainer = subprocess.run([sys.executable, _write(tmp_path, "trainer.py")],
                                     env=_env(hub), capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired as exc:  # say why: the rollout's side of the story
            rollout.kill()
            out, err = rollout.communicate()
            pytest.fail(f"the trainer did not finish in 180 s; its stderr:\n"
                        f"{(exc.stderr or b'')[-2000:]!r}\nthe rollout's (exit {rollout.returncode}):"
                        f"\n{out[-1000:]}\n{err[-3000:]}")
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        with wf.connect(hub.url) as client:
            last = client.latest("policy")
        assert last == 3
        with wf.join(hub.url, worker="late-reader") as late:
            model = torch.nn.Linear(256, 256)
            store = late.model("policy")
            store.attach(model)
            stats = store.fetch("latest")
        assert stats.version == 3 and stats.sources
        assert all(w.startswith("rollout-") for w in stats.sources), stats.sources
    finally:
        rollout.send_signal(signal.SIGINT)  # its `with wf.join` closes the worker
        killed = False
        try:
            out, err = rollout.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            killed = True
            rollout.kill()
            out, err = rollout.communicate()
        left = list(SHM_DIR.glob(f"{PREFIX}-{rollout.pid}-*"))
        remove_stale_regions()
    assert "v3:" in out, err[-3000:]
    assert not left, (f"the rollout's exit (status {rollout.returncode}"
                      f"{', killed after 60 s' if killed else ''}) left {left}; its stderr:\n"
                      f"{err[-3000:]}")


@pytest.mark.parametrize("name", sorted(set(snippets()) - {"trainer.py", "rollout.py"}))
def test_the_other_snippets_run(hub, tmp_path, name):
    done = subprocess.run([sys.executable, _write(tmp_path, name)], env=_env(hub), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
