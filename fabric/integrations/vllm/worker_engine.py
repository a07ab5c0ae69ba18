"""The ``weightfabric`` backend of vLLM's weight-transfer API: the engine in each vLLM worker.

vLLM builds one `WeightfabricEngine` per worker process (every TP/PP rank of every
engine) when the engine is started with ``weight_transfer_config={"backend":
"weightfabric"}``; the project's ``vllm.general_plugins`` entry point registered the name
(`plugin.register`). The trainer side (or anyone: ``curl`` on ``vllm serve``) then calls
the four phases:

``init_weight_transfer_engine({"init_info": {"hub": URL, "model": "policy", ...}})``
    The worker joins the fabric as ``<engine>-rank<r>`` (`WeightfabricInitInfo`) and
    chooses how versions land in its parameters (`landing.choose`): straight in, where
    the model's parameters are vLLM's layout of a supported architecture
    (`fabric.relayout.engines.vllm_layout`), or through the model's ``load_weights``.
``start_weight_update()``
    Nothing: the whole update happens in the next call, so that a failure leaves the
    weights untouched (vLLM drops a session whose update failed, and would never call
    ``finish`` to undo a reload begun in ``start``).
``update_weights({"update_info": {"version": N | "latest"}})``
    Every rank of the engine agrees on the version (rank 0 resolves ``"latest"``),
    fetches it in its own layout (a `LayoutStore`: the rank's TP shard derived from the
    published tensors once per layout and rank, copied from peers that hold it after
    that; or, for ``load_weights``, the published tensors whole), verified. Then the
    ranks tell each other whether they have it: only if all do does each land it
    (`landing`); otherwise every rank raises the first failure, and all keep the
    weights they had. A version already landed is a no-op. The worker stays a holder of
    what it fetched: later engines read from it.
``finish_weight_update(weight_version=...)``
    Nothing here; vLLM records the version string.

Errors are the fabric's typed errors (`fabric.errors`). The ranks agree on the outcome
first, and only the engine's last rank raises (`_one_rank_raises` says why); vLLM carries
the error to the caller as text that starts with the error's class name, which the
fabric's clients (`fabric.integrations.vllm.clients`) raise again as the same type. After
any error every rank serves the weights it had.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightfabric.fabric import errors
from weightfabric.fabric.checks import check_version
from weightfabric.fabric.client import locate_data
from weightfabric.fabric.errors import FabricError, LayoutMismatchError, UnknownVersionError
from weightfabric.fabric.fetch import FetchOptions
from weightfabric.fabric.integrations.vllm.landing import (
    MODES,
    Choice,
    DirectLanding,
    Landing,
    LoaderLanding,
    check_against_checkpoint,
    checkpoint_shapes,
    choose,
    rank_specs,
)
from weightfabric.fabric.manifest import Manifest
from weightfabric.fabric.relayout.derive import PublishedVersion
from weightfabric.fabric.relayout.engines import hf_layout
from weightfabric.fabric.worker import Worker, join

if TYPE_CHECKING:
    from weightfabric.fabric.relayout.replica import LayoutStore

log = logging.getLogger(__name__)


@dataclass
class WeightfabricInitInfo(WeightTransferInitInfo):
    """``init_info`` of the ``weightfabric`` backend (plain JSON in ``vllm serve``'s route).

    Attributes:
        hub: the hub's URL (what ``fabric hub serve`` printed).
        model: the published model's name.
        token: the credential, as text: a token (``fabric hub token --role read``; what
            the trainer engine passes by default) or the deployment secret.
        secret_file: a file holding the credential, on the engine's host (default: the
            fabric's usual lookup, ``$WEIGHTFABRIC_SECRET_FILE`` then
            ``~/.config/weightfabric/secret``).
        insecure: talk to a hub started with ``--insecure`` (says so loudly).
        engine: this engine's name; its workers join as ``<engine>-rank<r>`` (default
            ``vllm-<host>-<vLLM instance id>``).
        host: the address the workers' read servers listen on (peers must reach it).
        location: ``{"datacenter", "node", ...}`` for the hub's routing.
        load: ``auto``, ``direct`` or ``load_weights`` (`landing.choose`).
        in_place: with direct landing, the parameters become views of the fabric's buffer
            (no copy per update, one copy less in memory); only with ``enforce_eager``
            (no CUDA graphs, nothing that keeps parameter addresses). The engine must not
            generate during an update.
        verify: check chunk checksums (None: the fabric's default, every chunk).
        deltas: ``auto``, ``on`` or ``off`` (`FetchOptions.deltas`).
        timeout: seconds an update may take (wait for a deriving peer included).
    """

    hub: str = ""
    model: str = "policy"
    token: str | None = None
    secret_file: str | None = None
    insecure: bool = False
    engine: str | None = None
    host: str = "127.0.0.1"
    location: dict[str, str] | None = None
    load: str = "auto"
    in_place: bool = False
    verify: bool | None = None
    deltas: str = "auto"
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.hub, str) or not self.hub:
            raise errors.BadRequestError("init_info needs 'hub': the hub's URL "
                                         "(what `fabric hub serve` printed)")
        if self.load not in MODES:
            raise errors.BadRequestError(f"init_info 'load' must be one of {', '.join(MODES)}, "
                                         f"got {self.load!r}")
        if not (isinstance(self.timeout, int | float) and self.timeout > 0):
            raise errors.BadRequestError(f"init_info 'timeout' must be > 0 s, got {self.timeout!r}")


@dataclass
class WeightfabricUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the ``weightfabric`` backend: the version to serve.

    Attributes:
        version: an ``int > 0`` or ``"latest"`` (the newest committed version).
    """

    version: int | str = "latest"

    def __post_init__(self) -> None:
        self.version = check_version(self.version)


@dataclass
class UpdateRecord:
    """What one rank's last update did (read it through ``collective_rpc``)."""

    version: int
    mode: str
    fetch_s: float = 0.0
    land_s: float = 0.0
    bytes: int = 0
    derived: bool = False
    sources: dict[str, int] = field(default_factory=dict)
    noop: bool = False


class WeightfabricEngine(WeightTransferEngine[WeightfabricInitInfo, WeightfabricUpdateInfo]):
    """vLLM's worker-side weight-transfer engine over the fabric (module docstring)."""

    init_info_cls = WeightfabricInitInfo
    update_info_cls = WeightfabricUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker: Worker | None = None
        self.info: WeightfabricInitInfo | None = None
        self.choice: Choice | None = None
        self.store: LayoutStore | None = None
        self.landing: Landing | None = None
        self.landed: int | None = None
        """The fabric version the engine's parameters hold (None: its checkpoint's)."""
        self.landed_from: tuple[str, str] | None = None
        """The (hub, model) whose version `landed` is."""
        self.last: UpdateRecord | None = None
        self._store_key: object = None
        self._attached: dict[str, torch.Tensor] | None = None  # in_place: the parameters

    # ------------------------------------------------------------------ phases
    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """`WeightfabricInitInfo` of ``init_dict``; a bad one is raised by `init_transfer_engine`."""
        try:
            return super().parse_init_info(init_dict)
        except Exception as exc:
            return _Refused(exc)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        """`WeightfabricUpdateInfo` of ``update_dict``; a bad one is raised by `receive_weights`."""
        try:
            return super().parse_update_info(update_dict)
        except Exception as exc:
            return _Refused(exc)

    def init_transfer_engine(self, init_info: WeightfabricInitInfo) -> None:
        """Join the fabric and choose how versions land here (module docstring).

        Every rank of the engine joins, or none does (a rank that joined leaves again).

        Raises:
            BadRequestError: bad ``init_info`` (no hub, an unknown ``load``, ...).
            HubUnavailableError, AuthenticationError: from joining the fabric.
            LayoutMismatchError: ``load="direct"`` and the parameters are not vLLM's layout.
        """
        failure = init_info.error if isinstance(init_info, _Refused) else None
        if failure is None:
            try:
                self._init(init_info)
            except Exception as exc:
                failure = exc
        first = _first_failure(failure)
        if first is not None:
            if failure is None:  # another rank failed: leave too
                self.shutdown()
            _one_rank_raises(first)

    def start_weight_update(self) -> None:
        """Nothing to prepare: `receive_weights` fetches, then lands, in one step."""

    def finish_weight_update(self) -> None:
        """Nothing to finish (vLLM records the ``weight_version`` string)."""

    def receive_weights(self, update_info: WeightfabricUpdateInfo) -> None:
        """Fetch the version in this rank's layout, agree with the other ranks, land it.

        Raises:
            BadRequestError: a bad version (e.g. 0); from `WeightfabricUpdateInfo`.
            InvalidStateError: `init_transfer_engine` has not run.
            UnknownVersionError: no such committed version (or it was retired).
            HubUnavailableError: the hub does not answer.
            LayoutMismatchError: the version is another model than the engine's.
            FetchError: its bytes could not be read from any holder.
            FabricError: the landing failed (the message says what the engine serves).
        """
        failure = update_info.error if isinstance(update_info, _Refused) else None
        version: int | None = None
        if failure is None:
            version, failure = self._agree_version(update_info.version)
        fetched: tuple[UpdateRecord, Any] | None = None
        if failure is None and version is not None and version != self.landed:
            try:
                fetched = self._fetch(version, self._require_init())
            except Exception as exc:
                failure = exc
        first = _first_failure(failure)
        if first is not None:
            _one_rank_raises(first)
            return
        assert version is not None and self.landing is not None
        if fetched is None:  # landed already, on every rank
            self.last = UpdateRecord(version, self.landing.mode, noop=True)
            return
        record, tensors = fetched
        start = time.monotonic()
        try:
            self.landing.land(tensors)
        except Exception as exc:
            failure = self._landing_failed(version, exc)
        first = _first_failure(failure)
        if first is not None:
            _one_rank_raises(first)
            return
        record.land_s = time.monotonic() - start
        self.landed, self.last = version, record
        self.landed_from = (self.info.hub, self.info.model) if self.info else None
        log.info("%s: v%d landed (%s): fetched %d bytes in %.3f s, landed in %.3f s",
                 self.worker.name if self.worker else "?", version, record.mode,
                 record.bytes, record.fetch_s, record.land_s)

    def _init(self, init_info: WeightfabricInitInfo) -> None:
        if self.worker is not None:
            if init_info == self.info:
                return  # the same trainer, again: nothing to do
            self.shutdown()
        if self.landed_from != (init_info.hub, init_info.model):
            self.landed = None  # version numbers of another model say nothing of these weights
        from vllm.distributed import parallel_state as ps

        tp_group, world = ps.get_tp_group(), ps.get_world_group()
        parallel = self.vllm_config.parallel_config
        name = init_info.engine or (f"vllm-{socket.gethostname()}-"
                                    f"{self.vllm_config.instance_id or 'engine'}")
        dp = parallel.data_parallel_size
        worker_name = (f"{name}-dp{parallel.data_parallel_rank}-rank{world.rank_in_group}"
                       if dp > 1 else f"{name}-rank{world.rank_in_group}")
        params = dict(self.model.named_parameters())
        moe = bool(getattr(self.model_config.hf_config, "num_experts", 0)
                   or getattr(self.model_config.hf_config, "num_local_experts", 0))
        choice = choose(init_info.load, hf_config=self.model_config.hf_config,  # type: ignore[arg-type]
                        params=params, dtype=self.model_config.dtype,
                        tp=tp_group.world_size, tp_rank=tp_group.rank_in_group,
                        quantization=self.model_config.quantization,
                        pipeline=parallel.pipeline_parallel_size,
                        ep=dp if moe else 1, ep_rank=parallel.data_parallel_rank if moe else 0,
                        expert_parallel=bool(parallel.enable_expert_parallel))
        if init_info.in_place and choice.mode == "direct" and not self._addresses_free():
            raise errors.BadRequestError(
                "in_place needs an engine that keeps no parameter addresses (start it with "
                "enforce_eager=True); this one uses CUDA graphs or compilation")
        worker = join(init_info.hub, worker=worker_name, host=init_info.host,
                      location=init_info.location, secret=init_info.token,
                      secret_file=init_info.secret_file, insecure=init_info.insecure)
        self.worker, self.info, self.choice = worker, init_info, choice
        self.landing = (DirectLanding(params) if choice.mode == "direct"
                        else LoaderLanding(self.model, self.model_config))
        if choice.mode == "direct":
            assert choice.layout is not None
            store = worker.layout_model(init_info.model, choice.layout, rank=choice.rank,
                                        device=self._store_device(), derive_wait=init_info.timeout)
            if init_info.in_place:  # in the layout's order, as the store lays versions out
                specs = rank_specs(choice.layout, choice.rank, self.model_config.dtype)
                self._attached = {n: params[n] for n in specs}
                store.attach(self._attached)
            self.store, self._store_key = store, "direct"
        log.info("%s joined %s for %r: lands versions %s (%s)", worker_name, init_info.hub,
                 init_info.model, choice.mode, choice.reason)

    def shutdown(self) -> None:
        """Leave the fabric (the engine keeps serving the weights it has)."""
        if self._attached is not None:  # in_place: move the weights out of the fabric's memory
            with torch.no_grad():
                for param in self._attached.values():
                    param.data = param.data.clone()
            self._attached = None
        if self.worker is not None:
            self.worker.close()
        self.worker = self.store = self.landing = self.choice = self.info = None
        self._store_key = None

    # ------------------------------------------------------------------ helpers
    def _require_init(self) -> WeightfabricInitInfo:
        if self.info is None or self.worker is None:
            raise errors.InvalidStateError(
                "the weightfabric weight-transfer engine is not initialised: call "
                "init_weight_transfer_engine({'init_info': {'hub': URL, 'model': NAME}}) first")
        return self.info

    def _addresses_free(self) -> bool:
        """True when vLLM captures no parameter addresses (eager, no CUDA graphs)."""
        return bool(getattr(self.model_config, "enforce_eager", False))

    def _store_device(self) -> torch.device | str:
        return self.device if self.device.type == "cuda" else "cpu"

    def _agree_version(self, asked: int | str) -> tuple[int | None, Exception | None]:
        """The version every rank updates to: ``asked``, or rank 0's ``"latest"``."""
        if asked != "latest":
            return int(asked), None
        number: int | None = None
        error: Exception | None = None
        if _rank() == 0:
            try:
                info = self._require_init()
                assert self.worker is not None
                number = self.worker.hub.latest(info.model)
                if number is None:
                    raise UnknownVersionError(f"{info.model!r} has no committed version yet")
            except Exception as exc:
                error = exc
        number, why = _broadcast((number, _describe(error)))
        if why is not None:
            return None, error or _rebuild(why)
        return number, None

    def _fetch(self, version: int, info: WeightfabricInitInfo) -> tuple[UpdateRecord, Any]:
        """Fetch ``version`` into this rank's store, verified; return its record and tensors."""
        start = time.monotonic()
        options = FetchOptions(deltas=info.deltas)
        store = self.store if self._store_key == "direct" else self._loader_store(version)
        assert store is not None and self.landing is not None
        stats = store.fetch(version, verify=info.verify, options=options)
        record = UpdateRecord(version, self.landing.mode, fetch_s=time.monotonic() - start,
                              bytes=stats.bytes, derived=stats.derived,
                              sources=dict(stats.sources))
        return record, store.tensors

    def _loader_store(self, version: int) -> LayoutStore:
        """The store of the published tensors whole (``load_weights``), for their layout.

        One per published tensor set, checked against the engine's own checkpoint first.
        Only the version's manifests are needed here: its published tensors' holders may
        all be gone while engines hold it in this layout (the store copies it from them).
        """
        assert self.worker is not None and self.info is not None
        where = locate_data(self.worker.hub.locate_reply(self.info.model, version,
                                                         manifests_only=True))
        manifests = [Manifest.from_wire(s["manifest"]) for s in where["shards"]]
        published = PublishedVersion.of(manifests)
        key = tuple(sorted((n, p.shape, str(p.dtype)) for n, p in published.tensors.items()))
        if self.store is not None and self._store_key == key:
            return self.store
        shapes = checkpoint_shapes(self.model_config.model)
        if shapes is not None:
            check_against_checkpoint(published.tensors, published.aliases, shapes,
                                     where=f"{self.info.model!r} v{version}")
        if self.store is not None:
            self.store.close()
        layout = hf_layout(published.tensors, dtype=self.model_config.dtype,
                           name=f"hf-{_model_type(self.model_config)}")
        self.store = self.worker.layout_model(self.info.model, layout, rank=0,
                                              device=self._store_device(),
                                              derive_wait=self.info.timeout)
        self._store_key = key
        return self.store

    def _landing_failed(self, version: int, exc: Exception) -> FabricError:
        """A landing that raised: restore the previous version where possible; the error."""
        what = f"{type(exc).__name__}: {exc}"
        if isinstance(self.landing, LoaderLanding) and self.landed is not None \
                and self.store is not None:
            try:
                self.store.fetch(self.landed)
                self.landing.land(self.store.tensors)
                return LayoutMismatchError(f"v{version} could not be loaded ({what}); the "
                                           f"engine serves v{self.landed} again")
            except Exception as again:
                what += f"; restoring v{self.landed} failed too ({again})"
        return FabricError(f"v{version} could not be loaded ({what}); the engine's weights "
                           "may be mixed: update it to a good version")


@dataclass
class _Refused:
    """An init or update info that could not be parsed; its error is raised later."""

    error: Exception


def _first_failure(failure: Exception | None) -> Exception | None:
    """The first failure among the engine's ranks (its type and text), or None.

    Every rank calls this at the same point (a collective): ``failure`` is its own.
    """
    mine = _describe(failure)
    first = next((w for w in _gather(mine) if w is not None), None)
    if first is None:
        return None
    return failure if failure is not None and mine == first else _rebuild(first)


def _one_rank_raises(exc: Exception) -> None:
    """Raise ``exc`` on the engine's last rank, with its type's name leading its text.

    vLLM's multiprocess executor reads its workers' replies in rank order and stops at
    the first failure, leaving the later ranks' replies queued, where the next call
    reads them as its own (a stale answer, then every call off by one). With only the
    last rank failing, every reply is read. vLLM hands the error to the caller as
    ``Worker failed with error '<text>'``, without its type: with the name in the text
    the fabric's clients raise the same type again (`clients.fabric_error`).
    """
    group = _group()
    if group is not None and group.rank_in_group != group.world_size - 1:
        log.warning("update refused (%s); the engine's last rank reports it", _describe(exc))
        return
    text = _describe(exc) or ""
    if isinstance(exc, FabricError) and str(exc).startswith(f"{type(exc).__name__}: "):
        raise exc
    named = type(exc)(text) if isinstance(exc, FabricError) else FabricError(text)
    raise named from exc


def _model_type(model_config: Any) -> str:
    return str(getattr(model_config.hf_config, "model_type", "model") or "model")


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _rebuild(text: str) -> FabricError:
    """The fabric error a ``"Type: message"`` text names (`FabricError` if none)."""
    name, _, message = text.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, FabricError):
        return cls(message)
    return FabricError(text)


def _group() -> Any:
    """The world group of this vLLM engine (its CPU process group), or None alone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from vllm.distributed import parallel_state as ps

    world = ps.get_world_group()
    return world if world.world_size > 1 else None


def _rank() -> int:
    group = _group()
    return 0 if group is None else int(group.rank_in_group)


def _broadcast(obj: Any) -> Any:
    group = _group()
    return obj if group is None else group.broadcast_object(obj, src=0)


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    group = _group()
    if group is None:
        return [obj]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


__all__ = ["UpdateRecord", "WeightfabricEngine", "WeightfabricInitInfo", "WeightfabricUpdateInfo"]
