"""`HubQueries`: a `HubState`'s retracts, retention, rendezvous and read-only queries.

A holder retracts a replica (`retract`, `retract_status`: at once, or delayed while
retention needs it); a model's retention policy changes (`set_retention`, `pin`); the
rendezvous store keeps small values (`kv_put`, `kv_get`); and the queries change nothing:
`latest`, `locate` (where every shard of a version can be read whole), `retained`.
"""

from __future__ import annotations

from weightfabric.fabric.errors import (
    InvalidStateError,
    NoSourceError,
    RetentionError,
    UnknownVersionError,
)
from weightfabric.fabric.hub.records import (
    COMMITTED,
    LIVE,
    RETIRED,
    RETRACTING,
    ModelRecord,
    RetentionPolicy,
)
from weightfabric.fabric.hub.retention import blocks_retention, held_by, retained, retract_state
from weightfabric.fabric.hub.routing import holders
from weightfabric.fabric.hub.state_base import HubStateBase
from weightfabric.fabric.hub_messages import (
    Holder,
    KvPutReply,
    LocateReply,
    LocateShard,
    ManifestWire,
    PolicyReply,
    RetractReply,
)
from weightfabric.fabric.locality import Location


class HubQueries(HubStateBase):
    """The retract, retention, rendezvous and query part of `HubState`."""

    # ----------------------------------------------------------------- retract
    def retract(self, model: str, version: int, worker: str, *, session: str,
                delay: bool = False) -> RetractReply:
        """Stop routing reads to the worker's replicas of a version.

        Returns:
            ``state``: ``done`` — no read may be in
            flight, the holder may overwrite; ``retracting`` — waiting for fetches that may
            read from it (see `retract_status`); ``delayed`` — still routed until another
            replica lets retention hold.

        Raises:
            UnknownVersionError: the worker holds no replica of this version.
            RetentionError: the retract would drop a retained version below
                ``min_replicas`` and ``delay`` is false.
        """
        self._worker(worker, session)
        v = self._version(model, version)
        reps = held_by(v, worker)
        if not reps:
            raise UnknownVersionError(f"{worker!r} holds no replica of {model!r} v{version}")
        blocked = any(blocks_retention(self.models[model], v, r) for r in reps)
        if blocked and not delay:
            policy = self.models[model].policy
            raise RetentionError(
                f"retracting {worker!r}'s replica of {model!r} v{version} would leave fewer "
                f"than min_replicas={policy.min_replicas} live copies of a retained version; "
                "retract with delay (waits for another replica), unpin it, or lower keep_last")
        # Its fetches of the version end now, delayed or not: their replicas are not
        # complete (they never hold retention up), and a fetch must keep its replica.
        for fid in list(self._index.own_fetches.get(worker, ())):
            f = self.fetches[fid]      # a done one is a group member waiting for the others
            if f.model == model and f.version == version:
                self._end_fetch(f, keep_replica=False, reason=f"{worker} retracted")
        reps = [r for r in held_by(v, worker) if r.status == LIVE]
        if blocked:
            for r in reps:
                r.retract_delayed = True
                self._index.delayed.add((model, version, r.shard, worker))
            self._settle()  # the ended fetches' replicas go once no reader is left
            return RetractReply(state="delayed")
        for r in reps:
            r.retract_delayed = False
            self._index.delayed.discard((model, version, r.shard, worker))
            self._index.set_status(v, r, RETRACTING)
        self._settle()
        return RetractReply(state=retract_state(v, worker))

    def retract_status(self, model: str, version: int, worker: str) -> RetractReply:
        """A retract's ``state``: ``done``, ``retracting``, ``delayed`` or ``live``."""
        self.expire()
        m = self.models.get(model)
        v = m.versions.get(version) if m else None
        if v is None:
            return RetractReply(state="done")
        return RetractReply(state=retract_state(v, worker))

    # --------------------------------------------------------------- retention
    def set_retention(self, model: str, *, keep_last: int | None = None,
                      min_replicas: int | None = None) -> PolicyReply:
        """Change a model's retention policy (creates the model if new)."""
        m = self.models.setdefault(model, ModelRecord.named(model))
        policy = RetentionPolicy(keep_last if keep_last is not None else m.policy.keep_last,
                                 min_replicas if min_replicas is not None
                                 else m.policy.min_replicas, set(m.policy.pinned))
        m.policy = policy
        self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._settle()
        return _policy_reply(policy)

    def pin(self, model: str, version: int, pinned: bool = True) -> PolicyReply:
        """Pin (retain regardless of ``keep_last``) or unpin a committed version."""
        v = self._version(model, version)
        policy = self.models[model].policy
        if pinned:
            if v.state == RETIRED:
                raise InvalidStateError(f"{model!r} v{version} is retired; it cannot be pinned")
            policy.pinned.add(version)
        else:
            policy.pinned.discard(version)
        self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._settle()
        return _policy_reply(policy)

    # --------------------------------------------------------------- rendezvous
    def kv_put(self, key: str, value: bytes, *, ttl: float | None = None) -> KvPutReply:
        """Store a small value under ``key`` (last writer wins); kept in the hub's records.

        Args:
            key: 1..`MAX_KV_KEY` bytes of UTF-8; one flat namespace per hub (use prefixes
                such as ``"job-7/nvshmem-uid"``).
            value: at most `MAX_KV_VALUE` bytes.
            ttl: seconds until the key vanishes (None: until the hub stops).

        Returns:
            The value's ``size`` in bytes.

        Raises:
            ValueTooLargeError: the key or value is over its limit, or the hub already
                holds `MAX_KV_KEYS` keys.
            BadRequestError: a ``ttl`` that is not a finite number > 0 (NaN, inf).
            ValueError: empty key.
        """
        self.kv.put(key, value, ttl=ttl)
        self.durable_generation += 1
        self._touch()
        return KvPutReply(size=len(value))

    def kv_get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None when it is absent (or its ttl ran out).

        Raises:
            ValueTooLargeError: the key is over `MAX_KV_KEY` bytes.
            ValueError: empty key.
        """
        return self.kv.get(key)

    # ------------------------------------------------------------------ queries
    def latest(self, model: str) -> int | None:
        """The newest committed version with a complete live replica of every shard."""
        self.expire()
        m = self.models.get(model)
        if m is None:
            return None
        for number in sorted(m.versions, reverse=True):
            if m.versions[number].servable():
                return number
        return None

    def locate(self, model: str, version: int | str, *, worker: str | None = None,
               manifests_only: bool = False) -> LocateReply:
        """Where every shard of a committed version can be read whole.

        Where every shard of a committed version can be read whole, for a reader that does
        not become a replica (it transforms the bytes as it reads them, e.g. to another
        tensor-parallel layout). Read-only: nothing is recorded, so a holder may retract
        meanwhile; its read server then refuses, and the reader tries the next.

        Returns:
            ``model, version, num_shards, shards`` (each ``manifest, holders``) and
            ``workers`` (each ``location, endpoints``); holders ranked for ``worker``'s location.

        Raises:
            UnknownModelError, UnknownVersionError: nothing committed to read.
            NoSourceError: some shard has no complete live replica (with
                ``manifests_only``: its holders are empty instead, e.g. for a reader that
                needs the layout of a version whose derived replicas are held elsewhere).
        """
        self.expire()
        m = self._model(model)
        v = self._version(model, self._resolve(m, version))
        if v.state != COMMITTED:
            raise UnknownVersionError(f"{model!r} v{v.number} is {v.state}, not committed")
        reader = self.workers[worker].location if worker in self.workers else Location()
        shards: list[LocateShard] = []
        for k in range(v.num_shards):
            ranked = holders(v, k, reader, workers=self.workers, load=self._index.load,
                             rank_sources=self.rank_sources)
            if not ranked and not manifests_only:
                raise NoSourceError(f"{model!r} v{v.number} shard {k}: no complete live replica")
            shards.append(LocateShard(manifest=ManifestWire.of(v.manifests[k]), holders=ranked))
        named = sorted({w for sh in shards for w in sh.holders})
        return LocateReply(model=model, version=v.number, num_shards=v.num_shards,
                           shards=shards,
                           workers={w: Holder(location=self.workers[w].location.to_wire(),
                                              endpoints=self.workers[w].endpoints)
                                    for w in named})

    def retained(self, model: str) -> set[int]:
        """Version numbers the model's retention policy keeps."""
        return retained(self.models[model])


def _policy_reply(policy: RetentionPolicy) -> PolicyReply:
    return PolicyReply(keep_last=policy.keep_last, min_replicas=policy.min_replicas,
                       pinned=sorted(policy.pinned))
