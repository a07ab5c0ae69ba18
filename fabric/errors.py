"""Typed exceptions raised by weightfabric.

Every error a user can cause is one of these, with a message that says what was
wrong and what to do about it. `ClusterConfigError` is defined in `topology`
(which must not import `fabric`) and re-exported here.

Hub errors carry a stable wire ``code``: the hub sends the code and message,
and the client raises the same class again (`hub_error_from_wire`).
"""

from __future__ import annotations

from weightfabric.topology.errors import ClusterConfigError


class FabricError(Exception):
    """Base class of the fabric's own errors (hub, workers, transports)."""


class ArenaError(FabricError):
    """An arena region could not be created, attached or used."""


class TransportError(FabricError):
    """A read from a source failed."""


class SourceLostError(TransportError):
    """The source cannot be reached or dropped the connection: read elsewhere."""


class ReadRefusedError(TransportError):
    """The source answered but refused the read.

    Unknown or retracted region, out-of-range bytes, or chunks that did not arrive in time.
    """


class NoBaseError(ReadRefusedError):
    """A delta read's holder holds none of the reader's base versions whole (read in full)."""


class ReadForbiddenError(ReadRefusedError):
    """The holder refused the read for want of a valid capability (none, forged, expired).

    Readers get capabilities from the hub with each plan (`fabric.auth`).
    """


class FetchError(FabricError):
    """A fetch could not complete: no source left for some chunks, out of time, or cancelled."""


class WaitTimeoutError(FabricError, TimeoutError):
    """No version newer than the one waited past was committed within the timeout."""


class ReplicationTimeoutError(WaitTimeoutError):
    """Too few workers held a complete replica of the version within the timeout.

    Fewer workers than asked for held a complete replica of the version within the timeout
    (`ModelStore.wait_replicated`).
    """


class TensorSetError(FabricError, ValueError, TypeError):
    """A tensor set cannot be published or attached.

    It is empty, a name is empty or not a string, a value is not a tensor, or a tensor has
    no storage (meta) or is on another device than the store. Also a `ValueError` and a
    `TypeError`, which these cases raised before.
    """


class HubError(FabricError):
    """An error reported by (or about) the hub. ``code`` names it on the wire."""

    code = "hub_error"


class HubTimeoutError(HubError):
    """The hub did not answer within the call's timeout (it may be overloaded or gone)."""

    code = "timeout"


class HubUnavailableError(HubError):
    """The hub cannot be reached: bad URL, nothing listening, or the client was closed."""

    code = "unavailable"


class ProtocolError(HubError):
    """A message was malformed, too large, or spoke another protocol version."""

    code = "protocol"


class BadRequestError(HubError, ValueError):
    """A well-formed message asked for something invalid (missing or mistyped argument)."""

    code = "bad_request"


class UnknownWorkerError(HubError):
    """The worker id is not registered (never registered, or its lease expired)."""

    code = "unknown_worker"


class DuplicateWorkerError(HubError):
    """Another live client already registered this worker id."""

    code = "duplicate_worker"


class UnknownModelError(HubError):
    """No version of this model name was ever published on this hub."""

    code = "unknown_model"


class UnknownVersionError(HubError):
    """The version does not exist, was retired, or has no live replica any more."""

    code = "unknown_version"


class UnknownFetchError(HubError):
    """The fetch id is unknown: it completed, was released, or its lease expired."""

    code = "unknown_fetch"


class ManifestMismatchError(HubError):
    """A manifest differs from the one the version was published with."""

    code = "manifest_mismatch"


class LayoutMismatchError(ManifestMismatchError):
    """An engine layout does not fit the published version; raised before any byte moves.

    The message names the tensor and the rule that do not fit.
    """

    code = "layout_mismatch"


class LayoutError(FabricError, ValueError):
    """An engine layout is malformed (a bad split, a duplicate target, a rank out of range)."""


class InvalidStateError(HubError):
    """The operation does not fit the current state (e.g. commit of a committed version)."""

    code = "invalid_state"


class RetentionError(HubError):
    """A retract would drop a retained version below ``min_replicas``."""

    code = "retention"


class NoSourceError(HubError):
    """No live replica holds some chunks of the version: they cannot be fetched now."""

    code = "no_source"


class GroupAbortedError(HubError):
    """A model-parallel group publish or fetch was aborted (a member failed or left)."""

    code = "group_aborted"


class ValueTooLargeError(BadRequestError):
    """A key/value rendezvous value (or key) is over the hub's size limit."""

    code = "value_too_large"


class AuthenticationError(HubError):
    """The request was not signed by a credential this hub knows (or the secret is missing).

    Also raised on the client when its own secret file is missing or unsafe, and when a
    hub's reply is not signed (the hub runs with ``--insecure``).
    """

    code = "unauthenticated"


class ForbiddenError(HubError):
    """The caller's credential does not hold the right the operation needs (`fabric.auth`)."""

    code = "forbidden"


class NotLeaderError(HubError):
    """This hub is a standby (or was deposed): another hub on the same etcd leads.

    The message names the leader's URL when one is known; a client given several hub
    URLs moves on by itself (`fabric.connect`).
    """

    code = "not_leader"


class StoreUnavailableError(HubError):
    """The hub cannot write its records: its etcd cluster has no quorum or does not answer.

    The hub stands down (what etcd holds is the truth; a write that timed out may or may
    not have been taken). Retry once etcd is back: a version number is never handed out
    twice and a version never commits twice. Fetches in flight keep reading meanwhile.
    """

    code = "store_unavailable"


_HUB_ERRORS: dict[str, type[HubError]] = {
    cls.code: cls
    for cls in (HubError, HubTimeoutError, HubUnavailableError, ProtocolError, BadRequestError,
                UnknownWorkerError, DuplicateWorkerError, UnknownModelError,
                UnknownVersionError, UnknownFetchError, ManifestMismatchError,
                InvalidStateError, RetentionError, NoSourceError, GroupAbortedError,
                ValueTooLargeError, AuthenticationError, ForbiddenError, NotLeaderError,
                StoreUnavailableError)
}


def hub_error_from_wire(code: str, message: str) -> HubError:
    """Rebuild the typed error a hub reported (unknown codes become `HubError`)."""
    return _HUB_ERRORS.get(code, HubError)(message)


__all__ = [
    "ArenaError",
    "AuthenticationError",
    "BadRequestError",
    "ClusterConfigError",
    "DuplicateWorkerError",
    "FabricError",
    "FetchError",
    "ForbiddenError",
    "GroupAbortedError",
    "HubError",
    "HubTimeoutError",
    "HubUnavailableError",
    "InvalidStateError",
    "LayoutError",
    "LayoutMismatchError",
    "ManifestMismatchError",
    "NoSourceError",
    "NotLeaderError",
    "ProtocolError",
    "NoBaseError",
    "ReadForbiddenError",
    "ReadRefusedError",
    "ReplicationTimeoutError",
    "RetentionError",
    "SourceLostError",
    "StoreUnavailableError",
    "TensorSetError",
    "TransportError",
    "UnknownFetchError",
    "UnknownModelError",
    "UnknownVersionError",
    "UnknownWorkerError",
    "WaitTimeoutError",
    "ValueTooLargeError",
    "hub_error_from_wire",
]
