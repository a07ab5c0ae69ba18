"""CPU arenas: memory a worker exposes to its peers, backed by `/dev/shm` files.

A `Region` is one shared-memory file mapped as a flat ``uint8`` tensor; tensors
live in it as views (`Region.view`). The owner creates it; peers on the same
host attach it read-only by path. Files are named
``weightfabric-<pid>-<worker>-<token>`` and removed when the owner closes the
region, when the owner's interpreter exits normally, or — after a crash — by
`remove_stale_regions`, which any later worker runs.

Stale detection cannot trust the pid alone (pids are reused), so the owner also
holds a shared `flock` on the file for its whole life. The kernel drops that
lock when the process dies, however it dies; a file whose lock can be taken
exclusively and whose pid is gone has no owner.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import weakref
from pathlib import Path

import torch

from fabric.errors import ArenaError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "weightfabric"
_NAME = re.compile(rf"^{PREFIX}-(?P<pid>\d+)-")


def _safe(worker: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", worker)[:48] or "worker"


def _release(path: Path, fd: int, owner: bool) -> None:
    """Unlink (when owner) and drop the lock; safe to call twice."""
    if owner:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


class Region:
    """One `/dev/shm` file mapped as a flat ``uint8`` CPU tensor.

    Create one with `Region.create` (the owner) or `Region.attach` (a peer on the
    same host). Closing the owner's region unlinks the file; peers that still map
    it keep valid memory until they close theirs.
    """

    def __init__(self, path: Path, nbytes: int, fd: int, *, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._finalizer = weakref.finalize(self, _release, path, fd, owner)

    @classmethod
    def create(cls, worker: str, nbytes: int, *, directory: Path | None = None) -> Region:
        """Create a zero-filled region of `nbytes` owned by this process.

        Raises:
            ArenaError: `nbytes` is not positive, or the file cannot be created
                (e.g. /dev/shm is full or missing).
        """
        if nbytes <= 0:
            raise ArenaError(f"a region needs a positive size, got {nbytes} bytes")
        directory = Path(directory or SHM_DIR)
        path = directory / f"{PREFIX}-{os.getpid()}-{_safe(worker)}-{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise ArenaError(f"cannot create {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, nbytes)
            return cls(path, nbytes, fd, owner=True)
        except BaseException:
            _release(path, fd, owner=True)
            raise

    @classmethod
    def attach(cls, path: str | os.PathLike[str], nbytes: int | None = None) -> Region:
        """Map a peer's region (same host) by path: its first `nbytes`, or all of it.

        Raises:
            ArenaError: the file is gone or smaller than `nbytes`.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ArenaError(f"cannot attach {path}: {exc.strerror}") from exc
        size = os.fstat(fd).st_size
        nbytes = size if nbytes is None else nbytes
        if size < nbytes or nbytes <= 0:
            os.close(fd)
            raise ArenaError(f"{path} holds {size} bytes, expected at least {nbytes}")
        return cls(path, nbytes, fd, owner=False)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` living at byte `offset` of the region.

        Raises:
            ArenaError: the view would not fit, or `offset` is not aligned to the
                dtype's element size.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for dim in shape:
            numel *= dim
        end = offset + numel * itemsize
        if offset < 0 or end > self.nbytes:
            raise ArenaError(f"view [{offset}, {end}) is outside region {self.path.name} "
                             f"of {self.nbytes} bytes")
        if offset % itemsize:
            raise ArenaError(f"offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
        return self.tensor[offset:end].view(dtype).view(shape)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Drop this mapping's file handle; the owner also unlinks the file."""
        self._finalizer()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Region({self.path}, {self.nbytes} bytes, owner={self.owner})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_regions(directory: Path | None = None) -> list[Path]:
    """Remove region files whose owner process is gone; return what was removed.

    A file is stale when the pid in its name is not running and nobody holds the
    owner's lock on it. Files of live workers are never touched.
    """
    directory = Path(directory or SHM_DIR)
    removed: list[Path] = []
    for path in directory.glob(f"{PREFIX}-*"):
        match = _NAME.match(path.name)
        if not match or _pid_alive(int(match.group("pid"))):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            path.unlink()
            removed.append(path)
            log.info("removed stale arena region %s", path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed
