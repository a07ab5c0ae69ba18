"""The trainer side of the ``weightfabric`` backend: publish, then tell the engines the version.

vLLM's trainer engines (`TrainerWeightTransferEngine`) push bytes to the engines; this one
publishes them to the fabric and hands the engines a version number, and the engines pull
it from whoever holds it (this trainer, and every engine that has it already)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from weightfabric.fabric.integrations.vllm import LLMClient, TrainerInitInfo

    info = TrainerInitInfo(hub=url, model="policy", rank=0)
    sender = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm),
                                                       source=ModuleSource(model))
    for step in range(steps):
        ...                      # train
        sender.send_weights()    # publish v, then start / update {"version": v} / finish

`trainer_init` joins the fabric as ``trainer-<rank>`` (every rank of a sharded trainer),
and rank 0 initialises the engines with the hub's address, the model's name and a read-
only token it mints for them (when it holds the deployment secret). `send_weights`
publishes the source as it is: an FSDP2 module's DTensors as each rank's local shards
(no ``full_tensor()`` gather), float32 stored as ``dtype`` while packing; rank 0 waits for
the version's commit, then drives ``start_weight_update``, ``update_weights({"version":
v})`` and ``finish_weight_update(weight_version=str(v))`` on the client.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import TrainerInitInfo as _VllmTrainerInitInfo
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from weightfabric.fabric.auth import Authority
from weightfabric.fabric.errors import AuthenticationError, BadRequestError
from weightfabric.fabric.integrations.vllm.clients import switch
from weightfabric.fabric.worker import Worker, join

log = logging.getLogger(__name__)

ENGINE_TOKEN_TTL_S = 7 * 24 * 3600.0
"""Lifetime of the read token `trainer_init` mints for the engines."""


@dataclass
class TrainerInitInfo(_VllmTrainerInitInfo):
    """The ``weightfabric`` trainer engine's init info (``rank`` is keyword-only).

    Attributes:
        hub: the hub's URL.
        model: the model's name at the hub.
        world_size: ranks publishing shards of the model (an FSDP2 trainer's world).
        worker: this rank's worker name (default ``trainer-<rank>``).
        host: the address this rank's read server listens on (engines must reach it).
        location: ``{"datacenter", "node", ...}`` for the hub's routing.
        secret, secret_file, insecure: this rank's credential (`fabric.join`).
        dtype: store float32 tensors in this dtype while publishing (``None``: as they are).
        engine_token: what the engines authenticate with: ``"auto"`` (a read-only token
            minted from the deployment secret when this rank holds it, else nothing: the
            engines then use their host's own), a token's text, or None.
        engine_options: more of the engines' init info (`WeightfabricInitInfo`: ``load``,
            ``in_place``, ``verify``, ``deltas``, ``timeout``, ``host``, ...).
        commit_timeout: seconds rank 0 waits for a sharded version's commit.
    """

    backend: ClassVar[str] = "weightfabric"
    hub: str = ""
    model: str = "policy"
    world_size: int = 1
    worker: str | None = None
    host: str = "127.0.0.1"
    location: dict[str, str] | None = None
    secret: str | None = None
    secret_file: str | None = None
    insecure: bool = False
    dtype: str | None = "bfloat16"
    engine_token: str | None = "auto"
    engine_options: dict[str, Any] = field(default_factory=dict)
    commit_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.hub:
            raise BadRequestError("TrainerInitInfo needs hub=: the hub's URL")
        if not 0 <= self.rank < self.world_size:
            raise BadRequestError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None),
                                                      torch.dtype):
            raise BadRequestError(f"dtype {self.dtype!r} is no torch dtype (e.g. 'bfloat16')")


class WeightfabricTrainerEngine(TrainerWeightTransferEngine[TrainerInitInfo]):
    """Publish each round's weights to the fabric; the engines pull them (module docstring)."""

    init_info_cls = TrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, info: TrainerInitInfo,
                 worker: Worker) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.worker = info, worker
        self.store = worker.model(info.model, shard=info.rank, num_shards=info.world_size)
        self.version: int | None = None
        """The last version `send_weights` published (and the engines now serve)."""
        self._rounds = 0

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any,
                     source: Any = None) -> WeightfabricTrainerEngine:
        """Join the fabric; rank 0 initialises the engines through ``client``.

        Raises:
            BadRequestError: no ``source``.
            HubUnavailableError, AuthenticationError: from joining the fabric.
        """
        if source is None:
            raise BadRequestError("the weightfabric trainer engine needs source= (a "
                                  "WeightSource, a module or a state dict)")
        info = init_info
        worker = join(info.hub, worker=info.worker or f"trainer-{info.rank}", host=info.host,
                      location=info.location, secret=info.secret,
                      secret_file=info.secret_file, insecure=info.insecure)
        try:
            engine = cls(client=client, source=source, is_sender=info.is_sender, info=info,
                         worker=worker)
            if engine.is_sender:
                client.init_weight_transfer_engine(engine.engine_init_info())
        except BaseException:
            worker.close()
            raise
        return engine

    def engine_init_info(self) -> dict[str, Any]:
        """What the engines get at ``init_weight_transfer_engine`` (`WeightfabricInitInfo`)."""
        info = self.info
        out: dict[str, Any] = {"hub": info.hub, "model": info.model, "insecure": info.insecure}
        token = _engine_token(info)
        if token is not None:
            out["token"] = token
        return {**out, **info.engine_options}

    def send_weights(self) -> None:
        """Publish the source as a new version and switch every engine to it.

        Raises:
            what `ModelStore.publish` raises, and the engines' typed errors (through the
            client): they keep serving the previous version then.
        """
        info = self.info
        dtype = None if info.dtype is None else getattr(torch, info.dtype)
        group = f"round-{self._rounds}" if info.world_size > 1 else None
        version = self.store.publish(_publishable(self.source), dtype=dtype, group=group)
        self._rounds += 1
        if self.is_sender:
            if info.world_size > 1:  # a sharded version is there once every shard is
                self.worker.hub.wait_version(info.model, after=version - 1,
                                             timeout=info.commit_timeout)
            switch(self.client, version)
        self.version = version
        log.info("%s: v%d published and served", self.worker.name, version)

    def shutdown(self) -> None:
        """Leave the fabric (the engines keep what they hold, and serve it to each other)."""
        self.worker.close()


def _publishable(source: Any) -> nn.Module | Mapping[str, torch.Tensor]:
    """What `ModelStore.publish` takes, from a module, a state dict or a vLLM `WeightSource`.

    vLLM's ``ModuleSource`` is unwrapped to its module, so DTensors are published as local
    shards; any other source is iterated (which gathers DTensors: prefer a module).
    """
    if isinstance(source, nn.Module | Mapping):
        return source
    module = vars(source).get("_module") if hasattr(source, "__dict__") else None
    if isinstance(module, nn.Module):
        return module
    return dict(iter(source))


def _engine_token(info: TrainerInitInfo) -> str | None:
    """The credential the engines get (`TrainerInitInfo.engine_token`)."""
    if info.engine_token != "auto":
        return info.engine_token
    if info.insecure or info.secret is not None:
        return None
    try:
        authority = Authority(info.secret_file)  # None: the default lookup
    except (AuthenticationError, OSError, ValueError):
        return None  # this rank holds a token, not the secret: engines bring their own
    return authority.issue_token(f"vllm-{info.model}", ["read"], ttl=ENGINE_TOKEN_TTL_S)


__all__ = ["ENGINE_TOKEN_TTL_S", "TrainerInitInfo", "WeightfabricTrainerEngine"]
