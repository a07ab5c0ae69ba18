"""A node's fresh fetches of one shard, begun in one request: how a relay joins and answers them.

When a version commits, each node's readers ask for it at about the same moment, so a node
relay's batch carries several ``begin_fetch`` requests for the same shard. Alone, each is
decoded, checked, run, answered (its plan carrying the manifest, one checksum per chunk)
and kept for retries by the hub: about a third of what a reader's begin in a batch costs
the hub is that, not the fetch. A relay joins those it vouches for (signed with its own
credential, `fabric.relay`) into one ``begin_fetches`` request (`join`); the hub begins each
reader's fetch as alone and answers them together, the manifest once
(`fabric.hub.server`); the relay builds each reader's answer (`split`) as the hub would
have sent it alone, and signs it.

Only fresh begins join: no fetch group, no chunks held, ``group_size`` 1. A reader the hub
leaves out (a planned reader that waits for its upstreams), or a ``begin_fetches`` refused
whole (an older hub that does not know it), has its request sent alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from weightfabric.fabric.errors import ProtocolError
from weightfabric.fabric.hub_messages import (
    NO_MANIFEST,
    BeginFetchesReply,
    BeginFetchesRequest,
    BeginFetchRequest,
    ErrorBody,
    NodeReader,
)
from weightfabric.fabric.protocol import (
    ERROR,
    MAX_MESSAGE_SIZE,
    REPLY,
    REQUEST,
    decode,
    decode_body,
    encode,
)


class Item(NamedTuple):
    """A batch's request: one worker's, or the joined begins of several.

    ``members``: the indices (in what `join` was given) of the requests it carries;
    ``req_ids``: theirs, for their answers, when joined (empty for a request alone).
    """

    payload: bytes
    members: list[int]
    req_ids: list[int]


def join(payloads: Sequence[bytes], vouched: Sequence[bool], session: str, *,
         max_size: int = MAX_MESSAGE_SIZE) -> list[Item]:
    """A batch's items: the vouched fresh ``begin_fetch`` requests of one shard joined.

    A joined request takes the place of its first member; the others keep their order.
    ``session``: the relay's (the joined request's envelope).
    """
    items: list[Item | None] = []
    groups: dict[tuple[str, int | str, int, str | None], tuple[int, list[int], list[int],
                                                                 list[NodeReader]]] = {}
    for i, (payload, mine) in enumerate(zip(payloads, vouched, strict=True)):
        begin = _fresh_begin(payload) if mine else None
        if begin is None:
            items.append(Item(payload, [i], []))
            continue
        req_id, tag, req = begin
        key = (req.model, req.version, req.shard, req.fingerprint)
        group = groups.get(key)
        if group is None:
            group = groups[key] = (len(items), [], [], [])
            items.append(None)
        group[1].append(i)
        group[2].append(req_id)
        group[3].append(NodeReader(req.worker, tag, req.fetch_id))
    for (model, version, shard, fingerprint), (at, members, req_ids, readers) in groups.items():
        if len(members) == 1:
            items[at] = Item(payloads[members[0]], members, [])
            continue
        joined = BeginFetchesRequest(model=model, version=version, shard=shard,
                                     fingerprint=fingerprint, readers=readers)
        items[at] = Item(encode(REQUEST, 0, session, joined.op, joined, max_size=max_size),
                         members, req_ids)
    return [item for item in items if item is not None]


def split(data: bytes, req_ids: Sequence[int], *, max_size: int = MAX_MESSAGE_SIZE
          ) -> list[bytes | None]:
    """Each joined reader's answer, as the hub would have sent it alone; None: send alone.

    ``data``: the hub's answer to the joined request; ``req_ids``: the readers' request ids.
    """
    nobody: list[bytes | None] = [None] * len(req_ids)
    try:
        msg = decode(data, max_size=max_size)
        if msg.kind != REPLY:
            return nobody             # refused whole: each goes alone
        reply = decode_body(msg, BeginFetchesReply)
    except (ProtocolError, msgspec.ValidationError, msgspec.DecodeError):
        return nobody
    if not len(reply.plans) == len(reply.errors) == len(req_ids):
        return nobody
    manifest = None if bytes(reply.manifest) == bytes(NO_MANIFEST) else reply.manifest
    answers: list[bytes | None] = []
    for req_id, plan, error in zip(req_ids, reply.plans, reply.errors, strict=True):
        if plan is not None:
            body = plan if manifest is None else msgspec.structs.replace(plan, manifest=manifest)
            answers.append(encode(REPLY, req_id, msg.tag, "", body, max_size=max_size))
        elif error is not None:
            answers.append(encode(ERROR, req_id, msg.tag, error[0],
                                  ErrorBody(message=error[1])))
        else:
            answers.append(None)
    return answers


def _fresh_begin(payload: bytes) -> tuple[int, str, BeginFetchRequest] | None:
    """``(req_id, session, request)`` of a fresh ``begin_fetch``; None for anything else."""
    try:
        msg = decode(payload)
        if msg.kind != REQUEST or msg.name != BeginFetchRequest.op:
            return None
        req = decode_body(msg, BeginFetchRequest)
    except (ProtocolError, msgspec.ValidationError, msgspec.DecodeError):
        return None       # alone: the hub says what is wrong with it
    if req.group is not None or req.group_size != 1 or req.have:
        return None
    return msg.req_id, msg.tag, req


__all__ = ["Item", "join", "split"]
