"""Who may talk to a hub and read from a holder: secrets, tokens, signed frames, capabilities.

One deployment secret ``S`` (32 random bytes, hex in a file of mode 0600) is the root
of everything; every key below is an HMAC-SHA256 derived from it, so nothing secret
ever crosses the network:

- a **credential** is either the secret itself (every right: ``admin``) or a **token**
  the hub's operator issued (`issue_token`: a name, roles, models, an expiry). A
  token is its payload ``P`` and its key ``HMAC(S, "wf-token" P)``; the hub recomputes
  the key from ``P``, so tokens need no state and cannot be widened.
- every hub request carries an auth frame: the token payload (empty for the secret),
  a wall-clock timestamp and ``HMAC(key, "wf-req" ts payload)``. The hub refuses a
  frame outside `MAX_SKEW_S` of its clock or seen before (`ReplayGuard`), and signs
  its reply with the same key bound to the request's MAC, so a client never takes an
  answer (a plan, a manifest's checksums) from anyone but the hub.
- a worker's **serving key** is ``HMAC(key, "wf-serve")``. The hub mints read
  **capabilities** with the holder's serving key (scope ``model/vN/s``, reader,
  expiry) and hands them out with plans; the holder's read server checks them
  (`CapabilityCheck`) before any work. A reader never learns a holder's key.

A hub served at a ``curve://`` URL also encrypts its channel with zmq CURVE: its key
pair is derived from the secret too, and tokens carry its public key
(`Credential.hub_key`), so any credential can reach it.

Roles: ``read`` (register, fetch, serve, derive layouts, read metadata), ``publish``
(``read`` plus publishing the token's models), ``admin`` (everything: retention,
pins, dropping others' keys; the secret itself).
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import fnmatch
import hmac
import os
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgpack
import zmq
from zmq.utils import z85

from weightfabric.fabric.errors import AuthenticationError

SECRET_FILE_ENV = "WEIGHTFABRIC_SECRET_FILE"
SECRET_BYTES = 32
TOKEN_PREFIX = "wft1."
ROLES = ("read", "publish", "admin")
MAX_SKEW_S = 60.0
"""A signed request's timestamp must be within this many seconds of the hub's clock
(hosts must agree on the time this well: run NTP)."""
MAX_TOKENS_KEPT = 4096
"""Tokens whose key and rights a hub keeps computed (the newest)."""
CAP_TTL_S = 900.0
"""Seconds a read capability stays valid (a fetch re-planned later gets fresh ones)."""
MAX_CAP_BYTES = 512
_TS = struct.Struct("!d")


def default_secret_path() -> Path:
    """``$WEIGHTFABRIC_SECRET_FILE``, else ``$XDG_CONFIG_HOME/weightfabric/secret``.

    (``~/.config/weightfabric/secret`` without ``XDG_CONFIG_HOME``.)
    """
    env = os.environ.get(SECRET_FILE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "weightfabric" / "secret"


def ensure_secret(path: str | Path | None = None) -> tuple[Path, bool]:
    """The deployment secret file at ``path`` (default `default_secret_path`), created if missing.

    A new file holds 32 random bytes in hex, mode 0600, in a directory of mode 0700
    when it creates that too.

    Returns:
        ``(path, created)``.

    An existing file is left as it is (`Authority` checks it when it loads it).

    Raises:
        AuthenticationError: the file cannot be created.
    """
    p = Path(path).expanduser() if path is not None else default_secret_path()
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return p, False
    except OSError as exc:
        raise AuthenticationError(f"cannot create the deployment secret {p}: "
                                  f"{exc.strerror}") from exc
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return p, True


@dataclass(frozen=True)
class Principal:
    """What a credential may do: its ``name``, ``roles``, and the models it may publish."""

    name: str
    roles: frozenset[str]
    models: tuple[str, ...] = ("*",)
    """``fnmatch`` patterns of the models ``publish`` covers."""
    expires: float | None = None
    """Wall-clock time (``time.time()``) after which the token is refused; None: never."""

    def may(self, role: str, model: str | None = None) -> bool:
        """Whether this principal holds ``role`` (for ``model``, when it is ``publish``)."""
        if "admin" in self.roles:
            return True
        if role == "read":
            return bool(self.roles & {"read", "publish"})
        if role == "publish":
            return "publish" in self.roles and (
                model is None or any(fnmatch.fnmatchcase(model, pat) for pat in self.models))
        return role in self.roles

    def describe(self) -> str:
        """``name (roles[, publish models])`` for messages and logs."""
        roles = ",".join(sorted(self.roles))
        models = f" of {','.join(self.models)}" if "publish" in self.roles else ""
        return f"{self.name} ({roles}{models})"


ADMIN = Principal("admin", frozenset({"admin"}))


_hmac_digest: Callable[[bytes, bytes, str], bytes] = hmac.digest
# `hmac.digest` calls OpenSSL's one-shot HMAC; a hub's hot path calls it straight (a Python
# without OpenSSL's hashlib keeps `hmac.digest`)
with contextlib.suppress(ImportError):
    from _hashlib import hmac_digest as _hmac_digest


def _mac(key: bytes, *parts: bytes) -> bytes:
    return _hmac_digest(key, b"".join(parts), "sha256")   # one call in C


class MacKey:
    """An HMAC-SHA256 key prepared once, for many messages.

    ``MacKey(key).mac(data)`` is ``hmac.digest(key, data, "sha256")``. It keeps the
    standard library's HMAC object, whose two padded key blocks are hashed when it is
    made, and copies it per message, where a one-shot HMAC hashes both blocks again on
    every call (1.8 µs against 3.2 for a capability's few dozen bytes on the dev VM). The
    hub keeps one per serving key to sign capabilities with.
    """

    __slots__ = ("_hmac",)

    def __init__(self, key: bytes) -> None:
        self._hmac = hmac.new(key, digestmod="sha256")

    def mac(self, data: bytes) -> bytes:
        """``HMAC-SHA256(key, data)``."""
        h = self._hmac.copy()
        h.update(data)
        return h.digest()


def serving_key(key: bytes) -> bytes:
    """The key a worker's read server checks capabilities with, from its credential key."""
    return _mac(key, b"wf-serve")


@dataclass(frozen=True)
class Credential:
    """A client's credential: the key it signs with and the token naming its rights.

    Use `load_credential`. ``token`` is empty for the deployment secret.
    """

    key: bytes
    token: bytes
    principal: Principal
    source: str
    """Where it came from (a file path), for messages."""
    hub_key: bytes = b""
    """The hub's CURVE public key (z85), for ``curve://`` hubs."""

    @property
    def serve_key(self) -> bytes:
        """The key this worker's read server checks capabilities with."""
        return serving_key(self.key)

    def sign(self, payload: bytes, now: float | None = None) -> tuple[bytes, bytes]:
        """The auth frame of a request ``payload``, and its MAC (to check the reply with)."""
        ts = _TS.pack(time.time() if now is None else now)
        mac = _mac(self.key, b"wf-req", ts, payload)
        return msgpack.packb([self.token, ts, mac]), mac

    def check_reply(self, auth: bytes, request_mac: bytes, payload: bytes) -> bool:
        """Whether ``auth`` is the hub's signature of reply ``payload`` to that request."""
        return hmac.compare_digest(auth, reply_mac(self.key, request_mac, payload))

    def signed_by_me(self, payload: bytes, auth: bytes) -> tuple[float, bytes] | None:
        """``(timestamp, MAC)`` of a request ``payload`` this same credential signed, else None.

        A node relay holding its workers' credential checks their requests with it and
        vouches for them (`fabric.relay`); a request another credential signed (or a
        malformed frame, or a forged one) is None: it goes on with its own signature.
        """
        try:
            token, ts_raw, ts, mac = _request_frame(auth)
        except Exception:
            return None
        if token != self.token or not hmac.compare_digest(
                mac, _mac(self.key, b"wf-req", ts_raw, payload)):
            return None
        return ts, mac


def _request_frame(auth: bytes) -> tuple[bytes, bytes, float, bytes]:
    """A request's auth frame: ``(token, timestamp bytes, timestamp, MAC)``.

    Raises:
        Exception: not such a frame (msgpack's and struct's errors, or TypeError).
    """
    token, ts_raw, mac = msgpack.unpackb(auth)
    (ts,) = _TS.unpack(ts_raw)
    if not (isinstance(token, bytes) and isinstance(mac, bytes)):
        raise TypeError("fields of the wrong type")
    return token, ts_raw, ts, mac


def reply_mac(key: bytes, request_mac: bytes, payload: bytes) -> bytes:
    """The hub's signature of a reply, bound to the request it answers."""
    return _mac(key, b"wf-rep", request_mac, payload)


def load_credential(*, secret: str | None = None,
                    secret_file: str | Path | None = None) -> Credential:
    """The credential given as text (``secret``), in ``secret_file``, or at the default path.

    The text is a deployment secret (64 hex digits) or a token (``wft1.…``, from
    `issue_token` / ``fabric hub token``).

    Raises:
        AuthenticationError: no file there, a file other users can read, or text that
            is neither a secret nor a token (the message says what to do).
    """
    if secret is not None:
        return _parse(secret.strip(), "the secret= argument")
    path = Path(secret_file).expanduser() if secret_file is not None else default_secret_path()
    return _parse(_read_private(path), str(path))


def _read_private(path: Path) -> str:
    """The text of a secret or token file, once it is known to be readable by its owner only.

    Raises:
        AuthenticationError: no such file, unreadable, or readable by other users.
    """
    try:
        st = path.stat()
        text = path.read_text().strip()
    except FileNotFoundError:
        raise AuthenticationError(
            f"no deployment secret at {path}: start the hub on this machine first "
            "(`fabric hub serve` creates it), or copy the hub's secret file (or a token from "
            f"`fabric hub token`) here, or point {SECRET_FILE_ENV} at it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthenticationError(f"cannot read the secret file {path}: {exc}") from exc
    if st.st_mode & 0o077:
        raise AuthenticationError(f"the secret file {path} is readable by other users (mode "
                                  f"{st.st_mode & 0o777:o}); run `chmod 600 {path}`")
    return text


def _parse(text: str, source: str) -> Credential:
    if text.startswith(TOKEN_PREFIX):
        try:
            _, payload_b64, key_b64 = text.split(".")
            payload, key = _unb64(payload_b64), _unb64(key_b64)
            principal = principal_of(payload)
            hub_key = msgpack.unpackb(payload).get("hub_key", "").encode()
        except (ValueError, binascii.Error, AttributeError) as exc:
            raise AuthenticationError(f"{source}: a malformed token ({exc})") from None
        return Credential(key, payload, principal, source, hub_key)
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != SECRET_BYTES:
        raise AuthenticationError(f"{source} holds neither a deployment secret ({SECRET_BYTES * 2} "
                                  "hex digits) nor a token (wft1.…)")
    return Credential(_admin_key(raw), b"", ADMIN, source, curve_keys(raw)[0])


def _admin_key(secret: bytes) -> bytes:
    return _mac(secret, b"wf-admin")


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The hub's CURVE key pair (public, secret; z85), derived from the deployment secret."""
    private = z85.encode(_mac(secret, b"wf-curve"))
    return zmq.curve_public(private), private


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def principal_of(payload: bytes) -> Principal:
    """The rights a token payload names.

    Raises:
        ValueError: not a token payload.
    """
    try:
        data = msgpack.unpackb(payload)
    except Exception as exc:
        raise ValueError(f"not a token payload: {exc}") from None
    if (not isinstance(data, dict) or not isinstance(data.get("name"), str)
            or not isinstance(data.get("roles"), list)
            or not all(r in ROLES for r in data["roles"])
            or not isinstance(data.get("models"), list)
            or not all(isinstance(m, str) for m in data["models"])
            or not isinstance(data.get("expires"), (float, int, type(None)))):
        raise ValueError("not a token payload (name, roles, models, expires)")
    return Principal(data["name"], frozenset(data["roles"]), tuple(data["models"]),
                     data["expires"])


class ReplayGuard:
    """Refuses a signed request seen before, or stamped outside the clock window.

    It remembers each MAC for `MAX_SKEW_S` (at most ``capacity``; past that the oldest
    go, and requests stamped before them are refused as too old).
    """

    def __init__(self, window: float = MAX_SKEW_S, capacity: int = 1 << 20) -> None:
        self.window, self.capacity = window, capacity
        self._seen: set[bytes] = set()
        self._order: collections.deque[tuple[float, bytes]] = collections.deque()
        self._floor = -float("inf")

    def check(self, ts: float, mac: bytes, now: float) -> str | None:
        """Why the request is refused, or None (and it is remembered)."""
        if not abs(now - ts) <= self.window:
            return (f"its timestamp is {now - ts:+.1f} s off the hub's clock (at most "
                    f"{self.window:g} s): the hosts' clocks disagree (run NTP) or it is a replay")
        while self._order and (self._order[0][0] < now - self.window
                               or len(self._order) >= self.capacity):
            old_ts, old = self._order.popleft()
            self._seen.discard(old)
            self._floor = max(self._floor, old_ts)
        if ts <= self._floor:
            return "it is older than the requests the hub still remembers (a replay?)"
        if mac in self._seen:
            return "it was seen before (a replay)"
        self._seen.add(mac)
        self._order.append((ts, mac))
        return None


class Verified(NamedTuple):
    """A request the hub authenticated: who sent it and the key its reply is signed with."""

    principal: Principal
    key: bytes
    mac: bytes


class Authority:
    """The hub's side: checks request frames, signs replies, mints tokens and capabilities.

    Args:
        secret_file: the deployment secret (default `default_secret_path`); it must hold
            the secret itself, not a token.
    """

    def __init__(self, secret_file: str | Path | None = None) -> None:
        path = Path(secret_file).expanduser() if secret_file is not None else default_secret_path()
        text = _read_private(path)
        if _parse(text, str(path)).token:
            raise AuthenticationError(f"{path} holds a token; the hub needs the deployment "
                                      "secret itself")
        self.path = path
        self._secret = bytes.fromhex(text)
        self._admin = _admin_key(self._secret)
        self._tokens: dict[bytes, tuple[bytes, Principal]] = {}   # token -> key, rights
        self._replays = ReplayGuard()
        self.curve_public, self.curve_secret = curve_keys(self._secret)

    def key_of(self, token: bytes) -> bytes:
        """The key of a credential: the secret's (empty ``token``) or the token's."""
        return _mac(self._secret, b"wf-token", token) if token else self._admin

    def _token(self, token: bytes) -> tuple[bytes, Principal]:
        """A token's key and rights, computed once per token (the newest `MAX_TOKENS_KEPT`).

        Raises:
            ValueError: not a token payload.
        """
        kept = self._tokens.get(token)
        if kept is None:
            kept = (self.key_of(token), principal_of(token))
            if len(self._tokens) >= MAX_TOKENS_KEPT:
                self._tokens.pop(next(iter(self._tokens)))
            self._tokens[token] = kept
        return kept

    def verify(self, payload: bytes, auth: bytes, now: float | None = None) -> Verified:
        """Who signed request ``payload`` with auth frame ``auth``.

        Raises:
            AuthenticationError: a missing, malformed, forged, expired or replayed signature.
        """
        now = time.time() if now is None else now
        try:
            token, ts_raw, ts, mac = _request_frame(auth)
        except Exception as exc:
            raise AuthenticationError(f"a malformed auth frame ({exc})") from None
        if token:
            try:
                key, principal = self._token(token)
            except ValueError:
                key, principal = self.key_of(token), None   # refused below, as before
        else:
            key, principal = self._admin, ADMIN
        if not hmac.compare_digest(mac, _mac(key, b"wf-req", ts_raw, payload)):
            raise AuthenticationError("the request's signature does not match: the client's "
                                      "secret or token is not this hub's")
        if principal is None:
            try:
                principal = principal_of(token)
            except ValueError as exc:
                raise AuthenticationError(str(exc)) from None
        if principal.expires is not None and now > principal.expires:
            raise AuthenticationError(f"token {principal.name!r} expired "
                                      f"{now - principal.expires:.0f} s ago; issue a new one")
        why = self._replays.check(ts, mac, now)
        if why is not None:
            raise AuthenticationError(f"request refused: {why}")
        return Verified(principal, key, mac)

    def issue_token(self, name: str, roles: list[str], models: list[str] | None = None,
                    ttl: float | None = None) -> str:
        """A token for ``name`` with ``roles`` (``publish`` covers ``models``: patterns).

        Raises:
            ValueError: an unknown role, an empty name, or ``ttl`` not > 0.
        """
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise ValueError(f"roles must be some of {', '.join(ROLES)}, got {roles}")
        if not name:
            raise ValueError("a token needs a name")
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        payload = msgpack.packb({"name": name, "roles": sorted(set(roles)),
                                 "models": list(models or ["*"]),
                                 "expires": None if ttl is None else time.time() + ttl,
                                 "hub_key": self.curve_public.decode()})
        return f"{TOKEN_PREFIX}{_b64(payload)}.{_b64(self.key_of(payload))}"


def capability(serve_key: bytes, scope: str, reader: str, ttl: float = CAP_TTL_S,
               now: float | None = None) -> bytes:
    """A capability to read regions ``scope``N (``model/vV/s``) from the holder of ``serve_key``."""
    expires = (time.time() if now is None else now) + ttl
    return CapabilityBody(scope, reader, expires).sign(MacKey(serve_key))


class CapabilityBody:
    """What a capability says, encoded once: ``reader`` may read ``scope``N until ``expires``.

    A plan's capabilities all say the same (one reader, one version, one expiry) and differ
    only in the holder's key that signs them: the hub encodes this once per plan and calls
    `sign` per holder. ``sign(MacKey(k))`` is the same bytes as ``capability(k, ...)``: the
    msgpack of ``[body, HMAC(k, "wf-cap" body)]``, ``body`` the msgpack of
    ``[scope, reader, expires]`` (what `CapabilityCheck` reads).
    """

    __slots__ = ("_body", "_signed")

    def __init__(self, scope: str, reader: str, expires: float) -> None:
        self._body = msgpack.packb([scope, reader, expires])
        self._signed = b"wf-cap" + self._body

    def sign(self, serve_key: MacKey) -> bytes:
        """The capability, signed with a holder's serving key."""
        return msgpack.packb([self._body, serve_key.mac(self._signed)])


def scope_of(model: str, version: int) -> str:
    """The capability scope of every shard of ``model`` v``version`` (`regions.region_name`)."""
    return f"{model}/v{version}/s"


class CapabilityCheck:
    """A holder's check of the capabilities readers present (`fabric.transports.server`)."""

    def __init__(self, serve_key: bytes) -> None:
        self._key = serve_key

    def reader(self, cap: bytes, region: str, now: float | None = None) -> str:
        """The reader ``cap`` names, if it allows reading ``region`` now.

        Raises:
            PermissionError: no capability, a forged or expired one, or one for other regions.
        """
        if not cap:
            raise PermissionError("no read capability: ask the hub for a plan (readers get "
                                  "capabilities with it)")
        try:
            body, mac = msgpack.unpackb(cap)
            scope, reader, expires = msgpack.unpackb(body)
            if not (isinstance(scope, str) and isinstance(reader, str)
                    and isinstance(expires, (int, float))):
                raise TypeError("fields of the wrong type")
        except Exception as exc:
            raise PermissionError(f"a malformed read capability ({exc})") from None
        if not hmac.compare_digest(mac, _mac(self._key, b"wf-cap", body)):
            raise PermissionError("a read capability this holder did not get from its hub")
        if (time.time() if now is None else now) > expires:
            raise PermissionError("the read capability expired; re-plan the fetch")
        if not (region.startswith(scope) and region[len(scope):].isdigit()):
            raise PermissionError(f"the read capability covers {scope}*, not {region!r}")
        return reader


__all__ = ["ADMIN", "CAP_TTL_S", "MAX_CAP_BYTES", "MAX_SKEW_S", "ROLES", "SECRET_FILE_ENV",
           "Authority", "CapabilityBody", "CapabilityCheck", "Credential", "MacKey", "Principal",
           "ReplayGuard", "Verified", "capability", "curve_keys", "default_secret_path",
           "ensure_secret", "load_credential", "principal_of", "reply_mac", "scope_of",
           "serving_key"]
