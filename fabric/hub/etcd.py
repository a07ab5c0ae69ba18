"""A small synchronous etcd v3 client over etcd's JSON gateway (HTTP/1.1, standard library).

What the hubs of a high-availability service need from etcd and no more: keys (get, get
a prefix, put, delete), transactions (compare, then one list of operations or another),
leases (grant, keep alive, revoke), the member list and each member's status.
`fabric.hub.election` builds the leader election on it.

Why the JSON gateway rather than gRPC: every etcd server serves it (``POST /v3/kv/range``
and friends on the client port), so the fabric needs no gRPC or protobuf packages (the
python-etcd3 client is unmaintained and at odds with current protobuf; aetcd is asyncio,
while the hub is a synchronous zmq loop). Keys and values travel base64-encoded in JSON,
64-bit integers as JSON strings, and absent fields mean 0 / false / empty.

Behaviour:

- Every call has one deadline (``timeout`` seconds) and tries the endpoints in turn, the
  one that answered last first; `EtcdUnavailableError` when none answers in time. A
  connection is kept per endpoint and thread (a small pool), so a slow call on one
  thread (a transaction) never holds up another (an election's keep-alive).
- Requests carry ``Grpc-Metadata-hasleader: true`` (what etcd's Go client sends with
  ``WithRequireLeader``): a member cut off from the quorum answers at once with
  "etcdserver: no leader" instead of holding the request, and the next endpoint is tried.
- A write (put, delete, a transaction that writes) is sent to another endpoint only when
  the first surely never got it (connection refused, "no leader"); once sent, silence or a
  timeout from etcd raises `EtcdUnavailableError` whose message says the outcome is
  unknown. Reads, lease calls and the member list move on to the next endpoint.
- etcd's errors come back as `EtcdError` with etcd's own message; those that mean "no
  quorum now" (gRPC codes Unavailable, DeadlineExceeded, Canceled, ResourceExhausted:
  "request timed out", "leader changed", "no leader", ...) as `EtcdUnavailableError`.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

DEFAULT_PREFIX = "/weightfabric"
"""The key prefix of `EtcdClient.from_url` when the URL names none."""
DEFAULT_PORT = 2379

UNAVAILABLE_CODES = frozenset({1, 4, 8, 14})
"""gRPC codes that mean etcd cannot serve now (Canceled, DeadlineExceeded,
ResourceExhausted, Unavailable): no quorum, no leader, a leader change, overload."""
NOT_APPLIED = ("etcdserver: no leader", "etcdserver: not capable",
               "etcdserver: too many requests", "etcdserver: server stopped")
"""etcd errors given before a request is proposed: a write may go to the next member."""

_REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}

CompareOp = Literal["==", "!=", "<", ">"]
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


class EtcdError(Exception):
    """etcd refused a request, or could not be asked; the message says which endpoints and why.

    Attributes:
        code: etcd's gRPC status code when etcd answered with an error (5: not found,
            e.g. an unknown lease), else None.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailableError(EtcdError):
    """No endpoint answered in time, or the cluster has no quorum (no leader, timed out)."""


# --- values --------------------------------------------------------------------------------


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes ``[prefix, range_end)`` every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"     # an empty prefix (or all 0xff): every key from `prefix` on


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it (revisions are the cluster's, counted from 1)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        """Parse one of the gateway's ``kvs`` entries."""
        return cls(key=_unb64(kv.get("key")), value=_unb64(kv.get("value")),
                   create_revision=_int(kv.get("create_revision")),
                   mod_revision=_int(kv.get("mod_revision")),
                   version=_int(kv.get("version")), lease=_int(kv.get("lease")))


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction (`EtcdClient.txn`); build it with the class methods.

    A key that does not exist has create_revision, mod_revision and version 0 (so
    ``Compare.version(k, "==", 0)`` holds while ``k`` is absent).
    """

    key: bytes
    target: Literal["CREATE", "MOD", "VERSION", "VALUE"]
    op: CompareOp
    operand: int | bytes

    def __post_init__(self) -> None:
        if self.op not in _RESULTS:
            raise ValueError(f"compare operator must be one of {sorted(_RESULTS)}, "
                             f"got {self.op!r}")

    @classmethod
    def create_revision(cls, key: bytes | str, op: CompareOp, revision: int) -> Compare:
        """The revision that created ``key`` (0: absent)."""
        return cls(_bytes(key), "CREATE", op, int(revision))

    @classmethod
    def mod_revision(cls, key: bytes | str, op: CompareOp, revision: int) -> Compare:
        """The revision of ``key``'s last change (0: absent)."""
        return cls(_bytes(key), "MOD", op, int(revision))

    @classmethod
    def version(cls, key: bytes | str, op: CompareOp, version: int) -> Compare:
        """How many times ``key`` was written since it was created (0: absent)."""
        return cls(_bytes(key), "VERSION", op, int(version))

    @classmethod
    def value(cls, key: bytes | str, op: CompareOp, value: bytes | str) -> Compare:
        """``key``'s value (never holds for an absent key)."""
        return cls(_bytes(key), "VALUE", op, _bytes(value))

    def to_json(self) -> dict[str, Any]:
        """The gateway's form of the compare."""
        body: dict[str, Any] = {"key": _b64(self.key), "result": _RESULTS[self.op],
                                "target": self.target}
        if self.target == "VALUE":
            assert isinstance(self.operand, bytes)
            body["value"] = _b64(self.operand)
        else:
            name = {"CREATE": "create_revision", "MOD": "mod_revision",
                    "VERSION": "version"}[self.target]
            body[name] = str(self.operand)
        return body


@dataclass(frozen=True)
class Op:
    """One operation of a transaction (`EtcdClient.txn`); build it with the class methods."""

    kind: Literal["get", "put", "delete"]
    key: bytes
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    @classmethod
    def put(cls, key: bytes | str, value: bytes | str, lease: int = 0) -> Op:
        """Set ``key`` to ``value`` (attached to ``lease`` when not 0)."""
        return cls("put", _bytes(key), _bytes(value), lease=int(lease))

    @classmethod
    def delete(cls, key: bytes | str, prefix: bool = False) -> Op:
        """Delete ``key`` (every key starting with it when ``prefix``)."""
        return cls("delete", _bytes(key), prefix=prefix)

    @classmethod
    def get(cls, key: bytes | str, prefix: bool = False) -> Op:
        """Read ``key`` (every key starting with it, in key order, when ``prefix``)."""
        return cls("get", _bytes(key), prefix=prefix)

    def to_json(self) -> dict[str, Any]:
        """The gateway's form of the operation (a ``RequestOp``)."""
        body: dict[str, Any] = {"key": _b64(self.key)}
        if self.prefix:
            body["range_end"] = _b64(prefix_range_end(self.key))
        if self.kind == "put":
            body["value"] = _b64(self.value)
            if self.lease:
                body["lease"] = str(self.lease)
            return {"request_put": body}
        if self.kind == "delete":
            return {"request_delete_range": body}
        return {"request_range": body}


@dataclass(frozen=True)
class TxnResult:
    """What `EtcdClient.txn` did.

    Attributes:
        succeeded: every compare held (the success operations ran; else the failure ones).
        revision: the cluster's revision after the transaction.
        responses: one per operation that ran: a get's keys (list of `KeyValue`), None for
            a put, the number of keys a delete removed.
    """

    succeeded: bool
    revision: int
    responses: list[list[KeyValue] | int | None] = field(default_factory=list)


@dataclass(frozen=True)
class Member:
    """One member of the etcd cluster (``name`` is empty for a member added but not started)."""

    name: str
    id: int
    peer_urls: list[str]
    client_urls: list[str]


# --- endpoints -----------------------------------------------------------------------------


def normalize_endpoint(endpoint: str) -> str:
    """``"host:port"``, ``"host"`` or ``"http://host:port"`` -> ``"http://host:port"``.

    Raises:
        ValueError: not an endpoint (another scheme, a path, a bad port).
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("empty etcd endpoint")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {endpoint!r}: scheme must be http or https")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"etcd endpoint {endpoint!r}: only scheme://host:port")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"etcd endpoint {endpoint!r}: bad port") from exc
    host = parts.hostname
    if not host:
        raise ValueError(f"etcd endpoint {endpoint!r}: no host")
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port if port is not None else DEFAULT_PORT}"


class _Unsent(Exception):
    """The request surely did not reach etcd (connect failed): safe to send elsewhere."""


class _Silent(Exception):
    """The request was sent and no (whole) answer came back: its outcome is unknown."""


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether the server closed a pooled connection (it is readable: EOF or junk)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


# --- the client ----------------------------------------------------------------------------


class EtcdClient:
    """A synchronous, thread-safe client of one etcd cluster (see the module docstring).

    Args:
        endpoints: client URLs of the members: ``"http://127.0.0.1:2379"``, ``"h1:2379"``,
            a comma-separated string of them, or a list.
        timeout: seconds every call may take, all endpoints tried included.

    Raises:
        ValueError: no endpoint, or one that is not ``[http://]host[:port]``.
    """

    POOL_PER_ENDPOINT = 4
    """Idle connections kept per endpoint (one per thread that calls concurrently)."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 2.0) -> None:
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        self.endpoints: list[str] = []
        for item in items:
            url = normalize_endpoint(item)
            if url not in self.endpoints:
                self.endpoints.append(url)
        if not self.endpoints:
            raise ValueError("no etcd endpoint given")
        if not timeout > 0 or not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._idle: dict[str, list[http.client.HTTPConnection]] = {e: [] for e in self.endpoints}
        self._preferred = 0
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 2.0) -> tuple[EtcdClient, str]:
        """A client of ``etcd://h1:p1,h2:p2[/prefix]`` and the prefix (`DEFAULT_PREFIX` if none).

        The prefix comes back without a trailing slash (``/some/prefix``).

        Raises:
            ValueError: not an ``etcd://`` URL with at least one ``host[:port]``.
        """
        endpoints, prefix = parse_url(url)
        return cls(endpoints, timeout=timeout), prefix

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r}, timeout={self.timeout})"

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- keys ---

    def get(self, key: bytes | str, *, timeout: float | None = None) -> KeyValue | None:
        """``key`` as etcd holds it now (a linearizable read), or None when absent.

        Args:
            timeout: this call's deadline, when shorter than the client's.
        """
        reply = self._call("/v3/kv/range", {"key": _b64(_bytes(key))}, timeout=timeout)
        kvs = reply.get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes | str, *,
                   timeout: float | None = None) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key.

        Args:
            timeout: this call's deadline, when shorter than the client's.
        """
        p = _bytes(prefix)
        reply = self._call("/v3/kv/range", {"key": _b64(p or b"\0"),
                                            "range_end": _b64(prefix_range_end(p))},
                           timeout=timeout)
        return [KeyValue.from_json(kv) for kv in reply.get("kvs") or []]

    def put(self, key: bytes | str, value: bytes | str, *, lease: int = 0) -> int:
        """Set ``key`` (attached to ``lease`` when not 0); returns the new revision."""
        body: dict[str, Any] = {"key": _b64(_bytes(key)), "value": _b64(_bytes(value))}
        if lease:
            body["lease"] = str(int(lease))
        reply = self._call("/v3/kv/put", body, write=True)
        return _int(reply.get("header", {}).get("revision"))

    def delete(self, key: bytes | str, *, prefix: bool = False) -> int:
        """Delete ``key`` (every key starting with it when ``prefix``); returns how many went."""
        k = _bytes(key)
        body = {"key": _b64(k or b"\0") if prefix else _b64(k)}
        if prefix:
            body["range_end"] = _b64(prefix_range_end(k))
        reply = self._call("/v3/kv/deleterange", body, write=True)
        return _int(reply.get("deleted"))

    def txn(self, compare: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> TxnResult:
        """If every compare holds, run ``success``, else ``failure``, atomically.

        etcd limits the operations of one transaction (``--max-txn-ops``, 128 by default)
        and refuses one that writes a key twice.
        """
        body = {"compare": [c.to_json() for c in compare],
                "success": [op.to_json() for op in success],
                "failure": [op.to_json() for op in failure]}
        writes = any(op.kind != "get" for op in (*success, *failure))
        reply = self._call("/v3/kv/txn", body, write=writes)
        responses: list[list[KeyValue] | int | None] = []
        for item in reply.get("responses") or []:
            if "response_range" in item:
                kvs = (item["response_range"] or {}).get("kvs") or []
                responses.append([KeyValue.from_json(kv) for kv in kvs])
            elif "response_delete_range" in item:
                responses.append(_int((item["response_delete_range"] or {}).get("deleted")))
            else:
                responses.append(None)
        return TxnResult(succeeded=bool(reply.get("succeeded")),
                         revision=_int(reply.get("header", {}).get("revision")),
                         responses=responses)

    # --- leases ---

    def lease_grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to a whole second, at least 1); its id.

        etcd may grant more than asked: its minimum is 1.5 election timeouts (2 s with
        etcd's defaults); `lease_keepalive` says what it holds.
        """
        seconds = max(1, math.ceil(ttl))
        reply = self._call("/v3/lease/grant", {"TTL": str(seconds)})
        return _int(reply.get("ID"))

    def lease_keepalive(self, lease: int, *, timeout: float | None = None) -> float:
        """Renew ``lease`` to its full TTL; the TTL it now has (0: the lease is gone).

        Args:
            timeout: this call's deadline, when shorter than the client's.
        """
        reply = self._call("/v3/lease/keepalive", {"ID": str(int(lease))}, stream=True,
                           timeout=timeout)
        return float(_int(reply.get("TTL")))

    def lease_revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys now (an unknown or expired lease is no error)."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(int(lease))})
        except EtcdError as exc:
            if exc.code != 5:    # NotFound: "requested lease not found"
                raise

    # --- the cluster ---

    def members(self) -> list[Member]:
        """The cluster's members, as the first member that answers knows them."""
        reply = self._call("/v3/cluster/member/list", {}, require_leader=False)
        return [Member(name=m.get("name", ""), id=_int(m.get("ID")),
                       peer_urls=list(m.get("peerURLs") or []),
                       client_urls=list(m.get("clientURLs") or []))
                for m in reply.get("members") or []]

    def status(self, endpoint: str) -> dict[str, Any]:
        """One member's status; never raises for a member that is down or unhealthy.

        Returns:
            ``{"endpoint", "healthy", "leader", "member_id", "raft_term", "db_size",
            "error"}``: healthy when it answered, knows a leader and reports no alarm;
            ``leader`` is the leader's member id (0: none known); ``error`` says why not
            healthy (None when healthy).
        """
        url = normalize_endpoint(endpoint)
        out: dict[str, Any] = {"endpoint": url, "healthy": False, "leader": 0, "member_id": 0,
                               "raft_term": 0, "db_size": 0, "error": None}
        try:
            reply = self._call("/v3/maintenance/status", {}, endpoints=[url],
                               require_leader=False)
        except EtcdError as exc:
            out["error"] = str(exc)
            return out
        out.update(leader=_int(reply.get("leader")),
                   member_id=_int(reply.get("header", {}).get("member_id")),
                   raft_term=_int(reply.get("raftTerm")), db_size=_int(reply.get("dbSize")))
        errors = reply.get("errors") or []
        if errors:
            out["error"] = "; ".join(map(str, errors))
        elif not out["leader"]:
            out["error"] = "no leader (the member is cut off from the quorum)"
        else:
            out["healthy"] = True
        return out

    def close(self) -> None:
        """Close every idle connection; later calls raise `EtcdError`."""
        with self._lock:
            self._closed = True
            conns = [c for pool in self._idle.values() for c in pool]
            for pool in self._idle.values():
                pool.clear()
        for conn in conns:
            conn.close()

    # --- transport ---

    def _call(self, path: str, body: dict[str, Any], *, write: bool = False,
              stream: bool = False, require_leader: bool = True,
              endpoints: list[str] | None = None,
              timeout: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the endpoints in turn until one answers.

        Args:
            write: the request changes keys: once sent it is never sent again.
            stream: a streaming method (one request): the answer is ``{"result": ...}``.
            endpoints: these instead of the client's (no preference kept).
        """
        if self._closed:
            raise EtcdError(f"etcd client of {','.join(self.endpoints)} is closed")
        budget = self.timeout if timeout is None else max(0.001, min(timeout, self.timeout))
        deadline = time.monotonic() + budget
        if endpoints is None:
            with self._lock:
                first = self._preferred
            order = [self.endpoints[(first + i) % len(self.endpoints)]
                     for i in range(len(self.endpoints))]
        else:
            order = endpoints
        payload = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if require_leader:
            headers.update(_REQUIRE_LEADER)
        failures: list[str] = []
        for i, endpoint in enumerate(order):
            left = deadline - time.monotonic()
            if left <= 0:
                failures.append(f"{endpoint}: not tried (deadline passed)")
                continue
            # A read gets its share of what is left, so a silent member leaves time for
            # the others; a write keeps all of it once sent (it is never sent twice).
            share = left / (len(order) - i)
            try:
                status, data = self._post(endpoint, path, payload, headers,
                                          connect_s=share, answer_s=share if not write
                                          else left, deadline=deadline)
            except _Unsent as exc:
                self._demote(endpoint, endpoints)
                failures.append(f"{endpoint}: {exc}")
                continue
            except _Silent as exc:
                self._demote(endpoint, endpoints)
                if write:
                    raise EtcdUnavailableError(
                        f"etcd {endpoint} did not answer {path} ({exc}); the write may or "
                        f"may not have been applied") from None
                failures.append(f"{endpoint}: {exc}")
                continue
            try:
                reply = self._decode(endpoint, path, status, data, stream)
            except EtcdUnavailableError as exc:
                self._demote(endpoint, endpoints)
                if write and not str(exc).endswith(NOT_APPLIED):
                    raise
                failures.append(str(exc))
                continue
            except EtcdError:
                self._prefer(endpoint, endpoints)
                raise
            self._prefer(endpoint, endpoints)
            return reply
        raise EtcdUnavailableError(f"etcd unavailable ({path}, {budget:g} s): "
                                   + "; ".join(failures))

    def _prefer(self, endpoint: str, explicit: list[str] | None) -> None:
        if explicit is None:
            with self._lock:
                self._preferred = self.endpoints.index(endpoint)

    def _demote(self, endpoint: str, explicit: list[str] | None) -> None:
        """The preferred endpoint failed: the next call starts at the one after it."""
        if explicit is None:
            with self._lock:
                if self.endpoints[self._preferred] == endpoint:
                    self._preferred = (self._preferred + 1) % len(self.endpoints)

    def _decode(self, endpoint: str, path: str, status: int, data: bytes,
                stream: bool) -> dict[str, Any]:
        text = data.decode(errors="replace")
        try:
            reply = json.loads(data.splitlines()[0] if stream and data else data)
        except (ValueError, IndexError):
            raise EtcdError(f"etcd {endpoint} {path}: HTTP {status}: "
                            f"{text.strip()[:200] or 'empty answer'}", None) from None
        if not isinstance(reply, dict):
            raise EtcdError(f"etcd {endpoint} {path}: unexpected answer {text[:200]!r}")
        error = reply.get("error")
        if stream and isinstance(error, dict):     # a stream's error: {"error": {"grpc_code"...}}
            code, message = error.get("grpc_code"), error.get("message", "")
        elif error is not None or status != 200:
            code, message = reply.get("code"), reply.get("message") or error or f"HTTP {status}"
        else:
            code = message = None
        if message is not None:
            kind = EtcdUnavailableError if code in UNAVAILABLE_CODES else EtcdError
            raise kind(f"etcd {endpoint} {path}: {message}", code)
        if stream:
            result = reply.get("result")
            return result if isinstance(result, dict) else {}
        return reply

    def _post(self, endpoint: str, path: str, payload: bytes, headers: dict[str, str], *,
              connect_s: float, answer_s: float, deadline: float) -> tuple[int, bytes]:
        conn = self._checkout(endpoint)
        fresh = conn.sock is None
        try:
            if fresh:
                conn.timeout = max(0.001, connect_s)
                try:
                    conn.connect()
                except OSError as exc:
                    raise _Unsent(_describe(exc, "connecting")) from None
                if conn.sock is not None:
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert conn.sock is not None
            conn.sock.settimeout(max(0.001, min(answer_s, deadline - time.monotonic())))
            try:
                conn.request("POST", path, body=payload, headers=headers)
            except OSError as exc:   # nothing reached a live server: it had gone
                raise _Unsent(_describe(exc, "sending")) from None
            try:
                response = conn.getresponse()
                data = response.read()
                status = response.status
                reusable = not response.will_close
            except (OSError, http.client.HTTPException) as exc:
                raise _Silent(_describe(exc, "waiting for the answer")) from None
        except BaseException:
            conn.close()
            raise
        if reusable:
            self._checkin(endpoint, conn)
        else:
            conn.close()
        return status, data

    def _checkout(self, endpoint: str) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                pool = self._idle.setdefault(endpoint, [])
                conn = pool.pop() if pool else None
            if conn is None:
                parts = urlsplit(endpoint)
                cls = (http.client.HTTPSConnection if parts.scheme == "https"
                       else http.client.HTTPConnection)
                return cls(parts.hostname or "", parts.port)
            if not _dropped(conn):
                return conn
            conn.close()

    def _checkin(self, endpoint: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            pool = self._idle.setdefault(endpoint, [])
            if not self._closed and len(pool) < self.POOL_PER_ENDPOINT:
                pool.append(conn)
                return
        conn.close()


def _describe(exc: BaseException, doing: str) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer in time ({doing})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc) or type(exc).__name__
    return f"{text} ({doing})"


def parse_url(url: str) -> tuple[list[str], str]:
    """``etcd://h1:p1,h2:p2[/prefix]`` -> (``["http://h1:p1", ...]``, ``"/prefix"``).

    Raises:
        ValueError: another scheme, no host, a bad port, a query or fragment.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "etcd":
        raise ValueError(f"not an etcd URL: {url!r} (etcd://HOST:PORT[,HOST:PORT...][/PREFIX])")
    if "?" in rest or "#" in rest:
        raise ValueError(f"etcd URL {url!r}: no query or fragment allowed")
    hosts, slash, path = rest.partition("/")
    endpoints = []
    for host in hosts.split(","):
        if not host.strip():
            raise ValueError(f"etcd URL {url!r}: empty host")
        if "@" in host:
            raise ValueError(f"etcd URL {url!r}: no user names (etcd auth is not supported)")
        endpoints.append(normalize_endpoint(host))
    prefix = ("/" + path).rstrip("/") if slash else ""
    if "//" in prefix:
        raise ValueError(f"etcd URL {url!r}: empty path segment in the prefix")
    return endpoints, prefix or DEFAULT_PREFIX


__all__ = [
    "DEFAULT_PREFIX",
    "Compare",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailableError",
    "KeyValue",
    "Member",
    "Op",
    "TxnResult",
    "normalize_endpoint",
    "parse_url",
    "prefix_range_end",
]
