"""The vLLM backend's parts that need no running engine: choices, checks, clients, plugin."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from vllm_helpers import hf_model

import weightfabric as wf
from weightfabric.fabric.integrations.vllm.clients import fabric_error, switch
from weightfabric.fabric.integrations.vllm.landing import (
    check_against_checkpoint,
    checkpoint_shapes,
    choose,
    rank_specs,
)
from weightfabric.fabric.relayout.engines import vllm_layout
from weightfabric.fabric.relayout.rules import Published


def _engine_params(family: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What a vLLM worker of ``family`` at ``tp`` holds (names, shapes, bf16)."""
    config = hf_model(family).config
    specs = rank_specs(vllm_layout(config, tp=tp, dtype=torch.bfloat16), rank, torch.bfloat16)
    return {n: torch.empty(s, dtype=d) for n, (s, d) in specs.items()}


def _choose(family: str, params: dict[str, torch.Tensor], mode: str = "auto", **kw: Any):
    args = {"hf_config": hf_model(family).config, "params": params, "dtype": torch.bfloat16,
            "tp": 2, "tp_rank": 1, "quantization": None, **kw}
    return choose(mode, **args)  # type: ignore[arg-type]


def test_parameters_in_vllms_layout_land_straight_in():
    choice = _choose("qwen2", _engine_params("qwen2", 2, 1))
    assert choice.mode == "direct" and choice.rank == 1
    assert choice.layout is not None and choice.layout.tp == 2


def test_repacked_quantised_pipelined_or_unknown_models_land_through_load_weights():
    params = _engine_params("llama", 2, 1)
    params["model.layers.0.mlp.down_proj.weight"] = torch.empty(0, dtype=torch.bfloat16)
    choice = _choose("llama", params)
    assert choice.mode == "load_weights" and "down_proj" in choice.reason
    assert _choose("llama", _engine_params("llama", 2, 1), quantization="fp8").mode == \
        "load_weights"
    assert _choose("llama", _engine_params("llama", 2, 1), pipeline=2).mode == "load_weights"
    gpt2 = {n: p.to(torch.bfloat16) for n, p in hf_model("gpt2").named_parameters()}
    assert _choose("gpt2", gpt2, tp=1, tp_rank=0).mode == "load_weights"


def test_direct_asked_for_on_parameters_that_do_not_fit_is_refused():
    params = _engine_params("llama", 2, 0)  # rank 0's tensors, rank 1's worker
    params["lm_head.weight"] = torch.empty((7, 256), dtype=torch.bfloat16)
    with pytest.raises(wf.LayoutMismatchError, match="lm_head"):
        _choose("llama", params, mode="direct")
    with pytest.raises(wf.LayoutError, match="load must be"):
        _choose("llama", params, mode="sideways")


def test_a_version_of_another_model_is_refused_before_any_load(tmp_path):
    model = hf_model("gpt2")
    model.save_pretrained(tmp_path)
    ckpt = checkpoint_shapes(tmp_path)
    assert ckpt is not None and checkpoint_shapes(tmp_path / "nothing") is None
    published = {n: Published(tuple(t.shape), t.dtype) for n, t in model.state_dict().items()
                 if n in ckpt}
    check_against_checkpoint(published, {}, ckpt, where="v1")
    name = next(iter(ckpt))
    wrong = {**published, name: Published((3, 3), torch.float32)}
    with pytest.raises(wf.LayoutMismatchError, match="engine's checkpoint"):
        check_against_checkpoint(wrong, {}, ckpt, where="v1")
    with pytest.raises(wf.LayoutMismatchError, match="lacks"):
        check_against_checkpoint({**published, "extra.weight": Published((1,), torch.float32)},
                                 {}, ckpt, where="v1")
    missing = dict(published)
    missing.pop(name)
    with pytest.raises(wf.LayoutMismatchError, match="does not"):
        check_against_checkpoint(missing, {}, ckpt, where="v1")


def test_errors_named_in_vllms_text_come_back_as_their_fabric_type():
    text = ("Call to collective_rpc method failed: Worker failed with error 'UnknownVersionError: "
            "base model 'policy' v9 is absent', please check the stack trace above for the "
            "root cause")
    err = fabric_error(text)
    assert isinstance(err, wf.UnknownVersionError)
    assert str(err) == "base model 'policy' v9 is absent"
    assert fabric_error("Worker failed with error 'RuntimeError: boom'") is None
    assert isinstance(fabric_error('{"error": "LayoutMismatchError: v2 is another model"}'),
                      wf.LayoutMismatchError)


class _Engine:
    """A client that records the phases; ``fail`` makes update_weights raise it."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail
        self.init_info: dict[str, Any] | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.init_info = init_info

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, info: Any) -> None:
        self.calls.append(("update", info))
        if self.fail is not None:
            raise self.fail

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def test_a_session_ends_with_the_version_or_ends_anyway_after_an_error():
    ok = _Engine()
    switch(ok, 4)
    assert ok.calls == [("start", None), ("update", {"version": 4}), ("finish", "4")]
    bad = _Engine(fail=wf.UnknownVersionError("v5"))
    with pytest.raises(wf.UnknownVersionError):
        switch(bad, 5)
    assert bad.calls[-1] == ("finish", None)


def test_fan_out_drives_every_engine_and_raises_the_first_error():
    engines = [_Engine(), _Engine(fail=wf.FetchError("holder gone")), _Engine()]
    with pytest.raises(wf.FetchError):
        switch(wf.vllm.FanOut(engines), 3)
    assert all(e.calls[0] == ("start", None) and e.calls[-1][0] == "finish" for e in engines)
    with pytest.raises(ValueError):
        wf.vllm.FanOut([])


def test_init_info_is_checked_where_vllm_parses_it():
    from weightfabric.fabric.integrations.vllm.worker_engine import (
        WeightfabricInitInfo,
        WeightfabricUpdateInfo,
    )

    with pytest.raises(wf.BadRequestError, match="hub"):
        WeightfabricInitInfo()
    with pytest.raises(wf.BadRequestError, match="load"):
        WeightfabricInitInfo(hub="tcp://h:1", load="somehow")
    with pytest.raises(wf.BadRequestError):
        WeightfabricUpdateInfo(version=0)
    assert WeightfabricUpdateInfo().version == "latest"


def test_the_plugin_registers_both_engines_once():
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from weightfabric.fabric.integrations.vllm.plugin import register

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "weightfabric"]
    assert ep.load() is register
    register()
    register()
    assert WeightTransferEngineFactory._registry["weightfabric"]().__name__ == "WeightfabricEngine"
    assert WeightTransferTrainerFactory._registry["weightfabric"]().__name__ == \
        "WeightfabricTrainerEngine"


def test_importing_weightfabric_or_its_vllm_helpers_loads_no_vllm():
    code = ("import sys, weightfabric as wf; wf.vllm.connect; "
            "print([m for m in sys.modules if m.split('.')[0] == 'vllm'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_sharded_trainer_ranks_publish_one_version_and_rank_0_drives_the_engines(hub):
    from concurrent.futures import ThreadPoolExecutor

    from weightfabric.fabric.integrations.vllm.trainer_engine import WeightfabricTrainerEngine

    engine = _Engine()
    shards = [{"a.weight": torch.full((4, 4), float(r)), f"b{r}.weight": torch.ones(3)}
              for r in range(2)]
    senders = [WeightfabricTrainerEngine.trainer_init(
        wf.vllm.TrainerInitInfo(hub=hub.url, model="sharded", rank=r, world_size=2),
        client=engine, source=shards[r]) for r in range(2)]
    try:
        assert engine.init_info is not None and engine.init_info["model"] == "sharded"
        assert engine.init_info["token"].startswith("wft1.")  # a read token, not the secret
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(s.send_weights) for s in senders]:
                f.result(timeout=60)
        version = senders[0].version
        assert version == senders[1].version == 1
        assert engine.calls == [("start", None), ("update", {"version": 1}), ("finish", "1")]
        with wf.connect(hub.url) as client:
            assert len(client.locate("sharded", version)["shards"]) == 2
    finally:
        for s in senders:
            s.shutdown()


def test_the_trainer_gives_the_engines_a_read_token_it_mints():
    from weightfabric.fabric.integrations.vllm.trainer_engine import _engine_token

    token = _engine_token(wf.vllm.TrainerInitInfo(hub="tcp://h:1", rank=0))
    assert token is not None and token.startswith("wft1.")
    assert _engine_token(wf.vllm.TrainerInitInfo(hub="tcp://h:1", rank=0, engine_token=None)) \
        is None
    with pytest.raises(wf.BadRequestError):
        wf.vllm.TrainerInitInfo(hub="tcp://h:1", rank=2, world_size=2)


def test_a_module_source_is_published_as_its_module_so_dtensors_stay_shards():
    from vllm.distributed.weight_transfer import ModuleSource

    from weightfabric.fabric.integrations.vllm.trainer_engine import _publishable

    module = torch.nn.Linear(4, 4)
    assert _publishable(ModuleSource(module)) is module
    assert _publishable(module) is module
    state = {"w": torch.ones(2)}
    assert _publishable(state) is state

    class Pairs:
        def __iter__(self):
            yield "x", torch.zeros(3)

    assert set(_publishable(Pairs())) == {"x"}
