"""A derived layout outlives the published tensors' holders: later readers copy it from peers."""

from __future__ import annotations

from test_layout_store import CHUNK, _check, _layout, _published


def test_a_reader_copies_the_layout_from_a_peer_after_the_trainer_left(workers):
    trainer, weights, v = _published(workers, 1)
    layout = _layout()
    a = workers.join("a").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    assert a.fetch().derived
    trainer.close()                       # the published tensors have no holder now
    b = workers.join("b").layout_model("policy", layout, rank=0, chunk_size=CHUNK)
    got = b.fetch(v)
    assert not got.derived and set(got.sources) == {"a"}, got.sources
    _check(b, layout, weights, 0)
