"""Skew-aware dispatch: the predictor, assign, steal, and a simulated long-tailed batch."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightfabric.rollout.dispatch import (
    ConstantPredictor,
    Dispatcher,
    EngineLoad,
    HistoryPredictor,
)


class GroupOracle:
    """Predicts a fixed length per group (the group name is the length)."""

    def predict(self, prompt: Sequence[int], max_tokens: int, group: str | None) -> float:
        return float(group) if group is not None else 1.0

    def observe(
        self, prompt: Sequence[int], group: str | None, output_tokens: int, max_tokens: int
    ) -> None:
        pass


def oracle(*, steal: bool = True, steal_min_remaining: float = 8.0) -> Dispatcher:
    return Dispatcher(GroupOracle(), steal=steal, steal_min_remaining=steal_min_remaining)


def engine(
    name: str, free: int, running: dict[str, float] | None = None, accepting: bool = True
) -> EngineLoad:
    return EngineLoad(name, free, dict(running or {}), accepting)


# --- HistoryPredictor ----------------------------------------------------------------------


def test_history_predictor_falls_back_from_group_to_global_fit_to_half_max() -> None:
    p = HistoryPredictor()
    assert p.predict([1] * 10, 300, "a") == 150.0  # nothing observed
    p.observe([1] * 10, "a", 100, 300)
    assert p.predict([1] * 5, 300, "a") == 100.0  # the group, whatever the prompt
    assert p.predict([1] * 20, 1000, "b") == 200.0  # unseen group: 10 tokens out per prompt token
    assert p.predict([1] * 20, 1000, None) == 200.0
    assert p.predict([1] * 20, 150, "b") == 150.0  # clipped to max_tokens
    assert p.predict([1] * 20, 60, "a") == 60.0


def test_history_predictor_clips_to_at_least_one_token() -> None:
    p = HistoryPredictor()
    p.observe([1, 2, 3], "a", 0, 10)
    assert p.predict([1, 2, 3], 10, "a") == 1.0
    assert p.predict([], 10, "b") == 1.0
    assert p.predict([], 0, None) == 1.0


def test_history_predictor_recent_mean_per_group() -> None:
    p = HistoryPredictor(alpha=0.5)
    p.observe([1], "a", 100, 1000)
    p.observe([1], "a", 200, 1000)
    p.observe([1], "b", 10, 1000)
    assert p.predict([1], 1000, "a") == 150.0
    assert p.predict([1], 1000, "b") == 10.0
    for _ in range(20):
        p.observe([1], "a", 400, 1000)
    assert p.predict([1], 1000, "a") == pytest.approx(400.0, abs=1e-3)


def test_history_predictor_empty_prompts_use_the_mean_output() -> None:
    p = HistoryPredictor()
    p.observe([], "a", 30, 100)
    p.observe([], "b", 50, 100)
    assert p.predict([], 100, "c") == 40.0
    assert p.predict([7, 7], 100, "c") == 40.0  # no prompt tokens seen: no ratio either


def test_history_predictor_keeps_at_most_max_groups_least_recently_used_dropped() -> None:
    p = HistoryPredictor(max_groups=3)
    for g, n in (("a", 10), ("b", 20), ("c", 30)):
        p.observe([1], g, n, 1000)
    assert p.predict([1], 1000, "a") == 10.0  # touches a: b is now the oldest
    p.observe([1], "d", 40, 1000)
    assert p.groups() == 3
    assert p.predict([1], 1000, "b") == 25.0  # forgotten: the global fit (100 out / 4 prompt)
    assert [p.predict([1], 1000, g) for g in "acd"] == [10.0, 30.0, 40.0]
    for i in range(1000):
        p.observe([1], f"g{i}", 5, 1000)
    assert p.groups() == 3


def test_history_predictor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        HistoryPredictor(alpha=0.0)
    with pytest.raises(ValueError):
        HistoryPredictor(max_groups=0)


def test_constant_predictor_predicts_max_tokens() -> None:
    p = ConstantPredictor()
    p.observe([1], "a", 3, 100)
    assert p.predict([1], 100, "a") == 100.0


# --- assign --------------------------------------------------------------------------------


def test_assign_sends_the_longest_first() -> None:
    d = oracle()
    for rid, n in (("r1", 10), ("r2", 300), ("r3", 40), ("r4", 300)):
        d.add(rid, [1], 1000, str(n))
    assert d.assign([engine("e", 3)]) == [("r2", "e"), ("r4", "e"), ("r3", "e")]
    assert d.waiting() == 1
    assert d.predicted("r1") == 10.0


def test_assign_balances_predicted_outstanding_tokens() -> None:
    d = oracle()
    for rid, n in (("a", 80), ("b", 50), ("c", 30), ("d", 20)):
        d.add(rid, [1], 1000, str(n))
    engines = [engine("e1", 4, {"x": 60.0, "y": 40.0}), engine("e2", 4)]
    # e2: 0 -> 80 -> 130; e1: 100 -> 130; then the tie goes by name
    assert d.assign(engines) == [("a", "e2"), ("b", "e2"), ("c", "e1"), ("d", "e1")]


def test_assign_ties_by_engine_name() -> None:
    d = oracle()
    d.add("r", [1], 100, "5")
    assert d.assign([engine("b", 1), engine("a", 1)]) == [("r", "a")]


def test_assign_respects_free_slots_and_accepting() -> None:
    d = oracle()
    for i in range(6):
        d.add(f"r{i}", [1], 100, str(10 + i))
    engines = [
        engine("full", 0),
        engine("draining", 5, accepting=False),
        engine("one", 1, {"x": 1000.0}),
        engine("two", 2, {"x": 2000.0}),
    ]
    pairs = d.assign(engines)
    assert [e for _, e in pairs] == ["one", "two", "two"]
    assert [r for r, _ in pairs] == ["r5", "r4", "r3"]
    assert d.waiting() == 3
    assert d.assign([engine("full", 0), engine("draining", 5, accepting=False)]) == []
    assert d.waiting() == 3


def test_front_requests_go_first_in_their_order_with_their_remaining() -> None:
    d = oracle()
    d.add("long", [1], 1000, "900")
    assert d.add("m1", [1], 200, "100", generated=30, front=True) == 70.0
    assert d.add("m2", [1], 200, "100", generated=99, front=True) == 1.0
    assert d.add("m3", [1], 200, "100", generated=150, front=True) == 1.0
    assert d.add("m4", [1], 100, "500", generated=10, front=True) == 90.0  # max_tokens - generated
    assert d.add("m5", [1], 100, "500", generated=100, front=True) == 1.0  # nothing left
    assert d.predicted("m1") == 70.0
    pairs = d.assign([engine("e", 10)])
    assert [r for r, _ in pairs] == ["m1", "m2", "m3", "m4", "m5", "long"]


def test_add_refuses_duplicates_and_bad_arguments_and_remove_drops() -> None:
    d = oracle()
    d.add("r", [1], 100, "5")
    with pytest.raises(ValueError):
        d.add("r", [1], 100, "5")
    with pytest.raises(ValueError):
        d.add("r", [1], 100, "5", front=True)
    with pytest.raises(ValueError):
        d.add("z", [1], 0, "5")
    with pytest.raises(ValueError):
        d.add("z", [1], 100, "5", generated=-1)
    d.add("f", [1], 100, "5", front=True)
    assert d.remove("r") and d.remove("f")
    assert not d.remove("r") and not d.remove("nope")
    with pytest.raises(KeyError):
        d.predicted("r")
    assert d.waiting() == 0
    assert d.assign([engine("e", 4)]) == []
    d.add("r", [1], 100, "7")  # a removed rid may come back
    assert d.assign([engine("e", 4)]) == [("r", "e")]
    d.add("r", [1], 100, "7")  # so may an assigned one (a retry)
    assert d.waiting() == 1


def test_many_removals_leave_only_the_live_requests() -> None:
    d = oracle()
    for i in range(500):
        d.add(f"r{i}", [1], 1000, str(i + 1))
    for i in range(500):
        if i != 17:
            assert d.remove(f"r{i}")
    assert d.waiting() == 1
    assert d.assign([engine("e", 10)]) == [("r17", "e")]


def test_dispatcher_forwards_observations_to_its_predictor() -> None:
    d = Dispatcher()
    d.observe([1, 2], "g", 64, 512)
    assert d.add("r", [1, 2], 512, "g") == 64.0
    assert d.add("s", [1, 2], 512, "g", generated=60) == 4.0


# --- steal ---------------------------------------------------------------------------------


def test_steal_does_nothing_while_requests_wait_or_when_off() -> None:
    engines = [engine("a", 0, {"a1": 100.0, "a2": 100.0}), engine("b", 2)]
    d = oracle()
    d.add("w", [1], 100, "5")
    assert d.steal(engines) == []
    assert oracle(steal=False).steal(engines) == []
    assert oracle().steal(engines) == [("a1", "a", "b")]


def test_steal_moves_from_the_most_loaded_to_the_idle_only_while_it_lowers_the_makespan() -> None:
    engines = [
        engine("a", 0, {"a1": 100.0, "a2": 60.0, "a3": 40.0}),
        engine("b", 0, {"b1": 50.0}),
        engine("idle", 3),
    ]
    # a1 evens a (200) and idle (0) at 100; then the most loaded is a at 100, not above idle
    assert oracle().steal(engines) == [("a1", "a", "idle")]
    # a single long request is not moved: it would only change where the makespan is
    assert oracle().steal([engine("a", 0, {"a1": 100.0}), engine("b", 1)]) == []


def test_steal_takes_from_whichever_engine_is_most_loaded_now() -> None:
    engines = [
        engine("a", 0, {"a1": 50.0, "a2": 50.0, "a3": 50.0}),
        engine("b", 0, {"b1": 60.0, "b2": 60.0}),
        engine("c", 3),
    ]
    # a (150) gives a1 (c: 50); then b (120) gives b1 (c: 110); then a (100) < c: stop
    assert oracle().steal(engines) == [("a1", "a", "c"), ("b1", "b", "c")]


def test_steal_respects_min_remaining_free_slots_and_accepting() -> None:
    small = {f"s{i}": 5.0 for i in range(10)}
    assert oracle().steal([engine("a", 0, small), engine("b", 4)]) == []
    assert len(oracle(steal_min_remaining=1.0).steal([engine("a", 0, small), engine("b", 4)])) == 4
    assert len(oracle(steal_min_remaining=1.0).steal([engine("a", 0, small), engine("b", 2)])) == 2
    busy = {f"r{i}": 100.0 for i in range(6)}
    assert oracle().steal([engine("a", 0, busy), engine("b", 3, accepting=False)]) == []
    # a draining engine may be stolen from
    moves = oracle().steal([engine("a", 0, busy, accepting=False), engine("b", 3)])
    assert moves == [("r0", "a", "b"), ("r1", "a", "b"), ("r2", "a", "b")]


def test_duplicate_engine_names_are_refused() -> None:
    with pytest.raises(ValueError):
        oracle().steal([engine("a", 1), engine("a", 1)])
    with pytest.raises(ValueError):
        oracle().assign([engine("a", 1), engine("a", 1)])


# --- properties ----------------------------------------------------------------------------

remaining_st = st.integers(1, 400).map(float)
engines_st = st.lists(
    st.tuples(
        st.integers(0, 4),
        st.dictionaries(st.text("xyz", min_size=1, max_size=3), remaining_st, max_size=6),
        st.booleans(),
    ),
    min_size=1,
    max_size=5,
).map(
    lambda specs: [
        EngineLoad(f"e{i}", free, {f"e{i}.{k}": v for k, v in run.items()}, acc)
        for i, (free, run, acc) in enumerate(specs)
    ]
)
requests_st = st.lists(
    st.tuples(st.integers(1, 500), st.integers(1, 500), st.integers(0, 499), st.booleans()),
    max_size=25,
)


def totals(engines: Sequence[EngineLoad]) -> dict[str, float]:
    return {e.name: sum(e.running.values()) for e in engines}


@settings(max_examples=200, deadline=None)
@given(engines=engines_st, requests=requests_st)
def test_assign_property(
    engines: list[EngineLoad], requests: list[tuple[int, int, int, bool]]
) -> None:
    d = oracle()
    expected_front: list[tuple[float, int, str]] = []
    rest: list[tuple[float, int, str]] = []
    for i, (pred, max_tokens, generated, front) in enumerate(requests):
        remaining = d.add(f"r{i}", [1], max_tokens, str(pred), generated=generated, front=front)
        assert 1.0 <= remaining <= max(1, max_tokens - generated)
        (expected_front if front else rest).append((-remaining, i, f"r{i}"))
    order = [rid for *_, rid in expected_front] + [rid for *_, rid in sorted(rest)]
    free = {e.name: e.free_slots for e in engines if e.accepting}
    pairs = d.assign(engines)
    rids = [r for r, _ in pairs]
    assert rids == order[: len(rids)]  # front in order, then longest first; each at most once
    assert len(pairs) == min(len(order), sum(free.values()))
    for name in {e.name for e in engines}:
        assert sum(1 for _, e in pairs if e == name) <= free.get(name, 0)
    assert d.waiting() == len(order) - len(pairs)
    for rid in order[len(rids) :]:
        d.predicted(rid)  # still waiting


@settings(max_examples=200, deadline=None)
@given(engines=engines_st, min_remaining=st.sampled_from([1.0, 8.0, 100.0]))
def test_steal_property(engines: list[EngineLoad], min_remaining: float) -> None:
    before = totals(engines)
    moves = oracle(steal_min_remaining=min_remaining).steal(engines)
    now = dict(before)
    running = {e.name: e.running for e in engines}
    free = {e.name: e.free_slots for e in engines if e.accepting}
    assert len({rid for rid, _, _ in moves}) == len(moves)
    for rid, src, dst in moves:  # in order: each move lowers the larger of its two totals
        assert src != dst and dst in free
        size = running[src][rid]
        assert size >= min_remaining
        assert max(now[src] - size, now[dst] + size) < max(now[src], now[dst])
        now[src] -= size
        now[dst] += size
    for name in free:
        assert sum(1 for *_, dst in moves if dst == name) <= free[name]
    assert max(now.values()) <= max(before.values())


# --- simulation ----------------------------------------------------------------------------


def simulate(
    dispatcher: Dispatcher, requests: list[tuple[str, str, int]], engines: int, slots: int
) -> int:
    """Ticks until the last request finishes.

    Each tick every running request generates one token; an engine runs at most `slots`.
    """
    true_len = {rid: n for rid, _, n in requests}
    for rid, group, _ in requests:
        dispatcher.add(rid, [1] * 8, 1024, group)
    predicted: dict[str, dict[str, float]] = {f"e{i}": {} for i in range(engines)}
    generated: dict[str, int] = {}
    ticks = 0
    while dispatcher.waiting() or any(predicted.values()):
        loads = [
            EngineLoad(
                name, slots - len(run), {r: max(1.0, p - generated[r]) for r, p in run.items()}
            )
            for name, run in predicted.items()
        ]
        waiting = {rid: dispatcher.predicted(rid) for rid in true_len if rid not in generated}
        for rid, name in dispatcher.assign(loads):
            predicted[name][rid] = waiting[rid]
            generated[rid] = 0
        ticks += 1
        for run in predicted.values():
            for rid in list(run):
                generated[rid] += 1
                if generated[rid] == true_len[rid]:
                    del run[rid]
    return ticks


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_longest_first_with_balance_beats_fifo_on_a_long_tailed_batch(seed: int) -> None:
    rng = random.Random(seed)
    base = {f"g{i}": min(1024, int(16 * rng.paretovariate(1.1))) for i in range(24)}
    requests = [
        (f"{g}.{k}", g, max(1, min(1024, round(n * rng.uniform(0.8, 1.2)))))
        for g, n in base.items()
        for k in range(4)
    ]
    rng.shuffle(requests)
    history = HistoryPredictor()
    for g, n in base.items():  # an earlier epoch saw each prompt group once
        history.observe([1] * 8, g, n, 1024)
    skew = simulate(Dispatcher(history), requests, engines=2, slots=4)
    fifo = simulate(Dispatcher(ConstantPredictor()), requests, engines=2, slots=4)
    lower_bound = max(max(n for *_, n in requests), -(-sum(n for *_, n in requests) // 8))
    assert lower_bound <= skew <= 1.05 * lower_bound  # near optimal
    assert skew < fifo


def test_settled_requests_are_never_stolen():
    d = Dispatcher(steal_min_remaining=1.0)
    busy = EngineLoad("a", 0, {"x": 50.0, "y": 40.0}, settled=frozenset({"x"}))
    idle = EngineLoad("b", 2, {})
    assert d.steal([busy, idle]) == [("y", "a", "b")]
    assert d.steal([EngineLoad("a", 0, {"x": 50.0}, settled=frozenset({"x"})), idle]) == []
