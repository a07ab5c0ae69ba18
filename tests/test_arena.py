"""CPU arenas: /dev/shm regions, views, and cleanup of files of dead workers."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric.arena import ArenaError, Region, remove_stale_regions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm_dir(tmp_path):
    """A private directory standing in for /dev/shm, so tests never see other files."""
    return tmp_path


def test_region_views_share_memory_with_peers(shm_dir):
    with Region.create("w", 4096, directory=shm_dir) as owner:
        weights = owner.view(64, (3, 5), torch.float32)
        weights.copy_(torch.arange(15, dtype=torch.float32).view(3, 5))
        with Region.attach(owner.path, 4096) as peer:
            assert torch.equal(peer.view(64, (3, 5), torch.float32), weights)
            peer.tensor[0] = 7
        assert owner.tensor[0] == 7


def test_owner_close_unlinks_the_file(shm_dir):
    region = Region.create("w", 128, directory=shm_dir)
    path = region.path
    assert path.exists() and path.name.startswith(f"weightfabric-{os.getpid()}-w-")
    region.close()
    region.close()  # idempotent
    assert not path.exists() and region.closed


def test_peer_close_keeps_the_file(shm_dir):
    with Region.create("w", 128, directory=shm_dir) as owner:
        Region.attach(owner.path, 128).close()
        assert owner.path.exists()


@pytest.mark.parametrize(("offset", "shape", "dtype", "words"), [
    (4000, (100,), torch.float32, "outside region"),
    (2, (4,), torch.float32, "not aligned"),
    (-4, (1,), torch.float32, "outside region"),
])
def test_bad_views_are_refused(shm_dir, offset, shape, dtype, words):
    with Region.create("w", 4096, directory=shm_dir) as region, \
            pytest.raises(ArenaError, match=words):
        region.view(offset, shape, dtype)


def test_bad_sizes_and_missing_files_are_refused(shm_dir):
    with pytest.raises(ArenaError, match="positive size"):
        Region.create("w", 0, directory=shm_dir)
    with pytest.raises(ArenaError, match="cannot attach"):
        Region.attach(shm_dir / "weightfabric-1-x-0", 16)
    with Region.create("w", 16, directory=shm_dir) as region, \
            pytest.raises(ArenaError, match="expected at least 32"):
        Region.attach(region.path, 32)


def _spawn_owner(shm_dir: Path, *, crash: bool) -> tuple[subprocess.Popen, Path]:
    code = (
        "import sys, os, signal; from pathlib import Path; from fabric.arena import Region;"
        f"r = Region.create('victim', 1024, directory=Path({str(shm_dir)!r}));"
        "print(r.path, flush=True); sys.stdin.readline();"
        + ("os.kill(os.getpid(), signal.SIGKILL)" if crash else "")
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, Path(proc.stdout.readline().strip())


def test_normal_exit_removes_the_region(shm_dir):
    proc, path = _spawn_owner(shm_dir, crash=False)
    try:
        assert path.exists()
        proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0
        assert not path.exists()
    finally:
        proc.kill()


def test_stale_regions_of_killed_workers_are_removed_live_ones_kept(shm_dir):
    victim, victim_path = _spawn_owner(shm_dir, crash=True)
    alive, alive_path = _spawn_owner(shm_dir, crash=False)
    try:
        victim.communicate("die\n", timeout=60)
        assert victim.returncode == -signal.SIGKILL
        assert victim_path.exists()  # nobody cleaned up after the crash...
        with Region.create("me", 64, directory=shm_dir) as mine:
            removed = remove_stale_regions(shm_dir)  # ...until now
            assert removed == [victim_path]
            assert alive_path.exists() and mine.path.exists()
    finally:
        for proc in (victim, alive):
            proc.kill()
            proc.wait(timeout=30)
