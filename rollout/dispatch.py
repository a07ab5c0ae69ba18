"""Skew-aware dispatch of rollout requests to a pool of engines.

RL rollouts are long-tailed: a few long responses decide when the batch's last
sample finishes (StreamRL's skewness-aware dispatch). Started late, or piled on
one engine, they stretch the whole step. The policy:

- a `LengthPredictor` ranks requests by predicted output length (`HistoryPredictor`
  learns it per prompt group; `ConstantPredictor` is the no-skew-awareness baseline);
- waiting requests go out longest predicted first; migrated ones (``front=True``) go
  before everything else, in the order they were added, since they already cost work;
- each goes to the accepting engine with a free slot and the fewest predicted
  outstanding tokens (ties by name), which balances predicted load;
- once the queue is empty, idle engines steal running requests from the most loaded
  engine while that lowers the larger of the two totals (RLBoost's token-level
  migration makes moving a running request possible), skipping ones too short to be
  worth the re-prefill.

Everything is deterministic: no randomness, no clock. Not thread-safe.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


def _clip(value: float, max_tokens: int) -> float:
    return min(max(float(value), 1.0), float(max(max_tokens, 1)))


class LengthPredictor(Protocol):
    """Predicts a request's output length in tokens (a pluggable ranker)."""

    def predict(self, prompt: Sequence[int], max_tokens: int, group: str | None) -> float:
        """The predicted output length of a request, in tokens."""
        ...

    def observe(
        self, prompt: Sequence[int], group: str | None, output_tokens: int, max_tokens: int
    ) -> None:
        """Learn from a finished request's true output length."""
        ...


class HistoryPredictor:
    """Predicts from observed output lengths, per prompt group.

    A known group: the EWMA of its observed output lengths. A group never seen (or
    ``None``): a global fit, the ratio of all observed output tokens to all observed
    prompt tokens times this prompt's length (the mean output length if prompts were
    empty). Nothing observed yet: ``max_tokens / 2``. Always clipped to
    ``[1, max_tokens]``. O(1) per call; at most `max_groups` groups are kept, the
    least recently used dropped first.

    Args:
        alpha: weight of the newest observation in a group's EWMA (0 < alpha <= 1).
        max_groups: how many groups to remember.
    """

    def __init__(self, *, alpha: float = 0.3, max_groups: int = 4096) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.alpha = alpha
        self.max_groups = max_groups
        self._groups: OrderedDict[str, float] = OrderedDict()
        self._count = 0
        self._out_total = 0.0
        self._prompt_total = 0.0

    def groups(self) -> int:
        """How many groups are remembered now."""
        return len(self._groups)

    def predict(self, prompt: Sequence[int], max_tokens: int, group: str | None) -> float:
        """The group's recent mean, else the global fit, else ``max_tokens / 2``; clipped."""
        if group is not None:
            mean = self._groups.get(group)
            if mean is not None:
                self._groups.move_to_end(group)
                return _clip(mean, max_tokens)
        if self._count == 0:
            return _clip(max_tokens / 2, max_tokens)
        if self._prompt_total > 0 and len(prompt) > 0:
            return _clip(self._out_total / self._prompt_total * len(prompt), max_tokens)
        return _clip(self._out_total / self._count, max_tokens)

    def observe(
        self, prompt: Sequence[int], group: str | None, output_tokens: int, max_tokens: int
    ) -> None:
        """Fold a finished request's output length into its group and the global fit."""
        out = float(max(output_tokens, 0))
        self._count += 1
        self._out_total += out
        self._prompt_total += len(prompt)
        if group is None:
            return
        mean = self._groups.get(group)
        self._groups[group] = out if mean is None else mean + self.alpha * (out - mean)
        self._groups.move_to_end(group)
        if len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)


class ConstantPredictor:
    """Predicts ``max_tokens`` for everything: dispatch degenerates to FIFO with balance."""

    def predict(self, prompt: Sequence[int], max_tokens: int, group: str | None) -> float:
        """Always ``max_tokens`` (at least 1)."""
        return float(max(max_tokens, 1))

    def observe(
        self, prompt: Sequence[int], group: str | None, output_tokens: int, max_tokens: int
    ) -> None:
        """Learns nothing."""


@dataclass
class EngineLoad:
    """An engine's state as dispatch sees it.

    Attributes:
        name: the engine's name (unique in a call).
        free_slots: how many more requests it takes now (0: full).
        running: request id -> predicted tokens it still has to generate.
        accepting: False while draining, updating or leaving: nothing is assigned or
            stolen to it (it may still be stolen from).
        settled: running requests that must not be stolen (e.g. moved once already:
            without it a request can bounce between engines as their loads shift).
    """

    name: str
    free_slots: int
    running: dict[str, float]
    accepting: bool = True
    settled: frozenset[str] = frozenset()


@dataclass
class _Waiting:
    remaining: float
    seq: int
    front: bool


def _outstanding(engines: Sequence[EngineLoad]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for engine in engines:
        if engine.name in totals:
            raise ValueError(f"engine name {engine.name!r} appears twice")
        totals[engine.name] = float(sum(engine.running.values()))
    return totals


class Dispatcher:
    """Skew-aware dispatch: waiting requests ordered by predicted output length, longest first.

    Args:
        predictor: ranks requests; a fresh `HistoryPredictor` when None.
        steal: whether `steal` moves running requests at all (kept as `steal_enabled`).
        steal_min_remaining: running requests predicted to need fewer tokens than this
            are never stolen (not worth the re-prefill).
    """

    def __init__(
        self,
        predictor: LengthPredictor | None = None,
        *,
        steal: bool = True,
        steal_min_remaining: float = 8.0,
    ) -> None:
        self.predictor: LengthPredictor = predictor if predictor is not None else HistoryPredictor()
        self.steal_enabled = steal
        self.steal_min_remaining = steal_min_remaining
        self._waiting: dict[str, _Waiting] = {}
        self._front: OrderedDict[str, None] = OrderedDict()
        # (-remaining, seq, rid); entries of removed requests are skipped when popped
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    def add(
        self,
        rid: str,
        prompt: Sequence[int],
        max_tokens: int,
        group: str | None = None,
        *,
        generated: int = 0,
        front: bool = False,
    ) -> float:
        """Queue a request; returns its predicted remaining tokens.

        `generated` is what a migrated request already has: its remaining is
        ``max(1, predicted - generated)``, at most ``max_tokens - generated``.
        (1 when nothing is left). ``front=True`` queues it before every non-front
        request (after earlier front ones). Raises ValueError for a rid already
        waiting, ``max_tokens < 1`` or ``generated < 0``.
        """
        if rid in self._waiting:
            raise ValueError(f"request {rid!r} is already waiting")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if generated < 0:
            raise ValueError(f"generated must be >= 0, got {generated}")
        total = _clip(self.predictor.predict(prompt, max_tokens, group), max_tokens)
        remaining = max(1.0, min(total - generated, float(max_tokens - generated)))
        self._seq += 1
        self._waiting[rid] = _Waiting(remaining, self._seq, front)
        if front:
            self._front[rid] = None
        else:
            heapq.heappush(self._heap, (-remaining, self._seq, rid))
        return remaining

    def remove(self, rid: str) -> bool:
        """Drop a waiting request (cancelled); False if it was not waiting."""
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return False
        if entry.front:
            del self._front[rid]
        elif len(self._heap) > 2 * len(self._waiting) + 64:
            # drop the stale entries of removed requests: memory stays bounded by the queue
            self._heap = [e for e in self._heap if self._live(e[1], e[2])]
            heapq.heapify(self._heap)
        return True

    def _live(self, seq: int, rid: str) -> bool:
        entry = self._waiting.get(rid)
        return entry is not None and entry.seq == seq

    def waiting(self) -> int:
        """How many requests wait."""
        return len(self._waiting)

    def predicted(self, rid: str) -> float:
        """The predicted remaining tokens of a waiting request (KeyError otherwise)."""
        return self._waiting[rid].remaining

    def _pop(self) -> tuple[str, float] | None:
        if self._front:
            rid, _ = self._front.popitem(last=False)
            return rid, self._waiting.pop(rid).remaining
        while self._heap:
            _, seq, rid = heapq.heappop(self._heap)
            if self._live(seq, rid):
                return rid, self._waiting.pop(rid).remaining
        return None

    def assign(self, engines: Sequence[EngineLoad]) -> list[tuple[str, str]]:
        """Take requests off the queue for engines with free slots: (rid, engine name) pairs.

        Repeatedly the next request (front ones in order, then the largest predicted
        remaining, ties in arrival order) goes to the accepting engine with a free slot
        whose predicted outstanding tokens (running plus what this call gave it) are
        fewest, ties by name; until the queue or the slots run out.
        """
        totals = _outstanding(engines)
        slots = {e.name: e.free_slots for e in engines if e.accepting and e.free_slots > 0}
        ready = [(totals[name], name) for name in slots]
        heapq.heapify(ready)
        pairs: list[tuple[str, str]] = []
        while ready and self._waiting:
            load, name = heapq.heappop(ready)
            taken = self._pop()
            if taken is None:  # pragma: no cover - _waiting non-empty means an entry exists
                break
            rid, remaining = taken
            pairs.append((rid, name))
            slots[name] -= 1
            if slots[name] > 0:
                heapq.heappush(ready, (load + remaining, name))
        if not self._waiting:
            self._heap.clear()
        return pairs

    def steal(self, engines: Sequence[EngineLoad]) -> list[tuple[str, str, str]]:
        """Running requests to move to idle engines: (rid, from engine, to engine).

        Only when the queue is empty (and stealing is on). Each accepting engine with
        free slots, least loaded first (ties by name), takes up to `free_slots`
        requests, one at a time, from the engine with the most predicted outstanding
        tokens now (ties by name; an earlier receiver too, with its own requests),
        choosing the one that leaves the lowest max of the two totals (ties: the
        smaller, then by rid), and only while that max drops below the donor's total. Requests predicted to need fewer
        than `steal_min_remaining` tokens stay; none moves twice in a call. The queue
        is not touched: the caller migrates the requests (abort on the old engine,
        continue on the new one from the tokens generated so far).
        """
        if not self.steal_enabled or self._waiting:
            return []
        totals = _outstanding(engines)
        receivers = sorted(
            (totals[e.name], e.name, e.free_slots)
            for e in engines
            if e.accepting and e.free_slots > 0
        )
        # per engine, the requests that may still move: (remaining, rid)
        movable = {
            e.name: {rid: float(r) for rid, r in e.running.items()
                     if r >= self.steal_min_remaining and rid not in e.settled}
            for e in engines
        }
        moves: list[tuple[str, str, str]] = []
        for _, to, free in receivers:
            for _ in range(free):
                donor = min(
                    (name for name in totals if name != to),
                    key=lambda name: (-totals[name], name),
                    default=None,
                )
                if donor is None or totals[donor] <= totals[to]:
                    break
                best = _best_move(movable[donor], totals[donor], totals[to])
                if best is None:
                    break
                rid, size = best
                del movable[donor][rid]
                totals[donor] -= size
                totals[to] += size
                moves.append((rid, donor, to))
        return moves

    def observe(
        self, prompt: Sequence[int], group: str | None, output_tokens: int, max_tokens: int
    ) -> None:
        """Forward a finished request's output length to the predictor."""
        self.predictor.observe(prompt, group, output_tokens, max_tokens)


def _best_move(
    candidates: dict[str, float], donor_total: float, receiver_total: float
) -> tuple[str, float] | None:
    """The candidate leaving the lowest max of the two totals, if below the donor's.

    Ties: the smaller request (less to migrate), then the rid.
    """
    best: tuple[float, float, str] | None = None
    for rid, size in candidates.items():
        key = (max(donor_total - size, receiver_total + size), size, rid)
        if key[0] < donor_total and (best is None or key < best):
            best = key
    if best is None:
        return None
    return best[2], best[1]
