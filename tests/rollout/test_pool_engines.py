"""A rollout pool of real vLLM engines (CPU build) on the fabric.

One pool for the module: a hub, a trainer publishing a tiny random llama (bf16) through
the fabric, two engines launched by the pool (each in its own process, on its own core).
In order: samples stream in completion order and a weight update mid-run keeps the
staleness bound; an engine SIGKILLed mid-generation loses no request, its requests keep
their tokens exactly and continue as an engine run alone on prompt + kept tokens would;
a new engine joins after the trainer left, takes the version (in vLLM's layout) from the
engines and gets work, and a SIGTERM (preemption notice) moves another engine's requests
to it. Bad input: another model, too long a request, a pool without engines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from timeouts import hard_timeout
from vllm_helpers import hf_model, save_bf16, train_step

import weightfabric as wf
from weightfabric import rollout
from weightfabric.fabric.arena import PREFIX, SHM_DIR

MAX_LEN = 128


class Rig:
    """The module's hub, trainer, pool and model."""

    def __init__(self, hub: Any, trainer: Any, pool: rollout.Pool, model: torch.nn.Module,
                 tmp: Path) -> None:
        self.hub, self.trainer, self.pool, self.model, self.tmp = hub, trainer, pool, model, tmp
        self.store = trainer.model("policy")

    def publish(self, seed: int) -> int:
        """A training step and its version, published and made the pool's."""
        train_step(self.model, seed=seed)
        version = self.store.publish(self.model, dtype=torch.bfloat16)
        self.pool.update(version)
        return version


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("rollout")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    shm_before = set(SHM_DIR.glob(f"{PREFIX}-*"))
    hub = wf.serve("tcp://127.0.0.1:0")
    model = hf_model("llama", seed=0)
    checkpoint = save_bf16(model, tmp / "v0")
    trainer = wf.join(hub.url, worker="trainer")
    pool = rollout.Pool(hub.url, "policy", checkpoint=checkpoint, max_model_len=MAX_LEN,
                        engine_timeout=10.0, patience=60.0)
    try:
        with hard_timeout(300):
            r = Rig(hub, trainer, pool, model, tmp)
            r.publish(seed=1)
            pool.launch(2, names=["a", "b"], max_num_seqs=4)
        yield r
    finally:
        pool.close()
        trainer.close()
        hub.stop()
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        assert not left, f"processes left behind: {left}"
        assert set(SHM_DIR.glob(f"{PREFIX}-*")) <= shm_before


def requests(n: int, base: int, lengths: list[int]) -> list[rollout.Request]:
    """``n`` greedy requests with distinct prompts, output lengths cycling ``lengths``."""
    return [rollout.Request([base + i, 7, 11, 13 + i], max_tokens=lengths[i % len(lengths)],
                            ignore_eos=True, logprobs=True, group=f"g{i % 3}")
            for i in range(n)]


def alone(pool: rollout.Pool, prompt: list[int], max_tokens: int) -> list[int]:
    """What an engine of the pool generates (greedy) for ``prompt`` with nothing else running."""
    (rid,) = pool.submit(rollout.Request(prompt, max_tokens=max_tokens, ignore_eos=True))
    (sample,) = list(pool.samples(count=1, timeout=60))
    assert sample.rid == rid
    return sample.tokens


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_samples_stream_in_completion_order_and_an_update_keeps_the_staleness_bound(rig):
    pool = rig.pool
    v_before = pool.version
    with hard_timeout(180):
        rids = pool.submit(requests(10, 100, [90, 8, 60, 20, 100]))
        stream = pool.samples(count=len(rids), timeout=150)
        first = next(stream)
        assert len(first.tokens) <= 20     # a short one, though the long ones went first
        pool.max_staleness = 0
        v_new = rig.publish(seed=2)
        switched = time.monotonic()
        got = [first, *stream]
        pool.wait_version(v_new, timeout=120)
    pool.max_staleness = None
    assert sorted(s.rid for s in got) == sorted(rids)
    finished = [s.finished_at for s in got]
    assert finished == sorted(finished)               # handed out as they finished
    for s in got:
        assert len(s.tokens) == len(s.versions) == len(s.logprobs)
        assert set(s.versions) <= {v_before, v_new}
        if s.finished_at > switched:                 # finished after the update: no old token
            assert min(s.versions) == v_new, (s.rid, s.versions)
    assert all(e.version == v_new for e in pool.engines() if e.state != "gone")


def test_a_killed_engine_loses_nothing_and_its_requests_continue_from_their_tokens(rig):
    pool = rig.pool
    with hard_timeout(180):
        rids = pool.submit(requests(8, 200, [70, 90, 50, 100]))
        wait_until(lambda: sum(e == "a" and n >= 4 for e, n in pool.running().values()) >= 2,
                   60, "engine a to have tokens")
        kept = {rid: pool.partial(rid) for rid, (e, _) in pool.running().items() if e == "a"}
        pool.preempt("a")                                    # SIGKILL, no notice
        got = {s.rid: s for s in pool.samples(count=len(rids), timeout=150)}
        assert sorted(got) == sorted(rids)
        assert {e.name: e.state for e in pool.engines()}["a"] == "gone"
        migrated = [s for s in got.values() if len(s.spans) > 1]
        stats = pool.stats()
        assert migrated and stats["migrations"] + stats["steals"] >= len(migrated)
        for rid, tokens in kept.items():
            s = got[rid]
            assert s.tokens[:len(tokens)] == tokens            # what it had, kept exactly
            assert s.spans[0][0] == "a" and s.spans[-1][0] == "b"
        for s in migrated:       # killed, or moved to an idle engine before (work stealing)
            cut = s.spans[-1][1]
            assert s.tokens[cut:] == alone(pool, s.prompt + s.tokens[:cut],
                                           len(s.tokens) - cut), s.rid


def test_a_new_engine_takes_the_version_from_its_peers_and_takes_over_from_a_leaving_one(rig):
    pool = rig.pool
    with hard_timeout(240):
        rig.trainer.close()          # the published tensors' only holder leaves
        (name,) = pool.launch(1, names=["c"], max_num_seqs=4)
        info = {e.name: e for e in pool.engines()}
        assert info["c"].state == "ready" and info["c"].version == pool.version
        # vLLM's layout of the version is held by engine b alone: c copies it from b
        assert info["c"].sources and set(info["c"].sources) <= {"b-rank0"}, info["c"].sources
        asked = requests(8, 300, [60, 80])
        rids = pool.submit(asked)
        wait_until(lambda: {e for e, n in pool.running().values() if n >= 3} == {"b", "c"},
                   60, "both engines to generate")
        pool.preempt("b", grace=10.0)                    # SIGTERM: b says it leaves
        got = {s.rid: s for s in pool.samples(count=len(rids), timeout=150)}
    assert sorted(got) == sorted(rids)
    assert {e.name: e for e in pool.engines()}["b"].why_gone == "left (SIGTERM)"
    assert any(s.spans[-1][0] == "c" and len(s.spans) > 1 for s in got.values())
    assert [len(got[r].tokens) for r in rids] == [q.max_tokens for q in asked]


def test_bad_input_is_refused_and_nothing_is_lost(rig, tmp_path):
    pool = rig.pool
    with hard_timeout(120):
        other = save_bf16(hf_model("llama", seed=0, intermediate_size=384), tmp_path / "other")
        with pytest.raises(rollout.EngineRefusedError, match="another model"):
            pool.launch(1, names=["wrong"], checkpoint=other, timeout=60)
        with pytest.raises(wf.BadRequestError, match="context"):
            pool.submit(rollout.Request([1, 2, 3], max_tokens=MAX_LEN))
        with pytest.raises(wf.BadRequestError, match="prompt"):
            pool.submit(rollout.Request([], max_tokens=4))
        rids = pool.submit(requests(3, 400, [10]))
        assert sorted(s.rid for s in pool.samples(timeout=60)) == sorted(rids)


def test_a_pool_without_engines_says_so(tmp_path):
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llama"}')
    with rollout.Pool("tcp://127.0.0.1:1", "policy", checkpoint=checkpoint, patience=0.5) as pool:
        pool.submit(rollout.Request([1, 2], max_tokens=4))
        with hard_timeout(30), pytest.raises(rollout.NoEngineError, match="no engine"):
            list(pool.samples(timeout=20))
