"""The reference engine's messages: its request API (clients → rank 0) and its step plan (rank 0 → ranks).

Both travel in the project's envelope (``remote_g2.protocol.wire``: msgpack, typed
dataclasses, validated on receipt — a malformed frame gets ``ERR`` on the
API socket and is dropped and logged on the step channel). ``docs/protocol.md``
lists them under "Reference engine".

API (rank 0's ROUTER, TCP or IPC, served by :class:`~.server.EngineServer`):
``engine_submit`` queues a generation and answers at once; ``engine_results``
hands back finished ones; ``engine_stats``, ``engine_evict`` (drop blocks
from G2 on every rank, as memory pressure would) and ``engine_shutdown``.

Step plan (one PUSH per rank > 0, IPC, one-way): ``engine_step`` carries the
operations every rank performs, in order, on its own shard; see
:class:`StepOp`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from remote_g2.protocol.messages import message
from remote_g2.protocol.schema import Limits

__all__ = [
    "CacheMode",
    "EngineAccepted",
    "EngineEvict",
    "EngineEvictReply",
    "EngineResult",
    "EngineResults",
    "EngineResultsReply",
    "EngineShutdown",
    "EngineStats",
    "EngineStatsReply",
    "EngineStep",
    "EngineSubmit",
    "StepOp",
]

CacheMode = Literal["all", "local", "none"]
"""Which prefix caches a request may use: ``all`` (G1, G2, remote G2), ``local``
(G1 and G2 only), ``none`` (recompute everything, store nothing: the baseline)."""

_ReqId = Annotated[str, Limits(min_len=1, max_len=128)]
_Tokens = Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=8192)]
_Ids = Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=8192)]
_Hashes = Annotated[list[Annotated[bytes, Limits(min_len=1, max_len=32)]], Limits(max_len=8192)]
_Count = Annotated[int, Limits(ge=0)]
_Secs = Annotated[float, Limits(ge=0)]


@dataclass(frozen=True, slots=True)
class EngineAccepted:
    """``queued``: requests admitted and not finished, this one included."""

    queued: _Count


@message("engine_submit", reply=EngineAccepted)
@dataclass(frozen=True, slots=True)
class EngineSubmit:
    """Generate ``max_new_tokens`` greedy tokens after ``prompt``; ``cache`` says which prefix caches to use.

    ``pause_after_lookup_ms`` is a fault-injection knob for tests: the leader
    holds the request that long between its remote lookup and its load (the
    window in which a source may evict what the registry just promised).
    """

    request_id: _ReqId
    prompt: _Tokens
    max_new_tokens: Annotated[int, Limits(ge=1, le=4096)]
    cache: CacheMode = "all"
    pause_after_lookup_ms: Annotated[int, Limits(ge=0, le=60_000)] = 0


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One finished request: its tokens, the float32 logits each was picked from, and where its KV came from.

    ``logits`` is ``len(tokens) × vocab`` little-endian float32. ``ttft_s`` is
    admission → first token on the leader. ``blocks_*`` count prompt blocks
    by origin (``blocks_computed`` includes blocks whose remote load failed,
    ``blocks_remote_failed``). ``load_s`` is start_load → get_finished of the
    remote load (0 without one). ``remote_error`` says why a remote load
    failed (the target client's words: the source's ERR, a timeout, the
    transfer backend's error), "" when none did.
    """

    request_id: _ReqId
    ok: bool
    error: Annotated[str, Limits(max_len=2048)]
    tokens: _Tokens
    logits: Annotated[bytes, Limits(max_len=64 * 1024 * 1024)]
    ttft_s: _Secs
    total_s: _Secs
    prompt_blocks: _Count
    blocks_g1: _Count
    blocks_g2: _Count
    blocks_remote: _Count
    blocks_remote_failed: _Count
    blocks_computed: _Count
    bytes_remote: _Count
    load_s: _Secs
    remote_reason: Annotated[str, Limits(max_len=256)] = ""
    remote_error: Annotated[str, Limits(max_len=4096)] = ""


@dataclass(frozen=True, slots=True)
class EngineResultsReply:
    """``results``: the finished requests asked for (each handed out once)."""

    results: Annotated[list[EngineResult], Limits(max_len=1024)]


@message("engine_results", reply=EngineResultsReply)
@dataclass(frozen=True, slots=True)
class EngineResults:
    """Finished requests among ``request_ids`` (empty: any finished request)."""

    request_ids: Annotated[list[_ReqId], Limits(max_len=1024)] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineStatsReply:
    """The leader's view: sizes, cache contents, counters, whether the hooks run; ``paused``: ids held after lookup.

    ``g2_pinned`` is rank 0's count of pinned G2 blocks, ``g2_pinned_per_rank`` every rank's.
    """

    worker_id: Annotated[str, Limits(max_len=128)]
    tp_size: _Count
    model_id: Annotated[str, Limits(max_len=256)]
    source_enabled: bool
    target_enabled: bool
    source_endpoint: Annotated[str, Limits(max_len=256)]
    running: _Count
    finished: _Count
    g1_cached: _Count
    g2_cached: _Count
    g2_pinned: _Count
    g2_pinned_per_rank: Annotated[list[_Count], Limits(max_len=4096)]
    remote_lookups: _Count
    blocks_remote: _Count
    blocks_remote_failed: _Count
    paused: Annotated[list[_ReqId], Limits(max_len=1024)] = field(default_factory=list)


@message("engine_stats", reply=EngineStatsReply)
@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters (rank 0)."""


@dataclass(frozen=True, slots=True)
class EngineEvictReply:
    """How many of the hashes rank 0 dropped (pinned blocks stay; other ranks drop theirs)."""

    removed: _Count


@message("engine_evict", reply=EngineEvictReply)
@dataclass(frozen=True, slots=True)
class EngineEvict:
    """Drop these hashes from G2 on every rank, as memory pressure would (G1 copies stay)."""

    hashes: _Hashes


@message("engine_shutdown", reply=EngineAccepted)
@dataclass(frozen=True, slots=True)
class EngineShutdown:
    """Stop after the running requests fail; every rank shuts its hooks down and exits."""


StepKind = Literal["forward", "onboard", "land", "store", "evict", "finish", "gauges", "stop"]


@dataclass(frozen=True, slots=True)
class StepOp:
    """One operation every rank performs on its own shard, in plan order.

    * ``forward`` — run ``token_ids`` at ``start_pos`` for ``request_id``
      (``blocks``: its whole G1 block table; the first forward of a request
      also gathers its first ``start_pos`` tokens of KV from those blocks into
      a working cache of ``capacity`` tokens) and write the new KV into G1.
    * ``onboard`` — copy the longest G2-cached prefix of ``hashes`` into G1
      ``blocks``; the ranks agree (allgather) on the shortest such prefix.
    * ``land`` — remote blocks arrived in landing ``slots``: copy them into G1
      ``blocks`` (``hashes`` names them, for logs; they reach G2 with the
      request's write-through).
    * ``store`` — write-through: cache G1 ``blocks`` in G2 under ``hashes``.
    * ``evict`` — drop ``hashes`` from G2.
    * ``finish`` — drop ``request_id``'s working cache.
    * ``gauges`` — every rank's G2 pin count, gathered to every rank (for stats).
    * ``stop`` — leave the step loop.
    """

    kind: StepKind
    request_id: Annotated[str, Limits(max_len=128)] = ""
    token_ids: _Tokens = field(default_factory=list)
    start_pos: _Count = 0
    capacity: _Count = 0
    blocks: _Ids = field(default_factory=list)
    slots: _Ids = field(default_factory=list)
    hashes: _Hashes = field(default_factory=list)


@message("engine_step", reply=EngineAccepted)
@dataclass(frozen=True, slots=True)
class EngineStep:
    """Step ``seq`` (1, 2, … with no gap) of the leader's plan; rank > 0 never answers it."""

    seq: Annotated[int, Limits(ge=1)]
    ops: Annotated[list[StepOp], Limits(max_len=1024)]
