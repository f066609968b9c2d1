"""The Redis store's target-side commands: prefix lookup (one, or a pipelined batch) and who-has.

On one node a lookup is ONE ``EVALSHA`` of ``lua/lookup.lua`` (liveness,
layout filter, and the walk hash by hash, reading each candidate's prefix
from its ``wb`` set), and a batch of lookups is one pipelined write whose
replies are read when they arrive (:meth:`LookupCommands.start_many`). On
Cluster a lookup first reads the block sets held by the other nodes, one call
per node in parallel, then runs the same script on the meta slot's node with
those members inline. Semantics: :mod:`.contract`; key layout:
:mod:`.redis_store`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import redis

from remote_g2.protocol.messages import Holder, Lookup, LookupReply

from .contract import ConvertedLookups, PendingLookups
from .redis_keyspace import RedisKeyspace, command
from .redis_nodes import REDIS_ERRORS

__all__ = ["LookupCommands"]


class LookupCommands:
    """The target side: prefix lookup and who-has."""

    def __init__(self, space: RedisKeyspace) -> None:
        self.space = space

    @command()
    def lookup(self, hashes: Sequence[bytes], *, compat_key: str | None = None, requester: str | None = None,
               want_all_holders: bool = False, tie_breaker: int = 0) -> LookupReply:
        if not hashes:
            return LookupReply("no_candidate", 0)
        space = self.space
        payload: list[bytes] = list(hashes)
        kinds = bytearray(b"k" * len(payload))
        meta_name, meta_client = space.nodes.node(space.keys.lease)
        keys: list[bytes] = []
        remote: list[tuple[redis.Redis, list[int]]] = []
        if not space.nodes.all_keys_local:  # Cluster: read other nodes' block sets first, one call per node
            keys = [space.keys.block + h for h in payload]
            remote = [(c, idx) for name, (c, idx) in space.nodes.group(keys).items() if name != meta_name]
        if remote:
            replies = space.fan_out([functools.partial(space.scripts.run, c, "members", keys[idx[0]],
                                                       [*space.keys.header, *(payload[i] for i in idx)])
                                     for c, idx in remote])
            for (_, idx), members in zip(remote, replies):
                for i, m in zip(idx, members):
                    kinds[i] = ord("m")
                    payload[i] = b",".join(m)
            if kinds[0] == ord("m") and not payload[0]:
                return LookupReply("no_candidate", 0)  # nobody, live or dead, holds the first block
        reply = space.scripts.run(meta_client, "lookup", space.keys.lease,
                                  self._lookup_args(payload, bytes(kinds), requester, compat_key, want_all_holders))
        return _lookup_reply(reply, tie_breaker)

    def start_many(self, requests: Sequence[Lookup], tie_breakers: Sequence[int]) -> PendingLookups:
        """One node only: every lookup is one EVALSHA, so the batch is one pipelined write; the
        replies are read when the caller's poller sees them arrive."""
        space = self.space
        _, client = space.nodes.node(space.keys.lease)
        try:
            pending = space.scripts.start_many(client, "lookup", space.keys.lease, [
                self._lookup_args(r.hashes, b"k" * len(r.hashes), r.requester, r.compat_key, r.want_all_holders)
                for r in requests])
        except REDIS_ERRORS as e:
            raise space.unavailable(e) from e
        ties = list(tie_breakers)
        return ConvertedLookups(pending, lambda replies: [_lookup_reply(raw, t) for raw, t in
                                                          zip(replies, ties, strict=True)],
                                errors=REDIS_ERRORS, on_error=space.unavailable)

    def _lookup_args(self, payload: Sequence[bytes], kinds: bytes, requester: str | None,
                     compat_key: str | None, want_all_holders: bool) -> list[Any]:
        return [*self.space.keys.header, requester or "", compat_key or "", b"1" if want_all_holders else b"0",
                b"inc" if self.space.nodes.all_keys_local else b"pos", kinds, *payload]

    def raw_lookup(self, client: redis.Redis, hashes: Sequence[bytes]) -> Any:
        """One EVALSHA of the lookup script on ``client``, reply left raw (single node only).

        The benchmark's baseline: the same Redis work as :meth:`lookup`, without
        the Python around it. Returns ``[b"ok", matched, tied, holders]`` or ``[reason]``.
        """
        return self.space.scripts.run(client, "lookup", self.space.keys.lease,
                                      self._lookup_args(hashes, b"k" * len(hashes), None, None, False))

    @command()
    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> list[list[str]]:
        hashes = list(hashes)
        members: list[list[bytes]] = [[] for _ in hashes]
        for idx, reply in self.space.per_node("members", hashes):
            for i, m in zip(idx, reply):
                members[i] = m
        incs = sorted({inc for m in members for inc in m})
        if not incs:
            return [[] for _ in hashes]
        owner = {}
        for inc, row in zip(incs, self.space.meta("who_is", *incs)):
            if row and (include_dead or row[1]):
                owner[inc] = row[0].decode()
        return [sorted({owner[inc] for inc in m if inc in owner}) for m in members]


def _lookup_reply(reply: Any, tie_breaker: int) -> LookupReply:
    """A lookup script's reply as a :class:`LookupReply` (see ``lua/lookup.lua``)."""
    if reply[0] != b"ok":
        return LookupReply(reply[0].decode(), 0)
    _, matched, tied, holders = reply
    tied = sorted((Holder(w.decode(), e.decode(), int(tp), matched) for w, e, tp in tied),
                  key=lambda x: x.worker_id)
    everyone = sorted((Holder(w.decode(), e.decode(), int(tp), m) for w, e, tp, m in holders),
                      key=lambda x: (-x.matched, x.worker_id))
    return LookupReply("ok", matched, tied[tie_breaker % len(tied)], everyone)
