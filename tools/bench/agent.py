"""A benchmark child process: a hub or a fabric worker, driven by JSON lines.

Run as ``python -m weightfabric.tools.bench.agent`` (the benchmarks start it through
`tools.bench.launch`, possibly inside a network namespace). It prints
``{"ready": true}``, then answers each command line with one JSON line:

- ``{"op": "hub", "host": H, "port": P, "ranking": "locality" | "origin" | "ranked" |
  "plan", "cluster": YAML, "start_bound_s": S}`` -> ``{"url": U}``: serve a hub in this
  process. ``origin`` ranks only the worker named ``trainer`` (or ``"origin": NAME``) as a source (every
  reader pulls from the trainer); ``ranked`` ranks sources by widest path on the
  ``cluster``; ``plan`` routes along each version's planned forest on it
  (`fabric.hub.planned`).
- ``{"op": "plans"}`` -> ``{"plans": [...]}``: the hub's broadcast plans (`PlanRouter.summary`).
- ``{"op": "join", "url", "name", "location", "host", "chunk_size", "device", "attach",
  "keep_last", "prepare_spare"}`` -> ``{}``: join, and open the model's store on ``device`` (default
  ``cpu``; ``prepare_spare`` as `Worker.model`'s); with ``attach: N``, attach
  `bench_tensors(N, 0)` to it, as a rollout attaches its model; with ``keep_last``,
  set the model's retention.
- ``{"op": "settle", "wait": bool}`` -> ``{}``: wait until the store's buffers prepared in
  the background are populated (start-up done); memory peaks count from here.
  ``"wait": false``: only count memory peaks from here (a cold start waits for nothing).
- ``{"op": "publish", "size": N, "seed": S, "inplace": bool, "lr": L}`` -> ``{"version",
  "bytes", "tensor_bytes", "changed_fraction", "start", "end"}`` (wall clock of the publish;
  on a GPU both ends after a device synchronize):
  publish `bench_tensors(N, S)` (snapshot); each later publish first adds 1 to
  every byte, so versions differ without generating them again. With ``lr``, the
  tensors are `trained_tensors` instead, and each later publish is one step of
  `TrainingSteps` (fp32 master weights moved by +-lr, published as bf16). With ``inplace``,
  the tensors are attached (once) and published in place
  (``publish(snapshot=False)``); before changing them for the next version the
  previous one is retracted (not timed: a trainer does that when its readers are done).
- ``{"op": "prepare", "size": N, "seed": S, "inplace": bool, "reserve": bool}`` -> ``{}``:
  what a trainer does at start-up: make the tensors (on the store's device) and attach
  them (``inplace``) or reserve the buffer of their first snapshot (`ModelStore.reserve`;
  ``"reserve": false``: only make them, as a trainer that follows the README does).
- ``{"op": "gloo", "rank", "world", "store", "size", "seed", "flat"}`` -> ``{"start",
  "end", "sha256", "bytes"}``: one ``torch.distributed`` gloo broadcast of `bench_tensors` from
  rank 0 (the process group is set up on the first call, the receivers' tensors
  allocated then); per tensor, or with ``flat`` packed into one flat buffer on rank
  0 and unpacked on the others (both copies timed). Rank 0 adds 1 to every byte
  before each later broadcast.
- ``{"op": "nixl_serve", "size", "seed"}`` / ``{"op": "nixl_bump"}`` / ``{"op":
  "nixl_read", "served"}``: the raw NIXL READ baseline (`peers.NixlPeer`): the trainer
  registers its tensors and answers what readers need, then makes each version in
  place (``start``, ``sha256``); a reader READs the whole version (``end``, ``sha256``).
- ``{"op": "memory"}`` -> `MemoryWatch.report`: the peak of this process's own memory
  (anonymous RSS plus the /dev/shm files it owns), the same at start-up, and RSS's
  peak (which also counts peers' shared pages it read).
- ``{"op": "fetch", "version": V, "in_place": bool, "samples": bool}`` -> fetch stats plus
  ``start`` / ``end`` (wall clock); with ``samples``, ``samples``: ``[[time, chunks held],
  ...]`` at every chunk (wall clock). While it runs, ``{"progress": [done, total]}`` lines
  come first. On a GPU, ``end`` is taken after a device synchronize.
- ``{"op": "sync", "in_place": bool}`` -> the same as ``fetch``, through ``store.sync``:
  wait for a version newer than the one held, fetch it and switch (a rollout's loop);
  ``start`` is when the call began, before the wait.
- ``{"op": "digest"}`` -> ``{"sha256": hex}`` of the active version's bytes.
- ``{"op": "forwarded", "version": V}`` -> ``{"first": wall clock or None}``: when this
  worker's read server first granted bytes of version V to another reader.
- ``{"op": "ipc_prepare", "size", "seed", "device", "trainer": bool}`` /
  ``{"op": "ipc_export"}`` / ``{"op": "ipc_load", "handles"}`` / ``{"op": "ipc_digest"}``:
  the ``ipc-per-tensor`` baseline on a GPU (`peers.IpcPeer`, vLLM's CUDA IPC weight
  transfer): the trainer exports one handle per tensor of each version (``start``,
  ``end``, ``handles``), a reader rebuilds them and copies into its own tensors
  (``start``, ``end``).
- ``{"op": "served"}`` -> ``{"bytes": N}`` this worker served (egress).
- ``{"op": "cpu"}`` -> ``{"seconds": S}``: this process's CPU time so far (every
  thread, NIXL's and UCX's included).
- ``{"op": "exit"}``: leave the fabric and exit.

Errors come back as ``{"error": "TypeName", "message": ...}``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import weightfabric as wf
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.hub.planned import plan_router
from weightfabric.fabric.hub.ranking import topology_ranker
from weightfabric.fabric.locality import Location, SourceCandidate, rank_by_locality

if TYPE_CHECKING:
    from weightfabric.tools.bench.peers import IpcPeer, NixlPeer

_print_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON line to stdout (thread-safe)."""
    with _print_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def bench_tensors(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """About `nbytes` of Llama-shaped, mixed-dtype tensors (bf16 weights, fp32 norms).

    Deterministic in `seed`: views of one random byte buffer, so generating 1 GB is cheap.
    """
    hidden = 1024
    while hidden > 64 and 4 * 26 * hidden * hidden > nbytes:  # at least 4 layers
        hidden //= 2
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes + (1 << 20),), dtype=torch.uint8, generator=g)
    out: dict[str, torch.Tensor] = {}
    pos = 0

    def take(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nonlocal pos
        size = torch.Size(shape).numel() * dtype.itemsize
        pos = -(-pos // 16) * 16
        out[name] = raw[pos:pos + size].view(dtype).view(shape)
        pos += size

    inter = 3 * hidden
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2 + 2 * hidden * 4
    num_layers = max(1, (nbytes - 2 * hidden * 4) // per_layer)
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            take(f"{p}.self_attn.{proj}.weight", (hidden, hidden), torch.bfloat16)
        take(f"{p}.mlp.gate_proj.weight", (inter, hidden), torch.bfloat16)
        take(f"{p}.mlp.up_proj.weight", (inter, hidden), torch.bfloat16)
        take(f"{p}.mlp.down_proj.weight", (hidden, inter), torch.bfloat16)
        take(f"{p}.input_layernorm.weight", (hidden,), torch.float32)
        take(f"{p}.post_attention_layernorm.weight", (hidden,), torch.float32)
    take("model.norm.weight", (hidden,), torch.float32)
    rest = (nbytes - pos) // 2 // hidden  # an embedding takes up what is left
    if rest > 0:
        take("model.embed_tokens.weight", (rest, hidden), torch.bfloat16)
    take("step", (1,), torch.int64)
    return out


def trained_tensors(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """`bench_tensors`' names and shapes with weights as a trained model has them.

    bf16 matrices ~ N(0, 0.02), fp32 norms 1 (random bytes would make a delta
    benchmark meaningless: their magnitudes span every exponent).
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in bench_tensors(nbytes, seed).items():
        if t.dtype == torch.bfloat16:
            out[name] = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
        elif t.dtype == torch.float32:
            out[name] = torch.ones(t.shape)
        else:
            out[name] = torch.zeros(t.shape, dtype=t.dtype)
    return out


class TrainingSteps:
    """Versions as a mixed-precision trainer makes them: fp32 master weights, bf16 published.

    Each `step` moves every master weight by ``+-lr`` (the size of an Adam update, whose
    normalised step is about ``lr`` per weight) and writes the bf16 rounding into the
    published tensors; fp32 tensors take the step themselves, integer ones count steps.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], lr: float, seed: int) -> None:
        self.tensors, self.lr = tensors, lr
        self.master = {n: t.float() for n, t in tensors.items() if t.dtype == torch.bfloat16}
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> float:
        """One step; returns the fraction of published words that changed."""
        changed = total = 0
        for name, t in self.tensors.items():
            if not t.is_floating_point():
                t.add_(1)
                continue
            target = self.master.get(name, t)
            sign = torch.randint(0, 2, target.shape, generator=self.gen).mul_(2).sub_(1)
            target.add_(sign, alpha=self.lr)
            if target is not t:
                before = t.clone()
                t.copy_(target)
                changed += int((t.view(torch.int16) != before.view(torch.int16)).sum())
                total += t.numel()
        return changed / max(1, total)


def own_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor with storage of its own, as a model's parameters have.

    `bench_tensors` are views of one buffer; a view keeps its base alive after `attach`
    moved its data into the arena, which would count the model twice.
    """
    return {n: t.clone() for n, t in tensors.items()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and raw bytes of `tensors`, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        raw = tensors[name].reshape(-1).view(torch.uint8).cpu().numpy()
        # numpy's stubs declare ndarray.__buffer__ only for Python 3.12+.
        h.update(memoryview(raw))  # type: ignore[arg-type]
    return h.hexdigest()


def origin_only(reader: Location, candidates: Sequence[SourceCandidate], *,
                origin: str = "trainer") -> list[SourceCandidate]:
    """A hub ranking that names only the trainer (worker ``origin``): the no-fabric baseline."""
    return [c for c in candidates if c.worker == origin]


RANKINGS = {"locality": rank_by_locality, "origin": origin_only}


class MemoryWatch:
    """Samples this process's own memory: anonymous RSS plus the /dev/shm files it owns.

    RSS alone would count the pages of peers' /dev/shm regions this process read from
    (shared, owned by them); this counts what the process holds. Sampled every
    ``interval`` seconds on a daemon thread; `peak` is the largest sum seen.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.base = self.sample()
        self.peak = dict(self.base)
        threading.Thread(target=self._run, args=(interval,), daemon=True,
                         name="memory-watch").start()

    @staticmethod
    def sample() -> dict[str, int]:
        """Anonymous resident bytes and owned /dev/shm bytes now."""
        from weightfabric.fabric.arena import PREFIX, SHM_DIR

        anon = 0
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
        shm = 0
        for path in SHM_DIR.glob(f"{PREFIX}-{os.getpid()}-*"):
            with contextlib.suppress(OSError):  # freed meanwhile
                shm += path.stat().st_size
        return {"anon": anon, "shm": shm, "total": anon + shm}

    def reset(self) -> None:
        """Count the peak from now on (`base` stays the process's start)."""
        self.peak = self.sample()

    def _run(self, interval: float) -> None:
        while True:
            now = self.sample()
            if now["total"] > self.peak["total"]:
                self.peak = now
            time.sleep(interval)

    def report(self) -> dict[str, int]:
        """Peak (anon, shm, total), the sample at process start (base_*) and RSS's peak."""
        return {**{f"peak_{k}": v for k, v in self.peak.items()},
                **{f"base_{k}": v for k, v in self.base.items()},
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class Gloo:
    """One rank of a gloo broadcast of `bench_tensors` (the no-fabric baseline)."""

    def __init__(self, rank: int, world: int, store: str, size: int, seed: int) -> None:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                                world_size=world)
        self.dist, self.rank = dist, rank
        source = bench_tensors(size, seed)
        # an engine's parameters: one tensor each (the sender's are views of one buffer)
        self.tensors = source if rank == 0 else {n: torch.empty_like(t) for n, t in source.items()}
        self.flat: torch.Tensor | None = None
        self.calls = 0

    def broadcast(self, *, flat: bool) -> dict[str, Any]:
        """Broadcast the next version; timed from a barrier to this rank's last byte."""
        if self.rank == 0 and self.calls:
            for t in self.tensors.values():
                t.reshape(-1).view(torch.uint8).add_(1)
        self.calls += 1
        views = [t.reshape(-1).view(torch.uint8) for t in self.tensors.values()]
        if flat and self.flat is None:
            self.flat = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
        self.dist.barrier()
        start = time.time()
        if flat:
            assert self.flat is not None
            pieces = self.flat.split([v.numel() for v in views])
            if self.rank == 0:
                for piece, v in zip(pieces, views, strict=True):
                    piece.copy_(v)
            self.dist.broadcast(self.flat, src=0)
            if self.rank != 0:
                for piece, v in zip(pieces, views, strict=True):
                    v.copy_(piece)
        else:
            for v in views:
                self.dist.broadcast(v, src=0)
        end = time.time()
        return {"start": start, "end": end, "sha256": digest(self.tensors),
                "bytes": sum(v.numel() for v in views)}

    def close(self) -> None:
        """Leave the process group."""
        self.dist.destroy_process_group()


class Agent:
    """Holds this process's hub or worker between commands."""

    def __init__(self) -> None:
        self.hub: wf.HubServer | None = None
        self.worker: wf.Worker | None = None
        self.store: wf.ModelStore | None = None
        self.device = "cpu"
        self._tensors: dict[str, torch.Tensor] | None = None
        self._training: TrainingSteps | None = None
        self._published: int | None = None
        self._gloo: Gloo | None = None
        self._nixl: NixlPeer | None = None
        self._ipc: IpcPeer | None = None

    def _synchronize(self) -> None:
        """Wait for this process's work on its GPU (nothing on CPU): times end after it."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The answer to one command; raises if it fails (`main` reports the error)."""
        op = cmd["op"]
        if op == "gloo":
            if self._gloo is None:
                self._gloo = Gloo(int(cmd["rank"]), int(cmd["world"]), cmd["store"],
                                  int(cmd["size"]), int(cmd.get("seed", 0)))
            return self._gloo.broadcast(flat=bool(cmd.get("flat")))
        if op in ("nixl_serve", "nixl_bump", "nixl_read"):
            from weightfabric.tools.bench.peers import NixlPeer

            if self._nixl is None:
                self._nixl = NixlPeer(cmd.get("name", f"nixl-{os.getpid()}"))
            if op == "nixl_serve":
                return self._nixl.serve(int(cmd["size"]), int(cmd.get("seed", 0)))
            return self._nixl.bump() if op == "nixl_bump" else self._nixl.read(cmd["served"])
        if op in ("ipc_prepare", "ipc_export", "ipc_load", "ipc_digest"):
            return self._ipc_op(op, cmd)
        if op == "memory":
            return _WATCH.report() if _WATCH is not None else {}
        if op == "cpu":
            return {"seconds": time.process_time()}
        if op == "hub":
            ranking = cmd.get("ranking", "locality")
            router = (plan_router(cmd["cluster"], start_bound_s=float(cmd.get("start_bound_s", 2.0)))
                      if ranking == "plan" else None)
            rank = (None if router is not None else topology_ranker(cmd["cluster"])
                    if ranking == "ranked" else RANKINGS[ranking])
            if ranking == "origin" and "origin" in cmd:
                rank = functools.partial(origin_only, origin=cmd["origin"])
            self.hub = wf.serve(f"tcp://{cmd['host']}:{cmd.get('port', 0)}",
                                lease_s=cmd.get("lease_s", 30.0), rank_sources=rank,
                                plan_routing=router)
            return {"url": self.hub.url}
        if op == "plans":
            router = self.hub.state.plan_routing if self.hub is not None else None
            return {"plans": router.summary() if router is not None else []}
        if op == "join":
            self.worker = wf.join(cmd["url"], worker=cmd["name"],
                                      location=cmd.get("location"),
                                      host=cmd.get("host", "127.0.0.1"))
            self.device = cmd.get("device", "cpu")
            self.store = self.worker.model("bench", chunk_size=int(cmd["chunk_size"]),
                                           device=self.device,
                                           prepare_spare=cmd.get("prepare_spare", True))
            if cmd.get("keep_last"):
                self.worker.hub.set_retention("bench", keep_last=int(cmd["keep_last"]))
            if cmd.get("attach"):
                self.store.attach({n: t.to(self.device)
                                   for n, t in own_tensors(bench_tensors(int(cmd["attach"]),
                                                                         0)).items()})
            return {}
        assert self.worker is not None and self.store is not None, "join first"
        if op == "publish":
            inplace = bool(cmd.get("inplace"))
            changed: float | None = None
            if self._tensors is None:
                self._prepare(int(cmd["size"]), int(cmd.get("seed", 0)), inplace=inplace,
                              lr=cmd.get("lr"))
            elif self._published is not None:
                if inplace:
                    state = self.store.retract(self._published, wait=300)
                    if state != "done":
                        raise RuntimeError(f"v{self._published} still in use ({state})")
                if self._training is not None:
                    changed = self._training.step()
                else:
                    for t in self._tensors.values():
                        t.reshape(-1).view(torch.uint8).add_(1)
            tensors = self._tensors
            assert tensors is not None
            self._synchronize()  # the new weights are ready (their bump done)
            start = time.time()
            version = self.store.publish(None if inplace else tensors, snapshot=not inplace)
            self._synchronize()
            end = time.time()
            self._published = version
            assert self.store.layout is not None, "a publish sets the store's layout"
            return {"version": version, "bytes": self.store.layout.nbytes,
                    "tensor_bytes": [t.numel() * t.element_size() for t in tensors.values()],
                    "changed_fraction": changed, "start": start, "end": end}
        if op == "prepare":
            self._prepare(int(cmd["size"]), int(cmd.get("seed", 0)),
                          inplace=bool(cmd.get("inplace")), lr=cmd.get("lr"),
                          reserve=bool(cmd.get("reserve", True)))
            return {}
        if op == "settle":
            if cmd.get("wait", True):
                self.store.wait_prepared(timeout=float(cmd.get("timeout", 300)))
            if _WATCH is not None:
                _WATCH.reset()
            return {}
        if op in ("fetch", "sync"):
            last = [0.0]
            samples: list[tuple[float, int]] = []

            def on_chunk(done: int, total: int) -> None:
                if cmd.get("samples"):
                    samples.append((time.time(), done))
                now = time.monotonic()
                if now - last[0] > 0.1 or done == total:
                    last[0] = now
                    emit({"progress": [done, total]})

            options = FetchOptions(**cmd.get("options", {}))
            start = time.time()
            if op == "sync":
                stats = self.store.sync(timeout=float(cmd.get("timeout", 600)),
                                        verify=cmd.get("verify"), options=options,
                                        on_chunk=on_chunk, in_place=bool(cmd.get("in_place")))
            else:
                stats = self.store.fetch(cmd.get("version", "latest"), verify=cmd.get("verify"),
                                         options=options, on_chunk=on_chunk,
                                         in_place=bool(cmd.get("in_place")))
            self._synchronize()
            end = time.time()
            return {**stats.to_dict(), "start": start, "end": end,
                    **({"samples": samples} if cmd.get("samples") else {})}
        if op == "digest":
            return {"sha256": digest(self.store.tensors)}
        if op == "served":
            return {"bytes": self.worker.bytes_served}
        if op == "forwarded":
            from weightfabric.fabric.regions import region_name
            return {"first": self.worker.server.first_served(
                region_name("bench", int(cmd["version"])))}
        raise ValueError(f"unknown op {op!r}")

    def _ipc_op(self, op: str, cmd: dict[str, Any]) -> dict[str, Any]:
        """The ``ipc-per-tensor`` baseline's commands (`peers.IpcPeer`)."""
        from weightfabric.tools.bench.peers import IpcPeer

        if op == "ipc_prepare":
            self._ipc = IpcPeer(int(cmd["size"]), int(cmd.get("seed", 0)), cmd["device"],
                                trainer=bool(cmd.get("trainer")))
            return {}
        assert self._ipc is not None, "ipc_prepare first"
        if op == "ipc_export":
            return self._ipc.export()
        if op == "ipc_load":
            return self._ipc.load(cmd["handles"])
        return {"sha256": digest(self._ipc.tensors)}

    def _prepare(self, size: int, seed: int, *, inplace: bool, lr: float | None = None,
                 reserve: bool = True) -> None:
        """Make the trainer's tensors; attach them (``inplace``) or reserve their buffer.

        With ``lr``, `trained_tensors` that `TrainingSteps` change from version to version;
        without ``reserve`` a snapshot publisher only makes them (its first publish then
        allocates the buffer, as a trainer that never called `ModelStore.reserve` does).
        """
        assert self.store is not None
        tensors = trained_tensors(size, seed) if lr is not None else bench_tensors(size, seed)
        self._tensors = {n: t.to(self.device)
                         for n, t in (own_tensors(tensors) if inplace else tensors).items()}
        if lr is not None:
            self._training = TrainingSteps(self._tensors, float(lr), seed)
        if inplace:
            self.store.attach(self._tensors)
        elif reserve:
            self.store.reserve(self._tensors)
        self._synchronize()

    def close(self) -> None:
        """Close the agent's worker, hub and process group."""
        if self._gloo is not None:
            self._gloo.close()
        if self.worker is not None:
            self.worker.close()
        if self.hub is not None:
            self.hub.stop()


_WATCH: MemoryWatch | None = None


def main() -> None:
    """Answer JSON commands on stdin, one JSON line each on stdout."""
    global _WATCH
    _WATCH = MemoryWatch()
    agent = Agent()
    emit({"ready": True})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                break
            try:
                reply = agent.handle(cmd)
            except Exception as exc:  # reported to the driver, which decides
                reply = {"error": type(exc).__name__, "message": str(exc)}
            emit(reply)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
