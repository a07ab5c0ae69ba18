"""Signed messages between a pool and its engines, with the fabric's credentials.

An engine opens a session with a ``hello`` signed as a hub request is (`Credential.sign`:
its token, a timestamp, a MAC; the pool checks it with `Authority.verify`, which refuses
replays and tokens without the right to read the pool's model). The pool answers with a
fresh nonce, signed with the engine's key and bound to the hello. From then on every
message either way carries a sequence number and ``HMAC(K, direction seq payload)``, with
``K = HMAC(key, "wf-rollout" nonce)``: nothing unsigned, replayed or reordered is acted on,
and the engine knows its orders come from the pool. Payloads are msgpack maps.
"""

from __future__ import annotations

import hmac
import os
import struct
from typing import Any

import msgpack

from weightfabric.fabric.auth import Authority, Credential, reply_mac
from weightfabric.fabric.errors import AuthenticationError, ForbiddenError

_SEQ = struct.Struct("!Q")
TO_POOL, TO_ENGINE = b"P", b"E"


def pack(message: dict[str, Any]) -> bytes:
    """A message's bytes."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(payload: bytes) -> dict[str, Any]:
    """A message from ``payload``.

    Raises:
        AuthenticationError: not a msgpack map (only checked after the MAC, so it means a bug).
    """
    message = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise AuthenticationError("a message that is not a map")
    return message


class Session:
    """One engine's session: seals what this side sends, opens what the other side sent.

    Args:
        key: the engine's credential key.
        nonce: the pool's nonce for this session.
        outgoing: `TO_POOL` on the engine's side, `TO_ENGINE` on the pool's.
    """

    def __init__(self, key: bytes, nonce: bytes, outgoing: bytes) -> None:
        self._key = hmac.digest(key, b"wf-rollout" + nonce, "sha256")
        self._out, self._in = outgoing, (TO_ENGINE if outgoing == TO_POOL else TO_POOL)
        self._sent = 0
        self._seen = 0

    def seal(self, message: dict[str, Any]) -> list[bytes]:
        """The frames that carry ``message``."""
        self._sent += 1
        seq, payload = _SEQ.pack(self._sent), pack(message)
        return [seq, hmac.digest(self._key, self._out + seq + payload, "sha256"), payload]

    def open(self, frames: list[bytes]) -> dict[str, Any]:
        """The message these frames carry.

        Raises:
            AuthenticationError: a bad MAC, or a sequence number not above the last one.
        """
        if len(frames) != 3:
            raise AuthenticationError(f"a message of {len(frames)} frames (want 3)")
        seq, mac, payload = frames
        if not hmac.compare_digest(mac, hmac.digest(self._key, self._in + seq + payload,
                                                    "sha256")):
            raise AuthenticationError("a message whose signature does not match its session")
        (n,) = _SEQ.unpack(seq)
        if n <= self._seen:
            raise AuthenticationError(f"message {n} replayed or reordered (last {self._seen})")
        self._seen = n
        return unpack(payload)


def hello(credential: Credential, message: dict[str, Any]) -> tuple[list[bytes], bytes]:
    """An engine's first frames (``message`` signed as a hub request) and their MAC."""
    payload = pack(message)
    auth, mac = credential.sign(payload)
    return [b"hello", auth, payload], mac


def accept(authority: Authority, frames: list[bytes], model: str
           ) -> tuple[dict[str, Any], bytes, bytes]:
    """Check a hello: its message, the engine's key and the hello's MAC.

    Raises:
        AuthenticationError: unsigned, forged, expired or replayed.
        ForbiddenError: the credential may not read ``model``.
    """
    if len(frames) != 3 or frames[0] != b"hello":
        raise AuthenticationError("a session that did not start with a hello")
    verified = authority.verify(frames[2], frames[1])
    if not verified.principal.may("read", model):
        raise ForbiddenError(f"{verified.principal.describe()} may not read {model!r}")
    return unpack(frames[2]), verified.key, verified.mac


def welcome(key: bytes, hello_mac: bytes, message: dict[str, Any]) -> tuple[list[bytes], bytes]:
    """The pool's answer to a hello, and the session's nonce."""
    nonce = os.urandom(16)
    payload = pack(message)
    return [b"welcome", nonce, reply_mac(key, hello_mac, nonce + payload), payload], nonce


def check_welcome(credential: Credential, hello_mac: bytes, frames: list[bytes]
                  ) -> tuple[dict[str, Any], bytes]:
    """The pool's answer and the session nonce, once it is known to come from the pool.

    Raises:
        AuthenticationError: not signed by a pool that knows this engine's key.
    """
    if len(frames) == 2 and frames[0] == b"refused":
        raise AuthenticationError(f"the pool refused the hello: {frames[1].decode(errors='replace')}")
    if len(frames) != 4 or frames[0] != b"welcome":
        raise AuthenticationError("the pool did not answer the hello with a welcome")
    _, nonce, mac, payload = frames
    if not hmac.compare_digest(mac, reply_mac(credential.key, hello_mac, nonce + payload)):
        raise AuthenticationError("the pool's welcome is not signed with this engine's key: "
                                  "the pool's secret is not the one the token came from")
    return unpack(payload), nonce


__all__ = ["Session", "TO_ENGINE", "TO_POOL", "accept", "check_welcome", "hello", "pack",
           "unpack", "welcome"]
