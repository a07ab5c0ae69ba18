"""CPU arenas: /dev/shm regions, views, cleanup, and population of pages.

CPU arenas: /dev/shm regions, views, cleanup of files of dead workers, and population of
pages ahead of writes.
"""

import errno
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from paths import ROOT, child_env
from shm_pages import is_resident, populate_threads, resident_bytes, scratch_shm

from weightfabric.fabric import arena
from weightfabric.fabric.arena import ArenaError, Region, remove_stale_regions


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
                            env=child_env())
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


# --- population ----------------------------------------------------------------------

MiB = 1 << 20


@pytest.fixture
def tmpfs():
    with scratch_shm() as path:
        yield path


def slow_populate(monkeypatch, seconds: float) -> None:
    """Make every step of a background populate take `seconds` longer (to act while one runs).

    Writers' own `populate_range` calls keep their speed.
    """
    real = arena._populate_range

    def slow(*args, **kwargs):
        if threading.current_thread().name.startswith("wf-populate-"):
            time.sleep(seconds)
        real(*args, **kwargs)

    monkeypatch.setattr(arena, "_populate_range", slow)


def test_a_populated_region_is_resident_before_its_first_write(tmpfs):
    with Region.create("w", 64 * MiB + 100, directory=tmpfs) as sparse:
        assert resident_bytes(sparse.path) == 0
    with Region.create("w", 64 * MiB + 100, directory=tmpfs, populate=True) as region:
        assert is_resident(region.path, region.nbytes)
        assert region.populated_bytes == region.nbytes and region.wait_populated(timeout=0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        region.tensor.fill_(7)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 64  # of 16k pages
        assert bool((region.tensor == 7).all())


def test_background_populate_finishes_and_its_thread_ends(tmpfs):
    with Region.create("w", 32 * MiB, directory=tmpfs) as region:
        region.populate(background=True)
        region.populate(background=True)  # a second call does nothing
        assert region.wait_populated(timeout=60)
        assert is_resident(region.path, region.nbytes)
        deadline = time.monotonic() + 10
        while populate_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not populate_threads()


def test_close_stops_a_background_populate_and_removes_the_file(tmpfs, monkeypatch):
    slow_populate(monkeypatch, 0.05)
    region = Region.create("w", 64 * MiB, directory=tmpfs)  # 16 steps: 0.8 s or more
    region.populate(background=True)
    assert region.wait_populated(arena.POPULATE_PIECE, timeout=30)
    assert region.populated_bytes < region.nbytes  # still running
    start = time.monotonic()
    region.close()
    assert time.monotonic() - start < 2  # within one step, not the whole populate
    assert not populate_threads() and not region.path.exists()
    assert region.populated_bytes < region.nbytes


def test_populate_in_the_foreground_takes_over_from_the_background(tmpfs, monkeypatch):
    slow_populate(monkeypatch, 0.2)
    with Region.create("w", 32 * MiB, directory=tmpfs) as region:
        region.populate(background=True)
        region.populate()
        assert region.populated_bytes == region.nbytes and not populate_threads()
        assert is_resident(region.path, region.nbytes)


def test_a_waiting_caller_populates_with_several_threads(tmpfs, monkeypatch):
    """The caller and its helpers each take the next piece; `frontier` counts only done ones."""
    real, seen = arena._populate_range, []

    def record(fd, tensor, lo, hi, *args, **kwargs):
        seen.append((lo, hi, threading.current_thread().name))
        time.sleep(0.01)  # long enough that every thread gets pieces
        real(fd, tensor, lo, hi, *args, **kwargs)

    monkeypatch.setattr(arena, "_populate_range", record)
    nbytes = 10 * arena.POPULATE_PIECE + 5
    with Region.create("w", nbytes, directory=tmpfs) as region:
        region.populate(workers=3)
        assert region.populated_bytes == nbytes and not populate_threads()
        assert sorted((lo, hi) for lo, hi, _ in seen) == [
            (lo, min(lo + arena.POPULATE_PIECE, nbytes))
            for lo in range(0, nbytes, arena.POPULATE_PIECE)]  # each piece once
        assert len({name for *_, name in seen}) == 3
        assert is_resident(region.path, nbytes)
    assert arena.populate_workers() == max(1, min(arena.MAX_POPULATE_WORKERS,
                                                  len(os.sched_getaffinity(0))))


def test_a_failing_helper_stops_the_others_and_the_caller_raises(tmpfs, monkeypatch):
    real, calls = arena._populate_range, []

    def fails_in_a_helper(fd, tensor, lo, hi, *args, **kwargs):
        calls.append(lo)
        if threading.current_thread().name.startswith("wf-populate-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.01)
        real(fd, tensor, lo, hi, *args, **kwargs)

    monkeypatch.setattr(arena, "_populate_range", fails_in_a_helper)
    with Region.create("w", 64 * arena.POPULATE_PIECE, directory=tmpfs) as region:
        with pytest.raises(ArenaError, match="No space left"):
            region.populate(workers=2)
        assert not populate_threads() and len(calls) < 64  # stopped early
        assert region.populated_bytes < region.nbytes
        monkeypatch.setattr(arena, "_populate_range", real)
        region.populate(workers=2)  # room again: a later call finishes it
        assert region.populated_bytes == region.nbytes


@pytest.mark.parametrize("fallocate", [True, False], ids=["fallocate", "no-fallocate"])
def test_populate_falls_back_when_the_kernel_lacks_madv_populate_write(tmpfs, monkeypatch,
                                                                       fallocate):
    calls = []
    monkeypatch.setattr(arena, "_madvise", lambda *args: calls.append(args) or errno.EINVAL)
    if not fallocate:
        def unsupported(*args):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with Region.create("w", 8 * MiB + 1, directory=tmpfs, populate=True) as region:
        assert len(calls) == 1  # asked once, then the fallback for every step
        assert region._populator.methods == {"madvise": False, "fallocate": fallocate}
        assert is_resident(region.path, region.nbytes)
        region.populate_range(5, 4 * MiB + 3)  # a writer's range after the fallback
        assert len(calls) == 1


def test_no_room_in_dev_shm_is_an_arena_error_not_a_sigbus(tmpfs, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ArenaError, match="No space left"):
        Region.create("w", 8 * MiB, directory=tmpfs, populate=True)
    assert not list(tmpfs.iterdir())  # the failed region's file is gone
    with Region.create("w", 8 * MiB, directory=tmpfs) as region:
        region.populate(background=True)
        with pytest.raises(ArenaError, match="No space left"):
            region.wait_populated(timeout=30)
        assert isinstance(region.populate_error, ArenaError)
    monkeypatch.undo()  # fallocate works again; madvise says a write would SIGBUS
    monkeypatch.setattr(arena, "_madvise", lambda *args: errno.EFAULT)
    with Region.create("w", 8 * MiB, directory=tmpfs) as region, \
            pytest.raises(ArenaError, match="Bad address"):
        region.populate_range(0, MiB)


def test_only_the_owner_populates(tmpfs):
    with Region.create("w", MiB, directory=tmpfs) as owner, \
            Region.attach(owner.path) as peer:
        with pytest.raises(ArenaError, match="only the owner"):
            peer.populate()
        assert peer.wait_populated(timeout=0) is False
    owner.close()
    with pytest.raises(ArenaError, match="only the owner"):
        owner.populate()


def test_exit_during_a_background_populate_removes_the_file(tmpfs):
    code = (
        "from pathlib import Path; from fabric.arena import Region;"
        f"r = Region.create('exiting', 1 << 30, directory=Path({str(tmpfs)!r}));"
        "r.populate(background=True); print(r.path, flush=True)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not Path(proc.stdout.strip()).exists()
