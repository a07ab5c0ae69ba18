"""Which credential may run which hub operation (`fabric.auth` roles).

``read`` covers a worker's whole life as a reader and holder: register, fetch, serve,
derive engine layouts, read metadata, and the key-value store for keys it owns.
Publishing a model's versions needs ``publish`` for that model (a derived layout's
versions need ``read``: rollouts derive them); retention and pins need ``admin``. A
restore may not re-create a version the hub does not know unless the credential may
publish its model: otherwise a reader could announce weights of its own after a hub
restart. Key-value keys belong to the first credential that wrote them: another may
read them but not overwrite them (an admin may).
"""

from __future__ import annotations

from typing import Any

import msgspec

from weightfabric.fabric.auth import Principal
from weightfabric.fabric.errors import ForbiddenError
from weightfabric.fabric.hub.state import HubState, derived_base
from weightfabric.fabric.hub_messages import KvPutRequest, Request, RestoreRequest

PUBLISH_OPS = frozenset({"begin_publish", "commit", "abort_publish"})
ADMIN_OPS = frozenset({"set_retention", "pin"})


class Rights:
    """The hub's authorization of each request (key owners are kept with the keys)."""

    def check(self, state: HubState, who: Principal, op: str, req: Any
              ) -> tuple[Any, list[tuple[str, int, int, str]]]:
        """``req`` as ``who`` may run it, and restore holdings refused for want of rights.

        Raises:
            ForbiddenError: ``who`` may not run ``op`` (the message names the right).
        """
        if op in ADMIN_OPS and not who.may("admin"):
            raise _forbidden(who, op, "administer (admin)")
        if op in PUBLISH_OPS:
            model = req.model
            if derived_base(model) is None and not who.may("publish", model):
                raise _forbidden(who, op, f"publish {model!r}")
        if not who.may("read"):
            raise _forbidden(who, op, "read")
        if isinstance(req, KvPutRequest):
            self._check_owner(state, who, req.key)
        if isinstance(req, RestoreRequest):
            return self._restorable(state, who, req)
        return req, []

    @staticmethod
    def wrote(state: HubState, who: Principal, req: Request) -> None:
        """Note the owner of a key ``req`` (a successful ``kv_put``) wrote, if it has none."""
        if isinstance(req, KvPutRequest) and state.kv.claim(req.key, who.name):
            state.durable_generation += 1      # the owner is part of the records

    @staticmethod
    def _check_owner(state: HubState, who: Principal, key: str) -> None:
        owner = state.kv.owner(key)      # None once the key expired: the next writer owns it
        if owner is not None and owner != who.name and not who.may("admin"):
            raise ForbiddenError(f"kv key {key!r} belongs to {owner!r}; {who.describe()} may "
                                 "read it but not overwrite it (an admin may)")

    @staticmethod
    def _restorable(state: HubState, who: Principal, req: RestoreRequest
                    ) -> tuple[RestoreRequest, list[tuple[str, int, int, str]]]:
        keep, refused = [], []
        for h in req.holdings:
            m = state.models.get(h.model)
            known = m is not None and h.version in m.versions
            if known or derived_base(h.model) is not None or who.may("publish", h.model):
                keep.append(h)
            else:
                refused.append((h.model, h.version, h.shard,
                                f"{who.describe()} may not re-create a version the hub does "
                                "not know; its publisher restores it first"))
        return msgspec.structs.replace(req, holdings=keep), refused


def _forbidden(who: Principal, op: str, right: str) -> ForbiddenError:
    return ForbiddenError(f"{op}: {who.describe()} lacks the right to {right}; ask the hub's "
                          "operator for a token with it (`fabric hub token`)")


__all__ = ["ADMIN_OPS", "PUBLISH_OPS", "Rights"]
