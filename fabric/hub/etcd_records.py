"""Hub records in etcd: the `RecordStore` several hubs share (``--store etcd://...``).

Key space under the store's prefix (default ``/weightfabric``):

* ``{prefix}/format``: ``weightfabric-hub/1``, written by the first hub; a key space
  that holds keys but not this one was written by something else, and no hub starts
  on it;
* ``{prefix}/models/{model}``: one JSON record per model (next version number,
  retention and pins, the versions not retired with their state and shard count, the
  numbers ever handed out, the last retired with why): `fabric.hub.persist`'s
  `DurableState`, cut per model so that a change rewrites only its model;
* ``{prefix}/kv/{key}``: one rendezvous key each (value, wall-clock deadline, owner);
* ``{prefix}/leader/...``: the election, one key per hub (`fabric.hub.service`).

Every save is one etcd transaction guarded by the writer's leadership (the create
revision of its election key): a hub that lost the lead without knowing it yet
writes nothing, so two hubs can never hand out the same version number or both
commit. Only the records that changed are written.
"""

from __future__ import annotations

import functools
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
        self._written: dict[bytes, bytes] = {}   # etcd key -> record as last read or written

    @property
    def describe(self) -> str:
        """The etcd endpoints and prefix."""
        return f"etcd {','.join(self.client.endpoints)} prefix {self.prefix}"

    def model_key(self, model: str) -> bytes:
        """The key of ``model``'s record."""
        return f"{self.prefix}/models/{model}".encode()

    def kv_key(self, key: str) -> bytes:
        """The etcd key of rendezvous key ``key``."""
        return f"{self.prefix}/kv/{key}".encode()

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
                foreign = [kv.key for kv in self.client.get_prefix(self.prefix + "/")
                           if not kv.key.startswith(self._ours)]
                if foreign:
                    raise ValueError(
                        f"etcd prefix {self.prefix!r} holds keys no weightfabric hub wrote (e.g. "
                        f"{foreign[0].decode(errors='replace')!r}); give the hub a prefix of "
                        "its own: etcd://HOST:PORT/PREFIX")
                self.client.txn([Compare.version(fmt_key, "==", 0)], [Op.put(fmt_key, FORMAT)])
            elif fmt.value != FORMAT:
                raise ValueError(f"etcd prefix {self.prefix!r} holds records of format "
                                 f"{fmt.value[:40]!r}, not {FORMAT.decode()}; give this hub "
                                 "another prefix")
            models = self.client.get_prefix(f"{self.prefix}/models/")
            keys = self.client.get_prefix(f"{self.prefix}/kv/")
        except EtcdError as exc:
            raise StoreUnavailableError(f"cannot read the hub's records from {self.describe}: "
                                        f"{exc}") from exc
        raw: dict[str, Any] = {field: {} for field in (*_FIELDS, "kv")}
        for kv in (*models, *keys):
            try:
                record = json.loads(kv.value)
                if kv.key.startswith(self.model_key("")):
                    model = kv.key[len(self.model_key("")):].decode()
                    for field, name in _FIELDS.items():
                        if name in record:
                            raw[field][model] = record[name]
                else:
                    raw["kv"][kv.key[len(self.kv_key("")):].decode()] = record
            except (ValueError, TypeError) as exc:
                raise ValueError(f"etcd key {kv.key!r}: not a hub record ({exc})") from exc
        state = parse_state(raw)
        self._written = {kv.key: kv.value for kv in (*models, *keys)}
        return state

    def save(self, state: DurableState) -> None:
        """Write the models whose record changed, in guarded transactions.

        Raises:
            StoreUnavailableError: etcd did not take it (no quorum, no answer).
            NotLeaderError: the guard failed: another hub leads now.
        """
        records = self.records(state)
        ops = [Op.put(k, body) for k, body in records.items() if self._written.get(k) != body]
        ops += [Op.delete(k) for k in self._written if k not in records]
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

    def records(self, state: DurableState) -> dict[bytes, bytes]:
        """``state`` cut into etcd keys: a JSON record per model and per rendezvous key.

        JSON with sorted keys: equal records, equal bytes (only changes are written).
        """
        out: dict[bytes, dict[str, Any]] = {}
        whole = state_json(state)
        kv = whole.pop("kv")
        for field, values in whole.items():
            for model, value in values.items():
                out.setdefault(self.model_key(model), {})[_FIELDS[field]] = value
        dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))
        return {**{k: dump(r).encode() for k, r in out.items()},
                **{self.kv_key(k): dump(r).encode() for k, r in kv.items()}}

    @property
    def _ours(self) -> tuple[bytes, ...]:
        return tuple(f"{self.prefix}/{part}/".encode() for part in ("models", "kv", "leader"))


__all__ = ["FORMAT", "EtcdRecords"]
