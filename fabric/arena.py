"""CPU arenas: memory a worker exposes to its peers, backed by `/dev/shm` files.

A `Region` is one shared-memory file mapped as a flat ``uint8`` tensor; tensors
live in it as views (`Region.view`). The owner creates it; peers on the same
host attach it by path (mapped shared; readers only copy from it). Files are named
``weightfabric-<pid>-<worker>-<token>`` and removed when the owner closes the
region, when the owner's interpreter exits normally, or — after a crash — by
`remove_stale_regions`, which any later worker runs.

Stale detection cannot trust the pid alone (pids are reused), so the owner also
holds a shared `flock` on the file for its whole life. The kernel drops that
lock when the process dies, however it dies; a file whose lock can be taken
exclusively and whose pid is gone has no owner.

A new region is sparse: each page is allocated, zeroed and mapped by a fault on
its first write, which costs far more than the copy itself (0.4-2 s per GB on
the 2-core dev VM, against 0.06 s for the copy). `Region.populate` does that
work ahead of the writes, in the caller's thread or in a background thread;
`Region.populate_range` lets a writer populate the part it is about to write
when the background thread has not got there yet. The thread runs at normal
priority: at nice 19 it made a concurrent fetch in the same process slower, not
faster (a starved thread inside ``madvise`` holds the process's memory-map lock). Pages are allocated with ``posix_fallocate`` and mapped with
``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14: one call faults a whole range
in, writable); both report a full /dev/shm as an error, where a write into a
sparse file would die of SIGBUS. Without ``MADV_POPULATE_WRITE`` one byte per
page is read instead (a read fault maps a shared tmpfs page writable, and a read
cannot race with a writer).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from pathlib import Path

import torch

from weightfabric.fabric.errors import ArenaError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "weightfabric"
_NAME = re.compile(rf"^{PREFIX}-(?P<pid>\d+)-")

MADV_POPULATE_WRITE = 23
"""`madvise` advice (Linux >= 5.14, <linux/mman.h>): fault a range in, writable."""
POPULATE_PIECE = 4 << 20
"""Bytes a background populate does per step (what writers can follow closely, and
how soon it notices `close`)."""
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
MAX_POPULATE_WORKERS = 8
"""Threads at most that a caller waiting for its pages populates them with (`Region.populate`)."""


def populate_workers() -> int:
    """Threads a waiting caller populates with: this process's cores, at most 8.

    Allocating and zeroing tmpfs pages is CPU work that scales with cores (1 GB on the
    2-core dev VM: 0.5-0.9 s in one thread, 0.35 s in two).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_POPULATE_WORKERS, cores))


def _safe(worker: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", worker)[:48] or "worker"


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _madvise(address: int, length: int, advice: int) -> int:
    """`madvise`; returns 0 or the errno."""
    if _libc().madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def _populate_range(fd: int, tensor: torch.Tensor, lo: int, hi: int,
                    methods: dict[str, bool], *, allocate: bool = True) -> None:
    """Allocate and map bytes [lo, hi) of a shared-memory file mapped at `tensor`.

    `allocate` first allocates the pages with ``posix_fallocate`` (about 25 % less
    CPU than letting ``madvise`` allocate them, but it holds the file's lock, so a
    writer racing a background populate leaves it out). `methods` says which system
    calls work here; one that answers "not supported" is turned off in it.

    Raises:
        ArenaError: no room in /dev/shm (or another error than "not supported").
    """
    lo -= lo % mmap.PAGESIZE  # madvise wants a page-aligned start
    if allocate or not methods["madvise"]:
        _fallocate(fd, lo, hi, methods)
    if methods["madvise"]:
        err = _madvise(tensor.data_ptr() + lo, hi - lo, MADV_POPULATE_WRITE)
        if err == 0:
            return
        if err not in _UNSUPPORTED:
            raise ArenaError(f"cannot populate {hi - lo} bytes of shared memory: "
                             f"{os.strerror(err)}")
        methods["madvise"] = False
        if not allocate:
            _fallocate(fd, lo, hi, methods)
    int(tensor[lo:hi:mmap.PAGESIZE].max())  # one read per page maps it (and allocates it)


def _fallocate(fd: int, lo: int, hi: int, methods: dict[str, bool]) -> None:
    if not methods["fallocate"]:
        return
    try:
        os.posix_fallocate(fd, lo, hi - lo)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise ArenaError(f"cannot allocate {hi - lo} bytes of shared memory: "
                             f"{exc.strerror}") from exc
        methods["fallocate"] = False


class _Populator:
    """Populates a region's pages in order, in a background thread or the caller's.

    `frontier` is the end of the bytes done so far. The thread holds the mapping alive while
    it runs; `stop` ends it within one `POPULATE_PIECE` and joins it.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.frontier = 0
        self.error: ArenaError | None = None
        self.methods = {"madvise": True, "fallocate": True}
        self._closed = False
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._cond = threading.Condition()
        self._next = 0                    # where the next piece starts (claimed up to here)
        self._done: dict[int, int] = {}   # pieces finished past `frontier`: lo -> hi

    def start(self, tensor: torch.Tensor, name: str) -> None:
        """Populate in a background thread (once)."""
        with self._cond:
            if self._closed or self._thread is not None or self.error is not None:
                return
            self._thread = threading.Thread(target=self._background, args=(tensor,),
                                            daemon=True, name=f"wf-populate-{name}")
        self._thread.start()

    def _background(self, tensor: torch.Tensor) -> None:
        with contextlib.suppress(ArenaError):  # kept in self.error for the waiters
            self._run(tensor)

    def run_here(self, tensor: torch.Tensor, workers: int = 1) -> None:
        """Finish in the caller's thread, taking over from a background thread.

        With ``workers`` > 1 the caller is joined by ``workers - 1`` threads, each taking
        the next `POPULATE_PIECE` in turn (`frontier` still grows only over finished
        pieces): a caller waiting for the pages gets the host's cores, not one of them.

        Raises:
            ArenaError: no room in /dev/shm.
        """
        self._cancel.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._cond:
            if self._closed:
                return
            self._cancel.clear()
            self.error = None
            self._next = self.frontier
            self._done.clear()
        if workers > 1:
            self._run(tensor, pieces=1)  # alone first: it learns which calls work here
        helpers = [threading.Thread(target=self._background, args=(tensor,), daemon=True,
                                    name=f"wf-populate-{k}") for k in range(1, workers)]
        for thread in helpers:
            thread.start()
        try:
            self._run(tensor)
        finally:
            for thread in helpers:
                thread.join()
        if self.error is not None:
            raise self.error

    def _run(self, tensor: torch.Tensor, pieces: int | None = None) -> None:
        """Populate the next unclaimed piece until none is left, or `pieces` of them.

        One or more threads at once: each claims the piece after the last one claimed.
        """
        try:
            while not self._cancel.is_set() and (pieces is None or pieces > 0):
                pieces = None if pieces is None else pieces - 1
                with self._cond:
                    lo = max(self._next, self.frontier)
                    if lo >= self.nbytes or self.error is not None:
                        return
                    hi = self._next = min(lo + POPULATE_PIECE, self.nbytes)
                _populate_range(self.fd, tensor, lo, hi, self.methods)
                with self._cond:
                    self._done[lo] = hi
                    while self.frontier in self._done:
                        self.frontier = self._done.pop(self.frontier)
                    self._cond.notify_all()
        except Exception as exc:
            error = exc if isinstance(exc, ArenaError) else ArenaError(
                f"populating shared memory failed: {exc}")
            with self._cond:
                self.error = self.error or error
            self._cancel.set()  # the other threads stop at their next piece
            if error is exc:
                raise
            raise error from exc
        finally:
            with self._cond:
                self._cond.notify_all()

    def wait(self, end: int, timeout: float | None) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self.frontier >= end or self.error is not None
                                or self._thread is None or not self._thread.is_alive(), timeout)
            if self.error is not None and self.frontier < end:
                raise self.error
            return self.frontier >= end

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cancel.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _release(path: Path, fd: int, owner: bool, populator: _Populator | None = None) -> None:
    """Stop populating, unlink (when owner) and drop the lock; safe to call twice."""
    if populator is not None:
        populator.stop()  # before the fd closes: it must not be reused under the thread
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
        # torch's stubs type from_file as returning _StorageBase, which set_ does not take.
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        self._populator = _Populator(fd, nbytes) if owner else None
        self._finalizer = weakref.finalize(self, _release, path, fd, owner, self._populator)

    @classmethod
    def create(cls, worker: str, nbytes: int, *, directory: Path | None = None,
               populate: bool = False) -> Region:
        """Create a zero-filled region of `nbytes` owned by this process.

        Args:
            populate: allocate and map every page before returning (see `populate`);
                by default the file is sparse and pages come with first writes.

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
            region = cls(path, nbytes, fd, owner=True)
        except BaseException:
            _release(path, fd, owner=True)
            raise
        if populate:
            try:
                region.populate()
            except BaseException:
                region.close()
                raise
        return region

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

    # --- population ------------------------------------------------------------------

    def populate(self, *, background: bool = False, workers: int | None = None) -> None:
        """Allocate and map every page, so that writes take no page faults.

        Args:
            background: do it in a thread and return at once (a second call does
                nothing); `wait_populated` follows it, `close` stops it. Without it
                the caller's thread does the rest now, taking over from a
                background thread that has not finished, with ``workers - 1`` more
                threads (default `populate_workers`: the caller is waiting).

        Raises:
            ArenaError: not the owner, closed, or no room in /dev/shm (in the
                background the error is kept: `populate_error`, `wait_populated`).
        """
        populator = self._owner_only()
        if background:
            populator.start(self.tensor, self.path.name[-8:])
        else:
            populator.run_here(self.tensor, populate_workers() if workers is None else workers)

    def populate_range(self, start: int, end: int) -> None:
        """Populate bytes [`start`, `end`) now, in the caller's thread.

        Populate bytes [`start`, `end`) now, in the caller's thread, unless `populate`
        already got past them: what a writer ahead of the background thread does before
        writing there.

        Raises:
            ArenaError: not the owner, closed, or no room in /dev/shm.
        """
        populator = self._owner_only()
        if end > populator.frontier:
            _populate_range(populator.fd, self.tensor, max(start, populator.frontier), end,
                            populator.methods, allocate=False)

    @property
    def populated_bytes(self) -> int:
        """Bytes from offset 0 that `populate` has allocated and mapped so far."""
        return self._populator.frontier if self._populator is not None else 0

    @property
    def populate_error(self) -> ArenaError | None:
        """Why a background `populate` stopped short (e.g. /dev/shm is full), or None."""
        return self._populator.error if self._populator is not None else None

    def wait_populated(self, end: int | None = None, *, timeout: float | None = None) -> bool:
        """Wait until a background `populate` has done bytes [0, `end`).

        Wait until a background `populate` has done bytes [0, `end`) (default: all),
        stopped, or `timeout` passed; return whether those bytes are populated.

        Raises:
            ArenaError: the populate failed before `end`.
        """
        if self._populator is None:
            return False
        return self._populator.wait(self.nbytes if end is None else end, timeout)

    def _owner_only(self) -> _Populator:
        if self._populator is None or self.closed:
            raise ArenaError(f"only the owner of an open region populates it ({self.path.name})")
        return self._populator

    @property
    def closed(self) -> bool:
        """Whether this mapping was closed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Drop this mapping's file handle.

        The owner also stops a background `populate` (waiting for its current piece) and
        unlinks the file.
        """
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
