"""The pool's own behaviour, with scripted engines (the real protocol, no vLLM).

Engines here are `scripted_engine.py` processes started by the test, as engines on other
machines would be (the pool did not launch them: it learns of a death by silence). Their
tokens are a function of everything before them, so every sample's tokens are known
whatever migrated where: the pool's bookkeeping is checked exactly, fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SECRET_FILE
from scripted_engine import expected
from timeouts import hard_timeout

from weightfabric import rollout
from weightfabric.fabric.auth import Authority
from weightfabric.rollout.engine import TOKEN_ENV

ENGINE = Path(__file__).with_name("scripted_engine.py")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    return tmp_path


class Engines:
    """Scripted engine processes; all killed at the end."""

    def __init__(self, pool: rollout.Pool, checkpoint: Path) -> None:
        self.pool, self.checkpoint = pool, checkpoint
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *, token: str | None = None, model: str = "policy",
              wait: bool = True, **options: float) -> subprocess.Popen[bytes]:
        token = token or Authority(SECRET_FILE).issue_token(name, ["read"], ["policy"])
        argv = [sys.executable, str(ENGINE), "--pool", self.pool.address, "--hub", "unused",
                "--checkpoint", str(self.checkpoint), "--name", name, "--model", model,
                "--max-model-len", "256", "--max-num-seqs", "4", "--heartbeat", "0.1"]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: token},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(proc)
        if wait:
            self.pool.wait_ready([name], timeout=30)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(10)


@pytest.fixture
def rig(checkpoint: Path) -> Iterator[tuple[rollout.Pool, Engines]]:
    pool = rollout.Pool("tcp://127.0.0.1:1", "policy", checkpoint=checkpoint,
                        engine_timeout=1.0, patience=10.0)
    engines = Engines(pool, checkpoint)
    try:
        with hard_timeout(60):
            yield pool, engines
    finally:
        engines.close()
        pool.close()


def asked(n: int, length: int, base: int = 0, **kw: Any) -> list[rollout.Request]:
    return [rollout.Request([base + i + 1, 5, 9], max_tokens=length, rid=f"q{base + i}", **kw)
            for i in range(n)]


def two_generating_on(pool: rollout.Pool, engine: str) -> None:
    """Wait until two requests on ``engine`` have more than 5 tokens each."""
    deadline = time.monotonic() + 20
    while sum(e == engine and n > 5 for e, n in pool.running().values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_silent_engine_is_lost_and_its_requests_end_as_if_nothing_happened(rig):
    pool, engines = rig
    frozen = engines.start("a", step_s=0.01)
    engines.start("b", step_s=0.01)
    reqs = asked(8, 120)
    pool.submit(reqs)
    two_generating_on(pool, "a")
    frozen.send_signal(signal.SIGSTOP)       # a machine gone quiet: no exit, no notice
    got = {s.rid: s for s in pool.samples(count=len(reqs), timeout=30)}
    frozen.send_signal(signal.SIGCONT)        # its late tokens are not taken
    for r in reqs:
        assert got[r.rid].tokens == expected(list(r.prompt), r.max_tokens)
    moved = [s for s in got.values() if s.spans[0][0] == "a"]
    assert moved and all(s.spans[-1][0] == "b" and s.migrations == 1 for s in moved)
    gone = {e.name: e for e in pool.engines()}["a"]
    assert gone.state == "gone" and "silent" in (gone.why_gone or "")
    assert pool.stats()["migrations"] == len(moved)


def test_updates_go_one_engine_at_a_time_while_the_others_generate(rig):
    pool, engines = rig
    for name in ("a", "b", "c"):
        engines.start(name, step_s=0.01, update_s=0.5)
    pool.submit(asked(9, 150))
    time.sleep(0.2)
    pool.update(2)
    most_updating, grew_while_updating = 0, False
    last = sum(n for _, n in pool.running().values())
    while any(e.version < 2 for e in pool.engines()):
        states = [e.state for e in pool.engines()]
        most_updating = max(most_updating, states.count("updating"))
        now = sum(n for _, n in pool.running().values())
        grew_while_updating |= "updating" in states and now > last
        last = now
        time.sleep(0.02)
    assert most_updating == 1 and grew_while_updating
    got = list(pool.samples(timeout=30))
    assert len(got) == 9 and all(set(s.versions) <= {0, 2} for s in got)
    assert any(2 in s.versions and 0 in s.versions for s in got)  # switched mid-response


def test_a_version_gap_policy_restarts_and_a_staleness_bound_regenerates(rig):
    pool, engines = rig
    engines.start("a", step_s=0.01, update_s=0.1)
    pool.restart_version_gap = 0
    reqs = asked(4, 100)
    pool.submit(reqs)
    time.sleep(0.3)
    pool.update(3)
    got = list(pool.samples(timeout=30))
    assert all(s.versions == [3] * 100 for s in got)           # one version each
    assert sum(s.restarts for s in got) > 0 and pool.stats()["regenerated_tokens"] > 0
    for s in got:
        assert s.tokens == expected(s.prompt, 100)
    pool.restart_version_gap, pool.max_staleness = None, 0
    pool.submit(asked(2, 60, base=10))
    time.sleep(0.2)
    pool.update(4)
    again = list(pool.samples(timeout=30))
    assert all(s.oldest_version == 4 for s in again)


def test_samples_come_in_completion_order_also_for_asyncio(rig):
    pool, engines = rig
    engines.start("a", step_s=0.005)
    lengths = [40, 5, 30, 10, 20]
    pool.submit([rollout.Request([i + 1], max_tokens=n, rid=f"n{n}")
                 for i, n in enumerate(lengths)])

    async def collect() -> list[rollout.Sample]:
        return [s async for s in pool.asamples(timeout=30)]

    got = asyncio.run(collect())
    # the four longest fill the engine's four slots; the 5-token one waits for the first
    # free slot (the 10-token one's) and still ends before the 20-token one
    assert [len(s.tokens) for s in got] == [10, 5, 20, 30, 40]
    assert [s.finished_at for s in got] == sorted(s.finished_at for s in got)


def test_engines_are_admitted_by_credential_model_and_name(rig, tmp_path):
    pool, engines = rig
    engines.start("a")
    twin = engines.start("a", wait=False)                        # a name in use
    expired = Authority(SECRET_FILE).issue_token("x", ["read"], ttl=0.01)
    time.sleep(0.05)
    late = engines.start("x", token=expired, wait=False)
    stranger_secret = tmp_path / "stranger"
    stranger_secret.write_text("ab" * 32)
    stranger_secret.chmod(0o600)
    stranger = engines.start(
        "s", token=Authority(stranger_secret).issue_token("s", ["read"]), wait=False)
    wrong_model = engines.start("m", model="other", wait=False)
    for proc, why in ((twin, "in the pool already"), (late, "expired"),
                      (stranger, "signature"), (wrong_model, "fabric model")):
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 3 and why in err.decode(), err.decode()[-500:]
    assert [e.name for e in pool.engines() if e.state == "ready"] == ["a"]


def test_without_migration_a_lost_engines_requests_start_over(rig):
    pool, engines = rig
    pool.migrate = False
    doomed = engines.start("a", step_s=0.01)
    engines.start("b", step_s=0.01)
    reqs = asked(8, 80)
    pool.submit(reqs)
    two_generating_on(pool, "a")
    doomed.kill()
    got = {s.rid: s for s in pool.samples(count=len(reqs), timeout=30)}
    restarted = [s for s in got.values() if s.restarts]
    assert restarted and all(s.migrations == 0 and s.spans == [("b", 0)] for s in restarted)
    for r in reqs:
        assert got[r.rid].tokens == expected(list(r.prompt), r.max_tokens)
    stats = pool.stats()
    assert stats["migrations"] == 0 and stats["restarts"] == len(restarted)
    assert stats["regenerated_tokens"] >= 6 * len(restarted)
