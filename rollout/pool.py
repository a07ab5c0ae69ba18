"""A pool of vLLM engines that generates rollouts: engines come and go, no token is lost.

The pool runs in the trainer's process (it needs the deployment secret, as a hub does)
and owns the requests; engines (`engine`: one vLLM engine per process, here or on other
machines) own nothing but the work in flight. The pool:

- admits an engine that proves a credential allowed to read the model, serves the same
  model (its checkpoint's config) and a long enough context, and makes it take the pool's
  version from the fabric before it gets work (`launch` starts local ones);
- dispatches waiting requests longest-predicted first into free slots (`dispatch`), and
  moves running requests from a loaded engine to an idle one when the queue is empty;
- keeps every request's tokens as they stream in, with the version that made each;
  when an engine leaves (SIGTERM), dies (SIGKILL, exit) or falls silent, its requests
  continue on other engines from prompt + tokens so far (token-level migration);
- hands out finished samples in completion order (`samples`), refusing, if asked, those
  with tokens more than ``max_staleness`` versions behind (they are generated again);
- switches engines to a new version a few at a time (`update`), between their steps,
  so the pool never stops generating as a whole.

All state lives in one thread (the pool's loop, which alone uses the socket); the public
methods take the lock and leave messages for it to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from weightfabric.fabric.auth import Authority
from weightfabric.fabric.errors import (
    AuthenticationError,
    BadRequestError,
    FabricError,
    ForbiddenError,
    WaitTimeoutError,
)
from weightfabric.rollout import channel
from weightfabric.rollout.dispatch import Dispatcher, EngineLoad, LengthPredictor
from weightfabric.rollout.engine import TOKEN_ENV
from weightfabric.rollout.identity import fingerprint
from weightfabric.rollout.samples import Request, Sample

log = logging.getLogger(__name__)

LOOP_POLL_S = 0.01
RECV_BATCH = 256
REFUSED = "refused: "


class RolloutError(FabricError):
    """Base of the pool's errors."""


class NoEngineError(RolloutError):
    """Requests wait and the pool has had no engine for longer than its ``patience``."""


class EngineRefusedError(RolloutError):
    """An engine was refused: another model, too short a context, a bad credential, a name in use."""


class EngineStartError(RolloutError):
    """A launched engine exited or fell silent before it was ready (its log's tail says why)."""


@dataclass
class EngineInfo:
    """An engine as the pool sees it."""

    name: str
    state: str
    """``launched`` (process started, no hello yet), ``starting`` (admitted, vLLM loading),
    ``joining`` (taking the pool's version), ``ready``, ``updating``, ``gone``."""
    version: int
    running: int
    slots: int
    pid: int | None
    why_gone: str | None = None
    sources: dict[str, int] = field(default_factory=dict)
    """Bytes its last version switch read from each fabric worker (first rank)."""


@dataclass
class _Engine:
    name: str
    state: str = "launched"
    ident: bytes | None = None
    session: channel.Session | None = None
    version: int = 0
    slots: int = 0
    running: set[str] = field(default_factory=set)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    last_seen: float = field(default_factory=time.monotonic)
    since: float = field(default_factory=time.monotonic)
    failed_version: int = 0
    kill_at: float | None = None
    why_gone: str | None = None
    sources: dict[str, int] = field(default_factory=dict)


@dataclass
class _Req:
    request: Request
    rid: str
    predicted: float
    submitted_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[str, int]] = field(default_factory=list)
    engine: str | None = None
    attempt: int = 0
    stolen: bool = False
    migrations: int = 0
    restarts: int = 0


class Pool:
    """Engines that generate from requests and stream samples back (see the module's text).

    Args:
        hub: the fabric hub's URL (engines take their weights from it).
        model: the published model's name.
        checkpoint: the model's directory; engines must serve a model with the same
            config, and `launch` starts them from it.
        secret_file: the deployment secret (default: the fabric's usual lookup).
        bind: where engines reach the pool (``tcp://HOST:PORT``; port 0 picks one).
        max_model_len: the context every request must fit (engines with less are refused).
        predictor: output-length predictor for dispatch (default `HistoryPredictor`).
        steal: move running requests to an engine that ran out of work.
        migrate: continue a lost engine's requests from their tokens (False: start them
            again from the prompt, as systems without token-level migration do).
        max_staleness: a finished sample with a token older than ``version - max_staleness``
            is generated again instead of handed out (None: any version).
        restart_version_gap: a request whose tokens would span versions more than this
            apart starts again (None: it continues across updates).
        max_concurrent_updates: engines switching version at the same time.
        engine_timeout: seconds of silence after which a ready engine counts as lost.
        start_timeout: seconds an engine may take to become ready.
        update_timeout: seconds an engine may take to switch version.
        patience: seconds requests may wait with no engine before `samples` raises.
        log_dir: where launched engines write their logs (default: a temporary folder).
    """

    def __init__(self, hub: str, model: str = "policy", *, checkpoint: str | Path,
                 secret_file: str | Path | None = None, bind: str = "tcp://127.0.0.1:0",
                 max_model_len: int = 256, predictor: LengthPredictor | None = None,
                 steal: bool = True, migrate: bool = True, max_staleness: int | None = None,
                 restart_version_gap: int | None = None, max_concurrent_updates: int = 1,
                 engine_timeout: float = 5.0, start_timeout: float = 600.0,
                 update_timeout: float = 600.0, patience: float = 30.0,
                 log_dir: str | Path | None = None) -> None:
        for name, value in (("max_staleness", max_staleness),
                            ("restart_version_gap", restart_version_gap)):
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise BadRequestError(f"{name} must be None or an int >= 0, got {value!r}")
        if max_concurrent_updates < 1:
            raise BadRequestError("max_concurrent_updates must be >= 1")
        self.hub, self.model, self.checkpoint = hub, model, str(checkpoint)
        self.fingerprint = fingerprint(checkpoint)
        self.max_model_len = max_model_len
        self.max_staleness, self.restart_version_gap = max_staleness, restart_version_gap
        self.max_concurrent_updates = max_concurrent_updates
        self.engine_timeout, self.start_timeout = engine_timeout, start_timeout
        self.update_timeout, self.patience = update_timeout, patience
        self._authority = Authority(secret_file)
        self._dispatch = Dispatcher(predictor, steal=steal)
        self.migrate = migrate
        self._own_logs = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix="wf-rollout-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.version = 0
        self._lock = threading.RLock()
        self._engines: dict[str, _Engine] = {}
        self._by_ident: dict[bytes, str] = {}
        self._reqs: dict[str, _Req] = {}
        self._finished: queue.Queue[Sample] = queue.Queue()
        self._outbox: list[tuple[str, dict[str, Any]]] = []
        self._ids = itertools.count()
        self._cores = itertools.count()
        self._no_engine_since: float | None = time.monotonic()
        self._stats = {"useful_tokens": 0, "regenerated_tokens": 0, "migrations": 0,
                       "steals": 0, "restarts": 0, "preemptions": 0, "samples": 0,
                       "updates": 0, "update_failures": 0}
        self._error: BaseException | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(bind)
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.address = endpoint.decode()
        self._closed = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="wf-rollout-pool", daemon=True)
        self._thread.start()

    # -- engines ---------------------------------------------------------------------------
    def launch(self, n: int = 1, *, names: Sequence[str] | None = None, wait: bool = True,
               timeout: float | None = None, max_num_seqs: int = 8, dtype: str = "bfloat16",
               host: str = "127.0.0.1", checkpoint: str | Path | None = None,
               cores: int = 1, env: dict[str, str] | None = None) -> list[str]:
        """Start ``n`` engines as local processes (``python -m weightfabric.rollout.engine``).

        Each gets a read token for the model, minted from the secret, in its environment.
        On vLLM's CPU build each takes the next ``cores`` cores of this process's (vLLM
        binds its threads to them; engines sharing cores spin against each other); GPU
        builds ignore it. ``env`` adds to the engines' environment. With ``wait``,
        returns once all are ready.

        Raises:
            EngineRefusedError: the pool refused one (e.g. ``checkpoint`` is another model).
            EngineStartError: one exited or did not become ready in ``timeout`` s.
        """
        names = list(names) if names is not None else [
            f"engine-{next(self._ids)}" for _ in range(n)]
        token = self._authority.issue_token("rollout-engine", ["read"], [self.model])
        mine = sorted(os.sched_getaffinity(0))
        for name in names:
            bind = ",".join(str(mine[next(self._cores) % len(mine)]) for _ in range(cores))
            child_env = {**os.environ, TOKEN_ENV: token, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                         "VLLM_CPU_OMP_THREADS_BIND": bind, **(env or {})}
            with self._lock:
                if name in self._engines and self._engines[name].state != "gone":
                    raise BadRequestError(f"an engine named {name!r} is in the pool already")
            log_path = self.log_dir / f"{name}.log"
            argv = [sys.executable, "-m", "weightfabric.rollout.engine", "--pool", self.address,
                    "--checkpoint", str(checkpoint or self.checkpoint), "--hub", self.hub,
                    "--model", self.model, "--name", name, "--host", host,
                    "--max-model-len", str(self.max_model_len),
                    "--max-num-seqs", str(max_num_seqs), "--dtype", dtype]
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=child_env,
                                        start_new_session=True)
            with self._lock:
                self._engines[name] = _Engine(name=name, proc=proc, log_path=log_path)
        if wait:
            self.wait_ready(names, timeout=timeout)
        return names

    def wait_ready(self, names: Sequence[str], timeout: float | None = None) -> None:
        """Wait until these engines are ready.

        Raises:
            EngineRefusedError, EngineStartError: as `launch`.
        """
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        while True:
            self._raise_if_broken()
            with self._lock:
                pending = []
                for name in names:
                    e = self._engines.get(name)
                    if e is None:
                        pending.append(name)
                    elif e.state == "gone":
                        why = e.why_gone or ""
                        if why.startswith(REFUSED):
                            raise EngineRefusedError(f"engine {name!r}: {why[len(REFUSED):]}")
                        raise EngineStartError(f"engine {name!r} is gone ({e.why_gone}) "
                                               f"before it was ready{self._tail(e)}")
                    elif e.state not in ("ready", "updating"):
                        pending.append(name)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise EngineStartError(f"engines {pending} not ready in time")
            time.sleep(0.05)

    def preempt(self, name: str, grace: float | None = None) -> None:
        """Take a launched engine away, as a cloud reclaims a preemptible instance.

        ``grace=None``: SIGKILL now (its process group, vLLM included). Else SIGTERM (the
        engine tells the pool and exits) and SIGKILL after ``grace`` seconds.
        """
        with self._lock:
            e = self._engine(name)
            if e.proc is None:
                raise BadRequestError(f"engine {name!r} was not launched by this pool")
            if e.state == "gone":
                return
            self._stats["preemptions"] += 1
            if grace is None:
                _killpg(e.proc, signal.SIGKILL)
            else:
                _killpg(e.proc, signal.SIGTERM)
                e.kill_at = time.monotonic() + grace

    def engines(self) -> list[EngineInfo]:
        """Every engine the pool knows, gone ones included."""
        with self._lock:
            return [EngineInfo(e.name, e.state, e.version, len(e.running), e.slots,
                               e.proc.pid if e.proc else None, e.why_gone, dict(e.sources))
                    for e in self._engines.values()]

    # -- requests ---------------------------------------------------------------------------
    def submit(self, requests: Request | Sequence[Request]) -> list[str]:
        """Queue requests; their ids (a request's ``rid``, or one the pool gives).

        Raises:
            BadRequestError: a malformed request, one longer than ``max_model_len``, or an
                id in use; then none of them is queued.
        """
        batch = [requests] if isinstance(requests, Request) else list(requests)
        with self._lock:
            rids = []
            for r in batch:
                r.check(self.max_model_len)
                rid = r.rid if r.rid is not None else f"r{next(self._ids)}"
                if rid in self._reqs or rid in rids:
                    raise BadRequestError(f"request id {rid!r} is in use")
                rids.append(rid)
            now = time.monotonic()
            for r, rid in zip(batch, rids, strict=True):
                predicted = self._dispatch.add(rid, r.prompt, r.max_tokens, r.group)
                self._reqs[rid] = _Req(r, rid, predicted, now)
            return rids

    def running(self) -> dict[str, tuple[str, int]]:
        """Requests on an engine now: ``rid -> (engine, tokens so far)``."""
        with self._lock:
            return {r.rid: (r.engine, len(r.tokens)) for r in self._reqs.values()
                    if r.engine is not None}

    def partial(self, rid: str) -> list[int]:
        """The tokens a pending request has so far (a copy).

        Raises:
            BadRequestError: no such pending request.
        """
        with self._lock:
            req = self._reqs.get(rid)
            if req is None:
                raise BadRequestError(f"no pending request {rid!r}")
            return list(req.tokens)

    def pending(self) -> int:
        """Requests submitted and not yet handed out as samples."""
        with self._lock:
            return len(self._reqs)

    def samples(self, count: int | None = None, timeout: float | None = None
                ) -> Iterator[Sample]:
        """Finished samples in the order they finish.

        Args:
            count: stop after this many (None: when nothing is pending).
            timeout: seconds for all of them.

        Raises:
            WaitTimeoutError: ``timeout`` passed first.
            NoEngineError: requests wait and no engine was in the pool for ``patience`` s.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        got = 0
        while count is None or got < count:
            try:
                sample = self._finished.get(timeout=0.05)
            except queue.Empty:
                self._raise_if_broken()
                with self._lock:
                    if count is None and not self._reqs:
                        return
                    waiting = bool(self._reqs)
                    since = self._no_engine_since
                if waiting and since is not None and time.monotonic() - since > self.patience:
                    raise NoEngineError(f"{len(self._reqs)} requests wait and the pool has "
                                        f"had no engine for {self.patience:g} s") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeoutError(f"{got} of {count if count is not None else 'all'} "
                                           f"samples in {timeout:g} s") from None
                continue
            got += 1
            yield sample

    async def asamples(self, count: int | None = None, timeout: float | None = None
                       ) -> AsyncIterator[Sample]:
        """`samples` for an asyncio loop (the waiting runs on a worker thread)."""
        it = self.samples(count, timeout)
        done = object()
        while True:
            sample = await asyncio.to_thread(next, it, done)
            if sample is done:
                return
            assert isinstance(sample, Sample)
            yield sample

    def cancel(self, rid: str) -> bool:
        """Forget a request (waiting or running); False if it is not pending."""
        with self._lock:
            req = self._reqs.pop(rid, None)
            if req is None:
                return False
            if not self._dispatch.remove(rid) and req.engine is not None:
                self._abort(req)
            return True

    # -- versions ---------------------------------------------------------------------------
    def update(self, version: int) -> None:
        """Make ``version`` the pool's; engines switch to it a few at a time.

        ``max_concurrent_updates`` engines at a time, each between two of its steps; new
        engines start on it.

        Raises:
            BadRequestError: not an int > the pool's version.
        """
        if not (isinstance(version, int) and version > 0):
            raise BadRequestError(f"version must be an int > 0, got {version!r}")
        with self._lock:
            if version < self.version:
                raise BadRequestError(f"version {version} is older than the pool's "
                                      f"({self.version})")
            self.version = version

    def wait_version(self, version: int | None = None, timeout: float = 600.0) -> None:
        """Wait until every engine that generates serves ``version`` (default the pool's).

        Engines still starting are not waited for: they take the pool's version before
        they generate. With none generating, this waits for one.

        Raises:
            WaitTimeoutError: not in time; RolloutError: an engine failed to switch.
        """
        target = self.version if version is None else version
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_broken()
            with self._lock:
                live = [e for e in self._engines.values() if e.state in ("ready", "updating")]
                failed = [e.name for e in live if e.failed_version >= target]
                if failed:
                    raise RolloutError(f"engines {failed} could not switch to version {target}")
                if live and all(e.version >= target for e in live):
                    return
            if time.monotonic() > deadline:
                raise WaitTimeoutError(f"engines did not all serve version {target} in "
                                       f"{timeout:g} s")
            time.sleep(0.05)

    def stats(self) -> dict[str, int]:
        """The pool's counters.

        ``useful_tokens`` (in samples handed out), ``regenerated_tokens`` (generated and
        thrown away: lost with an engine, restarted, stale), ``migrations``, ``steals``,
        ``restarts``, ``preemptions``, ``samples``, ``updates``, ``update_failures``.
        """
        with self._lock:
            return dict(self._stats)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop every engine, the loop and the socket; remove the logs the pool made.

        Launched engines that do not exit within ``timeout`` s are killed.
        """
        if self._closed.is_set():
            return
        with self._lock:
            self._closing = True
            for e in self._engines.values():
                if e.state != "gone" and e.session is not None:
                    self._outbox.append((e.name, {"op": "stop"}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._outbox:
                    break
            time.sleep(0.02)
        procs = [e.proc for e in self._engines.values() if e.proc is not None]
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                _killpg(p, signal.SIGKILL)
                p.wait(30)
        self._closed.set()
        self._thread.join(10)
        self._sock.close()
        self._ctx.term()
        if procs:
            _remove_stale_regions()
        if self._own_logs:
            for path in self.log_dir.glob("*"):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.log_dir.rmdir()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                # what has arrived (at most a batch: engines stream without pause), then
                # the housekeeping that dispatches and sends
                if self._sock.poll(int(LOOP_POLL_S * 1000)):
                    for _ in range(RECV_BATCH):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        with self._lock:
                            self._receive(frames[0], frames[1:])
                with self._lock:
                    self._watch()
                    self._schedule_updates()
                    self._assign()
                    self._flush()
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller by _raise_if_broken
            log.exception("the rollout pool's loop failed")
            self._error = exc

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise RolloutError(f"the pool's loop failed: {self._error!r}") from self._error

    def _receive(self, ident: bytes, frames: list[bytes]) -> None:
        name = self._by_ident.get(ident)
        if name is None:
            self._hello(ident, frames)
            return
        e = self._engines[name]
        if e.state == "gone" or e.session is None:
            return
        try:
            message = e.session.open(frames)
        except AuthenticationError as exc:
            log.warning("engine %s: %s; message dropped", name, exc)
            return
        e.last_seen = time.monotonic()
        op = message.get("op")
        if op == "tokens":
            self._tokens(e, int(message["version"]), message["out"])
        elif op == "ready":           # vLLM is up: take the pool's version before any work
            e.version = int(message["version"])
            self._join(e)
        elif op == "updated":
            e.state, e.version = "ready", int(message["version"])
            e.sources = dict(message.get("sources") or {})
            self._stats["updates"] += 1
        elif op == "update_failed":
            e.failed_version = int(message["version"])
            self._stats["update_failures"] += 1
            log.warning("engine %s could not switch to version %s: %s", name,
                        message["version"], message.get("error"))
            if e.state == "joining":
                self._join(e)
            else:
                e.state = "ready"
        elif op == "refused":
            req = self._reqs.get(message["rid"])
            if req is not None and req.attempt == message["attempt"] and req.engine == name:
                self._reqs.pop(req.rid)
                e.running.discard(req.rid)
                self._emit(req, f"error: {message.get('error')}")
        elif op == "leaving":
            self._lose(e, "left (SIGTERM)")

    def _hello(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            info, key, mac = channel.accept(self._authority, frames, self.model)
        except (AuthenticationError, ForbiddenError) as exc:
            log.warning("a hello refused: %s", exc)
            self._sock.send_multipart([ident, b"refused", str(exc).encode()])
            return
        name = str(info.get("name"))
        why = None
        e = self._engines.get(name)
        if info.get("model") != self.model:
            why = f"it serves fabric model {info.get('model')!r}, the pool {self.model!r}"
        elif info.get("fingerprint") != self.fingerprint:
            why = (f"its checkpoint is another model (config {info.get('fingerprint')}, the "
                   f"pool's {self.fingerprint} from {self.checkpoint})")
        elif int(info.get("max_model_len", 0)) < self.max_model_len:
            why = (f"its context ({info.get('max_model_len')}) is shorter than the pool's "
                   f"max_model_len ({self.max_model_len})")
        elif e is not None and e.state not in ("launched", "gone"):
            why = f"an engine named {name!r} is in the pool already"
        if why is not None:
            frames_out, _ = channel.welcome(key, mac, {"ok": False, "error": why})
            self._sock.send_multipart([ident, *frames_out])
            if e is not None and e.state == "launched":
                self._gone(e, REFUSED + why)
            log.warning("engine %s refused: %s", name, why)
            return
        frames_out, nonce = channel.welcome(key, mac, {"ok": True})
        self._sock.send_multipart([ident, *frames_out])
        if e is None or e.state == "gone":
            e = _Engine(name=name)
            self._engines[name] = e
        e.ident, e.session = ident, channel.Session(key, nonce, channel.TO_ENGINE)
        e.state, e.slots = "starting", int(info.get("slots", 1))
        e.last_seen = e.since = time.monotonic()
        self._by_ident[ident] = name
        self._no_engine_since = None

    def _join(self, e: _Engine) -> None:
        """A started engine: ready if it serves the pool's version, else it switches first.

        The version is the pool's when the engine's vLLM is up (not at its hello: start-up
        takes long enough for that one to be retired); a joining engine's switch is not
        staggered with the others'. One that cannot switch to the pool's version is let go.
        """
        if e.version >= self.version:
            e.state = "ready"
        elif e.failed_version >= self.version:
            if e.session is not None and e.ident is not None:
                self._sock.send_multipart([e.ident, *e.session.seal({"op": "stop"})])
            self._lose(e, f"could not take version {self.version}")
        else:
            e.state = "joining"
            e.last_seen = time.monotonic()
            self._outbox.append((e.name, {"op": "update", "version": self.version}))

    def _tokens(self, e: _Engine, version: int, out: list[Any]) -> None:
        for rid, attempt, toks, lps, reason in out:
            req = self._reqs.get(rid)
            if req is None or req.attempt != attempt or req.engine != e.name:
                self._stats["regenerated_tokens"] += len(toks)   # aborted or stolen meanwhile
                continue
            gap = self.restart_version_gap
            if gap is not None and req.versions and version - min(req.versions) > gap:
                self._stats["regenerated_tokens"] += len(toks)
                self._restart(req)
                continue
            req.tokens.extend(toks)
            req.logprobs.extend(lps)
            req.versions.extend([version] * len(toks))
            if reason is not None:
                e.running.discard(rid)
                req.engine = None
                self._finish(req, str(reason))

    def _finish(self, req: _Req, reason: str) -> None:
        bound = self.max_staleness
        if bound is not None and req.versions and min(req.versions) < self.version - bound:
            self._restart(req)
            return
        self._reqs.pop(req.rid)
        self._dispatch.observe(req.request.prompt, req.request.group, len(req.tokens),
                               req.request.max_tokens)
        self._stats["useful_tokens"] += len(req.tokens)
        self._emit(req, reason)

    def _emit(self, req: _Req, reason: str) -> None:
        r = req.request
        self._stats["samples"] += 1
        self._finished.put(Sample(
            rid=req.rid, prompt=list(r.prompt), tokens=req.tokens, logprobs=req.logprobs,
            versions=req.versions, spans=req.spans, finish_reason=reason, group=r.group,
            migrations=req.migrations, restarts=req.restarts, submitted_at=req.submitted_at,
            finished_at=time.monotonic()))

    def _restart(self, req: _Req) -> None:
        """Throw the request's tokens away and queue it again from its prompt."""
        if req.engine is not None:
            self._abort(req)
        self._stats["regenerated_tokens"] += len(req.tokens)
        self._stats["restarts"] += 1
        req.restarts += 1
        req.tokens, req.logprobs, req.versions, req.spans = [], [], [], []
        r = req.request
        self._dispatch.add(req.rid, r.prompt, r.max_tokens, r.group, front=True)

    def _abort(self, req: _Req) -> None:
        e = self._engines.get(req.engine or "")
        if e is not None:
            e.running.discard(req.rid)
            if e.state != "gone":
                self._outbox.append((e.name, {"op": "abort", "ids": [[req.rid, req.attempt]]}))
        req.engine = None

    def _lose(self, e: _Engine, why: str) -> None:
        """The engine is gone: its requests continue elsewhere from their tokens."""
        for rid in sorted(e.running):
            req = self._reqs.get(rid)
            if req is None:
                continue
            req.engine = None
            if req.tokens and not self.migrate:
                self._restart(req)
                continue
            if req.tokens:
                req.migrations += 1
                self._stats["migrations"] += 1
            r = req.request
            self._dispatch.add(rid, r.prompt, r.max_tokens, r.group,
                               generated=len(req.tokens), front=True)
        e.running.clear()
        self._gone(e, why)

    def _gone(self, e: _Engine, why: str) -> None:
        e.state, e.why_gone = "gone", why
        if e.ident is not None:
            self._by_ident.pop(e.ident, None)
        if e.proc is not None and e.proc.poll() is None:
            _killpg(e.proc, signal.SIGKILL)
        if e.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                e.proc.wait(5)
            _remove_stale_regions()   # the fabric regions a killed engine could not remove
        if not any(x.state != "gone" for x in self._engines.values()):
            self._no_engine_since = time.monotonic()
        log.info("engine %s gone: %s", e.name, why)

    def _watch(self) -> None:
        now = time.monotonic()
        for e in list(self._engines.values()):
            if e.state == "gone":
                continue
            if e.proc is not None and e.kill_at is not None and now > e.kill_at:
                _killpg(e.proc, signal.SIGKILL)
            if e.proc is not None and e.proc.poll() is not None:
                self._lose(e, f"exited with status {e.proc.returncode}")
            elif self._closing:
                continue   # stopping: engines go quiet while vLLM shuts down
            elif e.state == "launched" and now - e.since > self.start_timeout:
                self._lose(e, f"no hello in {self.start_timeout:g} s")
            elif e.state == "starting" and now - e.since > self.start_timeout:
                self._lose(e, f"not ready in {self.start_timeout:g} s")
            elif (e.state in ("updating", "joining")
                  and now - e.last_seen > self.update_timeout):
                self._lose(e, f"silent for {self.update_timeout:g} s while updating")
            elif e.state == "ready" and now - e.last_seen > self.engine_timeout:
                self._lose(e, f"silent for {self.engine_timeout:g} s")

    def _schedule_updates(self) -> None:
        if not self.version:
            return
        live = [e for e in self._engines.values() if e.state in ("ready", "updating")]
        busy = sum(e.state == "updating" for e in live)
        behind = sorted((e for e in live if e.state == "ready" and e.version < self.version
                         and e.failed_version < self.version),
                        key=lambda e: (len(e.running), e.name))
        for e in behind[:max(0, self.max_concurrent_updates - busy)]:
            e.state = "updating"
            e.last_seen = time.monotonic()
            self._outbox.append((e.name, {"op": "update", "version": self.version}))

    def _loads(self) -> list[EngineLoad]:
        loads = []
        for e in self._engines.values():
            if e.state not in ("ready", "updating"):
                continue
            running = {rid: max(1.0, self._reqs[rid].predicted - len(self._reqs[rid].tokens))
                       for rid in e.running if rid in self._reqs}
            settled = frozenset(rid for rid in running if self._reqs[rid].stolen)
            loads.append(EngineLoad(e.name, max(0, e.slots - len(e.running)), running,
                                    accepting=e.state == "ready", settled=settled))
        return loads

    def _assign(self) -> None:
        for rid, name in self._dispatch.assign(self._loads()):
            self._start(self._reqs[rid], name)
        for rid, src, dst in self._dispatch.steal(self._loads()):
            req = self._reqs[rid]
            if req.engine != src:
                continue
            self._abort(req)
            self._stats["steals"] += 1
            req.migrations += 1
            req.stolen = True   # moves once at most: loads shift, requests must not bounce
            self._start(req, dst)

    def _start(self, req: _Req, name: str) -> None:
        r = req.request
        if len(req.tokens) >= r.max_tokens:   # its engine died after the last token
            self._finish(req, "length")
            return
        e = self._engines[name]
        req.attempt += 1
        req.engine = name
        req.spans.append((name, len(req.tokens)))
        e.running.add(req.rid)
        self._outbox.append((name, {"op": "add", "reqs": [[
            req.rid, req.attempt, [*r.prompt, *req.tokens], r.max_tokens - len(req.tokens),
            r.sampling()]]}))

    def _flush(self) -> None:
        for name, message in self._outbox:
            e = self._engines.get(name)
            if e is None or e.session is None or e.ident is None or e.state == "gone":
                continue
            self._sock.send_multipart([e.ident, *e.session.seal(message)])
        self._outbox.clear()

    def _engine(self, name: str) -> _Engine:
        e = self._engines.get(name)
        if e is None:
            raise BadRequestError(f"no engine named {name!r} in the pool")
        return e

    @staticmethod
    def _tail(e: _Engine, lines: int = 15) -> str:
        if e.log_path is None or not e.log_path.exists():
            return ""
        text = e.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "; its log ends:\n" + "\n".join(text)


def _remove_stale_regions() -> None:
    from weightfabric.fabric.arena import remove_stale_regions  # imports torch

    remove_stale_regions()


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


__all__ = ["EngineInfo", "EngineRefusedError", "EngineStartError", "NoEngineError", "Pool",
           "RolloutError"]
