"""`HubRestoring`: what a restarted `HubState` gets back, and what it must keep.

After a hub restart each worker re-registers what it holds (`restore`: replicas, single
fetches, and the shards it published, every holding checked first by `parse_holding`);
a holding re-enters publishing where its version is still publishing, so this part builds
on `state_publish`. `durable` is what a state dir keeps (`fabric.hub.persist`).
"""

from __future__ import annotations

from weightfabric.fabric.errors import BadRequestError, InvalidStateError, ManifestMismatchError
from weightfabric.fabric.hub.persist import DurableState
from weightfabric.fabric.hub.records import (
    COMMITTED,
    PUBLISHING,
    RETIRED,
    FetchRecord,
    ModelRecord,
    Replica,
    VersionRanges,
    VersionRecord,
)
from weightfabric.fabric.hub.state_base import _check_shard
from weightfabric.fabric.hub.state_publish import HubPublishing, check_manifest_size, derived_base
from weightfabric.fabric.hub_messages import Holding, RestoreReply
from weightfabric.fabric.manifest import Manifest


class HubRestoring(HubPublishing):
    """The restart part of `HubState`: `restore` holdings, keep what is `durable`."""

    def restore(self, worker: str, *, session: str, holdings: list[Holding]) -> RestoreReply:
        """Re-register what a worker holds after a hub restart (soft state).

        Every holding is checked before anything changes (`parse_holding`); then each
        is restored, or rejected when it does not fit what the hub knows. A holding of
        a fetch group, not complete, is rejected: groups do not survive a restart.

        Returns:
            How many were ``restored``, and ``[(model, version, shard, why)]`` of each
            ``rejected``.

        Raises:
            BadRequestError: a malformed holding (nothing changed).
        """
        self._worker(worker, session)
        parsed = [(h, parse_holding(h)) for h in holdings]
        restored, rejected = 0, []
        try:
            for h, manifest in parsed:
                try:
                    self._restore_one(worker, h, manifest)
                    restored += 1
                except (ManifestMismatchError, InvalidStateError, ValueError) as exc:
                    rejected.append((h.model, h.version, h.shard, str(exc)))
        finally:        # even a bug half-way leaves retention and retracts settled
            self._settle()
        return RestoreReply(restored=restored, rejected=rejected)

    def _restore_one(self, worker: str, h: Holding, manifest: Manifest) -> None:
        model, number, shard, num_shards = h.model, h.version, h.shard, h.num_shards
        _check_shard(shard, num_shards)
        if h.group is not None and not h.complete:
            raise InvalidStateError(f"it was fetched in fetch group {h.group!r}, and fetch "
                                    "groups do not survive a hub restart; begin a new group")
        derived = derived_base(model) is not None
        if derived and num_shards != 1:
            raise InvalidStateError(f"a derived version has 1 shard, holder says {num_shards}")
        m = self.models.setdefault(model, ModelRecord.named(model))
        if number >= self.next_versions.get(model, 1):
            self.next_versions[model] = number + 1
            self.durable_generation += 1
        v = m.versions.get(number)
        seen = self.seen.setdefault(model, VersionRanges())
        if v is None and number in seen and not derived:
            # Retired earlier (in this run, or before a restart with a state dir): it stays
            # retired; the holder hears so in its heartbeat news and may retract.
            v = VersionRecord(model, number, num_shards, state=RETIRED, retire_reason=(
                m.retired_log.get(number) or "retired before the hub restarted"))
            m.versions[number] = v
        elif v is None:
            state = COMMITTED if h.state == COMMITTED else PUBLISHING
            v = VersionRecord(model, number, num_shards, state=state)
            m.versions[number] = v
            m.retired_log.pop(number, None)     # a derived version derived again
            seen.add(number)
            self.durable_generation += 1
            if state == PUBLISHING:
                self._leases.claim(v)
        if v.num_shards != num_shards:
            raise InvalidStateError(f"v{number} has {v.num_shards} shards, holder says {num_shards}")
        if (derived and h.publisher and v.state == PUBLISHING
                and any(w != worker for w, _ in v.publishers)):
            raise InvalidStateError(f"v{number} is derived again by another worker now; "
                                    "begin_derive to learn whether to fetch it")
        if v.state == PUBLISHING and h.state == COMMITTED:
            v.state = COMMITTED
            self._index.unpublish(v)
            self.durable_generation += 1
        self._index.dirty_models.add(model)
        self._set_manifest(v, shard, manifest)
        rep = Replica(worker, shard, bytearray(manifest.num_chunks))
        committed_shard = h.publisher and h.complete
        if h.complete and v.state == COMMITTED:
            rep.fill()
            rep.complete = True
        elif committed_shard:       # this shard committed, the version waits for others
            rep.fill()
        else:
            rep.add_chunks(h.chunks)
        self._index.add_replica(v, rep)
        if h.publisher and v.state == PUBLISHING:
            v.publishers[(worker, shard)] = committed_shard
            self._index.add_publisher(worker, v)
            self._leases.claim(v)
            self._commit_if_every_shard_committed(v, worker)
        fid = h.fetch_id
        if fid and not rep.complete and v.state == COMMITTED and fid not in self.fetches:
            self._index.add_fetch(FetchRecord(fid, model, number, shard, worker))

    def durable(self) -> DurableState:
        """What a state dir must keep so a restarted hub goes on (`fabric.hub.persist`)."""
        return DurableState(
            next_versions=dict(self.next_versions),
            policies={n: m.policy for n, m in self.models.items()},
            versions={n: {k: (v.state, v.num_shards, v.fingerprints())
                          for k, v in m.versions.items() if v.state != RETIRED}
                      for n, m in self.models.items()},
            seen={n: r.to_wire() for n, r in self.seen.items()},
            retired={n: dict(m.retired_log) for n, m in self.models.items() if m.retired_log},
            kv=self.kv.records())


def parse_holding(h: Holding) -> Manifest:
    """A `restore` holding's manifest, after every check its types cannot say.

    Raises:
        BadRequestError: a bad manifest, version < 1, or chunk indices out of range.
    """
    try:
        manifest = h.manifest.manifest()
        check_manifest_size(manifest)
    except ValueError as exc:
        raise BadRequestError(f"bad manifest in holding: {exc}") from exc
    if h.version < 1:
        raise BadRequestError(f"holding version must be >= 1, got {h.version}")
    bad = [c for c in h.chunks if not 0 <= c < manifest.num_chunks]
    if bad:
        raise BadRequestError(f"holding chunk indices out of range 0..{manifest.num_chunks - 1}:"
                              f" {bad[:8]}")
    return manifest
