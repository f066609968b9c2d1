"""What the transfer benchmark's source and target ranks share: layout, hashes, bytes, files, the recording adapter.

* :func:`make_layout` — an HND layout of ``block_kib`` KiB per rank-slice
  (8 layers x K/V x 2 kv heads x ``block_kib / 4`` tokens x 64 dims x 2 bytes);
* :func:`hash_of` — the ``i``-th hash of a configuration (namespaced by block
  size, so two configurations never share a registry entry);
* :func:`rank_stream` — the bytes source rank ``r`` holds: hash ``i`` is
  ``stream[i * block_bytes:(i + 1) * block_bytes]``, pseudo-random per (rank,
  block size), so a block read from the wrong rank or slot never matches;
* :class:`RecordingNixl` — the ``nixl`` transfer adapter, unchanged, plus a
  timestamp for every call and the descriptors of every READ (so the raw
  baseline re-issues exactly what the target client planned). The target
  ranks select it with ``TargetConfig(transfer="bench.transfer.transfer_procs.common:RecordingNixl")``.

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every
process on the machine), so the bench can line up events of different ranks.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_json  # (re-exported: the ranks write their files with it)
from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint

__all__ = ["make_layout", "fingerprint_for", "hash_of", "rank_stream", "write_json", "read_json", "RecordingNixl",
           "EVENTS", "record", "raw_agent_name"]

NUM_LAYERS, KV, HEADS_PER_RANK, HEAD_DIM, DTYPE_BYTES = 8, 2, 2, 64, 2
_TOKEN_BYTES = NUM_LAYERS * KV * HEADS_PER_RANK * HEAD_DIM * DTYPE_BYTES  # 4 KiB per token per rank


def make_layout(block_kib: int, num_blocks: int) -> BlockLayout:
    """A rank's layout with ``block_kib`` KiB blocks (a multiple of 4), no padding."""
    if block_kib <= 0 or (block_kib * 1024) % _TOKEN_BYTES:
        raise ValueError(f"block size {block_kib} KiB is not a positive multiple of {_TOKEN_BYTES // 1024} KiB")
    return BlockLayout(num_blocks=num_blocks, block_bytes=block_kib * 1024, num_layers=NUM_LAYERS, kv=KV,
                       num_kv_heads=HEADS_PER_RANK, tokens_per_block=block_kib * 1024 // _TOKEN_BYTES,
                       head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES, order="HND")


def fingerprint_for(layout: BlockLayout, tp: int) -> LayoutFingerprint:
    return LayoutFingerprint(model_id="bench-transfer", dtype="bf16", tokens_per_block=layout.tokens_per_block,
                             kv_layout="HND", num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads * tp,
                             head_dim=layout.head_dim, tp_size=tp)


def hash_of(block_kib: int, i: int) -> bytes:
    """The ``i``-th block hash of the ``block_kib`` configuration (a u64, big-endian)."""
    return ((0x7E57 << 48) | (block_kib << 24) | i).to_bytes(8, "big")


def rank_stream(rank: int, block_kib: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` source rank ``rank`` holds for the ``block_kib`` configuration (hash i at i * block_bytes)."""
    return np.random.default_rng([0xB17E, rank, block_kib]).integers(0, 256, nbytes, dtype=np.uint8)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# -- timestamps -----------------------------------------------------------------------

EVENTS: list[tuple] = []  # (what, t0, t1, extra) in time.monotonic() seconds; list.append is atomic
_events_on = threading.Event()
_events_on.set()


def record(what: str, t0: float, t1: float | None = None, extra: Any = None) -> None:
    if _events_on.is_set():
        EVENTS.append((what, t0, t0 if t1 is None else t1, extra))


class RecordingNixl(NixlTransfer):
    """:class:`NixlTransfer` that timestamps every call and keeps the descriptors of every READ.

    ``reads[total_bytes]`` is the last ``(peer, local, remote, nbytes)`` READ
    of that many bytes; ``peers`` the metadata loaded per agent name.
    """

    instances: list[RecordingNixl] = []

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.reads: dict[int, tuple[str, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.peer_metadata: dict[str, bytes] = {}
        self._done_seen: set[int] = set()
        RecordingNixl.instances.append(self)

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        t0 = time.monotonic()
        super().add_peer(agent_name, metadata)
        record("add_peer", t0, time.monotonic(), agent_name)
        self.peer_metadata[agent_name] = metadata

    def start_read(self, agent_name, local_addr, remote_addr, nbytes, **kw):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        h = super().start_read(agent_name, local_addr, remote_addr, nbytes, **kw)
        t1 = time.monotonic()
        total = int(np.asarray(nbytes, dtype=np.uint64).sum())
        record("start_read", t0, t1, [len(nbytes), total, h.state])
        # The plan's arrays are read-only and never reused: keeping references costs nothing.
        self.reads[total] = (agent_name, local_addr, remote_addr, nbytes)
        return h

    def poll(self, handle):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        state = super().poll(handle)
        if state != "pending" and id(handle) not in self._done_seen:
            self._done_seen.add(id(handle))
            record("poll_final", t0, time.monotonic(), state)
        return state

    def release(self, handle):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        super().release(handle)
        self._done_seen.discard(id(handle))
        record("release_xfer", t0, time.monotonic())


def raw_agent_name(worker_id: str, rank: int) -> str:
    """The bare NIXL agent source rank ``rank`` keeps on its pool's memory for the raw baseline (source_rank.py)."""
    return f"bench-raw-src-{worker_id}-tp{rank}"
