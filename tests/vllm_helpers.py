"""Real vLLM engines for the tests: tiny random models, one engine per module, torn down after.

An engine starts in about 40 s on the CI's two cores, so modules share theirs
(module-scoped fixtures) and tests compare inside the workers through
``collective_rpc`` (the functions below run in each vLLM worker process).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

# vLLM reads these when it starts an engine: a small KV cache, functions over collective_rpc
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

CONFIGS: dict[str, dict[str, Any]] = {
    # GQA (4 heads, 2 kv heads), untied; head_dim 64 (vLLM's CPU attention wants >= 32)
    "llama": {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": False},
    # q/k/v biases, tied embeddings
    "qwen2": {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": True},
    # no ready-made layout: lands through vLLM's load_weights
    "gpt2": {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 256, "n_layer": 2,
             "n_head": 4, "n_positions": 256},
}
PROMPTS = [[1, 2, 3, 4], [7, 9, 11, 13, 15, 17]]


def hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A Hugging Face causal LM of ``family`` (`CONFIGS`), random, fp32 (a trainer's)."""
    import transformers

    fields = {**CONFIGS[family], **overrides}
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def save_bf16(model: torch.nn.Module, path: Path) -> str:
    """``model`` as a bf16 ``save_pretrained`` checkpoint in ``path`` (what the fabric serves)."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def train_step(model: torch.nn.Module, seed: int) -> None:
    """Change every weight a little, as an optimizer step would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


@contextlib.contextmanager
def engine(checkpoint: str, *, tp: int = 1, inprocess: bool = False,
           **kwargs: Any) -> Iterator[Any]:
    """An offline ``vllm.LLM`` with the ``weightfabric`` backend.

    ``inprocess`` runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    about half the start-up; two such engines cannot live in one process at once). Not the
    default: its workers set process-wide state (e.g. ``LD_PRELOAD`` of libgomp in the
    environment every later child inherits) that made later multi-process tests hang at
    exit. The environment is restored afterwards either way. Every process it started is
    gone afterwards, also when the test fails.
    """
    from vllm import LLM, envs
    from vllm.config import WeightTransferConfig

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    shm_before = set(mp_shm())
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if inprocess else "1"}
    if tp > 1:  # one core per worker (without it: "Not enough allowed NUMA nodes")
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
    saved = dict(os.environ)
    llm = None
    try:
        os.environ.update(env)
        envs.disable_envs_cache()  # an in-process engine core froze vLLM's reading of them
        llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=128, enforce_eager=True, tensor_parallel_size=tp,
                  enable_prefix_caching=False, seed=0,
                  weight_transfer_config=WeightTransferConfig(backend="weightfabric"), **kwargs)
        yield llm
    finally:
        os.environ.clear()     # what vLLM set here (LD_PRELOAD, ...) must not reach later tests
        os.environ.update(saved)
        envs.disable_envs_cache()
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        kill_new_children(me, before)
        for path in set(mp_shm()) - shm_before:  # the engine's queues, now unused
            path.unlink(missing_ok=True)


def mp_shm() -> list[Path]:
    """Shared memory and semaphores of Python's multiprocessing (vLLM's message queues)."""
    shm = Path("/dev/shm")
    return [*shm.glob("psm_*"), *shm.glob("sem.mp-*")] if shm.is_dir() else []


def kill_new_children(me: psutil.Process, before: set[int]) -> None:
    """Kill the processes under ``me`` that were not there ``before``; wait for them.

    Python's multiprocessing resource tracker is spared: it removes the shared memory
    vLLM registered with it once its users are gone.
    """
    left = [p for p in me.children(recursive=True)
            if p.pid not in before and not _is_resource_tracker(p)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=30)


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except psutil.Error:
        return False


def generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and their logprobs for `PROMPTS` (8 tokens each)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids, strict=True)]
        result.append((list(c.token_ids), logprobs))
    return result


# ---- run in each vLLM worker (collective_rpc) ------------------------------------------
def params_of(worker: Any) -> dict[str, torch.Tensor]:
    """The model's parameters, copied."""
    return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}


def record_of(worker: Any) -> dict[str, Any] | None:
    """The weightfabric engine's last update (`UpdateRecord`) and its landing mode."""
    e = worker.weight_transfer_engine
    return None if e.last is None else {**vars(e.last), "choice": e.choice.mode,
                                        "worker": e.worker.name if e.worker else None}


def params_in_fabric_memory(worker: Any) -> bool:
    """True when every parameter is a view of the weightfabric store's active buffer."""
    buffer = worker.weight_transfer_engine.store.store.pool.active.region.tensor
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return all(lo <= p.data_ptr() < hi
               for p in worker.model_runner.get_model().parameters())


def linears_unpacked(worker: Any) -> bool:
    """True when vLLM kept its linear layers' weights as loaded (no prepacked kernel)."""
    model = worker.model_runner.get_model()
    return all(p.dim() == 2 and p.numel() > 0 for n, p in model.named_parameters()
               if n.endswith("_proj.weight"))


def vllm_own_load(llm: Any, checkpoint: str) -> list[dict[str, torch.Tensor]]:
    """Reload ``checkpoint`` with vLLM's own loader in every worker; the parameters after."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
    return llm.collective_rpc(params_of)


def differing(ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]
              ) -> list[str]:
    """``rank:name`` of every parameter that is not bit-identical in the two snapshots."""
    out = []
    for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.keys() == b.keys()
        out += [f"{rank}:{n}" for n in a if not torch.equal(a[n], b[n])]
    return out
