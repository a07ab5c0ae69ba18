"""The hub's wire protocol: msgpack messages in single zmq frames, no pickle.

Every message is one msgpack array::

    request: [PROTOCOL_VERSION, REQUEST, req_id, session, op,   args]
    reply:   [PROTOCOL_VERSION, REPLY,   req_id, epoch,   "",   body]
    error:   [PROTOCOL_VERSION, ERROR,   req_id, epoch,   code, {"message": str}]

``args`` and ``body`` are maps: an operation's request and reply structs
(`fabric.hub_messages`). `decode` checks the envelope and leaves the body raw;
the receiver decodes it into the type it expects (`decode_body`), so a body is
parsed and validated once. The error envelope keeps its shape across versions:
the hub answers a request of another version with an error in that version.

``req_id`` (per client session, increasing) makes retries idempotent: the hub
answers a repeated ``(session, req_id)`` from its reply cache instead of running
the operation again. ``epoch`` identifies one run of the hub: a client that sees
it change knows the hub restarted and re-registers what it holds. Messages are
bounded by ``max_size`` here and by ``zmq.MAXMSGSIZE`` on the sockets.

Version 2: typed messages (unknown fields refused, defaults left off the wire).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

import msgspec

from weightfabric.fabric.errors import ProtocolError

PROTOCOL_VERSION = 3
"""3: manifests carry the NH-style chunk checksums (`kernels.checksum`); a version-2
peer computes the old mix and would fail every verified read."""
REQUEST, REPLY, ERROR = 1, 2, 3
MAX_MESSAGE_SIZE = 16 * 1024 * 1024
_KINDS = (REQUEST, REPLY, ERROR)
_MAP_MARKERS = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})   # msgpack fixmap, map16, map32

T = TypeVar("T")
Body = msgspec.Struct | Mapping[str, Any]

_encoder = msgspec.msgpack.Encoder()
_parts = msgspec.msgpack.Decoder(list[msgspec.Raw])
_envelope = msgspec.msgpack.Decoder(tuple[int, int, int, str, str, msgspec.Raw])
_MAP_HEADS = frozenset(bytes([m]) for m in _MAP_MARKERS)
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


class Message(NamedTuple):
    """A decoded message (a named tuple: the hub makes one per request).

    ``tag`` is the session (requests) or the hub epoch (replies); ``name`` is the operation
    (requests) or the error code (errors); ``body`` is the raw map, for `decode_body`.
    """

    kind: int
    req_id: int
    tag: str
    name: str
    body: msgspec.Raw


def encode(kind: int, req_id: int, tag: str, name: str, body: Body, *,
           max_size: int = MAX_MESSAGE_SIZE, version: int = PROTOCOL_VERSION) -> bytes:
    """Encode one message (``version``: only to answer a peer of another version).

    Raises:
        ProtocolError: the body holds a type msgpack cannot carry, or the message is
            larger than ``max_size``.
    """
    try:
        data = _encoder.encode([version, kind, req_id, tag, name, body])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {name or 'message'}: {exc}") from exc
    if len(data) > max_size:
        raise ProtocolError(f"{name or 'message'} is {len(data)} bytes, over the "
                            f"{max_size}-byte limit")
    return data


def decode(data: bytes, *, max_size: int = MAX_MESSAGE_SIZE) -> Message:
    """Decode and check one message's envelope; the body stays raw (`decode_body`).

    Raises:
        ProtocolError: oversized, not msgpack, wrong shape or types, a body that is not
            a map, or another protocol version.
    """
    if len(data) > max_size:
        raise ProtocolError(f"message of {len(data)} bytes is over the {max_size}-byte limit")
    try:   # the usual message, in one typed decode; anything else the slow way, to say why
        usual = _envelope.decode(data)
        if (usual[0] == PROTOCOL_VERSION and usual[1] in _KINDS
                and bytes(memoryview(usual[5])[:1]) in _MAP_HEADS):
            return Message(*usual[1:])
    except Exception:  # the slow way below says what is wrong
        pass
    try:
        parts = _parts.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError("a message must be a 6-element array "
                            "[version, kind, req_id, tag, name, body]") from exc
    except Exception as exc:  # garbage: msgspec raises DecodeError, deep nesting others
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    if len(parts) != 6:
        raise ProtocolError("a message must be a 6-element array "
                            "[version, kind, req_id, tag, name, body]")
    version = _scalar(parts[0])
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks "
                            f"{PROTOCOL_VERSION}); upgrade the older side")
    kind, req_id, tag, name = (_scalar(p) for p in parts[1:5])
    body = parts[5]
    head = memoryview(body)[:1].tobytes()
    if (kind not in _KINDS or isinstance(req_id, bool) or not isinstance(req_id, int)
            or not isinstance(tag, str) or not isinstance(name, str)
            or not head or head[0] not in _MAP_MARKERS):
        raise ProtocolError("malformed message header (kind, req_id, tag, name or body "
                            "has the wrong type)")
    return Message(kind, req_id, tag, name, body)


def decode_body(msg: Message, type_: type[T]) -> T:
    """``msg``'s body as ``type_`` (a request or reply struct, or a plain type).

    Raises:
        msgspec.ValidationError: the body does not fit ``type_`` (a missing, unknown or
            mistyped field; the message names it).
    """
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return decoder.decode(msg.body)


def _scalar(raw: msgspec.Raw) -> object:
    """One envelope field (already known to be well-formed msgpack)."""
    try:
        return msgspec.msgpack.decode(raw)
    except Exception:
        return None


def peek_req_id(data: bytes) -> int:
    """Best-effort request id of an undecodable message (0 when there is none)."""
    rid = _peek(data, 2)
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def peek_version(data: bytes) -> int:
    """Best-effort protocol version of an undecodable message.

    Best-effort protocol version of an undecodable message (`PROTOCOL_VERSION` when it names
    none that an error reply could be written in).
    """
    version = _peek(data, 0)
    if isinstance(version, int) and not isinstance(version, bool) and 0 < version < 1 << 16:
        return version
    return PROTOCOL_VERSION


def _peek(data: bytes, index: int) -> object:
    try:
        parts = _parts.decode(data)
        return msgspec.msgpack.decode(parts[index])
    except Exception:
        return None


__all__ = ["ERROR", "MAX_MESSAGE_SIZE", "PROTOCOL_VERSION", "REPLY", "REQUEST", "Body",
           "Message", "decode", "decode_body", "encode", "peek_req_id", "peek_version"]
