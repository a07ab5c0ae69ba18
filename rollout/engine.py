"""A pool's engine: one vLLM engine in its own process, fed and drained by the pool.

``python -m weightfabric.rollout.engine --pool tcp://HOST:PORT --checkpoint PATH --hub URL``
(`Pool.launch` runs it for local engines; run it yourself on other machines). The
credential is read from ``$WEIGHTFABRIC_ROLLOUT_TOKEN`` (a token the pool minted, or the
secret), else the fabric's secret file. In order:

1. ``hello`` to the pool (before vLLM starts, so that an engine on another model or with
   too short a context is refused at once).
2. Start vLLM (the ``weightfabric`` weight-transfer backend, in this process), join the
   fabric, then ``ready``; the pool answers with the version to take (its version now,
   not at the hello: start-up is long enough for that one to be retired) before any work.
3. Loop: take orders (``add``, ``abort``, ``update``, ``stop``) between engine steps; after
   each step send every request's new tokens, tagged with the version that made them.
   An update lands between two steps: the requests in flight pause for it and go on
   with the new weights. Idle, it sends a heartbeat every ``--heartbeat`` seconds.

SIGTERM (a preemption notice): stop stepping, tell the pool (``leaving``) and exit; the
pool continues the requests elsewhere from the tokens it has. SIGKILL: the pool notices
the silence (or the process's exit) and does the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import zmq

from weightfabric.fabric.auth import Credential, load_credential
from weightfabric.fabric.errors import FabricError
from weightfabric.rollout import channel
from weightfabric.rollout.identity import fingerprint

TOKEN_ENV = "WEIGHTFABRIC_ROLLOUT_TOKEN"
WELCOME_TIMEOUT_S = 30.0


class EngineLoop:
    """The engine's side of the pool protocol around an offline ``vllm.LLM``."""

    def __init__(self, args: argparse.Namespace, credential: Credential) -> None:
        self.args, self.credential = args, credential
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(args.pool)
        self.session: channel.Session | None = None
        self.version = 0
        self.llm: Any = None
        self.live: dict[str, tuple[str, int]] = {}   # vLLM request id -> (rid, attempt)
        self.leaving = False
        self.last_sent = 0.0

    # -- protocol -----------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        """Seal and send ``message`` to the pool."""
        assert self.session is not None
        self.sock.send_multipart(self.session.seal(message))
        self.last_sent = time.monotonic()

    def greet(self) -> None:
        """Hello and welcome: a session with the pool."""
        a = self.args
        frames, mac = channel.hello(self.credential, {
            "name": a.name, "model": a.model, "fingerprint": fingerprint(a.checkpoint),
            "max_model_len": a.max_model_len, "slots": a.max_num_seqs, "pid": os.getpid()})
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(WELCOME_TIMEOUT_S * 1000)):
            raise FabricError(f"the pool at {a.pool} did not answer in {WELCOME_TIMEOUT_S:g} s")
        answer, nonce = channel.check_welcome(self.credential, mac, self.sock.recv_multipart())
        if not answer.get("ok"):
            raise FabricError(f"the pool refused this engine: {answer.get('error')}")
        self.session = channel.Session(self.credential.key, nonce, channel.TO_POOL)

    def start_engine(self) -> None:
        """Start vLLM and join the fabric."""
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        import weightfabric.fabric.integrations.vllm as wfv

        a = self.args
        self.llm = LLM(model=a.checkpoint, skip_tokenizer_init=True, dtype=a.dtype,
                       max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                       enforce_eager=True, enable_prefix_caching=False, seed=0,
                       weight_transfer_config=WeightTransferConfig(backend="weightfabric"))
        token = os.environ.get(TOKEN_ENV)
        wfv.connect(self.llm, hub=a.hub, model=a.model, engine=a.name, host=a.host,
                    **({"token": token} if token else {}))

    def update(self, version: int) -> dict[str, int]:
        """Fetch ``version`` from the fabric and land it (between two steps).

        Returns:
            the bytes read from each source worker (first rank).
        """
        import weightfabric.fabric.integrations.vllm as wfv

        wfv.update(self.llm, version)
        self.version = version
        records = self.llm.collective_rpc(_last_sources)
        return dict(records[0]) if records else {}

    def abort(self, keys: list[str]) -> None:
        """Abort these vLLM requests."""
        self.llm.llm_engine.abort_request(keys)

    def has_work(self) -> bool:
        """Whether vLLM has requests to step."""
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def handle(self, message: dict[str, Any]) -> bool:
        """Carry out one order; False to stop."""
        op = message.get("op")
        if op == "add":
            for rid, attempt, prompt, max_tokens, sampling in message["reqs"]:
                self.add(rid, attempt, prompt, max_tokens, sampling)
        elif op == "abort":
            wanted = {(rid, attempt) for rid, attempt in message["ids"]}
            keys = [k for k, who in self.live.items() if who in wanted]
            if keys:
                self.abort(keys)
                for k in keys:
                    del self.live[k]
        elif op == "update":
            version = int(message["version"])
            started = time.monotonic()
            try:
                sources = self.update(version)
            except Exception as exc:  # the engine keeps its weights; the pool decides
                self.send({"op": "update_failed", "version": version,
                           "error": f"{type(exc).__name__}: {exc}"})
            else:
                self.send({"op": "updated", "version": version, "sources": sources,
                           "seconds": time.monotonic() - started})
        elif op == "stop":
            return False
        return True

    def add(self, rid: str, attempt: int, prompt: list[int], max_tokens: int,
            sampling: dict[str, Any]) -> None:
        """Give vLLM attempt ``attempt`` of request ``rid`` (prompt: with the kept tokens)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        key = f"{rid}@{attempt}"
        try:
            params = SamplingParams(
                n=1, max_tokens=max_tokens, temperature=sampling["temperature"],
                top_p=sampling["top_p"], top_k=sampling["top_k"], seed=sampling["seed"],
                ignore_eos=sampling["ignore_eos"],
                logprobs=0 if sampling["logprobs"] else None,
                output_kind=RequestOutputKind.DELTA, detokenize=False)
            self.llm.llm_engine.add_request(key, {"prompt_token_ids": list(prompt)}, params)
        except Exception as exc:
            self.send({"op": "refused", "rid": rid, "attempt": attempt,
                       "error": f"{type(exc).__name__}: {exc}"})
            return
        self.live[key] = (rid, attempt)

    def step(self) -> None:
        """One engine step; every request's new tokens to the pool."""
        outs = []
        for out in self.llm.llm_engine.step():
            who = self.live.get(out.request_id)
            if who is None or not out.outputs:
                continue
            completion = out.outputs[0]
            lps: list[float] = []
            if completion.logprobs:
                lps = [float(d[t].logprob) for t, d in zip(completion.token_ids,
                                                           completion.logprobs, strict=True)]
            reason = completion.finish_reason if out.finished else None
            outs.append([who[0], who[1], list(completion.token_ids), lps, reason])
            if out.finished:
                del self.live[out.request_id]
        if outs:
            self.send({"op": "tokens", "version": self.version, "out": outs})

    def run(self) -> int:
        """The whole life of the engine; the process's exit status."""
        signal.signal(signal.SIGTERM, self._on_term)
        self.greet()
        self.start_engine()
        self.send({"op": "ready", "version": self.version})
        a = self.args
        running = True
        while running and not self.leaving:
            busy = self.has_work()
            while self.sock.poll(0 if busy else int(a.heartbeat * 500)):
                assert self.session is not None
                if not self.handle(self.session.open(self.sock.recv_multipart())):
                    running = False
                    break
            if not running or self.leaving:
                break
            if self.has_work():
                self.step()
            if time.monotonic() - self.last_sent >= a.heartbeat:
                self.send({"op": "hb", "version": self.version})
        if self.leaving:
            self.send({"op": "leaving", "reason": "SIGTERM"})
        return 0

    def _on_term(self, signum: int, frame: Any) -> None:
        self.leaving = True

    def close(self) -> None:
        """Close the socket and let vLLM go."""
        self.sock.close()
        if self.llm is not None:
            del self.llm


def _last_sources(worker: Any) -> dict[str, int]:
    """In a vLLM worker: the bytes its last update read from each source worker."""
    last = worker.weight_transfer_engine.last
    return dict(last.sources) if last is not None else {}


def parser() -> argparse.ArgumentParser:
    """The engine's command line."""
    p = argparse.ArgumentParser(
        prog="python -m weightfabric.rollout.engine",
        description="One vLLM engine of a rollout pool (weightfabric.rollout.Pool): it takes "
                    "its weights from the fabric and its requests from the pool, and streams "
                    "tokens back. Credential: $WEIGHTFABRIC_ROLLOUT_TOKEN, else the fabric's "
                    "secret file.")
    p.add_argument("--pool", required=True, help="the pool's address (Pool.address)")
    p.add_argument("--checkpoint", required=True, help="the model's directory (config.json, "
                   "weights: the version vLLM starts from)")
    p.add_argument("--hub", required=True, help="the fabric hub's URL")
    p.add_argument("--model", default="policy", help="the published model's name")
    p.add_argument("--name", default=f"engine-{os.uname().nodename}-{os.getpid()}",
                   help="this engine's name (unique in the pool)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address this engine's fabric read server listens on")
    p.add_argument("--max-model-len", type=int, default=256, help="vLLM's context length")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests generated together (the pool gives no more)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heartbeat", type=float, default=0.5,
                   help="seconds between heartbeats when idle")
    return p


def run(loop_class: type[EngineLoop], args: argparse.Namespace) -> int:
    """Run a ``loop_class`` engine with the credential of this process; the exit status.

    3 (and the error on standard error) when the pool or the fabric refused it.
    """
    token = os.environ.get(TOKEN_ENV)
    loop = loop_class(args, load_credential(secret=token) if token else load_credential())
    try:
        return loop.run()
    except FabricError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    """Run one engine until the pool stops it or SIGTERM; the exit status."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # one process per engine
    return run(EngineLoop, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
