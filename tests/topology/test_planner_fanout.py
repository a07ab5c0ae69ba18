"""Fan-out quotas: exact per-sender totals, contiguous runs, spare capacity, overflow."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from weightfabric.topology.fanout import FanOut


def test_each_stripe_takes_a_contiguous_run_where_the_last_one_stopped():
    quota = FanOut(list("abcd"), dict.fromkeys("abcd", 8))
    assert quota.take(11, list("abcd")) == {"a": 8, "b": 3}
    assert quota.take(11, list("abcd")) == {"b": 5, "c": 6}
    assert quota.take(5, list("abcd")) == {"c": 2, "d": 3}
    assert quota.left == {"a": 0, "b": 0, "c": 0, "d": 5}


def test_spare_capacity_lets_a_stripe_skip_a_remnant_instead_of_splitting():
    # 4 senders of 8 and 8 stripes of 3: 8 streams to spare, so no stripe is split
    quota = FanOut(list("abcd"), dict.fromkeys("abcd", 8))
    runs = [quota.take(3, list("abcd"), slack=32 - 3 * (8 - s)) for s in range(8)]
    assert all(len(run) == 1 for run in runs)
    # without spare capacity the remnants are used: a split, but nobody goes over
    quota = FanOut(list("abc"), dict.fromkeys("abc", 8))
    runs = [quota.take(3, list("abc")) for _ in range(8)]
    assert {"a": 2, "b": 1} in runs and min(quota.left.values()) == 0


def test_beyond_capacity_the_sender_with_most_left_goes_over_one_stream_at_a_time():
    quota = FanOut(["a", "b"], {"a": 2, "b": 1})
    assert quota.take(3, ["a", "b"]) == {"a": 2, "b": 1}
    assert quota.take(3, ["a", "b"], spill=["root"]) == {"a": 1, "b": 1, "root": 1}
    assert quota.take(2, []) == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=12), st.data())
def test_quotas_meet_every_demand_and_stay_within_capacity_when_it_suffices(caps, data):
    names = list(range(len(caps)))
    quota = FanOut(names, dict(zip(names, caps, strict=True)))
    total = sum(caps)
    demands = data.draw(st.lists(st.integers(0, 20), max_size=8))
    slack = data.draw(st.integers(0, 4))
    fits = sum(demands) <= total
    given_out = dict.fromkeys(names, 0)
    for i, d in enumerate(demands):
        eligible = names if fits else data.draw(st.lists(st.sampled_from(names), min_size=1,
                                                         unique=True))
        spare = max(0, total - sum(demands)) - slack if fits else 0
        out = quota.take(d, eligible, slack=max(0, spare) if i else 0)
        assert sum(out.values()) == d
        assert all(v > 0 and n in eligible for n, v in out.items())
        for n, v in out.items():
            given_out[n] += v
    if fits:
        assert all(given_out[n] <= c for n, c in zip(names, caps, strict=True))
