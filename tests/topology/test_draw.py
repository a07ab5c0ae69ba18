"""`fabric topo draw`: every cluster draws to a valid PNG, large ones quickly and compactly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest
from draw_helpers import dgx_cluster, png_size
from paths import ROOT as REPO

from weightfabric.topology import load_cluster, loads_cluster, reference_clusters
from weightfabric.topology.draw import draw_cluster


@pytest.mark.parametrize("name", sorted(reference_clusters()))
def test_every_reference_cluster_draws_to_a_readable_png(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.png"
    draw_cluster(load_cluster(reference_clusters()[name]), out)
    width, height = png_size(out)
    assert 600 <= width <= 6000 and 400 <= height <= 4000, (width, height)
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05, "the picture is blank"


def test_title_and_string_path_are_accepted(tmp_path: Path) -> None:
    out = tmp_path / "titled.png"
    draw_cluster(load_cluster(reference_clusters()["dgx-h100"]), str(out), title="One DGX H100")
    assert png_size(out)[0] > 0


def test_ten_thousand_gpu_cluster_draws_quickly_and_no_larger_than_a_small_one(
        tmp_path: Path) -> None:
    cluster = loads_cluster(dgx_cluster(1280))
    assert sum(n.type.gpus for n in cluster.nodes()) == 10_240
    start = time.perf_counter()
    draw_cluster(cluster, tmp_path / "big.png")
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"drawing 10,240 GPUs took {elapsed:.1f} s"
    # Node groups collapse, so the picture's size does not grow with the node count.
    draw_cluster(loads_cluster(dgx_cluster(2560)), tmp_path / "bigger.png")
    assert png_size(tmp_path / "big.png") == png_size(tmp_path / "bigger.png")
    width, height = png_size(tmp_path / "big.png")
    assert width <= 6000 and height <= 3000, (width, height)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_cli_topo_draw_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    done = _run(["-m", "weightfabric.tools.cli", "topo", "draw",
                 str(reference_clusters()["two-datacenters"]), "-o", str(out)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert png_size(out)[0] > 0


def test_drawing_leaves_pyplot_unimported(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from topology import reference_cluster\n"
            "from topology.draw import draw_cluster\n"
            f"draw_cluster(reference_cluster('localhost'), {str(tmp_path / 'x.png')!r})\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n")
    done = _run(["-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
