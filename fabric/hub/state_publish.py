"""`HubPublishing`: how a `HubState` publishes versions, and derives them.

A publisher begins a version (`begin_publish`: the hub assigns the number; model-parallel
publishers join one version by a group key), commits its shards (`commit`: the version
commits once every shard has) or abandons it (`abort_publish`). A derived model
(``base@layout``) takes its base's numbers instead: `begin_derive` says who derives a
version, the deriver commits it with the checksums it computed (`commit`), and readers
wait on it (`commit_state`). Manifests are checked here: their size (`check_manifest_size`,
`MAX_CHUNKS`), one manifest per shard (`_set_manifest`), one layout per derived version
(`_check_layout`).
"""

from __future__ import annotations

from weightfabric.fabric.errors import (
    BadRequestError,
    GroupAbortedError,
    InvalidStateError,
    ManifestMismatchError,
    UnknownModelError,
    UnknownVersionError,
)
from weightfabric.fabric.hub.records import (
    COMMITTED,
    PUBLISHING,
    RETIRED,
    ModelRecord,
    Replica,
    VersionRanges,
    VersionRecord,
)
from weightfabric.fabric.hub.state_base import HubStateBase, _check_shard, log
from weightfabric.fabric.hub_messages import (
    BeginPublishReply,
    CommitWaitReply,
    DeriveReply,
    PublishStateReply,
)
from weightfabric.fabric.manifest import Manifest

MAX_CHUNKS = 1 << 20    # per manifest: 4 TB in 4 MiB chunks; the hub keeps a byte per chunk


class HubPublishing(HubStateBase):
    """The publishing part of `HubState`: begin, commit or abort a version; derive one."""

    # ----------------------------------------------------------------- publish
    def begin_publish(self, model: str, worker: str, manifest: Manifest, *, session: str,
                      shard: int = 0, num_shards: int = 1, group: str | None = None
                      ) -> BeginPublishReply:
        """Start publishing one shard of a new version; the hub assigns the number.

        Model-parallel publishers pass the same ``group`` key and ``num_shards``: the
        first call creates the version, the others join it.

        Returns:
            The ``version`` number.

        Raises:
            BadRequestError: a name with ``@`` (a derived layout: `begin_derive`).
            ManifestMismatchError: another publisher of this shard sent another manifest.
            InvalidStateError: the group's version is no longer publishing, or the shard
                numbers do not fit.
        """
        self._worker(worker, session)
        if "@" in model:
            raise BadRequestError(f"cannot publish {model!r}: names with @ are derived layouts; "
                                  "use begin_derive")
        _check_shard(shard, num_shards)
        check_manifest_size(manifest)
        m = self.models.setdefault(model, ModelRecord.named(model))
        v = None
        if group is not None and group in m.publish_groups:
            v = m.versions.get(m.publish_groups[group])
            if v is None or v.state != PUBLISHING:
                raise InvalidStateError(f"publish group {group!r} of {model!r} is no longer "
                                        "publishing; use a new group key")
            if v.num_shards != num_shards:
                raise InvalidStateError(f"publish group {group!r} has {v.num_shards} shards, "
                                        f"this call says {num_shards}")
        if v is None:
            number = max(self.next_versions.get(model, 1), 1)
            self.next_versions[model] = number + 1
            self.seen.setdefault(model, VersionRanges()).add(number)
            self.durable_generation += 1
            v = VersionRecord(model, number, num_shards, group=group)
            m.versions[number] = v
            if group is not None:
                m.publish_groups[group] = number
        self._add_publisher(v, worker, shard, manifest)
        log.info("begin publish model=%s version=%d shard=%d worker=%s", model, v.number, shard,
                 worker)
        self._touch()
        return BeginPublishReply(version=v.number)

    def _add_publisher(self, v: VersionRecord, worker: str, shard: int,
                       manifest: Manifest) -> None:
        """``worker`` publishes ``shard`` of ``v``: its manifest, claim and (empty) replica."""
        self._set_manifest(v, shard, manifest)
        v.publishers[(worker, shard)] = False
        self._index.add_publisher(worker, v)
        self._leases.claim(v)
        self._index.add_replica(v, Replica(worker, shard, bytearray(manifest.num_chunks)))

    def _set_manifest(self, v: VersionRecord, shard: int, manifest: Manifest) -> None:
        old = v.manifests.get(shard)
        # A derived version's recorded fingerprint may predate its checksums: not checked.
        known = old.fingerprint if old is not None else (
            v.recorded.get(shard) if derived_base(v.model) is None else None)
        if known is not None and known != manifest.fingerprint:
            raise ManifestMismatchError(
                f"{v.model!r} v{v.number} shard {shard} was published with manifest "
                f"{known}, this one is {manifest.fingerprint}")
        if old is None:
            v.manifests[shard] = manifest
            if v.recorded.get(shard) != manifest.fingerprint:
                self.durable_generation += 1     # the records keep it

    def commit(self, model: str, version: int, worker: str, *, session: str,
               checksums: list[int] | None = None) -> PublishStateReply:
        """Commit the worker's shards of a publishing version.

        The version becomes committed (and may become `latest`) once every shard has a
        committed publisher; until then its state stays ``publishing``.

        Args:
            checksums: for a derived version (`begin_derive`) begun without checksums: one
                per chunk, computed while deriving; its manifest gets them.

        Returns:
            ``state``: ``"publishing"`` or ``"committed"``.

        Raises:
            InvalidStateError: the worker is not a publisher of this version.
            GroupAbortedError: the version was retired (a publisher of the group was lost).
            BadRequestError: ``checksums`` for a version that is not derived, or whose
                manifest has checksums already, or not one per chunk.
        """
        self._worker(worker, session)
        v = self._version(model, version)
        if v.state == RETIRED:
            raise GroupAbortedError(f"{model!r} v{version} was retired ({v.retire_reason}); "
                                    "publish again")
        mine = [k for k in v.publishers if k[0] == worker]
        if not mine:
            raise InvalidStateError(f"{worker!r} did not begin publishing {model!r} v{version}")
        if checksums is not None:
            self._add_checksums(v, checksums)
        if v.state == PUBLISHING:
            self._leases.claim(v)
        for key in mine:
            v.publishers[key] = True
            rep = v.replicas.get(key)
            if rep is not None:
                rep.fill()
        self._commit_if_every_shard_committed(v, worker)
        self._settle()
        return PublishStateReply(state=v.state)

    def abort_publish(self, model: str, version: int, worker: str, *, session: str,
                      reason: str = "") -> PublishStateReply:
        """Abandon the worker's publish of a version that is still publishing.

        A publisher whose local step failed after the hub assigned the number (a region
        its read server refused, say) calls this so the version retires at once instead
        of staying ``publishing`` while its heartbeats keep claiming it. A model-parallel
        version retires as a whole (all or none).

        Returns:
            ``state``: ``"retired"``.

        Raises:
            InvalidStateError: the worker is not a publisher of this version, or the
                version is committed already (retract it instead).
        """
        self._worker(worker, session)
        v = self._version(model, version)
        if not any(k[0] == worker for k in v.publishers):
            raise InvalidStateError(f"{worker!r} did not begin publishing {model!r} v{version}")
        if v.state == PUBLISHING:
            self._retire(v, f"publisher {worker} aborted: {reason or 'no reason given'}")
            self._settle()      # a version without replicas goes now
        elif v.state != RETIRED:
            raise InvalidStateError(f"{model!r} v{version} is {v.state}, not publishing: "
                                    "retract it instead")
        return PublishStateReply(state=v.state)

    def _commit_if_every_shard_committed(self, v: VersionRecord, worker: str) -> None:
        """A publishing version whose every shard has a committed publisher commits."""
        if v.state != PUBLISHING or not all(
                any(done for (_, s), done in v.publishers.items() if s == shard)
                for shard in range(v.num_shards)):
            return
        v.state = COMMITTED
        self._index.unpublish(v)
        for rep in v.replicas.values():
            if v.publishers.get((rep.worker, rep.shard)):
                rep.complete = True
                v.reindex(rep)
        self.models[v.model].publish_groups.pop(v.group or "", None)
        self._index.dirty_models.add(v.model)
        self.durable_generation += 1
        log.info("committed model=%s version=%d worker=%s", v.model, v.number, worker)

    # ------------------------------------------------------------------ derive
    def begin_derive(self, model: str, version: int, worker: str, manifest: Manifest, *,
                     session: str, with_base: bool = False) -> DeriveReply:
        """Derive version ``version`` of ``model`` (``base@layout``), or learn who does.

        A derived version holds the base model's version ``version`` converted to a layout
        the name encodes; its number is the base's (not assigned here) and one worker at a
        time derives it. The deriver publishes it as a one-shard version (publish claim,
        `commit` with the checksums it computed, `abort_publish`); a deriver that dies or
        aborts leaves it retired, and the next caller derives it again.

        Returns:
            ``action``: ``"derive"`` (absent, retired, or committed with no live holder
            left: this worker derives it now; again for the worker already deriving it), ``"wait"`` (``by`` derives it, or None: a
            deriver may come back after a hub restart; ask again later), ``"fetch"``
            (committed: fetch it like any version).

            With ``with_base``, a ``"derive"`` answer also says where the base version can be
            read (`locate`'s answer for this worker: one hub call fewer for the deriver).

        Raises:
            BadRequestError: ``model`` is not ``base@layout``, or ``version`` < 1.
            UnknownModelError, UnknownVersionError: the base version is not committed.
            NoSourceError: with ``with_base``, a shard of the base has no complete live
                replica (nothing changed).
            ManifestMismatchError: ``manifest`` lays the bytes out otherwise than the
                version's deriver did.
            ValueError: a manifest over `MAX_CHUNKS` chunks.
        """
        self._worker(worker, session)
        base = derived_base(model)
        if base is None:
            raise BadRequestError(f"{model!r} is not a derived model name: derived model names "
                                  "are base@layout (e.g. 'policy@vllm-tp2.r1')")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise BadRequestError(f"version must be an int >= 1, got {version!r}")
        self._check_base(base, version)
        check_manifest_size(manifest)
        m = self.models.setdefault(model, ModelRecord.named(model))
        v = m.versions.get(version)
        if v is not None and v.state == COMMITTED and not v.servable():
            self._retire(v, "no live holder left: derived again")  # its holders all left
        if v is not None and v.state != RETIRED:
            answer = self._derive_answer(v, worker, manifest)
            if answer.action == "derive" and with_base:
                return DeriveReply(action="derive", by=None,
                                   base=self.locate(base, version, worker=worker))
            return answer
        where = self.locate(base, version, worker=worker) if with_base else None
        if v is not None:
            self._forget_version(v)
        v = VersionRecord(model, version, 1)
        m.versions[version] = v
        m.retired_log.pop(version, None)
        self.next_versions[model] = max(self.next_versions.get(model, 1), version + 1)
        self.seen.setdefault(model, VersionRanges()).add(version)
        self.durable_generation += 1
        self._add_publisher(v, worker, 0, manifest)
        log.info("begin derive model=%s version=%d worker=%s", model, version, worker)
        self._settle()
        return DeriveReply(action="derive", by=None, base=where)

    def commit_state(self, model: str, version: int, shard: int = 0) -> CommitWaitReply:
        """A version's state, and ``shard``'s checksums once it is committed (`wait_commit`).

        Raises:
            UnknownModelError, UnknownVersionError: no such model or version.
            ValueError: no such shard.
        """
        v = self._version(model, version)
        _check_shard(shard, v.num_shards)
        if v.state != COMMITTED:
            return CommitWaitReply(state=v.state, reason=v.retire_reason or "")
        manifest = v.manifests.get(shard)
        return CommitWaitReply(state=v.state,
                               checksums=list(manifest.checksums) if manifest else [])

    def _derive_answer(self, v: VersionRecord, worker: str, manifest: Manifest) -> DeriveReply:
        """`begin_derive`'s answer for a derived version that is publishing or committed.

        Raises:
            ManifestMismatchError: ``manifest`` lays the bytes out otherwise than ``v``.
        """
        _check_layout(v, manifest)
        if v.state == COMMITTED:
            return DeriveReply(action="fetch", by=None)
        deriver = next((w for w, _ in v.publishers), None)
        if deriver != worker:
            return DeriveReply(action="wait", by=deriver)
        self._leases.claim(v)           # its deriver asks again: idempotent
        return DeriveReply(action="derive", by=None)

    def _check_base(self, base: str, number: int) -> None:
        """Refuse to derive from a base version that is not committed.

        Raises:
            UnknownModelError, UnknownVersionError: no such base model, or its version
                ``number`` is absent, publishing or retired.
        """
        if base not in self.models:
            known = ", ".join(sorted(n for n in self.models if "@" not in n))
            raise UnknownModelError(f"no base model {base!r} on this hub to derive from "
                                    f"(known: {known or 'none'})")
        v = self.models[base].versions.get(number)
        if v is None or v.state != COMMITTED:
            raise UnknownVersionError(
                f"base model {base!r} v{number} is {v.state if v else 'absent'}, not committed; "
                "derive only from a committed version")

    def _forget_version(self, v: VersionRecord) -> None:
        """Remove retired ``v`` now, with its replicas and fetches, to reuse its number.

        Its fetches end (their groups abort) and its remaining holders' replicas go (the
        bytes of a derived version are the same whoever derives them again).
        """
        for fid in [fid for w, _ in v.replicas for fid in self._index.own_fetches.get(w, ())]:
            f = self.fetches.get(fid)
            if f is not None and (f.model, f.version) == (v.model, v.number):
                self._end_fetch(f, keep_replica=False, reason=f"{v.model!r} v{v.number} is "
                                                              "derived again")
        for key in list(v.replicas):
            self._index.remove_replica(v, key)
        self._index.gc.discard((v.model, v.number))
        del self.models[v.model].versions[v.number]

    def _add_checksums(self, v: VersionRecord, checksums: list[int]) -> None:
        """Give derived version ``v`` the checksums its deriver computed (`commit`).

        Raises:
            BadRequestError: ``v`` is not derived, its manifest had checksums (other ones,
                or ``v`` is still publishing), or they are not one int per chunk.
            InvalidStateError: ``v`` has no manifest (restored without its deriver).
        """
        if derived_base(v.model) is None:
            raise BadRequestError(f"checksums at commit are only for derived versions "
                                  f"(begin_derive); {v.model!r} carries them in its manifest")
        manifest = v.manifests.get(0)
        if manifest is None:
            raise InvalidStateError(f"{v.model!r} v{v.number} has no manifest here")
        bad = [c for c in checksums if isinstance(c, bool) or not isinstance(c, int)
               or not -(1 << 63) <= c < 1 << 64]
        if bad:
            raise BadRequestError(f"checksums must be 64-bit ints, got {bad[:4]}")
        new = tuple(checksums)
        if manifest.checksums:
            if v.state == COMMITTED and manifest.checksums == new:
                return          # a commit retried after its reply was lost
            raise BadRequestError(f"{v.model!r} v{v.number} was begun with checksums in its "
                                  "manifest; commit it without checksums")
        if v.state != PUBLISHING:
            raise BadRequestError(f"{v.model!r} v{v.number} is {v.state} without checksums; "
                                  "they can only come with its first commit")
        if len(new) != manifest.num_chunks:
            raise BadRequestError(f"{len(new)} checksums for {v.model!r} v{v.number}, whose "
                                  f"manifest has {manifest.num_chunks} chunks: one per chunk")
        v.manifests[0] = Manifest(manifest.tensors, manifest.chunk_size, new,
                                  manifest.total_bytes)


def check_manifest_size(manifest: Manifest) -> None:
    """Refuse a manifest of more than `MAX_CHUNKS` chunks.

    Refuse a manifest of more than `MAX_CHUNKS` chunks (the hub's work per replica, plan and
    progress report grows with the chunk count).

    Raises:
        ValueError: too many chunks; the message suggests a chunk size that fits.
    """
    if manifest.num_chunks > MAX_CHUNKS:
        fits = 1 << max(0, -(-manifest.total_bytes // MAX_CHUNKS) - 1).bit_length()
        raise ValueError(f"manifest has {manifest.num_chunks} chunks, over the hub's limit of "
                         f"{MAX_CHUNKS} per manifest; publish with a larger chunk_size "
                         f"(at least {fits} bytes for {manifest.total_bytes} bytes)")


def derived_base(model: str) -> str | None:
    """The base model of a derived model name (``"policy@vllm-tp2.r1"`` -> ``"policy"``).

    None for a plain name (no ``@``).

    Raises:
        BadRequestError: a derived name with an empty base or layout.
    """
    base, at, layout = model.partition("@")
    if not at:
        return None
    if not base or not layout:
        raise BadRequestError(f"bad derived model name {model!r}: derived model names are "
                              "base@layout, both parts non-empty")
    return base


def _check_layout(v: VersionRecord, manifest: Manifest) -> None:
    """Refuse a manifest that lays a derived version's bytes out otherwise than its own.

    Checksums are compared only where both have them (a deriver computes them late).

    Raises:
        ManifestMismatchError: tensors, chunking, size or checksums differ.
    """
    own = v.manifests.get(0)
    if own is None:
        return
    same = ((own.tensors, own.chunk_size, own.total_bytes)
            == (manifest.tensors, manifest.chunk_size, manifest.total_bytes))
    if same and (not own.checksums or not manifest.checksums
                 or own.checksums == manifest.checksums):
        return
    raise ManifestMismatchError(
        f"{v.model!r} v{v.number} is derived with manifest {own.fingerprint}, this one is "
        f"{manifest.fingerprint}: the layout key must name the layout")
