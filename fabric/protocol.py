"""The hub's wire protocol: msgpack messages in single zmq frames, no pickle.

Every message is one msgpack array::

    request: [PROTOCOL_VERSION, REQUEST, req_id, session, op,   args]
    reply:   [PROTOCOL_VERSION, REPLY,   req_id, epoch,   "",   body]
    error:   [PROTOCOL_VERSION, ERROR,   req_id, epoch,   code, {"message": str}]

``req_id`` (per client session, increasing) makes retries idempotent: the hub
answers a repeated ``(session, req_id)`` from its reply cache instead of running
the operation again. ``epoch`` identifies one run of the hub: a client that sees
it change knows the hub restarted and re-registers what it holds. Messages are
bounded by ``max_size`` here and by ``zmq.MAXMSGSIZE`` on the sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from weightfabric.fabric.errors import ProtocolError

PROTOCOL_VERSION = 1
REQUEST, REPLY, ERROR = 1, 2, 3
MAX_MESSAGE_SIZE = 16 * 1024 * 1024
_KINDS = (REQUEST, REPLY, ERROR)


@dataclass(frozen=True)
class Message:
    """A decoded message. ``tag`` is the session (requests) or the hub epoch (replies);
    ``name`` is the operation (requests) or the error code (errors)."""

    kind: int
    req_id: int
    tag: str
    name: str
    body: dict[str, Any]


def encode(kind: int, req_id: int, tag: str, name: str, body: dict[str, Any], *,
           max_size: int = MAX_MESSAGE_SIZE) -> bytes:
    """Encode one message.

    Raises:
        ProtocolError: the body holds a type msgpack cannot carry, or the message is
            larger than ``max_size``.
    """
    try:
        data = msgpack.packb([PROTOCOL_VERSION, kind, req_id, tag, name, body],
                             use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {name or 'message'}: {exc}") from exc
    if len(data) > max_size:
        raise ProtocolError(f"{name or 'message'} is {len(data)} bytes, over the "
                            f"{max_size}-byte limit")
    return data


def decode(data: bytes, *, max_size: int = MAX_MESSAGE_SIZE) -> Message:
    """Decode and validate one message.

    Raises:
        ProtocolError: oversized, not msgpack, wrong shape or types, or another
            protocol version.
    """
    if len(data) > max_size:
        raise ProtocolError(f"message of {len(data)} bytes is over the {max_size}-byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, list) or len(raw) != 6:
        raise ProtocolError("a message must be a 6-element array "
                            "[version, kind, req_id, tag, name, body]")
    version, kind, req_id, tag, name, body = raw
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks "
                            f"{PROTOCOL_VERSION}); upgrade the older side")
    if (kind not in _KINDS or isinstance(req_id, bool) or not isinstance(req_id, int)
            or not isinstance(tag, str) or not isinstance(name, str)
            or not isinstance(body, dict)):
        raise ProtocolError("malformed message header (kind, req_id, tag, name or body "
                            "has the wrong type)")
    return Message(kind, req_id, tag, name, body)


def peek_req_id(data: bytes) -> int:
    """Best-effort request id of an undecodable message (0 when there is none)."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        rid = raw[2]
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:
        return 0


__all__ = ["ERROR", "MAX_MESSAGE_SIZE", "PROTOCOL_VERSION", "REPLY", "REQUEST", "Message",
           "decode", "encode", "peek_req_id"]
