"""Hub records in etcd: the `RecordStore` several hubs share (``--store etcd://...``).

Key space under the store's prefix (default ``/weightfabric``):

* ``{prefix}/format``: ``weightfabric-hub/1``, written by the first hub; a key space
  that holds keys but not this one was written by something else, and no hub starts
  on it;
* ``{prefix}/models/{model}``: one JSON record per model (next version number,
  retention and pins, the versions not retired with their state and shard count, the
  numbers ever handed out, the last retired with why): `fabric.hub.persist`'s
  `DurableState`, cut per model so that a change rewrites only its model;
* ``{prefix}/leader/...`` and ``{prefix}/hubs/...``: the election and the hubs alive
  (`fabric.hub.leadership`).

Every save is one etcd transaction guarded by the writer's leadership (the create
revision of its election key): a hub that lost the lead without knowing it yet
writes nothing, so two hubs can never hand out the same version number or both
commit. Only models whose record changed are written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from weightfabric.fabric.errors import NotLeaderError, StoreUnavailableError
from weightfabric.fabric.hub.etcd import Compare, EtcdClient, EtcdError, EtcdUnavailableError, Op
from weightfabric.fabric.hub.persist import DurableState, parse_state, state_json

FORMAT = b"weightfabric-hub/1"
MAX_TXN_OPS = 100    # etcd refuses transactions over --max-txn-ops (128 by default)
_FIELDS = {"next_versions": "next_version", "policies": "policy", "versions": "versions",
           "seen": "seen", "retired": "retired"}


class EtcdRecords:
    """A hub's durable records in etcd.

    Args:
        client: the etcd cluster (`fabric.hub.etcd.EtcdClient`).
        prefix: the key space (several deployments may share one etcd under prefixes).
        guard: the compare that holds while this hub leads (`Election.guard`); None
            writes unguarded (a single hub, tests).
    """

    def __init__(self, client: EtcdClient, prefix: str,
                 guard: Callable[[], Compare] | None = None) -> None:
        self.client = client
        self.prefix = prefix.rstrip("/")
        self.guard = guard
        self._written: dict[str, bytes] = {}   # model -> its record as last read or written

    @property
    def describe(self) -> str:
        """The etcd endpoints and prefix."""
        return f"etcd {','.join(self.client.endpoints)} prefix {self.prefix}"

    def model_key(self, model: str) -> bytes:
        """The key of ``model``'s record."""
        return f"{self.prefix}/models/{model}".encode()

    def load(self) -> DurableState:
        """Every model's record, after checking the key space is this format's.

        Raises:
            ValueError: keys under the prefix that a weightfabric hub did not write.
            StoreUnavailableError: etcd does not answer.
        """
        fmt_key = f"{self.prefix}/format".encode()
        try:
            fmt = self.client.get(fmt_key)
            if fmt is None:
                others = self.client.get_prefix(self.prefix + "/")
                if any(not kv.key.startswith(self._ours) for kv in others):
                    raise ValueError(
                        f"etcd prefix {self.prefix!r} holds keys no weightfabric hub wrote (e.g. "
                        f"{others[0].key.decode(errors='replace')!r}); give the hub a prefix of "
                        "its own: etcd://HOST:PORT/PREFIX")
                self.client.txn([Compare.version(fmt_key, "==", 0)], [Op.put(fmt_key, FORMAT)])
            elif fmt.value != FORMAT:
                raise ValueError(f"etcd prefix {self.prefix!r} holds records of format "
                                 f"{fmt.value[:40]!r}, not {FORMAT.decode()}; give this hub "
                                 "another prefix")
            kvs = self.client.get_prefix(f"{self.prefix}/models/")
        except EtcdError as exc:
            raise StoreUnavailableError(f"cannot read the hub's records from {self.describe}: "
                                        f"{exc}") from exc
        start = len(self.model_key(""))
        records = {kv.key[start:].decode(): kv.value for kv in kvs}
        raw: dict[str, Any] = {field: {} for field in _FIELDS}
        for model, body in records.items():
            try:
                record = json.loads(body)
                for field, name in _FIELDS.items():
                    if name in record:
                        raw[field][model] = record[name]
            except (ValueError, TypeError) as exc:
                raise ValueError(f"etcd key {self.model_key(model)!r}: not a hub record "
                                 f"({exc})") from exc
        state = parse_state(raw)
        self._written = records
        return state

    def save(self, state: DurableState) -> None:
        """Write the models whose record changed, in guarded transactions.

        Raises:
            StoreUnavailableError: etcd did not take it (no quorum, no answer).
            NotLeaderError: the guard failed: another hub leads now.
        """
        records = model_records(state)
        ops = [Op.put(self.model_key(m), body) for m, body in records.items()
               if self._written.get(m) != body]
        ops += [Op.delete(self.model_key(m)) for m in self._written if m not in records]
        compare = [self.guard()] if self.guard is not None else []
        for i in range(0, len(ops), MAX_TXN_OPS):
            for attempt in range(2):
                try:
                    result = self.client.txn(compare, ops[i:i + MAX_TXN_OPS])
                    break
                except EtcdUnavailableError as exc:
                    # Whole records put under the same guard: sending again is safe, and
                    # gets past a member that died with the first try in flight.
                    if attempt == 1:
                        raise StoreUnavailableError(f"the hub could not save its records to "
                                                    f"{self.describe}: {exc}") from exc
                except EtcdError as exc:
                    raise StoreUnavailableError(f"the hub could not save its records to "
                                                f"{self.describe}: {exc}") from exc
            if not result.succeeded:
                raise NotLeaderError("this hub no longer leads (another hub took over in "
                                     "etcd); nothing was saved; retry: clients move on to "
                                     "the leader")
        self._written = records

    def close(self) -> None:
        """Close the etcd client."""
        self.client.close()

    @property
    def _ours(self) -> tuple[bytes, ...]:
        return tuple(f"{self.prefix}/{part}/".encode() for part in ("models", "leader", "hubs"))


def model_records(state: DurableState) -> dict[str, bytes]:
    """``state`` cut into one JSON record per model (keys sorted: equal state, equal bytes)."""
    out: dict[str, dict[str, Any]] = {}
    for field, values in state_json(state).items():
        for model, value in values.items():
            out.setdefault(model, {})[_FIELDS[field]] = value
    return {m: json.dumps(r, sort_keys=True, separators=(",", ":")).encode()
            for m, r in out.items()}


__all__ = ["FORMAT", "EtcdRecords", "model_records"]
