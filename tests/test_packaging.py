"""The distribution installs one import root, `weightfabric`, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

FOLDERS = ("fabric", "kernels", "rollout", "topology", "tools")

ROUND_TRIP = """
import torch
import weightfabric as wf
import fabric, kernels, tools   # the user's own packages, beside ours
assert fabric.MINE and kernels.MINE and tools.MINE
hub = wf.serve("tcp://127.0.0.1:0")
try:
    with wf.join(hub.url, worker="trainer") as trainer, wf.join(hub.url, worker="rollout") as rollout:
        weights = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7)}
        version = trainer.model("policy").publish(weights)
        mine = {"w": torch.zeros(1000), "b": torch.zeros(7)}
        store = rollout.model("policy")
        store.attach(mine)
        store.fetch(version)
        assert torch.equal(mine["w"], weights["w"]) and torch.equal(mine["b"], weights["b"])
finally:
    hub.stop()
print("round trip ok")
"""


def _packages_on_disk() -> set[str]:
    found = {"weightfabric"}
    for top in FOLDERS:
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            found.add(".".join(("weightfabric", *parts)))
    return found


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _packages_on_disk()
    assert config["package-dir"] == {"weightfabric": "."}


def test_the_wheel_installs_only_weightfabric(tmp_path: Path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("weightfabric-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read(next(n for n in names if n.endswith("top_level.txt"))).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "weightfabric"}
    assert top_level.split() == ["weightfabric"]
    assert "weightfabric/topology/clusters/localhost.yaml" in names
    assert not [n for n in names if n.startswith(("weightfabric/tests", "weightfabric/examples"))]


def test_import_and_round_trip_beside_packages_named_like_ours(tmp_path: Path):
    """A user repo with its own fabric/, kernels/ and tools/ (first on sys.path)."""
    for name in ("fabric", "kernels", "tools"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("MINE = True\n")
    done = subprocess.run([sys.executable, "-c", ROUND_TRIP], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round trip ok" in done.stdout
