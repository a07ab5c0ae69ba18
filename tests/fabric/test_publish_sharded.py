"""What trainers hold, published: FSDP2 / DTensor shards, casts, wrapper names, tied weights.

The DTensor tests build real DTensors in this process on torch's ``fake`` process
group (one rank of a larger world: no peers, no communication), except the FSDP2
test, whose two ranks train and publish in their own processes over gloo.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from procs import children
from torch import nn

import weightfabric as wf
from weightfabric.fabric.dtensors import local_shards
from weightfabric.fabric.errors import FabricError, ManifestMismatchError, TensorSetError
from weightfabric.fabric.hub_messages import ManifestWire
from weightfabric.fabric.manifest import Manifest, ShardedTensor, TensorSpec
from weightfabric.fabric.tensorset import normalize_name

CHUNK = 1 << 12


# --- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of `world` on the fake process group (no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(full: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s DTensor of `full`, cut as `Shard(dim)` cuts it (torch.chunk)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    pieces = full.chunk(world, dim)
    local = (pieces[rank] if rank < len(pieces)
             else full.narrow(dim, full.shape[dim], 0)).contiguous()
    return DTensor.from_local(local, mesh, [Shard(dim)], shape=full.shape, stride=full.stride(),
                              run_check=False)


def reassemble(pieces: list[tuple[ShardedTensor, torch.Tensor]]) -> torch.Tensor:
    """The logical tensor from its slices, each placed at its `start`."""
    first = pieces[0][0]
    out = torch.full(first.global_shape, float("nan"), dtype=pieces[0][1].dtype)
    for s, local in pieces:
        out.narrow(s.dim, s.start, local.shape[s.dim]).copy_(local)
    return out


class Tied(nn.Module):
    """An embedding and an output head sharing one weight (``tie_word_embeddings``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def spec(name: str, shape: tuple[int, ...], offset: int = 0) -> TensorSpec:
    n = 1
    for d in shape:
        n *= d
    return TensorSpec(name, shape, "float32", 4 * n, offset)


# --- the manifest ----------------------------------------------------------------------------


def test_a_manifest_without_sharding_or_aliases_keeps_its_fingerprint_and_wire_form():
    m = Manifest((spec("w", (4, 4)),), 256, (7,))
    assert m.fingerprint == "bcd5a01f7175603321dd3a48694128fe"  # what it was before either existed
    assert set(m.to_wire()) == {"tensors", "chunk_size", "checksums", "total_bytes"}
    assert m.sharding_of("w") is None and m.alias_map() == {}


def test_sharding_and_aliases_round_trip_and_change_the_fingerprint():
    plain = Manifest((spec("w", (3, 4)), spec("b", (3,), 48)), 256)
    m = Manifest(plain.tensors, 256, sharding=(ShardedTensor("w", 0, (7, 4), 4),),
                 aliases=(("head", "w"),))
    assert m.fingerprint != plain.fingerprint
    assert Manifest.from_wire(m.to_wire()) == m
    assert Manifest.from_wire(m.to_wire()).fingerprint == m.fingerprint
    back = ManifestWire.of(m).manifest()
    assert back == m and back.fingerprint == m.fingerprint
    assert m.sharding_of("w") == ShardedTensor("w", 0, (7, 4), 4)
    assert m.sharding_of("head") == ShardedTensor("head", 0, (7, 4), 4)
    assert m.sharding_of("b") is None and m.alias_map() == {"head": "w"}
    only_aliases = Manifest(plain.tensors, 256, aliases=(("head", "w"),))
    assert len({plain.fingerprint, m.fingerprint, only_aliases.fingerprint}) == 3


@pytest.mark.parametrize("sharding, aliases, match", [
    ((ShardedTensor("x", 0, (7, 4), 0),), (), "no tensor"),
    ((ShardedTensor("w", 2, (7, 4), 0),), (), "dim 2"),
    ((ShardedTensor("w", 0, (7, 5), 0),), (), "another dim"),
    ((ShardedTensor("w", 0, (7, 4), 5),), (), "past its global size"),
    ((ShardedTensor("w", 0, (7, 4, 1), 0),), (), "dim 0 of global shape"),
    ((ShardedTensor("w", 0, (7, 4), 0), ShardedTensor("w", 0, (7, 4), 0)), (), "twice"),
    ((), (("w", "w"),), "no tensor of the manifest"),
    ((), (("head", "x"),), "names 'x'"),
    ((), (("head", "w"), ("head", "w")), "twice"),
])
def test_manifest_refuses_bad_sharding_and_aliases(sharding, aliases, match):
    with pytest.raises(ValueError, match=match):
        Manifest((spec("w", (3, 4)),), 256, sharding=sharding, aliases=aliases)


def test_sharded_tensor_refuses_negative_fields():
    with pytest.raises(ValueError, match=">= 0"):
        ShardedTensor("w", 0, (7, 4), -1)
    with pytest.raises(ValueError, match="empty"):
        ShardedTensor("", 0, (7,), 0)


def test_the_hub_keeps_sharding_and_aliases_across_a_restart(tmp_path):
    """A holder restoring its replica after a hub restart brings the same manifest back."""
    m = Manifest((spec("w", (3, 4)),), 256, sharding=(ShardedTensor("w", 0, (7, 4), 4),),
                 aliases=(("head", "w"),))
    url = "memory://publish-sharded-restart"
    hub = wf.serve(url, state_dir=tmp_path)
    try:
        trainer = wf.connect(url, worker="trainer", heartbeat=False, timeout=5)
        version = trainer.begin_publish("policy", m)
        trainer.commit("policy", version)
        hub.stop()
        hub = wf.serve(url, state_dir=tmp_path)
        trainer.heartbeat()  # re-registers, restoring what it holds
        with wf.connect(url, timeout=5) as observer:
            got = Manifest.from_wire(observer.locate("policy", version)["shards"][0]["manifest"])
        assert got == m and got.fingerprint == m.fingerprint
        trainer.close()
    finally:
        hub.stop()


# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("module.layers.0.weight", "layers.0.weight"),
    ("_orig_mod.layers.0.weight", "layers.0.weight"),
    ("module._orig_mod.layers.0.weight", "layers.0.weight"),
    ("_orig_mod.module.layers.0.weight", "layers.0.weight"),
    ("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w", "layers.0.mlp.w"),
    ("layers.module.weight", "layers.module.weight"),  # "module" only leads
    ("module", "module"),                              # a tensor's own name stays
    ("_orig_mod", "_orig_mod"),
    ("weight", "weight"),
])
def test_normalize_name(name, expected):
    assert normalize_name(name) == expected


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_publish_strips_wrapper_names_and_a_plain_reader_attaches(workers):
    trainer, rollout = workers.join("trainer"), workers.join("rollout")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    wrapped = {f"module._orig_mod.{n}": t for n, t in model.state_dict().items()}
    version = trainer.model("m", chunk_size=CHUNK).publish(wrapped)
    mine = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    store = rollout.model("m", chunk_size=CHUNK)
    store.attach(torch.compile(mine))  # its names carry _orig_mod. too: normalized alike
    store.fetch(version)
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(),
                                                 model.state_dict().values(), strict=True))


def test_normalize_names_false_keeps_names(workers):
    store = workers.join("trainer").model("m", chunk_size=CHUNK)
    store.publish({"module.w": torch.ones(3)}, normalize_names=False)
    assert store.layout is not None and store.layout.names == ["module.w"]


def test_names_colliding_once_normalized_are_refused(workers):
    store = workers.join("trainer").model("m", chunk_size=CHUNK)
    with pytest.raises(TensorSetError, match=r"'module\.w' and '_orig_mod\.w'"):
        store.publish({"module.w": torch.ones(3), "_orig_mod.w": torch.zeros(3)})
    assert store.publish({"module.w": torch.ones(3), "_orig_mod.w": torch.zeros(3)},
                         normalize_names=False) >= 1


# --- casts -----------------------------------------------------------------------------------


def test_publish_casts_floats_bit_exactly_and_leaves_the_rest(workers):
    trainer, reader = workers.join("trainer"), workers.join("reader")
    g = torch.Generator().manual_seed(0)
    source = {"w": torch.randn(300, 70, generator=g) * 1e3,
              "strided": torch.randn(64, 40, generator=g).t(),  # cast from any strides
              "tiny": torch.tensor([1.0 + 2 ** -9, -0.0, float("inf"), 3e-39]),
              "half": torch.randn(5, generator=g).to(torch.bfloat16),
              "idx": torch.arange(10)}
    store = trainer.model("cast", chunk_size=CHUNK)
    version = store.publish(source, dtype=torch.bfloat16)
    assert store.layout is not None
    assert {s.name: s.dtype for s in store.layout} == {
        "w": torch.bfloat16, "strided": torch.bfloat16, "tiny": torch.bfloat16,
        "half": torch.bfloat16, "idx": torch.int64}
    got = reader.model("cast", chunk_size=CHUNK)
    got.fetch(version)
    for name, t in source.items():
        if t.is_floating_point():  # bit for bit what .to(bfloat16) gives
            want = t.to(torch.bfloat16)
            assert torch.equal(got.tensors[name].view(torch.int16), want.view(torch.int16)), name
        else:
            assert torch.equal(got.tensors[name], t), name


def test_a_cast_is_part_of_the_layout(workers):
    store = workers.join("trainer").model("cast", chunk_size=CHUNK)
    model = nn.Linear(4, 4)
    store.publish(model, dtype=torch.float16)
    store.publish(model, dtype=torch.float16)
    with pytest.raises(FabricError, match="layout differs"):
        store.publish(model)


def test_casts_packing_cannot_do_are_refused(workers):
    store = workers.join("trainer").model("cast", chunk_size=CHUNK)
    with pytest.raises(TensorSetError, match="float16 to bfloat16"):
        store.publish({"w": torch.ones(3, dtype=torch.float16)}, dtype=torch.bfloat16)
    with pytest.raises(TensorSetError, match="dtype must be one of"):
        store.publish({"w": torch.ones(3)}, dtype=torch.int8)
    store.attach({"w": torch.ones(3)})
    with pytest.raises(FabricError, match="snapshot=True"):
        store.publish(snapshot=False, dtype=torch.bfloat16)


# --- tied weights ----------------------------------------------------------------------------


def test_tied_weights_are_published_once_and_fetched_into_a_tied_module(workers):
    trainer, rollout, plain = workers.join("trainer"), workers.join("rollout"), workers.join("plain")
    source = Tied(seed=1)
    store = trainer.model("tied", chunk_size=CHUNK)
    version = store.publish(source)
    with wf.connect(workers.url) as client:
        manifest = Manifest.from_wire(client.locate("tied", version)["shards"][0]["manifest"])
    assert [t.name for t in manifest.tensors].count("embed_tokens.weight") == 1
    assert "lm_head.weight" not in {t.name for t in manifest.tensors}
    assert manifest.aliases == (("lm_head.weight", "embed_tokens.weight"),)
    assert manifest.total_bytes < 2 * 50 * 16 * 4  # the weight's bytes once

    mine = Tied(seed=2)
    r = rollout.model("tied", chunk_size=CHUNK)
    r.attach(mine)
    r.fetch(version)
    assert mine.lm_head.weight is mine.embed_tokens.weight  # still tied
    assert torch.equal(mine.lm_head.weight, source.embed_tokens.weight)
    assert mine.embed_tokens.weight.data_ptr() == r.tensors["embed_tokens.weight"].data_ptr()
    assert torch.equal(mine.norm.weight, source.norm.weight)

    p = plain.model("tied", chunk_size=CHUNK)  # a reader without a model
    p.fetch(version)
    assert set(p.tensors) == {"embed_tokens.weight", "norm.weight", "norm.bias", "lm_head.weight"}
    assert p.tensors["lm_head.weight"].data_ptr() == p.tensors["embed_tokens.weight"].data_ptr()
    assert p.aliases == {"lm_head.weight": "embed_tokens.weight"}


def test_separate_tensors_sharing_storage_are_aliases_in_place_too(workers):
    trainer, rollout = workers.join("trainer"), workers.join("rollout")
    w = torch.randn(6, 4)
    store = trainer.model("m", chunk_size=CHUNK)
    store.attach({"a": w, "b": w.view(6, 4), "c": w[:3]})  # c overlaps but is no alias
    assert store.aliases == {"b": "a"}
    version = store.publish(snapshot=False)
    got = {"a": torch.zeros(6, 4)}
    got["b"] = got["a"].view(6, 4)
    got["c"] = torch.zeros(3, 4)
    r = rollout.model("m", chunk_size=CHUNK)
    r.attach(got)
    r.fetch(version)
    assert torch.equal(got["a"], w) and torch.equal(got["b"], w) and torch.equal(got["c"], w[:3])
    assert got["a"].data_ptr() == got["b"].data_ptr()


def test_tie_mismatches_name_the_tensor(workers):
    trainer = workers.join("trainer")
    version = trainer.model("tied", chunk_size=CHUNK).publish(Tied())
    untied = Tied()
    untied.lm_head.weight = nn.Parameter(untied.embed_tokens.weight.detach().clone())
    store = workers.join("rollout").model("tied", chunk_size=CHUNK)
    store.attach(untied)
    with pytest.raises(ManifestMismatchError, match="'lm_head.weight' once, as an alias"):
        store.fetch(version)
    other = trainer.model("untied", chunk_size=CHUNK).publish(untied)
    store2 = workers.join("rollout-2").model("untied", chunk_size=CHUNK)
    store2.attach(Tied())
    with pytest.raises(ManifestMismatchError, match="ties it"):
        store2.fetch(other)


# --- DTensors in one process (fake process group) --------------------------------------------


def test_local_shards_follow_torch_chunk_and_do_not_copy():
    full = torch.arange(18.0).reshape(6, 3)  # 6 rows over 4 ranks: 2, 2, 2, 0
    for rank, (rows, start) in enumerate([(2, 0), (2, 2), (2, 4), (0, 6)]):
        with fake_rank(rank, 4):
            d = sharded(full, rank, 4)
            local, sharding = local_shards({"w": d, "plain": torch.ones(2)}, model="m",
                                           shard=rank, num_shards=4)
            assert sharding == (ShardedTensor("w", 0, (6, 3), start),)
            assert local["w"].shape == (rows, 3) and torch.equal(local["w"], d.to_local())
            assert local["w"].data_ptr() == d._local_tensor.data_ptr()  # a view, no copy
            assert local["plain"] is not None


def test_local_shards_of_dim_1_and_replicated():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    full = torch.arange(15.0).reshape(3, 5)
    with fake_rank(1, 2):
        rep = DTensor.from_local(torch.ones(4), init_device_mesh("cpu", (2,)), [Replicate()],
                                 run_check=False)
        local, sharding = local_shards({"cols": sharded(full, 1, 2, dim=1), "rep": rep},
                                       model="m", shard=1, num_shards=2)
    assert sharding == (ShardedTensor("cols", 1, (3, 5), 3),)
    assert torch.equal(local["cols"], full[:, 3:]) and torch.equal(local["rep"], torch.ones(4))


def test_uneven_dtensor_shards_publish_and_reassemble(workers):
    """Four ranks publish a 6-row tensor ([2, 2, 2, 0] rows) and a replicated one.

    A reader fetches every shard and rebuilds the tensor from the manifests' starts.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    full = torch.randn(6, 3)
    bias = torch.randn(5)
    for rank in range(4):
        with fake_rank(rank, 4):
            rep = DTensor.from_local(bias, init_device_mesh("cpu", (4,)), [Replicate()],
                                     run_check=False)
            store = workers.join(f"rank-{rank}").model("dt", shard=rank, num_shards=4,
                                                       chunk_size=CHUNK)
            version = store.publish({"module.w": sharded(full, rank, 4), "b": rep}, group="s1")
    pieces = []
    for rank in range(4):
        store = workers.join(f"reader-{rank}").model("dt", shard=rank, num_shards=4,
                                                     chunk_size=CHUNK)
        store.fetch(version)
        assert torch.equal(store.tensors["b"], bias)
        (s,) = store.sharding
        assert s.name == "w" and s.start == [0, 2, 4, 6][rank]
        pieces.append((s, store.tensors["w"].clone()))
    assert pieces[3][1].shape == (0, 3)
    assert torch.equal(reassemble(pieces), full)


def test_a_shard_of_only_empty_tensors_publishes_and_fetches(workers):
    """The last ranks of an uneven chunk may hold no rows of anything: one padding block."""
    store = workers.join("trainer").model("empty", chunk_size=CHUNK)
    version = store.publish({"w": torch.zeros(0, 7), "b": torch.zeros(0)})
    reader = workers.join("reader").model("empty", chunk_size=CHUNK)
    reader.fetch(version)
    assert {n: t.shape for n, t in reader.tensors.items()} == {"w": (0, 7), "b": (0,)}
    assert reader.layout is not None and reader.layout.nbytes == 256


def test_a_store_that_does_not_match_the_mesh_says_how_to_open_it(workers):
    with fake_rank(1, 2):
        d = sharded(torch.randn(5, 2), 1, 2)
        store = workers.join("trainer").model("dt", chunk_size=CHUNK)
        with pytest.raises(TensorSetError) as info:
            store.publish({"w": d})
    message = str(info.value)
    assert "worker.model(name, shard=rank, num_shards=world)" in message
    assert "worker.model('dt', shard=1, num_shards=2)" in message


def test_dtensors_that_cannot_be_published_are_refused(workers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    with fake_rank(0, 4):
        mesh2d = init_device_mesh("cpu", (2, 2))
        two_d = DTensor.from_local(torch.ones(2, 2), mesh2d, [Shard(0), Replicate()],
                                   run_check=False)
        partial = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (4,)), [Partial()],
                                     run_check=False)
        store = workers.join("trainer").model("dt", shard=0, num_shards=4, chunk_size=CHUNK)
        with pytest.raises(TensorSetError, match=r"'blocks'.*2-D device mesh.*Shard\(dim=0\)"):
            store.publish({"blocks": two_d}, group="g")
        with pytest.raises(TensorSetError, match=r"'acc'.*Partial"):
            store.publish({"acc": partial}, group="g")
        with pytest.raises(TensorSetError, match="DTensor: attach moves plain tensors"):
            store.attach({"acc": partial})


# --- FSDP2 over gloo, two processes ----------------------------------------------------------


def test_an_fsdp2_trainer_publishes_its_shards_and_a_reader_reassembles_them(hub, workers):
    """Two gloo ranks of an FSDP2 model (7 and 1 output rows: rank 1 holds 3 and 0)."""
    with tempfile.TemporaryDirectory() as tmp, children(limit=120) as spawn:
        init = str(Path(tmp) / "rendezvous")
        ranks = [spawn("fsdp-trainer", hub.url, r, 2, init, name=f"fsdp-{r}", wait=False)
                 for r in range(2)]
        for rank in ranks:
            rank.wait_ready(timeout=90)
        for rank in ranks:  # full_tensor() is a collective: both ranks run at once
            rank.send("publish", model="policy", group="step-1")
        replies = [rank.reply(timeout=60) for rank in ranks]
        version = replies[0]["version"]
        assert all(r["version"] == version and r["no_copy"] for r in replies)

        def tensor(plain: list) -> torch.Tensor:
            return torch.tensor(plain[1], dtype=torch.float32).reshape(plain[0])

        with wf.connect(hub.url) as client:
            where = client.locate("policy", version)
        manifests = [Manifest.from_wire(s["manifest"]) for s in where["shards"]]
        assert len(manifests) == 2
        assert manifests[1].sharding_of("2.weight") == ShardedTensor("2.weight", 0, (1, 7), 1)
        assert manifests[0].sharding_of("0.weight") == ShardedTensor("0.weight", 0, (7, 8), 0)

        fetched = []
        for r in range(2):
            store = workers.join(f"reader-{r}").model("policy", shard=r, num_shards=2,
                                                      chunk_size=CHUNK)
            store.fetch(version)
            for name, plain in replies[r]["local"].items():
                assert torch.equal(store.tensors[name], tensor(plain)), (r, name)
            slices = {s.name: s for s in store.sharding}
            assert set(slices) == set(store.tensors)  # FSDP2 shards every parameter
            fetched.append({n: (slices[n], t.clone()) for n, t in store.tensors.items()})
        assert fetched[1]["2.weight"][1].shape == (0, 7)
        for name, plain in replies[0]["full"].items():
            whole = reassemble([fetched[r][name] for r in range(2)])
            assert torch.equal(whole, tensor(plain)), name
