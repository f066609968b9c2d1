"""The Redis store's worker-side commands: registration, liveness, event batches, resync, worker records.

:class:`WorkerCommands` answers them on one node: each call is one script on
the meta slot (``lua/*.lua``), atomic. :class:`ClusterWorkerCommands` is the
same but for event batches and resyncs, which on Cluster are one call to the
meta node (validate, advance ``seq``) and then node-batched block writes
(:meth:`~.redis_keyspace.RedisKeyspace.wb_write`); each step retries by itself
because the meta step is not idempotent. Semantics: :mod:`.contract`; key
layout: :mod:`.redis_store`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Iterable, Sequence

from remote_g2.errors import RegistryError, StaleEpoch
from remote_g2.protocol.messages import (
    BlockEvent, DrainWorkerReply, Events, EventsReply, Heartbeat, HeartbeatReply, LayoutFingerprint, RegisterWorker,
    RegisterWorkerReply, Resync, ResyncReply, WorkerKind, WorkerRecord,
)

from .redis_keyspace import RedisKeyspace, command

__all__ = ["WorkerCommands", "ClusterWorkerCommands"]

_KIND = {"stored": b"s", "removed": b"r", "cleared": b"c"}


def _kind(stored: bytes | None) -> WorkerKind | None:
    """A record's kind as stored ("source" for a source's, which the record states as None); a record
    written before kinds were stored is a source's."""
    if not stored or stored == b"source":
        return None
    if stored == b"events-only":
        return "events-only"
    raise RegistryError(f"a worker record holds an unknown kind {stored!r}: written by a newer registry?")


class WorkerCommands:
    """Registration, liveness, records, event batches and resyncs: each one script on the meta slot."""

    def __init__(self, space: RedisKeyspace, lease_ttl_ms: int) -> None:
        self.space = space
        self.lease_ttl_ms = lease_ttl_ms

    @command()
    def register_worker(self, req: RegisterWorker) -> RegisterWorkerReply:
        fp = req.fingerprint
        status, value = self.space.meta("register", req.worker_id, req.epoch, req.endpoint, _fp_json(fp),
                                        fp.compat_key(), fp.tp_size, self.lease_ttl_ms, req.kind or "source", _nonce())
        if status == b"new":
            return RegisterWorkerReply(self.lease_ttl_ms, 1, True)
        if status == b"renewed":
            return RegisterWorkerReply(self.lease_ttl_ms, int(value) + 1, False)
        if status == b"stale":
            raise StaleEpoch(f"worker {req.worker_id!r} registered with epoch {req.epoch}, "
                             f"older than the live epoch {value.decode()}")
        raise StaleEpoch(f"worker {req.worker_id!r} re-registered epoch {req.epoch} with a "
                         "different endpoint, fingerprint or kind; use a new epoch")

    @command()
    def heartbeat(self, req: Heartbeat) -> HeartbeatReply:
        renewed = self.space.meta("heartbeat", req.worker_id, req.epoch, req.load, self.lease_ttl_ms)
        if renewed == 2:  # the topology changed since its blocks were stored: some may be lost
            return HeartbeatReply("resync_needed", self.lease_ttl_ms)
        if renewed:
            return HeartbeatReply("ok", self.lease_ttl_ms)
        return HeartbeatReply("unknown_worker", 0)

    @command()
    def apply_events(self, req: Events) -> EventsReply:
        kinds = bytearray()
        counts: list[int] = []
        hashes: list[bytes] = []
        for ev in req.events:
            kinds += _KIND[ev.kind]
            if ev.kind == "cleared":
                counts.append(0)
            else:
                counts.append(len(ev.hashes))
                hashes += ev.hashes
        status, value = self.space.meta("events", req.worker_id, req.epoch, req.seq, req.seq - 1, bytes(kinds),
                                        *counts, *hashes, _nonce())
        return _events_reply(status, value, req.seq)

    @command()
    def resync(self, req: Resync) -> ResyncReply:
        status, last_seq, stored = self.space.meta("resync", req.worker_id, req.epoch, b"1" if req.first else b"0",
                                                   req.seq - 1 if req.last else b"", *req.hashes, _nonce())
        if status != b"ok":
            return ResyncReply("unknown_worker", 0, 0)
        return ResyncReply("ok", int(last_seq) + 1, int(stored))

    def _records(self, worker_ids: Sequence[str]) -> list[WorkerRecord]:
        return [record for _, record in self._records_with_incs(worker_ids)]

    def _records_with_incs(self, worker_ids: Sequence[str]) -> list[tuple[bytes, WorkerRecord]]:
        rows = self.space.meta("workers", *worker_ids)
        blocks = self.space.block_counts([row[1] for row in rows])
        out = []
        for (wid, inc, left, endpoint, epoch, fp, seq, load, reg, kind), n in zip(rows, blocks):
            fingerprint = LayoutFingerprint(**json.loads(fp))
            out.append((inc, WorkerRecord(
                worker_id=wid.decode(), endpoint=endpoint.decode(), epoch=int(epoch), tp_size=fingerprint.tp_size,
                fingerprint=fingerprint, live=left > 0, lease_expires_in_ms=int(left), blocks=n,
                last_seq=int(seq), load=int(load), registered_at_ms=int(reg), kind=_kind(kind))))
        return out

    @command()
    def scan_worker(self, worker_id: str, cursor: bytes, count: int) -> tuple[WorkerRecord | None, list[bytes], bytes]:
        # SSCAN's own guarantee is the contract: members present for the whole
        # scan come back at least once. The cursor is SSCAN's, as decimal text.
        rows = self._records_with_incs([worker_id])
        if not rows or not rows[0][1].live:
            return None, [], b""
        inc, record = rows[0]
        if cursor and not cursor.isdigit():
            raise RegistryError(f"scan_worker: cursor {cursor!r:.40} is not one this store handed out")
        key = self.space.keys.wb(inc)
        _, client = self.space.nodes.node(key)
        nxt, members = client.sscan(key, cursor=int(cursor or b"0"), count=count)
        return record, list(members), (b"" if int(nxt) == 0 else str(int(nxt)).encode())

    @command()
    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        records = self._records([worker_id])
        return records[0] if records else None

    @command()
    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]:
        return sorted((r for r in self._records([]) if include_dead or r.live), key=lambda r: r.worker_id)

    @command()
    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        inc = self.space.meta("drain", worker_id)
        if not inc:
            return DrainWorkerReply(False, 0)
        return DrainWorkerReply(True, self.space.block_counts([inc])[0])

    @command()
    def counts(self) -> tuple[int, int, int]:
        live, total, incs = self.space.meta("counts")
        return int(live), int(total), sum(self.space.block_counts(incs))


class ClusterWorkerCommands(WorkerCommands):
    """On Cluster: an event batch or resync is a meta step, then block writes node by node.

    Not atomic across nodes: the batch first advances the worker's sequence
    (meta slot), then writes the block sets; if that fails the caller gets
    StoreUnavailable and its retry is answered ``resync_needed``.
    """

    @command(retry=False)  # the meta step is not idempotent; each step retries by itself
    def apply_events(self, req: Events) -> EventsReply:
        segments: list[list[BlockEvent]] = [[]]  # the events between `cleared`s
        for ev in req.events:
            if ev.kind == "cleared":
                segments.append([])
            else:
                segments[-1].append(ev)
        nonce = _nonce()
        space = self.space
        reply = space.nodes.retrying(lambda: space.meta("begin_batch", req.worker_id, req.epoch, b"e", req.seq,
                                                        req.seq - 1, len(segments) - 1, nonce))
        if reply[0] != b"ok":
            return _events_reply(reply[0], reply[1], req.seq)
        applied = 0
        for n, (events, inc) in enumerate(zip(segments, reply[2:])):
            adds, removes, touched = _net_effect(events)
            cleared_after = n < len(segments) - 1
            applied += touched + space.nodes.retrying(
                lambda: space.wb_write(inc, adds, removes, count=cleared_after))
        return EventsReply("ok", req.seq + 1, applied)

    @command(retry=False)
    def resync(self, req: Resync) -> ResyncReply:
        nonce = _nonce()
        space = self.space
        reply = space.nodes.retrying(lambda: space.meta("begin_batch", req.worker_id, req.epoch, b"r",
                                                        b"1" if req.first else b"0",
                                                        req.seq - 1 if req.last else b"", nonce))
        if reply[0] != b"ok":
            return ResyncReply("unknown_worker", 0, 0)
        _, last_seq, inc = reply
        adds = list(dict.fromkeys(req.hashes))
        stored = space.nodes.retrying(lambda: space.wb_write(inc, adds, (), count=True))
        return ResyncReply("ok", int(last_seq) + 1, stored)


# -- small pure helpers -------------------------------------------------------------------------


def _nonce() -> bytes:
    """What a script that may make an incarnation appends to its ARGV (``fresh_inc`` in
    ``registry/stores/lua/_lib.lua``): 9 random decimal digits, drawn per call, so an id stays new even when
    Redis hands a counter value out again."""
    return b"%09d" % secrets.randbelow(10**9)


def _fp_json(fp: LayoutFingerprint) -> str:
    """Canonical text of a fingerprint: equal fingerprints give equal strings (compared inside Lua)."""
    return json.dumps(dataclasses.asdict(fp), sort_keys=True, separators=(",", ":"))


def _events_reply(status: bytes, value: bytes, seq: int) -> EventsReply:
    """Reply from a script's {status, value}: value is `applied` when ok, the last applied seq when not."""
    if status == b"ok":
        return EventsReply("ok", seq + 1, int(value))
    if status == b"resync_needed":
        return EventsReply("resync_needed", int(value) + 1, 0)
    return EventsReply("unknown_worker", 0, 0)


def _net_effect(events: Iterable[BlockEvent]) -> tuple[list[bytes], list[bytes], int]:
    """(hashes present after the events, hashes absent after them, hashes touched), in first-seen order.

    Applying the net effect is idempotent, which is what makes a retried node call safe.
    """
    state: dict[bytes, bool] = {}
    touched = 0
    for ev in events:
        present = ev.kind == "stored"
        for h in ev.hashes:
            state[h] = present
        touched += len(ev.hashes)
    return [h for h, p in state.items() if p], [h for h, p in state.items() if not p], touched
