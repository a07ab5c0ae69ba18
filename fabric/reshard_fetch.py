"""Fetch a version into another tensor-parallel layout, transforming it as it lands.

The trainer's model-parallel ranks publish their shards of one version
(``worker.model(name, shard=k, num_shards=n)`` and ``publish(group=...)``). A reader
whose layout differs (another TP degree, fused QKV or gate-up split differently,
fp8 stored and bf16 wanted) cannot take any shard as it is. `fetch_resharded`
asks the hub where each shard lives (`HubClient.locate`), plans the rows its rank
needs (`fabric.staging.plan_staging`, bounded by ``budget``), reads each band of
rows from a holder of that shard through the worker's transports, and runs the
reshard and dequantisation kernels into the reader's tensors.

The reader holds no replica: it does not serve what it read, and the hub records
nothing, so a holder may retract meanwhile; its read server then refuses the read
and the next holder of that shard is tried. Bands do not align with chunks, so
their bytes are not checked against the chunk checksums.

fp8: a tensor stored as ``float8_e4m3fn`` carries its blockwise float32 scales as
the tensor ``name + scale_suffix`` of the same shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fabric.errors import ManifestMismatchError, TransportError
from fabric.fetch import FetchError, Source
from fabric.hub_planner import region_name
from fabric.manifest import Manifest
from fabric.staging import FP8, HeldTensor, StagingPlan, WantedTensor, plan_staging, run_staging
from fabric.tensorset import layout_from_manifest
from fabric.transports import SourceAddress
from kernels import Layout

if TYPE_CHECKING:
    from fabric.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resharding:
    """How one logical tensor is split on each side.

    Attributes:
        shape: the logical (unsharded) shape, 1-D or 2-D.
        held: the publishers' layout (its ``tp`` is the version's number of shards).
        wanted: the reader's layout.
    """

    shape: tuple[int, ...]
    held: Layout
    wanted: Layout


@dataclass
class ReshardStats:
    """What `fetch_resharded` did."""

    version: int
    seconds: float = 0.0
    bands: int = 0
    fetched_bytes: int = 0
    useful_bytes: int = 0
    staging_peak_bytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # worker -> bytes read from it
    failed_sources: list[str] = field(default_factory=list)


def held_tensors(manifests: list[Manifest], tensors: Mapping[str, Resharding], *,
                 scale_suffix: str = ".scale") -> list[HeldTensor]:
    """`HeldTensor`s of ``tensors`` from the shards' manifests (offsets, stored dtypes).

    Raises:
        ManifestMismatchError: a tensor (or an fp8 tensor's scales) is missing from a
            shard, or its stored shape is not what the held layout gives that shard.
    """
    layouts = [layout_from_manifest(m) for m in manifests]
    out = []
    for name, r in tensors.items():
        if r.held.tp != len(manifests):
            raise ManifestMismatchError(f"tensor {name!r}: held layout has tp={r.held.tp}, the "
                                        f"version has {len(manifests)} shards")
        offsets, scales, dtypes = [], [], set()
        for k, lay in enumerate(layouts):
            if name not in lay.names:
                raise ManifestMismatchError(f"shard {k} has no tensor {name!r}")
            slot = lay[name]
            want = r.held.shard_shape(r.shape, k)
            if tuple(slot.shape) not in (want, want[:1] if want[1:] == (1,) else want):
                raise ManifestMismatchError(f"tensor {name!r} is {tuple(slot.shape)} in shard {k}; "
                                            f"the held layout gives {want}")
            offsets.append(slot.offset)
            dtypes.add(slot.dtype)
            if slot.dtype == FP8:
                scale = name + scale_suffix
                if scale not in lay.names:
                    raise ManifestMismatchError(f"fp8 tensor {name!r} has no scales {scale!r} "
                                                f"in shard {k}")
                scales.append(lay[scale].offset)
        if len(dtypes) != 1:
            raise ManifestMismatchError(f"tensor {name!r} is stored as {sorted(map(str, dtypes))} "
                                        "in different shards")
        dtype = dtypes.pop()
        out.append(HeldTensor(name=name, shape=tuple(r.shape), layout=r.held, dtype=dtype,
                              offsets=tuple(offsets),
                              scale_offsets=tuple(scales) if dtype == FP8 else None))
    return out


class _ShardReader:
    """``read(shard, offset, out)`` over the holders the hub named, best first, moving
    on to the next holder of a shard when one fails."""

    def __init__(self, worker: Worker, where: dict, *, timeout: float) -> None:
        self.worker, self.timeout = worker, timeout
        self.model, self.version = where["model"], where["version"]
        self.holders = [list(s["holders"]) for s in where["shards"]]
        self.addresses = {w: SourceAddress.from_dict(info["endpoints"]["read"])
                          for w, info in where["workers"].items() if "read" in info["endpoints"]}
        self.failed: list[str] = []
        self.sources: dict[str, int] = {}

    def __call__(self, shard: int, offset: int, out: torch.Tensor) -> None:
        errors = []
        for holder in self.holders[shard]:
            if holder in self.failed or holder not in self.addresses:
                continue
            source = Source(holder, self.addresses[holder],
                            region_name(self.model, self.version, shard))
            try:
                self.worker.transport_for(source).read(source.address, source.region, offset,
                                                       out, timeout=self.timeout)
            except TransportError as exc:
                log.warning("resharded read from %s failed (%s); trying the next holder",
                            holder, exc)
                self.failed.append(holder)
                errors.append(f"{holder}: {exc}")
                continue
            self.sources[holder] = self.sources.get(holder, 0) + out.numel()
            return
        raise FetchError(f"{self.model!r} v{self.version} shard {shard}: no holder could serve "
                         f"bytes [{offset}, {offset + out.numel()}): {'; '.join(errors) or 'none left'}")


def fetch_resharded(worker: Worker, model: str, tensors: Mapping[str, Resharding],
                    dst: Mapping[str, torch.Tensor], *, rank: int, version: int | str = "latest",
                    wanted_dtypes: Mapping[str, torch.dtype] | None = None,
                    budget: int = 64 << 20, scale_suffix: str = ".scale",
                    timeout: float = 30.0) -> ReshardStats:
    """Read ``version`` of a sharded model into this reader's shards of ``tensors``.

    Args:
        worker: the reader's worker (its transports are used).
        model: the model the publishers' ranks publish shards of.
        tensors: name -> `Resharding` (logical shape, held and wanted layouts).
        dst: name -> this rank's destination (the wanted layout's shard shape, any
            device the kernels run on; 1-D tensors as 1-D).
        rank: this reader's rank in the wanted layouts.
        wanted_dtypes: dtype per tensor (default: each ``dst`` tensor's dtype).
        budget: staging bytes at any one time.
        timeout: per band read.

    Returns:
        `ReshardStats`.

    Raises:
        UnknownModelError, UnknownVersionError, NoSourceError: from the hub.
        ManifestMismatchError: the shards do not hold the tensors as described.
        FetchError: some band could not be read from any holder of its shard.
        ValueError, TypeError: bad layouts, budget or destinations (see `plan_staging`).
    """
    missing = sorted(set(tensors) - set(dst))
    if missing:
        raise ValueError(f"resharded fetch: no destination for {missing}")
    start = time.monotonic()
    where = worker.hub.locate(model, version)
    manifests = [Manifest.from_wire(s["manifest"]) for s in where["shards"]]
    held = held_tensors(manifests, tensors, scale_suffix=scale_suffix)
    dtypes = dict(wanted_dtypes or {})
    wanted = [WantedTensor(name=n, layout=r.wanted, dtype=dtypes.get(n, dst[n].dtype))
              for n, r in tensors.items()]
    plan: StagingPlan = plan_staging(held, wanted, rank=rank, budget=budget)
    read = _ShardReader(worker, where, timeout=timeout)
    staged = run_staging(plan, read, dst)
    stats = ReshardStats(version=where["version"], seconds=time.monotonic() - start,
                         bands=staged.bands, fetched_bytes=staged.fetched_bytes,
                         useful_bytes=plan.useful_bytes, staging_peak_bytes=staged.peak_bytes,
                         sources=read.sources, failed_sources=read.failed)
    log.info("fetched %s v%d resharded for rank %d: %d bands, %d bytes in %.3f s", model,
             stats.version, rank, stats.bands, stats.fetched_bytes, stats.seconds)
    return stats
