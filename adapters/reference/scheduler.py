"""The leader's scheduler: which request does what this step, as a list of :class:`StepOp` for every rank.

One request goes through::

    admitted ──► onboard (G1 hit, G2 hit) ──► remote lookup ──► loading ──► prefill ──► decode ──► done
                                               (paused: test knob)    └─ failed/invalid: recompute

* **Admission** needs G1 blocks for the whole request (prompt + new tokens);
  requests wait in arrival order until G1 has them. G1 prefix hits are
  referenced in place; the next blocks are looked up in the leader's own G2
  and onboarded by every rank (each from its own pool; the ranks agree on
  the common prefix).
* **Remote**: with ``cache="all"`` and a target client, the blocks past the
  local prefix are looked up in the registry and loaded straight into G2
  landing slots (``start_load``); ``get_finished``/``invalid_block_ids`` are
  polled every step, never waited on. The loaded prefix is onboarded into G1
  and, with the prompt's other new blocks, written through to G2 after the
  first token (so this worker can share it in turn); whatever failed is
  recomputed. Landing slots of a failed load sit out ``quarantine_s`` before
  reuse: a READ the client gave up on could still be landing. The failed
  load's source sits out ``failed_source_cooldown_s``: requests matching it
  meanwhile recompute at once (``remote_reason="source_cooling_down"``).
* **Prefill** runs ``prefill_chunk`` tokens per step per request; the last
  prompt token's logits give the first token (TTFT). Full prompt blocks are
  then made findable in G1 and written through to G2. **Decode** is one token
  per step. Requests that can run share a step (one forward each).

The last prompt token is always computed (its logits pick the first token),
so at most ``(len(prompt) - 1) // tokens_per_block`` blocks come from caches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from remote_g2.errors import RequestRejected
from remote_g2.identity.hashing import chain_block_hashes

from ..failed_sources import FailedSources
from ..landing_slots import LandingSlots, valid_prefix
from .kv_cache import G1BlockManager
from .messages import EngineResult, EngineSubmit, StepOp

__all__ = ["Scheduler", "Request"]

log = logging.getLogger("remote_g2.adapters.reference.scheduler")


@dataclass
class Request:
    """The leader's state of one request."""

    sub: EngineSubmit
    hashes: list[bytes]  # every full prompt block
    reusable: int  # leading blocks a cache may supply
    t_admit: float
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV sits in G1
    state: str = "new"
    tokens: list[int] = field(default_factory=list)
    logits: list[bytes] = field(default_factory=list)
    t_first: float = 0.0
    blocks_g1: int = 0
    blocks_g2: int = 0
    blocks_remote: int = 0
    blocks_remote_failed: int = 0
    remote_reason: str = ""
    remote_error: str = ""  # why its remote load failed (the target client's words)
    source: str | None = None  # the worker its remote load came from
    load_lo: int = 0
    slots: list[int] = field(default_factory=list)
    t_load: float = 0.0
    load_s: float = 0.0
    resume_at: float = 0.0
    started: bool = False  # its first forward was planned (ranks hold a working cache)

    @property
    def prompt(self) -> list[int]:
        return self.sub.prompt


class Scheduler:
    """Plans steps on the leader. ``target`` is the target client or None; ``g2_has(h)`` asks the leader's G2."""

    def __init__(self, *, tokens_per_block: int, g1_blocks: int, landing_slots: range, block_bytes: int,
                 tp_size: int, target: Any, g2_has: Callable[[bytes], bool], prefill_chunk: int = 256,
                 quarantine_s: float = 30.0, failed_source_cooldown_s: float = 30.0) -> None:
        self.tpb = tokens_per_block
        self.g1 = G1BlockManager(g1_blocks)
        self._landing = LandingSlots(landing_slots, quarantine_s=quarantine_s)
        self._failed_sources = FailedSources(failed_source_cooldown_s)
        self.block_bytes, self.tp_size = block_bytes, tp_size
        self.target = target
        self._g2_has = g2_has
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.finished: dict[str, EngineResult] = {}
        self.remote_lookups = 0
        self.blocks_remote = 0
        self.blocks_remote_failed = 0

    # -- intake ---------------------------------------------------------------------------

    def submit(self, sub: EngineSubmit, vocab_size: int, max_positions: int) -> None:
        """Queue a request; :class:`RequestRejected` (answered as ``ERR``) for one the engine can never run."""
        if sub.request_id in self.running or sub.request_id in self.finished or \
                any(r.sub.request_id == sub.request_id for r in self.waiting):
            raise RequestRejected(f"request id {sub.request_id!r} is already in use")
        if not sub.prompt:
            raise RequestRejected("empty prompt")
        if max(sub.prompt) >= vocab_size:
            raise RequestRejected(f"token ids must be < {vocab_size}")
        need = len(sub.prompt) + sub.max_new_tokens - 1
        if need > max_positions:
            raise RequestRejected(f"prompt + max_new_tokens - 1 = {need} exceeds the model's {max_positions} positions")
        blocks = -(-need // self.tpb)
        if blocks > self.g1.num_blocks:
            raise RequestRejected(f"request needs {blocks} G1 blocks, the engine has {self.g1.num_blocks}")
        hashes = chain_block_hashes(sub.prompt, self.tpb)
        self.waiting.append(Request(sub, hashes, (len(sub.prompt) - 1) // self.tpb, time.perf_counter()))

    def take_results(self, ids: list[str]) -> list[EngineResult]:
        keys = ids or list(self.finished)
        return [self.finished.pop(k) for k in keys if k in self.finished]

    def paused(self) -> list[str]:
        return [r.sub.request_id for r in self.running.values() if r.state == "paused"]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning -------------------------------------------------------------------------

    def plan(self) -> list[StepOp]:
        """This step's operations. Loads that finished are landed first, then admissions, then forwards."""
        ops: list[StepOp] = []
        self._poll_loads(ops)
        self._start_paused_loads()
        self._admit(ops)
        for req in list(self.running.values()):
            if req.state == "prefill":
                n = min(self.prefill_chunk, len(req.prompt) - req.computed)
                ops.append(self._forward(req, req.prompt[req.computed:req.computed + n]))
            elif req.state == "decode":
                ops.append(self._forward(req, [req.tokens[-1]]))
        return ops

    def _forward(self, req: Request, token_ids: list[int]) -> StepOp:
        first = not req.started
        req.started = True
        capacity = len(req.prompt) + req.sub.max_new_tokens - 1
        return StepOp("forward", req.sub.request_id, token_ids, req.computed, capacity if first else 0, req.blocks)

    def _admit(self, ops: list[StepOp]) -> None:
        while self.waiting:
            req = self.waiting[0]
            sub = req.sub
            need = -(-(len(sub.prompt) + sub.max_new_tokens - 1) // self.tpb)
            hits = self.g1.match(req.hashes[:req.reusable]) if sub.cache != "none" else []
            if need - len(hits) > self.g1.available():
                self.g1.release(hits)
                return  # G1 is full: wait (arrival order) for running requests to finish
            self.waiting.popleft()
            req.blocks = hits + self.g1.allocate(need - len(hits))
            req.blocks_g1 = len(hits)
            self.running[sub.request_id] = req
            lo = len(hits)
            g2 = 0
            if sub.cache != "none":
                while lo + g2 < req.reusable and self._g2_has(req.hashes[lo + g2]):
                    g2 += 1
            if g2:
                req.state = "onboard"
                ops.append(StepOp("onboard", sub.request_id, blocks=req.blocks[lo:lo + g2],
                                  hashes=req.hashes[lo:lo + g2]))
            else:
                self._after_local(req, lo)

    def onboarded(self, request_id: str, blocks: int) -> None:
        """Every rank onboarded ``blocks`` G2 blocks (the agreed count) for the request."""
        req = self.running[request_id]
        req.blocks_g2 = blocks
        self._after_local(req, req.blocks_g1 + blocks)

    def _after_local(self, req: Request, local: int) -> None:
        """``local`` leading blocks are in G1: go remote for more, or straight to prefill."""
        req.computed = local * self.tpb
        req.state = "prefill"
        if req.sub.cache != "all" or local >= req.reusable:
            return
        if self.target is None:
            req.remote_reason = "target_disabled"
            return
        self.remote_lookups += 1
        match = self.target.lookup(req.hashes[local:req.reusable])
        req.remote_reason = match.reason
        if match.matched and match.worker_id and self._failed_sources.remaining(match.worker_id) > 0:
            req.remote_reason = "source_cooling_down"  # a load from it failed moments ago: recompute now
            return
        req.source = match.worker_id
        n = min(match.matched, self._landing.available())
        if n <= 0:
            if match.matched:
                req.remote_reason = "no_landing_slot"
            return
        req.load_lo = local
        req.slots = self._landing.take(n)
        req.state = "paused"
        req.resume_at = time.perf_counter() + req.sub.pause_after_lookup_ms / 1000
        self._start_paused_loads()

    def _start_paused_loads(self) -> None:
        now = time.perf_counter()
        for req in self.running.values():
            if req.state == "paused" and now >= req.resume_at:
                lo, n = req.load_lo, len(req.slots)
                req.state, req.t_load = "loading", time.perf_counter()
                self.target.start_load(req.sub.request_id, req.hashes[lo:lo + n], req.slots)

    def _poll_loads(self, ops: list[StepOp]) -> None:
        if self.target is None:
            return
        done, failed = self.target.get_finished()
        invalid = self.target.invalid_block_ids()
        why = self.target.failure_reasons() if failed else {}
        for rid in sorted(done | failed):
            req = self.running.get(rid)
            if req is None or req.state != "loading":
                log.warning("target reported request %r it is not loading", rid)
                continue
            good = valid_prefix(req.slots, invalid) if rid in done else 0
            req.load_s = time.perf_counter() - req.t_load
            lo = req.load_lo
            if good:
                ops.append(StepOp("land", rid, blocks=req.blocks[lo:lo + good], slots=req.slots[:good],
                                  hashes=req.hashes[lo:lo + good]))
            req.blocks_remote, req.blocks_remote_failed = good, len(req.slots) - good
            self.blocks_remote += good
            self.blocks_remote_failed += len(req.slots) - good
            if rid in done:
                # A landed slot is copied out by this step's own ``land``, before any later load can use it.
                self._landing.give_back(req.slots)
            else:
                self._landing.quarantine(req.slots)
                req.remote_error = why.get(rid, "the load failed")[:4096]
                if req.source:
                    self._failed_sources.note_failure(req.source, rid)
            req.slots = []
            req.computed = (lo + good) * self.tpb
            req.state = "prefill"

    # -- results of a step ----------------------------------------------------------------

    def forwarded(self, op: StepOp, logits: torch.Tensor) -> list[StepOp]:
        """The leader's logits of a ``forward``; returns ops for the next step (write-through, finish)."""
        req = self.running[op.request_id]
        req.computed = op.start_pos + len(op.token_ids)
        if req.state == "prefill" and req.computed < len(req.prompt):
            return []
        row = logits[-1]
        req.tokens.append(int(torch.argmax(row)))
        req.logits.append(row.contiguous().numpy().astype("<f4").tobytes())
        later: list[StepOp] = []
        if req.state == "prefill":
            req.t_first = time.perf_counter()
            req.state = "decode"
            if req.sub.cache != "none":
                full = len(req.prompt) // self.tpb
                for i in range(full):
                    self.g1.commit(req.blocks[i], req.hashes[i])
                # Write-through of every block G2 did not supply: landed remote blocks and computed ones.
                lo = req.blocks_g1 + req.blocks_g2
                if full > lo:
                    later.append(StepOp("store", op.request_id, blocks=req.blocks[lo:full], hashes=req.hashes[lo:full]))
        if len(req.tokens) >= req.sub.max_new_tokens:
            later.append(self._finish(req, ""))
        return later

    def _finish(self, req: Request, error: str) -> StepOp:
        rid = req.sub.request_id
        now = time.perf_counter()
        self.running.pop(rid, None)
        self.g1.release(req.blocks)
        self.finished[rid] = EngineResult(
            request_id=rid, ok=not error, error=error, tokens=req.tokens, logits=b"".join(req.logits),
            ttft_s=(req.t_first or now) - req.t_admit, total_s=now - req.t_admit, prompt_blocks=len(req.hashes),
            blocks_g1=req.blocks_g1, blocks_g2=req.blocks_g2, blocks_remote=req.blocks_remote,
            blocks_remote_failed=req.blocks_remote_failed,
            blocks_computed=len(req.hashes) - req.blocks_g1 - req.blocks_g2 - req.blocks_remote,
            bytes_remote=req.blocks_remote * self.block_bytes * self.tp_size, load_s=req.load_s,
            remote_reason=req.remote_reason, remote_error=req.remote_error)
        return StepOp("finish", rid)

    def fail_all(self, error: str) -> list[StepOp]:
        """Finish every request with ``error`` (shutdown); returns the ``finish`` ops."""
        ops = [self._finish(req, error) for req in list(self.running.values())]
        while self.waiting:
            req = self.waiting.popleft()
            self.running[req.sub.request_id] = req
            self._finish(req, error)
        return ops
