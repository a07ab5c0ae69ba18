"""How much of a mapped file is resident in this process, and scratch /dev/shm dirs."""

from __future__ import annotations

import mmap
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from weightfabric.fabric.arena import SHM_DIR


def resident_bytes(path: Path) -> int:
    """Bytes of `path` mapped into this process's page tables (Rss in /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


UNMAP_SLACK = 64 * mmap.PAGESIZE
"""Pages a resident check forgives: the kernel may unmap a page of a shared file at
any time (migrating it for compaction, reclaiming it), which CI once caught on one
page of 8192. One skipped populate step (`POPULATE_PIECE`, 4 MiB) is far more."""


def is_resident(path: Path, nbytes: int) -> bool:
    """Whether the first `nbytes` of `path` are mapped here, to within `UNMAP_SLACK`."""
    return resident_bytes(path) >= nbytes - UNMAP_SLACK


def populate_threads(paths: Iterable[Path] | None = None) -> list[threading.Thread]:
    """Live background populate threads (of the regions at `paths`, or all)."""
    names = None if paths is None else {f"wf-populate-{p.name[-8:]}" for p in paths}
    return [t for t in threading.enumerate() if t.is_alive() and t.name.startswith("wf-populate-")
            and (names is None or t.name in names)]


@contextmanager
def scratch_shm() -> Iterator[Path]:
    """A private directory in /dev/shm (tmpfs, as in production), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="wf-test-", dir=SHM_DIR))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
