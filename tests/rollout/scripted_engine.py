"""A pool engine with the real protocol and no vLLM, for the pool's own tests.

It speaks `weightfabric.rollout.engine`'s protocol (the same `EngineLoop`: hello, signed
session, orders, heartbeats, SIGTERM) but "generates" one token per request per step
(``--step-s`` apart): ``next_token(prompt + tokens so far)``, so a request continued from
its kept tokens ends exactly as an uninterrupted one, and a test can compute every token.
A version switch takes ``--update-s`` seconds and reads nothing.

``python tests/rollout/scripted_engine.py --pool ... --checkpoint DIR --hub x [--step-s S]``
"""

from __future__ import annotations

import sys
import time
from typing import Any

from weightfabric.rollout.engine import EngineLoop, parser, run


def next_token(sequence: list[int]) -> int:
    """The scripted model: a token from everything before it."""
    return (31 * sum(sequence) + 7 * len(sequence)) % 1000


def expected(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens an uninterrupted request for ``prompt`` gets."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class ScriptedLoop(EngineLoop):
    """`EngineLoop` with the vLLM engine replaced by `next_token`."""

    def start_engine(self) -> None:
        self.work: dict[str, list[Any]] = {}     # key -> [sequence, tokens left]

    def update(self, version: int) -> dict[str, int]:
        time.sleep(self.args.update_s)
        self.version = version
        return {"scripted": 0}

    def add(self, rid: str, attempt: int, prompt: list[int], max_tokens: int,
            sampling: dict[str, Any]) -> None:
        key = f"{rid}@{attempt}"
        self.work[key] = [list(prompt), max_tokens]
        self.live[key] = (rid, attempt)

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            self.work.pop(key, None)

    def has_work(self) -> bool:
        return bool(self.work)

    def step(self) -> None:
        time.sleep(self.args.step_s)
        outs = []
        for key, item in list(self.work.items()):
            seq, left = item
            token = next_token(seq)
            seq.append(token)
            item[1] = left - 1
            rid, attempt = self.live[key]
            outs.append([rid, attempt, [token], [-1.0], "length" if left == 1 else None])
            if left == 1:
                del self.work[key], self.live[key]
        if outs:
            self.send({"op": "tokens", "version": self.version, "out": outs})


def main() -> int:
    p = parser()
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--update-s", type=float, default=0.2)
    return run(ScriptedLoop, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
