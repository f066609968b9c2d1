"""vLLM's KV-event wire format, decoded strictly (the subscriber of :mod:`.vllm_events` reads it).

vLLM's ``ZmqEventPublisher`` sends a msgspec-msgpack ``KVEventBatch`` per
message: ``[ts, events, data_parallel_rank?]``, each event a tagged struct —
``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, …), ``BlockRemoved`` (block_hashes, medium, …) or
``AllBlocksCleared`` — packed as an array ``["BlockStored", f1, f2, …]`` or a
map ``{"type": "BlockStored", …}`` depending on the release; both are read.

:func:`decode_kv_event_batch` gives two views of a batch:

* ``events`` — the G2 tier's block events for the registry's store: the host
  medium (``"CPU"``) only unless ``all_media``, and only 32-byte (full)
  hashes — vLLM's default 64-bit int form cannot be turned back into the key
  a connector looks up, so such events are counted, not stored;
* ``engine`` (only when asked for) — every event, every medium, hashes in either form (an int as
  its 8 big-endian bytes: the low 64 bits of vLLM's hash), with the token ids
  and block size a BlockStored carries: what the engine itself holds, for
  scoring only (:mod:`.engine_caches`), never for reads.

A batch that is not a ``KVEventBatch`` at all is a :class:`ProtocolError`.
One event that is malformed (an unknown type, a field of the wrong type) is
refused on its own: left out of both views and counted in
``DecodedBatch.refused``, and the rest of its batch is kept. Leaving out a
BlockStored only shortens a match; leaving out a BlockRemoved leaves a hash
that a resolve then finds missing, as a missed batch would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from remote_g2.errors import ProtocolError
from remote_g2.protocol.messages import BlockEvent

__all__ = ["G2_MEDIUM", "DecodedBatch", "EngineEvent", "decode_kv_event_batch"]

G2_MEDIUM = "CPU"
_MAX_PAYLOAD = 64 * 1024 * 1024
# Field order of the array-like encoding (vllm/distributed/kv_events.py).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """One KV event as the engine sent it, for the engine-cache view (see the module docstring).

    ``hashes`` (and ``parent``) are 32 bytes where vLLM sent bytes, 8 where it sent its 64-bit int;
    ``token_ids`` / ``block_size`` / ``lora_id`` only for a BlockStored that carried them; ``group`` is vLLM's
    ``group_idx`` (its KV-cache group) where the event names one (map-tagged releases).
    """

    kind: Literal["stored", "removed", "cleared"]
    medium: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    parent: bytes | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    group: int | None = None


@dataclass(frozen=True)
class DecodedBatch:
    """The G2 block events of one vLLM batch, and what was left out of it.

    ``int_hash_events``: events skipped because their hashes were vLLM's 64-bit
    ints; ``other_media``: media of events ignored by the medium filter; ``refused``: malformed events left
    out of both views (``refusal`` says why the first was).
    """

    events: list[BlockEvent]
    int_hash_events: int = 0
    other_media: frozenset[str | None] = frozenset()
    engine: list[EngineEvent] = field(default_factory=list, compare=False)
    refused: int = 0
    refusal: str = field(default="", compare=False)


def _hashes(values: list[Any], convert_ints: bool) -> tuple[list[bytes], bool]:
    """The hashes as bytes, and whether any was an int; an int becomes its 8 big-endian bytes only with
    ``convert_ints`` (the engine view: without it, an event with ints is counted, never stored)."""
    out: list[bytes] = []
    ints = False
    for v in values:
        if type(v) is bytes and 1 <= len(v) <= 32:
            out.append(v)
        elif type(v) is int and -(2**63) <= v < 2**64:
            ints = True
            if convert_ints:
                out.append((v & _U64).to_bytes(8, "big"))
        else:
            raise ProtocolError(f"block hash must be 1..32 bytes or a 64-bit int, got {type(v).__name__}")
    return out, ints


def _token_ids(value: Any) -> list[int] | None:
    if type(value) is list and all(type(t) is int and 0 <= t < 2**31 for t in value):
        return value
    return None  # absent or odd: nothing is learned from this event (it is not malformed for that)


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if type(raw) is list and raw and type(raw[0]) is str:
        return dict(zip(names, raw[1:]))
    if type(raw) is dict and type(raw.get("type")) is str:
        return raw
    raise ProtocolError("event is neither a tagged array nor a tagged map")


def decode_kv_event_batch(payload: bytes, *, all_media: bool = False, engine: bool = False) -> DecodedBatch:
    """Decode one vLLM ``KVEventBatch`` into block events for the G2 tier (strict); with ``engine``, also its
    engine view (``DecodedBatch.engine``: only a server that scores asks, so no other pays for its token ids)."""
    if len(payload) > _MAX_PAYLOAD:
        raise ProtocolError(f"event batch of {len(payload)} bytes exceeds {_MAX_PAYLOAD}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:
        raise ProtocolError(f"event batch is not valid msgpack: {type(e).__name__}") from None
    if type(batch) is not list or len(batch) < 2 or type(batch[1]) is not list:
        raise ProtocolError("KVEventBatch must be an array [ts, events, ...]")
    out: list[BlockEvent] = []
    view: list[EngineEvent] = []
    counts = [0, 0]  # events with int hashes, events refused
    other_media: set[str | None] = set()
    refusal = ""
    for raw in batch[1]:
        try:
            _decode_event(raw, out, view, counts, other_media, all_media, engine)
        except ProtocolError as e:  # this event only: the rest of the batch is kept
            counts[1] += 1
            refusal = refusal or str(e)
    return DecodedBatch(out, counts[0], frozenset(other_media), view, counts[1], refusal)


def _decode_event(raw: Any, out: list[BlockEvent], view: list[EngineEvent], counts: list[int],
                  other_media: set[str | None], all_media: bool, engine: bool) -> None:
    """Decode one event into ``out`` (the G2 view) and, with ``engine``, ``view``; validated whole before either
    is written, so a :class:`ProtocolError` leaves both as they were."""
    tag = raw[0] if type(raw) is list and raw else raw.get("type") if type(raw) is dict else None
    if tag == "AllBlocksCleared":
        out.append(BlockEvent("cleared"))
        if engine:
            view.append(EngineEvent("cleared"))
        return
    names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else None
    if names is None:
        raise ProtocolError(f"unknown KV event type {tag!r:.40}")
    f = _fields(raw, names)
    medium = f.get("medium")
    if medium is not None and type(medium) is not str:
        raise ProtocolError("medium must be a string or nil")
    hashes = f.get("block_hashes")
    if type(hashes) is not list:
        raise ProtocolError("block_hashes must be an array")
    parent = f.get("parent_block_hash") if tag == "BlockStored" else None
    # Validated before the medium filter, so a bad value is malformed on every medium.
    converted, ints = _hashes(hashes + ([] if parent is None else [parent]), engine)
    # (without the engine view, an event with int hashes is only counted: own and parent_b go unused)
    own, parent_b = converted[:len(hashes)], (None if parent is None or not converted else converted[-1])
    group = f.get("group_idx") if type(raw) is dict else None  # (array-tagged releases had no groups)
    if group is not None and (type(group) is not int or not 0 <= group < 1 << 16):
        raise ProtocolError("group_idx must be a small non-negative int or nil")
    if engine and tag == "BlockStored":
        size, lora = f.get("block_size"), f.get("lora_id")
        view.append(EngineEvent("stored", medium, own, parent_b, _token_ids(f.get("token_ids")),
                                size if type(size) is int and 0 < size <= 1 << 20 else None,
                                lora if type(lora) is int else None, group))
    elif engine:
        view.append(EngineEvent("removed", medium, own, group=group))
    if not all_media and medium != G2_MEDIUM:
        other_media.add(medium)
    elif ints:
        counts[0] += 1
    elif tag == "BlockStored":
        out.append(BlockEvent("stored", own, parent_b))
    else:
        out.append(BlockEvent("removed", own))
