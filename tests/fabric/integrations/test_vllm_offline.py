"""The weightfabric backend in real vLLM engines (offline ``LLM``, TP=1 and TP=2).

Per engine (one per parameter, started once from a random checkpoint "v0"): a trainer in
this process publishes versions through vLLM's trainer-engine API, and after each one
every worker's parameters are bit-identical to what vLLM's own loader makes of the same
version's ``save_pretrained`` checkpoint, and greedy tokens and logprobs equal. Both
landings are exercised: ``auto`` (straight into the parameters where they are vLLM's
layout) and ``load_weights`` (through vLLM's layerwise reload), on both families. Then
bad input: each refused update raises its typed error through vLLM's call and leaves the
engine generating the old version's exact tokens, as does an update once the hub is gone.
Engines reading versions from each other: tests/rollout/test_pool_engines.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from timeouts import hard_timeout
from vllm_helpers import (
    differing,
    engine,
    generate,
    hf_model,
    linears_unpacked,
    params_in_fabric_memory,
    params_of,
    record_of,
    save_bf16,
    train_step,
    vllm_own_load,
)

import weightfabric as wf
from weightfabric.fabric.arena import remove_stale_regions

# publishes one version of a model, prints its number, then waits to be killed
HOLDER = """
import sys, torch, weightfabric as wf
from vllm_helpers import hf_model
with wf.join(sys.argv[1], worker="doomed-holder") as worker:
    version = worker.model("policy").publish(hf_model(sys.argv[2], seed=77),
                                             dtype=torch.bfloat16)
    print(version, flush=True)
    sys.stdin.read()
"""

# (family, tensor-parallel size, landing): every pair of the three choices once, in four
# engines (~40 s each on 2 cores). A model without a ready-made layout (GPT-2) takes the
# load_weights landing these exercise; test_vllm_units checks that ``auto`` chooses it.
ENGINES = [("llama", 1, "auto"), ("qwen2", 2, "auto"), ("qwen2", 1, "load_weights"),
           ("llama", 2, "load_weights")]
MISFIT = {"llama": {"intermediate_size": 384}, "qwen2": {"intermediate_size": 384}}  # others


class Rig:
    """One engine, its hub, the trainer's model and its vLLM trainer engine."""

    def __init__(self, llm: Any, hub: Any, model: torch.nn.Module, family: str, tp: int,
                 load: str, sender: Any, tmp: Any) -> None:
        self.llm, self.hub, self.model, self.family = llm, hub, model, family
        self.tp, self.load, self.sender, self.tmp = tp, load, sender, tmp

    def served(self) -> int:
        """The version the engine serves (one is sent first if none was yet)."""
        if self.sender.version is None:
            self.sender.send_weights()
        return self.sender.version


@pytest.fixture(scope="module", params=ENGINES, ids=lambda e: f"{e[0]}-tp{e[1]}-{e[2]}")
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Rig]:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    family, tp, load = request.param
    tmp = tmp_path_factory.mktemp(f"{family}-tp{tp}")
    model = hf_model(family, seed=0)
    hub = wf.serve("tcp://127.0.0.1:0")
    sender = None
    try:
        with hard_timeout(300), engine(save_bf16(model, tmp / "v0"), tp=tp) as llm:
            info = wf.vllm.TrainerInitInfo(hub=hub.url, model="policy", rank=0,
                                           engine_options={"load": load})
            sender = WeightTransferTrainerFactory.trainer_init(
                info, client=wf.vllm.LLMClient(llm), source=ModuleSource(model))
            yield Rig(llm, hub, model, family, tp, load, sender, tmp)
    finally:
        if sender is not None:
            sender.shutdown()
        hub.stop()


def test_every_version_lands_bit_exact_as_vllms_own_loader(rig: Rig) -> None:
    with hard_timeout(300):
        for step in range(1, 4):
            train_step(rig.model, seed=step)
            rig.sender.send_weights()                      # publish, then start/update/finish
            version = rig.sender.version
            assert rig.llm.get_weight_version() == str(version)
            records = rig.llm.collective_rpc(record_of)
            assert {r["version"] for r in records} == {version}
            ours, tokens = rig.llm.collective_rpc(params_of), generate(rig.llm)
            # vLLM's own loader, from a save_pretrained checkpoint of the same version
            theirs = vllm_own_load(rig.llm, save_bf16(rig.model, rig.tmp / f"v{version}"))
            assert not differing(ours, theirs), f"v{version}: {differing(ours, theirs)[:5]}"
            assert generate(rig.llm) == tokens
        modes = {r["choice"] for r in records}
        if rig.load == "load_weights":
            assert modes == {"load_weights"}
        elif all(rig.llm.collective_rpc(linears_unpacked)):
            assert modes == {"direct"}, records  # vLLM kept the weights as loaded: straight in
        else:  # this CPU's kernels prepack linear weights: only vLLM's loader can place them
            assert modes == {"load_weights"}, records


def test_each_rank_reads_only_its_shard_and_ranks_serve_each_other(rig: Rig) -> None:
    with hard_timeout(120):
        train_step(rig.model, seed=10)
        rig.sender.send_weights()
        records = rig.llm.collective_rpc(record_of)
    sizes = sum(t.numel() * 2 for t in rig.model.state_dict().values())  # bf16 bytes
    for r in records:
        assert r["sources"], r
        if r["choice"] == "direct":
            assert r["bytes"] <= sizes / rig.tp * 1.2, r  # about its 1/tp share, not all
    if rig.tp > 1 and records[0]["choice"] == "load_weights":
        # both ranks hold the same published tensors: one reads the trainer, one its peer
        assert sum("trainer-0" in r["sources"] for r in records) == 1, records


def test_in_place_parameters_live_in_the_fabrics_buffer_and_land_exact(rig: Rig) -> None:
    if (rig.family, rig.tp, rig.load) != ("llama", 1, "auto"):
        pytest.skip("in_place runs on the llama TP=1 engine")
    if not all(rig.llm.collective_rpc(linears_unpacked)):
        pytest.skip("this CPU's kernels prepack the weights: no direct landing here")
    with hard_timeout(240):
        for in_place in (True, False):  # and back: the weights move out of the fabric first
            wf.vllm.connect(rig.llm, rig.hub.url, "policy", in_place=in_place)
            train_step(rig.model, seed=30 + in_place)
            rig.sender.send_weights()
            assert all(rig.llm.collective_rpc(params_in_fabric_memory)) == in_place
            ours, tokens = rig.llm.collective_rpc(params_of), generate(rig.llm)
            theirs = vllm_own_load(rig.llm, save_bf16(rig.model, rig.tmp / f"ip{in_place}"))
            assert not differing(ours, theirs)
            assert generate(rig.llm) == tokens


def test_a_version_whose_only_holder_was_killed_fails_typed_and_keeps_the_old_tokens(
        rig: Rig) -> None:
    from paths import child_env

    if rig.load != "auto":   # what fails is the fetch, before any landing: once per TP size
        pytest.skip("a lost holder is checked on the auto engines (TP=1 and TP=2)")
    with hard_timeout(240):
        rig.served()
        before = generate(rig.llm)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, rig.hub.url, rig.family],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=child_env())
        try:
            assert holder.stdout is not None
            version = int(holder.stdout.readline())
        finally:
            holder.kill()
            holder.wait()
            remove_stale_regions()
        with pytest.raises((wf.FetchError, wf.NoSourceError)):
            wf.vllm.update(rig.llm, version)   # the hub still lists it: no one can serve it
        assert generate(rig.llm) == before


def test_a_version_already_landed_is_a_no_op(rig: Rig) -> None:
    with hard_timeout(60):
        version = rig.served()
        wf.vllm.update(rig.llm, version)
        records = rig.llm.collective_rpc(record_of)
    assert all(r["noop"] and r["version"] == version for r in records), records


def test_refused_updates_raise_typed_errors_and_keep_the_old_tokens(rig: Rig) -> None:
    with hard_timeout(240):
        version = rig.served()
        before = generate(rig.llm)
        with pytest.raises(wf.BadRequestError):
            wf.vllm.update(rig.llm, 0)
        with pytest.raises(wf.UnknownVersionError):
            wf.vllm.update(rig.llm, version + 50)
        # a retired version: keep one, publish two more elsewhere
        with wf.join(rig.hub.url, worker="side-trainer") as side:
            side.hub.set_retention("policy", keep_last=1)
            store = side.model("policy")
            train_step(rig.model, seed=20)
            newer = [store.publish(rig.model, dtype=torch.bfloat16) for _ in range(2)]
            with pytest.raises(wf.UnknownVersionError):
                wf.vllm.update(rig.llm, newer[0])
            # another model's weights (other sizes) under another name
            other = hf_model(rig.family, seed=3, **MISFIT[rig.family])
            side.model("other").publish(other, dtype=torch.bfloat16)
            wf.vllm.connect(rig.llm, rig.hub.url, "other", load=rig.load)
            with pytest.raises(wf.LayoutMismatchError):
                wf.vllm.update(rig.llm, "latest")
            assert generate(rig.llm) == before                 # the old version, exactly
            # and the engine still takes a good version after all that
            wf.vllm.connect(rig.llm, rig.hub.url, "policy", load=rig.load)
            wf.vllm.update(rig.llm, newer[1])
            records = rig.llm.collective_rpc(record_of)
            assert {r["version"] for r in records} == {newer[1]}
            assert generate(rig.llm) != before


def test_a_lost_hub_fails_an_update_typed_and_the_engine_keeps_its_tokens(rig: Rig) -> None:
    # last in the file: it stops this engine's hub (the fixture's own stop is then a no-op)
    if rig.tp != 1 or rig.load != "auto":
        pytest.skip("a lost hub is checked on one engine (TP=1, auto)")
    with hard_timeout(120):
        version = rig.served()
        tokens = generate(rig.llm)
        rig.hub.stop()
        with pytest.raises(wf.HubError):   # unavailable, or timed out
            wf.vllm.update(rig.llm, version + 1)
        assert generate(rig.llm) == tokens
